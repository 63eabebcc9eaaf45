#pragma once
// Other work's share of this host's CPUs while the executor measured something: the CPU time
// that neither the job's ranks nor an idle CPU account for (other processes, and on a virtual
// machine the time the hypervisor gave other guests — "steal"), over the CPU time the host had.
//
// Why: a shared machine's other work moves collective waits far more than it moves compute. Two
// background loops at nice 19 on the 2-core development VM (2026-12-05) left the speed probe
// where it was (66.1 against 65.3 GFLOP/s per rank) — they only run while the ranks block — yet
// the calibration taken beside them put the default job's ZeRO-3 comm_s at 13.9 ms and
// sync_wait_s at 7.8 ms where the same job measured 8.4 and 4.0 ms on the quiet machine (a
// conclusive miss); /proc/stat had them at 16.7% of the CPUs, an idle machine at 0%.
// Calibration records the share it was measured at and every run round its own, so validation
// can tell when the machine's other work moved (planner::Validation::load_change) and
// `peftplan run` can replace a cached profile made beside other work once the machine is quieter.
//
// Source: proc(5), /proc/stat: the first line sums every CPU's time in USER_HZ ticks as user,
// nice, system, idle, iowait, irq, softirq, steal, guest, guest_nice (guest time is already in
// user, guest_nice in nice). Busy = user + nice + system + irq + softirq; the host's CPU time is
// the first eight summed; the ranks' own is getrusage(RUSAGE_SELF) (every thread of a rank).
#include <chrono>
#include <optional>
#include <string_view>

namespace peftplan::executor {

class Communicator;

// The first line of /proc/stat, in ticks. nullopt when `text` has no "cpu " line with at least
// the eight fields.
struct CpuTicks {
  double busy = 0.0;   // user + nice + system + irq + softirq
  double steal = 0.0;
  double total = 0.0;  // the eight fields summed: every CPU's time
};
std::optional<CpuTicks> parse_proc_stat(std::string_view text);

// Other work's share from two readings of the host and the job's own CPU seconds between them:
// (busy + steal - own) / total, clamped to [0, 1]; nullopt when the host's time between them is
// under kMinTicks: a share is read to one tick of the host's time, and the verdicts and
// `peftplan run` weigh it in points of the CPUs (against a 15% tolerance and a 5-point bound),
// so it is kept when one tick is at most a point — 100 ticks, one CPU-second at Linux's USER_HZ
// of 100 (a run of a few short steps is not judged by it).
inline constexpr double kMinTicks = 100.0;
std::optional<double> others_share(const CpuTicks& before, const CpuTicks& after, double own_cpu_s, double ticks_per_s);

// Measures others_share over an interval on every rank of `world` at once (this process alone
// when null): begin() and end() are collective calls. The share is the host's when all ranks run
// on one host (the CPU executor's mpirun); nullopt when they do not, or when /proc/stat cannot be
// read (not Linux).
class HostLoad {
 public:
  void begin(Communicator* world);
  std::optional<double> end(Communicator* world);
  // Seconds since begin() the host needs to count kMinTicks (its CPUs tick together): a
  // measurement shorter than this reads no share. 0 off Linux.
  static double min_window_s();
  double seconds_since_begin() const;

 private:
  std::optional<CpuTicks> host_;
  double own_cpu_s_ = 0.0;
  std::chrono::steady_clock::time_point began_{};
};

}  // namespace peftplan::executor
