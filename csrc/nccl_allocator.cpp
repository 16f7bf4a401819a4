// NCCL user-buffer allocator: ncclMemAlloc / ncclMemFree for a torch.cuda.MemPool.
//
// NCCL is not linked: its symbols are resolved once, at the first use, first from what the
// process has already loaded (RTLD_DEFAULT: torch's own libnccl), then from libnccl.so.2.
// The CUDA runtime is the only dependency, so the file also compiles on its own.
#include "nccl_allocator.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>

namespace {
// ncclResult_t is a C enum: returned in an int register, 0 = ncclSuccess.
using MemAllocFn = int (*)(void**, size_t);
using MemFreeFn = int (*)(void*);
using ErrorStringFn = const char* (*)(int);
using GetVersionFn = int (*)(int*);

struct Nccl {
  MemAllocFn mem_alloc = nullptr;
  MemFreeFn mem_free = nullptr;
  ErrorStringFn error_string = nullptr;
  mpzero::NcclAllocatorInfo info;
};

std::string library_of(const void* address) {
  Dl_info dl{};
  if (address != nullptr && dladdr(address, &dl) != 0 && dl.dli_fname != nullptr) {
    return dl.dli_fname;
  }
  return "";
}

template <typename F>
F symbol(void* handle, const char* name) {
  return reinterpret_cast<F>(dlsym(handle, name));
}

// Both allocation symbols from ``handle``, plus the optional error-string and version ones.
bool resolve_from(void* handle, Nccl& n) {
  auto mem_alloc = symbol<MemAllocFn>(handle, "ncclMemAlloc");
  auto mem_free = symbol<MemFreeFn>(handle, "ncclMemFree");
  if (mem_alloc == nullptr || mem_free == nullptr) return false;
  n.mem_alloc = mem_alloc;
  n.mem_free = mem_free;
  n.error_string = symbol<ErrorStringFn>(handle, "ncclGetErrorString");
  auto get_version = symbol<GetVersionFn>(handle, "ncclGetVersion");
  int version = 0;
  if (get_version != nullptr && get_version(&version) == 0) n.info.nccl_version = version;
  n.info.found = true;
  n.info.nccl_library = library_of(reinterpret_cast<const void*>(mem_alloc));
  return true;
}

Nccl resolve() {
  Nccl n;
  n.info.library_path = library_of(reinterpret_cast<const void*>(&mpzero_nccl_alloc));
  if (resolve_from(RTLD_DEFAULT, n)) {
    n.info.lookup = "process";
    return n;
  }
  // Loaded but not global (torch's libnccl, as Python loads it) or not loaded at all.
  void* handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  const bool loaded = handle != nullptr;
  if (!loaded) handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    n.info.error = std::string("ncclMemAlloc/ncclMemFree are not loaded in this process and "
                               "libnccl.so.2 cannot be opened (") +
                   (why != nullptr ? why : "no reason given") + ")";
    return n;
  }
  if (resolve_from(handle, n)) {
    n.info.lookup = loaded ? "libnccl.so.2 (already loaded)" : "libnccl.so.2";
    return n;  // the handle stays open: the functions are used for the process's lifetime
  }
  std::string where = library_of(dlsym(handle, "ncclGetVersion"));
  n.info.error = "libnccl.so.2" + (where.empty() ? std::string() : " (" + where + ")") +
                 " has no ncclMemAlloc/ncclMemFree (they need NCCL 2.19 or newer)";
  dlclose(handle);
  return n;
}

const Nccl& nccl() {
  static const Nccl n = resolve();  // thread-safe one-time initialisation
  return n;
}

std::atomic<size_t> live_allocations{0};
std::atomic<size_t> live_bytes{0};

std::mutex error_mutex;
std::string last_error;

void set_error(const std::string& message) {
  std::lock_guard<std::mutex> lock(error_mutex);
  last_error = message;
}

std::string nccl_error(int code) {
  const char* text = nccl().error_string != nullptr ? nccl().error_string(code) : nullptr;
  return "NCCL error " + std::to_string(code) + (text != nullptr ? std::string(": ") + text : "");
}

// Makes ``device`` current for its lifetime and restores the previous device.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      error_ = cudaGetLastError();
      return;
    }
    if (device >= 0 && device != previous_) {
      error_ = cudaSetDevice(device);
      switched_ = error_ == cudaSuccess;
    }
  }
  ~DeviceScope() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  cudaError_t error() const { return error_; }

 private:
  int previous_ = -1;
  bool switched_ = false;
  cudaError_t error_ = cudaSuccess;
};
}  // namespace

extern "C" void* mpzero_nccl_alloc(size_t size, int device, cudaStream_t /*stream*/) {
  const Nccl& n = nccl();
  if (!n.info.found) {
    set_error("mpzero_nccl_alloc: " + n.info.error);
    return nullptr;
  }
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) {
    set_error("mpzero_nccl_alloc: cannot make device " + std::to_string(device) +
              " current: " + cudaGetErrorString(scope.error()));
    return nullptr;
  }
  void* ptr = nullptr;
  const int rc = n.mem_alloc(&ptr, size);
  if (rc != 0 || ptr == nullptr) {
    cudaGetLastError();  // leave no CUDA error behind for torch's next check
    set_error("ncclMemAlloc(" + std::to_string(size) + " bytes) on device " +
              std::to_string(device) + " failed: " + nccl_error(rc));
    return nullptr;
  }
  live_allocations += 1;
  live_bytes += size;
  return ptr;
}

extern "C" void mpzero_nccl_free(void* ptr, size_t size, int device,
                                 cudaStream_t /*stream*/) {
  if (ptr == nullptr) return;
  const Nccl& n = nccl();
  if (!n.info.found) return;  // nothing was allocated by us then
  DeviceScope scope(device);
  const int rc = n.mem_free(ptr);
  if (rc != 0) {
    cudaGetLastError();
    const std::string message = "ncclMemFree on device " + std::to_string(device) +
                                " failed: " + nccl_error(rc);
    set_error(message);
    std::fprintf(stderr, "mpzero: %s\n", message.c_str());
    return;
  }
  live_allocations -= 1;
  live_bytes -= size;
}

namespace mpzero {
NcclAllocatorInfo nccl_allocator_info() {
  NcclAllocatorInfo info = nccl().info;
  info.live_allocations = live_allocations.load();
  info.live_bytes = live_bytes.load();
  return info;
}

std::string nccl_allocator_last_error(bool clear) {
  std::lock_guard<std::mutex> lock(error_mutex);
  std::string message = last_error;
  if (clear) last_error.clear();
  return message;
}
}  // namespace mpzero
