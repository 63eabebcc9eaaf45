// `peftplan models` (the bundled zoo with parameter counts) and `peftplan params` (PEFT's
// trainable/all parameter line for a model and adapter).
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "peft_flags.h"
#include "peftplan/common/error.h"
#include "peftplan/common/units.h"
#include "peftplan/models/config.h"
#include "peftplan/models/parameters.h"
#include "peftplan/models/peft.h"

namespace peftplan::cli {

void add_models_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("models", "list the bundled model zoo with exact parameter counts");
  cmd->footer("example: peftplan models");
  auto json_out = std::make_shared<bool>(false);
  cmd->add_flag("--json", *json_out, "machine-readable output");
  cmd->callback([&exit_code, json_out] {
    nlohmann::json rows = nlohmann::json::array();
    if (!*json_out)
      fmt::print("{:<16} {:<9} {:>6} {:>6} {:>4} {:>17} {:>8}  {}\n", "name", "type", "layers", "hidden", "kv",
                 "params", "short", "hugging face id");
    for (const auto& z : models::zoo()) {
      const models::ModelSpec m = models::load_model(z.name);
      const models::BaseCounts c = models::count_base(m);
      if (*json_out) {
        rows.push_back({{"name", z.name}, {"hf_id", z.hf_id}, {"model_type", models::name_of(m.arch)},
                        {"layers", m.layers}, {"hidden", m.hidden}, {"heads", m.heads}, {"kv_heads", m.kv_heads},
                        {"total_params", c.total}, {"active_params", c.active}, {"description", z.description}});
      } else {
        fmt::print("{:<16} {:<9} {:>6} {:>6} {:>4} {:>17} {:>8}  {}\n", z.name, models::name_of(m.arch), m.layers,
                   m.hidden, m.kv_heads, with_commas(c.total), short_count(c.total),
                   z.hf_id.empty() ? "(bundled tiny config)" : z.hf_id);
      }
    }
    if (*json_out) fmt::print("{}\n", rows.dump(2));
    exit_code = 0;
  });
}

void add_params_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("params", "count base, trainable and all parameters as PEFT prints them");
  cmd->footer("example: peftplan params --model llama-2-7b --lora-r 16 --lora-targets q_proj,v_proj");
  struct Options {
    std::string model;
    PeftFlags peft;
    bool json = false, tensors = false;
  };
  auto o = std::make_shared<Options>();
  cmd->add_option("--model", o->model, "zoo name, config.json, or a folder holding one")->required();
  add_peft_flags(cmd, o->peft);
  cmd->add_flag("--full-finetune", o->peft.full_finetune, "every weight trains (no adapter)");
  cmd->add_flag("--tensors", o->tensors, "also list every trainable tensor with its PEFT name and shape");
  cmd->add_flag("--json", o->json, "machine-readable output");
  cmd->callback([&exit_code, o] {
    const models::ModelSpec m = models::load_model(o->model);
    models::PeftSpec spec = peft_from_flags(o->peft);
    // The rule plan applies: a checkpoint saved quantised trains an adapter (the counts are PEFT's
    // either way: print_trainable_parameters counts a Params4bit as its unpacked elements).
    for (const auto& w : models::apply_checkpoint_quantization(m, spec, !o->peft.quant.empty()))
      fmt::print(stderr, "warning: {}\n", printable_line(w));
    const models::ParamCounts c = models::count_params(m, spec);
    for (const auto& w : models::unmatched_target_warnings(m, spec)) fmt::print(stderr, "warning: {}\n", printable_line(w));
    const auto rows = spec.adapters.empty() ? std::vector<models::TrainableTensor>{}
                                            : models::trainable_tensors(m, spec);
    if (o->json) {
      nlohmann::json j{{"model", m.name},
                       {"total_params", c.total_params},
                       {"active_params", c.active_params},
                       {"trainable_params", c.trainable_params},
                       {"all_params", c.all_params},
                       {"trainable_percent", c.trainable_percent}};
      if (o->tensors) {
        j["trainable_tensors"] = nlohmann::json::array();
        for (const auto& t : rows)
          j["trainable_tensors"].push_back({{"name", t.name}, {"shape", t.shape}, {"adapter", t.adapter}});
      }
      fmt::print("{}\n", j.dump(2));
    } else {
      if (o->tensors)
        for (const auto& t : rows) fmt::print("{:<80} [{}]\n", t.name, fmt::join(t.shape, ", "));
      fmt::print("{}\n", models::peft_summary_line(c));
    }
    exit_code = 0;
  });
}

}  // namespace peftplan::cli
