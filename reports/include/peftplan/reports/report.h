// Comparison reports: the seed's memory chart for the user's own model and cluster, the
// recommendation and its reasons, per-category and per-collective tables, the step time split,
// and what moves when one knob changes — one self-contained report.html (inline SVG and CSS,
// nothing fetched) and a report.md with the charts as .svg files beside it. Every figure is
// labelled "predicted"; every number in a table cell carries its raw value and the plan --json
// field it comes from (data-field, data-value), so tests compare them field by field.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "peftplan/planner/plan.h"
#include "peftplan/planner/recommend.h"
#include "peftplan/planner/validate.h"

namespace peftplan::reports {

struct StrategyColumn {
  std::string label;            // "zero3 + offload optimizer", "full FT ddp"
  std::string plan_args;        // the plan flags that make it from the report's inputs
  planner::Plan plan;
  // A measurement of the same plan (peftplan run): predicted against measured, figure by figure.
  std::optional<planner::Validation> validation;
  std::string measured_on;      // "AMD EPYC (cpu: 2 threads ..., 2 ranks)"
};

// "What moves if I change one knob": the base plan against one change.
struct KnobDelta {
  std::string knob;             // "micro-batch", "checkpointing", "offload", "stage"
  std::string change;           // "4 -> 8", "none -> full", "zero2 -> zero3"
  bool fits = false;
  std::int64_t used_delta_bytes = 0;
  double step_delta = 0;        // relative, +0.10 = 10% longer
  double tokens_delta = 0;      // relative
};

struct Provenance {
  std::string version;          // "peftplan 0.1.0 (git 33072d1)"
  std::string command;          // the command line that reproduces the report
  std::vector<std::pair<std::string, std::string>> inputs;  // model, adapter, training, cluster
  std::string label = "predicted";  // on every figure
};

struct ReportInput {
  std::string title;
  Provenance provenance;
  std::vector<StrategyColumn> strategies;
  std::string base_label;       // the user's own configuration (the knobs' base)
  std::vector<KnobDelta> knobs;
  std::optional<planner::Recommendation> recommendation;
  std::string no_recommendation = "No recommendation: the report was made without a search.";  // shown instead
  planner::KnobSpelling spell = planner::field_spelling;  // how suggestions name knobs (the CLI: flags)
};

// The seed's strategy set for a plan input: full fine-tuning with DDP beside PEFT with DDP,
// ZeRO-1, ZeRO-2, ZeRO-3 and the offload variants (deepspeed and executor profiles), or DDP and
// FSDP's NO_SHARD, SHARD_GRAD_OP, FULL_SHARD and FULL_SHARD with CPUOffload (hf); the user's
// training settings throughout. Each planned with make_plan.
std::vector<StrategyColumn> seed_strategies(const planner::PlanInput& input, const sim::Cluster& cluster, double headroom);

// The knob deltas of `base` (micro-batch ×2 and ÷2, checkpointing on/off, offload on/off, one
// stage up and down, where each exists).
std::vector<KnobDelta> knob_deltas(const planner::Plan& base);

std::string render_html(const ReportInput& r);
// report.md: the same sections as Markdown tables, the charts as ![...](memory.svg) beside it.
std::string render_markdown(const ReportInput& r);
std::string memory_chart_svg(const ReportInput& r);
std::string time_chart_svg(const ReportInput& r);

// Writes report.html, report.md, memory.svg and time.svg into `out` as a whole: into a temporary
// folder beside it, then renamed into place (an existing report folder is replaced). Throws
// InputError naming `out` when it cannot be written.
void write_report(const std::filesystem::path& out, const ReportInput& r);

// "peftplan 0.1.0 (git <revision>)": the version and the revision the binary was built from.
std::string version_string();

}  // namespace peftplan::reports
