// The knobs of a plan: the inputs a user turns (micro-batch, strategy, offload, ...), each named
// by its PlanInput field ("training.micro_batch", "strategy.stage"), and the recommender's
// (its SearchSpace and Constraints fields). The planner's messages and
// suggestions name knobs this way, as data, so that each front end spells them its own way: the
// CLI as flags (--micro-batch), the explorer as its controls, plan.json users as fields.
//   - KnobError: an input the planner refuses, with the knobs its message names;
//   - Suggestion: "set strategy.stage to zero3 (shards the frozen base)", "a smaller
//     training.micro_batch": a knob, a change and a value, with why in words.
// Deliberately not here: flag spellings (cli/), what to suggest (plan.cpp, recommend.cpp), and
// the checks themselves (program.cpp's validate).
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "peftplan/common/error.h"

namespace peftplan::planner {

enum class Knob : std::uint8_t {
  model,             // the model (a zoo name or config.json)
  lora_r,            // peft.adapters[].r
  quantization,      // peft.quantization (nf4 / fp4 / int8 base)
  stage,             // strategy.stage
  ranks,             // strategy.ranks (GPUs)
  offload_optimizer, // strategy.offload_optimizer
  offload_param,     // strategy.offload_param
  fsdp_version,      // strategy.fsdp.version
  reduce_bucket_size,           // strategy.ds.reduce_bucket_size
  stage3_prefetch_bucket_size,  // strategy.ds.stage3_prefetch_bucket_size
  stage3_max_live_parameters,   // strategy.ds.stage3_max_live_parameters
  profile,           // the runtime profile
  micro_batch,       // training.micro_batch
  seq_len,           // training.seq_len
  grad_accum,        // training.grad_accum
  precision,         // training.precision
  checkpointing,     // training.checkpointing
  checkpoint_every,  // training.checkpoint_every
  attention,         // training.attention
  cross_entropy,     // training.cross_entropy
  optimizer,         // training.optimizer
  eval_batch,        // training.eval_batch
  gpu,               // cluster.gpu
  // The recommender's search (recommend.h): its space, constraints and objective.
  search_gpus,       // space.gpus
  search_stages,     // space.stages
  search_offload,    // space.offload
  min_micro_batch,   // space.min_micro_batch
  global_batch,      // space.global_batch
  max_gpus,          // constraints.max_gpus
  objective,         // objective (the last knob: kNumKnobs counts to it)
};
inline constexpr int kNumKnobs = static_cast<int>(Knob::objective) + 1;

// The knob's PlanInput field, as plan.json and plan --json write it.
std::string_view field_of(Knob k);

// How a front end names a knob (the CLI: its flag). The default names the field.
using KnobSpelling = std::string (*)(Knob);
std::string field_spelling(Knob k);

// A change worth trying: set a knob to a value, or make it smaller or larger.
enum class Change : std::uint8_t { set, smaller, larger };
std::string_view name_of(Change c);  // "set", "smaller", "larger"

struct Suggestion {
  Knob knob = Knob::micro_batch;
  Change change = Change::set;
  std::string value;  // Change::set: the value, as the knob's own names write it ("zero3"); "" when the
                      // knob is a switch the spelling says how to turn (JSON: null)
  std::string why;    // words, no knob names ("shards the frozen base")
  bool operator==(const Suggestion&) const = default;
};

// "try <a> or <b>": each suggestion spelled by `spell` ("--strategy zero3 (shards the frozen
// base)", "a smaller --micro-batch"); "" for none.
std::string suggestion_text(std::span<const Suggestion> s, KnobSpelling spell = field_spelling);

// [{"knob": "strategy.stage", "change": "set", "value": "zero3", "why": "..."}, ...]
nlohmann::json suggestions_to_json(std::span<const Suggestion> s);

// An input the planner refuses. Its message names fields (field_of); `knobs` lists them, so a
// front end can say how it sets them (the CLI adds the flags).
class KnobError : public InputError {
 public:
  KnobError(std::vector<Knob> knobs, const std::string& message) : InputError(message), knobs_(std::move(knobs)) {}
  const std::vector<Knob>& knobs() const { return knobs_; }

 private:
  std::vector<Knob> knobs_;
};

}  // namespace peftplan::planner
