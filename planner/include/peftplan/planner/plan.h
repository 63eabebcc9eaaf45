// A plan: the step program of one configuration, its memory walk, its simulated timeline on a
// cluster, and the verdict ("fits" or "does not fit", with reasons). "Does not fit" is a result,
// not an error. Pure functions; fast enough for a GUI and for searches over thousands of plans.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "peftplan/planner/knobs.h"
#include "peftplan/planner/lifecycle.h"
#include "peftplan/planner/program.h"
#include "peftplan/sim/cluster.h"
#include "peftplan/sim/memory.h"
#include "peftplan/sim/timeline.h"

namespace peftplan::planner {

struct Plan {
  PlanInput input;
  sim::Cluster cluster;
  ProgramFacts facts;
  sim::Program program;
  sim::MemoryProfile memory;               // memory.device_peak_bytes: the allocated peak
  // Device memory in the three kinds users measure (README, "Memory kinds"): allocated (the
  // categories, torch.cuda.max_memory_allocated), reserved (the caching allocator's segments,
  // max_memory_reserved) and used (reserved plus what lives outside the allocator: nvidia-smi).
  std::uint64_t reserved_peak_bytes = 0;
  std::uint64_t outside_allocator_bytes = 0;  // CUDA context and libraries (runtime rule)
  std::uint64_t used_peak_bytes = 0;
  bool allocator_oom = false;              // the allocator model ran out of the GPU's memory
  std::string_view runtime_versions;       // what the runtime profile models
  double headroom_fraction = 0.0;          // the verdict's margin, a share of the GPU's memory
  std::optional<LifecyclePeaks> lifecycle; // loading and saving (the hf profile's stack)
  std::optional<sim::Timeline> time;       // absent when simulate_time is false
  std::uint64_t device_capacity_bytes = 0; // one GPU's memory
  std::uint64_t host_capacity_bytes = 0;   // host RAM per rank (node RAM / GPUs per node)
  bool fits = false;
  std::vector<std::string> reasons;        // why it does not fit
  std::vector<Suggestion> suggestions;     // what would make it fit (knobs.h), when it does not
  std::vector<std::string> explanation;    // what the strategy changed against DDP, and why
  std::vector<std::string> warnings;       // input oddities (not errors)
};

// The verdict's default margin: 5% of the GPU's memory kept free beyond the predicted `used`
// peak, for what a plan does not see (other processes, allocator behaviour outside the steady
// step). One default for every command that gives a verdict (--headroom).
inline constexpr double kDefaultHeadroomFraction = 0.05;

struct PlanOptions {
  bool simulate_time = true;
  double headroom_fraction = kDefaultHeadroomFraction;
  bool explain = true;   // builds a DDP reference plan to explain the strategy's effect
  bool names = true;     // buffer names (peak_op, traces); off for searches
  // A search's yes-or-no question: when the allocated peak alone, with what lives outside the
  // allocator and the headroom, is more than the GPU holds, the plan cannot fit whatever the
  // caching allocator reserves on top, so its replay is skipped and `reserved` is reported as the
  // allocated peak (a lower bound). Off everywhere a plan's numbers are shown.
  bool skip_replay_when_allocated_overflows = false;
};

// What shrinks a category that does not fit (strategy.stage zero3, shards the frozen base; or
// peft.quantization nf4): the verdict's and the recommender's suggestions, alternatives in order.
std::vector<Suggestion> fit_suggestions(sim::MemCategory category, const PlanInput& input);

// The n largest device categories at the peak, "base_weights 64.2 GiB, activations 9.1 GiB".
std::string largest_categories(const std::array<std::uint64_t, sim::kNumCategories>& at_peak, int n = 2);

Plan make_plan(const PlanInput& input, const sim::Cluster& cluster, const PlanOptions& options = {});

// The verdict's margin in bytes (headroom_fraction of the GPU's memory), and the device bytes left
// beyond the used peak and that margin (negative: short by that much): the one statement of
// "fits" that the verdict, the recommender and the explorer read.
std::uint64_t headroom_bytes(const Plan& plan);
std::int64_t spare_bytes(const Plan& plan);

// The input a plan on `cluster` is built from: the GPU's compute capability filled in when the
// input leaves it 0 (what make_plan builds; a MicroBatchSeries for make_plan_with starts here).
PlanInput input_on(const PlanInput& input, const sim::Cluster& cluster);

// make_plan over a program already built for input_on(input, cluster) with options.names (a
// MicroBatchSeries' program at input.training.micro_batch): the same walk, replay, timeline and
// verdict. The program ends up in Plan::program.
Plan make_plan_with(const PlanInput& input, BuiltProgram built, const sim::Cluster& cluster, const PlanOptions& options = {});

// `plan --json`: memory.device.<category>_bytes, memory.device.peak_bytes, memory.device.peak_op,
// memory.host.*, time.*, comm.<collective>_bytes, fits, reasons.
nlohmann::json plan_to_json(const Plan& plan);

// The columns of `peftplan sweep` (CSV and JSON lines) after the grid's own: leaves of plan
// --json, each named by its key. The one list the sweep writes and `report --sweep` reads.
struct SweepColumn {
  std::string name;               // "base_weights_bytes", "step_s"
  std::vector<std::string> path;  // into plan --json: {"memory", "device", "base_weights_bytes"}
};
const std::vector<SweepColumn>& sweep_columns();

// Chrome trace counter events of the memory timeline (`plan --memory-trace`).
nlohmann::json memory_trace(const Plan& plan);

}  // namespace peftplan::planner
