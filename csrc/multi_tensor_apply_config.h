// Launch knobs of the multi-tensor kernels, shared by host-only and CUDA translation units.
#pragma once
#include <cstdint>

namespace mpzero {

struct LaunchConfig {
  int threads = 512;            // threads per block (<= kMaxThreads)
  int blocks_per_sm = 0;        // 0: as many as the occupancy calculator allows
  int64_t chunk_elems = 8192;   // elements per chunk (rounded to whole block steps); 8192
                                // with the loads ahead was the fastest of the H200 sweep
                                // (docs/kernels.md)
  bool balance_chunks = true;   // elementwise launches on a persistent grid: pick the
                                // chunk near chunk_elems that spreads the work most
                                // evenly over the grid
  bool split_access = true;     // Adam kernels: a thread's 8 elements are two runs of 4,
                                // half a block step apart (each load instruction of a
                                // warp covers one contiguous span); false: 8 in a row
                                // (the loads ahead need split access; docs/kernels.md)
  bool prefetch = true;         // Adam kernels with split access: the next block step's
                                // loads issued before this step's math and stores (1-4%
                                // faster on an H200, noise on an H100)
  bool persistent = false;      // elementwise launches: a persistent grid (SMs x resident
                                // blocks walking the chunks) instead of one block per
                                // chunk (4-5% slower on an H100, docs/kernels.md)
};
LaunchConfig& launch_config();

constexpr int kMaxThreads = 512;
constexpr int kVec = 8;  // elements per thread per step

}  // namespace mpzero
