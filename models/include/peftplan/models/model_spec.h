// ModelSpec: the architecture of a decoder-only language model, read from a Hugging Face
// config.json. Only what changes parameter shapes, memory or FLOPs is kept; behaviour flags that
// change neither (dropout rates, rope scaling kinds) are not.
// Parsing lives in config.h; this header is the plain value type.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "peftplan/common/dtype.h"

namespace peftplan::models {

// The model_type values we understand (transformers' names).
enum class Arch { llama, mistral, mixtral, qwen2, gemma, gemma2, phi3, gpt2, gpt_neox, falcon, opt };

std::string_view name_of(Arch arch);

// QLoRA-style base quantisation (bitsandbytes BitsAndBytesConfig): applies to Linear layers of
// the base model, not embeddings, norms or the LM head.
struct Quantization {
  DType dtype = DType::nf4;                        // nf4 | fp4 | int8
  bool double_quant = false;                       // bnb_4bit_use_double_quant
  std::int64_t block_size = 64;                    // elements per absmax block (bnb 4-bit: 64)
  bool operator==(const Quantization&) const = default;
};

struct ModelSpec {
  std::string name;                 // zoo name or the config file's stem
  Arch arch = Arch::llama;          // from model_type
  std::int64_t hidden = 0;          // H: residual width
  std::int64_t intermediate = 0;    // I: MLP width (per expert for MoE)
  std::int64_t layers = 0;          // L: decoder layers
  std::int64_t heads = 0;           // query heads n_h
  std::int64_t kv_heads = 0;        // key/value heads n_kv (GQA/MQA; = n_h for MHA)
  std::int64_t head_dim = 0;        // d: per-head width (explicit in Gemma, else H / n_h)
  std::int64_t vocab = 0;           // V: embedding rows (often padded beyond the tokenizer)
  std::int64_t max_positions = 0;   // context window; sizes learned position tables (GPT-2, OPT)
  bool tie_embeddings = true;       // lm_head shares the input embedding (HF default: true)
  std::int64_t experts = 1;         // E: MoE experts per layer (Mixtral num_local_experts)
  std::int64_t experts_per_token = 1;  // k: experts each token is routed to (top-k)
  bool qkv_bias = false;            // bias on q/k/v projections (Qwen2: always)
  bool out_bias = false;            // bias on the attention output projection
  bool mlp_bias = false;            // bias on MLP projections
  bool norm_bias = false;           // LayerNorm with bias (GPT-2, NeoX, Falcon, OPT)
  bool parallel_attn = false;       // attention and MLP read the same input (Falcon, NeoX)
  bool falcon_new_arch = false;     // Falcon new_decoder_architecture (ln_attn + ln_mlp)
  std::int64_t falcon_norms = 1;    // LayerNorms per Falcon layer (1 or 2)
  std::int64_t opt_proj_dim = 0;    // OPT word_embed_proj_dim (project_in/out when != H)
  bool opt_final_norm = true;       // OPT has a final LayerNorm when do_layer_norm_before
  double rope_theta = 10000.0;      // RoPE base (no parameters)
  double rotary_pct = 1.0;          // NeoX: fraction of head_dim rotated
  double norm_eps = 1e-5;           // RMSNorm / LayerNorm epsilon
  std::optional<std::int64_t> sliding_window;  // tokens; bounds attention span when set
  DType dtype = DType::fp32;        // torch_dtype of the published checkpoint
  // A checkpoint saved quantised: config.json's quantization_config (bitsandbytes 4-bit or
  // 8-bit). It loads quantised whatever the caller asks (apply_checkpoint_quantization, peft.h).
  std::optional<Quantization> checkpoint_quantization;
  // The dtype its 4-bit weights are stored in when that is the dtype of the other parameters
  // (bnb_4bit_quant_storage bfloat16, float16 or float32, as FSDP QLoRA needs); none for the
  // default uint8, int8, float64, and an 8-bit checkpoint's int8.
  std::optional<DType> checkpoint_quant_storage;

  bool is_moe() const { return experts > 1; }
  bool gated_mlp() const {          // SwiGLU/GeGLU: gate, up, down
    return arch == Arch::llama || arch == Arch::mistral || arch == Arch::mixtral ||
           arch == Arch::qwen2 || arch == Arch::gemma || arch == Arch::gemma2 || arch == Arch::phi3;
  }
  bool rms_norm() const { return gated_mlp(); }
  std::int64_t q_width() const { return heads * head_dim; }
  std::int64_t kv_width() const { return kv_heads * head_dim; }
};

}  // namespace peftplan::models
