// A DeepSpeed ds_config.json (planner/ds_config.h: read_ds_config) with what the CLI gives it
// to resolve "auto" from: 2 ranks, a 4096-wide model, 100 steps.
#include "fuzz_target.h"
#include "peftplan/planner/ds_config.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace peftplan;
  fuzz::parse_or_refuse("ds_config.json", [&] {
    const nlohmann::json j = parse_json_text(fuzz::text_of(data, size), "ds_config.json");
    planner::DsConfigInputs in;
    in.world_size = 2;
    in.hidden = 4096;
    in.total_steps = 100;
    (void)planner::read_ds_config(j, "ds_config.json", in);
  });
  return 0;
}
