// The recommender: a search over strategies, offload, activation checkpointing, micro-batch,
// gradient accumulation and GPU count, each candidate planned exactly as `plan` plans it
// (make_plan), ranked by an objective, with a reason in words for every row and for every
// strategy that lost. Pure functions over the planner; the CLI prints and writes files.
//
// How the search stays small: memory grows with the micro-batch (every activation, the logits
// and the backward temporaries scale with it), so for each family (runtime profile, strategy,
// offload) and each checkpointing choice and GPU count the largest micro-batch that fits is found
// by doubling and then bisecting on memory alone (no timeline), and only the micro-batches
// 1, 2, 4, ... up to it (and it) are then planned in full. The model inventory is built once and
// shared by every candidate (PlanInput::inventory). A long gradient accumulation (a global batch
// fixes it) is planned from three short ones (plan_candidate).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "peftplan/planner/plan.h"

namespace peftplan::planner {

enum class Objective { tokens_per_s, gpus, cost, memory };
std::string_view name_of(Objective o);  // "tokens-per-s", "gpus", "cost", "memory"
inline constexpr std::array kObjectives = {Objective::tokens_per_s, Objective::gpus, Objective::cost, Objective::memory};
static_assert(lists_every(kObjectives, Objective::memory));

// One activation-checkpointing choice: none, every k-th layer, or every layer.
struct CheckpointChoice {
  Checkpointing kind = Checkpointing::none;
  std::int64_t every = 1;  // k, for Checkpointing::every_k
  bool operator==(const CheckpointChoice&) const = default;
};
std::string name_of(const CheckpointChoice& c);  // "none", "every-4", "full"

struct SearchSpace {
  // Runtime profiles to plan on; each brings its own strategies (deepspeed and executor: ddp and
  // the ZeRO stages; hf: ddp and FSDP's sharding strategies, HYBRID_SHARD only across nodes).
  std::vector<RuntimeProfile> profiles;
  std::vector<Stage> stages;          // empty: every strategy the profiles plan
  bool offload = true;                // try optimizer and parameter offload where they exist
  std::vector<CheckpointChoice> checkpointing;  // empty: none, every-4, every-2 and full
  std::vector<std::int32_t> gpus;     // GPU counts; empty: the base input's ranks
  std::optional<std::int64_t> global_batch;  // sequences per optimizer step over all GPUs
  std::int64_t min_micro_batch = 1;
  std::int64_t max_micro_batch = 1024;  // the doubling stops here
  unsigned threads = 0;                 // 0: every core
  bool accumulation_series = true;      // plan_candidate's series for long accumulations (off: each in full)
};

struct Constraints {
  double headroom_fraction = kDefaultHeadroomFraction;
  std::optional<std::int32_t> max_gpus;
  std::optional<std::uint64_t> host_ram_bytes_per_node;  // overrides the cluster's
};

// One planned configuration, the numbers the table shows.
struct Candidate {
  PlanInput input;                  // inventory shared; the exact input to re-plan it
  std::string family;               // "zero3 + offload param", "fsdp-full-shard (hf)"
  bool fits = false;
  std::uint64_t allocated_peak_bytes = 0, reserved_peak_bytes = 0, used_peak_bytes = 0;
  std::int64_t spare_bytes = 0;     // capacity - headroom - used (negative: the shortfall)
  std::uint64_t host_peak_bytes = 0, host_capacity_bytes = 0;
  std::array<std::uint64_t, sim::kNumCategories> at_peak_bytes{};
  double step_s = 0, compute_s = 0, exposed_comm_s = 0, offload_s = 0, optimizer_s = 0, host_floor_s = 0;
  double device_step_s = 0;         // the device's own step; step_s is the larger of it and host_floor_s
  bool host_bound = false;
  double tokens_per_s = 0;          // the cluster's total
  double mfu = 0;
  std::optional<double> cost_per_mtok_usd;  // GPU-hours per million tokens x price
  std::uint64_t gathered_bytes = 0;          // all-gathered per step per rank
  std::uint64_t comm_bytes = 0;              // every collective's bytes per step per rank
  std::uint64_t inter_node_bytes = 0;
  std::uint64_t model_base_bytes = 0;  // the whole frozen base in its storage dtype
  DType base_dtype = DType::bf16;
  sim::MemCategory binding = sim::MemCategory::activations;  // the largest category at the peak
  bool pareto = false;              // no other fitting row is both smaller in use and faster
  std::string reason;
};

// A family that lost: it does not fit anywhere in the space, or its best row is dominated.
struct Rejection {
  std::string family;
  bool fits = false;           // false: does not fit; true: fits but ranks below the top row
  std::string reason;
  std::vector<Suggestion> suggestions;  // does not fit: what would shrink its binding category
  std::optional<Candidate> best;  // the best fitting row, or the one closest to fitting
};

// A configuration outside the search space worth knowing about (a quantised base, fewer
// nodes, a larger micro-batch), with its numbers.
struct Alternative {
  std::string what;
  Candidate candidate;
};

struct Recommendation {
  Objective objective = Objective::tokens_per_s;
  std::vector<Candidate> ranked;       // every fitting candidate, best first
  std::vector<Rejection> rejected;     // every family but the winner's
  std::vector<Alternative> alternatives;
  std::int64_t evaluated = 0;          // plans made (memory-only ones included)
  std::int64_t timed = 0;              // of them, with a simulated timeline
  std::int64_t fitting = 0;            // fitting candidates (ranked holds them all; a file read back, its top)
  std::string summary;                 // one line: the recommendation, or the smallest shortfall
  std::vector<Suggestion> suggestions; // nothing fits: what to try outside the search
  // What the search was of, for whoever reads it back (report): the model, the cluster, its
  // GPU's memory and the headroom the verdicts kept.
  std::string model, cluster;
  std::uint64_t capacity_bytes = 0;
  double headroom_fraction = 0;
};

// One candidate: `input` planned as make_plan plans it (names and the explanation off), its
// timeline simulated when `timed`. With a long gradient accumulation N (at least
// kAccumulationSeriesFrom micro-steps when timed, kAccumulationMemorySeriesFrom when not) the
// plan is not built N micro-steps long: a step's micro-steps after the first are the same ops,
// so the plans at 3, 4 and 5 (3 and 4 when not timed) give it. Every memory figure must be
// the same at each (the peak and the caching allocator's state do not grow with the
// accumulation), and every time and byte count per step must move by the same amount from one to
// the next (the increments agreeing to 1e-9 of the value, the simulator's rounding); then the
// figures at N are those at the last point plus that amount times the micro-steps between. Else,
// or with `accumulation_series` off, the plan at N is made in full. `plans`, when given, counts
// the plans made.
// Where the series is the cheaper: its plans hold 3 + 4 + 5 = 12 micro-steps (3 + 4 = 7 for
// memory alone), so from one more than that.
inline constexpr std::int64_t kAccumulationSeriesFrom = 13;
inline constexpr std::int64_t kAccumulationMemorySeriesFrom = 8;
struct CandidateOptions {
  bool timed = true;
  double headroom_fraction = kDefaultHeadroomFraction;
  bool skip_replay_when_allocated_overflows = false;  // a yes/no probe of memory
  bool accumulation_series = true;
};
Candidate plan_candidate(const PlanInput& input, const sim::Cluster& cluster, const CandidateOptions& options, std::int64_t* plans = nullptr);

// Throws KnobError for an empty space or contradictory constraints (naming the knobs).
Recommendation recommend(const PlanInput& base, const sim::Cluster& cluster, const SearchSpace& space,
                         const Constraints& constraints, Objective objective);

// `recommend --json`: the objective, the ranked rows, the rejections and the alternatives.
nlohmann::json recommendation_to_json(const Recommendation& r, std::size_t top);
// A `recommend --json` read back: every field it holds (a row's input only as far as the row
// says: profile, strategy, offload, micro-batch, accumulation, checkpointing, GPUs). Throws
// InputError naming `source` and the field for anything else.
Recommendation recommendation_from_json(const nlohmann::json& j, const std::string& source);

// "none", "full", "every-4" (name_of(CheckpointChoice)) read back; nullopt for anything else.
std::optional<CheckpointChoice> checkpoint_choice_from_name(std::string_view name);

// The cluster with `gpus` GPUs in it: the same GPU and links, as many nodes as needed.
sim::Cluster cluster_for_gpus(const sim::Cluster& cluster, std::int32_t gpus);

}  // namespace peftplan::planner
