// A step program as a function of the micro-batch, for searches that plan one configuration at
// many micro-batches (recommend's bisection for the largest that fits, then its timed rows).
// With everything else fixed, every size, cost, shape and scalar the builder emits is an affine
// function of the micro-batch B (activations and logits are B × S × ..., a GEMM's M is B × S, the
// loss divisor B × accumulation × ranks × S; weights, gradients, optimizer states and the
// communication do not depend on it), and the ops, buffers and dependencies are the same list.
// So two builds, at B = 1 and B = 2, give the program at any B: each field that differs moves
// by its difference per sequence. Builds at 2 and 3 check it: the series exists only when the
// programs it gives there agree with the builds in every field an interpreter reads
// (sim::same_interpreted_fields, the fields sim::program_hash reads), and a test holds it to
// fresh builds over a random sample of inputs and micro-batches up to 64.
// Deliberately not here: buffer names (the series is built with names off) and anything that
// changes the program's structure (accumulation, strategy, checkpointing: another series).
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "peftplan/planner/program.h"

namespace peftplan::planner {

class MicroBatchSeries {
 public:
  // The series of `input` over its micro-batch (input.training.micro_batch is ignored), or
  // nullopt when the programs at 1, 2 and 3 are not one affine series or a double that moves is
  // not an integer (then build each in full). Throws validate()'s KnobError for a bad input.
  static std::optional<MicroBatchSeries> make(const PlanInput& input);

  // The program the builder makes at micro-batch b >= 1 (with names off), and its facts. The
  // program is lent: hand it back with give_back before the next call (make_plan_with takes it
  // by value and keeps it in the Plan; recommend moves it back out).
  BuiltProgram take(std::int64_t b);
  void give_back(sim::Program&& program);

  // The largest micro-batch whose allocated device peak is at most device_budget and whose host
  // peak is at most host_budget (0: no limit): each sample of the memory walk (sim::
  // memory_timeline) is affine in B too, so the peak at B is the largest of its lines, and the
  // budget bounds every line. 0 when even micro-batch 1 is over; INT64_MAX when no line grows.
  // A search's upper bound for the micro-batch that fits: the caching allocator's reserved
  // memory can only add to the allocated peak.
  std::int64_t largest_within(std::uint64_t device_budget, std::uint64_t host_budget);

  // Fields that move with the micro-batch (for the benchmark's label).
  std::size_t moving_fields() const { return moving_.size(); }

  MicroBatchSeries(const MicroBatchSeries&) = delete;  // moving_ points into built_'s storage
  MicroBatchSeries& operator=(const MicroBatchSeries&) = delete;
  MicroBatchSeries(MicroBatchSeries&&) = default;
  MicroBatchSeries& operator=(MicroBatchSeries&&) = default;

 private:
  MicroBatchSeries() = default;
  struct Moving {
    enum class Type : std::uint8_t { u64, i64, i32, f64, f64_bits };
    void* field = nullptr;
    Type type = Type::u64;
    // The value at B = 1 and its change per sequence, as doubles: exact for integers below 2^53
    // (make() refuses a series with a moving double that is not one).
    double at_one = 0.0, per_sequence = 0.0;
  };
  void set(std::int64_t b);

  BuiltProgram built_;  // at the micro-batch last set; its storage never reallocates
  std::vector<const void*> lent_storage_;  // while lent: the program's vectors, to know it when it comes back
  static std::vector<const void*> storage_of(const sim::Program& p);
  std::vector<Moving> moving_;  // fields in the program's heap storage (stable across moves)
  Moving tokens_, model_flops_;  // Program::tokens_per_step and model_flops_per_step
  // Per memory-walk sample, the device and host live totals at B = 1 and their change per
  // sequence (filled by the first largest_within).
  struct Line {
    std::int64_t at_one = 0, per_sequence = 0;
  };
  std::vector<Line> device_lines_, host_lines_;
};

}  // namespace peftplan::planner
