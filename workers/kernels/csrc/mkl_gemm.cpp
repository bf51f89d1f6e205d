// Linear layers on MKL's packed-weight GEMM (cblas_sgemm_pack / cblas_sgemm_compute).
//
// torch.mm hands MKL a plain weight, and MKL packs it into its panel layout again on every
// call: a full extra pass over the weight, which a decode step (a few dozen rows against
// every weight of the model) pays in full. Packed once at load, a batch-64 decode step of
// the bench model runs ~12% faster. The symbols come from the MKL inside libtorch_cpu (x86
// builds); where they are missing this module does not load and torch.mm serves.
#include <torch/extension.h>

extern "C" {
size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k);
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha, const float* src,
                      int ld, float* dest);
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc);
}

namespace {
// mkl_cblas.h's enum values (its header is not shipped with torch).
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;
}  // namespace

// weight [N, K] (an nn.Linear weight, any strides) -> MKL's packed B for y = x W^T. `rows_hint`
// is the M MKL tunes the layout for; any M may use it.
torch::Tensor pack_weight(const torch::Tensor& weight, int64_t rows_hint) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.device().is_cpu(),
              "pack_weight: a float32 CPU [out, in] weight");
  const auto w = weight.contiguous();
  const int n = w.size(0), k = w.size(1);
  const size_t bytes = cblas_sgemm_pack_get_size(kBMatrix, rows_hint, n, k);
  auto packed = torch::empty({static_cast<int64_t>((bytes + 3) / 4)}, torch::kFloat32);
  cblas_sgemm_pack(kRowMajor, kBMatrix, kTrans, rows_hint, n, k, 1.0f, w.data_ptr<float>(), k,
                   packed.data_ptr<float>());
  return packed;
}

// out [M, N] = x [M, K] W^T (+ out's prior contents when accumulate): the packed weight from
// pack_weight. x rows may be strided; out must be contiguous.
void packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, torch::Tensor& out,
                   bool accumulate) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1, "packed_linear: x [M, K]");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0) && out.size(1) == n,
              "packed_linear: out [M, N] contiguous");
  if (x.size(0) == 0) return;
  const int m = x.size(0), k = x.size(1);
  cblas_sgemm_compute(kRowMajor, kNoTrans, kPacked, m, n, k, x.data_ptr<float>(), std::max<int64_t>(x.stride(0), k),
                      packed.data_ptr<float>(), n, accumulate ? 1.0f : 0.0f, out.data_ptr<float>(), n);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight);
  m.def("packed_linear", &packed_linear);
}
