// NCCL user-buffer allocator (nccl_ub=True): ncclMemAlloc / ncclMemFree behind the C
// entry points that torch.cuda.memory.CUDAPluggableAllocator loads from this library.
// No torch or NCCL header here: nccl_allocator.cpp builds on its own, and NCCL's two
// symbols are looked up at run time (dlsym), never linked.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

// Names of the two entry points, as CUDAPluggableAllocator(path, alloc_name, free_name)
// takes them (mpzero/nccl_allocator.py reads them from nccl_allocator_info()).
#define MPZERO_NCCL_ALLOC_NAME "mpzero_nccl_alloc"
#define MPZERO_NCCL_FREE_NAME "mpzero_nccl_free"

extern "C" {
// Allocate ``size`` bytes on ``device`` with ncclMemAlloc; nullptr on failure (the reason
// is kept for mpzero::nccl_allocator_last_error). ``stream`` is unused: NCCL memory is
// not stream-ordered.
__attribute__((visibility("default"))) void* mpzero_nccl_alloc(size_t size, int device,
                                                               cudaStream_t stream);
// Free memory from mpzero_nccl_alloc with ncclMemFree (on ``device``).
__attribute__((visibility("default"))) void mpzero_nccl_free(void* ptr, size_t size, int device,
                                                             cudaStream_t stream);
}

namespace mpzero {
// What the extension found: its own shared library's path (for CUDAPluggableAllocator),
// whether ncclMemAlloc/ncclMemFree resolved, and from where.
struct NcclAllocatorInfo {
  std::string library_path;  // this extension's .so
  bool found = false;        // both NCCL symbols resolved
  std::string nccl_library;  // the library that provides them ("" when not found)
  std::string lookup;        // "process" (global symbols) or "libnccl.so.2" (dlopen)
  int nccl_version = 0;      // ncclGetVersion's code (e.g. 22703), 0 when unknown
  std::string error;         // why not found ("" when found)
  size_t live_allocations = 0;  // allocations made here and not freed yet
  size_t live_bytes = 0;        // their bytes
};

NcclAllocatorInfo nccl_allocator_info();

// The last allocation/free failure's message ("" when none); ``clear`` resets it.
std::string nccl_allocator_last_error(bool clear);
}  // namespace mpzero
