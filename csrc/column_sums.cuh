// Deterministic column sums of a [R, C] pass, for kernels that already read every element
// (bias_gelu.cu, heads_grad.cu): a block owns 256 columns (32 threads x 8-wide vectors) of
// a chunk of rows (8 row lanes); each thread keeps 8 fp32 column sums, the block adds its
// 8 lanes in shared memory in lane order and writes one fp32 partial row per chunk; a
// second kernel sums the chunks' partial rows in a fixed order. No atomics: the result
// does not depend on scheduling.
#pragma once

#include "multi_tensor_apply.cuh"

#include <ATen/ops/empty.h>

#include <algorithm>

namespace mpzero {
namespace {  // each including file gets its own copies of the kernels
namespace colsum {

constexpr int kColThreads = 32;
constexpr int kRowLanes = 8;
constexpr int kBlockCols = kColThreads * kVec;  // 256
constexpr int kThreads = kColThreads * kRowLanes;

// This thread's place in the block: its 8 columns start at column(), its rows at the
// chunk's first row + lane() and step by kRowLanes.
__device__ __forceinline__ int64_t column() {
  return (int64_t)blockIdx.x * kBlockCols + (threadIdx.x % kColThreads) * kVec;
}
__device__ __forceinline__ int lane() { return threadIdx.x / kColThreads; }

// The rows [begin, end) of this block's chunk (blockIdx.y) of R rows.
struct Rows {
  int64_t begin, end;
};
__device__ __forceinline__ Rows chunk_rows(int64_t R, int64_t rows_per_chunk) {
  const int64_t begin = (int64_t)blockIdx.y * rows_per_chunk;
  return {begin, min(R, begin + rows_per_chunk)};
}

// The block's sums over its lanes -> row blockIdx.y of partial [chunks, C].
__device__ __forceinline__ void write_partial(const float (&acc)[kVec], float* partial,
                                              int64_t C) {
  __shared__ float sums[kRowLanes][kBlockCols];
  const int lane_c = threadIdx.x % kColThreads;
#pragma unroll
  for (int k = 0; k < kVec; ++k) sums[lane()][lane_c * kVec + k] = acc[k];
  __syncthreads();
  const int64_t c = (int64_t)blockIdx.x * kBlockCols + threadIdx.x;
  if (threadIdx.x < kBlockCols && c < C) {
    float s = 0.0f;
#pragma unroll
    for (int l = 0; l < kRowLanes; ++l) s += sums[l][threadIdx.x];
    partial[blockIdx.y * C + c] = s;
  }
}

// The chunks' partial rows summed per column: a block owns 32 columns; its 8 lanes add
// the chunks l, l + 8, l + 16, ... each, then lane 0 adds the 8 lane sums in lane order.
// (With one thread per column, the 1.3B QKV shape ran 24 blocks whose threads each walked
// ~90 chunks one load after another.)
template <typename T>
__global__ void __launch_bounds__(kThreads)
    sum_chunks_kernel(const float* __restrict__ partial, int64_t chunks, int64_t C,
                      T* __restrict__ out) {
  __shared__ float sums[kRowLanes][kColThreads];
  const int lane_c = threadIdx.x % kColThreads;
  const int64_t c = (int64_t)blockIdx.x * kColThreads + lane_c;
  float s = 0.0f;
  if (c < C) {
#pragma unroll 4
    for (int64_t i = lane(); i < chunks; i += kRowLanes) s += partial[i * C + c];
  }
  sums[lane()][lane_c] = s;
  __syncthreads();
  if (lane() == 0 && c < C) {
    float total = 0.0f;
#pragma unroll
    for (int l = 0; l < kRowLanes; ++l) total += sums[l][lane_c];
    out[c] = from_float<T>(total);
  }
}

// How a [R, C] pass is cut: grid (column blocks, chunks), rows per chunk; about 4 waves
// of blocks over the SMs, at least 64 rows a chunk.
struct Grid {
  int64_t col_blocks, chunks, rows_per_chunk;
  dim3 dims() const {
    return dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(chunks));
  }
};

inline Grid plan(int64_t R, int64_t C, const char* who) {
  Grid g;
  g.col_blocks = (C + kBlockCols - 1) / kBlockCols;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t chunks = std::max<int64_t>(1, (4 * sms * 4 + g.col_blocks - 1) / g.col_blocks);
  chunks = std::min<int64_t>(chunks, std::max<int64_t>(1, (R + 63) / 64));
  g.rows_per_chunk = (R + chunks - 1) / chunks;
  g.chunks = (R + g.rows_per_chunk - 1) / g.rows_per_chunk;
  TORCH_CHECK(g.chunks < 65536, who, ": too many rows");
  return g;
}

// The sums of the `chunks` rows of partial [chunks, C] into out [C] (T), on the current
// stream.
template <typename T>
void finish_rows(const float* partial, int64_t chunks, int64_t C, T* out) {
  sum_chunks_kernel<T><<<static_cast<unsigned>((C + kColThreads - 1) / kColThreads), kThreads,
                         0, at::cuda::getCurrentCUDAStream()>>>(partial, chunks, C, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The sums of partial's rows into out [C] (T), on the current stream.
template <typename T>
void finish(const at::Tensor& partial, const Grid& g, int64_t C, T* out) {
  finish_rows<T>(partial.data_ptr<float>(), g.chunks, C, out);
}

}  // namespace colsum
}  // namespace
}  // namespace mpzero
