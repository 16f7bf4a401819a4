// Pipelined multi-tensor apply: the loads of the next tiles are in flight while a tile is
// computed.
//
// The plain kernel (multi_tensor_apply.cuh) loads a block step into registers, computes,
// stores, and only then loads the next step: while a warp computes, its next bytes are not
// requested, and the Adam kernels' ~128 registers allow one 512-thread block per SM, so
// little else fills the gap. Here each thread copies its own elements of the next
// `stages - 1` block steps ("tiles") into shared memory with cp.async (no registers held
// while the bytes travel), waits for the oldest tile only, reads it from shared memory,
// computes and stores to global memory as before.
//
// Each thread reads back only what it copied itself, so no block barrier is needed: a
// thread's cp.async.wait_group covers its own copies. A stage is refilled one iteration
// after it was read (its values were stored to global memory in between, so the reads
// finished before the refill is issued).
//
// Tiles are the whole block steps of the 16-byte aligned tensors, in the block's chunk order
// (persistent grid, grid-stride over chunks, as in the plain kernel). What is left (the
// partial last step of a tensor, tensors whose pointers are not aligned) goes through the
// op's plain `apply` afterwards.
//
// An Op adds to the plain interface (init / apply / finish):
//   kStageBytes                      bytes per thread per tile in shared memory
//   aligned(meta, t)                 tensor t may take the tile path
//   fetch(meta, t, i0, i1, stage)    issue the cp.async copies of a tile (elements i0..i0+3,
//                                    i1..i1+3 of tensor t: the split access pattern)
//   tile(meta, t, i0, i1, stage)     read the tile back, compute, store to global memory
#pragma once

#include "multi_tensor_apply.cuh"

#include <algorithm>

namespace mpzero {

constexpr int kMaxStages = 4;

template <int BYTES>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async moves 4, 8 or 16 bytes");
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (BYTES == 16) {  // .cg: L2 only, the data is read once
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(gmem), "n"(BYTES)
                 : "memory");
  }
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Wait until at most `pending` of this thread's committed groups are still in flight
// (`pending` is uniform and < kMaxStages; the instruction takes an immediate).
__device__ __forceinline__ void cp_async_wait(int pending) {
  switch (pending) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
  }
}

// One tensor's 8 elements of a tile in shared memory: the runs at i0 and i1 (4 elements
// each), laid out [run][thread] so that a warp's reads cover one contiguous span.
template <typename T>
struct Staged {
  static constexpr int kRun = 4 * static_cast<int>(sizeof(T));  // bytes of a run
  static constexpr int kBytes = 2 * kRun;                         // per thread per tile

  __device__ static void fetch(char* region, const T* g, int64_t i0, int64_t i1) {
    cp_async<kRun>(region + threadIdx.x * kRun, g + i0);
    cp_async<kRun>(region + (blockDim.x + threadIdx.x) * kRun, g + i1);
  }

  // As fp32 (float, half, bfloat16).
  __device__ static void read(const char* region, float (&r)[kVec]) {
    const char* a = region + threadIdx.x * kRun;
    const char* b = region + (blockDim.x + threadIdx.x) * kRun;
    if constexpr (sizeof(T) == 4) {
      const float4 x = *reinterpret_cast<const float4*>(a);
      const float4 y = *reinterpret_cast<const float4*>(b);
      r[0] = x.x; r[1] = x.y; r[2] = x.z; r[3] = x.w;
      r[4] = y.x; r[5] = y.y; r[6] = y.z; r[7] = y.w;
    } else {
      const uint2 x = *reinterpret_cast<const uint2*>(a);
      const uint2 y = *reinterpret_cast<const uint2*>(b);
      const T* ex = reinterpret_cast<const T*>(&x);
      const T* ey = reinterpret_cast<const T*>(&y);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        r[j] = to_float(ex[j]);
        r[4 + j] = to_float(ey[j]);
      }
    }
  }

  // Raw 16-bit values (bf16 bits, int16 remainders).
  __device__ static void read_u16(const char* region, uint32_t (&r)[kVec]) {
    static_assert(sizeof(T) == 2, "16-bit element expected");
    const uint2 x = *reinterpret_cast<const uint2*>(region + threadIdx.x * kRun);
    const uint2 y = *reinterpret_cast<const uint2*>(region + (blockDim.x + threadIdx.x) * kRun);
    const uint32_t w[4] = {x.x, x.y, y.x, y.y};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      r[2 * j] = w[j] & 0xFFFFu;
      r[2 * j + 1] = w[j] >> 16;
    }
  }
};

// The block's tiles in order: whole block steps of aligned tensors, chunk by chunk.
struct TileCursor {
  int64_t c = 0, base = 0, stop = 0;
  int t = 0;
  bool valid = false;

  template <int DEPTH, class Op>
  __device__ void seek(const TensorListMeta<DEPTH>& meta, int64_t chunk, int64_t step,
                       const Op& op) {
    const int64_t total = meta.chunk_begin[meta.ntensors];
    for (c += gridDim.x; c < total; c += gridDim.x) {
      t = tensor_of_chunk(meta, c);
      if (!op.aligned(meta, t)) continue;
      const int64_t begin = (c - meta.chunk_begin[t]) * chunk;
      const int64_t end = min(begin + chunk, meta.numel[t]);
      stop = begin + (end - begin) / step * step;
      if (stop > begin) {
        base = begin;
        valid = true;
        return;
      }
    }
    valid = false;
  }
  template <int DEPTH, class Op>
  __device__ void start(const TensorListMeta<DEPTH>& meta, int64_t chunk, int64_t step,
                        const Op& op) {
    c = (int64_t)blockIdx.x - gridDim.x;
    seek(meta, chunk, step, op);
  }
  template <int DEPTH, class Op>
  __device__ void next(const TensorListMeta<DEPTH>& meta, int64_t chunk, int64_t step,
                       const Op& op) {
    base += step;
    if (base >= stop) seek(meta, chunk, step, op);
  }
};

// A tile's tensor and first element in one word (tensors < 2^15, elements < 2^48), kept per
// thread and stage in shared memory: the consuming side needs no cursor of its own.
__device__ __forceinline__ int64_t tile_tag(int t, int64_t base) {
  return ((int64_t)t << 48) | base;
}

// What the tiles left (partial last steps, misaligned tensors), through the op's plain
// `apply`. Not inlined: its scalar paths would otherwise add their registers to the tile
// loop's (spills in the fp32 Adam kernels).
template <int DEPTH, class Op>
__device__ __noinline__ void plain_leftovers(const TensorListMeta<DEPTH>& meta, int64_t chunk,
                                             int64_t step, Op& op) {
  const int64_t total = meta.chunk_begin[meta.ntensors];
  for (int64_t c = blockIdx.x; c < total; c += gridDim.x) {
    const int t = tensor_of_chunk(meta, c);
    const int64_t begin = (c - meta.chunk_begin[t]) * chunk;
    const int64_t end = min(begin + chunk, meta.numel[t]);
    if (!op.aligned(meta, t)) {
      op.apply(meta, t, begin, end);
    } else {
      const int64_t stop = begin + (end - begin) / step * step;
      if (stop < end) op.apply(meta, t, stop, end);
    }
  }
}

template <int DEPTH, class Op>
__global__ void __launch_bounds__(kMaxThreads, 1)
    multi_tensor_pipelined_kernel(const __grid_constant__ TensorListMeta<DEPTH> meta,
                                  int64_t chunk, Op op, int stages) {
  if (op.init()) return;
  extern __shared__ __align__(16) char smem[];
  const int64_t step = (int64_t)blockDim.x * kVec;
  const int64_t half = step / 2;
  const int64_t lane = 4 * (int64_t)threadIdx.x;
  const size_t stage_bytes = (size_t)blockDim.x * Op::kStageBytes;
  int64_t* tags = reinterpret_cast<int64_t*>(smem + stages * stage_bytes) + threadIdx.x;

  TileCursor ahead;
  ahead.start(meta, chunk, step, op);
  int in_flight = 0;  // tiles fetched and not yet computed
  // Issue the next tile into stage s (a commit group per call, empty past the end).
  auto fetch = [&](int s) {
    if (ahead.valid) {
      const int64_t i0 = ahead.base + lane;
      op.fetch(meta, ahead.t, i0, i0 + half, smem + s * stage_bytes);
      tags[s * blockDim.x] = tile_tag(ahead.t, ahead.base);
      ahead.next(meta, chunk, step, op);
      ++in_flight;
    }
    cp_async_commit();
  };
  for (int s = 0; s + 1 < stages; ++s) fetch(s);  // prologue: stages - 1 tiles in flight
  for (int k = 0; in_flight > 0; k = (k + 1 == stages) ? 0 : k + 1) {
    // Refill the stage read in the previous iteration with tile (this one + stages - 1).
    fetch((k == 0 ? stages : k) - 1);
    cp_async_wait(stages - 1);  // this tile's group has landed
    const int64_t tag = tags[k * blockDim.x];
    const int64_t i0 = (tag & ((int64_t(1) << 48) - 1)) + lane;
    op.tile(meta, static_cast<int>(tag >> 48), i0, i0 + half, smem + k * stage_bytes);
    --in_flight;
  }
  cp_async_wait(0);
  plain_leftovers(meta, chunk, step, op);
  op.finish();
}

// Pipeline depth for `Op` at `threads` threads: the configured stages, fewer where the
// block's shared memory would not fit the device; 0 (plain kernel) below two stages.
template <class Op>
int pipeline_stages_for(int threads) {
  int stages = std::min(launch_config().pipeline_stages, kMaxStages);
  const size_t limit = at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
  while (stages >= 2 && (size_t)threads * (Op::kStageBytes + 8) * stages > limit) --stages;
  return stages >= 2 ? stages : 0;
}

// The pipelined kernel as a launcher for launch_multi_tensor (see PlainKernel).
template <int DEPTH, class Op>
struct PipelinedKernel {
  int stages;

  // Tiles and their tags (tile_tag) for every stage.
  size_t smem(int threads) const {
    return (size_t)threads * (Op::kStageBytes + sizeof(int64_t)) * stages;
  }
  // Raise the kernel's dynamic shared memory limit to what a launch needs (once per size).
  void allow(size_t bytes) const {
    static size_t allowed = 0;
    if (bytes > allowed) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(multi_tensor_pipelined_kernel<DEPTH, Op>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(bytes)));
      allowed = bytes;
    }
  }
  int blocks_per_sm(int threads) const {
    allow(smem(threads));
    return blocks_per_sm_of(multi_tensor_pipelined_kernel<DEPTH, Op>, threads, smem(threads));
  }
  void operator()(int grid, int threads, cudaStream_t stream, const TensorListMeta<DEPTH>& meta,
                  int64_t chunk, const Op& op) const {
    allow(smem(threads));
    multi_tensor_pipelined_kernel<DEPTH, Op><<<grid, threads, smem(threads), stream>>>(
        meta, chunk, op, stages);
  }
};

// launch_multi_tensor with the pipelined kernel where launch_config().pipeline_stages asks
// for it and it fits, else the plain kernel with `plain_op`.
template <int DEPTH, class TiledOp, class PlainOp>
void launch_multi_tensor_tiled(const std::vector<std::array<void*, DEPTH>>& ptrs,
                               const std::vector<int64_t>& numel, int64_t chunk,
                               const TiledOp& tiled_op, const PlainOp& plain_op) {
  const int stages = pipeline_stages_for<TiledOp>(launch_config().threads);
  if (stages > 0) {
    launch_multi_tensor<DEPTH>(ptrs, numel, chunk, tiled_op,
                               (int64_t)launch_config().threads * kVec,
                               PipelinedKernel<DEPTH, TiledOp>{stages});
  } else {
    launch_multi_tensor<DEPTH>(ptrs, numel, chunk, plain_op);
  }
}

}  // namespace mpzero
