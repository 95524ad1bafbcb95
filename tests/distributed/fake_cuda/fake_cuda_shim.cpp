// A CUDA that is "built and present" but runs nothing: for tracing the training step with fake
// CUDA tensors (FakeTensorMode) on a CPU-only torch wheel. Loaded with ctypes (RTLD_GLOBAL)
// before `import torch`, in the tracing process only. It registers
//   * a device guard for DeviceType::CUDA whose every operation is a no-op on device 0 (autograd
//     and the dispatcher switch devices through it; the stock wheel has none and aborts), and
//   * CUDA hooks that say "built, available, one device" (FakeTensor device checks, autocast,
//     torch.cuda.is_available() stay on the paths a GPU run takes), and
//   * a "pinned" host allocator: plain CPU memory whose blocks `is_pinned()` recognises, so
//     `pin_memory()` works and a check can tell pinned staging from pageable memory (a
//     non-blocking copy from pageable memory waits for the device on a real GPU).
// No kernel ever runs on a device: the tensors that say cuda are fake (FakeTensorMode) or CPU
// tensors tagged as cuda (tests/generation/device_syncs).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>

#include <map>
#include <mutex>

namespace {
using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;

struct FakeCudaGuard final : c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device) const override { return Device(DeviceType::CUDA, 0); }
  Device getDevice() const override { return Device(DeviceType::CUDA, 0); }
  void setDevice(Device) const override {}
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device) const noexcept override { return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, 0)); }
  Stream getNewStream(Device, int) const override { return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, 0)); }
  Stream exchangeStream(Stream) const noexcept override { return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, 0)); }
  DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const Stream&, const DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const Stream&) const override {}
};

// start -> size of every live "pinned" block
std::mutex pinned_mutex;
std::map<const char*, size_t>& pinned_blocks() {
  static std::map<const char*, size_t> blocks;
  return blocks;
}

void free_pinned(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    pinned_blocks().erase(static_cast<const char*>(ptr));
  }
  c10::free_cpu(ptr);
}

struct FakePinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* ptr = c10::alloc_cpu(n == 0 ? 1 : n);
    {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      pinned_blocks()[static_cast<const char*>(ptr)] = n == 0 ? 1 : n;
    }
    return {ptr, ptr, &free_pinned, Device(DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

FakePinnedAllocator pinned_allocator;

bool in_pinned_block(const void* data) {
  auto ptr = static_cast<const char*>(data);
  std::lock_guard<std::mutex> lock(pinned_mutex);
  auto& blocks = pinned_blocks();
  auto it = blocks.upper_bound(ptr);
  if (it == blocks.begin()) return false;
  --it;
  return ptr < it->first + it->second;
}

struct FakeCudaHooks final : at::CUDAHooksInterface {
  explicit FakeCudaHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  void init() const override {}
  DeviceIndex deviceCount() const override { return 1; }
  int getNumGPUs() const override { return 1; }
  DeviceIndex current_device() const override { return 0; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(DeviceIndex) const override {}
  DeviceIndex exchangeDevice(DeviceIndex) const override { return 0; }
  DeviceIndex maybeExchangeDevice(DeviceIndex) const override { return 0; }
  void deviceSynchronize(DeviceIndex) const override {}
  bool isPinnedPtr(const void* data) const override { return in_pinned_block(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
};
}  // namespace

C10_REGISTER_GUARD_IMPL(CUDA, FakeCudaGuard);
namespace at {
// the key getCUDAHooks() looks up (as the real libtorch_cuda's REGISTER_CUDA_HOOKS(CUDAHooks))
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, FakeCudaHooks);
}  // namespace at
