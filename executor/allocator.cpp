// The tracked allocator (see allocator.h).
#include "peftplan/executor/allocator.h"

#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "peftplan/common/error.h"

namespace peftplan::executor {
namespace {

// Host heap with a cache of freed blocks by exact size, like PyTorch's caching allocator: every
// step allocates the same sizes again, so the second step reuses the first step's blocks instead
// of asking the kernel for fresh pages (page faults cost several percent of a small model's
// step). The tracked allocator counts requested bytes, so the cache changes no measurement; it
// holds at most kMaxCachedBytes and frees beyond that.
class HeapMemory final : public MemoryResource {
 public:
  ~HeapMemory() override {
    for (auto& [bytes, blocks] : cache_)
      for (void* p : blocks) ::operator delete(p, std::align_val_t{64});
  }
  std::string_view name() const override { return "heap"; }
  void* allocate(std::uint64_t bytes) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cache_.find(bytes);
      if (it != cache_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        cached_bytes_ -= bytes;
        return p;
      }
    }
    return ::operator new(static_cast<std::size_t>(bytes), std::align_val_t{64});
  }
  void deallocate(void* p, std::uint64_t bytes) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cached_bytes_ + bytes <= kMaxCachedBytes) {
        cache_[bytes].push_back(p);
        cached_bytes_ += bytes;
        return;
      }
    }
    ::operator delete(p, std::align_val_t{64});
  }

 private:
  static constexpr std::uint64_t kMaxCachedBytes = 2ull << 30;
  std::mutex mu_;
  std::unordered_map<std::uint64_t, std::vector<void*>> cache_;
  std::uint64_t cached_bytes_ = 0;
};

}  // namespace

MemoryResource& heap_memory() {
  static HeapMemory heap;
  return heap;
}

TrackedAllocator::TrackedAllocator(MemoryResource& device, MemoryResource& host)
    : device_(device), host_(host) {}

TrackedAllocator::~TrackedAllocator() {
  for (auto& [p, b] : blocks_) (sim::on_host(b.category) ? host_ : device_).deallocate(p, b.bytes);
}

void* TrackedAllocator::allocate(std::uint64_t bytes, sim::MemCategory category, std::int32_t op) {
  const bool host = sim::on_host(category);
  void* p = (host ? host_ : device_).allocate(bytes);
  blocks_.emplace(p, Block{bytes, category});
  ++stats_.allocations;
  ledger_.alloc(category, bytes, op);  // counted as sim::walk_memory counts the program
  publish();
  return p;
}

void TrackedAllocator::publish() {
  const sim::MemoryProfile m = ledger_.profile();
  stats_.live_bytes = m.end_bytes;
  stats_.peak_bytes = m.category_peak_bytes;
  stats_.at_peak_bytes = m.at_peak_bytes;
  stats_.device_peak_bytes = m.device_peak_bytes;
  stats_.host_peak_bytes = m.host_peak_bytes;
  stats_.device_peak_op = m.device_peak_op;
  stats_.host_peak_op = m.host_peak_op;
}

void TrackedAllocator::release(void* p) {
  auto it = blocks_.find(p);
  PEFTPLAN_CHECK_MSG(it != blocks_.end(), "release of a pointer the allocator does not own");
  const Block b = it->second;
  blocks_.erase(it);
  ledger_.free(b.category, b.bytes);
  stats_.live_bytes = ledger_.live();
  (sim::on_host(b.category) ? host_ : device_).deallocate(p, b.bytes);
}

}  // namespace peftplan::executor
