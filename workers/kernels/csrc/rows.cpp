// Row-wise ops that torch runs as several kernels, each a trip through memory and a dispatch:
// greedy argmax, rotary embedding, RMSNorm. Float32, CPU.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <cmath>
#include <limits>

namespace {

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, ": a float32 CPU tensor");
}

}  // namespace

// torch.argmax(x, -1) for a contiguous [rows, vocab]: the first maximum, a NaN beating
// everything (the first NaN wins). Two passes over a row that sits in L2: a vectorised max,
// then the first index that equals it; torch's argmax keeps an index per lane and runs ~6x
// slower on the LM head's [64, 32000].
torch::Tensor argmax_rows(const torch::Tensor& x) {
  check_f32(x, "argmax_rows");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) > 0, "argmax_rows: contiguous [rows, vocab]");
  const int64_t rows = x.size(0), vocab = x.size(1);
  auto out = torch::empty({rows}, torch::kInt64);
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = p + r * vocab;
      float m = -std::numeric_limits<float>::infinity();
      int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
      for (int64_t i = 0; i < vocab; ++i) {
        m = std::max(m, row[i]);
        nan |= row[i] != row[i];
      }
      int64_t at = 0;
      if (nan) {
        while (row[at] == row[at]) ++at;
      } else {
        while (row[at] != m) ++at;  // found: m is one of the row's values
      }
      o[r] = at;
    }
  });
  return out;
}

// Rotate-half RoPE in place on q [tokens, Hq, D] and k [tokens, Hk, D] (views of the fused
// qkv output: heads contiguous, tokens strided). Per pair (a, b) = (x[i], x[i + D/2]):
//   x[i] = a * cos[i] - b * sin[i],   x[i + D/2] = b * cos[i + D/2] + a * sin[i + D/2]
// which is the torch path's x * cos + rotate_half(x) * sin to the bit: (-b) * s == -(b * s)
// and u + (-v) == u - v in IEEE arithmetic, as long as nothing fuses the multiply and add.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void rope_(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& cos, const torch::Tensor& sin,
           const torch::Tensor& positions) {
  for (const auto* t : {&q, &k}) {
    check_f32(*t, "rope_");
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "rope_: [tokens, heads, head_dim] with heads contiguous");
  }
  check_f32(cos, "rope_ cos");
  check_f32(sin, "rope_ sin");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == q.size(2), "rope_: [positions, D] tables");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() &&
              positions.numel() == q.size(0) && q.size(0) == k.size(0), "rope_: one int64 position per token");
  const int64_t tokens = q.size(0), D = q.size(2), half = D / 2, max_pos = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rope_: position ", pos[t], " outside the table");
  const float* ct = cos.data_ptr<float>();
  const float* st = sin.data_ptr<float>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (torch::Tensor* t : {&q, &k}) {
      float* base = t->data_ptr<float>();
      const int64_t heads = t->size(1), stride = t->stride(0);
      for (int64_t i = begin; i < end; ++i) {
        const float* c = ct + pos[i] * D;
        const float* s = st + pos[i] * D;
        for (int64_t h = 0; h < heads; ++h) {
          float* x = base + i * stride + h * D;
#pragma omp simd
          for (int64_t j = 0; j < half; ++j) {
            const float a = x[j], b = x[j + half];
            x[j] = a * c[j] - b * s[j];
            x[j + half] = b * c[j + half] + a * s[j + half];
          }
        }
      }
    }
  });
}
#pragma GCC pop_options

// weight * (x * rsqrt(mean(x^2) + eps)) per row of a contiguous [tokens, hidden], in the torch
// path's order (two rounded multiplies, 1 / sqrt); the mean is summed in double, so it can
// differ from torch's in the last bit.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_f32(x, "rms_norm");
  check_f32(weight, "rms_norm weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: contiguous [tokens, hidden] and [hidden]");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  auto out = torch::empty_like(x);
  const float* p = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = p + t * hidden;
      double ss = 0.0;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < hidden; ++i) ss += static_cast<double>(row[i] * row[i]);
      const float mean = static_cast<float>(ss / hidden);
      const float r = 1.f / std::sqrt(mean + static_cast<float>(eps));
      float* y = o + t * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) y[i] = w[i] * (row[i] * r);
    }
  });
  return out;
}
