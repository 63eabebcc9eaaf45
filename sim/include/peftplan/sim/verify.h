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
//     direction starts, and a device-to-host copy lands on the host;
//   - a scalar reduction (Op::reduction) is an 8-byte all_reduce of no buffer, and in an
//     executable program a collective of no buffer is one;
//   - at most one buffer holds each state role (trainable_flat ... optimizer_params), and a
//     tensor role's buffer (base_tensor, adapter_tensor, adapter_grad) names its inventory index;
//   - in an executable program (Program::executable), every required operand slot of a compute
//     op is filled, and every filled slot's buffer has the bytes the op's shape says
//     (sim/ops.h: SlotSpec). Cost-only programs name only the buffers their interpreters touch,
//     so their slots are checked for liveness, not size.
// Deliberately not checked here: costs, and whether an op's numbers are the right ones for the
// model (the executor's results against PyTorch's say that).
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
  scalar_reduction,  // a scalar reduction that is not an 8-byte all_reduce of no buffer, or an
                     //   executable program's collective of no buffer that reduces no scalar
  buffer_role,       // a state role held by two buffers, or a tensor role without its index
  operand_missing,   // an executable program's compute op leaves a required slot empty
  operand_size,      // an operand's bytes differ from what the op's shape says
};
inline constexpr int kNumRules = 16;
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
