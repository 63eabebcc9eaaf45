// validate(): predicted versus measured (see validate.h for what each measured figure is).
#include "peftplan/planner/validate.h"

#include <algorithm>
#include <filesystem>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <stdexcept>
#include <tuple>

#include <fmt/format.h>

#include "peftplan/common/error.h"
#include "peftplan/common/json_fields.h"
#include "peftplan/common/schemas.h"
#include "peftplan/models/config.h"
#include "peftplan/sim/compute.h"

namespace peftplan::planner {
namespace {

using nlohmann::json;
constexpr std::size_t kTop = 10;

double relative_error(double predicted, double measured) {
  if (predicted == 0.0) return measured == 0.0 ? 0.0 : 1.0;
  return (measured - predicted) / predicted;
}

// A required field of peftplan-exec's measurement.json (`where`: its object path, e.g. "per_rank[1].").
const json& need(const json& j, const char* key, const std::string& where) {
  return json_fields::required(j, key, "measurement.json", where);
}

Figure figure(std::string section, std::string name, double p, double m, double tolerance) {
  Figure f;
  f.section = std::move(section);
  f.name = std::move(name);
  f.predicted = p;
  f.measured = m;
  f.relative_error = relative_error(p, m);
  f.tolerance = tolerance;
  f.within = std::abs(f.relative_error) <= tolerance;
  return f;
}

// Memory figures of one rank's measurement: categories (device, then host) and the device peak.
std::vector<Figure> memory_figures(const Plan& plan, const json& m, double tolerance, const std::string& where) {
  const json& mem = need(m, "memory", where);
  const json& dev = need(mem, "device", where + "memory.");
  const json& host = need(mem, "host", where + "memory.");
  std::vector<Figure> out;
  for (int c = 0; c < sim::kNumCategories; ++c) {
    const auto cc = static_cast<sim::MemCategory>(c);
    const std::string key = std::string(sim::name_of(cc)) + "_bytes";
    const json& side = sim::on_host(cc) ? host : dev;
    const auto q = static_cast<std::uint64_t>(
        json_fields::required_integer(side, key, "measurement.json", where + (sim::on_host(cc) ? "memory.host." : "memory.device."), 0));
    out.push_back(figure("memory", std::string(sim::name_of(cc)),
                         static_cast<double>(plan.memory.category_peak_bytes[static_cast<std::size_t>(c)]), static_cast<double>(q),
                         tolerance));
  }
  out.push_back(figure("memory", "peak", static_cast<double>(plan.memory.device_peak_bytes),
                       static_cast<double>(json_fields::required_integer(dev, "peak_bytes", "measurement.json", where + "memory.device.", 0)),
                       tolerance));
  return out;
}

// (phase, kernel, label); a collective's "kernel" is its kind, a copy's "copy".
std::tuple<std::string, std::string, std::string> kind_of(const sim::Op& op) {
  std::string k = op.kind == sim::OpKind::collective ? std::string(sim::name_of(op.collective))
                  : op.kind == sim::OpKind::copy     ? std::string("copy")
                                                     : std::string(sim::name_of(op.kernel));
  return {std::string(sim::name_of(op.phase)), std::move(k), std::string(op.label)};
}

bool timed_kind(const sim::Op& op) {
  return op.phase != sim::Phase::setup &&
         (op.kind == sim::OpKind::compute || op.kind == sim::OpKind::collective || op.kind == sim::OpKind::copy);
}

bool by_abs_diff(const OpDiff& a, const OpDiff& b) {
  const double da = std::abs(a.diff_s()), db = std::abs(b.diff_s());
  return da != db ? da > db : a.op < b.op;
}

}  // namespace

Spread spread_of(std::vector<double> v) {
  if (v.empty()) return {};
  std::sort(v.begin(), v.end());
  auto at = [&](double q) {  // type 7: h = (n - 1) q
    const double h = static_cast<double>(v.size() - 1) * q;
    const auto lo = static_cast<std::size_t>(std::floor(h));
    const std::size_t hi = std::min(lo + 1, v.size() - 1);
    return v[lo] + (h - static_cast<double>(lo)) * (v[hi] - v[lo]);
  };
  return {at(0.5), at(0.25), at(0.75)};
}

std::vector<std::size_t> steady_samples(std::span<const double> times, std::size_t warmup) {
  std::vector<std::size_t> idx;
  if (times.empty()) return idx;
  const std::size_t first = times.size() > warmup ? std::max(warmup, times.size() - std::min(times.size() - warmup, kSteadyWindow)) : 0;
  for (std::size_t i = first; i < times.size(); ++i) idx.push_back(i);
  std::stable_sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) { return times[a] < times[b]; });
  idx.resize(1);
  std::sort(idx.begin(), idx.end());
  return idx;
}

std::size_t median_index(std::span<const double> values) {
  if (values.empty()) throw std::invalid_argument("median_index: no values");
  std::vector<std::size_t> order(values.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return values[a] < values[b]; });
  return order[(order.size() - 1) / 2];
}

std::string describe(const OpDiff& d) {
  if (d.op >= 0)
    return fmt::format("op {} {} ({}, {}, layer {}, micro-batch {}): predicted {:.3f} ms, measured {:.3f} ms ({:+.3f} ms)", d.op,
                       d.label, d.phase, d.kernel, d.layer, d.micro_batch, d.predicted_s * 1e3, d.measured_s * 1e3, d.diff_s() * 1e3);
  return fmt::format("{} ({}, {}, {} ops): predicted {:.3f} ms, measured {:.3f} ms ({:+.3f} ms)", d.label, d.phase, d.kernel, d.ops,
                     d.predicted_s * 1e3, d.measured_s * 1e3, d.diff_s() * 1e3);
}

double steady_step_s(const std::vector<double>& step_times) {
  if (step_times.empty()) return 0.0;
  double sum = 0.0;
  const std::vector<std::size_t> idx = steady_samples(step_times, 1);
  for (std::size_t i : idx) sum += step_times[i];
  return sum / static_cast<double>(idx.size());
}

namespace {

// The types of every field validate_one reads beyond the memory figures (which read their own):
// a measurement.json that is not peftplan-exec's is refused here, naming the field, before any
// of it is used.
void check_measurement_shape(const json& m) {
  namespace jf = json_fields;
  constexpr const char* src = "measurement.json";
  auto shown = [](const json& v) { return v.dump().substr(0, 60); };
  if (!m.is_object()) throw input_error(src, "", "must hold a JSON object (peftplan-exec's measurement.json)", shown(m));
  auto list = [&](const json& a, const std::string& field, auto&& each) {
    if (!a.is_array()) throw input_error(src, field, "must be a list", shown(a));
    for (std::size_t i = 0; i < a.size(); ++i) each(a[i], fmt::format("{}[{}]", field, i));
  };
  auto number = [&](const json& v, const std::string& field) { jf::as_number(v, src, field, jf::Sign::non_negative); };
  auto index = [&](const json& v, const std::string& field) { jf::as_integer(v, src, field, 0, 1ll << 40); };
  // present at all (null included: none of these is ever null in a measurement.json)
  auto optional = [&](const json& o, const char* key) { return o.is_object() && o.contains(key) ? &o.at(key) : nullptr; };
  if (const json* v = optional(m, "rank")) index(*v, "rank");
  list(need(m, "step_times_s", ""), "step_times_s", number);
  if (const json* v = optional(m, "op_s")) list(*v, "op_s", number);
  if (const json* v = optional(m, "op_s_steps")) index(*v, "op_s_steps");
  if (const json* v = optional(m, "collective_ops")) list(*v, "collective_ops", index);
  if (const json* v = optional(m, "collective_transfer_s")) list(*v, "collective_transfer_s", number);
  if (const json* v = optional(m, "sync_wait_s")) number(*v, "sync_wait_s");
  if (const json* v = optional(m, "exposed_comm_s")) number(*v, "exposed_comm_s");
  if (const json* t = optional(m, "trace")) {
    if (!t->is_object()) throw input_error(src, "trace", "must be an object (a Chrome trace)", shown(*t));
    if (const json* ev = optional(*t, "traceEvents"))
      list(*ev, "trace.traceEvents", [&](const json& e, const std::string& at) {
        if (!e.is_object()) throw input_error(src, at, "must be an object (a trace event)", shown(e));
        for (const char* key : {"ph", "name"})
          if (const json* v = optional(e, key)) jf::as_string(*v, src, at + "." + key);
        if (const json* args = optional(e, "args")) {
          if (!args->is_object()) throw input_error(src, at + ".args", "must be an object", shown(*args));
          if (const json* op = optional(*args, "op")) {
            index(*op, at + ".args.op");
            number(jf::required(e, "dur", src, at + "."), at + ".dur");
          }
        }
      });
  }
  if (const json* v = optional(m, "ops"))
    list(*v, "ops", [&](const json& o, const std::string& at) {
      for (const char* key : {"phase", "kernel", "label"}) jf::as_string(jf::required(o, key, src, at + "."), src, at + "." + key);
      number(jf::required(o, "total_s", src, at + "."), at + ".total_s");
    });
  if (const json* c = optional(m, "collectives")) {
    if (!c->is_object()) throw input_error(src, "collectives", "must be an object of collective kinds", shown(*c));
    for (const auto& [kind, e] : c->items()) {
      const std::string at = "collectives." + kind + ".";
      number(jf::required(e, "seconds", src, at), at + "seconds");
      jf::as_integer(jf::required(e, "bytes_per_step", src, at), src, at + "bytes_per_step", 0);
    }
  }
}

void set_load_change(Validation& v) {
  v.load_change.reset();
  if (v.others_cpu_share && v.calibration_others_cpu_share) v.load_change = *v.others_cpu_share - *v.calibration_others_cpu_share;
}

// One measurement against the plan: every figure, the parts' share of the step, the step's
// spread over its own steps. Verdicts are settled by finish().
Validation validate_one(const Plan& plan, const json& m, const Tolerances& tol) {
  check_measurement_shape(m);
  // A run of another world size measured another job (each rank holds its share of the states).
  const std::int32_t world = plan.input.strategy.ranks;
  if (m.contains("ranks")) {
    const std::int64_t measured = json_fields::as_integer(m.at("ranks"), "measurement.json", "ranks", 1, 1ll << 20);
    if (measured != world)
      throw input_error("measurement.json", "ranks", fmt::format("must be the plan's {} rank(s): a measurement of another job", world),
                        std::to_string(measured));
  }
  if (m.contains("rank") && m.at("rank").get<std::int64_t>() >= world)
    throw input_error("measurement.json", "rank", fmt::format("must be one of the plan's ranks, 0 to {}", world - 1), m.at("rank").dump());
  if (!plan.time) throw InputError("validate: the plan has no simulated timeline (make_plan with simulate_time)");
  const sim::Timeline& tl = *plan.time;
  const sim::Program& prog = plan.program;
  Validation v;
  v.tolerances = tol;

  // Memory: every rank when per_rank is there, the worst one (largest |relative error|) kept.
  if (m.contains("per_rank") && m.at("per_rank").is_array() && !m.at("per_rank").empty()) {
    const json& ranks = m.at("per_rank");
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      std::vector<Figure> f = memory_figures(plan, ranks[r], tol.memory, fmt::format("per_rank[{}].", r));
      for (Figure& x : f) x.rank = static_cast<std::int32_t>(r);
      if (v.memory.empty()) {
        v.memory = std::move(f);
        continue;
      }
      for (std::size_t i = 0; i < f.size(); ++i)
        if (std::abs(f[i].relative_error) > std::abs(v.memory[i].relative_error)) v.memory[i] = f[i];
    }
  } else {
    v.memory = memory_figures(plan, m, tol.memory, "");
    const json* r = m.contains("rank") ? &m.at("rank") : nullptr;  // an index (check_measurement_shape)
    const auto rank = static_cast<std::int32_t>(r ? r->get<std::int64_t>() : 0);
    for (Figure& x : v.memory) x.rank = rank;
  }

  // The machine's speed during the run against calibration's (calibrate.h, speed_probe).
  const double calibration_probe = plan.cluster.host_calibration.speed_probe_flops_per_s;
  if (const auto probe = json_fields::nullable_number(m, "speed_probe_flops_per_s", "measurement.json")) {
    v.probe_flops_per_s = *probe;
    v.calibration_probe_flops_per_s = calibration_probe;
    if (calibration_probe > 0.0 && v.probe_flops_per_s > 0.0) v.speed_drift = v.probe_flops_per_s / calibration_probe - 1.0;
  }
  // And the machine's other work during the run against calibration's (host_load.h).
  v.calibration_others_cpu_share = plan.cluster.host_calibration.others_cpu_share;
  v.others_cpu_share = json_fields::nullable_number(m, "others_cpu_share", "measurement.json", "", json_fields::Sign::non_negative);
  set_load_change(v);

  // Per-op measured seconds of one step: the last step's trace when given, else the totals.
  const auto step_times = need(m, "step_times_s", "").get<std::vector<double>>();
  v.steps = static_cast<std::int64_t>(step_times.size());
  if (step_times.empty()) throw InputError("measurement.json: step_times_s is empty (no step was measured)");
  const double steps = static_cast<double>(step_times.size());
  std::vector<std::optional<double>> op_measured(prog.ops.size());
  // Preferred: "op_s", every program op's mean seconds over the steady steps (steady_samples).
  const bool have_op_s = m.contains("op_s") && m.at("op_s").is_array() && !m.at("op_s").empty() &&
                         m.value("op_s_steps", std::int64_t{0}) > 0;
  if (have_op_s && m.at("op_s").size() != prog.ops.size())
    throw InputError(fmt::format("measurement.json: op_s has {} entries, the plan's program {} ops (was the run made from another plan?)",
                                 m.at("op_s").size(), prog.ops.size()));
  const bool have_trace = !have_op_s && m.contains("trace") && m.at("trace").is_object() && m.at("trace").contains("traceEvents");
  if (have_op_s) {
    v.op_time_source = fmt::format("op_s (mean of {} steady step(s))", m.at("op_s_steps").get<std::int64_t>());
    const json& a = m.at("op_s");
    for (std::size_t i = 0; i < prog.ops.size(); ++i)
      if (timed_kind(prog.ops[i])) op_measured[i] = a[i].get<double>();
    // Several ranks: a collective's measured time is its transfer, the shortest rank's call (the
    // rest of the others' calls is waiting for the last rank to arrive, reported as sync_wait_s),
    // each the mean over the steps after the first (executor/runner.h split_collective_time),
    // not the steady step the other op times describe: one step's call time on shared cores is
    // too noisy to judge. comm_s and sync_wait_s are therefore a typical step's, step_s,
    // compute_s and exposed_comm_s the steady step's.
    if (m.contains("collective_transfer_s") && m.contains("collective_ops")) {
      const auto ops = m.at("collective_ops").get<std::vector<std::int64_t>>();
      const auto tr = m.at("collective_transfer_s").get<std::vector<double>>();
      if (ops.size() != tr.size()) throw InputError("measurement.json: collective_transfer_s and collective_ops differ in length");
      for (std::size_t c = 0; c < ops.size(); ++c) {
        if (ops[c] < 0 || static_cast<std::size_t>(ops[c]) >= prog.ops.size() ||
            prog.ops[static_cast<std::size_t>(ops[c])].kind != sim::OpKind::collective)
          throw InputError(fmt::format("measurement.json: collective_ops[{}] = {} is no collective of the plan's program", c, ops[c]));
        op_measured[static_cast<std::size_t>(ops[c])] = tr[c];
      }
      v.sync_wait_s = m.value("sync_wait_s", 0.0);
      v.op_time_source += "; collectives: their transfer, the shortest rank's call, the mean over the steps after the first";
    }
  } else if (have_trace) {
    v.op_time_source = "trace (last step)";
    for (const json& e : m.at("trace").at("traceEvents")) {
      if (e.value("ph", "") != "X" || !e.contains("args") || !e.at("args").contains("op")) continue;
      const auto i = e.at("args").at("op").get<std::int64_t>();
      if (i < 0 || static_cast<std::size_t>(i) >= prog.ops.size() || prog.ops[static_cast<std::size_t>(i)].kind != sim::OpKind::compute)
        throw InputError(fmt::format("measurement trace: event \"{}\" names op {}, which is no compute op of the plan's {} ops "
                                     "(was the run made from another plan?)",
                                     e.value("name", ""), i, prog.ops.size()));
      op_measured[static_cast<std::size_t>(i)] = op_measured[static_cast<std::size_t>(i)].value_or(0.0) + e.at("dur").get<double>() * 1e-6;
    }
  } else {
    v.op_time_source = "ops (mean over all steps)";
  }

  // Kinds: predicted per step from the timeline; measured from "ops" (mean over all steps).
  std::map<std::tuple<std::string, std::string, std::string>, OpDiff> kinds;
  for (std::size_t i = 0; i < prog.ops.size(); ++i) {
    const sim::Op& op = prog.ops[i];
    if (have_op_s ? !timed_kind(op) : (op.kind != sim::OpKind::compute || op.phase == sim::Phase::setup)) continue;
    const auto k = kind_of(op);
    auto [it, inserted] = kinds.try_emplace(k);
    OpDiff& d = it->second;
    if (inserted) {
      std::tie(d.phase, d.kernel, d.label) = k;
      d.ops = 0;
    }
    d.ops += 1;
    d.predicted_s += tl.ops[i].end_s - tl.ops[i].start_s;
    if (have_op_s) d.measured_s += *op_measured[i];
  }
  if (!have_op_s)
  for (const json& o : need(m, "ops", "")) {
    const auto k = std::make_tuple(o.at("phase").get<std::string>(), o.at("kernel").get<std::string>(), o.at("label").get<std::string>());
    auto [it, inserted] = kinds.try_emplace(k);
    if (inserted) {
      std::tie(it->second.phase, it->second.kernel, it->second.label) = k;
      it->second.ops = 0;
    }
    it->second.measured_s += o.at("total_s").get<double>() / steps;
  }
  for (auto& [k, d] : kinds) v.kinds.push_back(d);
  std::sort(v.kinds.begin(), v.kinds.end(), by_abs_diff);

  // Per op (trace only): every compute op the trace timed.
  double compute_m = 0.0, optimizer_m = 0.0, comm_ops_m = 0.0;
  if (have_op_s || have_trace) {
    for (std::size_t i = 0; i < prog.ops.size(); ++i) {
      if (!op_measured[i]) continue;
      const sim::Op& op = prog.ops[i];
      OpDiff d;
      d.op = static_cast<std::int32_t>(i);
      std::tie(d.phase, d.kernel, d.label) = kind_of(op);
      d.layer = op.layer;
      d.micro_batch = op.micro_batch;
      d.predicted_s = tl.ops[i].end_s - tl.ops[i].start_s;
      d.measured_s = *op_measured[i];
      if (op.kind == sim::OpKind::compute && op.stream == sim::Stream::compute) compute_m += d.measured_s;
      if (op.kind == sim::OpKind::compute && op.phase == sim::Phase::optimizer) optimizer_m += d.measured_s;
      if (op.kind == sim::OpKind::collective) comm_ops_m += d.measured_s;
      v.ops.push_back(std::move(d));
    }
    std::sort(v.ops.begin(), v.ops.end(), by_abs_diff);
  } else {
    // A kind counts as compute-stream when its program ops are (kinds do not straddle streams).
    std::map<std::tuple<std::string, std::string, std::string>, sim::Stream> stream;
    for (const sim::Op& op : prog.ops)
      if (op.kind == sim::OpKind::compute) stream.emplace(kind_of(op), op.stream);
    for (const OpDiff& d : v.kinds) {
      const auto it = stream.find({d.phase, d.kernel, d.label});
      if (it == stream.end() || it->second == sim::Stream::compute) compute_m += d.measured_s;
      if (d.phase == "optimizer") optimizer_m += d.measured_s;
    }
  }
  if (!v.ops.empty()) v.most_different = v.ops.front();
  else if (!v.kinds.empty()) v.most_different = v.kinds.front();
  if (v.ops.size() > kTop) v.ops.resize(kTop);
  if (v.kinds.size() > kTop) v.kinds.resize(kTop);

  // Time figures.
  const double step_m = steady_step_s(step_times);
  double comm_m = 0.0;
  const json empty = json::object();
  const json& coll = m.contains("collectives") ? m.at("collectives") : empty;
  if (have_op_s) comm_m = comm_ops_m;  // the sum over collective ops of their per-op times
  else
    for (const auto& [kind, c] : coll.items()) comm_m += c.at("seconds").get<double>() / steps;
  // Exposed: the time the compute thread stood waiting for collectives when the executor measured
  // it, else all of comm_s (older measurements; collectives then blocked the rank).
  const double exposed_m = have_op_s && m.contains("exposed_comm_s") ? m.at("exposed_comm_s").get<double>() : comm_m;
  v.time = {figure("time", "step_s", tl.step_s, step_m, tol.time),
            figure("time", "compute_s", tl.compute_s, compute_m, tol.time),
            figure("time", "comm_s", tl.comm_s, comm_m, tol.time),
            figure("time", "exposed_comm_s", tl.exposed_comm_s, exposed_m, tol.time),
            figure("time", "optimizer_s", tl.optimizer_s, optimizer_m, tol.time)};
  // Waiting for the last rank to arrive: predicted from the calibrated skew per call.
  if (v.sync_wait_s) v.time.push_back(figure("time", "sync_wait_s", tl.sync_wait_s, *v.sync_wait_s, tol.time));
  // One measurement's spread: its steps after the first (the parts have no per-step figures).
  if (step_times.size() > 2) {
    v.time.front().spread = spread_of(std::vector<double>(step_times.begin() + 1, step_times.end())).iqr();
    v.time.front().has_spread = true;
    v.time.front().rounds = {step_m};
  }
  // The parts of the step are judged by what their error does to the step (finish()): a part is
  // within tolerance when its own relative error is, or when its absolute error is within the
  // tolerance times the predicted step (0.3 ms of a 30 ms step is 1% of the step, whatever it
  // is of a 0.05 ms all-reduce).

  // Collective bytes per step, per kind either side has.
  for (int c = 0; c < sim::kNumCollectives; ++c) {
    const std::string kind(sim::name_of(static_cast<sim::Collective>(c)));
    const auto p = static_cast<double>(tl.collective_bytes[static_cast<std::size_t>(c)]);
    const double q = coll.contains(kind) ? static_cast<double>(coll.at(kind).at("bytes_per_step").get<std::uint64_t>()) : 0.0;
    if (p != 0.0 || q != 0.0) v.comm.push_back(figure("comm", kind, p, q, tol.memory));
  }

  return v;
}

// Settles each figure's verdict. A time figure is within tolerance when its relative error is (a
// part also when its error is a small share of the step). With a speed drift it is judged twice:
// as predicted, and with the prediction at the run's speed (predicted seconds / (1 + drift)), the
// machine having moved by the drift. It is conclusive when its spread is within the tolerance
// (judged the same way) and both verdicts agree; a miss also needs spread + |drift| within the
// tolerance. The probe tracks the run's speed only roughly (README, "Predicted versus
// measured": with one rank it read a median 38% faster while the steps ran as predicted), so a
// verdict that hangs on which reading is right is inconclusive, and so is a miss that a wrong
// probe could make: a step 21% slow on a probe 17% fast is outside at both speeds, and proves
// nothing about the model when the probe itself is that far out.
void finish(Validation& v, double predicted_step_s) {
  const Tolerances& tol = v.tolerances;
  const double drift = v.speed_drift ? std::abs(*v.speed_drift) : 0.0;
  const double at_run_speed = v.speed_drift && *v.speed_drift > -1.0 ? 1.0 / (1.0 + *v.speed_drift) : 1.0;
  const double load = v.load_change ? *v.load_change : 0.0;
  // `slower`: the figure says the run took longer than predicted (a time above its prediction,
  // tokens/s below); more other work can only have made it slower, less only faster.
  const auto settle = [&](Figure& f, double noise, bool within_at_run_speed, bool slower) {
    using U = Figure::Unsure;
    const bool load_explains = load != 0.0 && (load > 0.0) == slower;
    f.unsure = noise > tol.time                                                           ? U::spread
               : within_at_run_speed != f.within                                          ? U::speed_decides
               : !f.within && noise + drift > tol.time                                    ? U::drift_wide
               : !f.within && load_explains && noise + drift + std::abs(load) > tol.time  ? U::load_changed
                                                                                          : U::no;
    f.conclusive = f.unsure == U::no;
  };
  for (Figure& f : v.time) {
    const bool step = f.name == "step_s";
    const auto within_at = [&](double scale) {  // predictions times `scale`
      const double rel = relative_error(f.predicted * scale, f.measured);
      const double share = predicted_step_s > 0.0 ? (f.measured - f.predicted * scale) / (predicted_step_s * scale) : rel;
      return std::abs(rel) <= tol.time || (!step && std::abs(share) <= tol.time);
    };
    f.relative_error = relative_error(f.predicted, f.measured);
    f.share_of_step = step ? 0.0 : predicted_step_s > 0.0 ? (f.measured - f.predicted) / predicted_step_s : f.relative_error;
    f.within = within_at(1.0);
    f.error_at_run_speed.reset();
    if (v.speed_drift) f.error_at_run_speed = relative_error(f.predicted * at_run_speed, f.measured);
    const double noise = !f.has_spread ? 0.0
                         : step        ? (f.measured > 0.0 ? f.spread / f.measured : 0.0)
                                       : (predicted_step_s > 0.0 ? f.spread / predicted_step_s : 0.0);
    settle(f, noise, within_at(at_run_speed), f.measured > f.predicted);
  }
  for (Figure& f : v.throughput) {  // judged like the step, whose spread it shares; tokens/s scale the other way
    f.relative_error = relative_error(f.predicted, f.measured);
    f.within = std::abs(f.relative_error) <= tol.time;
    f.error_at_run_speed.reset();
    if (v.speed_drift) f.error_at_run_speed = relative_error(f.predicted / at_run_speed, f.measured);
    const double noise = f.has_spread && f.measured > 0.0 ? f.spread / f.measured : 0.0;
    settle(f, noise, f.error_at_run_speed ? std::abs(*f.error_at_run_speed) <= tol.time : f.within, f.measured < f.predicted);
  }
  v.outside.clear();
  v.inconclusive.clear();
  for (const auto* section : {&v.memory, &v.time, &v.comm, &v.throughput})
    for (const Figure& f : *section) {
      if (!f.conclusive) v.inconclusive.push_back(f.key());
      else if (!f.within) v.outside.push_back(f.key());
    }
  v.within_tolerance = v.outside.empty();
}

// The worst of several rounds' figures (largest |relative error|), figure by figure.
void keep_worst(std::vector<Figure>& into, const std::vector<Figure>& other) {
  for (std::size_t i = 0; i < into.size() && i < other.size(); ++i)
    if (std::abs(other[i].relative_error) > std::abs(into[i].relative_error)) into[i] = other[i];
}

}  // namespace

std::vector<std::filesystem::path> run_folders(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return {path.parent_path()};  // a validation.json: its folder
  if (fs::is_regular_file(path / "validation.json", ec)) return {path};
  if (!fs::is_regular_file(path / "summary.json", ec))
    throw InputError(fmt::format("{}: no validation.json or summary.json here (give a peftplan run folder or a validation.json)", path.string()));
  const std::string source = (path / "summary.json").string();
  const json summary = models::read_json_file(source);
  const json* runs = json_fields::find(summary, "runs");
  if (!runs || !runs->is_array()) throw input_error(source, "runs", "must list the run's strategies");
  std::vector<fs::path> dirs;
  for (std::size_t i = 0; i < runs->size(); ++i) {
    const std::string strategy = json_fields::string((*runs)[i], "strategy", source, "", fmt::format("runs[{}].", i));
    if (strategy.empty() || strategy.find('/') != std::string::npos || strategy == "." || strategy == "..")
      throw input_error(source, fmt::format("runs[{}].strategy", i), "must be a strategy name (its folder beside summary.json)", (*runs)[i].dump());
    dirs.push_back(path / strategy);
  }
  return dirs;
}

std::optional<JobProbe> job_probe_median(std::span<const json* const> measurements) {
  std::vector<double> probes;
  for (const json* m : measurements)
    if (const auto p = json_fields::nullable_number(*m, "speed_probe_flops_per_s", "measurement.json"); p && *p > 0.0) probes.push_back(*p);
  if (probes.empty()) return std::nullopt;
  const auto n = static_cast<std::int32_t>(probes.size());
  return JobProbe{spread_of(std::move(probes)).median, n};
}

Validation validate_rounds(const Plan& plan, std::span<const json> rounds, const Tolerances& tol, const std::optional<JobProbe>& job_probe) {
  if (rounds.empty()) throw InputError("validate: no measurement to compare with the plan");
  std::vector<Validation> vs;
  vs.reserve(rounds.size());
  for (const json& m : rounds) vs.push_back(validate_one(plan, m, tol));
  const double predicted_step = plan.time->step_s;
  // The machine's speed: the job's probe when given (see the header), else this plan's rounds'.
  const auto set_speed = [&](Validation& v, double probe, std::int32_t count, bool job) {
    v.probe_flops_per_s = probe;
    v.probes = count;
    v.job_probe = job;
    if (v.calibration_probe_flops_per_s > 0.0 && probe > 0.0) v.speed_drift = probe / v.calibration_probe_flops_per_s - 1.0;
  };
  if (vs.size() == 1) {
    Validation& v = vs.front();
    v.probes = v.probe_flops_per_s > 0.0 ? 1 : 0;
    if (job_probe) {
      v.calibration_probe_flops_per_s = plan.cluster.host_calibration.speed_probe_flops_per_s;
      set_speed(v, job_probe->flops_per_s, job_probe->probes, true);
    }
    finish(v, predicted_step);
    return std::move(v);
  }
  // The round with the median step shows the op-by-op view; every figure is combined.
  std::vector<double> steps;
  for (const Validation& x : vs) steps.push_back(x.time.front().measured);
  const std::size_t mid = median_index(steps);
  Validation v = vs[mid];
  v.rounds = static_cast<std::int32_t>(vs.size());
  v.op_round = static_cast<std::int32_t>(mid);
  for (std::size_t r = 0; r < vs.size(); ++r) {
    if (vs[r].time.size() != v.time.size() || vs[r].memory.size() != v.memory.size() || vs[r].comm.size() != v.comm.size())
      throw InputError(fmt::format("measurement round {} does not measure what round {} does (were they runs of one plan?)", r + 1, mid + 1));
    keep_worst(v.memory, vs[r].memory);
    keep_worst(v.comm, vs[r].comm);
  }
  for (std::size_t i = 0; i < v.time.size(); ++i) {
    Figure& f = v.time[i];
    f.rounds.clear();
    for (const Validation& x : vs) f.rounds.push_back(x.time[i].measured);
    const Spread sp = spread_of(f.rounds);
    f.measured = sp.median;
    f.spread = sp.iqr();
    f.has_spread = true;
  }
  if (job_probe) {
    v.calibration_probe_flops_per_s = plan.cluster.host_calibration.speed_probe_flops_per_s;
    set_speed(v, job_probe->flops_per_s, job_probe->probes, true);
  } else {
    std::vector<double> probes;
    for (const Validation& x : vs)
      if (x.probe_flops_per_s > 0.0) probes.push_back(x.probe_flops_per_s);
    if (!probes.empty()) set_speed(v, spread_of(probes).median, static_cast<std::int32_t>(probes.size()), false);
  }
  std::vector<double> shares;
  for (const Validation& x : vs)
    if (x.others_cpu_share) shares.push_back(*x.others_cpu_share);
  v.others_cpu_share.reset();
  if (!shares.empty()) v.others_cpu_share = spread_of(shares).median;
  set_load_change(v);
  if (v.sync_wait_s) {
    std::vector<double> w;
    for (const Validation& x : vs) w.push_back(x.sync_wait_s.value_or(0.0));
    v.sync_wait_s = spread_of(w).median;
  }
  finish(v, predicted_step);
  return v;
}

Validation validate(const Plan& plan, const json& m, const Tolerances& tol) { return validate_rounds(plan, std::span<const json>(&m, 1), tol); }

Tolerances tolerances_for(RuntimeProfile profile) {
  switch (profile) {
    case RuntimeProfile::executor: return {0.02, 0.15};
    default: return {0.05, 0.15};
  }
}

double calibration_noise_limit() { return tolerances_for(RuntimeProfile::executor).time / 3.0; }

std::string_view name_of(Figure::Unsure u) {
  switch (u) {
    case Figure::Unsure::no: return "no";
    case Figure::Unsure::spread: return "spread";
    case Figure::Unsure::speed_decides: return "speed_decides";
    case Figure::Unsure::drift_wide: return "drift_wide";
    case Figure::Unsure::load_changed: return "load_changed";
  }
  return "?";
}

std::optional<Figure::Unsure> unsure_from_name(std::string_view s) {
  for (auto u : {Figure::Unsure::spread, Figure::Unsure::speed_decides, Figure::Unsure::drift_wide, Figure::Unsure::load_changed})
    if (s == name_of(u)) return u;
  return std::nullopt;
}

std::string_view name_of(Verdict v) {
  switch (v) {
    case Verdict::within: return "within";
    case Verdict::outside: return "outside";
    case Verdict::inconclusive: return "inconclusive";
  }
  return "?";
}

namespace {

// Reading a totals measurement: fields by name (common/json_fields.h), errors naming the file
// and the field. A figure the callback could not take is written as null: present, but null.
struct TotalsReader {
  std::string_view source;
  [[noreturn]] void fail(const std::string& field, const std::string& problem, const json& value) const {
    std::string shown = value.dump();
    if (shown.size() > 80) shown = shown.substr(0, 77) + "...";
    throw input_error(source, field, problem, shown);
  }
  const json& need(const json& obj, const char* key, const std::string& prefix) const {
    return json_fields::required(obj, key, source, prefix);
  }
  const json& object(const json& obj, const char* key, const std::string& prefix) const {
    return json_fields::required_object(obj, key, source, prefix);
  }
  // A non-negative number or null (nullopt); the field must be there.
  std::optional<double> number(const json& obj, const char* key, const std::string& prefix) const {
    need(obj, key, prefix);
    return json_fields::nullable_number(obj, key, source, prefix, json_fields::Sign::non_negative);
  }
  std::optional<std::int64_t> integer(const json& obj, const char* key, const std::string& prefix) const {
    return json_fields::nullable_integer(obj, key, source, prefix);
  }
};

}  // namespace

Validation validate_totals(const Plan& plan, const json& m, std::string_view source, const std::optional<std::string>& plan_sha,
                           const Tolerances& tol) {
  if (!plan.time) throw InputError("validate_totals: the plan has no simulated timeline (make_plan with simulate_time)");
  const TotalsReader rd{source};
  if (!m.is_object()) rd.fail("", "must be a JSON object (a measurement written by tools/peftplan_callback.py)", m);
  const json& schema = rd.need(m, "schema", "");
  if (schema != schemas::kMeasurementTotals)
    rd.fail("schema", fmt::format("must be \"{}\" (or \"{}\" from peftplan-exec)", schemas::kMeasurementTotals, schemas::kMeasurement), schema);
  const auto world = rd.integer(m, "world_size", "");
  if (!world || *world < 1) rd.fail("world_size", "must be a positive integer", rd.need(m, "world_size", ""));
  const std::int32_t ranks = plan.input.strategy.ranks;
  if (*world != ranks)
    throw input_error(source, "world_size", fmt::format("must be the plan's {} rank(s): a measurement of another job", ranks),
                      std::to_string(*world));
  // The model: every architecture field the measurement has must be the plan's.
  const json& model = rd.object(m, "model", "");
  const json& arch = rd.object(model, "architecture", "model.");
  const models::ModelSpec& ms = plan.input.model;
  const std::pair<const char*, std::int64_t> fields[] = {{"hidden_size", ms.hidden},           {"num_hidden_layers", ms.layers},
                                                          {"num_attention_heads", ms.heads},    {"num_key_value_heads", ms.kv_heads},
                                                          {"intermediate_size", ms.intermediate}, {"vocab_size", ms.vocab}};
  Validation v;
  v.tolerances = tol;
  for (const auto& [key, expected] : fields) {
    const auto got = rd.integer(arch, key, "model.architecture.");
    if (!got) {
      v.notes.push_back(fmt::format("the measurement has no model.architecture.{}; not checked against the plan's {}", key, expected));
      continue;
    }
    if (*got != expected)
      throw input_error(source, std::string("model.architecture.") + key,
                        fmt::format("must be the plan's model's ({}: {}): a measurement of another model", ms.name, expected),
                        std::to_string(*got));
  }
  if (auto it = model.find("config_sha256"); it != model.end() && it->is_string() && plan_sha) {
    if (it->get<std::string>() == *plan_sha) v.notes.push_back("model: the config.json hash matches the plan's");
    else
      v.notes.push_back(fmt::format("model: the config.json hash differs from the plan's ({:.12} vs {:.12}); its architecture fields "
                                    "agree (a config with other non-architecture fields)",
                                    it->get<std::string>(), *plan_sha));
  }
  const json& per_rank = rd.need(m, "per_rank", "");
  if (!per_rank.is_array() || per_rank.empty()) rd.fail("per_rank", "must be a non-empty array (one object per rank)", per_rank);
  const json& worst = rd.object(m, "max", "");
  v.steps = rd.integer(m, "steps", "").value_or(0);
  v.op_time_source = "totals (the slowest rank's median step after warm-up, tools/peftplan_callback.py)";

  // Memory: the allocated peak; reserved and in-use are measured, not predicted by this plan.
  if (const auto alloc = rd.number(worst, "max_memory_allocated_bytes", "max.")) {
    v.memory.push_back(figure("memory", "peak", static_cast<double>(plan.memory.device_peak_bytes), *alloc, tol.memory));
  } else {
    v.notes.push_back("max.max_memory_allocated_bytes is null (no CUDA device in the measured job?): memory not compared");
  }
  for (const char* key : {"max_memory_reserved_bytes", "device_memory_used_bytes"})
    if (const auto x = rd.number(worst, key, "max."))
      v.notes.push_back(fmt::format("max.{} measured {:.3f} GiB; this plan predicts the allocated peak only", key, *x / (1024.0 * 1024.0 * 1024.0)));

  // Time: the slowest rank's step with its spread.
  const auto step = rd.number(worst, "step_s", "max.");
  if (!step || !(*step > 0.0)) rd.fail("max.step_s", "must be a positive number of seconds", rd.need(worst, "step_s", "max."));
  Figure st = figure("time", "step_s", plan.time->step_s, *step, tol.time);
  if (const auto iqr = rd.number(worst, "step_s_iqr", "max.")) {
    st.spread = *iqr;
    st.has_spread = true;
  }
  v.time.push_back(st);
  const double predicted_tps = plan.time->tokens_per_s / static_cast<double>(ranks);
  if (const auto tps = rd.number(worst, "tokens_per_s_per_gpu", "max.")) {
    Figure f = figure("throughput", "tokens_per_s_per_gpu", predicted_tps, *tps, tol.time);
    f.spread = st.has_spread && *step > 0.0 ? *tps * st.spread / *step : 0.0;  // the step's relative spread
    f.has_spread = st.has_spread;
    v.throughput.push_back(f);
  } else {
    v.notes.push_back("max.tokens_per_s_per_gpu is null (tokens per step unknown to the callback): throughput not compared");
  }
  const auto& t = plan.input.training;
  const std::int64_t plan_tokens = t.micro_batch * t.seq_len * t.grad_accum * ranks;
  if (const auto tokens = rd.integer(m, "tokens_per_step", ""); tokens && *tokens != plan_tokens)
    v.notes.push_back(fmt::format("the job processed {} tokens per step, the plan's step has {} (micro-batch {} x sequence {} x "
                                  "accumulation {} x {} rank(s)): compare the time figures with care",
                                  *tokens, plan_tokens, t.micro_batch, t.seq_len, t.grad_accum, ranks));
  finish(v, plan.time->step_s);
  return v;
}

json validation_to_json(const Validation& v) {
  json j;
  j["schema"] = schemas::kValidation;
  json mem = json::object(), ranks = json::object(), time = json::object(), comm = json::object();
  for (const Figure& f : v.memory) {
    mem[f.name] = {{"predicted_bytes", static_cast<std::uint64_t>(f.predicted)},
                   {"measured_bytes", static_cast<std::uint64_t>(f.measured)},
                   {"relative_error", f.relative_error}};
    ranks[f.name] = f.rank;
  }
  for (const Figure& f : v.time) {
    time[f.name] = {{"predicted", f.predicted}, {"measured", f.measured}, {"relative_error", f.relative_error},
                    {"inconclusive_because", f.unsure == Figure::Unsure::no ? json(nullptr) : json(name_of(f.unsure))},
                    {"relative_error_at_run_speed", f.error_at_run_speed ? json(*f.error_at_run_speed) : json(nullptr)},
                    {"within_tolerance", f.within}, {"verdict", name_of(f.verdict())},
                    {"spread_s", f.has_spread ? json(f.spread) : json(nullptr)}, {"rounds", f.rounds}};
    if (f.name != "step_s") time[f.name]["error_share_of_step"] = f.share_of_step;
  }
  for (const Figure& f : v.comm)
    comm[f.name] = {{"predicted_bytes", static_cast<std::uint64_t>(f.predicted)},
                    {"measured_bytes", static_cast<std::uint64_t>(f.measured)},
                    {"relative_error", f.relative_error}};
  auto op_json = [](const OpDiff& d) {
    json o = {{"phase", d.phase}, {"kernel", d.kernel}, {"label", d.label}, {"predicted_s", d.predicted_s},
              {"measured_s", d.measured_s}, {"diff_s", d.diff_s()}};
    if (d.op >= 0) {
      o["op"] = d.op;
      o["layer"] = d.layer;
      o["micro_batch"] = d.micro_batch;
    } else {
      o["ops"] = d.ops;
    }
    return o;
  };
  json ops = json::array(), kinds = json::array();
  for (const OpDiff& d : v.ops) ops.push_back(op_json(d));
  for (const OpDiff& d : v.kinds) kinds.push_back(op_json(d));
  json tput = json::object();
  for (const Figure& f : v.throughput)
    tput[f.name] = {{"predicted", f.predicted}, {"measured", f.measured}, {"relative_error", f.relative_error},
                    {"inconclusive_because", f.unsure == Figure::Unsure::no ? json(nullptr) : json(name_of(f.unsure))},
                    {"relative_error_at_run_speed", f.error_at_run_speed ? json(*f.error_at_run_speed) : json(nullptr)},
                    {"within_tolerance", f.within}, {"verdict", name_of(f.verdict())}};
  j["memory"] = mem;
  j["time"] = time;
  if (!v.throughput.empty()) j["throughput"] = tput;
  j["comm"] = comm;
  j["within_tolerance"] = v.within_tolerance;
  j["outside"] = v.outside;
  j["inconclusive"] = v.inconclusive;
  j["notes"] = v.notes;
  j["rounds"] = v.rounds;
  j["op_round"] = v.op_round + 1;
  j["tolerances"] = {{"memory", v.tolerances.memory}, {"time", v.tolerances.time}};
  j["memory_rank"] = ranks;
  j["steps"] = v.steps;
  if (v.sync_wait_s) j["sync_wait_s"] = *v.sync_wait_s;
  j["speed_probe"] = {{"run_flops_per_s", v.probe_flops_per_s > 0.0 ? json(v.probe_flops_per_s) : json(nullptr)},
                      {"calibration_flops_per_s", v.calibration_probe_flops_per_s > 0.0 ? json(v.calibration_probe_flops_per_s) : json(nullptr)},
                      {"drift", v.speed_drift ? json(*v.speed_drift) : json(nullptr)},
                      {"probes", v.probes},
                      {"over", v.job_probe ? "job" : "rounds"}};
  const auto optional_number = [](const std::optional<double>& x) { return x ? json(*x) : json(nullptr); };
  j["host_load"] = {{"run_others_cpu_share", optional_number(v.others_cpu_share)},
                    {"calibration_others_cpu_share", optional_number(v.calibration_others_cpu_share)},
                    {"change", optional_number(v.load_change)}};
  j["op_time_source"] = v.op_time_source;
  j["most_different_op"] = v.most_different ? op_json(*v.most_different) : json(nullptr);
  j["ops"] = ops;
  j["op_kinds"] = kinds;
  return j;
}

Validation validation_from_json(const json& j, std::string_view source) {
  auto fail = [&](const std::string& field, const std::string& problem) { return input_error(source, field, problem); };
  if (!j.is_object()) throw fail("", "must hold a JSON object (a validation.json)");
  if (!j.contains("schema") || j["schema"] != schemas::kValidation)
    throw fail("schema", fmt::format("must be \"{}\" (a validation.json of peftplan run or compare), got {}", schemas::kValidation,
                                     j.contains("schema") ? j["schema"].dump() : std::string("none")));
  auto number = [&](const json& o, const char* key, const std::string& where) {
    return json_fields::required_number(o, key, source, where + ".");
  };
  Validation v;
  if (j.contains("tolerances")) {
    v.tolerances.memory = number(j["tolerances"], "memory", "tolerances");
    v.tolerances.time = number(j["tolerances"], "time", "tolerances");
  }
  auto bytes_figures = [&](const char* section, std::vector<Figure>& into, double tol) {
    if (!j.contains(section)) return;
    if (!j[section].is_object()) throw fail(section, "must be an object of figures");
    for (const auto& [name, f] : j[section].items()) {
      const std::string where = std::string(section) + "." + name;
      Figure x = figure(section, name, number(f, "predicted_bytes", where), number(f, "measured_bytes", where), tol);
      if (std::string(section) == "memory" && j.contains("memory_rank") && j["memory_rank"].contains(name) && j["memory_rank"][name].is_number_integer())
        x.rank = j["memory_rank"][name].get<std::int32_t>();
      into.push_back(std::move(x));
    }
  };
  bytes_figures("memory", v.memory, v.tolerances.memory);
  bytes_figures("comm", v.comm, v.tolerances.memory);
  auto timed_figures = [&](const char* section, std::vector<Figure>& into) {
    if (!j.contains(section)) return;
    if (!j[section].is_object()) throw fail(section, "must be an object of figures");
    for (const auto& [name, f] : j[section].items()) {
      const std::string where = std::string(section) + "." + name;
      Figure x = figure(section, name, number(f, "predicted", where), number(f, "measured", where), v.tolerances.time);
      x.relative_error = number(f, "relative_error", where);
      x.within = json_fields::boolean(f, "within_tolerance", source, x.within, where + ".");
      if (json_fields::find(f, "verdict"))
        x.conclusive = json_fields::string(f, "verdict", source, "", where + ".") != name_of(Verdict::inconclusive);
      if (const auto spread = json_fields::nullable_number(f, "spread_s", source, where + ".", json_fields::Sign::non_negative)) {
        x.spread = *spread;
        x.has_spread = true;
      }
      if (f.contains("rounds") && f["rounds"].is_array())
        for (const auto& r : f["rounds"])
          if (r.is_number()) x.rounds.push_back(r.get<double>());
      x.share_of_step = json_fields::number(f, "error_share_of_step", source, x.share_of_step, where + ".");
      x.error_at_run_speed = json_fields::nullable_number(f, "relative_error_at_run_speed", source, where + ".");
      if (const std::string why = json_fields::string(f, "inconclusive_because", source, "", where + "."); !why.empty()) {
        const auto u = unsure_from_name(why);
        if (!u) throw fail(where + ".inconclusive_because", fmt::format("must be \"spread\", \"speed_decides\", \"drift_wide\" or \"load_changed\", got \"{}\"", why));
        if (x.conclusive) throw fail(where + ".inconclusive_because", fmt::format("is \"{}\" but the verdict is not inconclusive", why));
        x.unsure = *u;
      } else if (!x.conclusive) {
        x.unsure = Figure::Unsure::spread;  // a validation.json from before the reason was written
      }
      into.push_back(std::move(x));
    }
  };
  timed_figures("time", v.time);
  timed_figures("throughput", v.throughput);
  if (const nlohmann::json* sp = json_fields::find(j, "speed_probe")) {  // the machine's speed (validation_to_json)
    v.probe_flops_per_s = json_fields::nullable_number(*sp, "run_flops_per_s", source, "speed_probe.").value_or(0.0);
    v.calibration_probe_flops_per_s = json_fields::nullable_number(*sp, "calibration_flops_per_s", source, "speed_probe.").value_or(0.0);
    v.speed_drift = json_fields::nullable_number(*sp, "drift", source, "speed_probe.");
    v.probes = static_cast<std::int32_t>(json_fields::integer(*sp, "probes", source, 0, "speed_probe.", 0, 1 << 30));
    const std::string over = json_fields::string(*sp, "over", source, "rounds", "speed_probe.");
    if (over != "rounds" && over != "job") throw fail("speed_probe.over", fmt::format("must be \"rounds\" or \"job\", got \"{}\"", over));
    v.job_probe = over == "job";
  }
  if (const nlohmann::json* hl = json_fields::find(j, "host_load")) {  // the machine's other work (validation_to_json)
    const auto share = [&](const char* key) {
      return json_fields::nullable_number(*hl, key, source, "host_load.", json_fields::Sign::non_negative);
    };
    v.others_cpu_share = share("run_others_cpu_share");
    v.calibration_others_cpu_share = share("calibration_others_cpu_share");
    v.load_change = json_fields::nullable_number(*hl, "change", source, "host_load.");
  }
  // JSON objects come back sorted by name: restore the order validate() makes them in.
  auto rank_of = [](const std::vector<std::string>& order, const std::string& name) {
    const auto it = std::find(order.begin(), order.end(), name);
    return it == order.end() ? order.size() : static_cast<std::size_t>(it - order.begin());
  };
  std::vector<std::string> memory_order;
  for (int c = 0; c < sim::kNumCategories; ++c) memory_order.emplace_back(sim::name_of(static_cast<sim::MemCategory>(c)));
  memory_order.emplace_back("peak");
  const std::vector<std::string> time_order = {"step_s", "compute_s", "comm_s", "exposed_comm_s", "optimizer_s", "sync_wait_s"};
  auto order_by = [&](std::vector<Figure>& figs, const std::vector<std::string>& order) {
    std::stable_sort(figs.begin(), figs.end(), [&](const Figure& a, const Figure& b) { return rank_of(order, a.name) < rank_of(order, b.name); });
  };
  std::vector<std::string> comm_order;
  for (int c = 0; c < sim::kNumCollectives; ++c) comm_order.emplace_back(sim::name_of(static_cast<sim::Collective>(c)));
  order_by(v.memory, memory_order);
  order_by(v.comm, comm_order);
  order_by(v.time, time_order);
  if (j.contains("notes") && j["notes"].is_array())
    for (const auto& n : j["notes"])
      if (n.is_string()) v.notes.push_back(n.get<std::string>());
  v.rounds = static_cast<std::int32_t>(json_fields::integer(j, "rounds", source, v.rounds, "", 0, std::numeric_limits<std::int32_t>::max()));
  v.steps = json_fields::integer(j, "steps", source, v.steps, "", 0);
  v.sync_wait_s = json_fields::nullable_number(j, "sync_wait_s", source);
  for (const auto* section : {&v.memory, &v.time, &v.comm, &v.throughput})
    for (const Figure& f : *section) {
      if (!f.conclusive) v.inconclusive.push_back(f.key());
      else if (!f.within) v.outside.push_back(f.key());
    }
  v.within_tolerance = v.outside.empty();
  return v;
}

}  // namespace peftplan::planner
