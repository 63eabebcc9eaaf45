// One colour per memory category, for every chart peftplan draws (reports/ and the Qt explorer):
// the Tableau 10 palette (Tableau's default categorical colours, chosen for telling adjacent
// categories apart in print and on screen), in the categories' order.
#pragma once

#include <array>
#include <string_view>

#include "peftplan/sim/program.h"

namespace peftplan::reports {

inline constexpr std::array<std::string_view, sim::kNumCategories> kCategoryColours = {
    "#4e79a7",  // base_weights
    "#a0cbe8",  // gathered_weights
    "#f28e2b",  // trainable_weights
    "#e15759",  // gradients
    "#76b7b2",  // optimizer_states
    "#59a14f",  // activations
    "#edc948",  // workspace
    "#b07aa1",  // comm_buffers
    "#9c755f",  // runtime_overhead
    "#bab0ac",  // host_optimizer_states
    "#d4a6c8",  // host_weights
    "#fabfd2",  // host_pinned_buffers
    "#d7b5a6",  // host_other
};
constexpr std::string_view colour_of(sim::MemCategory c) { return kCategoryColours[static_cast<std::size_t>(c)]; }

// The colours of the step-time parts (compute, exposed communication, optimizer, offload, host).
inline constexpr std::string_view kComputeColour = "#4e79a7";
inline constexpr std::string_view kCommColour = "#e15759";
inline constexpr std::string_view kOptimizerColour = "#76b7b2";
inline constexpr std::string_view kOffloadColour = "#edc948";
inline constexpr std::string_view kHostColour = "#9c755f";

// The colours of a step timeline's ops: compute by phase (setup, forward, backward, recompute,
// loss, optimizer; the step colours where they mean the same), collectives as exposed
// communication, copies as offload.
inline constexpr std::array<std::string_view, sim::kNumPhases> kPhaseColours = {
    "#bab0ac",  // setup
    "#4e79a7",  // forward
    "#f28e2b",  // backward
    "#b07aa1",  // recompute
    "#edc948",  // loss
    "#76b7b2",  // optimizer
};
constexpr std::string_view colour_of(sim::Phase p) { return kPhaseColours[static_cast<std::size_t>(p)]; }

// What each category holds, for legends (the README's "Memory kinds" and categories).
std::string_view definition_of(sim::MemCategory c);

}  // namespace peftplan::reports
