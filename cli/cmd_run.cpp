// `peftplan run`: plan and run, then compare. Plans the configuration on this machine's
// calibrated profile (--calibration FILE, else the cached one `peftplan calibrate` writes, made
// once with `calibrate --quick` when missing; --cluster overrides), writes <out>/plan.json
// atomically (planner/plan_file.h), launches the executor on it (peftplan-exec PLAN.json --out
// <out>: directly for one rank, under `mpirun -np N` for several, with --hostfile/--hosts and
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
#include "commands.h"
#include "peftplan/common/error.h"
#include "peftplan/common/units.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/plan.h"
#include "peftplan/planner/plan_file.h"
#include "peftplan/planner/validate.h"
#include "peftplan/sim/memory.h"
#include "peftplan/sim/trace.h"
#include "plan_flags.h"

namespace peftplan::cli {
namespace {

namespace fs = std::filesystem;

std::string absolute(const std::string& p) { return p.empty() ? p : fs::absolute(p).lexically_normal().string(); }

std::string mib(std::uint64_t b) { return fmt::format("{:.3f} MiB", static_cast<double>(b) / (1024.0 * 1024.0)); }

// Writes text to path through a temporary name and a rename, so a reader never sees half a file.
void write_atomic(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    if (!f) throw InputError(fmt::format("{}: cannot write", path.string()));
    f << text;
    if (!f) throw InputError(fmt::format("{}: cannot write", path.string()));
  }
  fs::rename(tmp, path);
}

// This machine's profile for N ranks: the file given, else the cached one for N ranks
// (calibration.<N>.json beside the default calibration.json: a profile describes ranks sharing
// the cores, so each rank count has its own). Missing: `peftplan calibrate --ranks N --quick` with
// this same binary, once, written where it was looked for.
sim::Cluster calibrated_cluster(const std::string& given, std::int32_t N) {
  const fs::path path = given.empty() ? default_profile_path().replace_filename(fmt::format("calibration.{}.json", N))
                                      : fs::absolute(given);
  if (fs::is_regular_file(path)) {
    sim::Cluster c = sim::read_cluster_file(path);
    if (sim::total_gpus(c) == N || !given.empty()) {
      fmt::print("cluster: calibrated profile {} ({})\n", path.string(), c.name);
      if (sim::total_gpus(c) < N)
        throw input_error("--calibration", "", fmt::format("must profile at least {} ranks, has {} (rerun peftplan calibrate --ranks {})",
                                                           N, sim::total_gpus(c), N),
                          path.string());
      if (sim::total_gpus(c) != N)
        fmt::print("warning: the profile was calibrated with {} ranks sharing the cores, this run has {}\n", sim::total_gpus(c), N);
      return c;
    }
  }
  fmt::print("cluster: no calibrated profile for {} rank(s) at {}: running peftplan calibrate --quick once\n", N, path.string());
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) throw std::runtime_error("peftplan run: cannot find its own binary to run calibrate");
  const int code = run_child({self.string(), "calibrate", "--ranks", std::to_string(N), "--quick", "--out", path.string()});
  if (code != 0) throw std::runtime_error(fmt::format("peftplan run: peftplan calibrate exited with code {}", code));
  sim::Cluster c = sim::read_cluster_file(path);
  fmt::print("cluster: calibrated profile {} ({})\n", path.string(), c.name);
  return c;
}

std::string pct(double rel) { return std::isfinite(rel) ? fmt::format("{:+.2f}%", 100.0 * rel) : "n/a"; }

// The comparison tables, as text rows (the console) or Markdown (report.md).
std::string tables(const planner::Validation& v, bool markdown) {
  std::string s;
  auto head = [&](const std::string& what, const std::string& unit) {
    if (markdown) s += fmt::format("| {} | predicted{} | measured{} | abs. error | rel. error | |\n|---|--:|--:|--:|--:|---|\n", what, unit, unit);
    else s += fmt::format("\n{:<24} {:>14} {:>14} {:>14} {:>9}\n", what, "predicted", "measured", "abs. error", "rel.");
  };
  auto row = [&](const planner::Figure& f, const std::string& p, const std::string& m, const std::string& d) {
    const char* mark = f.within ? "" : "OUTSIDE";
    if (markdown) s += fmt::format("| {} | {} | {} | {} | {} | {} |\n", f.name, p, m, d, pct(f.relative_error), mark);
    else s += fmt::format("{:<24} {:>14} {:>14} {:>14} {:>9} {}\n", f.name, p, m, d, pct(f.relative_error), mark);
  };
  const std::string mem_head = v.memory.empty() || v.memory.front().rank == 0 ? "memory" : "memory (worst rank)";
  head(mem_head, markdown ? " (MiB)" : "");
  for (const auto& f : v.memory)
    if (f.predicted != 0.0 || f.measured != 0.0 || f.name == "peak")
      row(f, mib(static_cast<std::uint64_t>(f.predicted)), mib(static_cast<std::uint64_t>(f.measured)),
          fmt::format("{:+.0f} B", f.measured - f.predicted));
  if (markdown) s += "\n";
  head("time per step", markdown ? " (ms)" : "");
  for (const auto& f : v.time)
    row(f, fmt::format("{:.3f} ms", f.predicted * 1e3), fmt::format("{:.3f} ms", f.measured * 1e3),
        fmt::format("{:+.3f} ms", (f.measured - f.predicted) * 1e3));
  if (!v.comm.empty()) {
    if (markdown) s += "\n";
    head("bytes per step", markdown ? " (B)" : "");
    for (const auto& f : v.comm)
      row(f, fmt::format("{:.0f}", f.predicted), fmt::format("{:.0f}", f.measured), fmt::format("{:+.0f}", f.measured - f.predicted));
  }
  return s;
}

std::string describe(const planner::OpDiff& d) {
  if (d.op >= 0)
    return fmt::format("op {} {} ({}, {}, layer {}, micro-batch {}): predicted {:.3f} ms, measured {:.3f} ms ({:+.3f} ms)", d.op,
                       d.label, d.phase, d.kernel, d.layer, d.micro_batch, d.predicted_s * 1e3, d.measured_s * 1e3, d.diff_s() * 1e3);
  return fmt::format("{} ({}, {}, {} ops): predicted {:.3f} ms, measured {:.3f} ms ({:+.3f} ms)", d.label, d.phase, d.kernel, d.ops,
                     d.predicted_s * 1e3, d.measured_s * 1e3, d.diff_s() * 1e3);
}

std::string outside_line(const planner::Figure& f) {
  return fmt::format("outside tolerance: {}: predicted {:.6g}, measured {:.6g} ({}, tolerance {:.4g}%)", f.key(), f.predicted,
                     f.measured, pct(f.relative_error), 100.0 * f.tolerance);
}

std::string report(const planner::Plan& plan, const planner::Validation& v, const std::string& profile) {
  const auto& in = plan.input;
  const auto& t = in.training;
  std::string s = "# peftplan run: predicted versus measured\n\n## Configuration\n\n";
  s += fmt::format("- model: {}\n- strategy: {}, {} rank(s)\n- micro-batch {}, sequence {}, gradient accumulation {}\n"
                   "- cluster: {} ({})\n- steps measured: {} (step time: median of the steps after the first)\n\n",
                   in.model.name, planner::name_of(in.strategy.stage), in.strategy.ranks, t.micro_batch, t.seq_len, t.grad_accum,
                   plan.cluster.name, profile, v.steps);
  s += "## Figures\n\n" + tables(v, true);
  s += fmt::format("\n## Op by op\n\nMeasured op times from the {}.\n\n", v.op_time_source);
  if (v.most_different) s += "Differs most: " + describe(*v.most_different) + "\n\n";
  if (!v.kinds.empty()) {
    s += "| op kind (phase, kernel, label) | ops | predicted (ms) | measured (ms) | difference (ms) |\n|---|--:|--:|--:|--:|\n";
    for (std::size_t i = 0; i < std::min<std::size_t>(5, v.kinds.size()); ++i) {
      const auto& d = v.kinds[i];
      s += fmt::format("| {}, {}, {} | {} | {:.3f} | {:.3f} | {:+.3f} |\n", d.phase, d.kernel, d.label, d.ops, d.predicted_s * 1e3,
                       d.measured_s * 1e3, d.diff_s() * 1e3);
    }
  }
  s += fmt::format("\n## Verdict\n\nTolerances: memory and collective bytes {:.4g}%, time {:.4g}%.\n\n", 100.0 * v.tolerances.memory,
                   100.0 * v.tolerances.time);
  if (v.within_tolerance) s += "Every figure is within tolerance.\n";
  for (const auto* section : {&v.memory, &v.time, &v.comm})
    for (const auto& f : *section)
      if (!f.within) s += "- " + outside_line(f) + "\n";
  return s;
}

}  // namespace

void add_run_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("run", "plan, run the executor for real, and compare predicted with measured memory");
  struct Options {
    PlanFlags plan;
    planner::RunOptions run;
    std::optional<double> lr, weight_decay, clip;
    std::string out = "peftplan-run";
    std::string hostfile, hosts, mpi_args;
    std::string calibration;
    double tolerance_memory = 0.02, tolerance_time = 0.15;
  };
  auto o = std::make_shared<Options>();
  // The executor's defaults: its own profile, fp32 compute, eager attention, one rank.
  o->plan.model = "tiny-llama-4l";
  o->plan.profile = "executor";
  o->plan.precision = "fp32";
  o->plan.attention = "eager";
  o->plan.seq_len = 128;
  o->plan.gpus = 1;
  add_plan_flags(cmd, o->plan);
  cmd->add_option("--data", o->run.data, "token file to train on")->required();
  cmd->add_option("--data-format", o->run.data_format, "u32, u16 (little-endian) or bytes (every byte a token)")
      ->capture_default_str();
  cmd->add_option("--steps", o->run.steps, "optimizer steps")->capture_default_str();
  cmd->add_option("--lr", o->lr, "learning rate (default 1e-4, or the ds_config's)");
  cmd->add_option("--weight-decay", o->weight_decay, "AdamW decoupled weight decay (default 0)");
  cmd->add_option("--clip", o->clip, "gradient clipping by global norm (0 = off)");
  cmd->add_option("--seed", o->run.seed, "seed of the weight and adapter init and dropout")->capture_default_str();
  cmd->add_option("--weights", o->run.weights, "safetensors checkpoint with Hugging Face names (default: random init)");
  cmd->add_option("--adapter-init", o->run.adapter_init, "peft (A uniform, B zero) or a safetensors adapter with PEFT names")
      ->capture_default_str();
  cmd->add_option("--save-adapter", o->run.save_adapter, "folder for adapter_model.safetensors + adapter_config.json");
  cmd->add_option("--out", o->out, "folder for plan.json, measurement.json and trace.json")->capture_default_str();
  cmd->add_option("--checkpoint-every", o->run.checkpoint_every, "write a training checkpoint every K steps (0: never)")
      ->capture_default_str();
  cmd->add_option("--checkpoint-dir", o->run.checkpoint_dir, "folder for checkpoints (default: <out>/checkpoints)");
  cmd->add_option("--resume", o->run.resume, "continue from a checkpoint (a step-<k> folder or a checkpoint folder)");
  cmd->add_option("--hostfile", o->hostfile, "mpirun hostfile: run the ranks on several machines");
  cmd->add_option("--hosts", o->hosts, "mpirun --host list (a,b or a:4,b:4)");
  cmd->add_option("--mpi-args", o->mpi_args, "extra mpirun arguments, space-separated (e.g. \"--mca btl tcp,self\")");
  cmd->add_option("--calibration", o->calibration,
                  fmt::format("calibrated profile to plan with (default {}; made once when missing)", default_profile_path().string()));
  cmd->add_option("--tolerance-memory", o->tolerance_memory, "relative tolerance of memory and collective bytes")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--tolerance-time", o->tolerance_time, "relative tolerance of the time figures")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->callback([o, &exit_code] {
    ResolvedPlan r = resolve_plan_flags(o->plan);
    for (const auto& w : r.warnings) fmt::print(stderr, "warning: {}\n", w);
    planner::PlanFile pf;
    pf.input = r.input;
    if (o->lr) pf.input.training.lr = *o->lr;
    if (o->weight_decay) pf.input.training.weight_decay = *o->weight_decay;
    if (o->clip) pf.input.training.grad_clip = *o->clip;
    if (!o->plan.ds_config.empty()) {  // the scheduler rides in ds_config.json
      planner::DsConfigInputs di;
      di.world_size = pf.input.strategy.ranks;
      di.training = pf.input.training;
      di.hidden = pf.input.model.hidden;
      di.total_steps = o->run.steps;
      pf.extras = planner::read_ds_config(models::read_json_file(o->plan.ds_config), o->plan.ds_config, di).extras;
    }
    pf.model_source = planner::model_source_for(o->plan.model);
    pf.run = o->run;
    pf.run.data = absolute(pf.run.data);
    pf.run.weights = absolute(pf.run.weights);
    if (pf.run.adapter_init != "peft") pf.run.adapter_init = absolute(pf.run.adapter_init);
    pf.run.save_adapter = absolute(pf.run.save_adapter);
    if (pf.run.checkpoint_every > 0 && pf.run.checkpoint_dir.empty()) pf.run.checkpoint_dir = (fs::path(o->out) / "checkpoints").string();
    pf.run.checkpoint_dir = absolute(pf.run.checkpoint_dir);
    pf.run.resume = absolute(pf.run.resume);
    for (const auto& w : planner::validate(pf.input)) fmt::print(stderr, "warning: {}\n", w);
    const int N = pf.input.strategy.ranks;
    std::string profile = "--cluster";
    if (o->plan.cluster.empty()) {
      r.cluster = calibrated_cluster(o->calibration, N);
      profile = "calibrated profile";
    } else {
      fmt::print("cluster: {} (--cluster)\n", r.cluster.name);
    }
    planner::PlanOptions po;
    po.explain = false;
    const planner::Plan plan = planner::make_plan(pf.input, r.cluster, po);
    const fs::path out = fs::absolute(o->out);
    fs::create_directories(out);
    const fs::path plan_path = out / "plan.json";
    planner::write_plan_file(plan_path, pf);
    fmt::print("wrote {}\n", plan_path.string());
    std::vector<std::string> args;
    if (N > 1 || !o->hostfile.empty() || !o->hosts.empty()) {
      // mpirun ($PEFTPLAN_MPIRUN or Open MPI's mpirun on the PATH); on one machine more ranks
      // than cores are allowed (--oversubscribe), and root may run it.
      const char* mpirun = std::getenv("PEFTPLAN_MPIRUN");
      args = {mpirun && *mpirun ? mpirun : "mpirun", "-np", std::to_string(N)};
      // Ranks are not bound to cores: each rank runs cores/ranks OpenMP threads (peftplan-exec),
      // the way calibrate measured them.
      if (o->hostfile.empty() && o->hosts.empty()) args.insert(args.end(), {"--oversubscribe", "--bind-to", "none"});
      if (!o->hostfile.empty()) args.insert(args.end(), {"--hostfile", absolute(o->hostfile)});
      if (!o->hosts.empty()) args.insert(args.end(), {"--host", o->hosts});
      if (::geteuid() == 0) args.push_back("--allow-run-as-root");
      std::istringstream extra(o->mpi_args);
      for (std::string a; extra >> a;) args.push_back(a);
    }
    args.insert(args.end(), {find_exec().string(), plan_path.string(), "--out", out.string()});
    const int code = run_child(args);
    if (code != 0) {
      fmt::print(stderr, "peftplan run: peftplan-exec exited with code {}\n", code);
      exit_code = code == 2 ? 2 : 3;
      return;
    }
    auto m = models::read_json_file((out / "measurement.json").string());
    if (fs::is_regular_file(out / "trace.json")) m["trace"] = models::read_json_file((out / "trace.json").string());
    planner::Tolerances tol;
    tol.memory = o->tolerance_memory;
    tol.time = o->tolerance_time;
    const planner::Validation v = planner::validate(plan, m, tol);
    fmt::print("{}", tables(v, false));
    fmt::print("peak at: {} (measured), {} (predicted)\n", m.at("memory").at("device").at("peak_op").get<std::string>(),
               planner::plan_to_json(plan).at("memory").at("device").at("peak_op").get<std::string>());
    fmt::print("step time: median of the {} step(s) after the first (the first includes warm-up); op times from the {}\n",
               v.steps > 1 ? v.steps - 1 : 1, v.op_time_source);
    if (v.most_different) fmt::print("op that differs most: {}\n", describe(*v.most_different));
    bool exact = true;
    for (const auto& f : v.memory)
      if (f.name.rfind("host_", 0) != 0 && f.predicted != f.measured) exact = false;  // device categories and the peak
    bool same = true;
    for (const auto& f : v.comm) same = same && f.predicted == f.measured;
    if (N > 1) fmt::print("{}\n", same ? "measured collective bytes equal the prediction exactly" : "measured collective bytes differ from the prediction");
    const auto& t = m.at("time");
    fmt::print("step {:.3f} s, {:.0f} tokens/s, {:.2f} GFLOP/s, {:.0f}% of the step in GEMMs\n", t.at("step_s").get<double>(),
               t.at("tokens_per_s").get<double>(), t.at("achieved_flops_per_s").get<double>() / 1e9,
               100.0 * t.at("gemm_fraction").get<double>());
    fmt::print("{}\n", exact ? "measured memory equals the prediction exactly" : "measured memory differs from the prediction");
    nlohmann::json vj = planner::validation_to_json(v);
    write_atomic(out / "validation.json", vj.dump(1) + "\n");
    sim::TraceOptions to;
    to.ranks = N;
    to.pid_base = 1000;  // the measured trace.json uses pid 0
    write_atomic(out / "trace.predicted.json", sim::chrome_trace(plan.program, *plan.time, to).dump() + "\n");
    write_atomic(out / "report.md", report(plan, v, profile));
    fmt::print("wrote {}, {}, {}, {}, {}\n", (out / "measurement.json").string(), (out / "trace.json").string(),
               (out / "validation.json").string(), (out / "trace.predicted.json").string(), (out / "report.md").string());
    std::fflush(stdout);  // the table first, then the verdict lines on stderr
    for (const auto* section : {&v.memory, &v.time, &v.comm})
      for (const auto& f : *section)
        if (!f.within) fmt::print(stderr, "{}\n", outside_line(f));
    if (!v.within_tolerance) {
      fmt::print(stderr, "peftplan run: {} figure(s) outside tolerance\n", v.outside.size());
      exit_code = 1;
    }
  });
}

}  // namespace peftplan::cli
