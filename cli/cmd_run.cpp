// `peftplan run`: plan and run. Predicts the configuration's memory with the executor profile,
// writes <out>/plan.json atomically (planner/plan_file.h), launches the executor on it
// (peftplan-exec PLAN.json --out <out>: directly for one rank, under `mpirun -np N` for several,
// with --hostfile/--hosts and --mpi-args passed through to mpirun), streams its progress lines
// (step, loss, tokens/s), and prints predicted vs measured memory per category and collective
// bytes per step from <out>/measurement.json.
// It never links the executor: peftplan-exec does the work in its own process.
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "commands.h"
#include "peftplan/common/error.h"
#include "peftplan/common/units.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/plan_file.h"
#include "peftplan/sim/memory.h"
#include "plan_flags.h"

namespace peftplan::cli {
namespace {

namespace fs = std::filesystem;

// $PEFTPLAN_EXEC, else the build layout (build/<preset>/cli/peftplan ->
// build/<preset>/executor/peftplan-exec), else beside this binary (an installed bin/).
fs::path find_exec() {
  if (const char* env = std::getenv("PEFTPLAN_EXEC"); env && *env) {
    if (!fs::is_regular_file(env)) throw input_error("PEFTPLAN_EXEC", "", "must name the peftplan-exec binary", env);
    return env;
  }
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  const fs::path dir = ec ? fs::current_path() : self.parent_path();
  for (const fs::path& p : {dir / ".." / "executor" / "peftplan-exec", dir / "peftplan-exec"})
    if (fs::is_regular_file(p)) return fs::weakly_canonical(p);
  throw InputError(fmt::format("peftplan run: peftplan-exec not found at {} or {}; build the peftplan-exec target "
                               "(it needs MPI) or set PEFTPLAN_EXEC",
                               (dir / ".." / "executor" / "peftplan-exec").lexically_normal().string(), (dir / "peftplan-exec").string()));
}

// Runs argv with this process's stdout/stderr (the child's lines stream through); its exit code.
int run_child(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("peftplan run: fork failed");
  if (pid == 0) {
    ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "peftplan run: cannot run %s\n", argv[0]);
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) throw std::runtime_error("peftplan run: waitpid failed");
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string absolute(const std::string& p) { return p.empty() ? p : fs::absolute(p).lexically_normal().string(); }

std::string mib(std::uint64_t b) { return fmt::format("{:.3f} MiB", static_cast<double>(b) / (1024.0 * 1024.0)); }

}  // namespace

void add_run_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("run", "plan, run the executor for real, and compare predicted with measured memory");
  struct Options {
    PlanFlags plan;
    planner::RunOptions run;
    std::optional<double> lr, weight_decay, clip;
    std::string out = "peftplan-run";
    std::string hostfile, hosts, mpi_args;
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
    const sim::MemoryProfile predicted = sim::walk_memory(planner::build_program(pf.input).program);
    const fs::path out = fs::absolute(o->out);
    fs::create_directories(out);
    const fs::path plan_path = out / "plan.json";
    planner::write_plan_file(plan_path, pf);
    fmt::print("wrote {}\n", plan_path.string());
    std::vector<std::string> args;
    const int N = pf.input.strategy.ranks;
    if (N > 1 || !o->hostfile.empty() || !o->hosts.empty()) {
      // mpirun ($PEFTPLAN_MPIRUN or Open MPI's mpirun on the PATH); on one machine more ranks
      // than cores are allowed (--oversubscribe), and root may run it.
      const char* mpirun = std::getenv("PEFTPLAN_MPIRUN");
      args = {mpirun && *mpirun ? mpirun : "mpirun", "-np", std::to_string(N)};
      if (o->hostfile.empty() && o->hosts.empty()) args.push_back("--oversubscribe");
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
    const auto m = models::read_json_file((out / "measurement.json").string());
    const auto& dev = m.at("memory").at("device");
    fmt::print("\n{:<20} {:>16} {:>16} {:>9}\n", "memory (device)", "predicted", "measured", "diff");
    bool exact = true;
    auto row = [&](const std::string& name, std::uint64_t p, std::uint64_t q) {
      const double diff = p == 0 ? (q == 0 ? 0.0 : 100.0) : 100.0 * (static_cast<double>(q) - static_cast<double>(p)) / static_cast<double>(p);
      exact = exact && p == q;
      fmt::print("{:<20} {:>16} {:>16} {:>8.2f}%\n", name, mib(p), mib(q), diff);
    };
    for (int c = 0; c < sim::kNumDeviceCategories; ++c) {
      const auto cc = static_cast<sim::MemCategory>(c);
      const std::uint64_t p = predicted.category_peak_bytes[static_cast<std::size_t>(c)];
      const std::uint64_t q = dev.at(std::string(sim::name_of(cc)) + "_bytes").get<std::uint64_t>();
      if (p != 0 || q != 0) row(std::string(sim::name_of(cc)), p, q);
    }
    row("peak", predicted.device_peak_bytes, dev.at("peak_bytes").get<std::uint64_t>());
    fmt::print("peak at: {}\n", dev.at("peak_op").get<std::string>());
    if (m.contains("collectives")) {
      bool same = true;
      fmt::print("\n{:<20} {:>16} {:>16}\n", "bytes per step", "predicted", "measured");
      for (const auto& [kind, c] : m.at("collectives").items()) {
        const auto p = c.at("predicted_bytes_per_step").get<std::uint64_t>(), q = c.at("bytes_per_step").get<std::uint64_t>();
        same = same && p == q;
        if (p != 0 || q != 0) fmt::print("{:<20} {:>16} {:>16}\n", kind, p, q);
      }
      if (N > 1) fmt::print("{}\n", same ? "measured collective bytes equal the prediction exactly"
                                         : "measured collective bytes differ from the prediction");
    }
    const auto& t = m.at("time");
    fmt::print("step {:.3f} s, {:.0f} tokens/s, {:.2f} GFLOP/s, {:.0f}% of the step in GEMMs\n", t.at("step_s").get<double>(),
               t.at("tokens_per_s").get<double>(), t.at("achieved_flops_per_s").get<double>() / 1e9,
               100.0 * t.at("gemm_fraction").get<double>());
    fmt::print("{}\n", exact ? "measured memory equals the prediction exactly" : "measured memory differs from the prediction");
    fmt::print("wrote {}, {}\n", (out / "measurement.json").string(), (out / "trace.json").string());
  });
}

}  // namespace peftplan::cli
