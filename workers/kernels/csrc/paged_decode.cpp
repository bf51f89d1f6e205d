// Decode attention straight from the paged KV cache: no gathered copy of K and V.
//
// Built with -fopenmp: at::parallel_for is a header template, and without the flag its
// OpenMP pragma compiles away and every call runs on one thread (the first version did,
// at half the speed; tests/model/test_cpu_kernels.py now checks that both threads work).
#include "kernels.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// D > 0: the head size fixed at compile time (fully unrolled, no loop tails); 0: runtime d.
template <int64_t D>
inline int64_t dim(int64_t d) { return D > 0 ? D : d; }

template <int64_t D>
inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < dim<D>(d); ++i) s += a[i] * b[i];
  return s;
}

template <int64_t D>
inline void axpy(float* __restrict y, const float* __restrict x, float w, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < dim<D>(d); ++i) y[i] += w * x[i];
}

template <int64_t D>
inline void scale_by(float* __restrict y, float c, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < dim<D>(d); ++i) y[i] *= c;
}

// Fetch `n` floats into the cache ahead of use, one 64-byte line at a time.
inline void prefetch(const float* p, int64_t n) {
  for (int64_t x = 0; x < n; x += 16) __builtin_prefetch(p + x);
}

struct Args {
  const float* q;          // [n, H, d], rows q_stride apart (a view of the fused qkv)
  const float* kc;         // [slots, KVH, d]
  const float* vc;         // [slots, KVH, d]
  const int32_t* tables;   // [n, W]
  const int32_t* lens;     // [n]
  float* out;              // [n, H, d]
  int64_t q_stride, n, H, d, KVH, W, block_size, window;
  float scale;
};

// Row r attends keys [lo, seq_len) with lo = max(0, seq_len - window) when window > 0; key p
// lives in slot tables[r][p / bs] * bs + p % bs. A task is one row and a run of its KV heads
// (all of them unless rows are fewer than threads), so each key's heads are read as one
// contiguous run. Blocks are visited in order with an online softmax, one rescale per block.
template <int64_t D>
void attend(const Args& a) {
  const int64_t d = dim<D>(a.d), G = a.H / a.KVH, bs = a.block_size;
  const int64_t threads = at::get_num_threads();
  int64_t split = std::min<int64_t>(a.KVH, std::max<int64_t>(1, (threads + a.n - 1) / a.n));
  while (a.KVH % split) --split;
  const int64_t kv_per_task = a.KVH / split, h_per_task = kv_per_task * G;
  const int64_t key_stride = a.KVH * d;  // floats from one key's heads to the next key's
  const int64_t span = kv_per_task * d;  // floats of one key a task reads
  at::parallel_for(0, a.n * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(h_per_task * d), m(h_per_task), l(h_per_task), logit(h_per_task * bs);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / split, g0 = (task % split) * kv_per_task, h0 = g0 * G;
      const int64_t hi = a.lens[r];
      const int64_t lo = a.window > 0 ? std::max<int64_t>(0, hi - a.window) : 0;
      const float* qr = a.q + r * a.q_stride + h0 * d;
      const int32_t* table = a.tables + r * a.W;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t start = lo; start < hi;) {
        const int64_t block = start / bs;
        const int64_t stop = std::min<int64_t>(hi, (block + 1) * bs);
        const int64_t nk = stop - start;
        const int64_t base = static_cast<int64_t>(table[block]) * bs + start % bs;
        const float* kb = a.kc + base * key_stride + g0 * d;
        const float* vb = a.vc + base * key_stride + g0 * d;
        // The next block is fetched while this one computes: a core's hardware prefetchers
        // stop at page boundaries, and blocks sit anywhere in the cache.
        const float* next_k = nullptr;
        const float* next_v = nullptr;
        if (stop < hi) {
          const int64_t next = static_cast<int64_t>(table[block + 1]) * bs;
          next_k = a.kc + next * key_stride + g0 * d;
          next_v = a.vc + next * key_stride + g0 * d;
        }
        for (int64_t t = 0; t < nk; ++t) {
          const float* k = kb + t * key_stride;
          if (next_k) prefetch(next_k + t * key_stride, span);
          for (int64_t j = 0; j < kv_per_task; ++j)
            for (int64_t g = 0; g < G; ++g) {
              const int64_t h = j * G + g;
              logit[h * bs + t] = dot<D>(qr + h * d, k + j * d, d) * a.scale;
            }
        }
        for (int64_t h = 0; h < h_per_task; ++h) {
          float* lg = &logit[h * bs];
          float blk_max = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < nk; ++t) blk_max = std::max(blk_max, lg[t]);
          if (blk_max > m[h]) {
            const float c = std::exp(m[h] - blk_max);
            l[h] *= c;
            scale_by<D>(&acc[h * d], c, d);
            m[h] = blk_max;
          }
          float sum = 0.f;
          for (int64_t t = 0; t < nk; ++t) {
            lg[t] = std::exp(lg[t] - m[h]);
            sum += lg[t];
          }
          l[h] += sum;
        }
        for (int64_t t = 0; t < nk; ++t) {
          const float* v = vb + t * key_stride;
          if (next_v) prefetch(next_v + t * key_stride, span);
          for (int64_t j = 0; j < kv_per_task; ++j)
            for (int64_t g = 0; g < G; ++g) {
              const int64_t h = j * G + g;
              axpy<D>(&acc[h * d], v + j * d, logit[h * bs + t], d);
            }
        }
        start = stop;
      }
      for (int64_t h = 0; h < h_per_task; ++h) {
        float* oh = a.out + (r * a.H + h0 + h) * d;
        const float inv = 1.f / l[h];
        for (int64_t i = 0; i < d; ++i) oh[i] = acc[h * d + i] * inv;
      }
    }
  });
}

}  // namespace

// query [n, H, D] (rows may be strided), caches [slots, KVH, D], block_tables [n, W] int32, seq_lens [n] int32,
// out [n, H, D].
void paged_decode(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                  const torch::Tensor& block_tables, const torch::Tensor& seq_lens, int64_t block_size,
                  double scale, int64_t window, torch::Tensor& out) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && key_cache.scalar_type() == torch::kFloat32 &&
              value_cache.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32, "int32 tables");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2), "query: heads contiguous in each row");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && block_tables.is_contiguous() &&
              seq_lens.is_contiguous() && out.is_contiguous(), "contiguous only");
  const Args a{query.data_ptr<float>(), key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
               block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), out.data_ptr<float>(),
               query.stride(0), query.size(0), query.size(1), query.size(2), key_cache.size(1), block_tables.size(1),
               block_size, window, static_cast<float>(scale)};
  switch (a.d) {  // the common head sizes unrolled; any other runs the generic loop
    case 64: attend<64>(a); break;
    case 128: attend<128>(a); break;
    default: attend<0>(a);
  }
}
