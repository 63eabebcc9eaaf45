// A measurement against a plan (planner/validate.h), both kinds `peftplan compare` reads:
// peftplan-exec's measurement.json (validate) and a training job's totals (validate_totals).
// The plan is the one seeds/plan.json describes (ZeRO-3 on 2 ranks of tiny-llama-4l), which the
// seed measurement was measured on, so mutations reach past the op-count check.
#include <optional>
#include <stdexcept>

#include "fuzz_target.h"
#include "peftplan/planner/plan.h"
#include "peftplan/planner/plan_file.h"
#include "peftplan/planner/validate.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace peftplan;
  static const planner::Plan plan = [] {
    const planner::PlanFile pf = planner::read_plan_file(PEFTPLAN_FUZZ_PLAN);
    if (!pf.cluster) throw std::logic_error(PEFTPLAN_FUZZ_PLAN ": the seed plan must carry its cluster");
    planner::PlanOptions o;
    o.explain = false;
    return planner::make_plan(pf.input, *pf.cluster, o);
  }();
  const std::string text = fuzz::text_of(data, size);
  fuzz::parse_or_refuse("measurement.json", [&] { (void)planner::validate(plan, parse_json_text(text, "measurement.json")); });
  fuzz::parse_or_refuse("measurement.json", [&] {
    (void)planner::validate_totals(plan, parse_json_text(text, "measurement.json"), "measurement.json", std::nullopt);
  });
  return 0;
}
