// A PEFT adapter_config.json (models/peft.h: adapter_from_config), then its target modules
// resolved against a real model (tiny-llama-2l from the zoo): a module the model lacks is refused
// naming the file and the module.
#include <optional>

#include "fuzz_target.h"
#include "peftplan/models/config.h"
#include "peftplan/models/peft.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace peftplan;
  static const models::ModelSpec model = models::load_model("tiny-llama-2l");
  std::optional<models::AdapterSpec> a;
  fuzz::parse_or_refuse("adapter_config.json", [&] {
    a = models::adapter_from_config(parse_json_text(fuzz::text_of(data, size), "adapter_config.json"), "adapter_config.json");
  });
  // Resolution knows the model, not the file (the CLI names the file around it): it must refuse
  // naming what the model lacks, in one line.
  if (a) fuzz::parse_or_refuse("", [&] { (void)models::trainable_tensors(model, models::PeftSpec{{*a}, std::nullopt}); });
  return 0;
}
