// The gradient of a fused projection split into attention heads, in one pass.
//
// A fused QKV (or KV) projection writes y [B, T, H, n, D]; attention takes n views of it,
// src_j = y[:, :, :, j, :] as [B, H, T, D]. Its backward gets the n gradients as separate
// tensors (any strides, D contiguous) and needs
//   dy    [B*T, H*n*D]   dy[b*T + t, (h*n + j)*D + d] = dsrc_j[b, h, t, d]
//   dbias [H*n*D]        the column sums of dy (fp32 sums of the values dy holds)
// which autograd would make as a stack, a copy into the row layout and a reduction that
// reads everything again. Here one kernel reads each gradient once, writes dy and keeps
// the column sums (column_sums.cuh: fixed order, no atomics).
#include "column_sums.cuh"
#include "mpzero.h"

namespace mpzero {
namespace {

using colsum::kRowLanes;
using colsum::kThreads;

constexpr int kMaxHeadsSrc = 4;
constexpr int kInFlight = 4;  // rows a thread loads before it stores the first

struct HeadsSrc {  // src_j's base pointer and its strides over B, H, T (elements)
  const void* ptr[kMaxHeadsSrc];
  int64_t sb[kMaxHeadsSrc], sh[kMaxHeadsSrc], st[kMaxHeadsSrc];
};

template <typename T, bool kBias>
__global__ void __launch_bounds__(kThreads)
    heads_grad_kernel(const HeadsSrc src, int64_t n, int64_t D, int64_t T_len,
                      T* __restrict__ dy, float* __restrict__ partial, int64_t R, int64_t C,
                      int64_t rows_per_chunk) {
  const int64_t c0 = colsum::column();
  const colsum::Rows rows = colsum::chunk_rows(R, rows_per_chunk);
  float acc[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) acc[k] = 0.0f;
  int64_t r = rows.begin + colsum::lane();
  if (c0 < C && r < rows.end) {  // D is a multiple of kVec: 8 columns lie in one head's row
    const int64_t h = c0 / (n * D), j = (c0 / D) % n, d = c0 % D;
    // Constant indices only: src stays in the parameter space (no local copy).
    const void* ptr = src.ptr[0];
    int64_t sb = src.sb[0], sh = src.sh[0], st = src.st[0];
#pragma unroll
    for (int k = 1; k < kMaxHeadsSrc; ++k)
      if (k == j) ptr = src.ptr[k], sb = src.sb[k], sh = src.sh[k], st = src.st[k];
    const T* base = static_cast<const T*>(ptr) + h * sh + d;
    // (b, t) of row r, advanced a lane step (kRowLanes rows) at a time.
    int64_t b = r / T_len, t = r % T_len;
    // kInFlight rows a step: every address first, then every load (rows past the chunk
    // load its first row again), then the stores. Row by row, each load would wait for the
    // last store: the compiler cannot prove that a store to dy leaves src alone.
    for (; r < rows.end; r += kRowLanes * kInFlight) {
      int64_t off[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        off[u] = r + u * kRowLanes < rows.end ? b * sb + t * st : off[0];
        for (t += kRowLanes; t >= T_len; t -= T_len) ++b;
      }
      Raw8<T> x[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) x[u] = load_raw8(base + off[u]);
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        if (r + u * kRowLanes >= rows.end) break;
        store_raw8(dy + (r + u * kRowLanes) * C + c0, x[u]);  // the bits, unchanged
        if constexpr (kBias) {
          float v[kVec];
          raw8_to_float(x[u], v);
#pragma unroll
          for (int k = 0; k < kVec; ++k) acc[k] += v[k];
        }
      }
    }
  }
  if constexpr (kBias) colsum::write_partial(acc, partial, C);
}

}  // namespace

void heads_grad(const std::vector<at::Tensor>& grads, at::Tensor dy,
                std::optional<at::Tensor> dbias) {
  const char* who = "mpzero.heads_grad";
  const int64_t n = static_cast<int64_t>(grads.size());
  TORCH_CHECK(n >= 1 && n <= kMaxHeadsSrc, who, ": 1 to ", num(kMaxHeadsSrc),
              " gradients expected, got ", num(n));
  const at::Tensor& g0 = grads[0];
  TORCH_CHECK(g0.is_cuda() && g0.dim() == 4, who, ": gradients must be 4-D [B, H, T, D] CUDA "
              "tensors");
  const int64_t B = g0.size(0), H = g0.size(1), T_len = g0.size(2), D = g0.size(3);
  TORCH_CHECK(D % kVec == 0, who, ": the head dim must be a multiple of ", num(kVec),
              ", got ", num(D));
  HeadsSrc src{};
  for (int64_t j = 0; j < n; ++j) {
    const at::Tensor& g = grads[j];
    TORCH_CHECK(g.is_cuda() && g.sizes() == g0.sizes() && g.scalar_type() == g0.scalar_type() &&
                    g.device() == g0.device(),
                who, ": every gradient must have the first's shape, dtype and device");
    TORCH_CHECK(g.numel() == 0 ||
                    (g.stride(3) == 1 && g.stride(0) % kVec == 0 && g.stride(1) % kVec == 0 &&
                     g.stride(2) % kVec == 0 &&
                     (reinterpret_cast<uintptr_t>(g.data_ptr()) & 15u) == 0),
                who, ": gradients need a contiguous last dim, strides that are multiples of ",
                num(kVec), " and 16-byte alignment");
    src.ptr[j] = g.data_ptr();
    src.sb[j] = g.stride(0);
    src.sh[j] = g.stride(1);
    src.st[j] = g.stride(2);
  }
  const int64_t R = B * T_len, C = H * n * D;
  TORCH_CHECK(dy.is_cuda() && dy.is_contiguous() && dy.numel() == R * C &&
                  dy.scalar_type() == g0.scalar_type() && dy.device() == g0.device() &&
                  (reinterpret_cast<uintptr_t>(dy.data_ptr()) & 15u) == 0,
              who, ": dy must be a contiguous, 16-byte aligned tensor of B*T*H*n*D elements of "
              "the gradients' dtype");
  if (dbias)
    TORCH_CHECK(dbias->is_cuda() && dbias->is_contiguous() && dbias->numel() == C &&
                    dbias->scalar_type() == g0.scalar_type() && dbias->device() == g0.device(),
                who, ": dbias must be a contiguous [H*n*D] tensor of the gradients' dtype");
  if (C == 0) return;
  const at::cuda::CUDAGuard guard(g0.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  if (R == 0) {
    if (dbias) C10_CUDA_CHECK(cudaMemsetAsync(dbias->data_ptr(), 0, dbias->nbytes(), stream));
    return;
  }
  const colsum::Grid grid = colsum::plan(R, C, who);
  at::Tensor partial;
  if (dbias) partial = at::empty({grid.chunks, C}, g0.options().dtype(at::kFloat));
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    T* out = static_cast<T*>(dy.data_ptr());
    if (dbias) {
      heads_grad_kernel<T, true><<<grid.dims(), kThreads, 0, stream>>>(
          src, n, D, T_len, out, partial.data_ptr<float>(), R, C, grid.rows_per_chunk);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      colsum::finish<T>(partial, grid, C, static_cast<T*>(dbias->data_ptr()));
    } else {
      heads_grad_kernel<T, false><<<grid.dims(), kThreads, 0, stream>>>(
          src, n, D, T_len, out, nullptr, R, C, grid.rows_per_chunk);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  };
  dispatch_float(g0.scalar_type(), launch, who, ": float32, float16 or bfloat16");
}

}  // namespace mpzero
