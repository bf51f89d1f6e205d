// Linear layers on 8-bit weights (int8 or FP8 e4m3) with one float32 scale per output row:
// out[m, n] = scale[n] * sum_k x[m, k] * w[n, k] (+ bias[n]).
//
// A decode step reads every weight once, so its time is the weights' bytes over the memory's
// bandwidth: 8-bit weights are a quarter of float32's. torch's `_weight_int8pack_mm` is 2-7x
// slower than float32 `F.linear` on the CPUs this runs on (bench/RESULTS.md), so this kernel
// converts weights to float in registers, 16 at a time where AVX-512 is compiled in, and
// multiplies four rows of x at once against each: near the cores' FMA peak, it beats MKL's
// float32 GEMM at every row count measured (1 to 512; handing MKL dequantized tiles did not).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <array>
#include <cmath>
#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

// e4m3fn bits -> float: 1 sign, 4 exponent (bias 7), 3 mantissa; exponent 0 is subnormal,
// 0x7F / 0xFF are NaN (never stored: quantization saturates at +-448).
std::array<float, 256> make_fp8_table() {
  std::array<float, 256> table{};
  for (int bits = 0; bits < 256; ++bits) {
    const int exponent = (bits >> 3) & 0xF, mantissa = bits & 0x7;
    float value = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
    if ((bits & 0x7F) == 0x7F) value = NAN;
    table[bits] = (bits & 0x80) ? -value : value;
  }
  return table;
}

const std::array<float, 256> kFp8 = make_fp8_table();

// Rows of x taken together against one weight row: each weight element is converted once and
// used this many times.
constexpr int64_t kRowsPerPass = 4;

template <typename W>
inline float to_float(W w);
template <>
inline float to_float<int8_t>(int8_t w) { return static_cast<float>(w); }
template <>
inline float to_float<uint8_t>(uint8_t w) { return kFp8[w]; }

#ifdef __AVX512F__
// 16 weights -> 16 floats. FP8 (e4m3) without a table: the 7 magnitude bits shifted to a
// float's exponent and mantissa fields and the exponent re-biased (+120), subnormals
// (exponent 0: mantissa x 2^-9) converted apart, then the sign bit; the same values as the
// table, exactly.
template <typename W>
inline __m512 load16(const W* p);
template <>
inline __m512 load16<int8_t>(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
template <>
inline __m512 load16<uint8_t>(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i magnitude = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(magnitude, 20), _mm512_set1_epi32(120 << 23));
  const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x7))),
                                         _mm512_set1_ps(1.0f / 512.0f));
  const __mmask16 is_subnormal = _mm512_cmplt_epi32_mask(magnitude, _mm512_set1_epi32(8));
  const __m512i value = _mm512_mask_blend_epi32(is_subnormal, normal, _mm512_castps_si512(subnormal));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(value, sign));
}
#endif

// out rows [0, R) x columns [n0, n1) of a pass over R <= kRowsPerPass rows of x.
template <typename W, int R>
void dot_rows(const float* x, int64_t ldx, const W* w, int64_t k, const float* scale, const float* bias,
              float* out, int64_t ldo, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* row = w + n * k;
    float sums[R] = {};
    int64_t i = 0;
#ifdef __AVX512F__
    // Two independent accumulators a row (four for one row): an FMA's latency is hidden.
    constexpr int kChains = R == 1 ? 4 : 2;
    __m512 acc[R][kChains];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kChains; ++c) acc[r][c] = _mm512_setzero_ps();
    for (; i + 16 * kChains <= k; i += 16 * kChains) {
      for (int c = 0; c < kChains; ++c) {
        const __m512 wf = load16<W>(row + i + 16 * c);
        for (int r = 0; r < R; ++r)
          acc[r][c] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * ldx + i + 16 * c), wf, acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512 total = acc[r][0];
      for (int c = 1; c < kChains; ++c) total = _mm512_add_ps(total, acc[r][c]);
      sums[r] = _mm512_reduce_add_ps(total);
    }
#endif
    for (int r = 0; r < R; ++r) {
      float sum = sums[r];
      for (int64_t t = i; t < k; ++t) sum += x[r * ldx + t] * to_float<W>(row[t]);
      out[r * ldo + n] = sum * scale[n] + (bias ? bias[n] : 0.0f);
    }
  }
}

template <typename W>
void w8_linear_impl(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scale,
                    const c10::optional<torch::Tensor>& bias, torch::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  const float* xp = x.data_ptr<float>();
  const W* wp = reinterpret_cast<const W*>(weight.data_ptr());
  const float* sp = scale.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  // The weight's rows split over threads; each pass of four rows of x goes over a thread's
  // rows (compute-bound from a few rows on: the weights' conversions and FMAs, not their bytes).
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    int64_t r = 0;
    for (; r + kRowsPerPass <= m; r += kRowsPerPass)
      dot_rows<W, kRowsPerPass>(xp + r * ldx, ldx, wp, k, sp, bp, op + r * ldo, ldo, n0, n1);
    const float* xr = xp + r * ldx;  // the rest in one more pass, not one a row
    float* orow = op + r * ldo;
    switch (m - r) {
      case 3: dot_rows<W, 3>(xr, ldx, wp, k, sp, bp, orow, ldo, n0, n1); break;
      case 2: dot_rows<W, 2>(xr, ldx, wp, k, sp, bp, orow, ldo, n0, n1); break;
      case 1: dot_rows<W, 1>(xr, ldx, wp, k, sp, bp, orow, ldo, n0, n1); break;
      default: break;
    }
  });
}

}  // namespace

// out [M, N] = (x [M, K] @ w [N, K]^T) * scale [N] (+ bias [N]); w int8 or FP8 e4m3 (stored
// as float8_e4m3fn), x float32 with unit stride in K, out float32 contiguous.
void w8_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scale,
               const c10::optional<torch::Tensor>& bias, torch::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1, "w8_linear: x [M, K] float32");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1), "w8_linear: w [N, K]");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == weight.size(0),
              "w8_linear: scale [N] float32");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) == weight.size(0),
              "w8_linear: out [M, N]");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == weight.size(0),
                "w8_linear: bias [N] float32");
  if (x.size(0) == 0) return;
  if (weight.scalar_type() == torch::kChar) {
    w8_linear_impl<int8_t>(x, weight, scale, bias, out);
  } else {
    TORCH_CHECK(weight.scalar_type() == at::ScalarType::Float8_e4m3fn, "w8_linear: w int8 or float8_e4m3fn");
    w8_linear_impl<uint8_t>(x, weight, scale, bias, out);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("w8_linear", &w8_linear); }
