// PEFT flags shared by params, plan and run: either --peft adapter_config.json (repeatable for
// several adapters) or --lora-* flags, plus QLoRA base quantisation.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "peftplan/models/peft.h"

namespace peftplan::cli {

struct PeftFlags {
  std::vector<std::string> peft_files;   // adapter_config.json paths (or folders holding one)
  std::optional<std::int64_t> lora_r;    // --lora-r
  std::optional<double> lora_alpha;      // --lora-alpha (PEFT default 8)
  std::string lora_targets;              // --lora-targets q_proj,v_proj | all-linear | regex
  double lora_dropout = 0.0;             // --lora-dropout
  bool use_rslora = false;               // --use-rslora
  bool use_dora = false;                 // --use-dora
  std::string quant;                     // --quant nf4|fp4|int8, or none (the default: no quantisation)
  bool quantised() const { return !quant.empty() && quant != "none"; }
  bool double_quant = false;             // --double-quant
  bool full_finetune = false;            // --full-finetune (set by commands that offer it)
};

void add_peft_flags(CLI::App* cmd, PeftFlags& flags);

// Whether any --lora-* flag was given.
bool any_lora_flag(const PeftFlags& flags);
// Whether any adapter flag was given: --peft, --lora-*, --quant, --double-quant or --full-finetune.
bool any_peft_flag(const PeftFlags& flags);

// No --peft and no --lora-* flags: an empty PeftSpec (full fine-tuning) only when
// flags.full_finetune; otherwise LoRA with PEFT's defaults (r 8, alpha 8, q_proj/v_proj).
models::PeftSpec peft_from_flags(const PeftFlags& flags);

}  // namespace peftplan::cli
