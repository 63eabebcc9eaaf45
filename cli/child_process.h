// What `peftplan run` and `peftplan calibrate` share to start the executor: where peftplan-exec
// is, running a child process with this process's output streams, and where the calibrated
// profile lives by default.
#pragma once

#include <filesystem>
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

// $XDG_CACHE_HOME/peftplan/calibration.json, else ~/.cache/peftplan/calibration.json.
std::filesystem::path default_profile_path();

}  // namespace peftplan::cli
