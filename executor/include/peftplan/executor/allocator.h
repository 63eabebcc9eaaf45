// The tracked allocator: every buffer the executor holds is allocated here, under one of the
// memory categories of the design (sim::MemCategory), so that measured memory is counted the way
// the planner predicts it: live and peak bytes per category, the simultaneous device and host
// peaks (the maximum of the live total, not the sum of per-category peaks) and the step-program
// op at which each was reached, counted by sim::MemoryLedger, as sim::walk_memory counts.
// Raw memory comes from a MemoryResource (the backend's device memory, or host memory), so a
// CUDA backend plugs in its own without changing this file.
// Deliberately not here: pooling or caching (every allocation is exactly the bytes asked for, so
// a sanitizer sees any overflow), fragmentation accounting, thread safety (one runner thread
// allocates).
#pragma once

#include <array>
#include <cstdint>
#include <string_view>
#include <unordered_map>

#include "peftplan/sim/memory.h"
#include "peftplan/sim/program.h"

namespace peftplan::executor {

// A source of raw memory (CPU heap, CUDA device memory, pinned host memory).
class MemoryResource {
 public:
  virtual ~MemoryResource() = default;
  virtual std::string_view name() const = 0;
  // At least `bytes` bytes aligned to 64; a 0-byte request returns a unique non-null pointer.
  // Throws std::bad_alloc when out of memory.
  virtual void* allocate(std::uint64_t bytes) = 0;
  virtual void deallocate(void* p, std::uint64_t bytes) = 0;
};

// Heap memory with 64-byte alignment (operator new), the CPU backend's device and host memory.
MemoryResource& heap_memory();

struct MemoryStats {
  std::array<std::uint64_t, sim::kNumCategories> live_bytes{};     // now
  std::array<std::uint64_t, sim::kNumCategories> peak_bytes{};     // each category's own peak
  std::array<std::uint64_t, sim::kNumCategories> at_peak_bytes{};  // device categories at the
                                                                   // device peak, host ones at
                                                                   // the host peak
  std::uint64_t device_peak_bytes = 0;  // simultaneous device peak
  std::uint64_t host_peak_bytes = 0;    // simultaneous host peak
  std::int32_t device_peak_op = -1;     // program op index of the alloc that reached it
  std::int32_t host_peak_op = -1;
  std::uint64_t allocations = 0;        // calls to allocate
};

class TrackedAllocator {
 public:
  // Device categories come from `device`, host categories from `host`.
  TrackedAllocator(MemoryResource& device, MemoryResource& host);
  ~TrackedAllocator();  // returns whatever is still allocated
  TrackedAllocator(const TrackedAllocator&) = delete;
  TrackedAllocator& operator=(const TrackedAllocator&) = delete;

  // Exactly `bytes` bytes under `category`; `op` is the step-program op that asks (-1 outside
  // the program) and is recorded when this allocation reaches a new simultaneous peak.
  void* allocate(std::uint64_t bytes, sim::MemCategory category, std::int32_t op);
  // Releases a pointer from allocate(); an unknown pointer is an InternalError.
  void release(void* p);

  const MemoryStats& stats() const { return stats_; }

 private:
  struct Block {
    std::uint64_t bytes;
    sim::MemCategory category;
  };
  void publish();  // stats_ from the ledger after an allocation
  MemoryResource& device_;
  MemoryResource& host_;
  std::unordered_map<void*, Block> blocks_;
  sim::MemoryLedger ledger_;
  MemoryStats stats_;
};

}  // namespace peftplan::executor
