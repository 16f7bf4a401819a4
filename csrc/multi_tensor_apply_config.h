// Launch knobs of the multi-tensor kernels, shared by host-only and CUDA translation units.
#pragma once
#include <cstdint>

namespace mpzero {

struct LaunchConfig {
  int threads = 512;            // threads per block (<= kMaxThreads)
  int blocks_per_sm = 0;        // 0: as many as the occupancy calculator allows
  int64_t chunk_elems = 16384;  // elements per chunk (rounded to whole block steps)
  int prefetch_steps = 0;       // Adam: prefetch to L2 this many block steps ahead (0: off)
  int variant = 0;  // hot Adam kernels: 0 = bounds (512, 1), 1 = bounds (256, 3), <= 80 regs
};
LaunchConfig& launch_config();

constexpr int kMaxThreads = 512;
constexpr int kVec = 8;  // elements per thread per step

}  // namespace mpzero
