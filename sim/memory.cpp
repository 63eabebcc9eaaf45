// Memory walk over a step program (see memory.h).
#include "peftplan/sim/memory.h"

#include <algorithm>

#include "peftplan/common/error.h"

namespace peftplan::sim {

void MemoryLedger::alloc(MemCategory category, std::uint64_t bytes, std::int32_t op) {
  const auto c = static_cast<std::size_t>(category);
  live_[c] += bytes;
  peaks_.category_peak_bytes[c] = std::max(peaks_.category_peak_bytes[c], live_[c]);
  const bool host = on_host(category);
  const std::size_t first = host ? kNumDeviceCategories : 0, last = host ? kNumCategories : kNumDeviceCategories;
  std::uint64_t total = 0;
  for (std::size_t i = first; i < last; ++i) total += live_[i];
  std::uint64_t& peak = host ? peaks_.host_peak_bytes : peaks_.device_peak_bytes;
  if (total > peak) {
    peak = total;
    (host ? peaks_.host_peak_op : peaks_.device_peak_op) = op;
    for (std::size_t i = first; i < last; ++i) peaks_.at_peak_bytes[i] = live_[i];
  }
}

MemoryProfile MemoryLedger::profile() const {
  MemoryProfile p = peaks_;
  p.end_bytes = live_;
  return p;
}

namespace {

// Counts the program's allocs and frees through a ledger, calling after(op index, ledger) after each.
template <typename After>
void count(const Program& program, MemoryLedger& ledger, After&& after) {
  for (std::size_t i = 0; i < program.ops.size(); ++i) {
    const Op& op = program.ops[i];
    if (op.kind != OpKind::alloc && op.kind != OpKind::free) continue;
    const Buffer& b = program.buffers[static_cast<std::size_t>(op.buffer)];
    if (op.kind == OpKind::alloc) ledger.alloc(b.category, b.bytes, static_cast<std::int32_t>(i));
    else ledger.free(b.category, b.bytes);
    after(static_cast<std::int32_t>(i), ledger);
  }
}

}  // namespace

MemoryProfile walk_memory(const Program& program) {
  MemoryLedger ledger;
  count(program, ledger, [](std::int32_t, const MemoryLedger&) {});
  return ledger.profile();
}

std::vector<MemorySample> memory_timeline(const Program& program) {
  std::vector<MemorySample> samples;
  MemoryLedger ledger;
  count(program, ledger, [&](std::int32_t op, const MemoryLedger& l) { samples.push_back(MemorySample{op, l.live()}); });
  return samples;
}

}  // namespace peftplan::sim
