// run_report and read_run (see run_report.h).
#include "run_report.h"

#include <fmt/format.h>

#include "commands.h"
#include "peftplan/common/error.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/plan_file.h"

namespace peftplan::cli {

namespace fs = std::filesystem;

reports::ReportInput run_report(const std::vector<MeasuredStrategy>& runs, const std::string& machine, const std::string& profile,
                                int rounds, const planner::Tolerances& tol) {
  reports::ReportInput ri;
  const auto& first = runs.front().plan;
  ri.title = fmt::format("peftplan run: {}, {} rank(s), {} strateg{}", first.input.model.name, first.input.strategy.ranks, runs.size(),
                         runs.size() == 1 ? "y" : "ies");
  ri.provenance.version = reports::version_string();
  ri.provenance.command = command_line();
  ri.provenance.inputs = {{"model", first.input.model.name},
                          {"machine", machine},
                          {"cluster profile", profile},
                          {"rounds", fmt::format("{} per strategy, interleaved; times are their median", rounds)},
                          {"tolerances", fmt::format("memory {:.4g}%, time {:.4g}%", 100.0 * tol.memory, 100.0 * tol.time)}};
  for (const auto& r : runs) {
    reports::StrategyColumn c = reports::plan_column(r.strategy, "--strategy " + r.strategy, r.plan);
    c.validation = r.validation;
    c.measured_on = machine;
    const fs::path trace = measured_trace_path(r.dir, r.validation);
    if (!r.dir.empty() && fs::is_regular_file(trace))
      c.measured_steps = reports::measured_timeline(models::read_json_file(trace.string()), trace.string(),
                                                    fmt::format("round {}", r.validation.op_round + 1));
    ri.strategies.push_back(std::move(c));
  }
  ri.base_label = fmt::format("{} (the first strategy run)", runs.front().strategy);
  ri.knobs = reports::knob_deltas(first);
  ri.no_recommendation = "No recommendation: peftplan run measures the strategies it was given (peftplan recommend searches).";
  return ri;
}

fs::path measured_trace_path(const fs::path& dir, const planner::Validation& v) {
  return v.op_round <= 0 ? dir / "trace.json" : dir / "rounds" / std::to_string(v.op_round + 1) / "trace.json";
}

std::vector<MeasuredStrategy> read_run(const fs::path& path, std::string& machine) {
  const std::vector<fs::path> dirs = planner::run_folders(path);
  std::vector<MeasuredStrategy> out;
  for (const auto& d : dirs) {
    const planner::PlanFile pf = planner::read_plan_file(d / "plan.json");
    if (!pf.cluster) throw input_error((d / "plan.json").string(), "cluster", "is missing: the plan cannot be remade without its cluster");
    planner::PlanOptions po;
    po.explain = false;
    MeasuredStrategy m{std::string(planner::name_of(pf.input.strategy.stage)), planner::make_plan(pf.input, *pf.cluster, po),
                       planner::validation_from_json(models::read_json_file((d / "validation.json").string()), (d / "validation.json").string()), d};
    if (fs::is_regular_file(d / "measurement.json") && machine.empty()) {
      const auto meas = models::read_json_file((d / "measurement.json").string());
      machine = fmt::format("{} ({} rank(s))", meas.value("backend", std::string("the executor")), meas.value("ranks", 0));
    }
    out.push_back(std::move(m));
  }
  if (machine.empty()) machine = "the machine the run measured";
  return out;
}

}  // namespace peftplan::cli
