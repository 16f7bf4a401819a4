// The process-wide launch configuration of the multi-tensor kernels.
#include <c10/util/Exception.h>

#include "messages.h"
#include "mpzero.h"
#include "multi_tensor_apply_config.h"

namespace mpzero {

LaunchConfig& launch_config() {
  static LaunchConfig cfg;
  return cfg;
}

void set_launch_config(int64_t threads, int64_t blocks_per_sm, int64_t chunk_elems) {
  LaunchConfig& cfg = launch_config();
  if (threads > 0) {
    TORCH_CHECK(threads % 32 == 0 && threads <= kMaxThreads,
                "mpzero: threads must be a multiple of 32 and <= ", num(kMaxThreads));
    cfg.threads = static_cast<int>(threads);
  }
  if (blocks_per_sm >= 0) cfg.blocks_per_sm = static_cast<int>(blocks_per_sm);
  if (chunk_elems > 0) cfg.chunk_elems = chunk_elems;
}

void set_chunk_balancing(bool on) { launch_config().balance_chunks = on; }
bool chunk_balancing() { return launch_config().balance_chunks; }

void set_split_access(bool on) { launch_config().split_access = on; }
bool split_access() { return launch_config().split_access; }

void set_prefetch(bool on) { launch_config().prefetch = on; }
bool prefetch() { return launch_config().prefetch; }

void set_persistent_grid(bool on) { launch_config().persistent = on; }
bool persistent_grid() { return launch_config().persistent; }

std::tuple<int64_t, int64_t, int64_t> get_launch_config() {
  const LaunchConfig& cfg = launch_config();
  return {cfg.threads, cfg.blocks_per_sm, cfg.chunk_elems};
}

}  // namespace mpzero
