// Runs the peftplan binary (PEFTPLAN_CLI, set by tests/CMakeLists.txt) with arguments and
// returns its exit code and its stdout and stderr together. For the end-to-end CLI tests.
#pragma once

#include <array>
#include <cstdio>
#include <string>
#include <sys/wait.h>

namespace peftplan::testing {

struct CliResult {
  int code = 0;
  std::string out;  // stdout and stderr together
};

// `env`: "NAME=value ..." put before the command (the shell's environment prefix).
inline CliResult run_cli(const std::string& args, const std::string& env = "") {
  const std::string cmd = (env.empty() ? "" : env + " ") + std::string(PEFTPLAN_CLI) + " " + args + " 2>&1";
  CliResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return {-1, "popen failed: " + cmd};
  std::array<char, 4096> buf{};
  while (std::fgets(buf.data(), static_cast<int>(buf.size()), p)) r.out += buf.data();
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace peftplan::testing
