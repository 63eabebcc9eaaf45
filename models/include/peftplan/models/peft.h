// PeftSpec: which adapters are trained on a model, read from PEFT's adapter_config.json or from
// flags, and the trainable inventory with PEFT's own tensor names. Semantics follow
// huggingface/peft (src/peft/tuners/lora/config.py, tuners/tuners_utils.py
// check_target_module_exists, utils/constants.py target-module defaults).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "peftplan/common/dtype.h"
#include "peftplan/models/model_spec.h"
#include "peftplan/models/parameters.h"

namespace peftplan::models {

enum class PeftType { lora, ia3, prefix_tuning, prompt_tuning };
std::string_view name_of(PeftType t);

// target_modules / exclude_modules: a list (exact name or ".name" suffix match), a single regex
// string (re.fullmatch on the module path), or "all-linear".
struct ModuleSelector {
  enum class Kind { none, list, regex, all_linear } kind = Kind::none;
  std::vector<std::string> names;   // Kind::list
  std::string regex;                // Kind::regex
};

// The largest LoRA rank read: far above any published adapter (ranks of 8-256; LoRA's own
// experiments go to 64, Hu et al. arXiv 2106.09685 §7.2) and the largest hidden size a config may
// have (2^20), and small enough that r x (in + out) stays inside 64 bits.
inline constexpr std::int64_t kMaxLoraRank = std::int64_t{1} << 20;
// The same bound for prompt and prefix tuning's num_virtual_tokens and encoder_hidden_size
// (published configs use 8-100 tokens, Lester et al. arXiv 2104.08691 §3; Li & Liang arXiv
// 2101.00190 §5): their products with the hidden size and the layer count stay inside 64 bits.
inline constexpr std::int64_t kMaxVirtualTokens = std::int64_t{1} << 20;

struct LoraConfig {
  std::int64_t r = 8;                              // rank (PEFT default 8)
  double alpha = 8.0;                              // lora_alpha (PEFT default 8)
  double dropout = 0.0;                            // lora_dropout on the LoRA input
  ModuleSelector targets;                          // none => PEFT's per-architecture default
  ModuleSelector exclude;
  std::optional<std::vector<std::int64_t>> layers_to_transform;
  std::optional<std::string> layers_pattern;       // "layers", "h", ...
  std::map<std::string, std::int64_t> rank_pattern;   // name or regex -> rank
  std::map<std::string, double> alpha_pattern;        // name or regex -> alpha
  bool use_rslora = false;                         // scale = alpha / sqrt(r)
  bool use_dora = false;                           // + magnitude vector [out] per module
  bool lora_bias = false;                          // + bias on lora_B [out]
  std::string bias = "none";                       // "none" | "all" | "lora_only"
  std::vector<std::string> modules_to_save;        // fully trained copies (lm_head, ...)
};

struct Ia3Config {
  ModuleSelector targets;                          // none => PEFT's default for the arch
  std::vector<std::string> feedforward_modules;    // scale the input instead of the output
  std::vector<std::string> modules_to_save;
};

struct PromptConfig {
  std::int64_t num_virtual_tokens = 20;            // n_vt
  std::int64_t num_transformer_submodules = 1;     // 1 for decoder-only
  bool prefix_projection = false;                  // prefix tuning: MLP reparameterisation
  std::int64_t encoder_hidden_size = 0;            // prefix projection width (default: H)
};

struct AdapterSpec {
  std::string name = "default";                    // PEFT adapter name
  std::string source;                              // the adapter_config.json it was read from
                                                   //   ("": flags), named in its errors
  PeftType type = PeftType::lora;
  LoraConfig lora;                                 // type lora
  Ia3Config ia3;                                   // type ia3
  PromptConfig prompt;                             // prefix/prompt tuning
};

struct PeftSpec {
  std::vector<AdapterSpec> adapters;               // empty = full fine-tuning
  std::optional<Quantization> quantization;
};

// A trainable tensor with PEFT's saved name
// ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight").
struct TrainableTensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::string adapter = "default";
  std::string module;             // the adapted module path in the base model
  std::int32_t layer = -1;
  bool is_base_param = false;     // a base tensor made trainable (bias="all"), not a new one
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;
    return n;
  }
};

// `source` names the file in errors. Unknown peft_type values are rejected with the valid list.
AdapterSpec adapter_from_config(const nlohmann::json& config, std::string_view source);

// Resolves selectors against the model; selectors that together match no module are an
// InputError that lists the module names the model has (PEFT: "Target modules ... not found in
// the base model").
std::vector<TrainableTensor> trainable_tensors(const ModelSpec& model, const PeftSpec& peft);

// One warning per name of a target_modules list that matches no Linear of the model. PEFT adapts
// what the other names match and ignores such a name (BaseTuner.inject_adapter raises only when
// nothing was targeted), so a config written for several architectures ("q_proj", "v_proj",
// "query_key_value") loads; the CLI warns of each once per input (params, and every command that
// takes plan's flags).
std::vector<std::string> unmatched_target_warnings(const ModelSpec& model, const PeftSpec& peft);

// The same from inventories already computed (planner hot path).
std::vector<TrainableTensor> trainable_tensors(const ModelSpec& model, const PeftSpec& peft,
                                               const std::vector<TensorInfo>& base,
                                               const std::vector<LinearModule>& linears);

// "bitsandbytes nf4 with double quantisation", "bitsandbytes int8 (LLM.int8())".
std::string describe(const Quantization& q);
// The one rule for a checkpoint saved quantised (ModelSpec::checkpoint_quantization): it loads
// quantised as saved, whatever the caller asks — transformers' AutoHfQuantizer
// .merge_quantization_configs keeps the model's quantization_config and warns of the one passed
// in — so `peft.quantization` becomes the checkpoint's. Returns a warning when the caller asked
// for another (`quant_asked`: a --quant flag was given; the explorer's QLoRA box always states one). Full
// fine-tuning of such a base is an InputError: transformers' Trainer refuses "to perform
// fine-tuning on purely quantized models" (trainer.py, Trainer.__init__).
std::vector<std::string> apply_checkpoint_quantization(const ModelSpec& model, PeftSpec& peft, bool quant_asked);

// The LoRA modules actually adapted, with their resolved rank and scale: the executor and the
// planner's FLOP count use this.
struct LoraModule {
  LinearModule linear;
  std::string adapter = "default";
  std::int64_t r = 0;
  double scale = 0.0;             // alpha / r, or alpha / sqrt(r) with rsLoRA
  double dropout = 0.0;
};
std::vector<LoraModule> lora_modules(const ModelSpec& model, const PeftSpec& peft);
std::vector<LoraModule> lora_modules(const ModelSpec& model, const PeftSpec& peft, const std::vector<LinearModule>& linears);

// PEFT's get_nb_trainable_parameters / print_trainable_parameters numbers.
struct ParamCounts {
  std::int64_t total_params = 0;      // base, unique
  std::int64_t active_params = 0;     // base per token (MoE); = total otherwise
  std::int64_t trainable_params = 0;
  std::int64_t all_params = 0;        // base + adapters (+ modules_to_save copies), as PEFT counts
  double trainable_percent = 0.0;     // 100 * trainable / all
};
ParamCounts count_params(const ModelSpec& model, const PeftSpec& peft);

// "trainable params: 8,388,608 || all params: 6,746,804,224 || trainable%: 0.1243"
std::string peft_summary_line(const ParamCounts& counts);

// PEFT's adapter_config.json for a LoRA adapter (written next to adapter_model.safetensors).
nlohmann::json lora_adapter_config(const AdapterSpec& adapter, const std::string& base_model);

}  // namespace peftplan::models
