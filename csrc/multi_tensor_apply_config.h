// Launch constants of the multi-tensor kernels, shared by host-only and CUDA translation
// units. Values and the measurements behind them: docs/kernels.md. A normal build takes
// the defaults; bench/sweep_launch.py builds variants with -DMPZERO_LAUNCH_THREADS=...,
// -DMPZERO_CHUNK_ELEMS=... and -DMPZERO_NO_PREFETCH to time them against it.
#pragma once
#include <cstdint>

#ifndef MPZERO_LAUNCH_THREADS
#define MPZERO_LAUNCH_THREADS 512
#endif
#ifndef MPZERO_CHUNK_ELEMS
#define MPZERO_CHUNK_ELEMS 8192
#endif

namespace mpzero {

// Threads per block of every multi-tensor launch: one 512-thread block per SM holds the
// Adam kernels' registers.
constexpr int kLaunchThreads = MPZERO_LAUNCH_THREADS;
// The kernel's launch bounds (__launch_bounds__(kMaxThreads, 1)), whatever the threads.
constexpr int kMaxThreads = 512;
// Elements per chunk (rounded up to whole block steps): one block per chunk.
constexpr int64_t kChunkElems = MPZERO_CHUNK_ELEMS;
// Adam kernels: the next block step's loads issued before this step's math and stores.
#ifdef MPZERO_NO_PREFETCH
constexpr bool kLoadsAhead = false;
#else
constexpr bool kLoadsAhead = true;
#endif
constexpr int kVec = 8;  // elements per thread per step

static_assert(kLaunchThreads > 0 && kLaunchThreads % 32 == 0 &&
                  kLaunchThreads <= kMaxThreads,
              "MPZERO_LAUNCH_THREADS must be a multiple of 32 and at most 512");
static_assert(kChunkElems > 0, "MPZERO_CHUNK_ELEMS must be positive");

}  // namespace mpzero
