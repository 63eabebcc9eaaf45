// The memory walk: replay a step program's alloc/free ops in program order and report, for the
// device and for the host, the peak of each category, the simultaneous peak (maximum over the
// step of the live total — not the sum of per-category peaks) and the op at which it happens.
// Pure function of the program; no costs, no cluster.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "peftplan/sim/program.h"

namespace peftplan::sim {

struct MemoryProfile {
  std::array<std::uint64_t, kNumCategories> category_peak_bytes{};  // each category's own peak
  std::array<std::uint64_t, kNumCategories> at_peak_bytes{};  // categories at the device peak
                                                              // (host ones at the host peak)
  std::array<std::uint64_t, kNumCategories> end_bytes{};      // still live after the last op
  std::uint64_t device_peak_bytes = 0;  // simultaneous device peak
  std::uint64_t host_peak_bytes = 0;    // simultaneous host peak
  std::int32_t device_peak_op = -1;     // index of the alloc op that reached the device peak
  std::int32_t host_peak_op = -1;
};

// How memory is counted, the one statement of it: live bytes per category, each category's own
// peak, and the simultaneous device and host peaks — the maximum of the live total, not the sum
// of per-category peaks — with the op whose allocation reached each (a new peak only when the
// total rises strictly above the last) and every category's bytes at that moment. The memory walk
// counts a program through it and the executor's tracked allocator counts real allocations
// through it, so that predicted and measured memory are counted by the same rules.
class MemoryLedger {
 public:
  void alloc(MemCategory category, std::uint64_t bytes, std::int32_t op);
  void free(MemCategory category, std::uint64_t bytes) { live_[static_cast<std::size_t>(category)] -= bytes; }
  const std::array<std::uint64_t, kNumCategories>& live() const { return live_; }
  // The peaks so far, end_bytes = what is live now.
  MemoryProfile profile() const;

 private:
  std::array<std::uint64_t, kNumCategories> live_{};
  MemoryProfile peaks_;
};

// The program must keep its contract (sim::verify: buffer ids exist, allocs and frees alternate);
// make_plan verifies each program it builds once, before the walk, the allocator model and the
// timeline read it.
MemoryProfile walk_memory(const Program& program);

// One sample per alloc/free: live bytes per category after that op. For traces and GUIs.
struct MemorySample {
  std::int32_t op = 0;
  std::array<std::uint64_t, kNumCategories> live_bytes{};
};
std::vector<MemorySample> memory_timeline(const Program& program);

}  // namespace peftplan::sim
