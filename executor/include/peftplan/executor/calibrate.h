// `peftplan calibrate`: measure this machine as the executor uses it and describe it as a
// sim::Cluster, so that the simulator predicts the executor.
//   - GEMM: cpu::linear_forward (Eigen, fp32) on the executor's shapes, one rank alone, and the
//     rate per rank when 1..N ranks compute at once on the shared cores;
//   - memory bandwidth: a STREAM triad per rank, 1..N ranks at once;
//   - collectives through the Communicator: all_reduce, reduce_scatter, all_gather over 2..N
//     ranks, 8 B .. 64 MiB, reported like nccl-tests (size, time, algbw, busbw);
//   - fits: latency/bandwidth per kind and rank count, the simulator's GEMM efficiency curve, and
//     one intra-node link for sim's collective_cost.
// The fits and the profile are pure functions (unit-tested); run_calibration is the measurement
// and must be called on every rank of `world`. Deliberately not here: GPU kernels (a device
// calibration belongs to the CUDA backend), CPU-Adam timing, inter-node links.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "peftplan/executor/communicator.h"
#include "peftplan/sim/cluster.h"
#include "peftplan/sim/program.h"

namespace peftplan::executor {

class Backend;

struct CalibrateOptions {
  bool quick = false;  // fewer shapes, sizes and repetitions: seconds instead of about a minute
  int rounds = 5;      // rounds of the calibration step programs (at least 1; the fastest is kept)
  // The user chose OpenMP's threads (OMP_NUM_THREADS, read by peftplan-exec's main): keep them;
  // otherwise each rank gets cores / ranks.
  bool threads_chosen = false;
  // The backend that runs the GEMM timings, the speed probe and the step programs (backend.h
  // backend_names); the profile describes it.
  std::string backend = "cpu";
  // When set, the backend to use (peftplan-exec makes it first, so that a one-rank communicator
  // can copy with it); otherwise make_backend(backend).
  Backend* backend_instance = nullptr;
};

// y[M,N] = x[M,K] · W[N,K]^T, the executor's linear layer (cpu::linear_forward).
struct GemmShape {
  std::int64_t M = 0;  // token rows (B × S)
  std::int64_t K = 0;  // in-features
  std::int64_t N = 0;  // out-features
};
constexpr double gemm_flops(const GemmShape& s) {
  return 2.0 * static_cast<double>(s.M) * static_cast<double>(s.K) * static_cast<double>(s.N);
}

struct GemmResult {
  GemmShape shape;
  double seconds = 0.0;      // time of one call (its steady blocks' mean)
  double flops_per_s = 0.0;  // gemm_flops / seconds
  int calls = 0;             // timed calls
};

// One rank count's compute and memory rates, every rank of the group busy at once.
struct SharedRate {
  int ranks = 1;                          // ranks running at once
  double gemm_flops_per_s = 0.0;          // mean over the ranks, per rank (executor shape mix)
  double gemm_min_flops_per_s = 0.0;      // slowest rank
  double memory_bytes_per_s = 0.0;        // triad bandwidth, mean per rank
};

struct CollectivePoint {
  sim::Collective kind = sim::Collective::all_reduce;
  int ranks = 2;
  std::uint64_t bytes = 0;          // nccl-tests size S (the whole array for rs/ag)
  std::uint64_t count = 0;          // fp32 elements: S/4 (all_reduce), S/4/ranks (rs, ag)
  int iterations = 0;               // timed operations
  double time_s = 0.0;              // max over ranks of the mean time per operation
  double algbw_bytes_per_s = 0.0;   // S / time
  double busbw_bytes_per_s = 0.0;   // algbw × busbw_factor(kind, ranks)
};

// t = alpha + beta × x, x = bytes each rank sends (S × busbw factor).
struct AlphaBeta {
  double alpha_s = 0.0;         // latency
  double beta_s_per_byte = 0.0; // inverse bandwidth; 1 / beta is the achieved busbw
  double rms_rel_error = 0.0;   // sqrt(mean((fit / measured - 1)^2)) over the fitted points
};

struct CollectiveFit {
  sim::Collective kind = sim::Collective::all_reduce;
  int ranks = 2;
  AlphaBeta fit;
};

// sim's GEMM efficiency curve with gemm_max = 1: rate = plateau × f(M) f(N) f(K),
// f(x) = x / (x + half_dim).
// The GEMM timing curve calibration fits (fit_gemm_curve): seconds per call = latency_s +
// FLOPs / (plateau × f(M)·f(N)·f(K)), f(x) = x / (x + half_dim) as sim::gemm_efficiency.
struct GemmCurve {
  double plateau_flops_per_s = 0.0;
  double half_dim = 0.0;
  double latency_s = 0.0;      // per call, whatever the size (a GPU's launch)
  double rms_rel_error = 0.0;  // of the rates, over the measured shapes
};

// The intra-node link for sim::collective_cost (ring, efficiency 1).
struct LinkFit {
  int ranks = 2;               // the rank count whose measurements were fitted
  double latency_s = 0.0;      // per ring step (sim adds its fixed base latency)
  double bytes_per_s = 0.0;    // achieved per-rank link rate
  double rms_rel_error = 0.0;  // over the fitted points, sim's prediction vs measured
  double error_factor = 1.0;   // exp(rms of log(sim / measured)): the typical factor off
};

// One timed op of the calibration step program (the executor's own kernels, N ranks at once):
// its kernel and work as the program states them and the measured mean seconds per step (rank
// 0's, over the steady steps: measurement op_s).
struct KernelSample {
  sim::Kernel kernel = sim::Kernel::none;
  bool host = false;             // on the host stream (offloaded optimizer)
  sim::ComputeWork work;
  double seconds = 0.0;
  std::string program;           // which calibration program, e.g. "ddp fp32 B2 S128"
  DType dtype = DType::fp32;     // its program's compute dtype (sim::Program::compute_dtype): a bf16
                                 //   program's samples fit HostCalibration::bf16_kernel_scale
};
struct CopySample {
  std::uint64_t bytes = 0;
  double seconds = 0.0;
};

// One collective op of a calibration step program as the ranks ran it (several ranks): its kind
// and size as the program states them, its transfer (mean over steps of the shortest rank's
// call) and the mean time ranks waited in it for the last rank to arrive.
struct CollectiveSample {
  sim::Collective kind = sim::Collective::all_reduce;
  sim::CollectivePlace place = sim::CollectivePlace::compute;  // where the program issues it
  std::uint64_t bytes = 0;       // nccl-tests size S
  std::int32_t group_size = 2;
  double transfer_s = 0.0;
  double wait_s = 0.0;
  double overlapped_s = 0.0;      // rank 0's measured compute around the call
  double since_previous_s = 0.0;  //   (sim::collective_compute_s on the measured op times)
  std::string program;
};

// One calibration step program as the ranks ran it: the program and the measured wall time of a
// step (rank 0, planner::steady_step_s of its steps), which includes what no op's timer sees:
// time a rank spends descheduled while ranks outnumber cores, waits for slower peers, the loop.
// The program runs in several rounds, interleaved with the other programs; the steady round
// (planner::steady_samples: the fastest) is kept (its op times become the kernel samples) and the
// rounds' spread reported.
struct ProgramSample {
  std::string program;           // e.g. "ddp fp32 B2 S128"
  sim::Program step;
  double step_s = 0.0;           // the kept (steady) round's step
  std::vector<double> round_step_s;  // every round's step, in round order
  double spread_s = 0.0;         // interquartile range of round_step_s
};

struct Calibration {
  bool quick = false;
  std::string cpu_model;          // /proc/cpuinfo "model name"
  int cores = 0;                  // logical CPUs
  std::uint64_t ram_bytes = 0;    // physical memory of the host
  // The device the backend computes on when it is not the host (Backend::device_memory_kinds):
  // its description and memory, which the profile's GPU then has; empty / 0 on the CPU backend.
  std::string device;
  std::uint64_t device_memory_bytes = 0;
  int ranks = 1;                  // ranks in the run (N)
  int omp_threads = 1;            // OpenMP threads per rank (Eigen's GEMM threads)
  std::vector<GemmResult> gemm;   // one rank alone, every calibration shape
  double gemm_representative_flops_per_s = 0.0;  // one rank alone, the shape mix
  std::vector<SharedRate> shared;                // 1..N ranks at once
  std::vector<CollectivePoint> collectives;      // 2..N ranks
  std::vector<CollectiveFit> fits;               // per kind and rank count
  GemmCurve gemm_curve;
  LinkFit link;
  std::vector<KernelSample> kernels;             // calibration step programs' compute ops
  std::vector<CopySample> copies;                // and copies (offload)
  std::vector<CollectiveSample> step_collectives;  // and collectives (several ranks)
  std::vector<ProgramSample> programs;           // the calibration step programs and their step times
  int rounds = 0;                                // rounds each program ran
  double probe_before_flops_per_s = 0.0;         // speed_probe as calibration began
  double probe_after_flops_per_s = 0.0;          //   and as it ended
  double reference_step_flops_per_s = 0.0;       // program 0 (the probe's program), its median round
  std::optional<double> others_cpu_share;        // other work's share of the host's CPUs while the
                                                 //   step programs ran (host_load.h); nullopt = not known
};

// How noisy a calibration was: the median over its step programs of their rounds' spread
// (interquartile range) over their step, or how far the machine's speed moved while it ran —
// |probe_after / probe_before - 1| when both probes were taken — whichever is larger: a
// calibration whose probes disagree measured some programs at one speed and some at another,
// however quiet each program's rounds were (one whose probes moved +11% predicted the default
// job 18-20% slow; one whose moved +4% came within 3-8%) — or the share of the host's CPUs other
// work took while the programs ran (others_cpu_share), if larger: a calibration beside other work
// fits that work's waits into the collectives' load and skew, though its probes and rounds may
// be steady (beside two nice-19 loops on the development VM, 2026-12-05: 8.6% of the CPUs, probes
// +1.9% apart, and the default job's ZeRO-3 comm_s predicted 16.8 ms where the quiet machine
// measured 10.1). 0 without programs, probes or share.
double calibration_noise(const Calibration& cal);
// A calibration taken in a noisy spell of a shared machine mispredicts every run after it (one
// taken while other jobs ran measured its programs 30% slow with a median spread of 11%, against
// 2-4% on a quiet machine): peftplan-exec calibrate measures again when calibration_noise exceeds
// a third of the executor profile's time tolerance, up to kCalibrationAttempts in all, and keeps
// the quietest attempt.
inline constexpr int kCalibrationAttempts = 3;

inline constexpr double kProbeWindowS = 0.3;       // before each round's steps (cheap: every round)
inline constexpr double kLongProbeWindowS = 1.0;   // calibration's two and run's check before planning
class Backend;
// The machine-speed probe: the reference step program — calibration's first (tiny-llama-4l, LoRA
// r 8 on every linear, fp32, DDP over the ranks of `world`, B 2 x S 128) — run by every rank at
// once (this process alone when world is null) for window_s after a warm-up step, timed as a run's
// steps are (planner::steady_step_s), giving its model FLOP/s per rank, the same on every rank.
// Calibration takes it as it begins and as it ends (calibration_noise) and the profile keeps the
// same program's rate among the calibration programs (reference_step_flops_per_s, into
// host_calibration.speed_probe_flops_per_s); peftplan-exec takes it before each round's steps
// (measurement.json "speed_probe_flops_per_s"), so validation can tell how much faster or slower
// the machine ran than when it was calibrated (planner::Validation::speed_drift) — a shared
// machine's speed drifts — and `peftplan run` takes it before it plans, to recalibrate a cached
// profile the machine has drifted far from. A step
// program rather than a GEMM: the spells that slow a shared host reach the small kernels, the
// step loop and the collectives, which a GEMM timed alone hides (see calibrate.cpp).
double speed_probe(Backend& backend, Communicator* world, double window_s);

// Per collective kind and place, from the step programs' collectives: the load (transfer -
// collective_cost on `profile`) as load_s + load_per_compute × overlapped_s and the skew (the
// wait) as skew_s + skew_per_compute × since_previous_s — a constant per slot, one slope for
// the host (within-slot least squares; all terms non-negative) — into profile.host_calibration's
// collective_load_* / collective_skew_*. Slots without samples keep 0.
void fit_collective_step_costs(std::span<const CollectiveSample> samples, sim::Cluster& profile);

// The factor by which measured steps exceed what `profile` predicts for them (sim::simulate):
// the geometric mean over the programs of measured / predicted step time (1 without programs).
double step_ratio(std::span<const ProgramSample> programs, const sim::Cluster& profile);

// The whole-step correction of a profile: a factor on every kernel's per-call overhead and one on
// the work-proportional part (kernel scales, copies, host AdamW), fitted to the programs' measured
// steps (least squares of the log of measured / predicted; see calibrate.cpp). apply_step_factors
// folds them into profile.host_calibration, which a profile file keeps.
struct StepFactors {
  double per_call = 1.0;
  double per_work = 1.0;
};
StepFactors fit_step_factors(std::span<const ProgramSample> programs, const sim::Cluster& profile);
void apply_step_factors(const StepFactors& factors, sim::Cluster& profile);

// Per kernel, time = overhead + scale × roofline (the roofline on `base`, a profile without host
// calibration) fitted over the kernel's samples into base.host_calibration.kernel_overhead_s and
// kernel_scale (the ratio of sums, no overhead, when the samples do not span sizes); host
// optimizer samples set cpu_adam_params_per_s instead (parameters per measured second); copies
// set copy_scale. Kernels without samples keep factor 1.
void fit_kernel_scales(std::span<const KernelSample> kernels, std::span<const CopySample> copies, sim::Cluster& base);
// The measured collective tables (kind, ranks, ascending sizes), for host_calibration.
std::vector<sim::CollectiveTable> collective_tables(std::span<const CollectivePoint> points);

// --- pure parts ---------------------------------------------------------------------------

// The executor's GEMM shapes: M in {256, 1024, 2048} × K×N of tiny-llama and ~100M Llama layers
// (quick: M in {256, 1024}, without the 32000-wide head); on a device (a GPU) also a
// TinyLlama-1.1B layer and head at M = 4096.
std::vector<GemmShape> calibration_gemm_shapes(bool quick, bool device = false);
// The mix the shared-core rates and the representative figure use: one Llama layer's
// q/o (640x640), gate/up (640x1728) and down (1728x640) at M = 1024 (quick: 256); on a device,
// TinyLlama-1.1B's (2048x2048, 2048x5632, 5632x2048) at M = 4096.
std::vector<GemmShape> gemm_mix(bool quick, bool device = false);
// Collective sizes S in bytes: 8 B .. 64 MiB in ×2 steps (quick: 16 B .. 4 MiB in ×4 steps).
std::vector<std::uint64_t> calibration_sizes(bool quick);

// Bytes one rank sends in a ring collective of size S: S × busbw_factor(kind, n).
double wire_bytes(sim::Collective kind, std::uint64_t bytes, int ranks);

// Least squares with relative residuals (each point weighted 1/t^2, so 8 B and 64 MiB count
// alike), alpha and beta clamped to >= 0.
AlphaBeta fit_alpha_beta(std::span<const double> x_bytes, std::span<const double> time_s);
std::vector<CollectiveFit> fit_collectives(std::span<const CollectivePoint> points);
GemmCurve fit_gemm_curve(std::span<const GemmResult> results);
// The curve's rate for one shape: FLOPs over its seconds per call.
double gemm_curve_flops_per_s(const GemmCurve& c, const GemmShape& s);
// Latency and bandwidth of one intra-node link such that sim::collective_cost reproduces the
// measurements at `ranks` ranks (least squares on log(t_sim / t_measured) over every kind and size).
LinkFit fit_link(std::span<const CollectivePoint> points, int ranks);

// The cluster profile of this host (see calibrate.cpp for every field's source).
sim::Cluster make_profile(const Calibration& cal);
// nccl-tests-like tables, per rank count and kind, with sim's prediction from `profile` and its
// error; then the GEMM, memory and fit summaries.
std::string format_report(const Calibration& cal, const sim::Cluster& profile);
// Every measurement and fit, with units in keys (the profile's companion file).
nlohmann::json calibration_to_json(const Calibration& cal);
// Writes the profile through sim::write_cluster_file and the measurements beside it
// (<stem>.measurements.json), each through a temporary name and a rename.
void write_profile(const sim::Cluster& profile, const Calibration& cal,
                   const std::filesystem::path& path);
std::filesystem::path measurements_path(const std::filesystem::path& profile_path);

// --- the measurement (every rank of `world` calls it) ------------------------------------

// Progress lines go to `log` (pass nullptr on ranks other than 0). The result is complete on
// world rank 0; other ranks get their own partial view.
Calibration run_calibration(Communicator& world, const CalibrateOptions& options,
                            std::FILE* log);

}  // namespace peftplan::executor
