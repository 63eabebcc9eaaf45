// `peftplan explain`: a plan's peak as a derivation a person can check. Every device category at
// the simultaneous peak is broken into the buffers live there, grouped by what they are (one line
// per kind: "layers.N.mb0.mlp.silu × 32"), each with its size as a formula in the model's and the
// batch's dimensions, the numbers substituted, and what the buffer is and where the rule comes
// from; the model states carry the ZeRO paper's formula beside them. The lines are read off the
// step program itself, so they add up to the walk's categories to the byte (a test holds that),
// and a formula is printed only when it evaluates to the buffer's bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "peftplan/planner/plan.h"

namespace peftplan::planner {

struct ExplainTerm {
  std::string what;            // the buffers' name pattern, digits as N ("layers.N.mb0.mlp.silu")
  std::int64_t count = 0;      // buffers of this kind live at the peak
  std::uint64_t bytes_each = 0;
  std::uint64_t bytes = 0;     // count × bytes_each (sizes of one kind can differ: then the sum)
  std::string formula;         // "B·S·I × 2 B (bf16)", empty when no shape matches
  std::string numbers;         // "2·4096·11008 × 2 B"
  std::string source;          // what it is and why it is kept, with the rule's source
};

struct ExplainCategory {
  sim::MemCategory category = sim::MemCategory::activations;
  std::uint64_t at_peak_bytes = 0;   // the walk's figure: the terms add up to it
  std::uint64_t peak_bytes = 0;      // the category's own peak (may be elsewhere in the step)
  std::string closed_form;           // model states: the ZeRO paper's formula with the numbers
  std::vector<ExplainTerm> terms;    // largest first
};

struct Explanation {
  std::vector<std::string> dims;     // "B = 2 (micro-batch)", "S = 4096 (tokens per sequence)", ...
  std::string peak_at;               // the op at the peak and its phase
  std::vector<ExplainCategory> categories;  // device categories with bytes at the peak
  std::vector<std::string> kinds;    // allocated, reserved and used, how each follows
};

// `plan` must have been made with buffer names (PlanOptions::names).
Explanation explain_plan(const Plan& plan);

nlohmann::json explanation_to_json(const Explanation& e);

}  // namespace peftplan::planner
