// The timeline interpreter (see timeline.h).
#include "peftplan/sim/timeline.h"

#include <algorithm>
#include <optional>

#include "peftplan/common/error.h"
#include "peftplan/sim/compute.h"

namespace peftplan::sim {
namespace {

struct Interval {
  double begin;
  double end;
};

// Length of union(a) minus its overlap with union(b); a and b each hold intervals sorted by
// begin; b's intervals do not overlap one another (one in-order stream).
double uncovered(std::vector<Interval>& a, const std::vector<Interval>& b) {
  std::sort(a.begin(), a.end(), [](const Interval& x, const Interval& y) { return x.begin < y.begin; });
  double total = 0.0;
  std::size_t j = 0;
  double cur_begin = 0.0, cur_end = -1.0;
  auto flush = [&](double lo, double hi) {
    // [lo, hi) minus the b intervals.
    double len = hi - lo;
    while (j < b.size() && b[j].end <= lo) ++j;
    for (std::size_t q = j; q < b.size() && b[q].begin < hi; ++q)
      len -= std::max(0.0, std::min(hi, b[q].end) - std::max(lo, b[q].begin));
    total += len;
  };
  for (const Interval& iv : a) {
    if (iv.end <= iv.begin) continue;
    if (iv.begin > cur_end) {
      if (cur_end > cur_begin) flush(cur_begin, cur_end);
      cur_begin = iv.begin;
      cur_end = iv.end;
    } else {
      cur_end = std::max(cur_end, iv.end);
    }
  }
  if (cur_end > cur_begin) flush(cur_begin, cur_end);
  return total;
}

// A collective inside the step: the cost model's figures, the arrival wait and the transfer. The
// transfer is the cost model's time plus the calibrated load per call, the wait the calibrated
// skew (both only with peers to wait for).
struct InStep {
  CollectiveCost cost;
  double wait_s = 0.0;
  double transfer_s = 0.0;
};
// `overlapped_s`, `since_s`: the compute around the call (collective_compute_s).
InStep collective_in_step(const Op& op, const Cluster& cluster, const SimOptions& options, double overlapped_s, double since_s) {
  const std::size_t slot = collective_slot(static_cast<std::size_t>(op.collective), collective_place(op.phase));
  const HostCalibration& h = cluster.host_calibration;
  const bool peers = op.group_size > 1;
  InStep r{collective_cost(op.collective, op.bytes, op.group_size, cluster, options.algorithm, op.group_stride)};
  if (peers) {
    r.wait_s = h.collective_skew_s[slot] + h.collective_skew_per_compute[slot] * since_s;
    r.transfer_s = r.cost.time_s + h.collective_load_s[slot] + h.collective_load_per_compute[slot] * overlapped_s;
  } else {
    r.transfer_s = r.cost.time_s;
  }
  return r;
}

// `program`: the op's program's compute dtype (which calibrated kernel factors apply).
double compute_op_s(const Op& op, const Cluster& cluster, const SimOptions& options, DType program) {
  if (op.stream == Stream::host) return host_compute_cost(op.work, op.kernel, cluster).time_s;
  const ComputeCost c = device_compute_cost(op.work, op.kernel, cluster, options.compute_dtype, options.allow_tf32, program);
  return (c.time_s - c.launch_s) / options.sustained + c.launch_s;
}

}  // namespace

CollectiveCompute collective_compute_s(const Program& program, std::span<const double> compute_s) {
  const std::size_t n = program.ops.size();
  // prefix[i] = compute-stream seconds of ops [0, i)
  std::vector<double> prefix(n + 1, 0.0);
  for (std::size_t i = 0; i < n; ++i) {
    const Op& op = program.ops[i];
    const bool counted = i < compute_s.size() && op.kind == OpKind::compute && op.stream == Stream::compute && op.phase != Phase::setup;
    prefix[i + 1] = prefix[i] + (counted ? compute_s[i] : 0.0);
  }
  std::vector<std::size_t> first_dependent(n, n);
  for (std::size_t j = 0; j < n; ++j)
    for (std::int32_t d : program.deps_of(program.ops[j])) {
      const auto di = static_cast<std::size_t>(d);
      if (di < n && first_dependent[di] == n) first_dependent[di] = j;
    }
  CollectiveCompute out{std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};
  std::optional<std::size_t> first, previous;
  for (std::size_t i = 0; i < n; ++i) {
    const Op& op = program.ops[i];
    if (op.kind != OpKind::collective || op.phase == Phase::setup) continue;
    out.overlapped[i] = prefix[first_dependent[i]] - prefix[i + 1];
    if (previous) out.since_previous[i] = prefix[i] - prefix[*previous + 1];
    else first = i;
    previous = i;
  }
  if (first)  // the step before ended with its last collective
    out.since_previous[*first] = prefix[*first] + (prefix[n] - prefix[*previous + 1]);
  return out;
}

double op_duration_s(const Op& op, const Cluster& cluster, const SimOptions& options, DType program) {
  if (op.phase == Phase::setup) return 0.0;
  switch (op.kind) {
    case OpKind::alloc:
    case OpKind::free: return 0.0;
    case OpKind::compute: return compute_op_s(op, cluster, options, program);
    case OpKind::collective: {
      const InStep c = collective_in_step(op, cluster, options, 0.0, 0.0);
      return c.wait_s + c.transfer_s;
    }
    case OpKind::copy: return copy_time_s(op.bytes, cluster);
  }
  return 0.0;
}

Timeline simulate(const Program& program, const Cluster& cluster, const SimOptions& options) {
  if (program.ranks > total_gpus(cluster))
    throw input_error(fmt::format("cluster \"{}\"", cluster.name), "",
                      fmt::format("has {} GPUs but the plan needs {} ranks", total_gpus(cluster),
                                  program.ranks));
  const std::size_t n_ops = program.ops.size();
  Timeline t;
  t.ops.resize(n_ops);
  std::array<double, kNumStreams> stream_free{};
  std::vector<Interval> comm_iv, compute_iv;
  comm_iv.reserve(n_ops / 4 + 1);
  compute_iv.reserve(n_ops / 2 + 1);
  // The compute each collective overlaps (HostCalibration's per-compute load and skew), costed
  // up front, and only on clusters calibrated with them.
  CollectiveCompute around;
  if (cluster.host_calibration.has_collective_step_costs()) {
    std::vector<double> cost(n_ops, 0.0);
    for (std::size_t i = 0; i < n_ops; ++i) {
      const Op& op = program.ops[i];
      if (op.kind == OpKind::compute && op.stream == Stream::compute && op.phase != Phase::setup)
        cost[i] = compute_op_s(op, cluster, options, program.compute_dtype);
    }
    around = collective_compute_s(program, cost);
  }

  for (std::size_t i = 0; i < n_ops; ++i) {
    const Op& op = program.ops[i];
    const auto s = static_cast<std::size_t>(op.stream);
    if (op.phase == Phase::setup) {
      t.ops[i] = OpTime{0.0, 0.0};
      continue;
    }
    double ready = stream_free[s];
    for (std::int32_t d : program.deps_of(op)) {
      PEFTPLAN_CHECK_MSG(d >= 0 && static_cast<std::size_t>(d) < i,
                         "op {} depends on op {}, which is not earlier", i, d);
      ready = std::max(ready, t.ops[static_cast<std::size_t>(d)].end_s);
    }
    double dur = 0.0, wait = 0.0;
    switch (op.kind) {
      case OpKind::alloc:
      case OpKind::free: break;
      case OpKind::compute:
        dur = compute_op_s(op, cluster, options, program.compute_dtype);
        if (op.phase == Phase::optimizer) t.optimizer_s += dur;
        if (op.stream == Stream::compute) {
          t.compute_s += dur;
          compute_iv.push_back({ready, ready + dur});
        }
        break;
      case OpKind::collective: {
        const InStep c = around.overlapped.empty() ? collective_in_step(op, cluster, options, 0.0, 0.0)
                                                   : collective_in_step(op, cluster, options, around.overlapped[i], around.since_previous[i]);
        const auto k = static_cast<std::size_t>(op.collective);
        wait = c.wait_s;
        dur = c.wait_s + c.transfer_s;
        t.collective_bytes[k] += op.bytes;
        t.collective_count[k] += 1;
        t.intra_node_bytes += c.cost.intra_node_bytes;
        t.inter_node_bytes += c.cost.inter_node_bytes;
        t.comm_s += c.transfer_s;
        t.sync_wait_s += c.wait_s;
        comm_iv.push_back({ready, ready + dur});
        break;
      }
      case OpKind::copy:
        dur = copy_time_s(op.bytes, cluster);
        (op.copy_dir == CopyDir::device_to_host ? t.device_to_host_bytes
                                                : t.host_to_device_bytes) += op.bytes;
        break;
    }
    t.ops[i] = OpTime{ready, ready + dur, wait};
    stream_free[s] = ready + dur;  // in order: later ops on the stream wait even for a
                                   // zero-time op that waited on a dependency
    t.busy_s[s] += dur;
    t.step_s = std::max(t.step_s, ready + dur);
  }

  t.exposed_comm_s = uncovered(comm_iv, compute_iv);
  t.offload_s = t.busy_s[static_cast<std::size_t>(Stream::copy)] +
                t.busy_s[static_cast<std::size_t>(Stream::host)];
  t.peak_flops_per_s =
      peak_flops_per_s(cluster.gpu, options.compute_dtype, options.allow_tf32);
  t.host_floor_s = options.host_floor_s;
  t.device_step_s = t.step_s;
  if (options.host_floor_s > t.step_s) {
    t.step_s = options.host_floor_s;
    t.host_bound = true;
  }
  if (t.step_s > 0.0) {
    t.tokens_per_s = static_cast<double>(program.tokens_per_step) * program.ranks / t.step_s;
    t.mfu = program.model_flops_per_step / (t.step_s * t.peak_flops_per_s);
  }
  return t;
}

}  // namespace peftplan::sim
