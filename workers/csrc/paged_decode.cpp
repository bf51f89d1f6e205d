// Decode attention straight from the paged KV cache: no gathered copy of K and V.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// query [n, H, D], caches [slots, KVH, D], block_tables [n, W] int32, seq_lens [n] int32,
// out [n, H, D]. Row r attends keys [lo, seq_len) with lo = max(0, seq_len - window) when
// window > 0; key p lives in slot block_tables[r][p / bs] * bs + p % bs. A task is one row
// and a run of its KV heads (all of them unless rows are fewer than threads): each key's
// heads are read as one contiguous run.
void paged_decode(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                  const torch::Tensor& block_tables, const torch::Tensor& seq_lens, int64_t block_size,
                  double scale, int64_t window, torch::Tensor& out) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && key_cache.scalar_type() == torch::kFloat32 &&
              value_cache.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32, "int32 tables");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
              block_tables.is_contiguous() && seq_lens.is_contiguous() && out.is_contiguous(), "contiguous only");
  const int64_t n = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t KVH = key_cache.size(1), G = H / KVH, W = block_tables.size(1);
  const int64_t threads = at::get_num_threads();
  int64_t split = std::min<int64_t>(KVH, std::max<int64_t>(1, (threads + n - 1) / n));
  while (KVH % split) --split;
  const int64_t kv_per_task = KVH / split, h_per_task = kv_per_task * G;
  const float* q = query.data_ptr<float>();
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, n * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(h_per_task * D), m(h_per_task), l(h_per_task), logit(h_per_task * block_size);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / split, g0 = (task % split) * kv_per_task, h0 = g0 * G;
      const int64_t hi = lens[r];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, hi - window) : 0;
      const float* qr = q + (r * H + h0) * D;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t start = lo; start < hi;) {  // one block at a time
        const int64_t block = start / block_size;
        const int64_t stop = std::min<int64_t>(hi, (block + 1) * block_size);
        const int64_t nk = stop - start;
        const int64_t base = static_cast<int64_t>(bt[r * W + block]) * block_size + start % block_size;
        for (int64_t t = 0; t < nk; ++t) {
          const float* k = kc + ((base + t) * KVH + g0) * D;
          for (int64_t h = 0; h < h_per_task; ++h) {
            const float* qh = qr + h * D;
            const float* kh = k + (h / G) * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qh[d] * kh[d];
            logit[h * block_size + t] = dot * s;
          }
        }
        for (int64_t h = 0; h < h_per_task; ++h) {  // one rescale per block and head
          float blk_max = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < nk; ++t) blk_max = std::max(blk_max, logit[h * block_size + t]);
          if (blk_max > m[h]) {
            const float c = std::exp(m[h] - blk_max);
            l[h] *= c;
            float* a = &acc[h * D];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] *= c;
            m[h] = blk_max;
          }
          for (int64_t t = 0; t < nk; ++t) {
            const float w = std::exp(logit[h * block_size + t] - m[h]);
            logit[h * block_size + t] = w;
            l[h] += w;
          }
        }
        for (int64_t t = 0; t < nk; ++t) {
          const float* v = vc + ((base + t) * KVH + g0) * D;
          for (int64_t h = 0; h < h_per_task; ++h) {
            const float w = logit[h * block_size + t];
            const float* vh = v + (h / G) * D;
            float* a = &acc[h * D];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += w * vh[d];
          }
        }
        start = stop;
      }
      for (int64_t h = 0; h < h_per_task; ++h) {
        float* oh = o + (r * H + h0 + h) * D;
        const float inv = 1.f / l[h];
        for (int64_t d = 0; d < D; ++d) oh[d] = acc[h * D + d] * inv;
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
