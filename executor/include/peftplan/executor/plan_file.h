// The executor's side of plan.json: reading it (planner/plan_file.h does the parsing) and the
// data file it names, checked against what this executor can run. A thin layer so that
// peftplan-exec and tests load a job the same way.
#pragma once

#include <filesystem>

#include "peftplan/executor/data.h"
#include "peftplan/planner/plan_file.h"

namespace peftplan::executor {

// read_plan_file + check_executable (runner.h).
planner::PlanFile load_plan(const std::filesystem::path& path);
// The token file plan.run.data in plan.run.data_format, for the plan's vocabulary and sequence
// length (a relative path is relative to the working directory).
TokenData load_data(const planner::PlanFile& plan);

}  // namespace peftplan::executor
