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
  const auto c = static_cast<std::size_t>(category);
  stats_.live_bytes[c] += bytes;
  stats_.peak_bytes[c] = std::max(stats_.peak_bytes[c], stats_.live_bytes[c]);
  // The same rule as sim::walk_memory: a new simultaneous peak strictly above the last one.
  std::uint64_t total = 0;
  const int first = host ? sim::kNumDeviceCategories : 0;
  const int last = host ? sim::kNumCategories : sim::kNumDeviceCategories;
  for (int i = first; i < last; ++i) total += stats_.live_bytes[static_cast<std::size_t>(i)];
  std::uint64_t& peak = host ? stats_.host_peak_bytes : stats_.device_peak_bytes;
  if (total > peak) {
    peak = total;
    (host ? stats_.host_peak_op : stats_.device_peak_op) = op;
    for (int i = first; i < last; ++i)
      stats_.at_peak_bytes[static_cast<std::size_t>(i)] = stats_.live_bytes[static_cast<std::size_t>(i)];
  }
  return p;
}

void TrackedAllocator::release(void* p) {
  auto it = blocks_.find(p);
  PEFTPLAN_CHECK_MSG(it != blocks_.end(), "release of a pointer the allocator does not own");
  const Block b = it->second;
  blocks_.erase(it);
  stats_.live_bytes[static_cast<std::size_t>(b.category)] -= b.bytes;
  (sim::on_host(b.category) ? host_ : device_).deallocate(p, b.bytes);
}

}  // namespace peftplan::executor
