// torch's CPU allocator, keeping freed buffers of a MiB or more for the next request of their size.
//
// A step asks for the same buffers in every block, so a kept buffer is used again within milliseconds; the
// memory a step frees and asks for again is then never unmapped, zeroed and faulted in afresh by the kernel.
// The buffers kept and those in use never exceed the most that were in use at once (since the last trim):
// the process's resident set stays what it would be had every freed buffer left it, which is what the
// planner prices. A request that finds no kept buffer of its size, where the peak leaves no room for a new one,
// takes over a kept buffer of another size instead (mremap): its pages stay resident, and only the difference
// is mapped or unmapped. Smaller requests go to c10's own allocation, as before.
//
// Call order: ws_install once (torch loaded); ws_trim where a run's set-up ends; ws_stats at any time.
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <list>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

using Block = std::pair<void*, size_t>;  // address, bytes (a size class)

struct Cache final : c10::Allocator {
  size_t threshold = size_t(1) << 20;
  std::mutex mutex;
  std::unordered_map<void*, size_t> in_use;  // block -> its bytes
  std::list<Block> kept;                     // freed blocks, oldest first
  std::map<size_t, std::vector<std::list<Block>::iterator>> kept_by_size;
  size_t in_use_bytes = 0, kept_bytes = 0, peak_bytes = 0;
  size_t hits = 0, misses = 0, released_bytes = 0, remapped_bytes = 0;

  static Cache& instance() {
    static Cache* cache = new Cache();  // never destroyed: tensors may outlive static destruction
    return *cache;
  }

  // Requests round up to a sixteenth of their power of two, so ragged batches' near sizes share blocks.
  static size_t size_class(size_t n) {
    size_t top = 63 - __builtin_clzll(n);
    size_t step = std::max<size_t>(size_t(1) << (top - 4), 4096);
    return (n + step - 1) / step * step;
  }

  static void release(void* p) { instance().give_back(p); }

  static void* map(size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK_WITH(OutOfMemoryError, p != MAP_FAILED, "CPU buffer cache: cannot map ", bytes, " bytes");
    return p;
  }

  // The kept block `node` out of the cache's lists (mutex held).
  Block unkeep(std::list<Block>::iterator node) {
    Block block = *node;
    auto& same = kept_by_size[block.second];
    same.erase(std::find(same.begin(), same.end(), node));
    if (same.empty()) kept_by_size.erase(block.second);
    kept.erase(node);
    kept_bytes -= block.second;
    return block;
  }

  // A kept block of exactly `bytes`, or none (mutex held).
  void* take(size_t bytes) {
    auto same = kept_by_size.find(bytes);
    return same == kept_by_size.end() ? nullptr : unkeep(same->second.back()).first;
  }

  // Whether `bytes` more in use would take kept and in use past the peak (mutex held).
  bool over_peak(size_t bytes) const {
    return in_use_bytes + kept_bytes + bytes > std::max(peak_bytes, in_use_bytes + bytes);
  }

  // A kept block to become a new one of `bytes` where the peak has no room for it, or none: the smallest of at
  // least that size (its tail unmapped), else the largest (grown). The oldest kept blocks after it are freed
  // until the new block fits within the peak (mutex held).
  Block donor_for(size_t bytes) {
    if (kept.empty() || !over_peak(bytes)) return {nullptr, 0};
    auto fit = kept_by_size.lower_bound(bytes);
    if (fit == kept_by_size.end()) fit = std::prev(kept_by_size.end());
    Block donor = unkeep(fit->second.back());
    while (!kept.empty() && over_peak(bytes)) {
      Block old = unkeep(kept.begin());
      released_bytes += old.second;
      munmap(old.first, old.second);
    }
    return donor;
  }

  void record(void* p, size_t bytes) {  // mutex held
    in_use[p] = bytes;
    in_use_bytes += bytes;
    peak_bytes = std::max(peak_bytes, in_use_bytes + kept_bytes);
  }

  c10::DataPtr allocate(size_t n) override {
    if (n < threshold) {
      void* p = c10::alloc_cpu(n);
      return {p, p, &c10::free_cpu, c10::Device(c10::DeviceType::CPU)};
    }
    size_t c = size_class(n);
    Block donor;
    {
      std::lock_guard<std::mutex> guard(mutex);
      if (void* p = take(c)) {
        hits++;
        record(p, c);
        return {p, p, &Cache::release, c10::Device(c10::DeviceType::CPU)};
      }
      misses++;
      donor = donor_for(c);
    }
    void* p;
    if (donor.first != nullptr) {
      p = mremap(donor.first, donor.second, c, MREMAP_MAYMOVE);
      TORCH_CHECK_WITH(OutOfMemoryError, p != MAP_FAILED, "CPU buffer cache: cannot remap ", c, " bytes");
    } else {
      p = map(c);
    }
    std::lock_guard<std::mutex> guard(mutex);
    remapped_bytes += std::min(donor.second, c);
    released_bytes += donor.second > c ? donor.second - c : 0;
    record(p, c);
    return {p, p, &Cache::release, c10::Device(c10::DeviceType::CPU)};
  }

  void give_back(void* p) {
    std::lock_guard<std::mutex> guard(mutex);
    auto it = in_use.find(p);
    if (it == in_use.end()) {  // a small block, given out by raw_allocate
      c10::free_cpu(p);
      return;
    }
    size_t bytes = it->second;
    in_use.erase(it);
    in_use_bytes -= bytes;
    kept.emplace_back(p, bytes);
    kept_by_size[bytes].push_back(std::prev(kept.end()));
    kept_bytes += bytes;
  }

  void trim() {
    std::lock_guard<std::mutex> guard(mutex);
    for (auto& [p, bytes] : kept) munmap(p, bytes);
    released_bytes += kept_bytes;
    kept.clear();
    kept_by_size.clear();
    kept_bytes = 0;
    peak_bytes = in_use_bytes;
  }

  c10::DeleterFnPtr raw_deleter() const override { return &Cache::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

// A fork while another thread holds the mutex would leave it held in the child: hold it across the fork.
void lock_for_fork() { Cache::instance().mutex.lock(); }
void unlock_after_fork() { Cache::instance().mutex.unlock(); }

}  // namespace

extern "C" {

void ws_install(size_t threshold) {
  static std::once_flag once;
  std::call_once(once, [threshold] {
    Cache::instance().threshold = threshold;
    pthread_atfork(lock_for_fork, unlock_after_fork, unlock_after_fork);
    c10::SetCPUAllocator(&Cache::instance(), /*priority=*/1);
  });
}

void ws_trim() { Cache::instance().trim(); }

// in use, kept, peak, released and remapped bytes; hits, misses.
void ws_stats(size_t* out) {
  Cache& c = Cache::instance();
  std::lock_guard<std::mutex> guard(c.mutex);
  size_t values[] = {c.in_use_bytes, c.kept_bytes, c.peak_bytes, c.released_bytes, c.remapped_bytes, c.hits, c.misses};
  std::copy(std::begin(values), std::end(values), out);
}
}
