// `peftplan calibrate`: measure this machine and write a cluster profile the simulator uses.
// It launches the executor under mpirun (`mpirun -np N peftplan-exec calibrate --out FILE`; one
// rank alone, without mpirun), which measures GEMMs, memory bandwidth and collectives, prints
// nccl-tests-like tables and writes the profile; this command then reads the profile back
// through sim to check it.
// It never links MPI: the executor binary does the MPI work in its own processes.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "child_process.h"
#include "commands.h"
#include "plan_flags.h"
#include "peftplan/common/error.h"
#include "peftplan/sim/cluster.h"
#include "peftplan/sim/collectives.h"

#ifndef PEFTPLAN_MPIEXEC
#define PEFTPLAN_MPIEXEC "mpirun"
#endif

namespace peftplan::cli {

namespace fs = std::filesystem;

void add_calibrate_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand(
      "calibrate", "measure this machine (GEMM, memory bandwidth, MPI collectives) and write a "
                   "cluster profile");
  cmd->footer("example: peftplan calibrate --ranks 2 --quick --out profile.json");
  struct Options {
    int ranks = static_cast<int>(std::max(2u, std::thread::hardware_concurrency()));
    std::string out;
    bool quick = false;
    int rounds = 5;
    int attempts = 3;  // executor::kCalibrationAttempts (the CLI does not link the executor)
    std::string mpirun = PEFTPLAN_MPIEXEC;
  };
  auto o = std::make_shared<Options>();
  cmd->add_option("--ranks", o->ranks, "ranks to calibrate (collectives over 2..N); default: CPUs")
      ->capture_default_str();
  cmd->add_option("--out", o->out, fmt::format("profile to write (default {})",
                                               default_profile_path().string()))
      ->check(kNonEmpty);
  cmd->add_flag("--quick", o->quick, "fewer shapes, sizes and repetitions (seconds)");
  cmd->add_option("--rounds", o->rounds, "interleaved rounds of the calibration step programs (each program keeps its median round, as a run does)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  cmd->add_option("--attempts", o->attempts,
                  "calibrations at most while the machine is noisy: measured again while the step programs' rounds spread by a "
                  "median of more than 5%; the quietest is kept")
      ->capture_default_str()
      ->check(CLI::Range(1, 10));
  cmd->add_option("--mpirun", o->mpirun, "the MPI launcher")->capture_default_str();
  cmd->callback([o, &exit_code] {
    if (o->ranks < 1)
      throw input_error("--ranks", "", "must be a positive integer (one rank measures no collectives)",
                        std::to_string(o->ranks));
    const fs::path out = o->out.empty() ? default_profile_path() : fs::path(o->out);
    if (out.has_parent_path()) fs::create_directories(out.parent_path());
    // Unbound ranks, as `peftplan run` starts them: Open MPI binds up to two ranks to one core
    // each by default, which would calibrate one rank with one core while it trains with all.
    // One rank starts alone, as `peftplan run` starts one: no launcher, so it also calibrates
    // where peftplan-exec was built without MPI.
    std::vector<std::string> args = o->ranks > 1 ? local_mpirun(o->mpirun, o->ranks) : std::vector<std::string>{};
    args.insert(args.end(), {find_exec().string(), "calibrate", "--out", out.string()});
    if (o->quick) args.push_back("--quick");
    args.insert(args.end(), {"--rounds", std::to_string(o->rounds), "--attempts", std::to_string(o->attempts)});
    std::string line;
    for (const auto& a : args) line += (line.empty() ? "" : " ") + a;
    fmt::print("$ {}\n", line);
    const int code = run_child(args);
    if (code != 0)
      throw std::runtime_error(fmt::format("peftplan calibrate: {} exited with code {}", args.front(), code));
    const sim::Cluster c = sim::read_cluster_file(out);
    const auto mib = sim::collective_cost(sim::Collective::all_reduce, 1ULL << 20,
                                          std::min(2, sim::total_gpus(c)), c);
    fmt::print("profile {}: {} ranks of {} ({:.1f} GFLOP/s fp32, {:.1f} GB/s memory), link "
               "{:.2f} GB/s + {:.1f} us/step; 1 MiB all_reduce over 2 ranks: {:.0f} us predicted\n",
               c.name, c.gpus_per_node, c.gpu.name, c.gpu.fp32_flops_per_s / 1e9,
               c.gpu.hbm_bytes_per_s / 1e9, c.intra_node_link.bandwidth_bytes_per_s / 1e9,
               c.intra_node_link.latency_s / 1e-6, mib.time_s / 1e-6);
    fmt::print("use it with: --cluster {}\n", out.string());
    exit_code = 0;
  });
}

}  // namespace peftplan::cli
