// A cluster file (sim/cluster.h: cluster_from_json): GPUs, links, calibration tables.
#include "fuzz_target.h"
#include "peftplan/sim/cluster.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace peftplan;
  fuzz::parse_or_refuse("cluster.json", [&] {
    const nlohmann::json j = parse_json_text(fuzz::text_of(data, size), "cluster.json");
    (void)sim::cluster_from_json(j, "cluster.json");
  });
  return 0;
}
