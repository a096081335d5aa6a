// torch's CPU allocator, keeping freed buffers of a MiB or more for the next request of their size.
//
// A step asks for the same buffers in every block, so a kept buffer is used again within milliseconds; the
// memory a step frees and asks for again is then never unmapped, zeroed and faulted in afresh by the kernel.
// The buffers kept and those in use never exceed the most that were in use at once (since the last trim):
// the process's resident set stays what it would be had every freed buffer left it, which is what the
// planner prices. Smaller requests go to c10's own allocation, as before.
//
// Call order: ws_install once (torch loaded); ws_trim where a run's set-up ends; ws_stats at any time.
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <pthread.h>

#include <algorithm>
#include <cstring>
#include <list>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

struct Cache final : c10::Allocator {
  size_t threshold = size_t(1) << 20;
  std::mutex mutex;
  std::unordered_map<void*, size_t> in_use;  // block -> its size class
  std::list<std::pair<void*, size_t>> kept;  // freed blocks, oldest first
  std::unordered_map<size_t, std::vector<std::list<std::pair<void*, size_t>>::iterator>> kept_by_size;
  size_t in_use_bytes = 0, kept_bytes = 0, peak_bytes = 0;
  size_t hits = 0, misses = 0, released_bytes = 0;

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

  // Frees the oldest kept blocks until `size` more bytes in use keep the total within the peak (mutex held).
  void make_room(size_t size) {
    while (!kept.empty() && in_use_bytes + kept_bytes + size > std::max(peak_bytes, in_use_bytes + size)) {
      auto [p, c] = kept.front();
      auto& same = kept_by_size[c];
      same.erase(std::find(same.begin(), same.end(), kept.begin()));
      kept.pop_front();
      kept_bytes -= c;
      released_bytes += c;
      c10::free_cpu(p);
    }
  }

  void* take(size_t c) {  // mutex held
    auto& same = kept_by_size[c];
    if (same.empty()) return nullptr;
    auto node = same.back();
    same.pop_back();
    void* p = node->first;
    kept.erase(node);
    kept_bytes -= c;
    return p;
  }

  void record(void* p, size_t c) {  // mutex held
    in_use[p] = c;
    in_use_bytes += c;
    peak_bytes = std::max(peak_bytes, in_use_bytes + kept_bytes);
  }

  c10::DataPtr allocate(size_t n) override {
    if (n < threshold) {
      void* p = c10::alloc_cpu(n);
      return {p, p, &c10::free_cpu, c10::Device(c10::DeviceType::CPU)};
    }
    size_t c = size_class(n);
    void* p;
    {
      std::lock_guard<std::mutex> guard(mutex);
      p = take(c);
      if (p != nullptr) {
        hits++;
        record(p, c);
        return {p, p, &Cache::release, c10::Device(c10::DeviceType::CPU)};
      }
      misses++;
      make_room(c);
    }
    p = c10::alloc_cpu(c);
    std::lock_guard<std::mutex> guard(mutex);
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
    size_t c = it->second;
    in_use.erase(it);
    in_use_bytes -= c;
    kept.emplace_back(p, c);
    kept_by_size[c].push_back(std::prev(kept.end()));
    kept_bytes += c;
  }

  void trim() {
    std::lock_guard<std::mutex> guard(mutex);
    for (auto& [p, c] : kept) c10::free_cpu(p);
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

// in use, kept, peak, released bytes; hits, misses.
void ws_stats(size_t* out) {
  Cache& c = Cache::instance();
  std::lock_guard<std::mutex> guard(c.mutex);
  size_t values[] = {c.in_use_bytes, c.kept_bytes, c.peak_bytes, c.released_bytes, c.hits, c.misses};
  std::copy(std::begin(values), std::end(values), out);
}
}
