// Chrome trace export (see trace.h).
// Format: Google, "Trace Event Format" (the catapult/chrome://tracing JSON spec): a top-level
// object with "traceEvents", optional "displayTimeUnit" and "otherData"; events with name, cat,
// ph, ts (microseconds), dur (ph "X"), pid, tid, args; "C" counters plot each args key as a
// series; "M" metadata names processes and threads. Metadata events are written the way
// libkineto's ChromeTraceLogger does (pytorch/kineto libkineto/src/output_json.cpp:
// process_name, process_labels, process_sort_index, thread_name, thread_sort_index, each with
// tid 0 or the thread's tid and the value in args), and the top level carries Kineto's
// "schemaVersion" and "distributedInfo" {"backend", "rank", "world_size"}.
// Memory counter values are memory_timeline()'s program-order live totals, stamped with the
// simulated start of each alloc/free; events are emitted in time order.
#include "peftplan/sim/trace.h"

#include <algorithm>
#include <numeric>

#include "peftplan/common/error.h"
#include "peftplan/common/units.h"
#include "peftplan/sim/compute.h"
#include "peftplan/sim/memory.h"

namespace peftplan::sim {
namespace {

constexpr double kUsPerS = 1e6;

std::string_view thread_label(Stream s) {
  switch (s) {
    case Stream::compute: return "compute stream";
    case Stream::comm: return "comm stream (NCCL)";
    case Stream::copy: return "copy stream (offload)";
    case Stream::host: return "host CPU";
  }
  return "?";
}

// tid 0 carries process metadata in Kineto traces; streams start at 1.
int tid_of(Stream s) { return static_cast<int>(s) + 1; }
constexpr int kCounterTid = 0;

std::string_view kind_name(OpKind k) {
  switch (k) {
    case OpKind::alloc: return "alloc";
    case OpKind::free: return "free";
    case OpKind::compute: return "compute";
    case OpKind::collective: return "collective";
    case OpKind::copy: return "copy";
  }
  return "?";
}

void add_metadata(nlohmann::json& events, const TraceOptions& o, bool with_threads) {
  for (std::int32_t r = 0; r < o.ranks; ++r) {
    const int pid = o.pid_base + r;
    events.push_back({{"name", "process_name"}, {"ph", "M"}, {"ts", 0}, {"pid", pid}, {"tid", 0},
                      {"args", {{"name", fmt::format("{} rank {}", o.process_name, r)}}}});
    events.push_back({{"name", "process_labels"}, {"ph", "M"}, {"ts", 0}, {"pid", pid}, {"tid", 0},
                      {"args", {{"labels", fmt::format("GPU {}", r)}}}});
    events.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"ts", 0}, {"pid", pid},
                      {"tid", 0}, {"args", {{"sort_index", pid}}}});
    if (!with_threads) continue;
    for (int s = 0; s < kNumStreams; ++s) {
      const auto stream = static_cast<Stream>(s);
      events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"ts", 0}, {"pid", pid},
                        {"tid", tid_of(stream)}, {"args", {{"name", thread_label(stream)}}}});
      events.push_back({{"name", "thread_sort_index"}, {"ph", "M"}, {"ts", 0}, {"pid", pid},
                        {"tid", tid_of(stream)}, {"args", {{"sort_index", s}}}});
    }
  }
}

// ts for each memory sample: the simulated start of its op, or the op index when there is no
// timeline. Samples are emitted in ts order (stable, so equal stamps keep program order).
void add_memory_counters(nlohmann::json& events, const Program& program, const Timeline* timeline,
                         const TraceOptions& o) {
  std::vector<MemorySample> samples = memory_timeline(program);
  auto ts_of = [&](const MemorySample& m) {
    const auto i = static_cast<std::size_t>(m.op);
    return timeline ? timeline->ops[i].start_s * kUsPerS : static_cast<double>(m.op);
  };
  std::vector<std::size_t> order(samples.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return ts_of(samples[a]) < ts_of(samples[b]);
  });
  for (std::int32_t r = 0; r < o.ranks; ++r) {
    const int pid = o.pid_base + r;
    for (std::size_t idx : order) {
      const MemorySample& m = samples[idx];
      const double ts = ts_of(m);
      double device = 0, host = 0;
      nlohmann::json dev_cats = nlohmann::json::object(), host_cats = nlohmann::json::object();
      for (int c = 0; c < kNumCategories; ++c) {
        const double gib = to_gib(m.live_bytes[static_cast<std::size_t>(c)]);
        const auto cat = static_cast<MemCategory>(c);
        (on_host(cat) ? host : device) += gib;
        (on_host(cat) ? host_cats : dev_cats)[std::string(name_of(cat))] = gib;
      }
      events.push_back({{"name", "device memory (GiB)"}, {"cat", "memory"}, {"ph", "C"},
                        {"ts", ts}, {"pid", pid}, {"tid", kCounterTid},
                        {"args", {{"total", device}}}});
      events.push_back({{"name", "host memory (GiB)"}, {"cat", "memory"}, {"ph", "C"},
                        {"ts", ts}, {"pid", pid}, {"tid", kCounterTid},
                        {"args", {{"total", host}}}});
      if (!o.category_counters) continue;
      events.push_back({{"name", "device memory by category (GiB)"}, {"cat", "memory"},
                        {"ph", "C"}, {"ts", ts}, {"pid", pid}, {"tid", kCounterTid},
                        {"args", dev_cats}});
      events.push_back({{"name", "host memory by category (GiB)"}, {"cat", "memory"},
                        {"ph", "C"}, {"ts", ts}, {"pid", pid}, {"tid", kCounterTid},
                        {"args", host_cats}});
    }
  }
}

nlohmann::json op_args(const Program& program, std::size_t i) {
  const Op& op = program.ops[i];
  nlohmann::json a = {{"op", i},
                      {"kind", kind_name(op.kind)},
                      {"phase", name_of(op.phase)},
                      {"layer", op.layer},
                      {"micro_batch", op.micro_batch}};
  switch (op.kind) {
    case OpKind::compute:
      a["kernel"] = name_of(op.kernel);
      a["flops"] = op.work.flops;
      a["bytes_moved"] = op.work.bytes_moved;
      if (op.work.gemm_m > 0)
        a["gemm_mnk"] = {op.work.gemm_m, op.work.gemm_n, op.work.gemm_k, op.work.gemm_count};
      if (op.work.params > 0) a["params"] = op.work.params;
      break;
    case OpKind::collective:
      a["collective"] = name_of(op.collective);
      a["bytes"] = op.bytes;
      a["group_size"] = op.group_size;
      // The keys Kineto's record_param_comms events carry, for tools that read them.
      a["Collective name"] = name_of(op.collective);
      a["Group size"] = op.group_size;
      break;
    case OpKind::copy:
      a["direction"] = op.copy_dir == CopyDir::device_to_host ? "device_to_host" : "host_to_device";
      a["bytes"] = op.bytes;
      break;
    default: break;
  }
  if (op.buffer >= 0 && static_cast<std::size_t>(op.buffer) < program.buffers.size())
    a["buffer"] = program.buffers[static_cast<std::size_t>(op.buffer)].name;
  return a;
}

std::string_view category_of(const Op& op) {
  switch (op.kind) {
    case OpKind::collective: return "nccl";
    case OpKind::copy: return "gpu_memcpy";
    default: return op.stream == Stream::host ? "cpu_op" : "kernel";
  }
}

std::string op_name(const Op& op) {
  if (!op.label.empty()) return std::string(op.label);
  switch (op.kind) {
    case OpKind::compute: return std::string(name_of(op.kernel));
    case OpKind::collective: return std::string(name_of(op.collective));
    case OpKind::copy:
      return op.copy_dir == CopyDir::device_to_host ? "copy_d2h" : "copy_h2d";
    default: return std::string(kind_name(op.kind));
  }
}

nlohmann::json top_level(nlohmann::json events, const Program& program, const Timeline* t,
                         const TraceOptions& o, std::string_view name) {
  nlohmann::json j = {{"schemaVersion", 1},
                      {"traceName", name},
                      {"displayTimeUnit", "ms"},
                      {"distributedInfo",
                       {{"backend", "nccl"}, {"rank", 0}, {"world_size", program.ranks}}},
                      {"traceEvents", std::move(events)}};
  nlohmann::json other = {{"generator", "peftplan"}, {"ops", program.ops.size()}};
  if (t) {
    other["step_s"] = t->step_s;
    other["compute_s"] = t->compute_s;
    other["comm_s"] = t->comm_s;
    other["exposed_comm_s"] = t->exposed_comm_s;
    other["optimizer_s"] = t->optimizer_s;
    other["offload_s"] = t->offload_s;
    other["tokens_per_s"] = t->tokens_per_s;
    other["mfu"] = t->mfu;
  }
  j["otherData"] = other;
  return j;
}

}  // namespace

nlohmann::json chrome_trace(const Program& program, const Timeline& timeline,
                            const TraceOptions& options) {
  PEFTPLAN_CHECK(timeline.ops.size() == program.ops.size());
  PEFTPLAN_CHECK(options.ranks >= 1);
  nlohmann::json events = nlohmann::json::array();
  add_metadata(events, options, true);
  for (std::int32_t r = 0; r < options.ranks; ++r) {
    const int pid = options.pid_base + r;
    for (std::size_t i = 0; i < program.ops.size(); ++i) {
      const Op& op = program.ops[i];
      const OpTime& ot = timeline.ops[i];
      if (op.kind == OpKind::alloc || op.kind == OpKind::free || ot.end_s <= ot.start_s) continue;
      events.push_back({{"name", op_name(op)},
                        {"cat", category_of(op)},
                        {"ph", "X"},
                        {"ts", ot.start_s * kUsPerS},
                        {"dur", (ot.end_s - ot.start_s) * kUsPerS},
                        {"pid", pid},
                        {"tid", tid_of(op.stream)},
                        {"args", op_args(program, i)}});
    }
  }
  if (options.memory_counters) add_memory_counters(events, program, &timeline, options);
  return top_level(std::move(events), program, &timeline, options, "peftplan simulated step");
}

nlohmann::json chrome_memory_trace(const Program& program, const Timeline& timeline,
                                   const TraceOptions& options) {
  PEFTPLAN_CHECK(timeline.ops.size() == program.ops.size());
  nlohmann::json events = nlohmann::json::array();
  add_metadata(events, options, false);
  add_memory_counters(events, program, &timeline, options);
  return top_level(std::move(events), program, &timeline, options, "peftplan memory");
}

nlohmann::json chrome_memory_trace(const Program& program, const TraceOptions& options) {
  nlohmann::json events = nlohmann::json::array();
  add_metadata(events, options, false);
  add_memory_counters(events, program, nullptr, options);
  return top_level(std::move(events), program, nullptr, options,
                   "peftplan memory (time axis: op index)");
}

}  // namespace peftplan::sim
