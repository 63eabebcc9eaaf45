// --peft / --lora-* / --quant flags -> PeftSpec. Bad values are InputErrors naming the flag.
#include "peft_flags.h"

#include <cmath>
#include <filesystem>

#include "peftplan/common/error.h"
#include "peftplan/common/json_fields.h"
#include "peftplan/models/config.h"

namespace peftplan::cli {

void add_peft_flags(CLI::App* cmd, PeftFlags& f) {
  cmd->add_option("--peft", f.peft_files, "PEFT adapter_config.json (or its folder); repeat for several adapters");
  cmd->add_option("--lora-r", f.lora_r, "LoRA rank r");
  cmd->add_option("--lora-alpha", f.lora_alpha, "LoRA alpha (PEFT default 8)");
  cmd->add_option("--lora-targets", f.lora_targets,
                  "target modules: comma list (q_proj,v_proj), all-linear, or a regex");
  cmd->add_option("--lora-dropout", f.lora_dropout, "dropout on the LoRA input");
  cmd->add_flag("--use-rslora", f.use_rslora, "scale by alpha/sqrt(r)");
  cmd->add_flag("--use-dora", f.use_dora, "DoRA magnitude vectors");
  cmd->add_option("--quant", f.quant, "quantise the base (QLoRA): nf4, fp4 or int8, or none (the default)");
  cmd->add_flag("--double-quant", f.double_quant, "bitsandbytes double quantisation of the absmax constants");
}

bool any_lora_flag(const PeftFlags& f) {
  return f.lora_r || f.lora_alpha || !f.lora_targets.empty() || f.use_rslora || f.use_dora || f.lora_dropout != 0.0;
}

bool any_peft_flag(const PeftFlags& f) {
  return any_lora_flag(f) || !f.peft_files.empty() || f.quantised() || f.double_quant || f.full_finetune;
}

models::PeftSpec peft_from_flags(const PeftFlags& f) {
  models::PeftSpec spec;
  const bool lora_flags = any_lora_flag(f);
  if (!f.peft_files.empty() && lora_flags)
    throw InputError("--peft and --lora-* both given: use one way of describing the adapter");
  if (f.full_finetune && (lora_flags || !f.peft_files.empty()))
    throw InputError("--full-finetune trains every weight: drop --peft / --lora-* or drop --full-finetune");
  for (const auto& file : f.peft_files) {
    if (file.empty()) throw input_error("--peft", "", "must not be empty (leave the flag out for the --lora-* flags' adapter)", "\"\"");
    std::filesystem::path p(file);
    if (std::filesystem::is_directory(p)) p /= "adapter_config.json";
    models::AdapterSpec a = models::adapter_from_config(models::read_json_file(p.string()), p.string());
    if (f.peft_files.size() > 1) a.name = p.parent_path().filename().string();
    if (a.name.empty()) a.name = "default";
    spec.adapters.push_back(std::move(a));
  }
  if (f.peft_files.empty() && !f.full_finetune) {
    models::AdapterSpec a;
    a.type = models::PeftType::lora;
    if (f.lora_r) {
      if (*f.lora_r <= 0 || *f.lora_r > models::kMaxLoraRank)
        throw input_error("--lora-r", "", json_fields::valid_integer(1, models::kMaxLoraRank), std::to_string(*f.lora_r));
      a.lora.r = *f.lora_r;
    }
    if (f.lora_alpha) {
      if (!(std::isfinite(*f.lora_alpha) && *f.lora_alpha > 0.0))
        throw input_error("--lora-alpha", "", "must be a positive finite number (the adapter's scale is alpha / r)", fmt::format("{}", *f.lora_alpha));
      a.lora.alpha = *f.lora_alpha;
    }
    if (!(f.lora_dropout >= 0.0 && f.lora_dropout < 1.0))
      throw input_error("--lora-dropout", "", "must be in [0, 1)", fmt::format("{}", f.lora_dropout));
    a.lora.dropout = f.lora_dropout;
    a.lora.use_rslora = f.use_rslora;
    a.lora.use_dora = f.use_dora;
    if (!f.lora_targets.empty()) {
      nlohmann::json targets;
      if (f.lora_targets == "all-linear" || f.lora_targets.find_first_of("*()[]|\\^$+?") != std::string::npos) {
        targets = f.lora_targets;
      } else {
        targets = nlohmann::json::array();
        std::string item;
        for (char ch : f.lora_targets + ",") {
          if (ch == ',') {
            if (!item.empty()) targets.push_back(item);
            item.clear();
          } else if (ch != ' ') {
            item += ch;
          }
        }
      }
      a.lora = models::adapter_from_config(
                   nlohmann::json{{"peft_type", "LORA"}, {"r", a.lora.r}, {"lora_alpha", a.lora.alpha},
                                  {"lora_dropout", a.lora.dropout}, {"use_rslora", a.lora.use_rslora},
                                  {"use_dora", a.lora.use_dora}, {"target_modules", targets}},
                   "--lora-targets")
                   .lora;
    }
    spec.adapters.push_back(std::move(a));
  }
  if (f.quantised()) {
    // transformers' Trainer refuses "to perform fine-tuning on purely quantized models" (trainer.py).
    if (f.full_finetune)
      throw InputError(fmt::format("--quant {} with --full-finetune: transformers' Trainer refuses to fine-tune a purely quantised model; "
                                   "drop --quant or train an adapter", f.quant));
    models::Quantization q;
    auto t = parse_dtype(f.quant);
    if (!t || (*t != DType::nf4 && *t != DType::fp4 && *t != DType::int8))
      throw input_error("--quant", "", "must be nf4, fp4, int8 or none", "\"" + f.quant + "\"");
    q.dtype = *t;
    // bitsandbytes' double quantisation is of the 4-bit blocks' absmax (bnb_4bit_use_double_quant);
    // LLM.int8() has no such option.
    if (f.double_quant && q.dtype == DType::int8) throw InputError("--double-quant needs --quant nf4 or --quant fp4, got --quant int8");
    q.double_quant = f.double_quant;
    spec.quantization = q;
  } else if (f.double_quant) {
    throw InputError("--double-quant needs --quant nf4 or --quant fp4");
  }
  return spec;
}

}  // namespace peftplan::cli
