// Starting peftplan-exec and mpirun (see child_process.h).
#include "child_process.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include "peftplan/common/error.h"
#include "peftplan/models/config.h"

namespace peftplan::cli {

namespace fs = std::filesystem;

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
  throw InputError(fmt::format("peftplan: peftplan-exec not found at {} or {}; build the peftplan-exec target "
                               "(it needs MPI) or set PEFTPLAN_EXEC",
                               (dir / ".." / "executor" / "peftplan-exec").lexically_normal().string(),
                               (dir / "peftplan-exec").string()));
}

int run_child(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("peftplan: fork failed");
  if (pid == 0) {
    ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "peftplan: cannot run %s\n", argv[0]);
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) throw std::runtime_error("peftplan: waitpid failed");
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::vector<std::string> local_mpirun(const std::string& mpirun, int ranks) {
  std::vector<std::string> args = {mpirun, "-np", std::to_string(ranks), "--oversubscribe", "--bind-to", "none"};
  if (::geteuid() == 0) args.push_back("--allow-run-as-root");
  return args;
}

SpeedProbe run_speed_probe(int ranks) {
  char dir_template[] = "/tmp/peftplan-probe.XXXXXX";
  const char* dir = ::mkdtemp(dir_template);
  if (dir == nullptr) throw std::runtime_error("peftplan: cannot make a temporary folder for the speed probe");
  const fs::path out = fs::path(dir) / "probe.json";
  const char* mpirun = std::getenv("PEFTPLAN_MPIRUN");
  std::vector<std::string> args = ranks > 1 ? local_mpirun(mpirun && *mpirun ? mpirun : "mpirun", ranks) : std::vector<std::string>{};
  args.insert(args.end(), {find_exec().string(), "probe", "--out", out.string()});
  const int code = run_child(args);
  SpeedProbe probe;
  if (code == 0) {
    const nlohmann::json j = models::read_json_file(out.string());
    probe.flops_per_s = j.at("flops_per_s").get<double>();
    if (const auto it = j.find("others_cpu_share"); it != j.end() && it->is_number()) probe.others_cpu_share = it->get<double>();
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
  if (code != 0) throw std::runtime_error(fmt::format("peftplan: peftplan-exec probe exited with code {}", code));
  return probe;
}

std::string profile_stem() {
  // A profile describes one backend's speed: the GPU's is kept apart from the CPU's.
  const char* env = std::getenv("PEFTPLAN_BACKEND");
  const std::string_view backend = env ? env : "";
  if (backend.empty() || backend == "cpu") return "calibration";
  // A backend's name, never a path: letters and digits only (peftplan-exec refuses unknown names).
  if (!std::all_of(backend.begin(), backend.end(), [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) != 0; }))
    throw input_error("PEFTPLAN_BACKEND", "", "must name a backend (cpu, cuda): letters and digits", std::string(backend));
  return fmt::format("calibration.{}", backend);
}

fs::path default_profile_path() {
  const std::string name = profile_stem() + ".json";
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) return fs::path(xdg) / "peftplan" / name;
  if (const char* home = std::getenv("HOME"); home && *home) return fs::path(home) / ".cache" / "peftplan" / name;
  return fs::path(name);
}

}  // namespace peftplan::cli
