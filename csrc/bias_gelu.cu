// Backward of y = gelu(x + bias) over rows x, dy [R, C] (row-contiguous, the same row
// stride), in one read of x and dy:
//   dx    = gelu'(x + bias) * dy          (fp32 math, rounded once to dx's dtype)
//   dbias = sum over the rows of dx        (of the rounded values, summed in fp32)
// The bias gradient is the column sum a separate reduction would read dx again for.
//
// Kernel 1 computes dx and the fp32 column sums of each chunk of rows; kernel 2 adds the
// chunks in a fixed order (column_sums.cuh): the result does not depend on scheduling.
#include "column_sums.cuh"
#include "mpzero.h"

namespace mpzero {
namespace {

using colsum::kThreads;
using colsum::kRowLanes;

__device__ __forceinline__ float gelu_grad(float x, bool tanh_approx) {
  if (tanh_approx) {  // d/dx of 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    const float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
    const float x2 = x * x;
    const float t = tanhf(kBeta * (x + kKappa * x2 * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kBeta * (1.0f + 3.0f * kKappa * x2);
  }
  const float cdf = 0.5f * (1.0f + erff(x * 0.7071067811865476f));  // Phi(x)
  return cdf + x * expf(-0.5f * x * x) * 0.3989422804014327f;         // + x phi(x)
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    bias_gelu_backward_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                              const T* __restrict__ dy, T* __restrict__ dx,
                              float* __restrict__ partial, int64_t R, int64_t C,
                              int64_t stride, int64_t rows_per_chunk, bool tanh_approx) {
  const int64_t c0 = colsum::column();
  const colsum::Rows rows = colsum::chunk_rows(R, rows_per_chunk);
  float acc[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) acc[k] = 0.0f;
  if (c0 < C) {  // C is a multiple of kVec (checked by the host)
    float b[kVec];
    load8(bias + c0, b);
#pragma unroll 2
    for (int64_t r = rows.begin + colsum::lane(); r < rows.end; r += kRowLanes) {
      float xv[kVec], g[kVec];
      load8(x + r * stride + c0, xv);
      load8(dy + r * stride + c0, g);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float v = gelu_grad(xv[k] + b[k], tanh_approx) * g[k];
        g[k] = v;
        acc[k] += to_float(from_float<T>(v));  // the rounded value, as dx holds it
      }
      store8_wide(dx + r * stride + c0, g);
    }
  }
  colsum::write_partial(acc, partial, C);
}

void check_matrix(const at::Tensor& t, const at::Tensor& like, const char* what) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 2 && t.sizes() == like.sizes() &&
                  t.strides() == like.strides() && t.scalar_type() == like.scalar_type() &&
                  t.device() == like.device(),
              "mpzero.bias_gelu_backward: '", what, "' must be a CUDA tensor of x's shape, ",
              "strides and dtype");
}

}  // namespace

void bias_gelu_backward(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& dy,
                        at::Tensor dx, at::Tensor dbias, bool tanh_approx) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2, "mpzero.bias_gelu_backward: x must be 2-D CUDA");
  const int64_t R = x.size(0), C = x.size(1), stride = x.stride(0);
  TORCH_CHECK(C % kVec == 0 && (C == 0 || x.stride(1) == 1) && stride % kVec == 0,
              "mpzero.bias_gelu_backward: rows must be contiguous with a multiple of ", num(kVec),
              " columns");
  check_matrix(dy, x, "dy");
  check_matrix(dx, x, "dx");
  for (const at::Tensor* t : std::array<const at::Tensor*, 2>{&bias, &dbias})
    TORCH_CHECK(t->is_cuda() && t->is_contiguous() && t->numel() == C &&
                    t->scalar_type() == x.scalar_type() && t->device() == x.device(),
                "mpzero.bias_gelu_backward: bias and dbias must be contiguous [C] tensors of "
                "x's dtype");
  for (const at::Tensor* t : std::array<const at::Tensor*, 4>{&x, &dy, &dx, &bias})
    TORCH_CHECK((reinterpret_cast<uintptr_t>(t->data_ptr()) & 15u) == 0,
                "mpzero.bias_gelu_backward: tensors must be 16-byte aligned");
  if (C == 0) return;
  const at::cuda::CUDAGuard guard(x.device());
  if (R == 0) {  // no rows: the bias gradient is zero
    C10_CUDA_CHECK(cudaMemsetAsync(dbias.data_ptr(), 0, dbias.nbytes(),
                                   at::cuda::getCurrentCUDAStream()));
    return;
  }
  const colsum::Grid grid = colsum::plan(R, C, "mpzero.bias_gelu_backward");
  auto partial = at::empty({grid.chunks, C}, x.options().dtype(at::kFloat));
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    bias_gelu_backward_kernel<T><<<grid.dims(), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        static_cast<const T*>(x.data_ptr()), static_cast<const T*>(bias.data_ptr()),
        static_cast<const T*>(dy.data_ptr()), static_cast<T*>(dx.data_ptr()),
        partial.data_ptr<float>(), R, C, stride, grid.rows_per_chunk, tanh_approx);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    colsum::finish<T>(partial, grid, C, static_cast<T*>(dbias.data_ptr()));
  };
  dispatch_float(x.scalar_type(), launch, "mpzero.bias_gelu_backward: float32, float16 or "
                 "bfloat16");
}

}  // namespace mpzero
