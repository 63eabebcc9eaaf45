// The timeline interpreter (see timeline.h).
#include "peftplan/sim/timeline.h"

#include <algorithm>

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

}  // namespace

double op_duration_s(const Op& op, const Cluster& cluster, const SimOptions& options) {
  if (op.phase == Phase::setup) return 0.0;
  switch (op.kind) {
    case OpKind::alloc:
    case OpKind::free: return 0.0;
    case OpKind::compute:
      return op.stream == Stream::host
                 ? host_compute_cost(op.work, op.kernel, cluster).time_s
                 : device_compute_cost(op.work, op.kernel, cluster, options.compute_dtype,
                                       options.allow_tf32)
                       .time_s;
    case OpKind::collective:
      return collective_cost(op.collective, op.bytes, op.group_size, cluster, options.algorithm)
          .time_s;
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
    double dur = 0.0;
    switch (op.kind) {
      case OpKind::alloc:
      case OpKind::free: break;
      case OpKind::compute:
        if (op.stream == Stream::host) {
          dur = host_compute_cost(op.work, op.kernel, cluster).time_s;
        } else {
          dur = device_compute_cost(op.work, op.kernel, cluster, options.compute_dtype,
                                    options.allow_tf32)
                    .time_s;
        }
        if (op.phase == Phase::optimizer) t.optimizer_s += dur;
        if (op.stream == Stream::compute) {
          t.compute_s += dur;
          compute_iv.push_back({ready, ready + dur});
        }
        break;
      case OpKind::collective: {
        CollectiveCost c =
            collective_cost(op.collective, op.bytes, op.group_size, cluster, options.algorithm);
        dur = c.time_s;
        const auto k = static_cast<std::size_t>(op.collective);
        t.collective_bytes[k] += op.bytes;
        t.collective_count[k] += 1;
        t.intra_node_bytes += c.intra_node_bytes;
        t.inter_node_bytes += c.inter_node_bytes;
        t.comm_s += dur;
        comm_iv.push_back({ready, ready + dur});
        break;
      }
      case OpKind::copy:
        dur = copy_time_s(op.bytes, cluster);
        (op.copy_dir == CopyDir::device_to_host ? t.device_to_host_bytes
                                                : t.host_to_device_bytes) += op.bytes;
        break;
    }
    t.ops[i] = OpTime{ready, ready + dur};
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
  if (t.step_s > 0.0) {
    t.tokens_per_s = static_cast<double>(program.tokens_per_step) * program.ranks / t.step_s;
    t.mfu = program.model_flops_per_step / (t.step_s * t.peak_flops_per_s);
  }
  return t;
}

}  // namespace peftplan::sim
