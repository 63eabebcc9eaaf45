// A plan: the step program of one configuration, its memory walk, its simulated timeline on a
// cluster, and the verdict ("fits" or "does not fit", with reasons). "Does not fit" is a result,
// not an error. Pure functions; fast enough for a GUI and for searches over thousands of plans.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

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
  sim::MemoryProfile memory;
  std::optional<sim::Timeline> time;       // absent when simulate_time is false
  std::uint64_t device_capacity_bytes = 0; // one GPU's memory
  std::uint64_t host_capacity_bytes = 0;   // host RAM per rank (node RAM / GPUs per node)
  bool fits = false;
  std::vector<std::string> reasons;        // why it does not fit, with suggestions
  std::vector<std::string> explanation;    // what the strategy changed against DDP, and why
  std::vector<std::string> warnings;       // input oddities (not errors)
};

struct PlanOptions {
  bool simulate_time = true;
  bool explain = true;   // builds a DDP reference plan to explain the strategy's effect
  bool names = true;     // buffer names (peak_op, traces); off for searches
};

Plan make_plan(const PlanInput& input, const sim::Cluster& cluster, const PlanOptions& options = {});

// `plan --json`: memory.device.<category>_bytes, memory.device.peak_bytes, memory.device.peak_op,
// memory.host.*, time.*, comm.<collective>_bytes, fits, reasons.
nlohmann::json plan_to_json(const Plan& plan);

// Chrome trace counter events of the memory timeline (`plan --memory-trace`).
nlohmann::json memory_trace(const Plan& plan);

}  // namespace peftplan::planner
