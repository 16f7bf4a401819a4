// Multi-tensor L2 norm, fp32 accumulation, deterministic two-stage reduction.
//
// Stage 1 (multi_tensor_kernel): each thread keeps 8 fp32 partial sums of squares over all
// the chunks its block visits (in a fixed order), the block reduces them in a fixed tree
// and writes one partial per block. Stage 2 (one block) sums the partials in a fixed
// order, takes the square root and raises the noop flag when the result is not finite.
// The grid depends only on the tensor sizes and the device, so the result is bitwise
// reproducible run to run. No atomics, no host sync.
#include "mpzero.h"
#include "multi_tensor_apply.cuh"

#include <ATen/ops/empty.h>

#include <algorithm>

namespace mpzero {
namespace {

// Sum over the block, fixed order; result valid in thread 0. `sh` holds >= 32 floats.
__device__ __forceinline__ float block_sum(float x, float* sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) sh[warp] = x;
  __syncthreads();
  const int nwarps = (blockDim.x + 31) >> 5;
  x = (threadIdx.x < nwarps) ? sh[threadIdx.x] : 0.0f;
  if (warp == 0) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
  }
  return x;
}

template <typename T>
struct L2Op {
  float* partials;  // this launch's slice: one float per block
  float acc[kVec];

  __device__ __forceinline__ bool init() {
#pragma unroll
    for (int j = 0; j < kVec; ++j) acc[j] = 0.0f;
    return false;
  }

  __device__ __forceinline__ void apply(const TensorListMeta<1>& meta, int t, int64_t begin,
                                        int64_t end) {
    const T* x = static_cast<const T*>(meta.ptr[0][t]);
    for_chunk(
        aligned16(x), begin, end,
        [&](int64_t i) {
          float r[kVec];
          load8(x + i, r);
#pragma unroll
          for (int j = 0; j < kVec; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(r[j], r[j]));
        },
        [&](int64_t base, int64_t e) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            const int64_t i = scalar_index(base, j);
            if (i < e) {
              const float r = to_float(x[i]);
              acc[j] = __fadd_rn(acc[j], __fmul_rn(r, r));
            }
          }
        });
  }

  __device__ __forceinline__ void finish() {
    __shared__ float sh[32];
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < kVec; ++j) s += acc[j];
    s = block_sum(s, sh);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
  }
};

__global__ void __launch_bounds__(1024)
    l2norm_finalize(const float* __restrict__ partials, int n, float* out, float* noop) {
  __shared__ float sh[32];
  float s = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += partials[i];
  s = block_sum(s, sh);
  if (threadIdx.x == 0) {
    const float r = sqrtf(s);
    *out = r;
    if (noop != nullptr && !isfinite(r)) *noop = 1.0f;
  }
}

}  // namespace

at::Tensor l2norm(const std::vector<at::Tensor>& tensors, std::optional<at::Tensor> noop_flag) {
  TORCH_CHECK(!tensors.empty(), "mpzero.l2norm: empty list (handled in Python)");
  const at::Device dev = tensors[0].device();
  check_list(tensors, "tensors", tensors.size(), dev);
  const at::cuda::CUDAGuard guard(dev);
  float* noop = nullptr;
  if (noop_flag.has_value() && noop_flag->defined()) {
    noop = const_cast<float*>(scalar_ptr(noop_flag, "noop_flag", dev));
  }
  at::Tensor out = at::empty({}, tensors[0].options().dtype(at::kFloat));
  at::ScalarType dtype = tensors[0].scalar_type();
  // Group by dtype; all partials of all groups go to one buffer, reduced once.
  std::vector<std::pair<at::ScalarType, std::pair<std::vector<std::array<void*, 1>>,
                                                  std::vector<int64_t>>>> groups;
  for (const auto& t : tensors) {
    if (t.numel() == 0) continue;
    dtype = t.scalar_type();
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& gr) { return gr.first == dtype; });
    if (it == groups.end()) {
      groups.push_back({dtype, {}});
      it = groups.end() - 1;
    }
    it->second.first.push_back({t.data_ptr()});
    it->second.second.push_back(t.numel());
  }
  const int64_t chunk = chunk_elems();
  auto for_group = [&](at::ScalarType st, auto&& f) {
    dispatch_float(st, f, "mpzero.l2norm: unsupported dtype ", c10::toString(st));
  };
  // Plan every launch first to size the partials buffer.
  std::vector<std::vector<LaunchPlan>> plans(groups.size());
  int64_t nblocks = 0;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    for_group(groups[gi].first, [&](auto tag) {
      using T = decltype(tag);
      plans[gi] =
          plan_launches<1>(groups[gi].second.second, chunk, persistent_grid<1, L2Op<T>>());
    });
    for (const auto& pl : plans[gi]) nblocks += pl.grid;
  }
  if (nblocks == 0) {
    out.zero_();
    return out;
  }
  at::Tensor partials = at::empty({nblocks}, out.options());
  float* base = partials.data_ptr<float>();
  int64_t offset = 0;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    for_group(groups[gi].first, [&](auto tag) {
      using T = decltype(tag);
      L2Op<T> op{};
      launch_planned<1>(groups[gi].second.first, groups[gi].second.second, chunk,
                                     plans[gi], op, [&](L2Op<T>& o, int, const LaunchPlan& pl) {
                                       o.partials = base + offset;
                                       offset += pl.grid;
                                     });
    });
  }
  l2norm_finalize<<<1, 1024, 0, at::cuda::getCurrentCUDAStream()>>>(
      base, static_cast<int>(nblocks), out.data_ptr<float>(), noop);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace mpzero
