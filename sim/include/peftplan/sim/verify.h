// The step program's structural contract, checked: what every interpreter may assume of a
// Program before it reads one op. The planner builds programs; the memory walk, the timeline,
// the caching-allocator model and the executor interpret them; sim::verify is the one place that
// says what a well-formed program is, so that a builder change that breaks it fails here, with
// the op and the rule, instead of as a wrong number or a crash deep in an interpreter.
//
// Checked, each rule a Rule value (a test breaks a program by hand for every one):
//   - every buffer id an op names (alloc/free target, collective or copy payload, kernel
//     operands) exists; a view lies inside its parent and is never allocated or freed itself;
//   - a buffer is allocated once before it is freed, and freed only while live; every buffer an
//     op reads or writes is live there (a view: its parent), setup buffers from the start;
//   - a buffer's allocation pieces (Buffer::pieces) tile it exactly, and a view has none;
//   - the setup ops come before the step's (the memory walk reads the program in order, the
//     caching-allocator model setup first: the two must see the same program);
//   - every explicit dependency names an earlier op;
//   - a compute op names its kernel; a collective has a group of at least one rank, and an
//     all_gather or reduce_scatter a total divisible by it; a copy's source lies where its
//     direction starts, and a device-to-host copy lands on the host.
// Deliberately not checked here: what each kernel's operand slots mean and their sizes (the
// per-kernel convention lives with the builder, planner/program.cpp), and costs.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "peftplan/sim/program.h"

namespace peftplan::sim {

enum class Rule : std::uint8_t {
  buffer_id,         // an op names a buffer that does not exist
  view_bounds,       // a view reaches past its parent, or its parent does not exist
  view_alloc,        // an alloc or free of a view
  double_alloc,      // an alloc of a live buffer
  free_not_live,     // a free of a buffer that is not live
  use_not_live,      // an op reads or writes a buffer that is not live
  dep_order,         // a dependency on this op or a later one
  kernel_none,       // a compute op without a kernel
  collective_group,  // a collective over fewer than one rank, or a total the group cannot split
  copy_direction,    // a copy whose source or destination lies on the wrong side
  setup_order,       // a setup op after the step's first op
  pieces,            // allocation pieces that do not sum to the buffer's bytes, or on a view
};
inline constexpr int kNumRules = 12;
std::string_view name_of(Rule r);

struct Violation {
  Rule rule = Rule::buffer_id;
  std::int32_t op = -1;  // the op that breaks it (-1: a buffer's own definition)
  std::string detail;    // what was found, naming the buffer
};

// Every violation, in program order (empty: the program is well-formed).
std::vector<Violation> verify(const Program& program);

// Throws InternalError naming the first violations (a bug in whoever built the program).
void verify_or_throw(const Program& program);

}  // namespace peftplan::sim
