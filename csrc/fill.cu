// A trivial kernel that keeps the build path real: fill a float tensor with a value.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "mpzero.h"

namespace {
__global__ void fill_kernel(float* out, int64_t n, float value) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    out[i] = value;
  }
}
}  // namespace

namespace mpzero {
void fill_scalar(at::Tensor t, double value) {
  TORCH_CHECK(t.is_cuda(), "fill_scalar: tensor must be CUDA");
  TORCH_CHECK(t.scalar_type() == at::kFloat, "fill_scalar: tensor must be float32");
  TORCH_CHECK(t.is_contiguous(), "fill_scalar: tensor must be contiguous");
  const at::cuda::CUDAGuard guard(t.device());
  const int64_t n = t.numel();
  if (n == 0) return;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, 4096));
  fill_kernel<<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
      t.data_ptr<float>(), n, static_cast<float>(value));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
}  // namespace mpzero
