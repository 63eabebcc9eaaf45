// plan.json (planner/plan_file.h: plan_file_from_json), the executor's input.
#include "fuzz_target.h"
#include "peftplan/planner/plan_file.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace peftplan;
  fuzz::parse_or_refuse("plan.json", [&] {
    const nlohmann::json j = parse_json_text(fuzz::text_of(data, size), "plan.json");
    (void)planner::plan_file_from_json(j, "plan.json");
  });
  return 0;
}
