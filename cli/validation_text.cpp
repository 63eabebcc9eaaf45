// Predicted-versus-measured as text (see validation_text.h).
#include "validation_text.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace peftplan::cli {
namespace {

// The spread of a time figure as the console shows it: "±0.412 ms" (IQR), "-" without one.
std::string spread_cell(const planner::Figure& f) {
  if (!f.has_spread) return "-";
  return fmt::format("{:.3f} ms", f.spread * 1e3);
}

// The spread beside the error, in the terms the figure is judged: relative to the figure for
// step_s, as a share of the predicted step for its parts.
std::string spread_pct(const planner::Figure& f, double predicted_step_s) {
  if (!f.has_spread) return "-";
  const double base = f.name == "step_s" ? f.measured : predicted_step_s;
  return base > 0.0 ? fmt::format("{:.1f}%", 100.0 * f.spread / base) : "-";
}

const char* mark(const planner::Figure& f) {
  switch (f.verdict()) {
    case planner::Verdict::within: return "";
    case planner::Verdict::outside: return "OUTSIDE";
    case planner::Verdict::inconclusive: return "inconclusive";
  }
  return "";
}

std::string figure_line(const planner::Figure& f) {
  const bool time = f.section == "time";
  std::string s = fmt::format("{}: predicted {:.6g}, measured {:.6g} ({}, tolerance {:.4g}%", f.key(), f.predicted, f.measured,
                              pct(f.relative_error), 100.0 * f.tolerance);
  if (time && f.has_spread) s += fmt::format(", spread {:.3f} ms", f.spread * 1e3);
  if (f.error_at_run_speed) s += fmt::format(", {} at the run's speed", pct(*f.error_at_run_speed));
  return s + ")";
}

}  // namespace

std::string pct(double rel) { return std::isfinite(rel) ? fmt::format("{:+.2f}%", 100.0 * rel) : "n/a"; }

std::string mib(std::uint64_t b) { return fmt::format("{:.3f} MiB", static_cast<double>(b) / (1024.0 * 1024.0)); }

std::string validation_tables(const planner::Validation& v, bool markdown) {
  std::string s;
  auto head = [&](const std::string& what, const std::string& unit, bool spread) {
    if (markdown)
      s += spread ? fmt::format("| {} | predicted{} | measured{} | abs. error | rel. error | spread | spread % | |\n"
                                "|---|--:|--:|--:|--:|--:|--:|---|\n", what, unit, unit)
                  : fmt::format("| {} | predicted{} | measured{} | abs. error | rel. error | |\n|---|--:|--:|--:|--:|---|\n", what, unit, unit);
    else if (spread)
      s += fmt::format("\n{:<24} {:>14} {:>14} {:>14} {:>9} {:>11} {:>7}\n", what, "predicted", "measured", "abs. error", "rel.", "spread",
                       "spr. %");
    else
      s += fmt::format("\n{:<24} {:>14} {:>14} {:>14} {:>9}\n", what, "predicted", "measured", "abs. error", "rel.");
  };
  auto row = [&](const planner::Figure& f, const std::string& p, const std::string& m, const std::string& d) {
    if (markdown) s += fmt::format("| {} | {} | {} | {} | {} | {} |\n", f.name, p, m, d, pct(f.relative_error), mark(f));
    else s += fmt::format("{:<24} {:>14} {:>14} {:>14} {:>9} {}\n", f.name, p, m, d, pct(f.relative_error), mark(f));
  };
  const std::string mem_head = v.memory.empty() || v.memory.front().rank == 0 ? "memory" : "memory (worst rank)";
  if (!v.memory.empty()) {
    head(mem_head, markdown ? " (MiB)" : "", false);
    for (const auto& f : v.memory)
      if (f.predicted != 0.0 || f.measured != 0.0 || f.name == "peak")
        row(f, mib(static_cast<std::uint64_t>(f.predicted)), mib(static_cast<std::uint64_t>(f.measured)),
            fmt::format("{:+.0f} B", f.measured - f.predicted));
    if (markdown) s += "\n";
  }
  const planner::Figure* step = nullptr;
  for (const auto& f : v.time)
    if (f.name == "step_s") step = &f;
  const double predicted_step = step ? step->predicted : 0.0;
  head(v.rounds > 1 ? fmt::format("time per step ({} rounds)", v.rounds) : "time per step", markdown ? " (ms)" : "", true);
  for (const auto& f : v.time) {
    const std::string p = fmt::format("{:.3f} ms", f.predicted * 1e3), m = fmt::format("{:.3f} ms", f.measured * 1e3),
                      d = fmt::format("{:+.3f} ms", (f.measured - f.predicted) * 1e3);
    if (markdown)
      s += fmt::format("| {} | {} | {} | {} | {} | {} | {} | {} |\n", f.name, p, m, d, pct(f.relative_error), spread_cell(f),
                       spread_pct(f, predicted_step), mark(f));
    else
      s += fmt::format("{:<24} {:>14} {:>14} {:>14} {:>9} {:>11} {:>7} {}\n", f.name, p, m, d, pct(f.relative_error), spread_cell(f),
                       spread_pct(f, predicted_step), mark(f));
  }
  if (!v.throughput.empty()) {
    if (markdown) s += "\n";
    head("throughput", markdown ? " (tokens/s)" : "", false);
    for (const auto& f : v.throughput)
      row(f, fmt::format("{:.1f}", f.predicted), fmt::format("{:.1f}", f.measured), fmt::format("{:+.1f}", f.measured - f.predicted));
  }
  if (!v.comm.empty()) {
    if (markdown) s += "\n";
    head("bytes per step", markdown ? " (B)" : "", false);
    for (const auto& f : v.comm)
      row(f, fmt::format("{:.0f}", f.predicted), fmt::format("{:.0f}", f.measured), fmt::format("{:+.0f}", f.measured - f.predicted));
  }
  return s;
}

std::string speed_line(const planner::Validation& v) {
  if (!v.speed_drift) return {};
  const std::string over = v.job_probe    ? fmt::format(" (the median of the job's {} probes, every strategy's rounds)", v.probes)
                           : v.probes > 1 ? fmt::format(" (the median of {} rounds' probes)", v.probes)
                                          : "";
  return fmt::format("machine speed: the reference step ran {:.2f} GFLOP/s per rank{}, {} than the {:.2f} of calibration ({}); a time figure is "
                     "conclusive when its spread is within the tolerance and its verdict is the same at this speed as at calibration's (a miss also "
                     "needs its spread plus this drift within the tolerance)\n",
                     v.probe_flops_per_s / 1e9, over, *v.speed_drift >= 0.0 ? "faster" : "slower", v.calibration_probe_flops_per_s / 1e9,
                     pct(*v.speed_drift));
}

std::string load_line(const planner::Validation& v) {
  if (!v.others_cpu_share) return {};
  std::string s = fmt::format("host load: other work took {:.1f}% of the host's CPUs during the run", 100.0 * *v.others_cpu_share);
  if (v.calibration_others_cpu_share && v.load_change)
    s += fmt::format(", {:.1f}% during calibration ({:+.1f} points)", 100.0 * *v.calibration_others_cpu_share, 100.0 * *v.load_change);
  else
    s += " (the profile does not say how busy the machine was when it was calibrated)";
  return s + "\n";
}

namespace {
std::string unsure_reason(const planner::Figure& f, const planner::Validation& v) {
  using U = planner::Figure::Unsure;
  switch (f.unsure) {
    case U::speed_decides:
      return fmt::format("{} the tolerance at calibration's speed, {} at the run's: the machine-speed drift decides", f.within ? "within" : "outside",
                         f.within ? "outside" : "within");
    case U::drift_wide:
      return fmt::format("outside at both speeds, but the spread plus the machine-speed drift ({}) is wider than the tolerance: a miss a wrong "
                         "probe could make",
                         v.speed_drift ? pct(*v.speed_drift) : std::string("n/a"));
    case U::load_changed:
      return fmt::format("outside, in the direction the change in the machine's other work explains ({} of the CPUs since calibration), and "
                         "the spread plus the speed drift plus that change is wider than the tolerance",
                         v.load_change ? fmt::format("{:+.1f} points", 100.0 * *v.load_change) : std::string("n/a"));
    case U::spread:
    case U::no: break;
  }
  return "spread wider than the tolerance";
}
}  // namespace

std::string verdict_lines(const planner::Validation& v) {
  std::string s;
  for (const auto* section : {&v.memory, &v.time, &v.comm, &v.throughput})
    for (const auto& f : *section) {
      if (f.verdict() == planner::Verdict::outside) s += "outside tolerance: " + figure_line(f) + "\n";
      else if (f.verdict() == planner::Verdict::inconclusive)
        s += fmt::format("inconclusive ({}): {}\n", unsure_reason(f, v), figure_line(f));
    }
  return s;
}

namespace {
// How many steps the steady step is chosen from (planner::steady_samples): the last
// kSteadyWindow after the first.
std::int64_t steady_window(std::int64_t steps) {
  return std::clamp<std::int64_t>(steps - 1, 1, static_cast<std::int64_t>(planner::kSteadyWindow));
}
}  // namespace

std::string validation_notes(const planner::Validation& v) {
  std::string s;
  if (v.op_time_source.rfind("totals", 0) == 0)
    s += fmt::format("time: {}; spread = the interquartile range of its steps after warm-up ({} step(s) recorded)\n", v.op_time_source,
                     v.steps);
  else if (v.rounds > 1)
    s += fmt::format("time: the median of {} rounds, each round's step the fastest of its {} step(s) after the first (noise on a "
                     "shared machine only adds time); spread = the interquartile range of the rounds (spr. %: of the measured step "
                     "for step_s, of the predicted step for its parts); op times from round {}'s {}\n",
                     v.rounds, steady_window(v.steps), v.op_round + 1, v.op_time_source);
  else
    s += fmt::format("time: step_s is the fastest of the {} step(s) after the first (the first includes warm-up; noise on a shared "
                     "machine only adds time), its spread their interquartile range; op times from the {}\n",
                     steady_window(v.steps), v.op_time_source);
  if (v.most_different) s += "op that differs most: " + planner::describe(*v.most_different) + "\n";
  if (v.sync_wait_s)
    s += fmt::format("ranks waited {:.3f} ms per step inside collectives for the last rank to arrive (sync_wait_s; predicted from the "
                     "calibrated skew per call; comm_s counts each collective's transfer)\n",
                     *v.sync_wait_s * 1e3);
  s += speed_line(v);
  s += load_line(v);
  for (const auto& n : v.notes) s += "note: " + n + "\n";
  return s;
}

std::string verdict_summary(const planner::Validation& v) {
  if (!v.outside.empty()) {
    std::string s = "outside:";
    for (const auto& k : v.outside) s += " " + k;
    return s;
  }
  if (!v.inconclusive.empty()) {
    std::string s = "within; inconclusive:";
    for (const auto& k : v.inconclusive) s += " " + k;
    return s;
  }
  return "within tolerance";
}

std::string validation_report(const planner::Plan& plan, const planner::Validation& v, const std::string& profile) {
  const auto& in = plan.input;
  const auto& t = in.training;
  std::string s = "# peftplan: predicted versus measured\n\n## Configuration\n\n";
  s += fmt::format("- model: {}\n- strategy: {}, {} rank(s)\n- micro-batch {}, sequence {}, gradient accumulation {}\n"
                   "- cluster: {} ({})\n- measured: {} round(s) of {} step(s) (step time: median of the steps after the first{})\n\n",
                   in.model.name, planner::name_of(in.strategy.stage), in.strategy.ranks, t.micro_batch, t.seq_len, t.grad_accum,
                   plan.cluster.name, profile, v.rounds, v.steps, v.rounds > 1 ? "; then the median of the rounds" : "");
  s += "## Figures\n\n" + validation_tables(v, true);
  s += "\nSpread: the interquartile range of the rounds (of the steps with one round). A time figure whose spread is wider than "
       "the tolerance is inconclusive: the machine was too noisy to tell a hit from a miss. So is one whose verdict changes when "
       "the prediction is taken at the run's speed (the speed probe's drift since calibration) instead of calibration's, and a miss "
       "whose spread plus that drift is wider than the tolerance (a probe that far out could make it), and a miss in the direction a "
       "change in the machine's other work since calibration explains, when the spread plus the drift plus that change is wider.\n";
  if (v.speed_drift) s += fmt::format("\n{}", speed_line(v));
  if (v.others_cpu_share) s += fmt::format("\n{}", load_line(v));
  s += fmt::format("\n## Op by op\n\nMeasured op times from round {}'s {}.\n\n", v.op_round + 1, v.op_time_source);
  if (v.most_different) s += "Differs most: " + planner::describe(*v.most_different) + "\n\n";
  if (v.sync_wait_s)
    s += fmt::format("Ranks waited {:.3f} ms per step inside collectives for the last rank to arrive (sync_wait_s).\n\n",
                     *v.sync_wait_s * 1e3);
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
  if (v.within_tolerance && v.inconclusive.empty()) s += "Every figure is within tolerance.\n";
  else if (v.within_tolerance) s += "Every conclusive figure is within tolerance.\n";
  const std::string lines = verdict_lines(v);
  std::size_t start = 0;
  while (start < lines.size()) {
    const std::size_t end = lines.find('\n', start);
    s += "- " + lines.substr(start, end - start) + "\n";
    start = end + 1;
  }
  for (const auto& n : v.notes) s += "- note: " + n + "\n";
  return s;
}

}  // namespace peftplan::cli
