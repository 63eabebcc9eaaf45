// What `peftplan run` and `peftplan calibrate` share to start the executor: where peftplan-exec
// is, running a child process with this process's output streams, and where the calibrated
// profile lives by default.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace peftplan::cli {

// $PEFTPLAN_EXEC, else the build layout (build/<preset>/cli/peftplan ->
// build/<preset>/executor/peftplan-exec), else beside this binary (an installed bin/).
// Throws InputError naming where it looked.
std::filesystem::path find_exec();

// Runs args[0] with args (searching PATH), its output streaming through this process's stdout
// and stderr; returns its exit code (128 + signal when it was killed).
int run_child(const std::vector<std::string>& args);

// `mpirun -np N --oversubscribe --bind-to none [--allow-run-as-root]`: N ranks on this machine
// as calibrate and run start them. Unbound, because each rank runs cores/N OpenMP threads
// (peftplan-exec) and Open MPI would bind up to two ranks to one core each; more ranks than cores
// allowed; root allowed (Open MPI refuses root without the flag).
std::vector<std::string> local_mpirun(const std::string& mpirun, int ranks);

// The machine-speed probe (executor/calibrate.h, speed_probe) with N ranks at once, through
// `peftplan-exec probe`: the reference step's FLOP/s per rank, and the share other work took of
// the host's CPUs meanwhile (executor/host_load.h; nullopt when unknown). Throws when the
// executor fails.
struct SpeedProbe {
  double flops_per_s = 0.0;
  std::optional<double> others_cpu_share;
};
SpeedProbe run_speed_probe(int ranks);

// $XDG_CACHE_HOME/peftplan/calibration.json, else ~/.cache/peftplan/calibration.json.
std::filesystem::path default_profile_path();
// "calibration", or "calibration.<backend>" when PEFTPLAN_BACKEND names a backend other than the
// CPU's (peftplan-exec runs on the backend that variable names; each backend has its profiles).
std::string profile_stem();

}  // namespace peftplan::cli
