// `peftplan run`: plan and run, then compare. Plans the configuration on this machine's
// calibrated profile (--calibration FILE, else the cached one `peftplan calibrate` writes, made
// once with `calibrate --quick` when missing; --cluster overrides), writes <out>/plan.json
// atomically (planner/plan_file.h), launches the executor once on every strategy's plan
// (peftplan-exec PLAN.json... --rounds R, the rounds interleaved: executor/runner.h run_rounds;
// directly for one rank, under `mpirun -np N` for several, with --hostfile/--hosts and
// --mpi-args passed through to mpirun), streams its progress lines (step, loss, tokens/s), and
// compares predicted with measured (planner/validate.h): memory per category and peak, step time
// and its split, collective bytes. Writes <out>/validation.json, <out>/trace.predicted.json
// (beside the executor's trace.json) and <out>/report.md; exit code 1 when a figure falls
// outside --tolerance-memory / --tolerance-time, naming each one.
// It never links the executor: peftplan-exec does the work in its own process.
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <filesystem>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "child_process.h"
#include "corpus.h"
#include "commands.h"
#include "peftplan/common/error.h"
#include "peftplan/common/paths.h"
#include "peftplan/common/schemas.h"
#include "peftplan/common/units.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/plan.h"
#include "peftplan/planner/plan_file.h"
#include "peftplan/planner/program.h"
#include "peftplan/planner/validate.h"
#include "peftplan/sim/compute.h"
#include "peftplan/sim/memory.h"
#include "peftplan/sim/trace.h"
#include "plan_flags.h"
#include "peftplan/reports/report.h"
#include "run_report.h"
#include "peftplan/common/atomic_file.h"
#include "validation_text.h"

namespace peftplan::cli {
namespace {

namespace fs = std::filesystem;

std::string absolute(const std::string& p) { return p.empty() ? p : fs::absolute(p).lexically_normal().string(); }

std::string shown(const fs::path& p) { return shown_path(p); }

// The CPU's name (/proc/cpuinfo's "model name"), for "measured on"; the host name without it.
std::string cpu_model_name() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return host;
}

// This machine's profile for N ranks: the file given, else the cached one for N ranks
// (calibration.<N>.json beside the default calibration.json: a profile describes ranks sharing
// the cores, so each rank count has its own). The cached one is made with `peftplan calibrate
// --ranks N --quick` by this same binary, written where it was looked for: when it is missing,
// when it predates the speed probe or has no scale for a kernel `program` runs (written by a
// calibrate that did not know the kernel, or, for a bf16 program, before calibrate timed a bf16
// program), and when the machine's speed has moved away from it.
// `program` is the first strategy's: the strategies of one run share their kernels (they differ
// in collectives, copies and the optimizer's place, not in what the layers compute).
// "Moved away" is the probe (executor/calibrate.h, speed_probe) taken now differing from the
// profile's by more than `recalibrate_beyond` — or the profile having been calibrated beside more
// other work than the machine has now (executor/host_load.h), by more than
// planner::calibration_noise_limit() of the CPUs. `recalibrate_beyond` is the
// profile's time tolerance, whatever
// --tolerance-time says — a drift beyond which no miss could be conclusive (see
// planner::Validation::speed_drift), so a run on the old profile could judge time one way only.
// A smaller drift is left to the verdict, which judges each figure at both speeds: the
// development VM's probe wanders ±10% from minute to minute, and recalibrating on every such
// swing cost each run 25 s for a profile no better than the last. A profile given with
// --calibration is the user's: used as it is (validation reports the drift).
sim::Cluster calibrated_cluster(const std::string& given, std::int32_t N, double recalibrate_beyond, const sim::Program& program) {
  const fs::path path = given.empty() ? default_profile_path().replace_filename(fmt::format("{}.{}.json", profile_stem(), N))
                                      : fs::absolute(given);
  std::string why = fmt::format("no calibrated profile for {} rank(s) at {}", N, path.string());
  if (fs::is_regular_file(path)) {
    sim::Cluster c = sim::read_cluster_file(path);
    // A kernel the run executes that the profile never measured (it predates the kernel).
    std::string missing;
    for (sim::Kernel k : sim::uncalibrated_kernels(program, c)) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", sim::name_of(k));
    // A bf16 run on a profile calibrated before calibrate ran a bf16 program (its kernels would
    // be timed with the fp32 programs' factors).
    const bool lacks_bf16 = sim::lacks_bf16_calibration(program, c);
    if (!given.empty()) {
      if (!missing.empty())
        fmt::print("warning: the profile {} has no calibration of {} (made before calibrate knew them): those kernels are timed on "
                   "the uncalibrated roofline; rerun peftplan calibrate\n",
                   path.string(), missing);
      if (lacks_bf16)
        fmt::print("warning: the profile {} has no calibration of a bf16 program's kernels (made before calibrate ran one): they are "
                   "timed with the fp32 programs' factors, which miss the bf16 conversions; rerun peftplan calibrate\n",
                   path.string());
      fmt::print("cluster: calibrated profile {} ({})\n", path.string(), c.name);
      if (sim::total_gpus(c) < N)
        throw input_error("--calibration", "", fmt::format("must profile at least {} ranks, has {} (rerun peftplan calibrate --ranks {})",
                                                           N, sim::total_gpus(c), N),
                          path.string());
      if (sim::total_gpus(c) != N)
        fmt::print("warning: the profile was calibrated with {} ranks sharing the cores, this run has {}\n", sim::total_gpus(c), N);
      return c;
    }
    const double then = c.host_calibration.speed_probe_flops_per_s;
    if (!missing.empty()) {
      why = fmt::format("the cached profile {} has no calibration of {}, which this run executes (it was made before calibrate "
                        "knew them)",
                        path.string(), missing);
    } else if (lacks_bf16) {
      why = fmt::format("the cached profile {} has no calibration of a bf16 program's kernels, which this run executes (it was made "
                        "before calibrate ran one)",
                        path.string());
    } else if (sim::total_gpus(c) != N) {
      why = fmt::format("the cached profile {} has {} rank(s), this run {}", path.string(), sim::total_gpus(c), N);
    } else if (!(then > 0.0)) {
      why = fmt::format("the cached profile {} predates the machine-speed probe", path.string());
    } else {
      // One probe jitters by a few percent (a 1 s window on the development VM: ±3%); a drift
      // beyond the bound is confirmed by a second probe (their mean decides) before it costs a
      // calibration.
      SpeedProbe probe = run_speed_probe(N);
      double now = probe.flops_per_s;
      if (std::abs(now / then - 1.0) > recalibrate_beyond) now = 0.5 * (now + run_speed_probe(N).flops_per_s);
      const double drift = now / then - 1.0;
      // The machine's other work, as the probe saw it, against the profile's (executor/host_load.h):
      // a profile calibrated beside other work fits that work's share of the collectives' waits
      // into every prediction, though the probe's speed barely moves with it.
      const std::optional<double> load_then = c.host_calibration.others_cpu_share;
      const std::optional<double> load_change =
          probe.others_cpu_share && load_then ? std::optional<double>(*probe.others_cpu_share - *load_then) : std::nullopt;
      // Asymmetric, as the steady step is (planner::steady_samples): other work only adds time, so
      // a profile made beside more of it than now is replaced; one made quieter than now is the
      // machine's own speed, and the verdict weighs the change (Validation::load_change).
      const double load_limit = planner::calibration_noise_limit();
      if (std::abs(drift) <= recalibrate_beyond && !(load_change && -*load_change > load_limit)) {
        fmt::print("cluster: calibrated profile {} ({}); speed probe {:.2f} GFLOP/s per rank, {:+.1f}% from the profile's{}\n",
                   path.string(), c.name, now / 1e9, 100.0 * drift,
                   load_change ? fmt::format("; other work {:.1f}% of the CPUs, {:+.1f} points from the profile's", 100.0 * *probe.others_cpu_share,
                                             100.0 * *load_change)
                               : std::string());
        return c;
      }
      if (std::abs(drift) > recalibrate_beyond)
        why = fmt::format("the machine runs {:+.1f}% from the speed of the cached profile {} (probe {:.2f} vs {:.2f} GFLOP/s per rank; "
                          "more than {:.0f}%)",
                          100.0 * drift, path.string(), now / 1e9, then / 1e9, 100.0 * recalibrate_beyond);
      else
        why = fmt::format("other work takes {:.1f}% of the CPUs now and took {:.1f}% when the cached profile {} was calibrated (more "
                          "than {:.0f} points more)",
                          100.0 * *probe.others_cpu_share, 100.0 * *load_then, path.string(), 100.0 * load_limit);
    }
  }
  fmt::print("cluster: {}: running peftplan calibrate --quick\n", why);
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) throw std::runtime_error("peftplan run: cannot find its own binary to run calibrate");
  // One attempt: a run waits for this calibration, which keeps each program's median round (as
  // the run reports its own), and the next run's probe retakes it if the machine has moved on
  // (`peftplan calibrate` itself retakes a noisy calibration up to 3 times).
  const int code = run_child({self.string(), "calibrate", "--ranks", std::to_string(N), "--quick", "--attempts", "1", "--out", path.string()});
  if (code != 0) throw std::runtime_error(fmt::format("peftplan run: peftplan calibrate exited with code {}", code));
  sim::Cluster c = sim::read_cluster_file(path);
  fmt::print("cluster: calibrated profile {} ({})\n", path.string(), c.name);
  return c;
}

// Splits "ddp,zero2,zero3" into its names (empty items are an input error).
std::vector<std::string> strategy_list(const std::string& s) {
  std::vector<std::string> out;
  std::string item;
  std::istringstream in(s);
  while (std::getline(in, item, ',')) {
    if (item.empty()) throw input_error("--strategy", "", "must be a strategy or a comma-separated list of them (ddp,zero2,zero3)", s);
    out.push_back(item);
  }
  if (out.empty()) throw input_error("--strategy", "", "must name at least one strategy", s);
  return out;
}

// One strategy of the job: its folder, plan file and prediction, and every round's measurement.
struct Job {
  std::string strategy;
  fs::path dir;
  planner::PlanFile pf;
  planner::Plan plan;
  std::vector<nlohmann::json> rounds;
  planner::Validation v;
};

const planner::Figure* figure_named(const std::vector<planner::Figure>& fs, const std::string& name) {
  for (const auto& f : fs)
    if (f.name == name) return &f;
  return nullptr;
}

// The comparison of several runs: step time and peak predicted versus measured, the step's
// spread, collective bytes, and the verdict, one row per strategy (text for the console,
// Markdown for summary.md).
std::string summary_table(const std::vector<Job>& runs, bool markdown) {
  std::string s;
  if (markdown)
    s += "| strategy | step predicted | step measured | error | spread | peak predicted | peak measured | error | collective bytes | verdict |\n"
         "|---|--:|--:|--:|--:|--:|--:|--:|---|---|\n";
  else
    s += fmt::format("{:<10} {:>14} {:>11} {:>8} {:>7} {:>15} {:>12} {:>8} {:>17}  {}\n", "strategy", "step predicted", "measured", "error",
                     "spread", "peak predicted", "measured", "error", "collective bytes", "verdict");
  for (const Job& r : runs) {
    const planner::Figure* st = figure_named(r.v.time, "step_s");
    const planner::Figure* pk = figure_named(r.v.memory, "peak");
    bool exact = true;
    for (const auto& f : r.v.comm) exact = exact && f.predicted == f.measured;
    const std::string bytes = r.v.comm.empty() ? "none" : exact ? "exact" : "differ";
    const std::string cells[] = {
        r.strategy,
        fmt::format("{:.3f} ms", st ? st->predicted * 1e3 : 0.0),
        fmt::format("{:.3f} ms", st ? st->measured * 1e3 : 0.0),
        st ? pct(st->relative_error) : "n/a",
        st && st->has_spread && st->measured > 0.0 ? fmt::format("{:.1f}%", 100.0 * st->spread / st->measured) : "-",
        mib(pk ? static_cast<std::uint64_t>(pk->predicted) : 0),
        mib(pk ? static_cast<std::uint64_t>(pk->measured) : 0),
        pk ? pct(pk->relative_error) : "n/a",
        bytes,
        verdict_summary(r.v)};
    if (markdown)
      s += fmt::format("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n", cells[0], cells[1], cells[2], cells[3], cells[4], cells[5],
                       cells[6], cells[7], cells[8], cells[9]);
    else
      s += fmt::format("{:<10} {:>14} {:>11} {:>8} {:>7} {:>15} {:>12} {:>8} {:>17}  {}\n", cells[0], cells[1], cells[2], cells[3], cells[4],
                       cells[5], cells[6], cells[7], cells[8], cells[9]);
  }
  return s;
}

}  // namespace

void add_run_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("run", "plan, run the executor for real, and compare predicted with measured (several strategies: one "
                                        "run each, then a comparison)");
  cmd->footer("example: peftplan run --strategy ddp,zero2,zero3 --out out/run");
  struct Options {
    PlanFlags plan;
    planner::RunOptions run;
    std::optional<double> lr, weight_decay, clip;
    std::string out = "peftplan-run";
    std::string hostfile, hosts, mpi_args;
    std::string calibration;
    std::optional<double> tolerance_memory, tolerance_time;
    int rounds = 5;
  };
  auto o = std::make_shared<Options>();
  // The embedded default job: tiny-llama-4l with LoRA, DDP, ZeRO-2 and ZeRO-3 on 2 ranks (unless
  // --cluster says otherwise), the bundled text, the executor's own profile (fp32 compute, eager
  // attention).
  o->plan.model = "tiny-llama-4l";
  o->plan.profile = "executor";
  o->plan.precision = "fp32";
  o->plan.attention = "eager";
  o->plan.seq_len = 128;
  o->plan.micro_batch = 4;
  o->plan.strategy = "ddp,zero2,zero3";
  o->run.steps = 20;
  add_plan_flags(cmd, o->plan);
  // run's --strategy takes a list; its default differs from plan's
  if (auto* opt = cmd->get_option_no_throw("--strategy"))
    opt->description("ddp, zero1, zero2 or zero3, or a comma-separated list to run each and compare");
  cmd->add_option("--data", o->run.data, "token file to train on (default: the bundled text, written to <out>/corpus.txt)")
      ->check(kNonEmpty)
      ->check(CLI::ExistingFile);
  cmd->add_option("--data-format", o->run.data_format, "u32, u16 (little-endian) or bytes (every byte a token)")
      ->capture_default_str();
  cmd->add_option("--steps", o->run.steps, "optimizer steps")->capture_default_str()->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 40));
  cmd->add_option("--lr", o->lr, "learning rate (default 1e-4, or the ds_config's)")->check(finite_non_negative());
  cmd->add_option("--weight-decay", o->weight_decay, "AdamW decoupled weight decay (default 0)")->check(finite_non_negative());
  cmd->add_option("--clip", o->clip, "gradient clipping by global norm (0 = off)")->check(finite_non_negative());
  cmd->add_option("--seed", o->run.seed, "seed of the weight and adapter init and dropout")->capture_default_str();
  cmd->add_option("--weights", o->run.weights, "safetensors checkpoint with Hugging Face names (default: random init)")
      ->check(kNonEmpty)
      ->check(CLI::ExistingFile);
  cmd->add_option("--adapter-init", o->run.adapter_init, "peft (A uniform, B zero) or a safetensors adapter with PEFT names")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& v) {
            std::error_code ec;
            return v == "peft" || fs::is_regular_file(v, ec) ? std::string() : "must be peft or an existing safetensors file, got " + v;
          },
          "", "PEFT_OR_FILE"));
  cmd->add_option("--save-adapter", o->run.save_adapter, "folder for adapter_model.safetensors + adapter_config.json")
      ->check(kNonEmpty)
      ->check(CLI::Validator(
          [](std::string& v) {
            std::error_code ec;
            return fs::exists(v, ec) && !fs::is_directory(v, ec) ? "must be a folder (or a new name), is a file: " + v : std::string();
          },
          "", "FOLDER"));
  cmd->add_option("--out", o->out, "folder for plan.json, measurement.json, validation.json, traces and report.md (several "
                                   "strategies: one subfolder each)")
      ->capture_default_str()
      ->check(kNonEmpty);
  cmd->add_option("--on-nonfinite", o->run.on_nonfinite,
                  "a step whose gradient norm is not finite: stop (naming the first non-finite gradient, exit code 1) or skip its update")
      ->check(CLI::IsMember({"stop", "skip"}))
      ->capture_default_str();
  cmd->add_option("--checkpoint-every", o->run.checkpoint_every, "write a training checkpoint every K steps (0: never)")
      ->capture_default_str();
  cmd->add_option("--checkpoint-dir", o->run.checkpoint_dir, "folder for checkpoints (default: <out>/checkpoints)");
  cmd->add_option("--resume", o->run.resume, "continue from a checkpoint (a step-<k> folder or a checkpoint folder)");
  cmd->add_option("--hostfile", o->hostfile, "mpirun hostfile: run the ranks on several machines");
  cmd->add_option("--hosts", o->hosts, "mpirun --host list (a,b or a:4,b:4)");
  cmd->add_option("--mpi-args", o->mpi_args, "extra mpirun arguments, space-separated (e.g. \"--mca btl tcp,self\")");
  cmd->add_option("--calibration", o->calibration,
                  fmt::format("calibrated profile to plan with (default: the cached one beside {}, made when missing or when the machine's speed moved from it)", default_profile_path().string()));
  cmd->add_option("--tolerance-memory", o->tolerance_memory,
                  "relative tolerance of memory and collective bytes (default: the profile's, 0.02 for executor)")
      ->check(finite_non_negative());
  cmd->add_option("--tolerance-time", o->tolerance_time,
                  "relative tolerance of the step time (the step's parts: their error as a share of the step; default: the "
                  "profile's, 0.15)")
      ->check(finite_non_negative());
  cmd->add_option("--rounds", o->rounds,
                  "rounds of every strategy's run, interleaved; times are the median of the rounds, the spread their "
                  "interquartile range")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->callback([o, &exit_code] {
    // A launcher config without --strategy sets the one strategy run runs (its own default is a list).
    const bool file_sets_strategy = !o->plan.was_given("--strategy") && (!o->plan.ds_config.empty() || !o->plan.accelerate_config.empty());
    const std::vector<std::string> strategies = file_sets_strategy ? std::vector<std::string>{"ddp"} : strategy_list(o->plan.strategy);
    const bool several = strategies.size() > 1;
    if (several) {
      // What belongs to one training run cannot be shared by several.
      if (!o->run.save_adapter.empty()) throw input_error("--save-adapter", "", "needs a single --strategy", o->plan.strategy);
      if (!o->run.resume.empty()) throw input_error("--resume", "", "needs a single --strategy", o->plan.strategy);
      if (!o->run.checkpoint_dir.empty()) throw input_error("--checkpoint-dir", "", "needs a single --strategy", o->plan.strategy);
    }
    PlanFlags flags = o->plan;
    if (!flags.gpus && flags.cluster.empty()) flags.gpus = 2;  // the default job's 2 ranks
    std::vector<ResolvedPlan> resolved;  // every strategy's input, checked before anything runs
    for (const std::string& s : strategies) {
      PlanFlags f = flags;
      f.strategy = s;
      resolved.push_back(resolve_plan_flags(f));
      // What peftplan-exec would refuse at its first step is refused here, before the folder, the
      // data or a calibration exist.
      if (const std::string why = planner::executor_limitation(resolved.back().input); !why.empty())
        throw InputError(fmt::format("run: the executor cannot run this plan ({}): `peftplan plan` plans it for the GPU runtimes", why));
    }
    const fs::path out = fs::absolute(o->out);
    make_folder(out, "--out");
    planner::RunOptions run = o->run;
    if (run.data.empty()) {  // the bundled text, as bytes
      write_text_atomic(out / "corpus.txt", std::string(bundled_corpus()));
      run.data = (out / "corpus.txt").string();
      run.data_format = "bytes";
      fmt::print("data: the bundled text ({} bytes), written to {}\n", bundled_corpus().size(), shown(run.data));
    }
    std::optional<sim::Cluster> calibrated;
    std::string profile = "--cluster";
    std::vector<Job> jobs;
    // Plans first, every strategy's: the prediction never sees a measurement.
    for (std::size_t si = 0; si < strategies.size(); ++si) {
      Job job;
      job.strategy = std::string(planner::name_of(resolved[si].input.strategy.stage));
      job.dir = several ? out / strategies[si] : out;
      ResolvedPlan& r = resolved[si];
      print_warnings(r.warnings);
      planner::PlanFile& pf = job.pf;
      pf.input = r.input;
      if (o->lr) pf.input.training.lr = *o->lr;
      if (o->weight_decay) pf.input.training.weight_decay = *o->weight_decay;
      if (o->clip) pf.input.training.grad_clip = *o->clip;
      if (!flags.ds_config.empty()) {  // the scheduler rides in ds_config.json
        planner::DsConfigInputs di;
        di.world_size = pf.input.strategy.ranks;
        di.training = pf.input.training;
        di.hidden = pf.input.model.hidden;
        di.total_steps = run.steps;
        pf.extras = planner::read_ds_config(models::read_json_file(flags.ds_config), flags.ds_config, di).extras;
      }
      pf.model_source = planner::model_source_for(flags.model);
      pf.run = run;
      pf.run.data = absolute(pf.run.data);
      pf.run.weights = absolute(pf.run.weights);
      if (pf.run.adapter_init != "peft") pf.run.adapter_init = absolute(pf.run.adapter_init);
      pf.run.save_adapter = absolute(pf.run.save_adapter);
      if (pf.run.checkpoint_every > 0 && pf.run.checkpoint_dir.empty()) pf.run.checkpoint_dir = (job.dir / "checkpoints").string();
      pf.run.checkpoint_dir = absolute(pf.run.checkpoint_dir);
      pf.run.resume = absolute(pf.run.resume);
      print_warnings(planner::validate(pf.input));
      const int N = pf.input.strategy.ranks;
      if (flags.cluster.empty()) {
        if (!calibrated)
          calibrated = calibrated_cluster(o->calibration, N, planner::tolerances_for(pf.input.profile).time,
                                          planner::build_program(pf.input, {.names = false}).program);
        r.cluster = *calibrated;
        profile = "calibrated profile";
      } else if (si == 0) {
        fmt::print("cluster: {} (--cluster)\n", r.cluster.name);
      }
      pf.cluster = r.cluster;
      planner::PlanOptions po;
      po.explain = false;
      job.plan = planner::make_plan(pf.input, r.cluster, po);
      jobs.push_back(std::move(job));
    }
    const std::string job_model = jobs.front().pf.input.model.name;
    const int job_ranks = jobs.front().pf.input.strategy.ranks;  // every strategy's: one --gpus or --cluster
    // The executor's command line: mpirun ($PEFTPLAN_MPIRUN or Open MPI's mpirun on the PATH) for
    // several ranks or hosts, where on one machine more ranks than cores are allowed
    // (--oversubscribe) and root may run it; peftplan-exec alone for one rank.
    std::vector<std::string> args;
    if (job_ranks > 1 || !o->hostfile.empty() || !o->hosts.empty()) {
      const char* mpirun = std::getenv("PEFTPLAN_MPIRUN");
      const std::string launcher = mpirun && *mpirun ? mpirun : "mpirun";
      if (o->hostfile.empty() && o->hosts.empty()) {
        args = local_mpirun(launcher, job_ranks);  // as calibrate measured the ranks
      } else {
        args = {launcher, "-np", std::to_string(job_ranks)};
        if (!o->hostfile.empty()) args.insert(args.end(), {"--hostfile", absolute(o->hostfile)});
        if (!o->hosts.empty()) args.insert(args.end(), {"--host", o->hosts});
        if (::geteuid() == 0) args.push_back("--allow-run-as-root");
      }
      std::istringstream extra(o->mpi_args);
      for (std::string a; extra >> a;) args.push_back(a);
    }
    args.push_back(find_exec().string());
    const planner::Tolerances defaults = planner::tolerances_for(jobs.front().pf.input.profile);
    planner::Tolerances tol;
    tol.memory = o->tolerance_memory.value_or(defaults.memory);
    tol.time = o->tolerance_time.value_or(defaults.time);

    // Rounds, the strategies interleaved, in one launch of the executor (executor/runner.h,
    // run_rounds): a slow spell of a shared machine lands on all of them. Round 1 runs in each
    // strategy's folder and shows its steps; later rounds run quietly in <dir>/rounds/<k>/, and
    // the executor prints one line per round.
    const int R = o->rounds;
    for (Job& job : jobs) {
      fs::create_directories(job.dir);
      const fs::path plan_path = job.dir / "plan.json";
      planner::write_plan_file(plan_path, job.pf);
      fmt::print("wrote {}\n", shown(plan_path));
      args.push_back(plan_path.string());
    }
    args.insert(args.end(), {"--rounds", std::to_string(R)});
    std::fflush(stdout);
    if (const int code = run_child(args); code != 0) {
      fmt::print(stderr, "peftplan run: peftplan-exec exited with code {}{}\n", code,
                 code == 1 ? ": the training went non-finite (see its message above; --on-nonfinite skip skips such steps)" : "");
      exit_code = code == 1 ? 1 : code == 2 ? 2 : 3;
      return;
    }
    for (int round = 1; round <= R; ++round)
      for (Job& job : jobs) {
        const fs::path dir = round == 1 ? job.dir : job.dir / "rounds" / std::to_string(round);
        auto m = models::read_json_file((dir / "measurement.json").string());
        if (round == 1 && fs::is_regular_file(dir / "trace.json")) m["trace"] = models::read_json_file((dir / "trace.json").string());
        job.rounds.push_back(std::move(m));
      }

    // The machine's speed over the job: the strategies' rounds were interleaved, so every probe
    // of every strategy measured the same span (planner::validate_rounds, job_probe).
    std::optional<planner::JobProbe> job_probe;
    if (several) {
      std::vector<const nlohmann::json*> all;
      for (const Job& job : jobs)
        for (const auto& m : job.rounds) all.push_back(&m);
      job_probe = planner::job_probe_median(all);
    }
    for (Job& job : jobs) {
      const fs::path& dir = job.dir;
      const int N = job.pf.input.strategy.ranks;
      if (several) fmt::print("\n== {}: predicted versus measured ({})\n", job.strategy, shown(dir));
      job.v = planner::validate_rounds(job.plan, job.rounds, tol, job_probe);
      const planner::Validation& v = job.v;
      const nlohmann::json& m = job.rounds.at(static_cast<std::size_t>(v.op_round));
      fmt::print("{}", validation_tables(v, false));
      fmt::print("peak at: {} (measured), {} (predicted)\n", m.at("memory").at("device").at("peak_op").get<std::string>(),
                 planner::plan_to_json(job.plan).at("memory").at("device").at("peak_op").get<std::string>());
      fmt::print("{}", validation_notes(v));
      bool exact = true;
      for (const auto& f : v.memory)
        if (f.name.rfind("host_", 0) != 0 && f.predicted != f.measured) exact = false;  // device categories and the peak
      bool same = true;
      for (const auto& f : v.comm) same = same && f.predicted == f.measured;
      if (N > 1)
        fmt::print("{}\n", same ? "measured collective bytes equal the prediction exactly" : "measured collective bytes differ from the prediction");
      const auto& t = m.at("time");
      fmt::print("step {:.3f} s, {:.0f} tokens/s, {:.2f} GFLOP/s, {:.0f}% of the step in GEMMs (round {})\n", t.at("step_s").get<double>(),
                 t.at("tokens_per_s").get<double>(), t.at("achieved_flops_per_s").get<double>() / 1e9,
                 100.0 * t.at("gemm_fraction").get<double>(), v.op_round + 1);
      fmt::print("{}\n", exact ? "measured memory equals the prediction exactly" : "measured memory differs from the prediction");
      nlohmann::json vj = planner::validation_to_json(v);
      write_text_atomic(dir / "validation.json", vj.dump(1) + "\n");
      sim::TraceOptions to;
      to.ranks = N;
      to.pid_base = 1000;  // the measured trace.json uses pid 0
      write_text_atomic(dir / "trace.predicted.json", sim::chrome_trace(job.plan.program, *job.plan.time, to).dump() + "\n");
      fmt::print("wrote validation.json and trace.predicted.json beside measurement.json and trace.json in {}\n", shown(dir));
      std::fflush(stdout);  // the table first, then the verdict lines on stderr
      fmt::print(stderr, "{}", verdict_lines(v));
      if (!v.within_tolerance) {
        fmt::print(stderr, "peftplan run: {} figure(s) outside tolerance\n", v.outside.size());
        exit_code = 1;
      }
      std::fflush(stderr);
    }
    // One report of every strategy, predicted and measured (reports/report.h).
    {
      std::vector<MeasuredStrategy> measured;
      for (const Job& job : jobs) measured.push_back({job.strategy, job.plan, job.v, job.dir});
      const std::string machine = fmt::format("{} ({}, {} rank(s))", cpu_model_name(), jobs.front().rounds.front().value("backend", std::string("?")), job_ranks);
      reports::write_report(out / "report", run_report(measured, machine, profile, R, tol));
      fmt::print("wrote {}/ (report.html, report.md: every strategy, predicted and measured)\n", shown(out / "report"));
    }
    if (several) {
      const std::string what = fmt::format("{}, {} rank(s), {}, {} round(s)", job_model, job_ranks, profile, R);
      fmt::print("\n== predicted versus measured, {} strategies ({}); tolerances: memory {:.4g}%, time {:.4g}%\n", jobs.size(), what,
                 100.0 * tol.memory, 100.0 * tol.time);
      fmt::print("{}", summary_table(jobs, false));
      nlohmann::json sj = nlohmann::json::array();
      for (const Job& r : jobs) {
        nlohmann::json vj = planner::validation_to_json(r.v);
        sj.push_back({{"strategy", r.strategy}, {"dir", r.dir.string()}, {"within_tolerance", r.v.within_tolerance}, {"outside", r.v.outside},
                      {"inconclusive", r.v.inconclusive}, {"step_s", vj["time"]["step_s"]}, {"peak", vj["memory"]["peak"]}, {"comm", vj["comm"]}});
      }
      write_text_atomic(out / "summary.json", nlohmann::json{{"schema", schemas::kRunSummary}, {"rounds", R}, {"runs", sj}}.dump(1) + "\n");
      write_text_atomic(out / "summary.md", "# peftplan run: predicted versus measured, by strategy\n\n" + summary_table(jobs, true));
      fmt::print("wrote {} and {}\n", shown(out / "summary.json"), shown(out / "summary.md"));
    }
  });
}

}  // namespace peftplan::cli
