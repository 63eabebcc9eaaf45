// Comparison reports: the seed's memory chart for the user's own model and cluster, the
// recommendation and its reasons, per-category and per-collective tables, the step time split,
// and what moves when one knob changes — one self-contained report.html (inline SVG and CSS,
// nothing fetched) and a report.md with the charts as .svg files beside it. Every figure is
// labelled "predicted"; every number in a table cell carries its raw value and the plan --json
// field it comes from (data-field, data-value), so tests compare them field by field.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "peftplan/planner/plan.h"
#include "peftplan/planner/recommend.h"
#include "peftplan/planner/validate.h"
#include "peftplan/sim/program.h"

namespace peftplan::reports {

// The figures one column of a report shows, whatever it was made from: a plan (make_plan), a
// row of a `sweep` table, or a row of a `recommend --json`. Every renderer reads these, so a
// report looks the same from each source.
struct Figures {
  std::array<std::uint64_t, sim::kNumDeviceCategories> at_peak_bytes{};  // allocated at the peak, per category
  std::uint64_t allocated_peak_bytes = 0, reserved_peak_bytes = 0, used_peak_bytes = 0, outside_allocator_bytes = 0;
  std::uint64_t host_peak_bytes = 0;
  std::uint64_t capacity_bytes = 0;  // the GPU's memory
  double headroom_fraction = 0;      // kept free by the verdict
  bool fits = false;
  std::int32_t ranks = 1;
  struct Time {
    double step_s = 0, compute_s = 0, exposed_comm_s = 0, comm_s = 0, optimizer_s = 0, offload_s = 0;
    double tokens_per_s = 0, tokens_per_s_per_gpu = 0, mfu = 0;
    bool host_bound = false;
  };
  std::optional<Time> time;
  // Bytes per step per rank by collective kind and by link; absent where the source has no
  // breakdown (a recommend row carries only totals).
  struct Comm {
    std::array<std::uint64_t, sim::kNumCollectives> collective_bytes{};
    std::uint64_t intra_node_bytes = 0, inter_node_bytes = 0, device_to_host_bytes = 0, host_to_device_bytes = 0;
  };
  std::optional<Comm> comm;
};
Figures figures_of(const planner::Plan& p);

// One step drawn as bars on lanes (a stream, or the executor's ops): the predicted step of a
// plan (its simulated timeline) and a measured one (the executor's trace.json) go one above the
// other on one time axis.
struct TimelineBar {
  double start_s = 0, end_s = 0;  // from the start of the step
  std::string name;               // the op's label ("all_gather_params", "q_proj")
  sim::Phase phase = sim::Phase::forward;
  bool collective = false;
};
struct TimelineLane {
  std::string label;  // "predicted: compute stream", "measured on <machine>: executor ops"
  std::vector<TimelineBar> bars;
};
// The plan's simulated step, one lane per stream that runs an op (setup ops left out).
std::vector<TimelineLane> predicted_timeline(const planner::Plan& p);
// The measured step of an executor trace.json (its rank 0, "pid" 0: every op it timed in the
// last step, on one lane labelled "measured: <what>", what being short: "round 2"). Throws
// InputError naming `source` when it is not one.
std::vector<TimelineLane> measured_timeline(const nlohmann::json& trace, const std::string& source, const std::string& what);

struct StrategyColumn {
  std::string label;            // "zero3 + offload optimizer", "full FT ddp"
  std::string plan_args;        // the plan flags that make it from the report's inputs
  Figures figures;
  std::optional<planner::Plan> plan;  // when the column was planned here (not read from a table)
  // A measurement of the same plan (peftplan run): predicted against measured, figure by figure.
  std::optional<planner::Validation> validation;
  std::string measured_on;      // "AMD EPYC (cpu: 2 threads ..., 2 ranks)"
  std::vector<TimelineLane> measured_steps;  // the measured step's timeline, when there is one
  std::string note;             // a word under the column ("refused: ...", "#1 of the search")
};
// A column of a plan made here.
StrategyColumn plan_column(std::string label, std::string plan_args, planner::Plan plan);

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
  std::string no_knobs = "No knob deltas: the report was made without a plan to change.";  // shown when knobs is empty
  // A table of every column, one row each (a sweep's configurations, a search's rows); also
  // shown whenever there are more columns than the charts draw.
  bool list_every_column = false;
  std::string columns_are = "strategies";  // what the columns are, in words ("configurations of the sweep")
};

// The seed's strategy set for a plan input: full fine-tuning with DDP beside PEFT with DDP,
// ZeRO-1, ZeRO-2, ZeRO-3 and the offload variants (deepspeed and executor profiles), or DDP and
// FSDP's NO_SHARD, SHARD_GRAD_OP, FULL_SHARD and FULL_SHARD with CPUOffload (hf); the user's
// training settings throughout. Each planned with make_plan, under the profile that runs it
// (planner::profile_that_runs: pure-bf16 DDP under DeepSpeed is the Trainer's DDP, labelled
// "ddp (hf)"). A column the planner refuses for these settings (8-bit AdamW with an offload,
// Liger's loss under ZeRO-3 with an untied head) is left out, "label: reason" appended to `refused` when given; when every column is
// refused, the first refusal is thrown (it is the settings', not a strategy's).
std::vector<StrategyColumn> seed_strategies(const planner::PlanInput& input, const sim::Cluster& cluster, double headroom,
                                            std::vector<std::string>* refused = nullptr);

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
