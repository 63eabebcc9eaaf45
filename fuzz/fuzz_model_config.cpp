// A Hugging Face config.json (models/config.h: model_from_config): every count in range, the
// dimensions consistent, or an InputError naming the field.
#include "fuzz_target.h"
#include "peftplan/models/config.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace peftplan;
  fuzz::parse_or_refuse("config.json", [&] {
    const nlohmann::json j = parse_json_text(fuzz::text_of(data, size), "config.json");
    (void)models::model_from_config(j, "config.json", "fuzz");
  });
  return 0;
}
