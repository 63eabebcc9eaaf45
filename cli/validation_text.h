// How `peftplan run` and `peftplan compare` show a validation: the predicted-versus-measured
// tables (memory, time with each figure's spread and verdict, collective bytes), the lines under
// them, report.md, and the verdict lines. Text only: it decides nothing (planner/validate.h does)
// and writes no file.
#pragma once

#include <string>

#include "peftplan/planner/plan.h"
#include "peftplan/planner/validate.h"

namespace peftplan::cli {

// "+1.23%", or "n/a" when not finite.
std::string pct(double rel);
std::string mib(std::uint64_t bytes);

// The tables, as aligned text (the console) or Markdown (report.md).
std::string validation_tables(const planner::Validation& v, bool markdown);

// One line per figure outside tolerance and per inconclusive one (the console's stderr).
std::string verdict_lines(const planner::Validation& v);

// The lines under the tables: where the op times come from, the op that differs most, how the
// spread was measured, the arrival wait.
std::string validation_notes(const planner::Validation& v);

// "machine speed: ..." — the run's speed probe against calibration's — or nothing without one.
std::string speed_line(const planner::Validation& v);
// "host load: other work took X% of the host's CPUs during the run, Y% during calibration ..."
// (planner::Validation::others_cpu_share, load_change); empty when the run's share is unknown.
std::string load_line(const planner::Validation& v);

// "within tolerance", "outside: time.step_s" or "inconclusive: time.step_s" (summary tables).
std::string verdict_summary(const planner::Validation& v);

// report.md: configuration, figures, op by op, verdict. `profile` says which cluster profile
// the prediction used.
std::string validation_report(const planner::Plan& plan, const planner::Validation& v, const std::string& profile);

}  // namespace peftplan::cli
