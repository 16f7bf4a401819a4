// Multi-tensor apply: one kernel launch walks many tensors, cut into fixed-size chunks.
//
// Layout of a launch
//   * The pointers (DEPTH per tensor: e.g. p, g, m, v, p_out) and element counts of up to
//     kMaxTensors<DEPTH> tensors travel in the kernel's parameter space (a struct passed by
//     value as a __grid_constant__ parameter, < 4 KiB), together with the prefix sum of
//     their chunk counts. More tensors than fit become several launches.
//   * Elementwise launches (Adam, casts) give each chunk its own block: grid = total chunks
//     (faster than a persistent grid: docs/kernels.md). Reductions (the L2 norm, one
//     partial per block) use a persistent grid: min(total chunks, SMs x blocks per SM)
//     blocks. Either way a block walks chunks blockIdx.x, blockIdx.x + gridDim.x, ... and
//     finds its tensor by a binary search over the prefix sums (uniform across the block,
//     a few constant-cache reads).
//   * Threads per block, chunk size and the Adam kernels' loads ahead are compile-time
//     constants (multi_tensor_apply_config.h).
//   * Inside a chunk, a thread handles 8 consecutive elements per step with 16-byte loads
//     and stores when every pointer of that tensor is 16-byte aligned (chunk starts are
//     multiples of 8 elements, so alignment carries over); the last < 8 elements, and
//     whole tensors whose pointers are not aligned, take a coalesced scalar path.
//
// An Op supplies: `bool init()` (read device scalars; true = skip the whole launch, which
// is how found_inf / noop flags stop every write), `apply(meta, t, begin, end)` for one
// chunk of tensor t, and `finish()` (end of the block's work, e.g. a block reduction).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "messages.h"
#include "multi_tensor_apply_config.h"

namespace mpzero {

template <int DEPTH>
constexpr int max_tensors() {
  return 3584 / (8 * DEPTH + 16);
}

template <int DEPTH>
struct TensorListMeta {
  static constexpr int kMaxT = max_tensors<DEPTH>();
  void* ptr[DEPTH][kMaxT];
  int64_t numel[kMaxT];
  int64_t chunk_begin[kMaxT + 1];
  int ntensors;
};
static_assert(sizeof(TensorListMeta<6>) < 3900, "kernel parameters must stay under 4 KiB");
static_assert(sizeof(TensorListMeta<1>) < 3900, "kernel parameters must stay under 4 KiB");

// ---------------------------------------------------------------------------------------
// Element conversions and 8-wide vector IO.

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// One 16-byte store instruction (st.global.v4.b32; p 16-byte aligned, in global memory).
// Stored through a plain pointer, a vector the compiler has seen built from 16-bit values
// can come out as four 4-byte stores. The memory clobber keeps loads the code issued
// before it there: a kernel that loads several rows before storing them uses it to keep
// the loads in flight together.
__device__ __forceinline__ void stg128(void* p, const uint4& v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// f(float{}), f(__half{}) or f(__nv_bfloat16{}) for the dtype t; any other dtype fails
// with the message parts msg (as TORCH_CHECK takes them).
template <typename F, typename... Msg>
void dispatch_float(at::ScalarType t, F&& f, const Msg&... msg) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(__half{}); break;
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    default: TORCH_CHECK(false, msg...);
  }
}

// Two floats rounded to a 16-bit type in one 32-bit word, a in the low half.
__device__ __forceinline__ uint32_t bits16(__half x) { return __half_as_ushort(x); }
__device__ __forceinline__ uint32_t bits16(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  return bits16(from_float<T>(a)) | (bits16(from_float<T>(b)) << 16);
}

// One 8-byte store instruction (st.global.v2.b32; p 8-byte aligned), as stg128.
__device__ __forceinline__ void stg64(void* p, const uint2& v) {
  asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}

// store8x (two runs of 4 at i0 and i1) with explicit vector store instructions: 16
// bytes per run of fp32, 8 per run of 16-bit values. Through a plain pointer the compiler
// may split a run into 4-byte stores when it cannot place the values in aligned registers
// (seen in the Adam kernels with loads ahead).
template <typename T>
__device__ __forceinline__ void store8x_wide(T* p, int64_t i0, int64_t i1,
                                             const float (&r)[kVec]) {
  if constexpr (sizeof(T) == 4) {
    stg128(p + i0, make_uint4(__float_as_uint(r[0]), __float_as_uint(r[1]),
                              __float_as_uint(r[2]), __float_as_uint(r[3])));
    stg128(p + i1, make_uint4(__float_as_uint(r[4]), __float_as_uint(r[5]),
                              __float_as_uint(r[6]), __float_as_uint(r[7])));
  } else {
    static_assert(sizeof(T) == 2, "16-bit element expected");
    stg64(p + i0, make_uint2(pack2<T>(r[0], r[1]), pack2<T>(r[2], r[3])));
    stg64(p + i1, make_uint2(pack2<T>(r[4], r[5]), pack2<T>(r[6], r[7])));
  }
}

// store8 with 16-byte store instructions (stg128).
template <typename T>
__device__ __forceinline__ void store8_wide(T* p, const float (&r)[kVec]) {
  if constexpr (sizeof(T) == 4) {
    stg128(p, make_uint4(__float_as_uint(r[0]), __float_as_uint(r[1]), __float_as_uint(r[2]),
                         __float_as_uint(r[3])));
    stg128(p + 4, make_uint4(__float_as_uint(r[4]), __float_as_uint(r[5]),
                             __float_as_uint(r[6]), __float_as_uint(r[7])));
  } else {
    static_assert(sizeof(T) == 2, "16-bit element expected");
    stg128(p, make_uint4(pack2<T>(r[0], r[1]), pack2<T>(r[2], r[3]), pack2<T>(r[4], r[5]),
                         pack2<T>(r[6], r[7])));
  }
}

// 8 elements of T as they lie in memory: 16-byte words (one for 16-bit types, two for
// fp32). Kept raw, a row loaded ahead takes half the registers of its fp32 values; stored
// raw with stg128, a copy is bit-exact.
template <typename T>
struct Raw8 {
  uint4 w[sizeof(T) / 2];
};
template <typename T>
__device__ __forceinline__ Raw8<T> load_raw8(const T* p) {
  Raw8<T> x;
#pragma unroll
  for (int i = 0; i < (int)(sizeof(T) / 2); ++i) x.w[i] = *(reinterpret_cast<const uint4*>(p) + i);
  return x;
}
template <typename T>
__device__ __forceinline__ Raw8<T> load_raw8_or_zero(const T* p, bool active) {
  if (active) return load_raw8(p);
  Raw8<T> x;
#pragma unroll
  for (int i = 0; i < (int)(sizeof(T) / 2); ++i) x.w[i] = make_uint4(0u, 0u, 0u, 0u);
  return x;
}
template <typename T>
__device__ __forceinline__ void store_raw8(T* p, const Raw8<T>& x) {
#pragma unroll
  for (int i = 0; i < (int)(sizeof(T) / 2); ++i) stg128(reinterpret_cast<uint4*>(p) + i, x.w[i]);
}
// The two 16-bit values of T (__half or __nv_bfloat16) in one 32-bit word as fp32, the low
// half first.
template <typename T>
__device__ __forceinline__ void word16_to_float(uint32_t w, float& lo, float& hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {  // bf16 -> fp32 is a shift
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xFFFF0000u);
  } else {
    static_assert(std::is_same_v<T, __half>, "16-bit float type expected");
    lo = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xFFFFu)));
    hi = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  }
}

// Four fp32 values held as the bits of a 16-byte word.
__device__ __forceinline__ void word128_to_float(const uint4& w, float* v) {
  v[0] = __uint_as_float(w.x);
  v[1] = __uint_as_float(w.y);
  v[2] = __uint_as_float(w.z);
  v[3] = __uint_as_float(w.w);
}

template <typename T>
__device__ __forceinline__ void raw8_to_float(const Raw8<T>& x, float (&v)[kVec]) {
  if constexpr (sizeof(T) == 4) {
    word128_to_float(x.w[0], v);
    word128_to_float(x.w[1], v + 4);
  } else {
    const uint32_t w[4] = {x.w[0].x, x.w[0].y, x.w[0].z, x.w[0].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) word16_to_float<T>(w[i], v[2 * i], v[2 * i + 1]);
  }
}

// A thread's 8 elements of one split step (elements i0..i0+3 and i1..i1+3, see load8x) as
// they lie in memory: two 16-byte words for fp32, two 8-byte words for 16-bit types
// (uint16_t: raw bits). Held raw, a step loaded ahead takes the fewest registers.
template <typename T>
struct Split8 {
  using W = std::conditional_t<sizeof(T) == 4, uint4, uint2>;
  W a, b;
};
template <typename T>
__device__ __forceinline__ Split8<T> load_split8(const T* p, int64_t i0, int64_t i1) {
  using W = typename Split8<T>::W;
  return {*reinterpret_cast<const W*>(p + i0), *reinterpret_cast<const W*>(p + i1)};
}
template <typename T>
__device__ __forceinline__ void split8_to_float(const Split8<T>& x, float (&r)[kVec]) {
  if constexpr (sizeof(T) == 4) {
    word128_to_float(x.a, r);
    word128_to_float(x.b, r + 4);
  } else {
    const uint32_t w[4] = {x.a.x, x.a.y, x.b.x, x.b.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) word16_to_float<T>(w[i], r[2 * i], r[2 * i + 1]);
  }
}
// Raw 16-bit values (bf16 bits, int16 remainders), each widened to 32 bits.
__device__ __forceinline__ void split8_to_u32(const Split8<uint16_t>& x, uint32_t (&r)[kVec]) {
  const uint32_t w[4] = {x.a.x, x.a.y, x.b.x, x.b.y};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    r[2 * j] = w[j] & 0xFFFFu;
    r[2 * j + 1] = w[j] >> 16;
  }
}

// Load 8 consecutive elements (p must be 16-byte aligned) as fp32.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&r)[kVec]) {
  if constexpr (sizeof(T) == 4) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *(reinterpret_cast<const float4*>(p) + 1);
    r[0] = a.x; r[1] = a.y; r[2] = a.z; r[3] = a.w;
    r[4] = b.x; r[5] = b.y; r[6] = b.z; r[7] = b.w;
  } else {
    static_assert(sizeof(T) == 2, "16-bit element expected");
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int j = 0; j < kVec; ++j) r[j] = to_float(e[j]);
  }
}

// Store 8 consecutive fp32 values as T (p must be 16-byte aligned), round to nearest even.
template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&r)[kVec]) {
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(r[0], r[1], r[2], r[3]);
    *(reinterpret_cast<float4*>(p) + 1) = make_float4(r[4], r[5], r[6], r[7]);
  } else {
    static_assert(sizeof(T) == 2, "16-bit element expected");
    uint4 u;
    T* e = reinterpret_cast<T*>(&u);
#pragma unroll
    for (int j = 0; j < kVec; ++j) e[j] = from_float<T>(r[j]);
    *reinterpret_cast<uint4*>(p) = u;
  }
}

// The Adam kernels' 8 values of a thread as two runs of 4 (split access): elements
// i0..i0+3 and i1..i1+3, i1 half a block step after i0, so that a warp's load instruction
// covers one contiguous span (512 B of fp32, 256 B of 16-bit values).
template <typename T>
__device__ __forceinline__ void load8x(const T* p, int64_t i0, int64_t i1, float (&r)[kVec]) {
  if constexpr (sizeof(T) == 4) {
    const float4 a = *reinterpret_cast<const float4*>(p + i0);
    const float4 b = *reinterpret_cast<const float4*>(p + i1);
    r[0] = a.x; r[1] = a.y; r[2] = a.z; r[3] = a.w;
    r[4] = b.x; r[5] = b.y; r[6] = b.z; r[7] = b.w;
  } else {
    static_assert(sizeof(T) == 2, "16-bit element expected");
    const uint2 a = *reinterpret_cast<const uint2*>(p + i0);
    const uint2 b = *reinterpret_cast<const uint2*>(p + i1);
    const T* ea = reinterpret_cast<const T*>(&a);
    const T* eb = reinterpret_cast<const T*>(&b);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      r[j] = to_float(ea[j]);
      r[4 + j] = to_float(eb[j]);
    }
  }
}

template <typename T>
__device__ __forceinline__ void store8x(T* p, int64_t i0, int64_t i1, const float (&r)[kVec]) {
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<float4*>(p + i0) = make_float4(r[0], r[1], r[2], r[3]);
    *reinterpret_cast<float4*>(p + i1) = make_float4(r[4], r[5], r[6], r[7]);
  } else {
    static_assert(sizeof(T) == 2, "16-bit element expected");
    uint2 a, b;
    T* ea = reinterpret_cast<T*>(&a);
    T* eb = reinterpret_cast<T*>(&b);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      ea[j] = from_float<T>(r[j]);
      eb[j] = from_float<T>(r[4 + j]);
    }
    *reinterpret_cast<uint2*>(p + i0) = a;
    *reinterpret_cast<uint2*>(p + i1) = b;
  }
}

__device__ __forceinline__ void load8x_u16(const uint16_t* p, int64_t i0, int64_t i1,
                                           uint32_t (&r)[kVec]) {
  split8_to_u32(load_split8(p, i0, i1), r);
}

__device__ __forceinline__ void store8x_u16(uint16_t* p, int64_t i0, int64_t i1,
                                            const uint32_t (&r)[kVec]) {
  uint2 a, b;
  a.x = (r[0] & 0xFFFFu) | (r[1] << 16);
  a.y = (r[2] & 0xFFFFu) | (r[3] << 16);
  b.x = (r[4] & 0xFFFFu) | (r[5] << 16);
  b.y = (r[6] & 0xFFFFu) | (r[7] << 16);
  *reinterpret_cast<uint2*>(p + i0) = a;
  *reinterpret_cast<uint2*>(p + i1) = b;
}

// store8x_u16 with explicit 8-byte store instructions (see store8x_wide).
__device__ __forceinline__ void store8x_u16_wide(uint16_t* p, int64_t i0, int64_t i1,
                                                 const uint32_t (&r)[kVec]) {
  stg64(p + i0, make_uint2((r[0] & 0xFFFFu) | (r[1] << 16), (r[2] & 0xFFFFu) | (r[3] << 16)));
  stg64(p + i1, make_uint2((r[4] & 0xFFFFu) | (r[5] << 16), (r[6] & 0xFFFFu) | (r[7] << 16)));
}

// Output dtype chosen at run time (keeps template instantiations down).
enum class OutKind : int { kNone = 0, kFloat = 1, kHalf = 2, kBFloat16 = 3 };

inline OutKind out_kind_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return OutKind::kFloat;
    case at::kHalf: return OutKind::kHalf;
    case at::kBFloat16: return OutKind::kBFloat16;
    default: TORCH_CHECK(false, "mpzero: unsupported output dtype ", t);
  }
}

__device__ __forceinline__ void store8x_out(OutKind k, void* base, int64_t i0, int64_t i1,
                                            const float (&r)[kVec]) {
  switch (k) {
    case OutKind::kFloat: store8x(static_cast<float*>(base), i0, i1, r); break;
    case OutKind::kHalf: store8x(static_cast<__half*>(base), i0, i1, r); break;
    case OutKind::kBFloat16: store8x(static_cast<__nv_bfloat16*>(base), i0, i1, r); break;
    default: break;
  }
}
__device__ __forceinline__ void store8x_out_wide(OutKind k, void* base, int64_t i0, int64_t i1,
                                                 const float (&r)[kVec]) {
  switch (k) {
    case OutKind::kFloat: store8x_wide(static_cast<float*>(base), i0, i1, r); break;
    case OutKind::kHalf: store8x_wide(static_cast<__half*>(base), i0, i1, r); break;
    case OutKind::kBFloat16: store8x_wide(static_cast<__nv_bfloat16*>(base), i0, i1, r); break;
    default: break;
  }
}
__device__ __forceinline__ void store1_out(OutKind k, void* base, int64_t i, float x) {
  switch (k) {
    case OutKind::kFloat: static_cast<float*>(base)[i] = x; break;
    case OutKind::kHalf: static_cast<__half*>(base)[i] = __float2half_rn(x); break;
    case OutKind::kBFloat16: static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(x); break;
    default: break;
  }
}

// ---------------------------------------------------------------------------------------
// The kernel.

// __launch_bounds__(512, 1): the Adam kernels use up to ~128 registers, one 512-thread block
// per SM; tighter bounds spilled and were slower (docs/kernels.md).
template <int DEPTH, class Op>
__global__ void __launch_bounds__(kMaxThreads, 1)
    multi_tensor_kernel(const __grid_constant__ TensorListMeta<DEPTH> meta, int64_t chunk, Op op) {
  if (op.init()) return;  // uniform across the grid: a device flag said "change nothing"
  const int64_t total = meta.chunk_begin[meta.ntensors];
  for (int64_t c = blockIdx.x; c < total; c += gridDim.x) {
    int lo = 0, hi = meta.ntensors - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (meta.chunk_begin[mid] <= c) lo = mid; else hi = mid - 1;
    }
    const int64_t begin = (c - meta.chunk_begin[lo]) * chunk;
    const int64_t end = min(begin + chunk, meta.numel[lo]);
    op.apply(meta, lo, begin, end);
  }
  op.finish();
}

// Iterate the V-wide steps and the scalar remainder of one chunk.
//   vec(i):          elements i..i+V-1, all pointers aligned (V = 8 elements, or 16 bytes)
//   scalar(base, e): elements base + j * blockDim.x + threadIdx.x (j < V) that are < e
// Both callbacks are called by every thread of the block.
template <int V = kVec, class Vec, class Scalar>
__device__ __forceinline__ void for_chunk(bool aligned, int64_t begin, int64_t end, Vec&& vec,
                                          Scalar&& scalar) {
  if (aligned) {
    const int64_t groups = (end - begin) / V;
    for (int64_t k = threadIdx.x; k < groups; k += blockDim.x) vec(begin + k * V);
    const int64_t tail = begin + groups * V;
    if (tail < end) scalar(tail, end);
  } else {
    for (int64_t base = begin; base < end; base += (int64_t)blockDim.x * V) scalar(base, end);
  }
}

// The Adam kernels' walk of a chunk with split access (load8x): vec(i0, i1) for the 8
// elements i0..i0+3, i1..i1+3 (i1 = i0 + half a block step). Only whole block steps are
// vectorized; the chunk's last partial step (tensor ends only: chunks are whole steps)
// takes the scalar path, and so do misaligned tensors (for_chunk with aligned false: its
// vector path, 8 in a row, is never taken; written so, the kernels compile to the same
// SASS as when the access pattern was a run-time choice).
template <class Vec, class Scalar>
__device__ __forceinline__ void for_chunk_split(bool aligned, int64_t begin, int64_t end,
                                                Vec&& vec, Scalar&& scalar) {
  if (aligned) {
    const int64_t step = (int64_t)blockDim.x * kVec;
    const int64_t half = step / 2;
    int64_t base = begin;
    for (; base + step <= end; base += step) {
      const int64_t i0 = base + 4 * (int64_t)threadIdx.x;
      vec(i0, i0 + half);
    }
    if (base < end) scalar(base, end);
  } else {
    for_chunk(aligned, begin, end, [&](int64_t i) { vec(i, i + 4); }, scalar);
  }
}

// for_chunk_split with the next block step's loads issued before this step's math and
// stores (double buffering in registers, kLoadsAhead), so that a warp keeps loads in
// flight while it computes: load(i0, i1) returns one step's raw words, body(row, i0, i1)
// converts, updates and stores them. Only for aligned tensors; the chunk's last partial
// step takes the scalar path as in for_chunk_split.
template <class Load, class Body, class Scalar>
__device__ __forceinline__ void for_chunk_prefetch(int64_t begin, int64_t end, Load&& load,
                                                   Body&& body, Scalar&& scalar) {
  const int64_t step = (int64_t)blockDim.x * kVec;
  const int64_t half = step / 2;
  const int64_t lane = 4 * (int64_t)threadIdx.x;
  int64_t base = begin;
  if (base + step <= end) {
    auto row = load(base + lane, base + lane + half);
    for (;;) {
      const int64_t next = base + step;
      const bool more = next + step <= end;  // uniform across the block
      decltype(row) ahead;
      if (more) ahead = load(next + lane, next + lane + half);
      body(row, base + lane, base + lane + half);
      base = next;
      if (!more) break;
      row = ahead;
    }
  }
  if (base < end) scalar(base, end);
}

// Index of element j of a scalar step (strided by the block for coalescing).
__device__ __forceinline__ int64_t scalar_index(int64_t base, int j) {
  return base + (int64_t)j * blockDim.x + threadIdx.x;
}

// ---------------------------------------------------------------------------------------
// Host side.

struct LaunchPlan {
  int first;        // first tensor of the launch
  int count;        // tensors in the launch
  int64_t chunks;   // total chunks
  int grid;         // blocks
};

inline int device_sm_count() {
  return at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

// Resident blocks per SM of this kernel at kLaunchThreads (the occupancy calculator).
// Cached per instantiation (and thus computed before any graph capture that follows a
// warm-up call). Single-device assumption: same SM type everywhere.
template <int DEPTH, class Op>
int blocks_per_sm() {
  static int n = 0;
  if (n == 0) {
    int k = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &k, multi_tensor_kernel<DEPTH, Op>, kLaunchThreads, 0));
    n = k > 0 ? k : 1;
  }
  return n;
}

// The grid of a persistent launch (the L2 norm): SMs x resident blocks.
template <int DEPTH, class Op>
int64_t persistent_grid() {
  return (int64_t)device_sm_count() * blocks_per_sm<DEPTH, Op>();
}

// Cut the (non-empty) tensors into launches of at most kMaxT tensors, each of at most
// `max_grid` blocks (default: one block per chunk).
template <int DEPTH>
std::vector<LaunchPlan> plan_launches(const std::vector<int64_t>& numel, int64_t chunk,
                                      int64_t max_grid = std::numeric_limits<int>::max()) {
  constexpr int kMaxT = TensorListMeta<DEPTH>::kMaxT;
  std::vector<LaunchPlan> plans;
  const int n = static_cast<int>(numel.size());
  for (int first = 0; first < n; first += kMaxT) {
    LaunchPlan pl{first, std::min(kMaxT, n - first), 0, 0};
    for (int i = 0; i < pl.count; ++i) pl.chunks += (numel[first + i] + chunk - 1) / chunk;
    pl.grid = static_cast<int>(std::min<int64_t>(pl.chunks, max_grid));
    plans.push_back(pl);
  }
  return plans;
}

// Launch `op` over tensors given by DEPTH pointers each. `prepare(op, launch_index, plan)`
// may adjust the op per launch (e.g. where a reduction writes its partial sums).
template <int DEPTH, class Op, class Prepare>
void launch_planned(const std::vector<std::array<void*, DEPTH>>& ptrs,
                    const std::vector<int64_t>& numel, int64_t chunk,
                    const std::vector<LaunchPlan>& plans, Op op, Prepare&& prepare) {
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (size_t li = 0; li < plans.size(); ++li) {
    const LaunchPlan& pl = plans[li];
    TensorListMeta<DEPTH> meta;
    int64_t acc = 0;
    for (int i = 0; i < pl.count; ++i) {
      for (int d = 0; d < DEPTH; ++d) meta.ptr[d][i] = ptrs[pl.first + i][d];
      meta.numel[i] = numel[pl.first + i];
      meta.chunk_begin[i] = acc;
      acc += (meta.numel[i] + chunk - 1) / chunk;
    }
    meta.chunk_begin[pl.count] = acc;
    meta.ntensors = pl.count;
    prepare(op, static_cast<int>(li), pl);
    multi_tensor_kernel<DEPTH, Op><<<pl.grid, kLaunchThreads, 0, stream>>>(meta, chunk, op);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// Launch an elementwise `op` over the tensors, one block per chunk.
template <int DEPTH, class Op>
void launch_multi_tensor(const std::vector<std::array<void*, DEPTH>>& ptrs,
                         const std::vector<int64_t>& numel, int64_t chunk, Op op) {
  launch_planned<DEPTH>(ptrs, numel, chunk, plan_launches<DEPTH>(numel, chunk), op,
                        [](Op&, int, const LaunchPlan&) {});
}

// Chunk size in elements, rounded to whole V-wide steps of a block (so that chunk starts
// keep 16-byte alignment and every vector step of a chunk is full).
constexpr int64_t chunk_elems(int64_t scale = 1, int V = kVec) {
  const int64_t step = (int64_t)kLaunchThreads * V;
  const int64_t want = kChunkElems * scale;
  return std::max<int64_t>(step, (want + step - 1) / step * step);
}

// ---------------------------------------------------------------------------------------
// Argument checks shared by the bindings.

inline void check_list(const std::vector<at::Tensor>& l, const char* what, size_t n,
                       const at::Device& dev) {
  TORCH_CHECK(l.size() == n, "mpzero: list '", what, "' has ", num(l.size()), " tensors, expected ", num(n));
  for (const auto& t : l) {
    TORCH_CHECK(t.is_cuda(), "mpzero: '", what, "' tensors must be CUDA tensors");
    TORCH_CHECK(t.device() == dev, "mpzero: '", what, "' tensors must be on ", dev.str());
    TORCH_CHECK(t.is_contiguous(), "mpzero: '", what, "' tensors must be contiguous");
  }
}

inline const float* scalar_ptr(const std::optional<at::Tensor>& t, const char* what,
                               const at::Device& dev) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->is_cuda() && t->device() == dev, "mpzero: '", what, "' must be on ", dev.str());
  TORCH_CHECK(t->scalar_type() == at::kFloat, "mpzero: '", what, "' must be float32");
  TORCH_CHECK(t->numel() == 1, "mpzero: '", what, "' must have one element");
  return t->data_ptr<float>();
}

}  // namespace mpzero
