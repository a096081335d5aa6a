// torch's CPU allocator, keeping freed buffers of a MiB or more for the next request of their size.
//
// A step asks for the same buffers in every block, so a kept buffer is used again within milliseconds; the
// memory a step frees and asks for again is then never unmapped, zeroed and faulted in afresh by the kernel.
// The buffers kept and those in use never exceed the most that were in use at once (since the last trim):
// the process's resident set stays what it would be had every freed buffer left it, which is what the
// planner prices. A request that finds no kept buffer of its size, where the peak leaves no room for a new one,
// is made of kept pages instead: the head of the smallest kept buffer that holds it (the rest unmapped), or the
// kept buffers, largest first, moved into one range (mremap) with fresh pages for what they lack. The pages it
// takes stay resident. Smaller requests go to c10's own allocation.
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
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

// A buffer: one range of pages, made of pieces each within one of the kernel's mappings. A range moved as a
// whole across mappings needs Linux 6.17, so each piece is moved on its own.
struct Piece {
  char* addr;
  size_t bytes;
};
using Pieces = std::vector<Piece>;
// A buffer made of more pieces than this is unmapped when freed, so the process's mappings stay few.
constexpr size_t MAX_PIECES = 64;

struct Cache final : c10::Allocator {
  size_t threshold = size_t(1) << 20;
  std::mutex mutex;
  std::unordered_map<void*, Pieces> in_use;  // buffer -> its pieces
  std::multimap<size_t, Pieces> kept;        // freed buffers by bytes
  size_t in_use_bytes = 0, kept_bytes = 0, peak_bytes = 0;
  size_t hits = 0, misses = 0, released_bytes = 0, remapped_bytes = 0;

  static Cache& instance() {
    static Cache* cache = new Cache();  // never destroyed: tensors may outlive static destruction
    return *cache;
  }

  // Requests round up to a sixteenth of their power of two, so ragged batches' near sizes share buffers.
  static size_t size_class(size_t n) {
    size_t top = 63 - __builtin_clzll(n);
    size_t step = std::max<size_t>(size_t(1) << (top - 4), 4096);
    return (n + step - 1) / step * step;
  }

  static size_t bytes_of(const Pieces& pieces) {
    size_t n = 0;
    for (const Piece& p : pieces) n += p.bytes;
    return n;
  }

  static void release(void* p) { instance().give_back(p); }

  static char* map(size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK_WITH(OutOfMemoryError, p != MAP_FAILED, "CPU buffer cache: cannot map ", bytes, " bytes");
    return static_cast<char*>(p);
  }

  // The first `bytes` of a buffer's pieces; the rest stay in `pieces`.
  static Pieces split(Pieces& pieces, size_t bytes) {
    Pieces head;
    size_t i = 0;
    for (; i < pieces.size() && bytes >= pieces[i].bytes; bytes -= pieces[i++].bytes) head.push_back(pieces[i]);
    if (bytes > 0) {
      head.push_back({pieces[i].addr, bytes});
      pieces[i] = {pieces[i].addr + bytes, pieces[i].bytes - bytes};
    }
    pieces.erase(pieces.begin(), pieces.begin() + i);
    return head;
  }

  // A kept buffer out of the cache (mutex held).
  Pieces unkeep(std::multimap<size_t, Pieces>::iterator it) {
    Pieces pieces = std::move(it->second);
    kept_bytes -= it->first;
    kept.erase(it);
    return pieces;
  }

  void keep(Pieces pieces) {  // mutex held
    size_t bytes = bytes_of(pieces);
    if (bytes == 0) return;
    kept.emplace(bytes, std::move(pieces));
    kept_bytes += bytes;
  }

  // Whether `bytes` more in use would take kept and in use past the peak (mutex held).
  bool over_peak(size_t bytes) const {
    return in_use_bytes + kept_bytes + bytes > std::max(peak_bytes, in_use_bytes + bytes);
  }

  // Kept pages to make a buffer of `bytes` of, where the peak has no room for fresh ones (mutex held): the head of
  // the smallest kept buffer that holds it, its tail unmapped (kept, it would hold the resident set at the peak
  // when the request is smaller), else the kept buffers, largest first, up to what the peak has no room for (the
  // rest of the buffer is fresh pages): what stays kept serves later requests of its size.
  std::vector<Pieces> donors_for(size_t bytes) {
    std::vector<Pieces> donors;
    if (kept.empty() || !over_peak(bytes)) return donors;
    auto fit = kept.lower_bound(bytes);
    if (fit != kept.end()) {
      Pieces pieces = unkeep(fit);
      donors.push_back(split(pieces, bytes));
      if (!pieces.empty()) {
        size_t tail = bytes_of(pieces);
        munmap(pieces.front().addr, tail);
        released_bytes += tail;
      }
      remapped_bytes += bytes;
      return donors;
    }
    // More than 0 (over the peak), and at most kept_bytes (the bound is at least in use plus the request).
    size_t wanted = in_use_bytes + kept_bytes + bytes - std::max(peak_bytes, in_use_bytes + bytes);
    while (wanted > 0 && !kept.empty()) {
      Pieces pieces = unkeep(std::prev(kept.end()));
      Pieces head = split(pieces, std::min(wanted, bytes_of(pieces)));
      keep(std::move(pieces));  // the last one's rest, if any
      wanted -= bytes_of(head);
      remapped_bytes += bytes_of(head);
      donors.push_back(std::move(head));
    }
    return donors;
  }

  // A buffer of `bytes` from kept pages (mutex not held): one donor's pieces as they lie, or the donors' pieces
  // moved into a fresh range, whose pages where they lack stay fresh. A piece that cannot move is unmapped.
  Pieces assemble(std::vector<Pieces> donors, size_t bytes) {
    if (donors.size() == 1 && bytes_of(donors[0]) == bytes) return std::move(donors[0]);
    char* range = map(bytes);
    Pieces pieces;
    size_t at = 0;
    for (const Pieces& donor : donors) {
      for (const Piece& piece : donor) {
        void* moved = mremap(piece.addr, piece.bytes, piece.bytes, MREMAP_MAYMOVE | MREMAP_FIXED, range + at);
        if (moved == MAP_FAILED) {
          munmap(piece.addr, piece.bytes);
          std::lock_guard<std::mutex> guard(mutex);
          released_bytes += piece.bytes;
        }
        pieces.push_back({range + at, piece.bytes});
        at += piece.bytes;
      }
    }
    if (at < bytes) pieces.push_back({range + at, bytes - at});
    return pieces;
  }

  c10::DataPtr given(Pieces pieces) {  // mutex held
    void* p = pieces.front().addr;
    in_use_bytes += bytes_of(pieces);
    in_use.emplace(p, std::move(pieces));
    peak_bytes = std::max(peak_bytes, in_use_bytes + kept_bytes);
    return {p, p, &Cache::release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DataPtr allocate(size_t n) override {
    if (n < threshold) {
      void* p = c10::alloc_cpu(n);
      return {p, p, &c10::free_cpu, c10::Device(c10::DeviceType::CPU)};
    }
    size_t c = size_class(n);
    std::vector<Pieces> donors;
    {
      std::lock_guard<std::mutex> guard(mutex);
      auto same = kept.find(c);
      if (same != kept.end()) {
        hits++;
        return given(unkeep(same));
      }
      misses++;
      donors = donors_for(c);
    }
    Pieces pieces = donors.empty() ? Pieces{{map(c), c}} : assemble(std::move(donors), c);
    std::lock_guard<std::mutex> guard(mutex);
    return given(std::move(pieces));
  }

  void give_back(void* p) {
    std::lock_guard<std::mutex> guard(mutex);
    auto it = in_use.find(p);
    if (it == in_use.end()) {  // a small buffer, given out by raw_allocate
      c10::free_cpu(p);
      return;
    }
    Pieces pieces = std::move(it->second);
    in_use.erase(it);
    size_t bytes = bytes_of(pieces);
    in_use_bytes -= bytes;
    if (pieces.size() > MAX_PIECES) {
      munmap(p, bytes);
      released_bytes += bytes;
      return;
    }
    keep(std::move(pieces));
  }

  void trim() {
    std::lock_guard<std::mutex> guard(mutex);
    for (auto& [bytes, pieces] : kept) munmap(pieces.front().addr, bytes);
    released_bytes += kept_bytes;
    kept.clear();
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
