// MicroBatchSeries (series.h): the step program at any micro-batch from the builds at 1 and 2,
// checked at 3.
#include "peftplan/planner/series.h"

#include <bit>
#include <cmath>

#include "peftplan/common/error.h"
#include "peftplan/sim/memory.h"
#include "peftplan/sim/ops.h"
#include "peftplan/sim/program_hash.h"

namespace peftplan::planner {
namespace {

BuiltProgram build_at(const PlanInput& input, std::int64_t b) {
  PlanInput in = input;
  in.training.micro_batch = b;
  return build_program(in, BuildOptions{.names = false});
}

// The same lists: ops, buffers (and each one's pieces), operands and dependencies.
bool same_shape(const sim::Program& a, const sim::Program& b) {
  if (a.ops.size() != b.ops.size() || a.buffers.size() != b.buffers.size() || a.operands.size() != b.operands.size() ||
      a.deps.size() != b.deps.size())
    return false;
  for (std::size_t i = 0; i < a.buffers.size(); ++i)
    if (a.buffers[i].pieces.size() != b.buffers[i].pieces.size()) return false;
  for (std::size_t i = 0; i < a.ops.size(); ++i)
    if (a.ops[i].kind != b.ops[i].kind || a.ops[i].kernel != b.ops[i].kernel || a.ops[i].operands != b.ops[i].operands) return false;
  return true;
}

}  // namespace

std::vector<const void*> MicroBatchSeries::storage_of(const sim::Program& p) {
  std::vector<const void*> at = {p.buffers.data(), p.ops.data(), p.operands.data(), p.deps.data()};
  for (const sim::Buffer& b : p.buffers)
    if (!b.pieces.empty()) at.push_back(b.pieces.data());
  return at;
}

std::optional<MicroBatchSeries> MicroBatchSeries::make(const PlanInput& input) {
  (void)validate(input);  // refuses contradictions before the builder meets them, as make_plan does
  MicroBatchSeries s;
  s.built_ = build_at(input, 1);
  const BuiltProgram two = build_at(input, 2);
  sim::Program& p = s.built_.program;
  const sim::Program& q = two.program;
  if (s.built_.facts != two.facts || !same_shape(p, q)) return std::nullopt;

  using Type = Moving::Type;
  auto note = [&](void* field, Type type, double one, double two_) {
    if (one != two_) s.moving_.push_back({field, type, one, two_ - one});
  };
  auto u64 = [&](std::uint64_t& a, std::uint64_t b) { note(&a, Type::u64, static_cast<double>(a), static_cast<double>(b)); };
  auto i64 = [&](std::int64_t& a, std::int64_t b) { note(&a, Type::i64, static_cast<double>(a), static_cast<double>(b)); };
  for (std::size_t i = 0; i < p.buffers.size(); ++i) {
    sim::Buffer& a = p.buffers[i];
    const sim::Buffer& b = q.buffers[i];
    u64(a.bytes, b.bytes);
    u64(a.offset, b.offset);
    for (std::size_t k = 0; k < a.pieces.size(); ++k) u64(a.pieces[k], b.pieces[k]);
  }
  for (std::size_t i = 0; i < p.ops.size(); ++i) {
    sim::Op& a = p.ops[i];
    const sim::Op& b = q.ops[i];
    u64(a.bytes, b.bytes);
    note(&a.work.flops, Type::f64, a.work.flops, b.work.flops);
    u64(a.work.bytes_moved, b.work.bytes_moved);
    i64(a.work.gemm_m, b.work.gemm_m);
    i64(a.work.gemm_n, b.work.gemm_n);
    i64(a.work.gemm_k, b.work.gemm_k);
    note(&a.work.gemm_count, Type::i32, a.work.gemm_count, b.work.gemm_count);
    i64(a.work.params, b.work.params);
    if (a.kind != sim::OpKind::compute || !sim::ops::operands_in_range(p, a)) continue;
    const std::size_t n = sim::ops::values_of(a.kernel);
    for (std::size_t k = 0; k < n; ++k) {
      std::int64_t& x = p.operands[static_cast<std::size_t>(a.operands) + k];
      const std::int64_t y = q.operands[static_cast<std::size_t>(a.operands) + k];
      if (sim::ops::value_is_scalar(a.kernel, k))
        note(&x, Type::f64_bits, std::bit_cast<double>(x), std::bit_cast<double>(y));
      else
        i64(x, y);
    }
  }
  // The program's own fields move with the program object (not with its heap storage, which the
  // pointers above follow), so these two are kept apart.
  s.tokens_ = {nullptr, Type::i64, static_cast<double>(p.tokens_per_step), static_cast<double>(q.tokens_per_step - p.tokens_per_step)};
  s.model_flops_ = {nullptr, Type::f64, p.model_flops_per_step, q.model_flops_per_step - p.model_flops_per_step};

  // A double that moves is exact at every micro-batch only while it and its step are integers
  // (below 2^53): FLOPs and the loss divisor are. A fraction (the executor's attention work share
  // of a non-power-of-two block, eager or flash, summed into the step's FLOPs) could round
  // differently at some B.
  auto integral = [](double x) { return std::nearbyint(x) == x && std::fabs(x) < 0x1p53; };
  for (const Moving& m : s.moving_)
    if ((m.type == Type::f64 || m.type == Type::f64_bits) && (!integral(m.at_one) || !integral(m.per_sequence))) return std::nullopt;
  if (!integral(s.model_flops_.at_one) || !integral(s.model_flops_.per_sequence)) return std::nullopt;

  // The series must give back the build at 2 (every other field equal), and predict the one at 3.
  s.set(2);
  if (!sim::same_interpreted_fields(p, q)) return std::nullopt;
  const BuiltProgram three = build_at(input, 3);
  if (s.built_.facts != three.facts || !same_shape(p, three.program)) return std::nullopt;
  s.set(3);
  if (!sim::same_interpreted_fields(p, three.program)) return std::nullopt;
  return s;
}

void MicroBatchSeries::set(std::int64_t b) {
  PEFTPLAN_CHECK_MSG(b >= 1, "micro-batch {} (a series starts at 1)", b);
  const double steps = static_cast<double>(b - 1);
  built_.program.tokens_per_step = static_cast<std::int64_t>(tokens_.at_one + tokens_.per_sequence * steps);
  built_.program.model_flops_per_step = model_flops_.at_one + model_flops_.per_sequence * steps;
  for (const Moving& m : moving_) {
    const double v = m.at_one + m.per_sequence * steps;
    switch (m.type) {
      case Moving::Type::u64:
        PEFTPLAN_CHECK_MSG(v >= 0, "a size of the series is negative at micro-batch {}", b);
        *static_cast<std::uint64_t*>(m.field) = static_cast<std::uint64_t>(v);
        break;
      case Moving::Type::i64: *static_cast<std::int64_t*>(m.field) = static_cast<std::int64_t>(v); break;
      case Moving::Type::i32: *static_cast<std::int32_t*>(m.field) = static_cast<std::int32_t>(v); break;
      case Moving::Type::f64: *static_cast<double*>(m.field) = v; break;
      case Moving::Type::f64_bits: *static_cast<std::int64_t*>(m.field) = std::bit_cast<std::int64_t>(v); break;
    }
  }
}

std::int64_t MicroBatchSeries::largest_within(std::uint64_t device_budget, std::uint64_t host_budget) {
  PEFTPLAN_CHECK_MSG(lent_storage_.empty(), "the series' program is lent; give_back it first");
  if (device_lines_.empty()) {
    auto totals = [&](std::int64_t b, std::vector<Line>& device, std::vector<Line>& host) {
      set(b);
      const std::vector<sim::MemorySample> samples = sim::memory_timeline(built_.program);
      device.resize(samples.size());
      host.resize(samples.size());
      for (std::size_t i = 0; i < samples.size(); ++i) {
        std::int64_t d = 0, h = 0;
        for (int c = 0; c < sim::kNumCategories; ++c)
          (sim::on_host(static_cast<sim::MemCategory>(c)) ? h : d) += static_cast<std::int64_t>(samples[i].live_bytes[static_cast<std::size_t>(c)]);
        device[i].at_one = d;
        host[i].at_one = h;
      }
    };
    std::vector<Line> d2, h2;
    totals(1, device_lines_, host_lines_);
    totals(2, d2, h2);
    PEFTPLAN_CHECK(d2.size() == device_lines_.size());
    for (std::size_t i = 0; i < d2.size(); ++i) {
      device_lines_[i].per_sequence = d2[i].at_one - device_lines_[i].at_one;
      host_lines_[i].per_sequence = h2[i].at_one - host_lines_[i].at_one;
    }
  }
  // Every line at + per_sequence * (B - 1) must stay within its budget.
  std::int64_t largest = std::numeric_limits<std::int64_t>::max();
  auto bound = [&](const std::vector<Line>& lines, std::uint64_t budget) {
    const auto cap = static_cast<std::int64_t>(std::min<std::uint64_t>(budget, std::numeric_limits<std::int64_t>::max()));
    for (const Line& l : lines) {
      if (l.at_one > cap) {
        largest = 0;
        return;
      }
      if (l.per_sequence > 0) largest = std::min(largest, 1 + (cap - l.at_one) / l.per_sequence);
    }
  };
  bound(device_lines_, device_budget);
  if (host_budget > 0 && largest > 0) bound(host_lines_, host_budget);
  return largest;
}

BuiltProgram MicroBatchSeries::take(std::int64_t b) {
  PEFTPLAN_CHECK_MSG(lent_storage_.empty(), "the series' program is lent; give_back it first");
  set(b);
  lent_storage_ = storage_of(built_.program);
  return BuiltProgram{std::move(built_.program), built_.facts};
}

void MicroBatchSeries::give_back(sim::Program&& program) {
  // The same storage, every vector of it: the fields the series moves live there, so a program
  // whose vectors grew (or another program) cannot come back.
  PEFTPLAN_CHECK_MSG(!lent_storage_.empty() && storage_of(program) == lent_storage_,
                     "give_back of a program the series did not lend, or that grew");
  built_.program = std::move(program);
  lent_storage_.clear();
}

}  // namespace peftplan::planner
