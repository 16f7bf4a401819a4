// Backward of y = gelu(x + bias) over rows x, dy [R, C] (row-contiguous, the same row
// stride), in one read of x and dy:
//   dx    = gelu'(x + bias) * dy          (fp32 math, rounded once to dx's dtype)
//   dbias = sum over the rows of dx        (of the rounded values, summed in fp32)
// The bias gradient is the column sum a separate reduction would read dx again for.
//
// Kernel 1: a block owns 256 columns (32 threads x 8-wide vectors) of a chunk of rows
// (8 row lanes); each thread keeps 8 fp32 column sums, the block adds its 8 lanes in
// shared memory in a fixed order and writes one fp32 partial row per chunk.
// Kernel 2 sums the chunks' partial rows in order: the result does not depend on
// scheduling (no atomics).
#include "mpzero.h"
#include "multi_tensor_apply.cuh"

#include <ATen/ops/empty.h>

#include <algorithm>

namespace mpzero {
namespace {

constexpr int kColThreads = 32;
constexpr int kRowLanes = 8;
constexpr int kBlockCols = kColThreads * kVec;  // 256
constexpr int kThreads = kColThreads * kRowLanes;

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
  __shared__ float sums[kRowLanes][kBlockCols];
  const int lane_c = threadIdx.x % kColThreads, lane_r = threadIdx.x / kColThreads;
  const int64_t c0 = (int64_t)blockIdx.x * kBlockCols + lane_c * kVec;
  const int64_t r_begin = (int64_t)blockIdx.y * rows_per_chunk;
  const int64_t r_end = min(R, r_begin + rows_per_chunk);
  float acc[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) acc[k] = 0.0f;
  if (c0 < C) {  // C is a multiple of kVec (checked by the host)
    float b[kVec];
    load8(bias + c0, b);
#pragma unroll 2
    for (int64_t r = r_begin + lane_r; r < r_end; r += kRowLanes) {
      float xv[kVec], g[kVec];
      load8(x + r * stride + c0, xv);
      load8(dy + r * stride + c0, g);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float v = gelu_grad(xv[k] + b[k], tanh_approx) * g[k];
        g[k] = v;
        acc[k] += to_float(from_float<T>(v));  // the rounded value, as dx holds it
      }
      store8(dx + r * stride + c0, g);
    }
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) sums[lane_r][lane_c * kVec + k] = acc[k];
  __syncthreads();
  // Thread t adds column t of the block over the 8 lanes, in lane order.
  const int64_t c = (int64_t)blockIdx.x * kBlockCols + threadIdx.x;
  if (threadIdx.x < kBlockCols && c < C) {
    float s = 0.0f;
#pragma unroll
    for (int l = 0; l < kRowLanes; ++l) s += sums[l][threadIdx.x];
    partial[blockIdx.y * C + c] = s;
  }
}

template <typename T>
__global__ void sum_chunks_kernel(const float* __restrict__ partial, int64_t chunks, int64_t C,
                                  T* __restrict__ dbias) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float s = 0.0f;
  for (int64_t i = 0; i < chunks; ++i) s += partial[i * C + c];
  dbias[c] = from_float<T>(s);
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
              "mpzero.bias_gelu_backward: rows must be contiguous with a multiple of ", kVec,
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
  auto stream = at::cuda::getCurrentCUDAStream();
  // About 4 waves of blocks over the SMs; at least 64 rows a chunk.
  const int64_t col_blocks = (C + kBlockCols - 1) / kBlockCols;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t chunks = std::max<int64_t>(1, (4 * sms * 4 + col_blocks - 1) / col_blocks);
  chunks = std::min<int64_t>(chunks, std::max<int64_t>(1, (R + 63) / 64));
  const int64_t rows_per_chunk = (R + chunks - 1) / chunks;
  chunks = (R + rows_per_chunk - 1) / rows_per_chunk;
  TORCH_CHECK(chunks < 65536, "mpzero.bias_gelu_backward: too many rows");
  auto partial = at::empty({chunks, C}, x.options().dtype(at::kFloat));
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(chunks));
    bias_gelu_backward_kernel<T><<<grid, kThreads, 0, stream>>>(
        static_cast<const T*>(x.data_ptr()), static_cast<const T*>(bias.data_ptr()),
        static_cast<const T*>(dy.data_ptr()), static_cast<T*>(dx.data_ptr()),
        partial.data_ptr<float>(), R, C, stride, rows_per_chunk, tanh_approx);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    sum_chunks_kernel<T><<<static_cast<unsigned>((C + 255) / 256), 256, 0, stream>>>(
        partial.data_ptr<float>(), chunks, C, static_cast<T*>(dbias.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  switch (x.scalar_type()) {
    case at::kFloat: launch(float{}); break;
    case at::kHalf: launch(__half{}); break;
    case at::kBFloat16: launch(__nv_bfloat16{}); break;
    default: TORCH_CHECK(false, "mpzero.bias_gelu_backward: float32, float16 or bfloat16");
  }
}

}  // namespace mpzero
