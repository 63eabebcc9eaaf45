// The report of a validation run (peftplan run writes it; peftplan report --run DIR remakes it
// from the folder): every strategy's plan with its measurement beside it.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "peftplan/planner/plan.h"
#include "peftplan/planner/validate.h"
#include "peftplan/reports/report.h"

namespace peftplan::cli {

struct MeasuredStrategy {
  std::string strategy;
  planner::Plan plan;
  planner::Validation validation;
  std::filesystem::path dir;  // the strategy's folder: its trace.json (and rounds/<k>/trace.json) draw the measured step
};

// The executor's trace.json of the round whose op times the validation shows (round 1 in the
// strategy's folder, round k in rounds/<k>/).
std::filesystem::path measured_trace_path(const std::filesystem::path& dir, const planner::Validation& v);

reports::ReportInput run_report(const std::vector<MeasuredStrategy>& runs, const std::string& machine, const std::string& profile,
                                int rounds, const planner::Tolerances& tolerances);

// A run folder (one strategy's: plan.json and validation.json; several: a subfolder each, in
// summary.json's order) or a validation.json with its plan.json beside it, read back: each plan
// remade from its plan.json (the same prediction) and its validation.json. Throws InputError
// naming the file for anything missing or of another kind.
std::vector<MeasuredStrategy> read_run(const std::filesystem::path& path, std::string& machine);

}  // namespace peftplan::cli
