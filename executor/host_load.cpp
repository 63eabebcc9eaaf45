#include "peftplan/executor/host_load.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdint>
#include <fstream>
#include <functional>
#include <string>

#include "peftplan/executor/communicator.h"

namespace peftplan::executor {

std::optional<CpuTicks> parse_proc_stat(std::string_view text) {
  if (text.rfind("cpu ", 0) != 0) return std::nullopt;
  const std::string_view line = text.substr(0, text.find('\n'));
  std::array<double, 8> f{};
  std::size_t pos = 3, n = 0;
  while (n < f.size()) {
    pos = line.find_first_not_of(' ', pos);
    if (pos == std::string_view::npos) break;
    std::uint64_t v = 0;
    const auto [end, ec] = std::from_chars(line.data() + pos, line.data() + line.size(), v);
    if (ec != std::errc()) return std::nullopt;
    f[n++] = static_cast<double>(v);
    pos = static_cast<std::size_t>(end - line.data());
  }
  if (n < f.size()) return std::nullopt;
  // user nice system idle iowait irq softirq steal
  CpuTicks t;
  t.busy = f[0] + f[1] + f[2] + f[5] + f[6];
  t.steal = f[7];
  for (double x : f) t.total += x;
  return t;
}

std::optional<double> others_share(const CpuTicks& before, const CpuTicks& after, double own_cpu_s, double ticks_per_s) {
  const double total = after.total - before.total;
  if (!(total >= kMinTicks) || !(ticks_per_s > 0.0)) return std::nullopt;
  const double others = (after.busy - before.busy) + (after.steal - before.steal) - own_cpu_s * ticks_per_s;
  return std::clamp(others / total, 0.0, 1.0);
}

namespace {

std::optional<CpuTicks> read_host() {
  std::ifstream f("/proc/stat");
  if (!f) return std::nullopt;
  std::string line;
  std::getline(f, line);
  return parse_proc_stat(line);
}

double own_cpu_s() {
  rusage u{};
  if (::getrusage(RUSAGE_SELF, &u) != 0) return 0.0;
  const auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec); };
  return s(u.ru_utime) + s(u.ru_stime);
}

std::int64_t host_id() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return static_cast<std::int64_t>(std::hash<std::string>{}(host) >> 1);
}

}  // namespace

void HostLoad::begin(Communicator* /*world*/) {
  host_ = read_host();
  own_cpu_s_ = own_cpu_s();
  began_ = std::chrono::steady_clock::now();
}

double HostLoad::min_window_s() {
  const long ticks = ::sysconf(_SC_CLK_TCK), cpus = ::sysconf(_SC_NPROCESSORS_ONLN);
  return ticks > 0 && cpus > 0 ? kMinTicks / static_cast<double>(ticks * cpus) : 0.0;
}

double HostLoad::seconds_since_begin() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - began_).count(); }

std::optional<double> HostLoad::end(Communicator* world) {
  const std::optional<CpuTicks> now = read_host();
  double own = own_cpu_s() - own_cpu_s_;
  std::int32_t ok = host_ && now ? 1 : 0;
  if (world && world->size() > 1) {
    // One host for every rank, /proc/stat read on every rank, the job's CPU time summed.
    std::array<std::int64_t, 2> id{host_id(), -host_id()};
    world->all_reduce(id.data(), id.data(), 2, CommDType::int64, ReduceOp::min);
    world->all_reduce(&ok, &ok, 1, CommDType::int32, ReduceOp::min);
    world->all_reduce(&own, &own, 1, CommDType::fp64, ReduceOp::sum);
    if (id[0] != -id[1]) ok = 0;
  }
  if (!ok) return std::nullopt;
  std::optional<double> share = others_share(*host_, *now, own, static_cast<double>(::sysconf(_SC_CLK_TCK)));
  if (world && world->size() > 1) {  // the same figure on every rank (they read the host moments apart)
    double s = share.value_or(-1.0);
    world->all_reduce(&s, &s, 1, CommDType::fp64, ReduceOp::max);
    share = s >= 0.0 ? std::optional<double>(s) : std::nullopt;
  }
  return share;
}

}  // namespace peftplan::executor
