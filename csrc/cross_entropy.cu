// Fused cross entropy over (vocab-parallel) logits: two passes over the logits in all.
//
// cross_entropy_stats: one block per row of logits [N, V] reads the row once and writes
// four fp32 numbers: the row's max m, the sum of exp(x - m) (online: the running sum is
// rescaled whenever the max grows), the target's logit (0 where the target id is not in
// this rank's block, target = -1), and the sum of the logits (label smoothing). The
// caller combines them over the TP ranks (max, then rescaled sums) and takes
// lse = m + log(sum).
//
// cross_entropy_backward: one block per row reads the logits again and writes
//   grad = (exp(x - lse) - off_target - on_target * [column == target]) * grad_loss[row]
// rounded once to the logits' dtype; `grad` may be the logits themselves (each element is
// read and written by the same thread).
//
// Rows whose pointers are 16-byte aligned and whose length is a multiple of 8 take 8-wide
// vector loads/stores (multi_tensor_apply.cuh's load8/store8); others a scalar loop.
#include "mpzero.h"
#include "multi_tensor_apply.cuh"

#include <cmath>

namespace mpzero {
namespace {

constexpr int kMaxThreads = 512;

struct Partial {  // a running (max, sum of exp(x - max), sum of x)
  float m, s, sum;
};

__device__ __forceinline__ Partial combine(Partial a, const Partial& b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f, a.sum + b.sum};  // nothing but -inf so far
  const float sa = a.m == m ? a.s : a.s * __expf(a.m - m);
  const float sb = b.m == m ? b.s : b.s * __expf(b.m - m);
  return {m, sa + sb, a.sum + b.sum};
}

// Fold n values into the running partial (max first, then one exp per value).
template <int n>
__device__ __forceinline__ void fold(Partial& p, const float (&r)[kVec]) {
  float vm = r[0];
#pragma unroll
  for (int j = 1; j < n; ++j) vm = fmaxf(vm, r[j]);
  const float m = fmaxf(p.m, vm);
  if (m == -INFINITY) {
#pragma unroll
    for (int j = 0; j < n; ++j) p.sum += r[j];
    return;
  }
  float s = p.m == m ? p.s : p.s * __expf(p.m - m);
#pragma unroll
  for (int j = 0; j < n; ++j) {
    s += __expf(r[j] - m);
    p.sum += r[j];
  }
  p.m = m;
  p.s = s;
}

__device__ __forceinline__ Partial shfl_down(const Partial& p, int o) {
  return {__shfl_down_sync(0xffffffffu, p.m, o), __shfl_down_sync(0xffffffffu, p.s, o),
          __shfl_down_sync(0xffffffffu, p.sum, o)};
}

// Over the block; the result is valid in thread 0.
__device__ __forceinline__ Partial block_combine(Partial p) {
  __shared__ Partial sh[kMaxThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) p = combine(p, shfl_down(p, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) sh[warp] = p;
  __syncthreads();
  if (warp == 0) {
    const int nwarps = (blockDim.x + 31) >> 5;
    p = lane < nwarps ? sh[lane] : Partial{-INFINITY, 0.0f, 0.0f};
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) p = combine(p, shfl_down(p, o));
  }
  return p;
}

template <typename T>
__global__ void __launch_bounds__(kMaxThreads)
    ce_stats_kernel(const T* __restrict__ x, int64_t stride, int64_t V,
                    const int64_t* __restrict__ target, float* __restrict__ stats, bool vec) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * stride;
  Partial p{-INFINITY, 0.0f, 0.0f};
  if (vec) {
#pragma unroll 4
    for (int64_t j = (int64_t)threadIdx.x * kVec; j < V; j += (int64_t)blockDim.x * kVec) {
      float r[kVec];
      load8(xr + j, r);
      fold<kVec>(p, r);
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      float r[kVec];
      r[0] = to_float(xr[j]);
      fold<1>(p, r);
    }
  }
  p = block_combine(p);
  if (threadIdx.x == 0) {
    const int64_t t = target[row];
    float4 out;
    out.x = p.m;
    out.y = p.s;
    out.z = t >= 0 ? to_float(xr[t]) : 0.0f;
    out.w = p.sum;
    reinterpret_cast<float4*>(stats)[row] = out;
  }
}

template <typename T>
__global__ void __launch_bounds__(kMaxThreads)
    ce_backward_kernel(const T* x, int64_t x_stride, T* out, int64_t out_stride, int64_t V,
                       const int64_t* __restrict__ target, const float* __restrict__ lse,
                       const float* __restrict__ grad_loss, float on_target, float off_target,
                       bool vec) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  T* orow = out + row * out_stride;
  const float l = lse[row], g = grad_loss[row];
  const int64_t t = target[row];
  const float hit = on_target * g, base = off_target * g;
  if (vec) {
#pragma unroll 4
    for (int64_t j = (int64_t)threadIdx.x * kVec; j < V; j += (int64_t)blockDim.x * kVec) {
      float r[kVec];
      load8(xr + j, r);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        r[k] = __expf(r[k] - l) * g - base;
        if (j + k == t) r[k] -= hit;
      }
      store8(orow + j, r);
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      float r = __expf(to_float(xr[j]) - l) * g - base;
      if (j == t) r -= hit;
      orow[j] = from_float<T>(r);
    }
  }
}

template <typename F>
void dispatch_logits(at::ScalarType t, const char* what, F&& f) {
  dispatch_float(t, f, "mpzero.", what, ": logits must be float32, float16 or bfloat16");
}

int threads_for(int64_t V, bool vec) {
  const int64_t per_row = vec ? (V + kVec - 1) / kVec : V;
  const int64_t warps = std::min<int64_t>(kMaxThreads / 32, std::max<int64_t>(1, (per_row + 31) / 32));
  return static_cast<int>(warps * 32);
}

bool vector_rows(const at::Tensor& t) {
  return (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15u) == 0 && t.size(1) % kVec == 0 && t.stride(0) % kVec == 0;
}

void check_rows(const at::Tensor& t, const char* fn, const char* what) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 2, "mpzero.", fn, ": '", what,
              "' must be a 2-D CUDA tensor");
  TORCH_CHECK(t.size(1) == 0 || t.stride(1) == 1, "mpzero.", fn, ": '", what,
              "' rows must be contiguous (last stride 1)");
}

void check_vector(const at::Tensor& t, const at::Tensor& like, at::ScalarType dtype,
                  int64_t n, const char* fn, const char* what) {
  TORCH_CHECK(t.device() == like.device(), "mpzero.", fn, ": '", what, "' must be on ",
              like.device().str());
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.numel() == n, "mpzero.", fn,
              ": '", what, "' must be a contiguous ", c10::toString(dtype), " tensor of ",
              num(n), " elements");
}

}  // namespace

void cross_entropy_stats(const at::Tensor& logits, const at::Tensor& target, at::Tensor stats) {
  const char* fn = "cross_entropy_stats";
  check_rows(logits, fn, "logits");
  const int64_t N = logits.size(0), V = logits.size(1);
  check_vector(target, logits, at::kLong, N, fn, "target");
  check_vector(stats, logits, at::kFloat, 4 * N, fn, "stats");
  TORCH_CHECK(V > 0, "mpzero.cross_entropy_stats: logits have no columns");
  if (N == 0) return;
  TORCH_CHECK(N < (int64_t{1} << 31), "mpzero.cross_entropy_stats: too many rows");
  const at::cuda::CUDAGuard guard(logits.device());
  const bool vec = vector_rows(logits);
  const int threads = threads_for(V, vec);
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_logits(logits.scalar_type(), fn, [&](auto tag) {
    using T = decltype(tag);
    ce_stats_kernel<T><<<N, threads, 0, stream>>>(
        static_cast<const T*>(logits.data_ptr()), logits.stride(0), V,
        target.data_ptr<int64_t>(), stats.data_ptr<float>(), vec);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void cross_entropy_backward(const at::Tensor& logits, const at::Tensor& target,
                            const at::Tensor& lse, const at::Tensor& grad_loss,
                            double on_target, double off_target, at::Tensor grad) {
  const char* fn = "cross_entropy_backward";
  check_rows(logits, fn, "logits");
  check_rows(grad, fn, "grad");
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(grad.sizes() == logits.sizes() && grad.scalar_type() == logits.scalar_type() &&
                  grad.device() == logits.device(),
              "mpzero.cross_entropy_backward: 'grad' must have the logits' shape, dtype and "
              "device");
  check_vector(target, logits, at::kLong, N, fn, "target");
  check_vector(lse, logits, at::kFloat, N, fn, "lse");
  check_vector(grad_loss, logits, at::kFloat, N, fn, "grad_loss");
  if (N == 0 || V == 0) return;
  TORCH_CHECK(N < (int64_t{1} << 31), "mpzero.cross_entropy_backward: too many rows");
  const at::cuda::CUDAGuard guard(logits.device());
  const bool vec = vector_rows(logits) && vector_rows(grad);
  const int threads = threads_for(V, vec);
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_logits(logits.scalar_type(), fn, [&](auto tag) {
    using T = decltype(tag);
    ce_backward_kernel<T><<<N, threads, 0, stream>>>(
        static_cast<const T*>(logits.data_ptr()), logits.stride(0),
        static_cast<T*>(grad.data_ptr()), grad.stride(0), V, target.data_ptr<int64_t>(),
        lse.data_ptr<float>(), grad_loss.data_ptr<float>(), static_cast<float>(on_target),
        static_cast<float>(off_target), vec);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace mpzero
