// Memory walk over a step program (see memory.h).
#include "peftplan/sim/memory.h"

#include <algorithm>

#include "peftplan/common/error.h"

namespace peftplan::sim {
namespace {

// Calls visit(op_index, live) after each alloc/free, with live bytes per category.
template <typename Visit>
void replay(const Program& program, Visit&& visit) {
  std::array<std::uint64_t, kNumCategories> live{};
  for (std::size_t i = 0; i < program.ops.size(); ++i) {
    const Op& op = program.ops[i];
    if (op.kind != OpKind::alloc && op.kind != OpKind::free) continue;
    const Buffer& b = program.buffers[static_cast<std::size_t>(op.buffer)];
    auto c = static_cast<std::size_t>(b.category);
    if (op.kind == OpKind::alloc) live[c] += b.bytes;
    else live[c] -= b.bytes;
    visit(static_cast<std::int32_t>(i), live);
  }
}

}  // namespace

MemoryProfile walk_memory(const Program& program) {
  MemoryProfile p;
  std::array<std::uint64_t, kNumCategories> last{};
  replay(program, [&](std::int32_t op, const std::array<std::uint64_t, kNumCategories>& live) {
    std::uint64_t device = 0, host = 0;
    for (int c = 0; c < kNumCategories; ++c) {
      p.category_peak_bytes[c] = std::max(p.category_peak_bytes[c], live[c]);
      (c < kNumDeviceCategories ? device : host) += live[c];
    }
    if (device > p.device_peak_bytes) {
      p.device_peak_bytes = device;
      p.device_peak_op = op;
      for (int c = 0; c < kNumDeviceCategories; ++c) p.at_peak_bytes[c] = live[c];
    }
    if (host > p.host_peak_bytes) {
      p.host_peak_bytes = host;
      p.host_peak_op = op;
      for (int c = kNumDeviceCategories; c < kNumCategories; ++c) p.at_peak_bytes[c] = live[c];
    }
    last = live;
  });
  p.end_bytes = last;
  return p;
}

std::vector<MemorySample> memory_timeline(const Program& program) {
  std::vector<MemorySample> samples;
  replay(program, [&](std::int32_t op, const std::array<std::uint64_t, kNumCategories>& live) {
    samples.push_back(MemorySample{op, live});
  });
  return samples;
}

}  // namespace peftplan::sim
