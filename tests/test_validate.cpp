// validate(): predicted versus measured on a plan and a synthetic measurement built from the
// plan itself (so "exact" is exact), then with one figure or one op pushed off. The end-to-end
// cases (RunCli.*) run `peftplan run` on tiny-llama-2l with 2 ranks under mpirun, planned on a
// profile the test writes (so no calibration and no timing dependence).
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>

#include <gmock/gmock.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "peftplan/common/error.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/plan.h"
#include "peftplan/planner/validate.h"
#include "peftplan/sim/cluster.h"
#include "peftplan/sim/compute.h"

using namespace peftplan;
using namespace peftplan::planner;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

Plan tiny_plan(Stage stage, std::int32_t ranks) {
  PlanInput in;
  in.model = models::load_model("tiny-llama-2l");
  models::AdapterSpec a;
  a.lora.r = 4;
  a.lora.alpha = 8;
  a.lora.targets.kind = models::ModuleSelector::Kind::list;
  a.lora.targets.names = {"q_proj", "v_proj"};
  in.peft = models::PeftSpec{{a}, std::nullopt};
  in.training.micro_batch = 2;
  in.training.seq_len = 16;
  in.training.precision = Precision::fp32;
  in.training.attention = Attention::eager;
  in.profile = RuntimeProfile::executor;
  in.strategy.stage = stage;
  in.strategy.ranks = ranks;
  PlanOptions o;
  o.explain = false;
  return make_plan(in, sim::default_cluster(ranks), o);
}

// A measurement.json (keys of executor/measurement.cpp) that measured exactly what the plan
// predicts, over `steps` steps (the first one 10x slower: warm-up), with the last step's trace.
json exact_measurement(const Plan& p, int steps = 3) {
  const sim::Timeline& t = *p.time;
  json dev, host;
  for (int c = 0; c < sim::kNumCategories; ++c) {
    const auto cc = static_cast<sim::MemCategory>(c);
    (sim::on_host(cc) ? host : dev)[std::string(sim::name_of(cc)) + "_bytes"] = p.memory.category_peak_bytes[static_cast<std::size_t>(c)];
  }
  dev["peak_bytes"] = p.memory.device_peak_bytes;
  dev["peak_op"] = "";
  host["peak_bytes"] = p.memory.host_peak_bytes;
  std::vector<double> step_times(static_cast<std::size_t>(steps), t.step_s);
  step_times[0] = 10.0 * t.step_s;
  std::map<std::tuple<std::string, std::string, std::string>, double> kinds;
  json events = json::array();
  for (std::size_t i = 0; i < p.program.ops.size(); ++i) {
    const sim::Op& op = p.program.ops[i];
    if (op.kind != sim::OpKind::compute || op.phase == sim::Phase::setup) continue;
    const double d = t.ops[i].end_s - t.ops[i].start_s;
    kinds[{std::string(sim::name_of(op.phase)), std::string(sim::name_of(op.kernel)), std::string(op.label)}] += d * steps;
    events.push_back({{"name", std::string(op.label)}, {"ph", "X"}, {"ts", t.ops[i].start_s * 1e6}, {"dur", d * 1e6},
                      {"pid", 0}, {"tid", 0}, {"args", {{"op", i}, {"layer", op.layer}}}});
  }
  json ops = json::array();
  for (const auto& [k, s] : kinds)
    ops.push_back({{"phase", std::get<0>(k)}, {"kernel", std::get<1>(k)}, {"label", std::get<2>(k)}, {"calls", steps}, {"total_s", s}});
  json coll = json::object();
  for (int c = 0; c < sim::kNumCollectives; ++c) {
    const std::string kind(sim::name_of(static_cast<sim::Collective>(c)));
    const auto b = t.collective_bytes[static_cast<std::size_t>(c)];
    coll[kind] = {{"calls", 0}, {"bytes", b * static_cast<std::uint64_t>(steps)}, {"seconds", 0.0}, {"bytes_per_step", b}};
  }
  coll["all_reduce"]["seconds"] = t.comm_s * steps;
  return {{"schema", "peftplan.measurement/1"},
          {"ranks", p.input.strategy.ranks},
          {"rank", 0},
          {"step_times_s", step_times},
          {"collectives", coll},
          {"memory", {{"device", dev}, {"host", host}}},
          {"ops", ops},
          {"trace", {{"traceEvents", events}}}};
}

const Figure& find(const std::vector<Figure>& fs, const std::string& name) {
  for (const Figure& f : fs)
    if (f.name == name) return f;
  throw std::runtime_error("no figure " + name);
}

std::set<std::string> keys(const json& j) {
  std::set<std::string> k;
  for (const auto& [key, value] : j.items()) k.insert(key);
  return k;
}

}  // namespace

TEST(Validate, ExactMeasurementIsWithinTolerance) {
  const Plan p = tiny_plan(Stage::zero2, 2);
  ASSERT_TRUE(p.time);
  // The executor's collectives block, so its exposed communication is all of it; the synthetic
  // measurement can only match exposed_comm_s when the plan exposes all of it too.
  ASSERT_NEAR(p.time->exposed_comm_s, p.time->comm_s, 1e-9 * p.time->comm_s) << "plan hides communication; pick another config";
  const Validation v = validate(p, exact_measurement(p));
  EXPECT_TRUE(v.within_tolerance);
  EXPECT_TRUE(v.outside.empty());
  EXPECT_EQ(v.steps, 3);
  EXPECT_EQ(v.op_time_source, "trace (last step)");
  EXPECT_NEAR(find(v.time, "step_s").measured, p.time->step_s, 1e-15);  // the 10x first step left out
  EXPECT_EQ(find(v.memory, "peak").measured, static_cast<double>(p.memory.device_peak_bytes));
  EXPECT_FALSE(v.comm.empty());  // ZeRO-2 on 2 ranks moves gradients
  for (const auto* s : {&v.memory, &v.time, &v.comm})
    for (const Figure& f : *s) EXPECT_NEAR(f.relative_error, 0.0, 1e-9) << f.key();
}

TEST(Validate, MemoryCategoryOffByFivePercentIsNamed) {
  const Plan p = tiny_plan(Stage::zero2, 2);
  json m = exact_measurement(p);
  const auto act = m["memory"]["device"]["activations_bytes"].get<std::uint64_t>();
  ASSERT_GT(act, 0u);
  m["memory"]["device"]["activations_bytes"] = act + act / 20;  // +5%
  const Validation v = validate(p, m);
  EXPECT_FALSE(v.within_tolerance);
  ASSERT_EQ(v.outside.size(), 1u);
  EXPECT_EQ(v.outside[0], "memory.activations");
  EXPECT_NEAR(find(v.memory, "activations").relative_error, 0.05, 1e-3);
  // Per rank: rank 1 off, rank 0 exact -> the worst rank (1) is reported.
  json pr = exact_measurement(p);
  json r0 = pr, r1 = m;
  r0.erase("trace");
  r1.erase("trace");
  r1["rank"] = 1;
  pr["per_rank"] = json::array({r0, r1});
  const Validation w = validate(p, pr);
  ASSERT_EQ(w.outside.size(), 1u);
  EXPECT_EQ(w.outside[0], "memory.activations");
  EXPECT_EQ(find(w.memory, "activations").rank, 1);
  EXPECT_EQ(validation_to_json(w)["memory_rank"]["activations"], 1);
}

TEST(Validate, TimeFigureOffByThirtyPercentIsNamed) {
  const Plan p = tiny_plan(Stage::zero2, 2);
  json m = exact_measurement(p);
  for (auto& s : m["step_times_s"]) s = s.get<double>() * 1.3;
  const Validation v = validate(p, m);
  EXPECT_FALSE(v.within_tolerance);
  ASSERT_EQ(v.outside.size(), 1u);
  EXPECT_EQ(v.outside[0], "time.step_s");
  EXPECT_NEAR(find(v.time, "step_s").relative_error, 0.3, 1e-9);
  // Within a 31% tolerance.
  EXPECT_TRUE(validate(p, m, Tolerances{0.02, 0.31}).within_tolerance);
}

// A run's step is its steady step: the fastest after the first (warm-up) of the last 32 — noise
// on a shared machine only adds time (Chen & Revels, arXiv:1608.04295). A 10x warm-up and a
// stalled 5x step change nothing; a lone fast step is the step; a fast step older than the
// window is not.
TEST(Validate, StepTimeIsTheFastestRecentStepAfterTheFirst) {
  const Plan p = tiny_plan(Stage::zero2, 2);
  json m = exact_measurement(p);
  const double t = p.time->step_s;
  m["step_times_s"] = {10.0 * t, 1.2 * t, 5.0 * t, t, 1.1 * t, 1.3 * t};
  EXPECT_NEAR(find(validate(p, m).time, "step_s").measured, t, 1e-15);
  m["step_times_s"] = {0.5 * t, 2.0 * t, 1.5 * t};  // the warm-up is never the step
  EXPECT_NEAR(find(validate(p, m).time, "step_s").measured, 1.5 * t, 1e-15);
  std::vector<double> long_run(40, 1.2 * t);
  long_run[3] = 0.9 * t;  // step 4 of 40: outside the last 32
  long_run[30] = t;
  m["step_times_s"] = long_run;
  EXPECT_NEAR(find(validate(p, m).time, "step_s").measured, t, 1e-15);
  m["step_times_s"] = {2.0 * t};  // the only step
  EXPECT_NEAR(find(validate(p, m).time, "step_s").measured, 2.0 * t, 1e-15);
}

TEST(Validate, SteadySamplesAreTheFastestOfTheWindowAfterTheWarmup) {
  EXPECT_TRUE(steady_samples(std::vector<double>{}, 1).empty());
  EXPECT_EQ(steady_samples(std::vector<double>{3.0}, 1), std::vector<std::size_t>{0});  // nothing else to choose
  EXPECT_EQ(steady_samples(std::vector<double>{1.0, 3.0, 2.0}, 1), std::vector<std::size_t>{2});
  EXPECT_EQ(steady_samples(std::vector<double>{1.0, 3.0, 2.0}, 0), std::vector<std::size_t>{0});
  std::vector<double> v(kSteadyWindow + 5, 2.0);
  v[4] = 1.0;  // the window is the last kSteadyWindow: indices 5..
  v[kSteadyWindow + 1] = 1.5;
  EXPECT_EQ(steady_samples(v, 1), std::vector<std::size_t>{kSteadyWindow + 1});
}

// Rounds (a run's and calibration's) are combined by their median round: the middle of an odd
// count, the lower middle of an even one; equal values keep their order.
TEST(Validate, MedianIndexIsTheMiddleRound) {
  EXPECT_EQ(median_index(std::vector<double>{3.0, 1.0, 2.0}), 2u);
  EXPECT_EQ(median_index(std::vector<double>{4.0, 1.0, 3.0, 2.0}), 3u);  // 1 2 | 3 4: the 2
  EXPECT_EQ(median_index(std::vector<double>{5.0}), 0u);
  EXPECT_EQ(median_index(std::vector<double>{2.0, 9.0, 2.0, 1.0, 2.0}), 2u);  // 1 2(0) 2(2) 2(4) 9: the middle one
  EXPECT_THROW(median_index(std::vector<double>{}), std::invalid_argument);
}

// A part of the step is judged by its error's share of the step: communication 10x its
// prediction but 10% of the step longer is within a 15% tolerance; 20% of the step is not, and
// both communication figures are named.
TEST(Validate, PartsOfTheStepAreJudgedByTheirShareOfTheStep) {
  const Plan p = tiny_plan(Stage::zero2, 2);
  json m = exact_measurement(p);
  const double step = p.time->step_s, comm = p.time->comm_s;
  ASSERT_GT(comm, 0.0);
  const std::int64_t steps = static_cast<std::int64_t>(m["step_times_s"].size());
  m["collectives"]["all_reduce"]["seconds"] = (comm + 0.10 * step) * static_cast<double>(steps);
  Validation v = validate(p, m);
  EXPECT_TRUE(v.within_tolerance);
  EXPECT_NEAR(find(v.time, "comm_s").share_of_step, 0.10, 1e-9);
  EXPECT_GT(find(v.time, "comm_s").relative_error, 0.15);  // its own relative error is large
  EXPECT_NEAR(validation_to_json(v)["time"]["comm_s"]["error_share_of_step"].get<double>(), 0.10, 1e-9);
  m["collectives"]["all_reduce"]["seconds"] = (comm + 0.20 * step) * static_cast<double>(steps);
  v = validate(p, m);
  EXPECT_FALSE(v.within_tolerance);
  EXPECT_EQ(v.outside, (std::vector<std::string>{"time.comm_s", "time.exposed_comm_s"}));
  // step_s itself is judged by its relative error only
  EXPECT_TRUE(find(v.time, "step_s").within);
}

TEST(Validate, OpByOpNamesTheInjectedSlowOp) {
  const Plan p = tiny_plan(Stage::zero2, 2);
  json m = exact_measurement(p);
  // Slow down the layer-1 backward of one op by a millisecond in the trace and in the totals.
  std::int64_t slow = -1;
  for (auto& e : m["trace"]["traceEvents"]) {
    const auto& op = p.program.ops[e["args"]["op"].get<std::size_t>()];
    if (op.phase == sim::Phase::backward && op.layer == 1 && op.kernel == sim::Kernel::linear_bwd_data) {
      slow = e["args"]["op"].get<std::int64_t>();
      e["dur"] = e["dur"].get<double>() + 1000.0;
      break;
    }
  }
  ASSERT_GE(slow, 0);
  const sim::Op& op = p.program.ops[static_cast<std::size_t>(slow)];
  for (auto& o : m["ops"])
    if (o["phase"] == "backward" && o["kernel"] == "linear_bwd_data" && o["label"] == std::string(op.label))
      o["total_s"] = o["total_s"].get<double>() + 3 * 1e-3;
  const Validation v = validate(p, m, Tolerances{0.02, 1000.0});
  ASSERT_TRUE(v.most_different);
  EXPECT_EQ(v.most_different->op, slow);
  EXPECT_EQ(v.most_different->layer, 1);
  EXPECT_EQ(v.most_different->phase, "backward");
  EXPECT_EQ(v.most_different->label, std::string(op.label));
  EXPECT_NEAR(v.most_different->diff_s(), 1e-3, 1e-9);
  ASSERT_FALSE(v.kinds.empty());
  EXPECT_EQ(v.kinds.front().label, std::string(op.label));
  EXPECT_EQ(v.kinds.front().kernel, "linear_bwd_data");
  EXPECT_NEAR(v.kinds.front().diff_s(), 1e-3, 1e-9);
  // Without the trace the kinds alone name it.
  m.erase("trace");
  const Validation k = validate(p, m, Tolerances{0.02, 1000.0});
  EXPECT_EQ(k.op_time_source, "ops (mean over all steps)");
  EXPECT_TRUE(k.ops.empty());
  ASSERT_TRUE(k.most_different);
  EXPECT_EQ(k.most_different->label, std::string(op.label));
  EXPECT_EQ(k.most_different->op, -1);
}

// op_s (every program op's seconds per step, warm-up excluded) drives the op-by-op comparison,
// collectives included, and the measured compute_s / comm_s / optimizer_s are its sums by kind.
TEST(Validate, OpSecondsNameACollectiveAndSumByKind) {
  const Plan p = tiny_plan(Stage::zero2, 2);
  const sim::Timeline& t = *p.time;
  json m = exact_measurement(p);
  std::vector<double> op_s(p.program.ops.size(), 0.0);
  std::int64_t coll = -1;
  for (std::size_t i = 0; i < op_s.size(); ++i) {
    const sim::Op& op = p.program.ops[i];
    if (op.phase == sim::Phase::setup) continue;
    if (op.kind == sim::OpKind::compute || op.kind == sim::OpKind::collective || op.kind == sim::OpKind::copy)
      op_s[i] = t.ops[i].end_s - t.ops[i].start_s;
    if (op.kind == sim::OpKind::collective && op.collective == sim::Collective::reduce_scatter && coll < 0)
      coll = static_cast<std::int64_t>(i);
  }
  ASSERT_GE(coll, 0);
  op_s[static_cast<std::size_t>(coll)] += 2e-3;
  m["op_s"] = op_s;
  m["op_s_steps"] = 2;
  const Validation v = validate(p, m, Tolerances{0.02, 1000.0});
  EXPECT_EQ(v.op_time_source, "op_s (mean of 2 steady step(s))");
  ASSERT_TRUE(v.most_different);
  EXPECT_EQ(v.most_different->op, coll);
  EXPECT_EQ(v.most_different->kernel, "reduce_scatter");
  EXPECT_NEAR(v.most_different->diff_s(), 2e-3, 1e-12);
  EXPECT_EQ(v.kinds.front().kernel, "reduce_scatter");
  EXPECT_NEAR(find(v.time, "compute_s").measured, t.compute_s, 1e-12);
  EXPECT_NEAR(find(v.time, "optimizer_s").measured, t.optimizer_s, 1e-12);
  EXPECT_NEAR(find(v.time, "comm_s").measured, t.comm_s + 2e-3, 1e-12);
  // Several ranks: the collectives' transfer replaces their calls (the 2 ms were a wait for the
  // last rank, reported apart), and the compute thread's measured wait is the exposed time.
  std::vector<std::int64_t> colls;
  std::vector<double> transfer;
  for (std::size_t i = 0; i < op_s.size(); ++i)
    if (p.program.ops[i].kind == sim::OpKind::collective && p.program.ops[i].phase != sim::Phase::setup) {
      colls.push_back(static_cast<std::int64_t>(i));
      transfer.push_back(t.ops[i].end_s - t.ops[i].start_s);
    }
  m["collective_ops"] = colls;
  m["collective_transfer_s"] = transfer;
  m["sync_wait_s"] = 2e-3;
  m["exposed_comm_s"] = 1e-4;
  const Validation w = validate(p, m, Tolerances{0.02, 1000.0});
  EXPECT_NEAR(find(w.time, "comm_s").measured, t.comm_s, 1e-12);
  EXPECT_NEAR(find(w.time, "exposed_comm_s").measured, 1e-4, 1e-15);
  ASSERT_TRUE(w.sync_wait_s);
  EXPECT_DOUBLE_EQ(*w.sync_wait_s, 2e-3);
  EXPECT_DOUBLE_EQ(validation_to_json(w)["sync_wait_s"].get<double>(), 2e-3);
  ASSERT_TRUE(w.most_different);
  EXPECT_NE(w.most_different->op, coll);
  m["collective_ops"] = std::vector<std::int64_t>{0};  // the setup's first op is no collective
  m["collective_transfer_s"] = std::vector<double>{0.0};
  EXPECT_THROW(validate(p, m), InputError);
  m.erase("collective_ops");
  m.erase("collective_transfer_s");
  // An op_s of another program is an input error.
  m["op_s"] = std::vector<double>(3, 0.0);
  EXPECT_THROW(validate(p, m), InputError);
}

TEST(Validate, JsonKeysAreTheIssues) {
  const Plan p = tiny_plan(Stage::zero2, 2);
  const json j = validation_to_json(validate(p, exact_measurement(p)));
  EXPECT_TRUE(j.at("within_tolerance").get<bool>());
  const std::set<std::string> bytes_keys = {"predicted_bytes", "measured_bytes", "relative_error"};
  const std::set<std::string> time_keys = {"predicted", "measured", "relative_error"};
  for (int c = 0; c < sim::kNumCategories; ++c)
    EXPECT_EQ(keys(j.at("memory").at(std::string(sim::name_of(static_cast<sim::MemCategory>(c))))), bytes_keys);
  EXPECT_EQ(keys(j.at("memory").at("peak")), bytes_keys);
  // the issue's keys, plus each time figure's verdict (and why inconclusive), spread, rounds and error at the run's speed
  // and, for the parts, their error's share of the step
  std::set<std::string> step_keys = time_keys, part_keys = time_keys;
  step_keys.insert({"within_tolerance", "verdict", "inconclusive_because", "spread_s", "rounds", "relative_error_at_run_speed"});
  part_keys.insert({"within_tolerance", "error_share_of_step", "verdict", "inconclusive_because", "spread_s", "rounds", "relative_error_at_run_speed"});
  EXPECT_EQ(keys(j.at("time").at("step_s")), step_keys);
  for (const char* t : {"compute_s", "comm_s", "exposed_comm_s", "optimizer_s"}) EXPECT_EQ(keys(j.at("time").at(t)), part_keys) << t;
  ASSERT_FALSE(j.at("comm").empty());
  for (const auto& [kind, c] : j.at("comm").items()) EXPECT_EQ(keys(c), bytes_keys) << kind;
  EXPECT_EQ(j.at("memory").at("peak").at("predicted_bytes").get<std::uint64_t>(), p.memory.device_peak_bytes);
}

// Quartiles by linear interpolation between order statistics, numpy's default percentile
// (Hyndman & Fan type 7): for 1, 2, 3, 4 the quartiles are 1.75 and 3.25, the median 2.5.
TEST(Validate, SpreadIsTheInterquartileRangeNumpyComputes) {
  const Spread s = spread_of({4.0, 1.0, 3.0, 2.0});
  EXPECT_DOUBLE_EQ(s.median, 2.5);
  EXPECT_DOUBLE_EQ(s.q1, 1.75);
  EXPECT_DOUBLE_EQ(s.q3, 3.25);
  EXPECT_DOUBLE_EQ(s.iqr(), 1.5);
  EXPECT_DOUBLE_EQ(spread_of({7.0}).iqr(), 0.0);
  EXPECT_DOUBLE_EQ(spread_of({}).median, 0.0);
}

namespace {

// `rounds` measurements of the exact plan whose steps are the predicted step times `factors`.
std::vector<json> rounds_at(const Plan& p, const std::vector<double>& factors) {
  std::vector<json> out;
  for (const double f : factors) {
    json m = exact_measurement(p, 5);
    auto steps = m.at("step_times_s").get<std::vector<double>>();
    for (std::size_t i = 1; i < steps.size(); ++i) steps[i] = f * p.time->step_s;
    m["step_times_s"] = steps;
    out.push_back(std::move(m));
  }
  return out;
}

// The same rounds, each with the speed probe the executor takes before its steps.
std::vector<json> with_probe(std::vector<json> rounds, const std::vector<double>& probes) {
  for (std::size_t r = 0; r < rounds.size(); ++r) rounds[r]["speed_probe_flops_per_s"] = probes[r];
  return rounds;
}

}  // namespace

// A noisy machine: five rounds whose median step is 60% over the prediction but whose rounds
// spread over more than the tolerance. Neither a hit nor a miss: inconclusive, listed apart,
// and not outside tolerance. The same median with quiet rounds is a miss.
TEST(Validate, NoisyRoundsAreInconclusiveNotAMiss) {
  const Plan p = tiny_plan(Stage::zero2, 2);
  const Validation noisy = validate_rounds(p, rounds_at(p, {0.6, 0.8, 1.6, 2.4, 3.0}));
  const Figure& st = find(noisy.time, "step_s");
  EXPECT_EQ(noisy.rounds, 5);
  EXPECT_NEAR(st.measured, 1.6 * p.time->step_s, 1e-12);
  EXPECT_NEAR(st.spread, (2.4 - 0.8) * p.time->step_s, 1e-12);  // q3 - q1 of five values: the 2nd and 4th
  EXPECT_FALSE(st.within);
  EXPECT_FALSE(st.conclusive);
  EXPECT_EQ(st.verdict(), Verdict::inconclusive);
  EXPECT_TRUE(noisy.within_tolerance);
  EXPECT_TRUE(noisy.outside.empty());
  EXPECT_NE(std::find(noisy.inconclusive.begin(), noisy.inconclusive.end(), "time.step_s"), noisy.inconclusive.end());
  for (const Figure& f : noisy.memory) EXPECT_TRUE(f.conclusive) << f.name;  // memory is never inconclusive
  const json j = validation_to_json(noisy);
  EXPECT_EQ(j.at("time").at("step_s").at("verdict"), "inconclusive");
  EXPECT_EQ(j.at("time").at("step_s").at("rounds").size(), 5u);
  EXPECT_TRUE(j.at("within_tolerance").get<bool>());

  const Validation quiet = validate_rounds(p, rounds_at(p, {1.59, 1.6, 1.6, 1.6, 1.61}));
  EXPECT_EQ(find(quiet.time, "step_s").verdict(), Verdict::outside);
  EXPECT_FALSE(quiet.within_tolerance);
  EXPECT_EQ(quiet.outside, std::vector<std::string>{"time.step_s"});
}

// A machine that ran faster than when it was calibrated: the run's speed probe (executor
// speed_probe, measurement.json "speed_probe_flops_per_s") against the profile's. The drift is the
// median of the rounds' probes over the calibration's; a time figure is conclusive when its
// verdict is the same with the prediction at the run's speed (/ (1 + drift)) as at calibration's:
// quiet rounds 10% slow on a machine 4% slower than at calibration are a hit (+5.6% at its speed),
// 20% slow a miss either way (+15.2%); rounds 10% slow with a 5% spread on a machine 12% faster
// are inconclusive (within as predicted, +23.2% at its speed); 10% fast on that machine is a hit
// at both speeds (+0.8%), however large the drift; but a miss needs spread + |drift| within the
// tolerance: 21% slow on a probe 17% fast is outside at both speeds and still inconclusive.
TEST(Validate, MachineSpeedDriftCountsWithTheSpread) {
  Plan p = tiny_plan(Stage::zero2, 2);
  p.cluster.host_calibration.speed_probe_flops_per_s = 50e9;
  const Validation slow = validate_rounds(p, with_probe(rounds_at(p, {1.09, 1.1, 1.1, 1.1, 1.105}), {47e9, 48e9, 48e9, 49e9, 60e9}));
  ASSERT_TRUE(slow.speed_drift.has_value());
  EXPECT_NEAR(*slow.speed_drift, -0.04, 1e-12);  // median probe 48 over 50
  EXPECT_NEAR(slow.probe_flops_per_s, 48e9, 1e-3);
  EXPECT_EQ(find(slow.time, "step_s").verdict(), Verdict::within);
  EXPECT_EQ(find(validate_rounds(p, with_probe(rounds_at(p, {1.2, 1.2, 1.2, 1.2, 1.2}), {48e9, 48e9, 48e9, 48e9, 48e9})).time, "step_s")
                .verdict(),
            Verdict::outside);
  const Validation fast = validate_rounds(p, with_probe(rounds_at(p, {1.05, 1.075, 1.1, 1.13, 1.15}), {56e9, 56e9, 56e9, 56e9, 56e9}));
  EXPECT_NEAR(*fast.speed_drift, 0.12, 1e-12);
  EXPECT_EQ(find(fast.time, "step_s").verdict(), Verdict::inconclusive);
  EXPECT_EQ(find(fast.time, "step_s").unsure, Figure::Unsure::speed_decides);
  ASSERT_TRUE(find(fast.time, "step_s").error_at_run_speed.has_value());
  EXPECT_NEAR(*find(fast.time, "step_s").error_at_run_speed, 1.1 * 1.12 - 1.0, 1e-9);
  EXPECT_TRUE(fast.within_tolerance);
  const Validation explained = validate_rounds(p, with_probe(rounds_at(p, {0.9, 0.9, 0.9, 0.9, 0.9}), {56e9, 56e9, 56e9, 56e9, 56e9}));
  EXPECT_EQ(find(explained.time, "step_s").verdict(), Verdict::within);
  const json j = validation_to_json(fast);
  EXPECT_NEAR(j.at("time").at("step_s").at("relative_error_at_run_speed").get<double>(), 1.1 * 1.12 - 1.0, 1e-9);
  EXPECT_EQ(j.at("time").at("step_s").at("inconclusive_because"), "speed_decides");
  EXPECT_EQ(validation_from_json(j, "validation.json").time.front().unsure, Figure::Unsure::speed_decides);
  // Outside at both speeds on a probe far out: a miss a wrong probe could make (the one-rank case of
  // the accuracy matrix, README: 21% slow on a probe 17% fast, spread 8.6%).
  const Validation far = validate_rounds(p, with_probe(rounds_at(p, {1.2, 1.21, 1.213, 1.22, 1.23}), {58.5e9, 58.5e9, 58.5e9, 58.5e9, 58.5e9}));
  EXPECT_EQ(find(far.time, "step_s").verdict(), Verdict::inconclusive);
  EXPECT_EQ(find(far.time, "step_s").unsure, Figure::Unsure::drift_wide);
  EXPECT_TRUE(far.within_tolerance);
  // validation.json keeps the reason and the machine's speed; a reason on a conclusive figure is refused.
  json fj = validation_to_json(far);
  const Validation back = validation_from_json(fj, "validation.json");
  EXPECT_EQ(find(back.time, "step_s").unsure, Figure::Unsure::drift_wide);
  ASSERT_TRUE(back.speed_drift.has_value());
  EXPECT_NEAR(*back.speed_drift, *far.speed_drift, 1e-12);
  EXPECT_EQ(back.probes, 5);
  EXPECT_FALSE(back.job_probe);
  fj["time"]["comm_s"]["inconclusive_because"] = "spread";
  try {
    (void)validation_from_json(fj, "v.json");
    ADD_FAILURE() << "a reason on a conclusive figure was read";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("v.json: time.comm_s.inconclusive_because"), std::string::npos) << e.what();
  }
  EXPECT_NEAR(j.at("speed_probe").at("drift").get<double>(), 0.12, 1e-12);
  EXPECT_NEAR(j.at("speed_probe").at("calibration_flops_per_s").get<double>(), 50e9, 1e-3);
  // The same rounds without a probe on either side: no drift, and a 5% spread is conclusive.
  const Validation none = validate_rounds(tiny_plan(Stage::zero2, 2), rounds_at(p, {1.05, 1.075, 1.1, 1.13, 1.15}));
  EXPECT_FALSE(none.speed_drift.has_value());
  EXPECT_EQ(find(none.time, "step_s").verdict(), Verdict::within);
  EXPECT_TRUE(validation_to_json(none).at("speed_probe").at("drift").is_null());
}

// The machine's other work moved since calibration (executor/host_load.h): the case from the
// development VM (2026-12-05), a profile calibrated beside two nice-19 loops that took 16.7% of
// the CPUs, and runs on the quiet machine measuring ZeRO-3's collectives far faster than it
// predicted. A miss in the direction the change explains (faster on a quieter machine) with
// spread + |drift| + |change| beyond the tolerance is inconclusive; the same miss with the load
// unchanged, or slower on a quieter machine, stays a miss; and a change of 5 points leaves a
// 25% miss conclusive (1% spread + 5% is within the 15% tolerance).
TEST(Validate, OtherWorkSinceCalibrationExplainsAMissInItsDirection) {
  Plan p = tiny_plan(Stage::zero3, 2);
  p.cluster.host_calibration.others_cpu_share = 0.167;
  const auto with_share = [](std::vector<json> rounds, double share) {
    for (json& m : rounds) m["others_cpu_share"] = share;
    return rounds;
  };
  const std::vector<double> fast = {0.745, 0.75, 0.75, 0.755, 0.76};
  const Validation quieter = validate_rounds(p, with_share(rounds_at(p, fast), 0.0));
  ASSERT_TRUE(quieter.load_change.has_value());
  EXPECT_NEAR(*quieter.load_change, -0.167, 1e-12);
  EXPECT_NEAR(*quieter.others_cpu_share, 0.0, 1e-12);
  const Figure& st = find(quieter.time, "step_s");
  EXPECT_FALSE(st.within);
  EXPECT_EQ(st.verdict(), Verdict::inconclusive);
  EXPECT_EQ(st.unsure, Figure::Unsure::load_changed);
  EXPECT_TRUE(quieter.within_tolerance);
  for (const Figure& f : quieter.memory) EXPECT_TRUE(f.conclusive) << f.name;  // memory is never inconclusive

  EXPECT_EQ(find(validate_rounds(p, with_share(rounds_at(p, fast), 0.167)).time, "step_s").verdict(), Verdict::outside);
  EXPECT_EQ(find(validate_rounds(p, with_share(rounds_at(p, {1.245, 1.25, 1.25, 1.255, 1.26}), 0.0)).time, "step_s").verdict(),
            Verdict::outside);
  EXPECT_EQ(find(validate_rounds(p, with_share(rounds_at(p, fast), 0.117)).time, "step_s").verdict(), Verdict::outside);
  // Without a share on either side the rule is silent: a miss.
  EXPECT_EQ(find(validate_rounds(tiny_plan(Stage::zero3, 2), with_share(rounds_at(p, fast), 0.0)).time, "step_s").verdict(),
            Verdict::outside);

  // validation.json keeps both shares, the change and the reason.
  const json j = validation_to_json(quieter);
  EXPECT_EQ(j.at("time").at("step_s").at("inconclusive_because"), "load_changed");
  EXPECT_NEAR(j.at("host_load").at("calibration_others_cpu_share").get<double>(), 0.167, 1e-12);
  EXPECT_NEAR(j.at("host_load").at("change").get<double>(), -0.167, 1e-12);
  const Validation back = validation_from_json(j, "validation.json");
  EXPECT_EQ(find(back.time, "step_s").unsure, Figure::Unsure::load_changed);
  ASSERT_TRUE(back.load_change.has_value());
  EXPECT_NEAR(*back.load_change, -0.167, 1e-12);
  EXPECT_TRUE(validation_to_json(validate_rounds(tiny_plan(Stage::zero3, 2), rounds_at(p, fast))).at("host_load").at("change").is_null());
}

// A job of interleaved plans judges each plan against the median of every plan's every round's
// probe (job_probe_median), not its own five: the case from the development VM (README,
// "Predicted versus measured") where one strategy's own probes read +3.6% and the job's +14.4%.
// Its quiet rounds 20% faster than predicted are a miss on its own probes (-17.1% at that speed)
// and inconclusive on the job's (-8.5% at that speed); the verdict names the job's count.
TEST(Validate, JobProbeStandsForEveryPlansOwn) {
  Plan p = tiny_plan(Stage::zero3, 2);
  p.cluster.host_calibration.speed_probe_flops_per_s = 45e9;
  const std::vector<json> own = with_probe(rounds_at(p, {0.79, 0.795, 0.8, 0.805, 0.81}), {44e9, 46e9, 46.62e9, 47e9, 49e9});
  const std::vector<json> other = with_probe(rounds_at(p, {1.0, 1.0, 1.0, 1.0, 1.0}), {51e9, 52e9, 53e9, 51.5e9, 55e9});
  const std::vector<json> third = with_probe(rounds_at(p, {1.0, 1.0, 1.0, 1.0, 1.0}), {50e9, 51.48e9, 54e9, 52e9, 56e9});
  std::vector<const json*> all;
  for (const auto* rounds : {&own, &other, &third})
    for (const json& m : *rounds) all.push_back(&m);
  const json no_probe = json::object();
  all.push_back(&no_probe);  // a measurement without a probe is skipped
  const auto job = job_probe_median(all);
  ASSERT_TRUE(job.has_value());
  EXPECT_EQ(job->probes, 15);
  EXPECT_NEAR(job->flops_per_s, 51.48e9, 1e-3);  // the 8th of 15

  const Validation alone = validate_rounds(p, own);
  EXPECT_NEAR(*alone.speed_drift, 46.62 / 45.0 - 1.0, 1e-12);
  EXPECT_EQ(alone.probes, 5);
  EXPECT_EQ(find(alone.time, "step_s").verdict(), Verdict::outside);

  const Validation pooled = validate_rounds(p, own, {}, job);
  EXPECT_NEAR(*pooled.speed_drift, 51.48 / 45.0 - 1.0, 1e-12);
  EXPECT_TRUE(pooled.job_probe);
  EXPECT_EQ(pooled.probes, 15);
  EXPECT_EQ(find(pooled.time, "step_s").verdict(), Verdict::inconclusive);
  EXPECT_TRUE(pooled.within_tolerance);
  const json j = validation_to_json(pooled);
  EXPECT_EQ(j.at("speed_probe").at("over"), "job");
  EXPECT_EQ(j.at("speed_probe").at("probes"), 15);
  EXPECT_EQ(validation_to_json(alone).at("speed_probe").at("over"), "rounds");

  EXPECT_FALSE(job_probe_median(std::vector<const json*>{}).has_value());
}

// With one measurement the step's spread is the interquartile range of its steps after the
// first; the parts have none, and so stay conclusive.
TEST(Validate, OneMeasurementsSpreadIsItsSteps) {
  const Plan p = tiny_plan(Stage::ddp, 1);
  json m = exact_measurement(p, 6);
  const double t = p.time->step_s;
  m["step_times_s"] = {10 * t, 1.0 * t, 1.1 * t, 0.9 * t, 1.2 * t, 1.0 * t};
  const Validation v = validate(p, m);
  const Figure& st = find(v.time, "step_s");
  ASSERT_TRUE(st.has_spread);
  EXPECT_NEAR(st.spread, spread_of({1.0 * t, 1.1 * t, 0.9 * t, 1.2 * t, 1.0 * t}).iqr(), 1e-15);
  EXPECT_TRUE(st.conclusive);
  EXPECT_FALSE(find(v.time, "compute_s").has_spread);
}

// Rounds that measured different things are not rounds of one plan.
TEST(Validate, RoundsOfAnotherPlanAreAnInputError) {
  const Plan p = tiny_plan(Stage::zero2, 2);
  std::vector<json> r = rounds_at(p, {1.0, 1.0});
  r[1]["memory"]["device"].erase("activations_bytes");
  EXPECT_THROW(validate_rounds(p, r), InputError);
  EXPECT_THROW(validate_rounds(p, std::vector<json>{}), InputError);
}

// Tolerances per runtime profile (README, "Tolerances").
TEST(Validate, TolerancesPerProfile) {
  EXPECT_DOUBLE_EQ(tolerances_for(RuntimeProfile::executor).memory, 0.02);
  EXPECT_DOUBLE_EQ(tolerances_for(RuntimeProfile::executor).time, 0.15);
  EXPECT_DOUBLE_EQ(tolerances_for(RuntimeProfile::deepspeed).memory, 0.05);
  EXPECT_DOUBLE_EQ(tolerances_for(RuntimeProfile::hf).time, 0.15);
}

namespace {

// A totals measurement (tools/peftplan_callback.py's schema) of the plan's job on `ranks` ranks.
json totals_for(const Plan& p, double step_s, std::optional<std::uint64_t> allocated) {
  const auto& m = p.input.model;
  const auto& t = p.input.training;
  const std::int64_t tokens = t.micro_batch * t.seq_len * t.grad_accum;
  json rank = {{"rank", 0}, {"step_times_s", {2 * step_s, step_s, step_s}}, {"step_s", step_s}, {"step_s_iqr", 0.0},
               {"tokens_per_s_per_gpu", static_cast<double>(tokens) / step_s},
               {"max_memory_allocated_bytes", allocated ? json(*allocated) : json(nullptr)},
               {"max_memory_reserved_bytes", nullptr}, {"device_memory_used_bytes", nullptr}};
  json worst = rank;
  worst.erase("step_times_s");
  worst.erase("rank");
  return {{"schema", "peftplan.measurement-totals/1"},
          {"world_size", p.input.strategy.ranks},
          {"steps", 3},
          {"warmup_steps", 1},
          {"tokens_per_step", tokens * p.input.strategy.ranks},
          {"model", {{"config_sha256", "0"}, {"architecture", {{"hidden_size", m.hidden}, {"num_hidden_layers", m.layers},
                                                                {"num_attention_heads", m.heads}, {"num_key_value_heads", m.kv_heads},
                                                                {"intermediate_size", m.intermediate}, {"vocab_size", m.vocab}}}}},
          {"per_rank", json::array({rank})},
          {"max", worst}};
}

}  // namespace

// The user's own job, totals only: the allocated peak, the slowest rank's step with its spread,
// tokens/s per GPU; what the capture lacks is a note, not a failure.
TEST(Validate, TotalsOfATrainingJob) {
  const Plan p = tiny_plan(Stage::ddp, 1);
  const Validation v = validate_totals(p, totals_for(p, p.time->step_s, p.memory.device_peak_bytes), "m.json", std::string("0"));
  EXPECT_TRUE(v.within_tolerance);
  ASSERT_EQ(v.memory.size(), 1u);
  EXPECT_EQ(v.memory[0].name, "peak");
  EXPECT_DOUBLE_EQ(v.memory[0].relative_error, 0.0);
  ASSERT_EQ(v.throughput.size(), 1u);
  EXPECT_NEAR(v.throughput[0].relative_error, 0.0, 1e-12);
  const Validation slow = validate_totals(p, totals_for(p, 2.0 * p.time->step_s, std::nullopt), "m.json", std::nullopt);
  EXPECT_FALSE(slow.within_tolerance);
  EXPECT_TRUE(slow.memory.empty());  // no CUDA: not compared, and said so
  bool noted = false;
  for (const auto& n : slow.notes) noted = noted || n.find("max_memory_allocated_bytes is null") != std::string::npos;
  EXPECT_TRUE(noted);
  EXPECT_NE(std::find(slow.outside.begin(), slow.outside.end(), "time.step_s"), slow.outside.end());
}

// Bad totals name the file and the field.
TEST(Validate, BadTotalsNameTheFileAndField) {
  const Plan p = tiny_plan(Stage::ddp, 1);
  const json good = totals_for(p, p.time->step_s, 1);
  auto message = [&](json m) {
    try {
      validate_totals(p, m, "job.json", std::nullopt);
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  json m = good;
  m["schema"] = "peftplan.measurement/7";
  EXPECT_THAT(message(m), ::testing::HasSubstr("job.json: schema"));
  m = good;
  m["max"].erase("step_s");
  EXPECT_THAT(message(m), ::testing::HasSubstr("job.json: max.step_s is missing"));
  m = good;
  m["model"]["architecture"]["num_hidden_layers"] = 32;
  EXPECT_THAT(message(m), ::testing::HasSubstr("job.json: model.architecture.num_hidden_layers must be the plan's model's"));
  m = good;
  m["world_size"] = 8;
  EXPECT_THAT(message(m), ::testing::HasSubstr("job.json: world_size"));
  m = good;
  m["max"]["step_s"] = "fast";
  EXPECT_THAT(message(m), ::testing::HasSubstr("job.json: max.step_s must be a non-negative number"));
  m = good;
  m.erase("per_rank");
  EXPECT_THAT(message(m), ::testing::HasSubstr("job.json: per_rank is missing"));
}

TEST(Validate, MissingKeyIsAnInputError) {
  const Plan p = tiny_plan(Stage::ddp, 1);
  json m = exact_measurement(p);
  m["memory"]["device"].erase("activations_bytes");
  try {
    validate(p, m);
    ADD_FAILURE() << "a measurement without memory.device.activations_bytes was accepted";
  } catch (const InputError& e) {  // the field with its whole path
    EXPECT_STREQ(e.what(), "measurement.json: memory.device.activations_bytes is missing");
  }
}

#ifdef PEFTPLAN_HAVE_MPI  // RunCli.* run 2 ranks under mpirun
namespace {

struct CliRun {
  int code = 0;
  std::string out;
};

CliRun run_cli(const std::string& args) {
  const std::string cmd = "OMP_NUM_THREADS=1 " + std::string(PEFTPLAN_CLI) + " run " + args + " 2>&1";
  CliRun r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return {-1, "popen failed"};
  std::array<char, 4096> buf{};
  while (std::fgets(buf.data(), static_cast<int>(buf.size()), p)) r.out += buf.data();
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

fs::path temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("peftplan_test_validate_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

// A hand-made 2-GPU profile (no timing involved) and the common arguments.
std::string common_args(const fs::path& dir) {
  sim::write_cluster_file(sim::default_cluster(2), dir / "profile.json");
  return "--model tiny-llama-2l --lora-r 4 --gpus 2 --strategy zero2 --steps 2 --rounds 1 --seq-len 16 --micro-batch 2 --data " +
         std::string(PEFTPLAN_TEST_DATA) + "/executor/corpus.txt --calibration " + (dir / "profile.json").string();
}

}  // namespace

TEST(RunCli, WritesValidationTraceAndReport) {
  const fs::path dir = temp_dir("ok");
  const CliRun r = run_cli(common_args(dir) + " --tolerance-time 1000 --out " + (dir / "out").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("calibrated profile " + (dir / "profile.json").string()), std::string::npos) << r.out;
  const json v = models::read_json_file((dir / "out" / "validation.json").string());
  EXPECT_TRUE(v.at("within_tolerance").get<bool>());
  for (const char* k : {"peak", "activations", "trainable_weights", "optimizer_states"}) {
    EXPECT_EQ(keys(v.at("memory").at(k)), (std::set<std::string>{"predicted_bytes", "measured_bytes", "relative_error"})) << k;
    EXPECT_EQ(v["memory"][k]["predicted_bytes"], v["memory"][k]["measured_bytes"]) << k;  // exact
  }
  for (const char* t : {"step_s", "compute_s", "comm_s", "exposed_comm_s", "optimizer_s"})
    for (const char* k : {"predicted", "measured", "relative_error", "within_tolerance"}) EXPECT_TRUE(v.at("time").at(t).contains(k)) << t << k;
  EXPECT_TRUE(v.at("comm").contains("reduce_scatter") || v.at("comm").contains("all_reduce")) << v.dump(1);
  for (const auto& [kind, c] : v.at("comm").items()) EXPECT_EQ(c["predicted_bytes"], c["measured_bytes"]) << kind;
  EXPECT_TRUE(v.at("most_different_op").contains("layer")) << v.dump(1);
  // Two ranks: each collective's transfer is at most its call on rank 0; the rest is the wait.
  const json meas = models::read_json_file((dir / "out" / "measurement.json").string());
  const auto colls = meas.at("collective_ops").get<std::vector<std::int64_t>>();
  const auto transfer = meas.at("collective_transfer_s").get<std::vector<double>>();
  ASSERT_EQ(colls.size(), transfer.size());
  ASSERT_FALSE(colls.empty());
  for (std::size_t c = 0; c < colls.size(); ++c) {
    EXPECT_GE(transfer[c], 0.0);
    EXPECT_LE(transfer[c], meas["op_s"][static_cast<std::size_t>(colls[c])].get<double>() * (1.0 + 1e-9) + 1e-12) << c;
  }
  EXPECT_GE(v.at("sync_wait_s").get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(v["time"]["exposed_comm_s"]["measured"].get<double>(), meas.at("exposed_comm_s").get<double>());
  const json tp = models::read_json_file((dir / "out" / "trace.predicted.json").string());
  EXPECT_FALSE(tp.at("traceEvents").empty());
  EXPECT_TRUE(fs::exists(dir / "out" / "trace.json"));
  // The run's report (reports/report.h) in place of a plain report.md: the figures, the op that
  // differs most, and the step timeline, predicted above measured, beside it.
  EXPECT_FALSE(fs::exists(dir / "out" / "report.md"));
  std::ifstream rep(dir / "out" / "report" / "report.md");
  std::stringstream s;
  s << rep.rdbuf();
  EXPECT_NE(s.str().find("step_s"), std::string::npos);
  EXPECT_NE(s.str().find("Differs most"), std::string::npos);
  EXPECT_NE(s.str().find("](timeline-"), std::string::npos) << s.str();
  for (const auto& e : fs::directory_iterator(dir / "out")) EXPECT_NE(e.path().extension(), ".tmp") << e.path();
  fs::remove_all(dir);
}

// Several strategies: one run each in its own folder, then the comparison table and
// summary.json/summary.md; without --data the bundled text is written to <out>/corpus.txt and
// trained on.
TEST(RunCli, SeveralStrategiesEndWithTheirComparison) {
  const fs::path dir = temp_dir("several");
  sim::write_cluster_file(sim::default_cluster(2), dir / "profile.json");
  const CliRun r = run_cli("--model tiny-llama-2l --lora-r 4 --gpus 2 --strategy ddp,zero3 --steps 2 --rounds 2 --seq-len 16 --micro-batch 2 "
                           "--tolerance-time 1000 --calibration " + (dir / "profile.json").string() + " --out " + (dir / "out").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("data: the bundled text"), std::string::npos) << r.out;
  std::ifstream corpus(dir / "out" / "corpus.txt");
  std::stringstream text;
  text << corpus.rdbuf();
  EXPECT_GT(text.str().size(), 4000u);
  EXPECT_NE(text.str().find("all-gather"), std::string::npos);
  for (const char* s : {"ddp", "zero3"}) {
    const json v = models::read_json_file((dir / "out" / s / "validation.json").string());
    EXPECT_EQ(v["memory"]["peak"]["predicted_bytes"], v["memory"]["peak"]["measured_bytes"]) << s;
    EXPECT_FALSE(fs::exists(dir / "out" / s / "report.md")) << s;  // one report of both, in out/report/
    EXPECT_TRUE(fs::exists(dir / "out" / "report" / ("timeline-" + std::string(s) + ".svg"))) << s;
  }
  // One report of both strategies (reports/report.h): each measured figure is validation.json's.
  std::ifstream html_file(dir / "out" / "report" / "report.html");
  std::stringstream html;
  html << html_file.rdbuf();
  for (const char* s : {"ddp", "zero3"}) {
    const json v = models::read_json_file((dir / "out" / s / "validation.json").string());
    EXPECT_NE(html.str().find(fmt::format("<table class=\"measured-table\" data-strategy=\"{}\">", s)), std::string::npos) << s;
    for (const char* k : {"peak", "activations"})
      EXPECT_NE(html.str().find(fmt::format("data-field=\"validation.memory.{}.measured\" data-value=\"{}\"", k,
                                            v["memory"][k]["measured_bytes"].get<std::uint64_t>())),
                std::string::npos)
          << s << " " << k;
  }
  EXPECT_TRUE(fs::exists(dir / "out" / "report" / "memory.svg"));
  const json sj = models::read_json_file((dir / "out" / "summary.json").string());
  ASSERT_EQ(sj.at("runs").size(), 2u);
  EXPECT_EQ(sj["runs"][0]["strategy"], "ddp");
  EXPECT_EQ(sj["runs"][1]["strategy"], "zero3");
  EXPECT_TRUE(sj["runs"][1].at("comm").contains("all_gather")) << sj.dump(1);  // ZeRO-3 gathers, DDP does not
  EXPECT_FALSE(sj["runs"][0].at("comm").contains("all_gather")) << sj.dump(1);
  const std::size_t table = r.out.find("== predicted versus measured, 2 strategies");
  ASSERT_NE(table, std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\nzero3 ", table), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(dir / "out" / "summary.md"));
  fs::remove_all(dir);
}

// What belongs to one training run is refused for several, and a malformed list is bad input.
TEST(RunCli, SeveralStrategiesRefuseSingleRunOptions) {
  const fs::path dir = temp_dir("refuse");
  CliRun r = run_cli("--strategy ddp,zero2 --save-adapter " + (dir / "a").string() + " --out " + (dir / "out").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--save-adapter"), std::string::npos) << r.out;
  r = run_cli("--strategy ddp,,zero2 --out " + (dir / "out").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--strategy"), std::string::npos) << r.out;
  r = run_cli("--strategy ddp,zero4 --cluster 2xA100-80GB --out " + (dir / "out").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("zero4"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(dir / "out" / "ddp")) << "nothing runs before every strategy is checked";
  fs::remove_all(dir);
}

// A ds_config.json without --strategy: run runs the one strategy the file sets (its default list
// of three does not apply); with a --strategy that contradicts the file it refuses, naming both.
TEST(RunCli, ADsConfigWithoutStrategyRunsTheFilesStrategy) {
  const fs::path dir = temp_dir("dsconfig");
  sim::write_cluster_file(sim::default_cluster(2), dir / "profile.json");
  {
    std::ofstream f(dir / "ds.json");
    f << R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3}})";
  }
  const std::string args = "--model tiny-llama-2l --lora-r 4 --gpus 2 --steps 2 --rounds 1 --seq-len 16 --micro-batch 2 --data " +
                           std::string(PEFTPLAN_TEST_DATA) + "/executor/corpus.txt --calibration " + (dir / "profile.json").string() +
                           " --tolerance-time 1000 --ds-config " + (dir / "ds.json").string();
  CliRun r = run_cli(args + " --out " + (dir / "out").string());
  ASSERT_EQ(r.code, 0) << r.out;
  const json plan = models::read_json_file((dir / "out" / "plan.json").string());
  EXPECT_EQ(plan.at("ds_config").at("zero_optimization").at("stage"), 3) << plan.dump(1);
  EXPECT_FALSE(fs::exists(dir / "out" / "ddp"));
  r = run_cli(args + " --strategy zero2 --out " + (dir / "out2").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("with --strategy zero2: the ds_config sets the strategy (zero_optimization.stage zero3); drop --strategy"),
            std::string::npos) << r.out;
  fs::remove_all(dir);
}

// An A100 profile predicts the CPU's step several times too fast: outside any honest tolerance,
// and with one round of two steps there is no spread to make it inconclusive.
TEST(RunCli, TimeOutsideToleranceExitsOneNamingIt) {
  const fs::path dir = temp_dir("tight");
  const CliRun r = run_cli(common_args(dir) + " --tolerance-time 0.5 --out " + (dir / "out").string());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("outside tolerance: time.step_s"), std::string::npos) << r.out;
  const json v = models::read_json_file((dir / "out" / "validation.json").string());
  EXPECT_FALSE(v.at("within_tolerance").get<bool>());
  fs::remove_all(dir);
}

// A step whose gradient norm is not finite (a learning rate of 1e38 makes the weights overflow
// after the first update): stop names the step and the first non-finite gradient, exit code 1;
// skip leaves those updates out, counts them in measurement.json, and every rank ends.
TEST(RunCli, NonFiniteGradientsStopOrSkip) {
  const fs::path dir = temp_dir("nonfinite");
  std::string args = common_args(dir);
  args.replace(args.find("--steps 2"), 9, "--steps 4");
  args += " --lr 1e38";
  // DDP: the whole gradient is on each rank, and the first bad element is named by its adapter tensor.
  std::string ddp = args;
  ddp.replace(ddp.find("--strategy zero2"), 16, "--strategy ddp");
  CliRun r = run_cli(ddp + " --out " + (dir / "stop").string());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("step 2: the gradient norm is"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("the first non-finite gradient is grad."), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("lora_A.weight (element 0 of grad.flat)"), std::string::npos) << r.out;
  // ZeRO-2: this rank's shard is named.
  r = run_cli(args + " --out " + (dir / "stop2").string());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("the first non-finite gradient is element 0 of grad.shard"), std::string::npos) << r.out;
  r = run_cli(args + " --on-nonfinite skip --tolerance-time 1000 --out " + (dir / "skip").string());
  EXPECT_EQ(r.code, 0) << r.out;
  const json m = models::read_json_file((dir / "skip" / "measurement.json").string());
  EXPECT_EQ(m.at("skipped_steps").get<std::int64_t>(), 3);  // steps 2-4: the first update overflowed the weights
  EXPECT_EQ(m.at("losses").size(), 4u);
  r = run_cli(args + " --on-nonfinite maybe --out " + (dir / "bad").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--on-nonfinite"), std::string::npos) << r.out;
  fs::remove_all(dir);
}
#endif
