// An emulated MUSA device for tests: torch's PrivateUse1 backend (renamed "musa" from Python, as
// torch_musa renames it), holding tensors in host memory.
//
// - Memory: a host allocator that counts bytes per card (memory_allocated, the peak).
// - Cards: a device guard with N virtual cards (N from MUSA_VISIBLE_DEVICES, set in configure()).
// - Copies: _copy_from between cpu and musa (and between cards), through CPU views of the same
//   memory.
// - Every other operator: one boxed fallback that runs the operator's CPU kernel on CPU views of
//   the musa tensors' memory (no copies of the inputs), then hands back musa tensors. Like real
//   hardware, it refuses an operator that mixes a musa tensor with a CPU tensor (a 0-dim one
//   too, unless the operator is NoCheck in native_functions.yaml and reads it as a number), or
//   tensors of two cards: a fallback that quietly accepted the mix would hide exactly the bugs
//   this device is for.
// - RNG: a generator per card (a musa generator, as torch.Generator("musa") makes); random
//   operators draw from the card's generator, never from the CPU's, and refuse a CPU generator as
//   a card's kernels do; a CPU operator refuses the card's generator, as the CPU kernels do.
// - Non-blocking copies to page-locked host memory complete at the next synchronisation point
//   (stream, event or device synchronize, or a blocking read of the card), as a card's copy
//   engine fills them; until then the host tensor holds poison (NaN, or 0xA5 in every byte of
//   an integer), so a read before the synchronisation fails here as it would race on a card.
// - Forks: a process forked after it asked for the cards or used one cannot use them (the
//   runtime cannot be re-initialized in a forked child).
// - Autocast: the CUDA autocast op lists, registered for AutocastPrivateUse1.
// - Collectives: a c10d backend ("mccl" from Python) that runs gloo on CPU views of the musa
//   tensors' memory, and takes musa tensors only, as MCCL does.
//
// Written after PyTorch's PrivateUse1 documentation and its OpenReg test backend (read, not
// copied). What it cannot show: muDNN kernels, real numerics, speed, memory limits, MCCL topology
// and the driver.

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/extension.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <pthread.h>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace emu {

constexpr c10::DeviceType kDev = c10::DeviceType::PrivateUse1;

// ---------------------------------------------------------------------------------------------
// Cards
// ---------------------------------------------------------------------------------------------

// A card's generator: a musa device to torch (so a kernel can tell it from a CPU generator, as
// check_generator in ATen/core/Generator.h does for CUDA's), drawing through a CPU generator that
// the CPU kernels are handed in its place.
struct DeviceGenerator final : c10::GeneratorImpl {
  DeviceGenerator(c10::DeviceIndex index, uint64_t seed)
      : c10::GeneratorImpl(
            c10::Device(kDev, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        host(at::make_generator<at::CPUGeneratorImpl>(seed)) {}
  void set_current_seed(uint64_t seed) override {
    std::lock_guard<std::mutex> lock(host.mutex());
    host.set_current_seed(seed);
  }
  void set_offset(uint64_t offset) override {
    std::lock_guard<std::mutex> lock(host.mutex());
    host.set_offset(offset);
  }
  uint64_t get_offset() const override {
    std::lock_guard<std::mutex> lock(host.mutex());
    return host.get_offset();
  }
  uint64_t current_seed() const override {
    std::lock_guard<std::mutex> lock(host.mutex());
    return host.current_seed();
  }
  uint64_t seed() override {
    std::lock_guard<std::mutex> lock(host.mutex());
    return host.seed();
  }
  void set_state(const c10::TensorImpl& state) override {
    std::lock_guard<std::mutex> lock(host.mutex());
    host.unsafeGetGeneratorImpl()->set_state(state);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    std::lock_guard<std::mutex> lock(host.mutex());
    return host.unsafeGetGeneratorImpl()->get_state();
  }
  mutable at::Generator host;  // what the CPU kernels draw from

 private:
  DeviceGenerator* clone_impl() const override {
    auto* copy = new DeviceGenerator(device_.index(), 0);
    copy->set_state(*get_state());
    return copy;
  }
};

at::Generator new_generator(c10::DeviceIndex index, uint64_t seed) {
  return at::make_generator<DeviceGenerator>(index, seed);
}

// The CPU generator a card's generator draws through.
at::Generator host_generator(const at::Generator& generator) {
  return generator.get<DeviceGenerator>()->host;
}

struct Card {
  std::atomic<int64_t> allocated{0};
  std::atomic<int64_t> peak{0};
  at::Generator generator;  // a DeviceGenerator
};

std::vector<std::unique_ptr<Card>> g_cards;  // the visible cards, by ordinal
thread_local c10::DeviceIndex t_current = 0;

// A process forked after its parent asked for the cards or used one cannot use them: torch_musa's
// csrc/core/Module.cpp arms a pthread_atfork handler (poison_fork) in _musa_getDeviceCount (so
// torch.musa.device_count and is_available) and _musa_init, which marks every later child as in
// a bad fork, as torch/csrc/cuda/Module.cpp does; core/_lazy_init.py then refuses with this line.
std::atomic<bool> g_armed{false};  // the fork handler is armed
std::atomic<bool> g_used{false};   // this process initialized the card
std::atomic<bool> g_bad_fork{false};

void forked_child() {
  g_bad_fork = g_armed.load();
}

void use_card() {
  TORCH_CHECK(
      !g_bad_fork,
      "Cannot re-initialize MUSA in forked subprocess. To use MUSA with multiprocessing, you must "
      "use the 'spawn' start method");
  g_armed = true;
  g_used = true;
}

c10::DeviceIndex count() {
  return static_cast<c10::DeviceIndex>(g_cards.size());
}

void check_index(int64_t index) {
  TORCH_CHECK(
      index >= 0 && index < count(),
      "invalid device ordinal musa:", static_cast<int>(index), " (", count(), " visible device",
      count() == 1 ? "" : "s", "; MUSA_VISIBLE_DEVICES decides which)");
}

Card& card(int64_t index) {
  check_index(index);
  return *g_cards[index];
}

// ---------------------------------------------------------------------------------------------
// Memory: host memory, counted per card
// ---------------------------------------------------------------------------------------------

struct Block {
  int64_t bytes;
  c10::DeviceIndex index;
};

void free_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  // The data pointer was stored after the Block (one allocation holds both).
  void* data = *reinterpret_cast<void**>(block + 1);
  if (block->index < count()) {
    g_cards[block->index]->allocated -= block->bytes;
  }
  c10::free_cpu(data);
  delete[] reinterpret_cast<char*>(block);
}

struct DeviceAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    use_card();
    c10::DeviceIndex index = t_current;
    check_index(index);
    c10::Device device(kDev, index);
    if (nbytes == 0) {
      return {nullptr, nullptr, &c10::detail::deleteNothing, device};
    }
    void* data = c10::alloc_cpu(nbytes);
    auto* raw = new char[sizeof(Block) + sizeof(void*)];
    auto* block = new (raw) Block{static_cast<int64_t>(nbytes), index};
    *reinterpret_cast<void**>(block + 1) = data;
    Card& c = *g_cards[index];
    int64_t now = (c.allocated += static_cast<int64_t>(nbytes));
    int64_t peak = c.peak.load();
    while (now > peak && !c.peak.compare_exchange_weak(peak, now)) {
    }
    return {data, block, &free_block, device};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr;
  }
  void copy_data(void* dest, const void* src, std::size_t n) const override {
    std::memcpy(dest, src, n);
  }
};

DeviceAllocator g_allocator;
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_allocator);

// Page-locked host memory as accelerators have it: plain host memory, remembered so that
// is_pinned() answers as it does on a device.
std::mutex g_pinned_mutex;
std::map<uintptr_t, size_t> g_pinned;

void free_pinned(void* data) {
  {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    g_pinned.erase(reinterpret_cast<uintptr_t>(data));
  }
  c10::free_cpu(data);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* data = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    if (data) {
      std::lock_guard<std::mutex> lock(g_pinned_mutex);
      g_pinned[reinterpret_cast<uintptr_t>(data)] = nbytes;
    }
    return {data, data, &free_pinned, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &free_pinned;
  }
  void copy_data(void* dest, const void* src, std::size_t n) const override {
    std::memcpy(dest, src, n);
  }
};

PinnedAllocator g_pinned_allocator;

bool is_pinned_ptr(const void* ptr) {
  auto address = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(g_pinned_mutex);
  auto it = g_pinned.upper_bound(address);
  if (it == g_pinned.begin()) {
    return false;
  }
  --it;
  return address < it->first + it->second;
}

// Replace a storage's memory with a larger block of the same card (resize_ and friends).
void grow_storage(c10::StorageImpl* storage, size_t nbytes) {
  if (nbytes <= storage->nbytes()) {
    return;
  }
  TORCH_CHECK(storage->resizable(), "Trying to resize storage that is not resizable");
  c10::DeviceIndex index = storage->device().index();
  c10::DeviceIndex saved = t_current;
  t_current = index;
  c10::DataPtr bigger = g_allocator.allocate(nbytes);
  t_current = saved;
  if (storage->nbytes() > 0) {
    std::memcpy(bigger.get(), storage->data(), storage->nbytes());
  }
  storage->set_data_ptr_noswap(std::move(bigger));
  storage->set_nbytes(nbytes);
}

// ---------------------------------------------------------------------------------------------
// Non-blocking device-to-host copies: filled at the next synchronisation point
// ---------------------------------------------------------------------------------------------

// A copy a card's stream has queued: the host tensor, what the stream will write into it (the
// card's work runs in order, and the emulator runs it at once, so the source as it is now) and
// the copy's place in the order of queued work.
struct Pending {
  at::Tensor host;
  at::Tensor value;
  c10::DeviceIndex card;
  uint64_t order;
};

std::mutex g_pending_mutex;
std::vector<Pending> g_pending;
uint64_t g_order = 0;  // guarded by g_pending_mutex

uint64_t current_order() {
  std::lock_guard<std::mutex> lock(g_pending_mutex);
  return g_order;
}

// The poison a host tensor holds until its copy lands: NaN where the dtype has one, else 0xA5 in
// every byte (true for bool). Returns false for a dtype it cannot fill (then copy at once).
bool poison(const at::Tensor& t) {
  if (t.is_floating_point() || t.is_complex()) {
    t.fill_(std::numeric_limits<double>::quiet_NaN());
  } else if (t.scalar_type() == at::kBool) {
    t.fill_(true);
  } else if (at::isIntegralType(t.scalar_type(), /*includeBool=*/false)) {
    auto marker = at::empty({}, t.options());
    std::memset(marker.data_ptr(), 0xA5, marker.element_size());
    t.fill_(marker);
  } else {
    return false;
  }
  return true;
}

// Land the queued copies of `index` (all cards where it is negative) up to `order`.
void land(c10::DeviceIndex index, uint64_t order = UINT64_MAX) {
  std::vector<Pending> due;
  {
    std::lock_guard<std::mutex> lock(g_pending_mutex);
    auto keep = g_pending.begin();
    for (auto& copy : g_pending) {
      if ((index < 0 || copy.card == index) && copy.order <= order) {
        due.push_back(std::move(copy));
      } else {
        *keep++ = std::move(copy);
      }
    }
    g_pending.erase(keep, g_pending.end());
  }
  for (auto& copy : due) {
    copy.host.copy_(copy.value);
  }
}

// ---------------------------------------------------------------------------------------------
// Device guard: which card is current, per thread; streams and events of a synchronous device
// ---------------------------------------------------------------------------------------------

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kDev;
  }
  c10::Device exchangeDevice(c10::Device device) const override {
    c10::Device old = getDevice();
    if (device.index() != old.index()) {
      setDevice(device);
    }
    return old;
  }
  c10::Device getDevice() const override {
    return {kDev, t_current};
  }
  void setDevice(c10::Device device) const override {
    TORCH_CHECK(device.type() == kDev, "expected a musa device, got ", device);
    if (device.index() >= 0) {
      check_index(device.index());
      t_current = device.index();
    }
  }
  void uncheckedSetDevice(c10::Device device) const noexcept override {
    if (device.index() >= 0) {
      t_current = device.index();
    }
  }
  c10::Stream getStream(c10::Device device) const override {
    return c10::Stream(c10::Stream::DEFAULT, device.index() < 0 ? getDevice() : device);
  }
  c10::Stream getDefaultStream(c10::Device device) const override {
    return getStream(device);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device device, bool) const override {
    return getStream(device);
  }
  c10::Stream getNewStream(c10::Device device, int) const override {
    return getStream(device);
  }
  c10::Stream exchangeStream(c10::Stream stream) const override {
    return getStream(stream.device());
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return count();
  }
  // Work runs on the host as it is queued, except non-blocking copies to the host (Pending):
  // an event remembers how far the queue was when it was recorded (stored in its handle, plus
  // one so that a recorded event is never null), and waiting for it or asking whether it has
  // happened lands the copies queued before it.
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag)
      const override {
    *event = reinterpret_cast<void*>(static_cast<uintptr_t>(current_order()) + 1);
  }
  void block(void*, const c10::Stream&) const override {}  // a wait on the card, not the host
  bool queryEvent(void* event) const override {
    synchronizeEvent(event);
    return true;
  }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream& stream) const override {
    synchronizeStream(stream);
    return true;
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    land(stream.device_index() < 0 ? t_current : stream.device_index());
  }
  void synchronizeEvent(void* event) const override {
    if (event != nullptr) {  // never recorded: nothing to wait for
      land(-1, static_cast<uint64_t>(reinterpret_cast<uintptr_t>(event)) - 1);
    }
  }
  void synchronizeDevice(const c10::DeviceIndex index) const override {
    land(index < 0 ? t_current : index);
  }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override {
    return 0.0;
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

// ---------------------------------------------------------------------------------------------
// Hooks: what ATen asks of a PrivateUse1 backend (generators, pinned memory, storage resize)
// ---------------------------------------------------------------------------------------------

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return count() > 0;
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    return card(index < 0 ? t_current : index).generator;
  }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    index = index < 0 ? t_current : index;
    check_index(index);
    return new_generator(index, c10::detail::getNonDeterministicRandom());
  }
  c10::Device getDeviceFromPtr(void*) const override {
    return {kDev, t_current};
  }
  bool isPinnedPtr(const void* data) const override {
    return is_pinned_ptr(data);
  }
  c10::Allocator* getPinnedMemoryAllocator() const override {
    return &g_pinned_allocator;
  }
  bool hasPrimaryContext(c10::DeviceIndex index) const override {
    return index >= 0 && index < count();
  }
  c10::DeviceIndex deviceCount() const override {
    return count();
  }
  void setCurrentDevice(c10::DeviceIndex index) const override {
    check_index(index);
    t_current = index;
  }
  c10::DeviceIndex getCurrentDevice() const override {
    return t_current;
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex index) const override {
    c10::DeviceIndex old = t_current;
    setCurrentDevice(index);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex index) const override {
    return exchangeDevice(index);
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    auto* impl = storage.unsafeGetStorageImpl();
    if (nbytes > impl->nbytes()) {
      grow_storage(impl, nbytes);
    } else {
      impl->set_nbytes(nbytes);
    }
  }
};

// ---------------------------------------------------------------------------------------------
// CPU views of musa memory
// ---------------------------------------------------------------------------------------------

void release_storage(void* ctx) {
  delete static_cast<c10::Storage*>(ctx);
}

// A CPU tensor over the same memory as a musa tensor (same sizes, strides and offset). Its
// storage keeps the musa storage alive and may be resized by an out= kernel (which then moves it
// to new host memory; the fallback copies that back).
at::Tensor cpu_view(const at::Tensor& t) {
  const c10::Storage& storage = t.storage();
  c10::DataPtr data(
      storage.mutable_data(), new c10::Storage(storage), &release_storage, c10::Device(c10::kCPU));
  c10::Storage host(
      c10::Storage::use_byte_size_t(), storage.nbytes(), std::move(data), c10::GetCPUAllocator(),
      /*resizable=*/true);
  auto out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(host), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return out;
}

at::Tensor empty_strided_on(
    c10::IntArrayRef size, c10::IntArrayRef stride, at::ScalarType dtype, c10::DeviceIndex index) {
  c10::DeviceIndex saved = t_current;
  check_index(index);
  t_current = index;
  auto out = at::detail::empty_strided_generic(
      size, stride, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), dtype);
  t_current = saved;
  return out;
}

// A musa copy of a CPU tensor, same sizes and strides.
at::Tensor to_device(const at::Tensor& cpu, c10::DeviceIndex index) {
  if (!cpu.is_non_overlapping_and_dense()) {
    return to_device(cpu.contiguous(), index);
  }
  auto out = empty_strided_on(cpu.sizes(), cpu.strides(), cpu.scalar_type(), index);
  cpu_view(out).copy_(cpu);
  return out;
}

// A musa view of `base`'s storage with `like`'s dtype, sizes, strides and offset.
at::Tensor device_view(const at::Tensor& base, const at::Tensor& like) {
  auto out = at::detail::make_tensor<c10::TensorImpl>(
      c10::TensorImpl::VIEW, c10::Storage(base.storage()), base.key_set(), like.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(
      like.sizes(), like.strides(), like.storage_offset());
  return out;
}

// ---------------------------------------------------------------------------------------------
// Native kernels: allocation, metadata, copies
// ---------------------------------------------------------------------------------------------

c10::DeviceIndex index_of(std::optional<c10::Device> device) {
  if (!device.has_value() || device->index() < 0) {
    return t_current;
  }
  return device->index();
}

at::Tensor empty_memory_format(
    c10::IntArrayRef size,
    std::optional<at::ScalarType> dtype,
    std::optional<at::Layout>,
    std::optional<c10::Device> device,
    std::optional<bool>,
    std::optional<c10::MemoryFormat> memory_format) {
  c10::DeviceIndex saved = t_current;
  c10::DeviceIndex index = index_of(device);
  check_index(index);
  t_current = index;
  auto out = at::detail::empty_generic(
      size, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype), memory_format);
  t_current = saved;
  return out;
}

at::Tensor empty_strided(
    c10::IntArrayRef size,
    c10::IntArrayRef stride,
    std::optional<at::ScalarType> dtype,
    std::optional<at::Layout>,
    std::optional<c10::Device> device,
    std::optional<bool>) {
  return empty_strided_on(size, stride, c10::dtype_or_default(dtype), index_of(device));
}

const at::Tensor& resize_(
    const at::Tensor& self, c10::IntArrayRef size, std::optional<c10::MemoryFormat> format) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  if (format.has_value()) {
    TORCH_CHECK(
        *format != c10::MemoryFormat::Preserve, "Unsupported memory format ", *format);
    impl->empty_tensor_restride(*format);
  }
  int64_t numel = impl->numel();
  if (numel > 0) {
    size_t itemsize = self.dtype().itemsize();
    grow_storage(
        impl->unsafe_storage().unsafeGetStorageImpl(),
        static_cast<size_t>(impl->storage_offset() + numel) * itemsize);
  }
  return self;
}

at::Tensor& set_storage_offset(
    at::Tensor& self,
    c10::Storage source,
    int64_t offset,
    c10::IntArrayRef size,
    c10::IntArrayRef stride) {
  TORCH_CHECK(
      source.device_type() == kDev,
      "Expected a storage on musa to set a musa tensor's storage to, but got one on ",
      source.device());
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  if (stride.empty()) {
    impl->set_sizes_contiguous(size);
    impl->set_storage_offset(offset);
  } else {
    impl->set_sizes_and_strides(size, stride, offset);
  }
  return self;
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source) {
  int64_t items = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage_offset(self, std::move(source), 0, {items}, {});
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  if (self.unsafeGetTensorImpl() == source.unsafeGetTensorImpl()) {
    return self;
  }
  return set_storage_offset(
      self, source.storage(), source.storage_offset(), source.sizes(), source.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  auto storage = empty_strided_on({0}, {1}, self.scalar_type(), self.device().index()).storage();
  return set_storage_offset(self, storage, 0, {0}, {});
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  use_card();
  TORCH_CHECK(
      self.is_cpu() || self.is_privateuseone(), "cannot copy from ", self.device(), " to musa");
  TORCH_CHECK(
      dst.is_cpu() || dst.is_privateuseone(), "cannot copy from musa to ", dst.device());
  if (self.is_privateuseone() && dst.is_cpu()) {
    // Only a copy into page-locked memory is asynchronous on a card (into pageable memory the
    // runtime copies through a staging buffer and returns when it is done).
    if (non_blocking && is_pinned_ptr(dst.storage().data())) {
      at::Tensor value = cpu_view(self).clone();
      if (poison(dst)) {
        std::lock_guard<std::mutex> lock(g_pending_mutex);
        g_pending.push_back({dst, std::move(value), self.device().index(), ++g_order});
        return dst;
      }
    }
    land(self.device().index());  // a blocking read waits for the card's queued work
  }
  at::Tensor src = self.is_privateuseone() ? cpu_view(self) : self;
  at::Tensor out = dst.is_privateuseone() ? cpu_view(dst) : dst;
  out.copy_(src);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (!dst.sizes().equals(self.sizes())) {
    dst.resize_(self.sizes());
  }
  return copy_from(self, dst, false);
}

void record_stream(at::Tensor&, c10::Stream) {}

// `param.data = param.to("musa")` (how FSDP and FSDP2 place a module's parameters on the device,
// and how much user code moves tensors) swaps the tensor's implementation for the card's. Stock
// torch allows it only between its own dense backends and refuses PrivateUse1 ("incompatible
// tensor type"); torch_musa's torch counts MUSA as dense, so there a host and a card tensor are
// interchangeable. The check is an operator: with a card tensor on either side it lands here.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    return t.layout() == at::kStrided && (t.is_cpu() || t.is_privateuseone());
  };
  return (dense(self) && dense(from)) ||
      self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set());
}

// ---------------------------------------------------------------------------------------------
// The fallback: every other operator runs its CPU kernel on CPU views of the same memory
// ---------------------------------------------------------------------------------------------

std::mutex g_ops_mutex;
std::unordered_set<std::string> g_missing_ops;  // operators this release has no kernel for
// Operators whose generated device wrapper checks that every tensor argument is on one device:
// those without `device_check: NoCheck` in native_functions.yaml (set from Python).
std::unordered_set<std::string> g_checked_ops;

// The check torchgen writes into a device backend's wrapper of each such operator
// (RegisterDispatchKey.gen_device_check: out= arguments, then the positional ones, through
// c10::impl::check_and_update_common_device): the first defined tensor's device is the common
// one and any other device is refused, a 0-dim CPU tensor included. Operators marked NoCheck
// (TensorIterator's, which take a 0-dim CPU tensor as a scalar, and indexing) check in their
// kernels instead, which the fallback below models.
void device_check(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first) {
  const auto& schema = op.schema();
  const std::string name = c10::toString(schema.operator_name());
  {
    std::lock_guard<std::mutex> lock(g_ops_mutex);
    if (g_checked_ops.count(name) == 0) {
      return;
    }
  }
  std::optional<c10::Device> common;
  auto visit = [&](const at::Tensor& t, const c10::Argument& argument) {
    if (!t.defined()) {
      return;
    }
    if (!common.has_value()) {
      common = t.device();
      return;
    }
    TORCH_CHECK(
        *common == t.device(), "Expected all tensors to be on the same device, but got ",
        argument.name(), " is on ", t.device(), ", different from other tensors on ", *common,
        " (when checking argument in method wrapper_MUSA_", schema.name().substr(6), "_",
        schema.overload_name(), ")");
  };
  const auto& arguments = schema.arguments();
  for (bool outs : {true, false}) {
    for (size_t i = 0; i < arguments.size(); ++i) {
      const auto& argument = arguments[i];
      if (outs ? !argument.is_out() : argument.kwarg_only()) {
        continue;
      }
      const c10::IValue& value = stack[first + i];
      if (value.isTensor()) {
        visit(value.toTensor(), argument);
      } else if (value.isList()) {
        for (const c10::IValue& item : value.toListRef()) {
          if (item.isTensor()) {
            visit(item.toTensor(), argument);
          }
        }
      }
    }
  }
}

// Random operators without a generator argument that draw from the default generator inside
// their CPU kernel: the card's generator stands in for the CPU's while they run. (Those with a
// generator argument get the card's generator in it instead.)
const std::unordered_set<std::string> kDefaultGeneratorOps = {"aten::native_dropout"};

// Operators whose card kernels wait for the card before they return (they read a value or a size
// back to the host): a blocking read, so queued copies to the host land first.
const std::unordered_set<std::string> kHostSyncOps = {
    "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2",
    "aten::unique_dim", "aten::unique_consecutive", "aten::equal", "aten::is_nonzero"};

bool is_generator(const c10::Argument& argument) {
  auto type = argument.type();
  if (type->kind() == c10::TypeKind::OptionalType) {
    type = type->castRaw<c10::OptionalType>()->getElementType();
  }
  return type->kind() == c10::TypeKind::GeneratorType;
}

std::string where(const c10::OperatorHandle& op, const c10::Argument& argument) {
  return c10::str(
      " (when checking argument ", argument.name(), " of ", op.schema().operator_name(), ")");
}

struct Alias {
  at::Tensor device;  // the musa tensor
  at::Tensor host;    // its CPU view, handed to the CPU kernel
  const void* data;   // the memory both started on
  bool written;       // the schema says the operator writes it
};

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const std::string name = c10::toString(schema.operator_name());
  const auto& arguments = schema.arguments();
  const size_t n = arguments.size();
  const size_t first = stack->size() - n;
  {
    std::lock_guard<std::mutex> lock(g_ops_mutex);
    TORCH_CHECK_NOT_IMPLEMENTED(
        g_missing_ops.count(schema.name()) == 0 && g_missing_ops.count(name) == 0,
        "Could not run '", name,
        "' with arguments from the 'musa' backend: this torch_musa release has no kernel for it");
  }
  use_card();
  device_check(op, *stack, first);

  std::optional<c10::DeviceIndex> index;  // the card every musa argument is on
  bool index_op = schema.name() == "aten::index" || schema.name() == "aten::index_put" ||
      schema.name() == "aten::index_put_" || schema.name() == "aten::_index_put_impl_" ||
      schema.name() == "aten::_unsafe_index" || schema.name() == "aten::_unsafe_index_put";
  std::vector<Alias> aliases;
  std::vector<const c10::Argument*> cpu_arguments;

  auto on_device = [&](const at::Tensor& t, const c10::Argument& argument) -> at::Tensor {
    if (!index.has_value()) {
      index = t.device().index();
    } else {
      TORCH_CHECK(
          *index == t.device().index(),
          "Expected all tensors to be on the same device, but found at least two devices, musa:",
          static_cast<int>(*index), " and ", t.device(), "!", where(op, argument));
    }
    bool written = argument.alias_info() != nullptr && argument.alias_info()->isWrite();
    auto host = cpu_view(t);
    aliases.push_back({t, host, t.storage().data(), written});
    return host;
  };
  auto convert = [&](const at::Tensor& t, const c10::Argument& argument) -> at::Tensor {
    if (!t.defined()) {
      return t;
    }
    if (t.is_privateuseone()) {
      return on_device(t, argument);
    }
    // Past the wrapper's check (device_check above): CPU indices are moved to the device by
    // indexing, as on CUDA, and a CPU scalar (0-dim) is a number to TensorIterator. Any other CPU
    // tensor is the bug real hardware would stop on.
    if (t.is_cpu() && t.dim() > 0 && !(index_op && argument.name() == "indices")) {
      cpu_arguments.push_back(&argument);
    }
    return t;
  };

  for (size_t i = 0; i < n; ++i) {
    c10::IValue& value = (*stack)[first + i];
    const auto& argument = arguments[i];
    if (value.isTensor()) {
      value = convert(value.toTensor(), argument);
    } else if (value.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : value.toTensorList().vec()) {
        list.push_back(convert(t, argument));
      }
      value = c10::IValue(std::move(list));
    } else if (value.isList() && value.toListRef().size() > 0 &&
               (value.toListRef()[0].isTensor() || value.toListRef()[0].isNone())) {
      auto old = value.toList();
      c10::impl::GenericList list(old.elementType());
      for (size_t j = 0; j < old.size(); ++j) {
        c10::IValue item = old.get(j);
        list.push_back(item.isTensor() ? c10::IValue(convert(item.toTensor(), argument)) : item);
      }
      value = c10::IValue(std::move(list));
    } else if (value.isDevice() && value.toDevice().type() == kDev) {
      c10::DeviceIndex asked = value.toDevice().index();
      if (!index.has_value()) {
        index = asked < 0 ? t_current : asked;
      }
      value = c10::IValue(c10::Device(c10::kCPU));
    }
  }
  if (!cpu_arguments.empty() && index.has_value()) {
    const c10::Argument& argument = *cpu_arguments.front();
    TORCH_CHECK(
        false,
        "Expected all tensors to be on the same device, but found at least two devices, musa:",
        static_cast<int>(*index), " and cpu!", where(op, argument));
  }
  const c10::DeviceIndex device = index.value_or(t_current);
  if (kHostSyncOps.count(schema.name())) {
    land(device);
  }

  // Random operators draw from the card's generator, or from the musa generator they are given.
  // A CPU generator is refused as a card's kernels refuse it (check_generator, through
  // get_generator_or_default<MUSAGeneratorImpl> in torch_musa's kernels). An operator with no
  // musa tensor or device (torch.randperm(n, generator=g), torch.multinomial(cpu_probs, k,
  // generator=g)) comes here only because the card's generator carries the musa dispatch key:
  // it is a CPU operator, whose kernel refuses the card's generator (check_generator through
  // get_generator_or_default<CPUGeneratorImpl>).
  std::optional<at::Generator> swapped;
  at::Tensor cpu_state;
  bool takes_generator = false;
  for (size_t i = 0; i < n; ++i) {
    if (is_generator(arguments[i])) {
      takes_generator = true;
      c10::IValue& value = (*stack)[first + i];
      if (value.isNone()) {
        value = c10::IValue(host_generator(card(device).generator));
        continue;
      }
      at::Generator given = value.toGenerator();
      TORCH_CHECK(
          given.device().type() == kDev, "Expected a '", kDev,
          "' device type for generator but found '", given.device().type(), "'");
      TORCH_CHECK(
          index.has_value(), "Expected a 'cpu' device type for generator but found '",
          given.device().type(), "'");
      value = c10::IValue(host_generator(given));
    }
  }
  if (!takes_generator && kDefaultGeneratorOps.count(schema.name())) {
    auto cpu = at::detail::getDefaultCPUGenerator();
    cpu_state = cpu.get_state();
    cpu.set_state(card(device).generator.get_state());
    swapped = cpu;
  }

  c10::DeviceIndex saved = t_current;
  t_current = device;
  try {
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  } catch (const c10::NotImplementedError& error) {
    t_current = saved;
    if (swapped) {
      swapped->set_state(cpu_state);
    }
    TORCH_CHECK_NOT_IMPLEMENTED(
        false, "Could not run '", name,
        "' with arguments from the 'musa' backend: the emulated device runs an operator through "
        "its CPU kernel, and this one has none (",
        error.what_without_backtrace(), ")");
  } catch (...) {
    t_current = saved;
    if (swapped) {
      swapped->set_state(cpu_state);
    }
    throw;
  }
  t_current = saved;
  if (swapped) {
    card(device).generator.set_state(swapped->get_state());
    swapped->set_state(cpu_state);
  }

  // Written arguments whose CPU view the kernel resized or re-pointed (out= results).
  for (auto& alias : aliases) {
    if (!alias.written) {
      continue;
    }
    auto* host = alias.host.unsafeGetTensorImpl();
    auto* impl = alias.device.unsafeGetTensorImpl();
    const bool moved = alias.host.storage().data() != alias.data;
    if (moved) {
      auto* storage = impl->unsafe_storage().unsafeGetStorageImpl();
      size_t nbytes = alias.host.storage().nbytes();
      grow_storage(storage, nbytes);
      if (nbytes > 0) {
        std::memcpy(storage->mutable_data(), alias.host.storage().data(), nbytes);
      }
    }
    if (moved || !host->sizes().equals(impl->sizes()) || !host->strides().equals(impl->strides()) ||
        host->storage_offset() != impl->storage_offset()) {
      impl->set_sizes_and_strides(host->sizes(), host->strides(), host->storage_offset());
    }
  }

  // Results: an argument handed back (in-place and out=) is the musa tensor itself; a view of an
  // argument is a musa view of the same memory; anything new is copied to the card.
  auto result = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || !t.is_cpu()) {
      return t;
    }
    for (const auto& alias : aliases) {
      if (t.unsafeGetTensorImpl() == alias.host.unsafeGetTensorImpl()) {
        return alias.device;
      }
    }
    for (const auto& alias : aliases) {
      if (t.storage().unsafeGetStorageImpl() == alias.host.storage().unsafeGetStorageImpl() &&
          alias.host.storage().data() == alias.data) {
        return device_view(alias.device, t);
      }
    }
    return to_device(t, device);
  };
  const size_t returns = schema.returns().size();
  for (size_t i = stack->size() - returns; i < stack->size(); ++i) {
    c10::IValue& value = (*stack)[i];
    if (value.isTensor()) {
      value = result(value.toTensor());
    } else if (value.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : value.toTensorList().vec()) {
        list.push_back(result(t));
      }
      value = c10::IValue(std::move(list));
    } else if (value.isTuple()) {
      auto elements = value.toTupleRef().elements().vec();
      for (auto& element : elements) {
        if (element.isTensor()) {
          element = result(element.toTensor());
        }
      }
      value = c10::ivalue::Tuple::create(std::move(elements));
    }
  }
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("resize_", TORCH_FN(resize_));
  m.impl("set_.source_Storage", TORCH_FN(set_storage));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(set_storage_offset));
  m.impl("set_.source_Tensor", TORCH_FN(set_tensor));
  m.impl("set_", TORCH_FN(set_empty));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  m.impl("record_stream", TORCH_FN(record_stream));
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(has_compatible_shallow_copy_type));
}

// Autocast on musa casts what autocast on CUDA casts (the same op lists).
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

}  // namespace emu

namespace at::autocast {
namespace {
TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define EMU_LOW_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define EMU_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define EMU_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define EMU_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(EMU_LOW_PRECISION_FP)
  AT_FORALL_FP32(EMU_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(EMU_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(EMU_PROMOTE)
}
}  // namespace
}  // namespace at::autocast

namespace emu {

// ---------------------------------------------------------------------------------------------
// Collectives: gloo on CPU views of the same memory
// ---------------------------------------------------------------------------------------------

// MCCL takes card tensors only, in every collective: torch_musa's ProcessGroupMCCL.cpp
// (check_gpu_single_tensor, check_gpu_tensors_same_device) refuses any other with this line, as
// NCCL's "Tensors must be CUDA and dense".
at::Tensor host(const at::Tensor& t) {
  use_card();
  TORCH_CHECK(t.is_privateuseone() && !t.is_sparse(), "Tensors must be MUSA and dense");
  return cpu_view(t);
}

std::vector<at::Tensor> host(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) {
    out.push_back(host(t));
  }
  return out;
}

std::vector<std::vector<at::Tensor>> host(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<std::vector<at::Tensor>> out;
  out.reserve(lists.size());
  for (const auto& list : lists) {
    out.push_back(host(list));
  }
  return out;
}

// The gloo work, answering with the musa tensors once it is done (its future completes with
// them; gloo's works without a future of their own complete it when waited on).
struct DeviceWork final : c10d::Work {
  DeviceWork(c10::intrusive_ptr<c10d::Work> inner, std::vector<at::Tensor> outputs)
      : c10d::Work(-1, inner->retrieveOpType()),
        inner_(std::move(inner)),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {
    c10::intrusive_ptr<c10::ivalue::Future> done;
    try {
      done = inner_->getFuture();
    } catch (const c10::Error&) {
      completes_in_wait_ = true;
      return;
    }
    auto future = future_;
    auto outputs_copy = outputs_;
    done->addCallback([future, outputs_copy](c10::ivalue::Future& finished) {
      if (finished.hasError()) {
        future->setError(finished.exception_ptr());
      } else {
        future->markCompleted(c10::IValue(outputs_copy));
      }
    });
  }
  bool isCompleted() override {
    return inner_->isCompleted();
  }
  bool isSuccess() const override {
    return inner_->isSuccess();
  }
  std::exception_ptr exception() const override {
    return inner_->exception();
  }
  std::vector<at::Tensor> result() override {
    return outputs_;
  }
  void synchronize() override {
    inner_->synchronize();
  }
  bool wait(std::chrono::milliseconds timeout) override {
    bool done = inner_->wait(timeout);
    if (!completes_in_wait_) {
      future_->wait();
      return done;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (!future_->completed()) {
      future_->markCompleted(c10::IValue(outputs_));
    }
    return done;
  }
  void abort() override {
    inner_->abort();
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  bool completes_in_wait_ = false;
  std::mutex mutex_;
};

c10::intrusive_ptr<c10d::Work> wrap(
    c10::intrusive_ptr<c10d::Work> work, std::vector<at::Tensor> outputs) {
  return c10::make_intrusive<DeviceWork>(std::move(work), std::move(outputs));
}

std::vector<at::Tensor> flat(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> out;
  for (const auto& list : lists) {
    out.insert(out.end(), list.begin(), list.end());
  }
  return out;
}

struct Collectives final : c10d::Backend {
  explicit Collectives(c10::intrusive_ptr<c10d::Backend> gloo)
      : c10d::Backend(gloo->getRank(), gloo->getSize()), gloo_(std::move(gloo)) {}

  const std::string getBackendName() const override {
    return "mccl";
  }

  // ``whole``'s memory as one CPU view per rank, each shaped as ``part``.
  std::vector<at::Tensor> per_rank(const at::Tensor& whole, const at::Tensor& part) const {
    auto view = host(whole);
    TORCH_CHECK(
        whole.numel() == part.numel() * getSize(),
        "mccl: the tensor of all ranks has ", whole.numel(), " elements, expected ", getSize(),
        " x ", part.numel());
    TORCH_CHECK(whole.is_contiguous(), "mccl: the tensor of all ranks must be contiguous");
    auto flat = view.view({-1});
    std::vector<at::Tensor> out;
    for (int64_t r = 0; r < getSize(); ++r) {
      out.push_back(flat.narrow(0, r * part.numel(), part.numel()).view(part.sizes()));
    }
    return out;
  }
  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    auto h = host(tensors);
    return wrap(gloo_->broadcast(h, opts), tensors);
  }
  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    auto h = host(tensors);
    return wrap(gloo_->allreduce(h, opts), tensors);
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    auto h = host(tensors);
    return wrap(gloo_->allreduce_coalesced(h, opts), tensors);
  }
  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    auto h = host(tensors);
    return wrap(gloo_->reduce(h, opts), tensors);
  }
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    auto ho = host(outputs);
    auto hi = host(inputs);
    return wrap(gloo_->allgather(ho, hi, opts), flat(outputs));
  }
  // MCCL, as NCCL, takes any output of world x input's elements (accelerate passes a flat one);
  // gloo wants one output per rank shaped as the input: views of the same memory.
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) override {
    std::vector<at::Tensor> hi = {host(input)};
    std::vector<std::vector<at::Tensor>> ho = {per_rank(output, input)};
    return wrap(gloo_->allgather(ho, hi, opts), {output});
  }
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    auto ho = host(outputs);
    auto hi = host(inputs);
    return wrap(gloo_->allgather_coalesced(ho, hi, opts), flat(outputs));
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    auto ho = host(outputs);
    auto hi = host(inputs);
    return wrap(gloo_->allgather_into_tensor_coalesced(ho, hi, opts), outputs);
  }
  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override {
    auto ho = host(outputs);
    auto hi = host(inputs);
    return wrap(gloo_->gather(ho, hi, opts), flat(outputs));
  }
  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override {
    auto ho = host(outputs);
    auto hi = host(inputs);
    return wrap(gloo_->scatter(ho, hi, opts), outputs);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    auto ho = host(outputs);
    auto hi = host(inputs);
    return wrap(gloo_->reduce_scatter(ho, hi, opts), outputs);
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    std::vector<at::Tensor> ho = {host(output)};
    std::vector<std::vector<at::Tensor>> hi = {per_rank(input, output)};
    return wrap(gloo_->reduce_scatter(ho, hi, opts), {output});
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    auto ho = host(outputs);
    auto hi = host(inputs);
    return wrap(gloo_->reduce_scatter_tensor_coalesced(ho, hi, opts), outputs);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& output_split_sizes,
      std::vector<int64_t>& input_split_sizes,
      const c10d::AllToAllOptions& opts) override {
    auto ho = host(output);
    auto hi = host(input);
    return wrap(
        gloo_->alltoall_base(ho, hi, output_split_sizes, input_split_sizes, opts), {output});
  }
  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override {
    auto ho = host(outputs);
    auto hi = host(inputs);
    return wrap(gloo_->alltoall(ho, hi, opts), outputs);
  }
  c10::intrusive_ptr<c10d::Work> send(
      std::vector<at::Tensor>& tensors, int dst, int tag) override {
    auto h = host(tensors);
    return wrap(gloo_->send(h, dst, tag), tensors);
  }
  c10::intrusive_ptr<c10d::Work> recv(
      std::vector<at::Tensor>& tensors, int src, int tag) override {
    auto h = host(tensors);
    return wrap(gloo_->recv(h, src, tag), tensors);
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(
      std::vector<at::Tensor>& tensors, int tag) override {
    auto h = host(tensors);
    return wrap(gloo_->recvAnysource(h, tag), tensors);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return gloo_->barrier(opts);
  }
  void setSequenceNumberForGroup() override {
    gloo_->setSequenceNumberForGroup();
  }
  uint64_t getSequenceNumberForGroup() override {
    return gloo_->getSequenceNumberForGroup();
  }

 private:
  c10::intrusive_ptr<c10d::Backend> gloo_;
};

// ---------------------------------------------------------------------------------------------
// Python
// ---------------------------------------------------------------------------------------------

void configure(int64_t visible) {
  TORCH_CHECK(g_cards.empty(), "the emulated MUSA device is configured once per process");
  for (int64_t i = 0; i < visible; ++i) {
    auto c = std::make_unique<Card>();
    c->generator = new_generator(static_cast<c10::DeviceIndex>(i), c10::default_rng_seed_val);
    g_cards.push_back(std::move(c));
  }
  static Hooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
  pthread_atfork(nullptr, nullptr, &forked_child);
}

at::Tensor get_rng_state(int64_t index) {
  auto& gen = card(index).generator;
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng_state(int64_t index, const at::Tensor& state) {
  auto& gen = card(index).generator;
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

void manual_seed(int64_t index, uint64_t seed) {
  auto& gen = card(index).generator;
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(seed);
}

uint64_t seed(int64_t index) {
  auto& gen = card(index).generator;
  std::lock_guard<std::mutex> lock(gen.mutex());
  uint64_t s = c10::detail::getNonDeterministicRandom();
  gen.set_current_seed(s);
  return s;
}

uint64_t initial_seed(int64_t index) {
  auto& gen = card(index).generator;
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.current_seed();
}

void set_missing_ops(const std::vector<std::string>& names) {
  std::lock_guard<std::mutex> lock(g_ops_mutex);
  g_missing_ops = {names.begin(), names.end()};
}

void set_checked_ops(const std::vector<std::string>& names) {
  std::lock_guard<std::mutex> lock(g_ops_mutex);
  g_checked_ops = {names.begin(), names.end()};
}

// Kernels this release registers for musa by name (torch_musa's musa_functions.yaml), run through
// the fallback: torch asks _dispatch_has_kernel_for_dispatch_key before it trusts one.
std::unique_ptr<torch::Library> g_named_kernels;

void register_kernels(const std::vector<std::string>& names) {
  TORCH_CHECK(!g_named_kernels, "kernels are registered once per process");
  g_named_kernels = std::make_unique<torch::Library>(
      torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  for (const auto& name : names) {
    g_named_kernels->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
}

c10::intrusive_ptr<c10d::Backend> collectives(c10::intrusive_ptr<c10d::Backend> gloo) {
  return c10::make_intrusive<Collectives>(std::move(gloo));
}

}  // namespace emu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("configure", &emu::configure);
  m.def("device_count", []() { return static_cast<int64_t>(emu::count()); });
  m.def("current_device", []() { return static_cast<int64_t>(emu::t_current); });
  m.def("lazy_init", &emu::use_card);
  m.def("poison_fork", []() { emu::g_armed = true; });
  m.def("in_bad_fork", []() { return emu::g_bad_fork.load(); });
  m.def("initialized", []() { return emu::g_used.load() && !emu::g_bad_fork.load(); });
  m.def("set_device", [](int64_t index) {
    emu::use_card();
    emu::check_index(index);
    emu::t_current = static_cast<c10::DeviceIndex>(index);
  });
  m.def("memory_allocated", [](int64_t i) { return emu::card(i).allocated.load(); });
  m.def("max_memory_allocated", [](int64_t i) { return emu::card(i).peak.load(); });
  m.def("reset_peak_memory_stats", [](int64_t i) {
    auto& c = emu::card(i);
    c.peak = c.allocated.load();
  });
  m.def("get_rng_state", &emu::get_rng_state);
  m.def("set_rng_state", &emu::set_rng_state);
  m.def("manual_seed", &emu::manual_seed);
  m.def("seed", &emu::seed);
  m.def("initial_seed", &emu::initial_seed);
  m.def("set_missing_ops", &emu::set_missing_ops);
  m.def("set_checked_ops", &emu::set_checked_ops);
  m.def("register_kernels", &emu::register_kernels);
  m.def("collectives", &emu::collectives);
  // torch.musa.synchronize(device): the card's queued copies to the host land.
  m.def("synchronize", [](int64_t i) { emu::land(static_cast<c10::DeviceIndex>(i)); });
}
