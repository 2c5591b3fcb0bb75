// An emulated CUDA device for torch's CPU build: the C++ half of tests/emulated.
//
// Loaded (RTLD_GLOBAL) before `import torch` by memo_ext/simulate/runtime.py, so that torch's C++
// side finds, when it first asks:
//   * CUDA hooks that say a device exists (`at::hasCUDA()`, the accelerator autograd's engine
//     asks for), with CUDA generators, and torch's pinned-memory allocator as far as the bytes
//     go: every block rounded up to a power of two and cached by that size (what
//     `CachingHostAllocator` does), `is_pinned` true on them and on cudaHostRegister'ed ranges;
//   * a device guard for CUDA (c10's FakeGuardImpl), so autograd runs CUDA nodes on its device
//     threads as it does on a GPU;
//   * a CUDA kernel for reading a scalar (`.item()` below Python): 0 / false, since the tensors
//     of the device are FakeTensors and hold no data;
//   * a meta allocator whose storages carry a token as their data pointer and report their
//     release: FakeTensors live on meta storages, so this is how the Python half learns that a
//     device storage died, and how its pluggable-allocator block is freed on the thread that
//     drops it, at that moment;
//   * the CUDA runtime entry points the allocator core resolves (cudaMalloc / cudaFree /
//     cudaGetDevice / cudaGetLastError; host memory, with an optional capacity), and a caller
//     of a pluggable allocator's `alloc` that behaves as torch's CUDAPluggableAllocator does.
// Everything is reached from Python through ctypes (the extern "C" functions at the end).
#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/empty.h>
#include <c10/core/Allocator.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/FakeGuardImpl.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);

// ---- generators ------------------------------------------------------------------------------

// A CUDA generator's state is (seed, Philox offset); so is this one's, in 16 bytes.
struct EmulatedGenerator final : c10::GeneratorImpl {
  explicit EmulatedGenerator(c10::DeviceIndex index)
      : c10::GeneratorImpl(c10::Device(c10::DeviceType::CUDA, index),
                           c10::DispatchKeySet(c10::DispatchKey::CUDA)) {}
  void set_current_seed(uint64_t seed) override {
    seed_ = seed;
    offset_ = 0;
  }
  void set_offset(uint64_t offset) override { offset_ = offset; }
  uint64_t get_offset() const override { return offset_; }
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override { return seed_ = c10::default_rng_seed_val; }
  void set_state(const c10::TensorImpl& state) override {
    TORCH_CHECK(state.numel() == 16, "an emulated CUDA generator's state holds 16 bytes");
    const auto* bytes = static_cast<const uint8_t*>(state.data());
    std::memcpy(&seed_, bytes, 8);
    std::memcpy(&offset_, bytes + 8, 8);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    // below the dispatcher, as CUDA's generator makes it: a tensor mode active in the caller
    // (a FakeTensorMode tracing) must not turn the state into a tensor without data
    auto state = at::detail::empty_cpu({16}, at::kByte, std::nullopt, std::nullopt, std::nullopt,
                                       std::nullopt);
    auto* bytes = static_cast<uint8_t*>(state.data_ptr());
    std::memcpy(bytes, &seed_, 8);
    std::memcpy(bytes + 8, &offset_, 8);
    return state.getIntrusivePtr();
  }
  EmulatedGenerator* clone_impl() const override {
    auto* copy = new EmulatedGenerator(device().index());
    copy->seed_ = seed_;
    copy->offset_ = offset_;
    return copy;
  }
  uint64_t seed_ = c10::default_rng_seed_val;
  uint64_t offset_ = 0;
};

// ---- pinned host memory ----------------------------------------------------------------------

std::mutex host_mutex;
std::unordered_map<void*, size_t> pinned_live;               // block -> rounded bytes
std::unordered_map<size_t, std::vector<void*>> pinned_free;  // rounded bytes -> cached blocks
std::map<uintptr_t, size_t> registered;                      // cudaHostRegister'ed ranges
size_t pinned_reserved = 0, registered_bytes = 0, registered_peak = 0;

size_t power_of_two_ceil(size_t n) {
  size_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

void release_pinned(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(host_mutex);
  auto it = pinned_live.find(ptr);
  if (it == pinned_live.end()) return;
  pinned_free[it->second].push_back(ptr);  // cached, never returned (no empty_cache here)
  pinned_live.erase(it);
}

struct EmulatedPinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nullptr;
    if (nbytes > 0) {
      size_t rounded = power_of_two_ceil(nbytes);
      std::lock_guard<std::mutex> lock(host_mutex);
      auto& cached = pinned_free[rounded];
      if (!cached.empty()) {
        ptr = cached.back();
        cached.pop_back();
      } else {
        ptr = std::aligned_alloc(4096, (rounded + 4095) / 4096 * 4096);
        TORCH_CHECK_WITH(OutOfMemoryError, ptr != nullptr, "no host memory to pin ", rounded,
                         " bytes");
        pinned_reserved += rounded;
      }
      pinned_live[ptr] = rounded;
    }
    return {ptr, ptr, &release_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

EmulatedPinnedAllocator pinned_allocator;

bool is_pinned(const void* data) {
  auto address = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(host_mutex);
  for (const auto& [block, size] : pinned_live) {
    auto start = reinterpret_cast<uintptr_t>(block);
    if (address >= start && address < start + size) return true;
  }
  auto it = registered.upper_bound(address);
  if (it == registered.begin()) return false;
  --it;
  return address < it->first + it->second;
}

// ---- hooks -----------------------------------------------------------------------------------

// GPUs of the emulated machine. The current device is FakeGuardImpl's, per thread as CUDA's is:
// autograd's device thread for GPU i sets it to i, as it does on a GPU.
std::atomic<int> device_count{1};
using CudaGuard = c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>;

struct EmulatedCUDAHooks final : at::CUDAHooksInterface {
  explicit EmulatedCUDAHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return device_count; }
  c10::DeviceIndex getCurrentDevice() const override { return CudaGuard::getDeviceIndex(); }
  c10::DeviceIndex current_device() const override { return CudaGuard::getDeviceIndex(); }
  int getNumGPUs() const override { return device_count; }
  bool isPinnedPtr(const void* data) const override { return is_pinned(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    static at::Generator generator = at::make_generator<EmulatedGenerator>(0);
    return generator;
  }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    return at::make_generator<EmulatedGenerator>(index < 0 ? 0 : index);
  }
};

// ---- scalar reads ----------------------------------------------------------------------------

at::Scalar read_device_scalar(const at::Tensor& t) {
  if (t.scalar_type() == at::kBool) return at::Scalar(false);
  if (at::isFloatingType(t.scalar_type())) return at::Scalar(0.0);
  return at::Scalar(static_cast<int64_t>(0));
}

TORCH_LIBRARY_IMPL(aten, CUDA, m) { m.impl("_local_scalar_dense", read_device_scalar); }

// ---- meta storages that report their release -------------------------------------------------

// Tokens are never dereferenced: meta storages hold no data. A token is its storage's identity
// while the storage lives (Python reads it with memo_emulated_storage_token). A device block a
// pluggable allocator gave the storage is bound to its token and freed, through the allocator's
// `free`, by the thread that releases the storage, at that moment (as torch's deleter does).
using FreeFn = void (*)(void*, size_t, int, void*);
struct BoundBlock {
  FreeFn free_fn;
  void* ptr;
  size_t nbytes;
  void* stream;
};
std::atomic<uintptr_t> next_token{4096};
std::mutex released_mutex;
std::vector<uintptr_t> released;
std::unordered_map<uintptr_t, BoundBlock> bound;

void release_token(void* ctx) {
  auto token = reinterpret_cast<uintptr_t>(ctx);
  BoundBlock block{};
  {
    std::lock_guard<std::mutex> lock(released_mutex);
    released.push_back(token);
    auto it = bound.find(token);
    if (it == bound.end()) return;
    block = it->second;
    bound.erase(it);
  }
  block.free_fn(block.ptr, block.nbytes, 0, block.stream);
}

struct TokenMetaAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    // 64-byte steps keep tokens apart like addresses; the token is also the deleter's context
    auto token = next_token.fetch_add(64 + (nbytes / 64) * 64);
    auto* ptr = reinterpret_cast<void*>(token);
    return {ptr, ptr, &release_token, c10::Device(c10::DeviceType::Meta)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release_token; }
  void copy_data(void*, const void*, std::size_t) const override {}
};

TokenMetaAllocator meta_allocator;

// ---- a stand-in CUDA runtime for the allocator core --------------------------------------------

std::mutex device_mutex;
std::unordered_map<void*, size_t> device_blocks;
size_t device_capacity = SIZE_MAX, device_in_use = 0;
long device_mallocs = 0, last_error_reads = 0;

}  // namespace

namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", EmulatedCUDAHooks);
}

__attribute__((constructor)) static void install_meta_allocator() {
  c10::SetAllocator(c10::DeviceType::Meta, &meta_allocator, /*priority=*/100);
}

extern "C" {

int memo_emulated_cuda_loaded() { return 1; }

// What the first CUDA call does on a GPU: torch's context marks the device initialised (until
// then it answers `is_pinned` with false, for instance).
void memo_emulated_init() { at::globalContext().lazyInitDevice(c10::DeviceType::CUDA); }

// Bytes torch's (emulated) pinned allocator holds, cached blocks included.
size_t memo_emulated_pinned_reserved() {
  std::lock_guard<std::mutex> lock(host_mutex);
  return pinned_reserved;
}

size_t memo_emulated_registered_bytes() {
  std::lock_guard<std::mutex> lock(host_mutex);
  return registered_bytes;
}

// cudaHostRegister / cudaHostUnregister: 0 (cudaSuccess), 712 (cudaErrorHostMemoryAlreadyRegistered:
// the range overlaps a registered one), 713 (cudaErrorHostMemoryNotRegistered).
// The most bytes registered at once since the last reset.
size_t memo_emulated_registered_peak(int reset) {
  std::lock_guard<std::mutex> lock(host_mutex);
  size_t peak = registered_peak;
  if (reset) registered_peak = registered_bytes;
  return peak;
}

int memo_emulated_host_register(void* ptr, size_t size) {
  auto start = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(host_mutex);
  auto next = registered.lower_bound(start);
  if (next != registered.end() && next->first < start + size) return 712;
  if (next != registered.begin()) {
    auto previous = std::prev(next);
    if (previous->first + previous->second > start) return 712;
  }
  registered[start] = size;
  registered_bytes += size;
  registered_peak = std::max(registered_peak, registered_bytes);
  return 0;
}

int memo_emulated_host_unregister(void* ptr) {
  std::lock_guard<std::mutex> lock(host_mutex);
  auto it = registered.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == registered.end()) return 713;
  registered_bytes -= it->second;
  registered.erase(it);
  return 0;
}

// The token of a meta storage, from its StorageImpl (Python's `untyped_storage()._cdata`),
// without the data-pointer access check FakeTensors' storages carry.
uintptr_t memo_emulated_storage_token(void* storage_impl) {
  auto* storage = static_cast<c10::StorageImpl*>(storage_impl);
  return reinterpret_cast<uintptr_t>(storage->_mutable_data_ptr_no_checks().get());
}

// The tokens of meta storages released since the last call, by any thread (up to `capacity`;
// the count is returned, the rest wait for the next call).
size_t memo_emulated_take_released(uintptr_t* out, size_t capacity) {
  std::lock_guard<std::mutex> lock(released_mutex);
  size_t n = std::min(capacity, released.size());
  std::copy(released.begin(), released.begin() + n, out);
  released.erase(released.begin(), released.begin() + n);
  return n;
}

// Free `ptr` with `free_fn(ptr, nbytes, 0, stream)` when the storage of `token` is released.
void memo_emulated_bind_block(uintptr_t token, void* free_fn, void* ptr, size_t nbytes,
                              void* stream) {
  std::lock_guard<std::mutex> lock(released_mutex);
  bound[token] = {reinterpret_cast<FreeFn>(free_fn), ptr, nbytes, stream};
}

// The CUDA runtime, as the allocator core resolves it from the process's symbols.
int cudaMalloc(void** ptr, size_t size) {
  std::lock_guard<std::mutex> lock(device_mutex);
  if (device_in_use + size > device_capacity) return 2;  // cudaErrorMemoryAllocation
  void* block = std::aligned_alloc(512, (size + 511) / 512 * 512);
  if (block == nullptr) return 2;
  device_blocks[block] = size;
  device_in_use += size;
  device_mallocs++;
  *ptr = block;
  return 0;
}

int cudaFree(void* ptr) {
  std::lock_guard<std::mutex> lock(device_mutex);
  auto it = device_blocks.find(ptr);
  if (it == device_blocks.end()) return 1;  // cudaErrorInvalidValue
  device_in_use -= it->second;
  device_blocks.erase(it);
  std::free(ptr);
  return 0;
}

int cudaGetDevice(int* device) {
  *device = CudaGuard::getDeviceIndex();
  return 0;
}

// The emulated machine's GPU count (at most c10's fake guard's 8).
void memo_emulated_set_device_count(int count) { device_count = count; }

// This thread's current device, as cudaGetDevice / cudaSetDevice see it.
int memo_emulated_current_device() { return CudaGuard::getDeviceIndex(); }

void memo_emulated_set_current_device(int index) {
  CudaGuard::setDeviceIndex(static_cast<c10::DeviceIndex>(index));
}

int cudaGetLastError() {
  std::lock_guard<std::mutex> lock(device_mutex);
  last_error_reads++;
  return 0;
}

// The device's memory: cudaMalloc fails past `bytes` in use (SIZE_MAX: no limit).
void memo_emulated_set_device_capacity(size_t bytes) {
  std::lock_guard<std::mutex> lock(device_mutex);
  device_capacity = bytes;
}

size_t memo_emulated_device_in_use() {
  std::lock_guard<std::mutex> lock(device_mutex);
  return device_in_use;
}

// What torch's CUDAPluggableAllocator::allocate does with a pluggable `alloc`: call it and wrap
// whatever pointer it returns (NULL included). A C++ exception it throws reaches the caller as
// torch turns it into a Python error: 0 a pointer (maybe NULL) in *out, 1 c10::OutOfMemoryError,
// 2 another c10::Error; the message goes to `message`.
int memo_emulated_pluggable_alloc(void* alloc_fn, size_t size, int device, void* stream,
                                  void** out, char* message, size_t message_bytes) {
  using AllocFn = void* (*)(size_t, int, void*);
  try {
    *out = reinterpret_cast<AllocFn>(alloc_fn)(size, device, stream);
    return 0;
  } catch (const c10::OutOfMemoryError& err) {
    std::snprintf(message, message_bytes, "%s", err.what_without_backtrace());
    return 1;
  } catch (const c10::Error& err) {
    std::snprintf(message, message_bytes, "%s", err.what_without_backtrace());
    return 2;
  }
}

}  // extern "C"
