// peftplan-exec: the executor, one process per rank under mpirun (or alone for one rank). Each
// mode is a CLI11 subcommand whose work lives in the executor library; main() only starts the job
// (executor::WorldRuntime: MPI where the build has it, one rank where it does not), parses, and
// maps failures to exit codes (2 bad input, 3 internal or MPI error), ending the whole job with
// MPI_Abort when one rank fails so that no peer waits in a collective forever.
//   mpirun -np N peftplan-exec calibrate --out FILE [--quick] [--rounds R] [--attempts A] [--backend B]
//   mpirun -np N peftplan-exec probe --out FILE [--window S] [--backend B]   (the machine-speed probe; calibrate.h)
//   mpirun -np N peftplan-exec PLAN.json [--out DIR] [--quiet] [--backend B]   (N = the plan's ranks; see executor/runner.h)
//   mpirun -np N peftplan-exec PLAN.json... [--rounds R] [--quiet]   (several plans and rounds, interleaved: run_rounds)
// --backend names the Backend the ranks compute on (backend.h backend_names: "cpu", and "cuda" in
// a CUDA build); its default is $PEFTPLAN_BACKEND when set, else "cpu".
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "peftplan/common/atomic_file.h"
#include "peftplan/common/error.h"
#include "peftplan/common/paths.h"
#include "peftplan/common/schemas.h"
#include "peftplan/executor/backend.h"
#include "peftplan/executor/calibrate.h"
#include "peftplan/executor/communicator.h"
#include "peftplan/executor/host_load.h"
#include "peftplan/executor/plan_file.h"
#include "peftplan/executor/runner.h"
#include "peftplan/planner/validate.h"

namespace {

using namespace peftplan;

// The backend a run computes on, refused as bad input (exit 2) when this build or machine has
// no such backend, with the reason (backend.h backend_unavailable).
std::string checked_backend(const std::string& name) {
  if (const std::string why = executor::backend_unavailable(name); !why.empty())
    throw InputError(fmt::format("--backend {}: {}", name, why));
  return name;
}

// Whether two ranks of `world` compute on one physical device (Backend::device_identity, all
// gathered): NCCL refuses them ("Duplicate GPU detected").
bool ranks_share_a_device(executor::Communicator& world, const executor::Backend& be) {
  constexpr std::size_t kId = 320;  // a host name (255 at most) and a PCI bus id
  std::array<char, kId> mine{};
  const std::string id = be.device_identity();
  std::copy_n(id.begin(), std::min(id.size(), kId - 1), mine.begin());
  std::vector<char> all(kId * static_cast<std::size_t>(world.size()));
  world.all_gather(mine.data(), all.data(), kId, executor::CommDType::uint8);
  std::set<std::string> seen;
  for (int r = 0; r < world.size(); ++r) seen.insert(std::string(all.data() + static_cast<std::size_t>(r) * kId));
  return seen.size() < static_cast<std::size_t>(world.size());
}

// The job's communicator for a backend: the world (MPI's, or one rank's) on the CPU backend. On a
// device backend: the NCCL communicator over the job's ranks, bootstrapped over the world and
// ordered after the backend's stream, where this build and machine have it and every rank has a
// device of its own; MPI's collectives through host staging where ranks share a device (two ranks
// on one GPU) or there is no NCCL; one rank without NCCL copies with the backend
// (Backend::copy_device), never touching device buffers from the host.
std::unique_ptr<executor::Communicator> world_for(const executor::WorldRuntime& job, executor::Backend* be) {
  if (be == nullptr || be->device_is_host()) return job.make_world_communicator();
  const bool have_nccl = executor::nccl_communicator_unavailable().empty();
  if (job.size() == 1 && !have_nccl)
    return executor::make_self_communicator([be](void* dst, const void* src, std::uint64_t n) { be->copy_device(dst, src, n); });
  std::unique_ptr<executor::Communicator> world = job.make_world_communicator();
  if (job.size() > 1 && (!have_nccl || ranks_share_a_device(*world, *be)))
    return executor::make_staging_communicator(std::move(world), *be);
  return executor::make_nccl_communicator(std::move(world), be->native_stream());
}

void calibrate(const executor::WorldRuntime& job, const std::string& out, bool quick, int rounds, int attempts,
               const std::string& backend) {
  // The CPU backend is made inside run_calibration, after it sets the ranks' OpenMP threads.
  std::unique_ptr<executor::Backend> device = backend == "cpu" ? nullptr : executor::make_backend(backend);
  auto world = world_for(job, device.get());
  const bool root = world->rank() == 0;
  // Retaken while the machine is noisy (calibrate.h, kCalibrationAttempts); rank 0 judges, every
  // rank follows its decision.
  const double noisy = planner::calibration_noise_limit();
  executor::Calibration cal;
  double quietest = std::numeric_limits<double>::infinity();
  for (int attempt = 1; attempt <= attempts; ++attempt) {
    executor::Calibration c =
        executor::run_calibration(*world, {.quick = quick, .rounds = rounds, .threads_chosen = std::getenv("OMP_NUM_THREADS") != nullptr,
                                           .backend = backend, .backend_instance = device.get()},
                                  root ? stdout : nullptr);
    double noise = root ? executor::calibration_noise(c) : 0.0;
    world->all_reduce(&noise, &noise, 1, executor::CommDType::fp64, executor::ReduceOp::max);
    if (noise < quietest) {
      quietest = noise;
      cal = std::move(c);
    }
    if (noise <= noisy) break;
    if (root)
      fmt::print("calibration attempt {} of {}: noise {:.1f}% (more than {:.0f}%: the step programs' median spread, the probe's move "
                 "or other work's share of the CPUs, whichever is largest): the machine is noisy{}\n",
                 attempt, attempts, 100.0 * noise, 100.0 * noisy,
                 attempt < attempts ? "; measuring again" : "; keeping the quietest attempt");
  }
  if (!root) return;
  const sim::Cluster profile = executor::make_profile(cal);
  std::fputs(executor::format_report(cal, profile).c_str(), stdout);
  executor::write_profile(profile, cal, out);
  fmt::print("\nwrote {} (cluster profile \"{}\") and {}\n", out, profile.name,
             executor::measurements_path(out).string());
  std::fflush(stdout);
}

int threads_per_rank();

// The machine-speed probe with every rank of the job at once, as calibrate and runs take it;
// rank 0 writes {"schema": "peftplan.speed-probe/1", "flops_per_s": x, "ranks": N, "window_s": w,
// "others_cpu_share": s} (the share other work took of the host's CPUs meanwhile, host_load.h;
// null when unknown).
void probe(const executor::WorldRuntime& job, const std::string& out, double window_s, const std::string& backend_name) {
  auto backend = executor::make_backend(backend_name, threads_per_rank());  // the OpenMP threads a run's rank has
  auto world = world_for(job, backend.get());
  executor::Communicator* comm = world->size() > 1 ? world.get() : nullptr;
  executor::HostLoad load;
  load.begin(comm);
  const double rate = executor::speed_probe(*backend, comm, window_s);
  // The share needs the host's time to count kMinTicks (the probe's steps are fewer than its
  // window when the warm-up step is slow): the ranks go on with the same program until it has,
  // every rank as long as the slowest needs (rank 0 decides).
  const double need_s = 1.1 * executor::HostLoad::min_window_s();  // a tick's phase: 10% more
  for (;;) {
    double left = need_s - load.seconds_since_begin();
    if (comm) comm->broadcast(&left, &left, 1, executor::CommDType::fp64, 0);
    if (left <= 0.0) break;
    executor::speed_probe(*backend, comm, left);
  }
  const std::optional<double> others = load.end(comm);
  if (world->rank() != 0) return;
  const nlohmann::json j = {{"schema", schemas::kSpeedProbe}, {"flops_per_s", rate}, {"ranks", world->size()},
                            {"window_s", window_s}, {"others_cpu_share", others ? nlohmann::json(*others) : nlohmann::json()}};
  write_text_atomic(out, j.dump(1) + "\n");
}

// OpenMP threads for this rank: OMP_NUM_THREADS when set; otherwise the machine's cores shared
// among the job's ranks on this node (Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE), at least one, as
// calibrate measures. OpenMP's default of every core per rank oversubscribes the machine as soon
// as two ranks share it, and its spinning barriers then stretch every step several-fold.
int threads_per_rank() {
  if (std::getenv("OMP_NUM_THREADS") != nullptr) return 0;  // OpenMP reads it
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const int ranks = local != nullptr ? std::max(1, std::atoi(local)) : 1;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / ranks);
}

// The session's options from the environment, read here once (runner.h SessionOptions).
executor::SessionOptions session_options_from_env() {
  executor::SessionOptions o;
  if (const char* w = std::getenv("PEFTPLAN_WATCHDOG_S"); w && *w) {
    char* end = nullptr;
    const double s = std::strtod(w, &end);
    if (end == w || *end != '\0' || !(s > 0.0))
      throw InputError(fmt::format("PEFTPLAN_WATCHDOG_S={}: must be a positive number of seconds", w));
    o.watchdog_s = s;
  }
  if (const char* f = std::getenv("PEFTPLAN_FAULT"); f && *f) {
    long long fr = -1, fs = -1, fo = -1;
    int used = 0;
    const bool parsed = std::sscanf(f, "%lld:%lld:%lld%n", &fr, &fs, &fo, &used) == 3;
    const std::string_view rest = parsed ? std::string_view(f).substr(static_cast<std::size_t>(used)) : std::string_view();
    if (!parsed || fr < 0 || fs < 0 || fo < 0 || (!rest.empty() && rest != ":stall"))
      throw InputError(fmt::format("PEFTPLAN_FAULT={}: must be RANK:STEP:OP or RANK:STEP:OP:stall (three non-negative integers)", f));
    o.fault = executor::SessionOptions::Fault{static_cast<std::int32_t>(fr), fs, static_cast<std::size_t>(fo), rest == ":stall"};
  }
  return o;
}

// Runs plan.json files on every rank of the job (executor::run_rounds): measurement.json and
// trace.json go to each plan's folder (or out_dir: one plan, one round), written by rank 0 with
// every rank's measurement inside.
// What a failure prints on this rank's stderr, and the exit code it ends with (one rule for main
// and run_plan_files). A non-finite step stops every rank at the same op (the norm is
// all-reduced), so rank 0 alone says it.
int report_failure(const std::exception& e, int rank) {
  if (dynamic_cast<const executor::NonFiniteError*>(&e)) {
    if (rank == 0) fmt::print(stderr, "peftplan-exec: {}\n", e.what());
    return 1;
  }
  const bool input = dynamic_cast<const InputError*>(&e) != nullptr;
  const bool comm = dynamic_cast<const executor::CommError*>(&e) != nullptr;
  fmt::print(stderr, "peftplan-exec: rank {}: {}: {}\n", rank, input || comm ? "error" : "internal error", e.what());
  std::fflush(stderr);
  return input ? 2 : 3;
}

void run_plan_files(const std::vector<std::string>& plan_paths, const std::string& out_dir, int rounds, bool quiet,
                    const std::string& backend_name, const executor::WorldRuntime& job) {
  auto backend = executor::make_backend(backend_name, threads_per_rank());
  auto world = world_for(job, backend.get());
  std::FILE* progress = world->rank() == 0 && !quiet ? stdout : nullptr;
  try {
    executor::run_rounds({plan_paths.begin(), plan_paths.end()}, rounds, *backend, progress, world.get(), session_options_from_env(),
                         out_dir);
  } catch (const executor::NonFiniteError&) {
    throw;  // every rank stops at the same op: nothing is left in flight
  } catch (const std::exception& e) {
    if (world->size() == 1) throw;
    // A collective this rank issued may still be in flight, one a peer never joins (the
    // watchdog's error is exactly that), and the communicator's destructor would wait for it
    // forever: the job ends here, while the communicator still exists.
    job.abort(report_failure(e, world->rank()));
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Each rank's communication thread sits inside blocking MPI calls while the rank computes
  // (runner.h). Open MPI's progress loop spins there unless told to yield, and on a host whose
  // ranks fill the cores the spinning thread takes the core from its own rank's compute thread:
  // ZeRO-3's all-gathers, issued while the layers compute, then stretched the steps by -4% to
  // +26% from run to run. With mpi_yield_when_idle the waiting thread gives the core back
  // (opal_progress calls sched_yield when nothing progressed; Open MPI's mpi_yield_when_idle MCA
  // parameter). Set before MPI_Init so every launcher's ranks get it; a user's own value wins.
  ::setenv("OMPI_MCA_mpi_yield_when_idle", "1", /*overwrite=*/0);
  std::unique_ptr<executor::WorldRuntime> job;
  try {
    job = std::make_unique<executor::WorldRuntime>(&argc, &argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "peftplan-exec: cannot start the job: {}\n", e.what());
    return 3;
  }
  CLI::App app{"peftplan-exec: the peftplan executor (one process per rank: under mpirun, or alone for one rank)"};
  app.require_subcommand(0, 1);
  std::vector<std::string> plan_paths;
  std::string run_out;
  app.add_option("plans", plan_paths, "plan.json written by `peftplan run` (runs its steps); several: run in turn, each into its folder");
  app.add_option("--out", run_out, "folder for measurement.json and trace.json (default: the plan's; one plan and one round only)");
  int run_rounds = 1;
  app.add_option("--rounds", run_rounds, "rounds of every plan, interleaved; round k > 1 into <plan folder>/rounds/<k>/")
      ->check(CLI::Range(1, 1000));
  bool quiet = false;
  app.add_flag("--quiet", quiet, "no progress lines (errors still go to stderr)");
  const char* backend_env = std::getenv("PEFTPLAN_BACKEND");
  std::string backend = backend_env != nullptr && *backend_env ? backend_env : "cpu";
  const auto add_backend = [&](CLI::App* to) {
    to->add_option("--backend", backend, fmt::format("the backend the ranks compute on ({}; default: $PEFTPLAN_BACKEND, else cpu)",
                                                     fmt::join(executor::backend_names(), ", ")))
        ->capture_default_str();
  };
  add_backend(&app);
  std::string out;
  bool quick = false;
  auto* cal = app.add_subcommand("calibrate", "measure this host and write a cluster profile");
  cal->add_option("--out", out, "cluster profile to write (JSON)")->required();
  cal->add_flag("--quick", quick, "fewer shapes, sizes and repetitions");
  int rounds = 5;
  cal->add_option("--rounds", rounds, "interleaved rounds of the calibration step programs")->check(CLI::Range(1, 100));
  int attempts = executor::kCalibrationAttempts;
  cal->add_option("--attempts", attempts, "calibrations at most while the machine is noisy (the quietest is kept)")->check(CLI::Range(1, 10));
  add_backend(cal);
  cal->callback([&] { calibrate(*job, out, quick, rounds, attempts, checked_backend(backend)); });
  std::string probe_out;
  auto* prb = app.add_subcommand("probe", "measure the machine's speed as calibrate does (GEMM FLOP/s per rank, every rank at once)");
  prb->add_option("--out", probe_out, "JSON file to write")->required();
  double probe_window = executor::kLongProbeWindowS;
  prb->add_option("--window", probe_window, "seconds to run the GEMM mix")->capture_default_str()->check(CLI::Range(0.01, 60.0));
  add_backend(prb);
  prb->callback([&] { probe(*job, probe_out, probe_window, checked_backend(backend)); });
  int code = 0;
  try {
    app.parse(argc, argv);
    if (app.get_subcommands().empty()) {
      if (plan_paths.empty()) throw InputError("give a plan.json to run, or a mode (calibrate); see --help");
      run_plan_files(plan_paths, run_out, run_rounds, quiet, checked_backend(backend), *job);
    }
  } catch (const CLI::ParseError& e) {
    code = job->rank() == 0 ? app.exit(e) : e.get_exit_code();  // rank 0 prints
    if (code != 0) code = 2;
  } catch (const executor::NonFiniteError& e) {
    code = report_failure(e, job->rank());  // no peer waits: exit 1
  } catch (const InputError& e) {
    code = report_failure(e, job->rank());
    if (job->size() > 1) job->abort(code);  // peers may wait in a collective: end the job
  } catch (const std::exception& e) {
    job->abort(report_failure(e, job->rank()));
  }
  return code;
}
