// accelerate's config YAML (planner/accelerate_config.h: read_accelerate_config): the text as
// yaml-cpp reads it, then the FSDP fields.
#include "fuzz_target.h"
#include "peftplan/planner/accelerate_config.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace peftplan;
  fuzz::parse_or_refuse("accelerate.yaml", [&] { (void)planner::read_accelerate_config(fuzz::text_of(data, size), "accelerate.yaml"); });
  return 0;
}
