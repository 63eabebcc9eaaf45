// Knob names and suggestion text (knobs.h).
#include "peftplan/planner/knobs.h"

#include <iterator>

#include <fmt/format.h>

namespace peftplan::planner {
namespace {

// In Knob's order; the static_assert below ties the table to the enum.
constexpr std::string_view kFields[] = {
    "model",
    "peft.adapters[].r",
    "peft.quantization",
    "strategy.stage",
    "strategy.ranks",
    "strategy.offload_optimizer",
    "strategy.offload_param",
    "strategy.fsdp.version",
    "strategy.ds.reduce_bucket_size",
    "strategy.ds.stage3_prefetch_bucket_size",
    "strategy.ds.stage3_max_live_parameters",
    "profile",
    "training.micro_batch",
    "training.seq_len",
    "training.grad_accum",
    "training.precision",
    "training.checkpointing",
    "training.checkpoint_every",
    "training.attention",
    "training.cross_entropy",
    "training.optimizer",
    "training.eval_batch",
    "cluster.gpu",
    "space.gpus",
    "space.stages",
    "space.offload",
    "space.min_micro_batch",
    "space.global_batch",
    "constraints.max_gpus",
    "objective",
};
static_assert(std::size(kFields) == static_cast<std::size_t>(kNumKnobs) && kFields[static_cast<std::size_t>(Knob::micro_batch)] == "training.micro_batch" &&
                  kFields[static_cast<std::size_t>(Knob::search_offload)] == "space.offload" && kFields[kNumKnobs - 1] == "objective",
              "kFields names every Knob, in order");

}  // namespace

std::string_view field_of(Knob k) { return kFields[static_cast<std::size_t>(k)]; }

std::string field_spelling(Knob k) { return std::string(field_of(k)); }

std::string_view name_of(Change c) {
  switch (c) {
    case Change::set: return "set";
    case Change::smaller: return "smaller";
    case Change::larger: return "larger";
  }
  return "?";
}

std::string suggestion_text(std::span<const Suggestion> s, KnobSpelling spell) {
  std::string out;
  for (const Suggestion& x : s) {
    out += out.empty() ? "try " : " or ";
    const std::string knob = spell(x.knob);
    switch (x.change) {
      case Change::set: out += x.value.empty() ? knob : fmt::format("{} {}", knob, x.value); break;
      case Change::smaller: out += fmt::format("a smaller {}", knob); break;
      case Change::larger: out += fmt::format("a larger {}", knob); break;
    }
    if (!x.why.empty()) out += fmt::format(" ({})", x.why);
  }
  return out;
}

nlohmann::json suggestions_to_json(std::span<const Suggestion> s) {
  nlohmann::json a = nlohmann::json::array();
  for (const Suggestion& x : s)
    a.push_back({{"knob", field_of(x.knob)}, {"change", name_of(x.change)}, {"value", x.change == Change::set && !x.value.empty() ? nlohmann::json(x.value) : nlohmann::json(nullptr)},
                 {"why", x.why}});
  return a;
}

}  // namespace peftplan::planner
