// torch shim: the allocator core (core.c) behind torch's allocators.
//
// CPU: a c10::Allocator over the core, set with c10::SetCPUAllocator.
// CUDA: memo_cuda_alloc / memo_cuda_free, the pair torch's CUDAPluggableAllocator calls. torch
// wraps whatever pointer `alloc` returns, NULL included (no check), so a NULL from the core
// would become an illegal address at the first kernel, with a sticky CUDA error; the shim
// raises c10::OutOfMemoryError instead, which torch turns into torch.OutOfMemoryError.
//
// Compiled against torch's headers (no CUDA headers: a cudaStream_t is a pointer) by
// memo_ext/allocator/shim.py (torch.utils.cpp_extension.load, a plain library, no Python module)
// and driven through ctypes:
//   memo_shim_bind(core_so_path)               -> 0, or -1 with memo_shim_last_error()
//   memo_shim_install(core_so_path, priority)  -> 0, or -1 with memo_shim_last_error()
//   memo_shim_uninstall()                      -> 0, or -1 when not installed
// The core is found by dlopen of the same path ctypes loaded, so both share its state. Neither
// library is ever closed: tensors allocated while the shim was installed keep its deleter, and
// that deleter calls the core, after an uninstall too.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>

namespace {

using AllocFn = void* (*)(size_t, int, void*);
using FreeFn = void (*)(void*, size_t, int, void*);
using ErrorFn = const char* (*)();

AllocFn core_alloc = nullptr;
FreeFn core_free = nullptr;
ErrorFn core_last_error = nullptr;
c10::Allocator* previous = nullptr;  // the CPU allocator before install
uint8_t installed_priority = 0;
char last_error[512] = "no error";

// The CPU shim has no device and no stream: -1 and NULL (the core's host backend ignores both).
void release(void* ptr) {
  if (ptr != nullptr) {
    core_free(ptr, 0, -1, nullptr);
  }
}

struct CoreCpuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    // Empty storages get no memory, as with torch's default CPU allocator.
    void* ptr = nbytes == 0 ? nullptr : core_alloc(nbytes, -1, nullptr);
    TORCH_CHECK_WITH(
        OutOfMemoryError,
        nbytes == 0 || ptr != nullptr,
        "the MEMO allocator core could not allocate ",
        nbytes,
        " bytes of host memory");
    return {ptr, ptr, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &release;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CoreCpuAllocator allocator;

}  // namespace

extern "C" {

const char* memo_shim_last_error() {
  return last_error;
}

// Find the core's entry points (the same library, so the same state, as ctypes loaded).
int memo_shim_bind(const char* core_so_path) {
  void* handle = dlopen(core_so_path, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    std::snprintf(last_error, sizeof last_error, "cannot load the core: %s.", dlerror());
    return -1;
  }
  auto alloc = reinterpret_cast<AllocFn>(dlsym(handle, "memo_alloc"));
  auto free = reinterpret_cast<FreeFn>(dlsym(handle, "memo_free"));
  if (alloc == nullptr || free == nullptr) {
    std::snprintf(
        last_error, sizeof last_error, "%s has no memo_alloc / memo_free.", core_so_path);
    return -1;
  }
  core_alloc = alloc;
  core_free = free;
  core_last_error = reinterpret_cast<ErrorFn>(dlsym(handle, "memo_last_error"));
  return 0;
}

int memo_shim_install(const char* core_so_path, int priority) {
  if (previous != nullptr) {
    std::snprintf(last_error, sizeof last_error, "the CPU shim is already installed.");
    return -1;
  }
  if (priority < 0 || priority > 255) {
    std::snprintf(last_error, sizeof last_error, "priority %d is not in 0..255.", priority);
    return -1;
  }
  if (memo_shim_bind(core_so_path) != 0) return -1;
  c10::Allocator* before = c10::GetCPUAllocator();
  c10::SetCPUAllocator(&allocator, static_cast<uint8_t>(priority));
  if (c10::GetCPUAllocator() != &allocator) {
    std::snprintf(
        last_error,
        sizeof last_error,
        "another CPU allocator holds a priority above %d; the shim was not installed.",
        priority);
    return -1;
  }
  previous = before;
  installed_priority = static_cast<uint8_t>(priority);
  return 0;
}

int memo_shim_uninstall() {
  if (previous == nullptr) {
    std::snprintf(last_error, sizeof last_error, "the CPU shim is not installed.");
    return -1;
  }
  // The same priority wins again (c10 replaces on priority >= the current one).
  c10::SetCPUAllocator(previous, installed_priority);
  previous = nullptr;
  return 0;
}

int memo_shim_installed() {
  return previous != nullptr && c10::GetCPUAllocator() == &allocator;
}

// CUDA: `alloc` and `free` of torch.cuda.memory.CUDAPluggableAllocator (cudaStream_t is a
// pointer). The core's own sentence says why it failed (its backend, a bad size).
void* memo_cuda_alloc(size_t size, int device, void* stream) {
  TORCH_CHECK(core_alloc != nullptr, "the MEMO allocator shim is not bound to a core");
  if (size == 0) return nullptr;
  void* ptr = core_alloc(size, device, stream);
  TORCH_CHECK_WITH(
      OutOfMemoryError,
      ptr != nullptr,
      "CUDA out of memory. Tried to allocate ",
      size,
      " B on device ",
      device,
      " through the MEMO allocator core: ",
      core_last_error != nullptr ? core_last_error() : "no reason given");
  return ptr;
}

void memo_cuda_free(void* ptr, size_t size, int device, void* stream) {
  if (ptr != nullptr) core_free(ptr, size, device, stream);
}

}  // extern "C"
