// Predicted versus measured: compare a plan with what the executor measured running it
// (measurement.json, "schema": "peftplan.measurement/1", taken as JSON so the planner does not
// depend on the executor), figure by figure, against tolerances — every memory category and the
// device peak (each rank when the measurement has per_rank: the worst rank is reported), the
// step time and its split, and the bytes of each collective kind — plus an op-by-op comparison
// of the predicted timeline with the measured op times that names the op that differs most.
// Pure functions; reading and writing the files is the caller's business. It does not judge
// losses or adapters (the distributed tests do).
//
// Measured time figures (the executor runs one rank's ops in program order on one thread):
//   step_s          median of step_times_s after the first step (the first includes warm-up;
//                   the median is robust to a step the OS stalled); the only step when there
//                   is one
//   compute_s       compute ops on the compute stream, per step
//   optimizer_s     optimizer-phase compute ops (device or host), per step
//   comm_s          collectives' measured seconds / steps; with several ranks, each collective's
//                   transfer: the shortest rank's execution (the last to arrive waits for nobody)
//   exposed_comm_s  the time the compute thread waited for collectives ("exposed_comm_s" of the
//                   measurement), else = comm_s
// When the measurement carries "op_s" (every program op's mean seconds per step over the steps
// after the first: compute ops, copies, and collectives' execution on the communication thread),
// compute_s, optimizer_s and comm_s are sums of op_s over the ops of each kind, and the
// op-by-op comparison covers every compute, copy and collective op (a collective's "kernel" is
// its kind, a copy's "copy"); the op that differs most is the one with the largest absolute
// difference. Otherwise (older measurements):
// compute_s and optimizer_s come from the last step's per-op times when the measurement carries
// "trace" (trace.json's Chrome trace, whose events name the program op in args.op; `peftplan
// run` attaches it), else from the per-(phase, kernel, label) totals in "ops" averaged over all
// steps (warm-up included). relative_error = (measured - predicted) / predicted, signed; when
// the prediction is 0 it is 0 if the measurement is 0 too and 1 otherwise. A figure is within
// tolerance when |relative_error| <= its tolerance (memory and collective bytes: memory; time:
// time); the parts of the step (compute_s, comm_s, exposed_comm_s, optimizer_s) also when their
// absolute error is within the time tolerance times the predicted step_s (share_of_step): what
// matters of a part is what its error does to the step.
//
// Rounds and spread. A measurement is noisy on a shared machine, so a run is measured in rounds
// (`peftplan run --rounds`, strategies interleaved) and validate() takes them all: each time
// figure's measured value is the median over the rounds and its spread the interquartile range
// of the rounds (with one measurement: step_s's spread is the IQR of its steps after the first;
// the parts have none). A time figure whose spread is wider than its tolerance — judged the way
// its error is, relative to the figure for step_s, as a share of the predicted step for the
// parts — is "inconclusive": neither a hit nor a miss, listed apart and never a failure by
// itself. Memory and collective bytes are never inconclusive: each is the worst round's.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "peftplan/planner/plan.h"

namespace peftplan::planner {

struct Tolerances {
  double memory = 0.02;  // relative, memory categories, peak and collective bytes
  double time = 0.15;    // relative, time figures
};

// The tolerances a runtime profile's predictions are held to (README, "Tolerances"):
//   executor            memory 2%, time 15%: memory is exact by construction (the margin covers
//                       nothing today; it is there for host-side bookkeeping), time is a shared
//                       CPU's;
//   deepspeed, pytorch  memory 5%, time 15%: the accuracy the fidelity work targets for
//                       transformers + PEFT stacks against published measurements (allocated
//                       within 5%, tokens/s within 15%).
Tolerances tolerances_for(RuntimeProfile profile);

// How noisy a calibration may be (executor::calibration_noise) before peftplan-exec calibrate
// measures it again, and how many points more of the host's CPUs other work may have taken while
// a cached profile was calibrated than it takes now before `peftplan run` recalibrates: a third
// of the executor profile's time tolerance (5%), so that a calibration's own noise leaves most of
// the tolerance to the model.
double calibration_noise_limit();

enum class Verdict : std::uint8_t { within, outside, inconclusive };
std::string_view name_of(Verdict v);

// One compared figure: memory.<category>, memory.peak (bytes), time.<figure> (seconds),
// comm.<collective> (bytes per step).
struct Figure {
  std::string section;        // "memory", "time" or "comm"
  std::string name;           // "activations", "peak", "step_s", "all_reduce", ...
  double predicted = 0.0;     // bytes or seconds
  double measured = 0.0;      // bytes or seconds (memory: the worst rank's)
  double relative_error = 0.0;  // signed, see above
  double tolerance = 0.0;
  bool within = true;
  std::int32_t rank = 0;      // memory: the rank measured (the worst one of per_rank)
  double share_of_step = 0.0; // time figures but step_s: (measured - predicted) / predicted step_s
  // Time figures: the spread of the measurement (seconds, interquartile range; see above),
  // whether there is one, the rounds' values, and whether the spread is narrow enough to judge.
  double spread = 0.0;
  bool has_spread = false;
  std::vector<double> rounds;
  // Time figures with a speed drift: the relative error of the prediction at the run's speed
  // (predicted seconds / (1 + drift); tokens/s times it), beside the raw one (finish in
  // validate.cpp: a verdict the two readings disagree on is inconclusive).
  std::optional<double> error_at_run_speed;
  bool conclusive = true;
  // Why a time figure is inconclusive (finish in validate.cpp): its spread is wider than the
  // tolerance; the verdicts at calibration's and at the run's speed differ; it is outside at
  // both but its spread plus |drift| is wider than the tolerance (a miss the machine could
  // explain); or the machine's other work moved since calibration by enough, and in the
  // direction, to explain the miss (Validation::load_change).
  enum class Unsure : std::uint8_t { no, spread, speed_decides, drift_wide, load_changed };
  Unsure unsure = Unsure::no;
  Verdict verdict() const { return !conclusive ? Verdict::inconclusive : within ? Verdict::within : Verdict::outside; }
  std::string key() const { return section + "." + name; }
};

// "spread", "speed_decides", "drift_wide", "load_changed" (validation.json's inconclusive_because),
// "no".
std::string_view name_of(Figure::Unsure u);
std::optional<Figure::Unsure> unsure_from_name(std::string_view s);

// Predicted and measured seconds per step of one program op (index >= 0) or of all the ops
// that share (phase, kernel, label) (index -1, layer -1).
struct OpDiff {
  std::int32_t op = -1;        // program op index; -1 for a kind
  std::string phase, kernel, label;
  std::int32_t layer = -1;     // transformer layer, -1 for embedding/head/optimizer or a kind
  std::int32_t micro_batch = -1;
  std::int32_t ops = 1;        // program ops in the kind (1 for one op)
  double predicted_s = 0.0;    // per step
  double measured_s = 0.0;     // per step
  double diff_s() const { return measured_s - predicted_s; }
};

// "op 226 q_proj (forward, gemm, layer 3, micro-batch 0): predicted 0.412 ms, measured 0.398 ms
// (-0.014 ms)", or for a kind "q_proj (forward, gemm, 8 ops): ...".
std::string describe(const OpDiff& d);

struct Validation {
  Tolerances tolerances;
  std::vector<Figure> memory;  // device categories, host categories, then "peak"
  std::vector<Figure> time;    // step_s, compute_s, comm_s, exposed_comm_s, optimizer_s, and
                               //   sync_wait_s when the measurement has several ranks
  std::vector<Figure> comm;    // per collective kind the plan or the measurement has
  std::vector<Figure> throughput;  // totals: tokens_per_s_per_gpu (tokens/s of the slowest rank)
  std::optional<double> sync_wait_s;  // several ranks: seconds per step ranks waited inside
                                     //   collectives for the last rank to arrive (not modelled)
  std::vector<OpDiff> ops;     // per op, largest |diff| first (top 10); empty without a trace
  std::vector<OpDiff> kinds;   // per (phase, kernel, label), largest |diff| first (top 10)
  std::optional<OpDiff> most_different;  // ops.front(), else kinds.front()
  std::int64_t steps = 0;      // measured steps (per round)
  std::int32_t rounds = 1;     // measurements combined
  std::int32_t op_round = 0;   // the round whose op times ops/kinds show (the median step's)
  std::string op_time_source;  // "op_s (...)", "trace (last step)" or "ops (mean over all steps)"
  bool within_tolerance = true;      // no conclusive figure is outside
  std::vector<std::string> outside;  // keys of the conclusive figures outside, e.g. "time.step_s"
  std::vector<std::string> inconclusive;  // keys of the time figures too noisy to judge
  std::vector<std::string> notes;    // what a measurement lacks or the plan does not predict
  // The machine's speed during the run relative to calibration: the measurement's
  // speed_probe_flops_per_s over the plan's cluster host_calibration.speed_probe_flops_per_s,
  // minus 1 (the median over rounds); absent when either side lacks the probe. A prediction for a
  // machine that ran 10% slower cannot be judged to better than 10%: a time figure is conclusive
  // when its spread is within the tolerance, its verdict is the same at the run's speed
  // (predictions / (1 + speed_drift)) as at calibration's, and, for a miss, spread + |drift| is
  // within the tolerance too (finish in validate.cpp).
  std::optional<double> speed_drift;
  double probe_flops_per_s = 0.0;        // the run's probe (median over rounds), 0 = none
  std::int32_t probes = 0;               // how many probes probe_flops_per_s is the median of
  bool job_probe = false;                // the median is over a job's interleaved plans (below)
  double calibration_probe_flops_per_s = 0.0;  // the plan's cluster's
  // Other work's share of the host's CPUs (executor/host_load.h) during the run (the
  // measurement's others_cpu_share, the median over rounds) and during calibration (the plan's
  // cluster host_calibration.others_cpu_share); load_change is the run's minus calibration's,
  // absent when either is. Other work moves collective waits far more than the speed probe
  // (host_load.h): a miss in the direction the change explains (the run slower when the machine
  // is busier, faster when quieter) with spread + |drift| + |load_change| beyond the tolerance is
  // inconclusive (Figure::Unsure::load_changed).
  std::optional<double> others_cpu_share;
  std::optional<double> calibration_others_cpu_share;
  std::optional<double> load_change;
};

// The median and quartiles of a sample, linear interpolation between order statistics (numpy's
// default percentile, Hyndman & Fan type 7); all 0 for an empty sample.
struct Spread {
  double median = 0.0;
  double q1 = 0.0, q3 = 0.0;
  double iqr() const { return q3 - q1; }  // interquartile range
};
Spread spread_of(std::vector<double> values);

// The index of the median of several rounds' figures (the lower of the middle two for an even
// count), one rule for the round a run reports and the round calibration keeps: within a round
// the fastest step is the program's own speed (steady_samples), and across rounds the median is
// kept, as benchmark harnesses do (Google Benchmark's aggregates, pyperf), so that a slow spell
// covering some rounds moves neither calibration nor a run, and the two are the same statistic.
// Throws on an empty sample.
std::size_t median_index(std::span<const double> values);

// The steady samples of repeated timings, one rule for every timing the executor, calibration
// and validation take: the fastest of the last kSteadyWindow samples after the first `warmup`
// (of all samples when there are no others). Noise on a shared machine only ever adds time —
// another tenant, an interrupt, a slow spell of the host — so the fastest sample is the
// program's own speed and the rest carry someone else's: Chen & Revels, "Robust benchmarking in
// noisy environments" (arXiv:1608.04295, 2016), show the minimum to be the most stable location
// estimate for exactly this kind of noise, and Python's timeit documentation says the same of
// its repeats. Seven runs of the default job's DDP on the 2-core development VM (5 rounds of 19
// steps each): the median over rounds of each round's median step ranged 29.8-38.0 ms, of its
// fastest 27.5-31.7 ms. The window keeps a long run's figure to its recent steps. Indices into `times`, in increasing order (one today).
inline constexpr std::size_t kSteadyWindow = 32;
std::vector<std::size_t> steady_samples(std::span<const double> times, std::size_t warmup);

// A run's steady step time: its steady step (steady_samples with the first step as warm-up), the
// only step when there is one.
double steady_step_s(const std::vector<double>& step_times);

// Several rounds of one plan (see above); each must be a measurement of that plan.
// `job_probe`: when the plan's rounds were interleaved with other plans' (peftplan
// run's strategies), the median of every plan's every round's speed probe, which then stands for
// this plan's own (job_probe_median): the machine ran the whole job in one span, so each plan's
// median of its R probes is the same speed measured with R samples instead of R × plans. On the
// development VM one job's three strategies' medians of five probes read 46.7, 51.5 and 51.7
// GFLOP/s per rank (2026-12-03): ZeRO-3 alone judged a +3.6% drift, the job +14.4%, and its step,
// 16.5% faster than predicted with a 2.5% spread, came out a conclusive miss on its own probes.
struct JobProbe {
  double flops_per_s = 0.0;  // the median
  std::int32_t probes = 0;   // over how many
};
Validation validate_rounds(const Plan& predicted, std::span<const nlohmann::json> rounds, const Tolerances& tolerances = {},
                           const std::optional<JobProbe>& job_probe = std::nullopt);

// The median speed probe over a job's measurements, every plan's every round (each one's
// speed_probe_flops_per_s; those without one are skipped); nullopt when none has one.
std::optional<JobProbe> job_probe_median(std::span<const nlohmann::json* const> measurements);
Validation validate(const Plan& predicted, const nlohmann::json& measurement, const Tolerances& tolerances = {});

// A totals-only measurement of the user's own job ("schema": "peftplan.measurement-totals/1",
// written by tools/peftplan_callback.py; README "Comparing your own training job"): per rank and
// for the worst rank, the median step after warm-up with its interquartile range, tokens/s per
// GPU, max_memory_allocated / max_memory_reserved and the device memory in use, with the model's
// architecture and config.json hash. Compared: the allocated peak (memory.peak; the plan's
// device peak), step_s (the slowest rank's, spread its IQR) and tokens_per_s_per_gpu. What the
// measurement lacks or the plan does not predict (reserved, device memory in use) becomes a
// note. `source` names the file in errors; `plan_config_sha256` is the hash of the config.json
// the plan was made from (models::config_sha256), when known.
// Throws InputError naming the file and field: a wrong schema, missing or mistyped fields, a
// world size other than the plan's ranks, architecture fields that differ from the plan's model.
Validation validate_totals(const Plan& predicted, const nlohmann::json& measurement, std::string_view source,
                           const std::optional<std::string>& plan_config_sha256, const Tolerances& tolerances = {});

// The folders of a `peftplan run`'s strategies, each holding its validation.json (and plan.json,
// measurement.json): `path` is a validation.json (its folder), a strategy's folder, or a run
// folder whose summary.json lists the strategies (each in `path`/<strategy>, so a moved or copied
// run folder still reads its own). One rule for `report --run` and the explorer. Throws
// InputError naming the file and field, or `path` when it holds none of these.
std::vector<std::filesystem::path> run_folders(const std::filesystem::path& path);

// validation.json ("schema": "peftplan.validation/2"): memory.<category> and memory.peak
// {predicted_bytes, measured_bytes, relative_error}; time.<figure> {predicted, measured,
// relative_error}; comm.<collective> {predicted_bytes, measured_bytes, relative_error};
// within_tolerance; and beside them tolerances, outside, memory_rank (the rank of each memory
// figure), steps, op_time_source, most_different_op, ops, op_kinds.
nlohmann::json validation_to_json(const Validation& v);

// validation.json back into a Validation: its figures (memory, time, comm and throughput, with
// errors, spreads and verdicts as written), tolerances, notes and counts; the per-op lists are
// not read back. Throws InputError naming `source` and the field for a file of another kind
// (schema) or a missing or malformed field.
Validation validation_from_json(const nlohmann::json& j, std::string_view source);

}  // namespace peftplan::planner
