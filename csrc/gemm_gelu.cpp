// GELU in the GEMM's epilogue (cuBLASLt), for an MLP  out = gelu(x W1^T + b1) W2^T:
//
//   gemm_bias_gelu:  z = x W1^T + b1, y = gelu(z)           one GEMM writes y and z
//   gemm_dgelu:     dz = (dout W2) * gelu'(z)                one GEMM writes dz
//
// The bias gradient is a separate reduction (mpzero/tensor_parallel/gelu_mlp.py): the
// DGELU_BGRAD and BGRADB epilogues that would sum dz's columns were slower
// (docs/tensor_parallel.md).
// cuBLASLt's GELU is the tanh approximation, 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))).
// Row-major [M, N] tensors are column-major [N, M] matrices to cuBLASLt, so each product
// is computed transposed: y^T = W1 x^T (W1 [N, K] row-major = column-major [K, N], op T),
// and dz^T = W2^T dout^T (W2 [H, F] row-major = column-major [F, H], op N). The bias
// vector runs along cuBLASLt's rows (our features): both epilogues' bias is per feature.
#include "messages.h"
#include "mpzero.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

#include <memory>
#include <string>

namespace mpzero {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;  // what cuBLASLt's Hopper kernels may ask for

#define MPZERO_LT_CHECK(expr)                                                              \
  do {                                                                                     \
    const cublasStatus_t s_ = (expr);                                                      \
    TORCH_CHECK(s_ == CUBLAS_STATUS_SUCCESS, "mpzero GEMM epilogue: " #expr " failed: ",   \
                cublasLtGetStatusString(s_));                                              \
  } while (0)

struct DescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* d) const { cublasLtMatmulDescDestroy(d); }
  void operator()(cublasLtMatrixLayoutOpaque_t* d) const { cublasLtMatrixLayoutDestroy(d); }
  void operator()(cublasLtMatmulPreferenceOpaque_t* d) const {
    cublasLtMatmulPreferenceDestroy(d);
  }
};
using MatmulDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t, DescDeleter>;
using Layout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, DescDeleter>;
using Preference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, DescDeleter>;

Layout layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t l = nullptr;
  MPZERO_LT_CHECK(cublasLtMatrixLayoutCreate(&l, type, rows, cols, ld));
  return Layout(l);
}

template <typename T>
void set_attr(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& value) {
  MPZERO_LT_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(value)));
}

cudaDataType_t lt_type(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    default: TORCH_CHECK(false, "mpzero GEMM epilogue: dtype must be bf16 or fp16, got ", t);
  }
}

// D [m, n] (column-major, ld m) = op(A) [m, k] op(B) [k, n], fp32 accumulation, then the
// epilogue; A is column-major [transa ? k : m, transa ? m : k] with ld lda, B likewise.
void lt_matmul(const at::Tensor& like, bool transa, bool transb, int64_t m, int64_t n,
               int64_t k, const void* A, int64_t lda, const void* B, int64_t ldb, void* D,
               cublasLtEpilogue_t epilogue, void* bias, void* aux) {
  const cudaDataType_t type = lt_type(like.scalar_type());
  cublasLtMatmulDesc_t raw = nullptr;
  MPZERO_LT_CHECK(cublasLtMatmulDescCreate(&raw, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  MatmulDesc desc(raw);
  set_attr(raw, CUBLASLT_MATMUL_DESC_TRANSA, transa ? CUBLAS_OP_T : CUBLAS_OP_N);
  set_attr(raw, CUBLASLT_MATMUL_DESC_TRANSB, transb ? CUBLAS_OP_T : CUBLAS_OP_N);
  set_attr(raw, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
  if (bias != nullptr) set_attr(raw, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
  set_attr(raw, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux);
  set_attr(raw, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, m);

  Layout a = layout(type, transa ? k : m, transa ? m : k, lda);
  Layout b = layout(type, transb ? n : k, transb ? k : n, ldb);
  Layout d = layout(type, m, n, m);

  cublasLtMatmulPreference_t praw = nullptr;
  MPZERO_LT_CHECK(cublasLtMatmulPreferenceCreate(&praw));
  Preference pref(praw);
  const uint64_t ws_bytes = kWorkspaceBytes;
  MPZERO_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(
      praw, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));

  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  MPZERO_LT_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, raw, a.get(), b.get(), d.get(),
                                                 d.get(), praw, 1, &heuristic, &found));
  TORCH_CHECK(found > 0, "mpzero GEMM epilogue: cuBLASLt has no algorithm for m=", num(m),
              " n=", num(n), " k=", num(k), " with epilogue ", num(static_cast<int>(epilogue)));
  at::Tensor workspace =
      at::empty({static_cast<int64_t>(heuristic.workspaceSize)}, like.options().dtype(at::kByte));
  const float alpha = 1.0f, beta = 0.0f;
  MPZERO_LT_CHECK(cublasLtMatmul(handle, raw, &alpha, A, a.get(), B, b.get(), &beta, D,
                                 d.get(), D, d.get(), &heuristic.algo,
                                 workspace.numel() ? workspace.data_ptr() : nullptr,
                                 heuristic.workspaceSize, at::cuda::getCurrentCUDAStream()));
}

// "[a, b]" built by hand, and every number through num() (messages.h): streaming an integer
// or an IntArrayRef into TORCH_CHECK's message crashes this extension with torch 2.11.
std::string shape(const at::Tensor& t) {
  std::string out = "[";
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (d) out += ", ";
    out += std::to_string(t.size(d));
  }
  return out + "]";
}

void check_matrix(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 2 && t.is_contiguous(), "mpzero GEMM epilogue: ", name,
              " must be a contiguous 2-D CUDA tensor, got ", shape(t),
              t.is_cuda() ? std::string() : std::string(" (not CUDA)"));
  TORCH_CHECK(t.scalar_type() == like.scalar_type() && t.device() == like.device(),
              "mpzero GEMM epilogue: ", name, " must have x's dtype and device");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "mpzero GEMM epilogue: ",
              name, " must be 16-byte aligned");
}

void check_bias(const std::optional<at::Tensor>& bias, int64_t n, const at::Tensor& like) {
  if (!bias) return;
  TORCH_CHECK(bias->is_cuda() && bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                  bias->scalar_type() == like.scalar_type(),
              "mpzero GEMM epilogue: bias must be a contiguous 1-D tensor of ", num(n),
              " features of x's dtype, got ", shape(*bias));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> gemm_bias_gelu(const at::Tensor& x, const at::Tensor& weight,
                                                  const std::optional<at::Tensor>& bias) {
  check_matrix(x, "x", x);
  check_matrix(weight, "weight", x);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "mpzero GEMM epilogue: weight ", shape(weight),
              " does not match x ", shape(x));
  TORCH_CHECK(N % 8 == 0, "mpzero GEMM epilogue: the output features (", num(N),
              ") must be a multiple of 8");
  check_bias(bias, N, x);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor z = at::empty({M, N}, x.options());
  if (M == 0) return {y, z};
  // y^T [N, M] = W [N, K] (column-major [K, N], op T) x^T (column-major [K, M]).
  lt_matmul(x, /*transa=*/true, /*transb=*/false, N, M, K, weight.data_ptr(), K, x.data_ptr(),
            K, y.data_ptr(), bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX,
            bias ? bias->data_ptr() : nullptr, z.data_ptr());
  return {y, z};
}

at::Tensor gemm_dgelu(const at::Tensor& grad_out, const at::Tensor& weight,
                      const at::Tensor& z) {
  check_matrix(grad_out, "grad_out", grad_out);
  check_matrix(weight, "weight", grad_out);
  check_matrix(z, "z", grad_out);
  const int64_t M = grad_out.size(0), H = grad_out.size(1), F = weight.size(1);
  TORCH_CHECK(weight.size(0) == H && z.size(0) == M && z.size(1) == F,
              "mpzero GEMM epilogue: grad_out ", shape(grad_out), ", weight ", shape(weight),
              " and z ", shape(z), " do not match (want [M, H], [H, F], [M, F])");
  TORCH_CHECK(F % 8 == 0, "mpzero GEMM epilogue: the hidden features (", num(F),
              ") must be a multiple of 8");
  const c10::cuda::CUDAGuard guard(grad_out.device());
  at::Tensor dz = at::empty({M, F}, grad_out.options());
  if (M == 0) return dz;
  // dz^T [F, M] = W^T (W [H, F] row-major = column-major [F, H], op N) dout^T ([H, M]).
  lt_matmul(grad_out, /*transa=*/false, /*transb=*/false, F, M, H, weight.data_ptr(), F,
            grad_out.data_ptr(), H, dz.data_ptr(), CUBLASLT_EPILOGUE_DGELU, nullptr,
            z.data_ptr());
  return dz;
}

}  // namespace mpzero
