// The CPU kernels workers/kernels/cpu_kernels.py compiles into one extension module (module.cpp).
#pragma once
#include <torch/extension.h>

// paged_decode.cpp: decode attention read straight from the paged KV cache.
void paged_decode(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                  const torch::Tensor& block_tables, const torch::Tensor& seq_lens, int64_t block_size,
                  double scale, int64_t window, torch::Tensor& out);

// rows.cpp: one pass per row where torch takes several ops (and as many trips through memory).
torch::Tensor argmax_rows(const torch::Tensor& x);
void rope_(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& cos, const torch::Tensor& sin,
           const torch::Tensor& positions);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// How many threads an at::parallel_for in this module really runs on.
int64_t parallel_threads();
