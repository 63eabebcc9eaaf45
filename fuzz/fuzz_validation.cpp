// validation.json read back (planner/validate.h: validation_from_json), as reports and the
// explorer read a run's comparison.
#include "fuzz_target.h"
#include "peftplan/planner/validate.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace peftplan;
  fuzz::parse_or_refuse("validation.json", [&] {
    const nlohmann::json j = parse_json_text(fuzz::text_of(data, size), "validation.json");
    (void)planner::validation_from_json(j, "validation.json");
  });
  return 0;
}
