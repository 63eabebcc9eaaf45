// The step-program builder's entry points (program.h) and Builder::build, which runs the
// layers in order (builder.h): facts and layout, setup, then per micro-batch the forward through
// the layers, the loss and the backward with the strategy's reductions, and finally the
// optimizer step.
#include "peftplan/planner/program.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "builder.h"
#include "peftplan/common/error.h"
#include "peftplan/models/parameters.h"
#include "peftplan/planner/knobs.h"
#include "peftplan/planner/runtime.h"

namespace peftplan::planner {
namespace builder {

BuiltProgram Builder::build() {
  use_layout(reuse_layout_);
  make_tables();
  p_.ranks = s_.ranks;
  p_.micro_batches = static_cast<std::int32_t>(t_.grad_accum);
  p_.executable = in_.profile == RuntimeProfile::executor && executor_limitation(in_).empty();
  p_.compute_dtype = f_.compute_dtype;
  p_.tokens_per_step = t_.micro_batch * t_.seq_len * t_.grad_accum;
  // Reserve for the whole program at once: growing vectors of ~10^4 ops dominated build time.
  const auto per_mb = static_cast<std::size_t>(m_.layers) * (zero3() ? 200 : 160) + 64;
  p_.ops.reserve(per_mb * static_cast<std::size_t>(t_.grad_accum) + tensors_->size() + 64);
  p_.buffers.reserve(per_mb / 2 * static_cast<std::size_t>(t_.grad_accum) + tensors_->size() + 64);
  p_.deps.reserve(per_mb * static_cast<std::size_t>(t_.grad_accum) / 2);
  p_.operands.reserve(per_mb * static_cast<std::size_t>(t_.grad_accum) * 5);  // about half the ops compute, ~10 values each
  gathered_.assign(lay_.units.size(), -1);
  gather_op_.assign(lay_.units.size(), -1);
  ag_out_.assign(lay_.units.size(), -1);
  bucket_buf_.assign(lay_.buckets.size(), -1);
  setup();
  adapter_views();
  if (exec_z3() && s_.ranks == 1) {  // one rank: the gradients are the partition itself
    const std::uint64_t tw = bytes_of(f_.trainable_dtype);
    for (std::size_t u = 1; u < lay_.units.size(); ++u) {
      const Unit& un = lay_.units[u];
      if (un.flat_offset < 0) continue;
      auto views = [&](LinearPlan& lp) {
        if (!lp.adapter || lp.adapter->a_off < 0) return;
        Adapter& a = *lp.adapter;
        a.ga_buf = role(p_.add_view(std::string(), grad_shard_, tw * static_cast<std::uint64_t>(un.part_offset + a.a_off - un.flat_offset),
                                    tw * static_cast<std::uint64_t>(a.a_numel)),
                        sim::BufferRole::adapter_grad, a.a_tensor);
        a.gb_buf = role(p_.add_view(std::string(), grad_shard_, tw * static_cast<std::uint64_t>(un.part_offset + a.b_off - un.flat_offset),
                                    tw * static_cast<std::uint64_t>(a.b_numel)),
                        sim::BufferRole::adapter_grad, a.b_tensor);
      };
      if (u == lay_.units.size() - 1) for (auto& lp : lay_.head_linears) views(lp);
      else for (auto& lp : lay_.layer_linears[u - 1]) views(lp);
    }
  }
  // RoPE cos/sin tables [S, d/2] each, built once per step and read by every layer (rope_tables
  // {tables}: cos then sin).
  const bool rope = m_.rms_norm() || m_.arch == models::Arch::gpt_neox || m_.arch == models::Arch::falcon;
  if (rope) {
    const std::int64_t per_pos = rules_.rope_table_elems_per_pos > 0 ? static_cast<std::int64_t>(rules_.rope_table_elems_per_pos) * m_.head_dim
                                                                      : (m_.head_dim / 2) * 2;
    // The executor keeps them in fp32 whatever it computes in (its kernels rotate in fp32, ops.h
    // RopeTables); transformers casts them to the activations' dtype (LlamaRotaryEmbedding.forward:
    // cos.to(dtype=x.dtype)).
    const auto table = [&](std::int64_t n) { return in_.profile == RuntimeProfile::executor ? f32(n) : act(n); };
    rope_ = alloc([&] { return "rope.tables"; }, Cat::workspace, table(kv_len_ * per_pos), Phase::forward);
    compute("rope_tables", -1, Phase::forward, elementwise(table(kv_len_ * (m_.head_dim / 2) * 2)),
            ops::RopeTables{.tables = rope_, .S = kv_len_, .d = m_.head_dim, .theta = m_.rope_theta});
  }
  for (std::int32_t mb = 0; mb < p_.micro_batches; ++mb) micro_batch(mb);
  mb_ = -1;
  if (eval_) return BuiltProgram{std::move(p_), f_};
  free(rope_, Phase::backward);
  rope_ = -1;
  optimizer_step();
  return BuiltProgram{std::move(p_), f_};
}

}  // namespace builder

DType frozen_storage_dtype(const models::TensorInfo& t, DType base, DType compute) {
  return t.role == models::ParamRole::linear_weight ? base : compute;
}

ModelInventory make_inventory(const models::ModelSpec& model, const models::PeftSpec& peft) {
  ModelInventory inv;
  inv.tensors = models::parameter_tensors(model);
  inv.linears = models::linear_modules(model, inv.tensors);
  if (!peft.adapters.empty()) {
    inv.trainables = models::trainable_tensors(model, peft, inv.tensors, inv.linears);
    inv.loras = models::lora_modules(model, peft, inv.linears);
  }
  return inv;
}

std::string_view name_of(RuntimeProfile p) {
  switch (p) {
    case RuntimeProfile::executor: return "executor";
    case RuntimeProfile::deepspeed: return "deepspeed";
    case RuntimeProfile::hf: return "hf";
  }
  return "?";
}

namespace {

// What an adapter config trains in the base model's own half dtype ("" for nothing):
// modules_to_save copies, and base biases under bias "all" (every bias) or "lora_only" (the
// biases of the Linears this adapter adapts, peft tuners/lora/model.py
// _mark_only_adapters_as_trainable). Not with a quantised base:
// prepare_model_for_kbit_training casts every unquantised parameter to fp32 before PEFT copies
// them (peft utils/other.py), and not with an fp32 base.
std::string trained_in_base_dtype(const PlanInput& in) {
  const models::ModelSpec& m = in.model;
  if (in.peft.quantization || in.training.base_storage == DType::fp32) return "";
  const bool linear_bias = m.qkv_bias || m.out_bias || m.mlp_bias;
  for (const models::AdapterSpec& a : in.peft.adapters) {
    const auto& saved = a.type == models::PeftType::ia3 ? a.ia3.modules_to_save : a.lora.modules_to_save;
    if (!saved.empty()) return fmt::format("modules_to_save ({})", fmt::join(saved, ", "));
    if (a.type != models::PeftType::lora) continue;
    if (a.lora.bias == "all" && (linear_bias || m.norm_bias)) return "bias \"all\"";
    if (a.lora.bias == "lora_only" && linear_bias)
      for (const models::LoraModule& l : models::lora_modules(m, in.peft))
        if (l.adapter == a.name && l.linear.has_bias) return fmt::format("bias \"lora_only\" ({} has a bias)", l.linear.path);
  }
  return "";
}

}  // namespace

std::vector<std::string> validate(const PlanInput& in) {
  std::vector<std::string> warnings;
  const auto& t = in.training;
  const auto& s = in.strategy;
  auto positive = [](std::int64_t v, Knob k) {
    if (v <= 0) throw KnobError({k}, fmt::format("{} must be a positive integer, got {}", field_of(k), v));
  };
  positive(t.micro_batch, Knob::micro_batch);
  positive(t.seq_len, Knob::seq_len);
  positive(t.grad_accum, Knob::grad_accum);
  positive(s.ranks, Knob::ranks);
  positive(t.checkpoint_every, Knob::checkpoint_every);
  // The bounds of specs.h (kMaxSeqLen and the others): every byte count stays inside 64 bits.
  auto at_most = [](std::int64_t v, std::int64_t most, Knob k, std::string_view what) {
    if (v > most) throw KnobError({k}, fmt::format("{} must be at most {} ({}), got {}", field_of(k), most, what, v));
  };
  at_most(t.seq_len, kMaxSeqLen, Knob::seq_len, "2^20 tokens");
  at_most(t.micro_batch, kMaxMicroBatch, Knob::micro_batch, "2^16 sequences");
  at_most(t.grad_accum, kMaxGradAccum, Knob::grad_accum, "2^20 micro-steps");
  at_most(t.eval_batch, kMaxMicroBatch, Knob::eval_batch, "2^16 sequences");
  for (const auto& [batch, knob] : {std::pair{t.micro_batch, Knob::micro_batch}, std::pair{t.eval_batch, Knob::eval_batch}})
    if (batch * t.seq_len > kMaxBatchTokens)
      throw KnobError({knob, Knob::seq_len}, fmt::format("{} × {} must be at most 2^31 tokens per micro-batch, got {} × {}", field_of(knob),
                                                         field_of(Knob::seq_len), batch, t.seq_len));
  const std::string_view stage = name_of(s.stage);
  if (is_fsdp(s.stage) && in.profile != RuntimeProfile::hf)
    throw KnobError({Knob::stage, Knob::profile},
                    fmt::format("strategy.stage {}: FSDP is planned with profile hf (transformers + PEFT under torch FSDP through "
                                "accelerate), got profile {}", stage, name_of(in.profile)));
  if (is_fsdp(s.stage) && s.offload_optimizer == OffloadDevice::cpu)
    throw KnobError({Knob::offload_optimizer, Knob::offload_param, Knob::stage},
                    fmt::format("strategy.offload_optimizer cpu: FSDP has no optimizer-only offload; strategy.offload_param cpu is "
                                "FSDP's CPUOffload (fsdp_offload_params: parameters, gradients and the optimizer step on the host), "
                                "got strategy.stage {}", stage));
  if (s.offload_param == OffloadDevice::cpu && !can_offload_params(s.stage))
    throw KnobError({Knob::offload_param, Knob::stage},
                    fmt::format("strategy.offload_param cpu: parameter offload needs sharded parameters (strategy.stage zero3, "
                                "fsdp-full-shard, fsdp-shard-grad-op or fsdp-hybrid-shard), got strategy.stage {}", stage));
  if (is_fsdp(s.stage) && s.fsdp.version == 2 && s.stage != Stage::fsdp_full_shard && s.stage != Stage::fsdp_shard_grad_op)
    throw KnobError({Knob::fsdp_version, Knob::stage},
                    fmt::format("strategy.fsdp.version 2 with strategy.stage {}: FSDP2's fully_shard plans fsdp-full-shard "
                                "(reshard_after_forward true) and fsdp-shard-grad-op (false)", stage));
  // FSDP1 flattens each unit's parameters into one tensor of one dtype (torch 2.4
  // distributed/fsdp/_flat_param.py: "Must flatten tensors with uniform dtype"), so QLoRA under
  // FSDP stores the 4-bit weights in the compute dtype (bnb_4bit_quant_storage; transformers'
  // Trainer._fsdp_qlora_plugin_updates). A checkpoint saved quantised loads with the storage it
  // was saved with, and uint8 or int8 weights cannot be wrapped (bitsandbytes issue #1123).
  if (const auto& cq = in.model.checkpoint_quantization; is_fsdp(s.stage) && s.fsdp.version == 1 && cq) {
    const DType others = load_dtype(t);  // from_pretrained builds the other parameters in it
    const auto& storage = in.model.checkpoint_quant_storage;
    if (cq->dtype == DType::int8)
      throw KnobError({Knob::stage, Knob::fsdp_version},
                      fmt::format("strategy.stage {} with a checkpoint saved in 8-bit: FSDP1 flattens a unit's parameters into one tensor "
                                  "of one dtype and cannot hold int8 weights beside the {} ones; use ddp, zero1 or zero2",
                                  stage, peftplan::name_of(others)));
    if (storage != others)
      throw KnobError({Knob::stage, Knob::fsdp_version},
                      fmt::format("strategy.stage {} with a checkpoint saved quantised in {} storage: FSDP1 flattens a unit's parameters "
                                  "into one tensor of one dtype and cannot hold those 4-bit weights beside the {} ones; the checkpoint loads "
                                  "as saved (transformers keeps its quantization_config), so re-save it with bnb_4bit_quant_storage {}, "
                                  "or use ddp, zero1 or zero2",
                                  stage, storage ? std::string(peftplan::name_of(*storage)) : std::string("integer"), peftplan::name_of(others),
                                  others == DType::bf16 ? "bfloat16" : others == DType::fp16 ? "float16" : "float32"));
  }
  if (s.stage == Stage::fsdp_hybrid_shard && s.shard_group > 0 && s.ranks % s.shard_group != 0)
    throw KnobError({Knob::ranks, Knob::stage},
                    fmt::format("strategy.stage fsdp-hybrid-shard: strategy.ranks {} do not divide into shard groups of {} (the GPUs "
                                "per node)", s.ranks, s.shard_group));
  if (s.offload_optimizer == OffloadDevice::cpu && s.stage == Stage::ddp)  // FSDP's case is refused above
    throw KnobError({Knob::offload_optimizer, Knob::stage},
                    "strategy.offload_optimizer cpu: optimizer offload needs a ZeRO stage (zero1, zero2 or zero3), got strategy.stage ddp");
  // bitsandbytes' 8-bit AdamW is a GPU kernel (bitsandbytes 0.43.3 functional.py
  // optimizer_update_8bit_blockwise checks is_on_gpu first); DeepSpeed also refuses any client
  // optimizer under ZeRO-Offload (runtime/engine.py _configure_optimizer,
  // zero_force_ds_cpu_optimizer).
  if (host_step_refused(t.optimizer, s))
    throw KnobError({Knob::optimizer, is_fsdp(s.stage) ? Knob::offload_param : Knob::offload_optimizer},
                    fmt::format("training.optimizer adamw-8bit with strategy.{} cpu: bitsandbytes' 8-bit AdamW runs only on the GPU, and "
                                "this offload steps the optimizer on the host; use training.optimizer adamw (DeepSpeed's CPU Adam, "
                                "torch's AdamW under FSDP) or no offload",
                                is_fsdp(s.stage) ? "offload_param" : "offload_optimizer"));
  if (in.model.sliding_window && *in.model.sliding_window < t.seq_len)
    warnings.push_back(fmt::format("sliding_window {} < training.seq_len {}: attention is planned over the full sequence",
                                   *in.model.sliding_window, t.seq_len));
  if (t.cross_entropy == CrossEntropy::chunked) {
    // The fused loss computes the head's weight gradient in its forward, outside the plan's
    // gradient buffers: not planned yet.
    const auto inv = make_inventory(in.model, in.peft);
    const bool head_trains = in.peft.adapters.empty() ||
                             std::any_of(inv.loras.begin(), inv.loras.end(), [](const models::LoraModule& l) { return l.linear.is_output; });
    if (head_trains)
      throw KnobError({Knob::cross_entropy},
                      "training.cross_entropy chunked with a trainable LM head (full fine-tuning, or an adapter on lm_head) is not "
                      "planned; use training.cross_entropy standard");
  }
  if (in.profile == RuntimeProfile::deepspeed && !is_fsdp(s.stage) && !deepspeed_runs(s, t))
    throw KnobError({Knob::profile, Knob::precision, Knob::stage},
                    "training.precision bf16-pure with strategy.stage ddp under profile deepspeed: DeepSpeed runs pure bf16 only under "
                    "ZeRO (bf16_master_weights_and_grads), so the Trainer's own DDP runs this job; plan it with profile hf");
  // Liger's fused linear cross-entropy (transformers' use_liger_kernel patches the model's
  // forward) reads lm_head.weight by attribute, outside the head module's forward, so ZeRO-3's
  // fetch hook never gathers it and the matmul meets an empty shard (Liger-Kernel#1048; the
  // mechanism as trl#6372 explains it for its own fused losses). A head tied to the embedding
  // is gathered with it.
  if (s.stage == Stage::zero3 && t.cross_entropy == CrossEntropy::chunked && in.profile == RuntimeProfile::deepspeed &&
      !in.model.tie_embeddings)
    throw KnobError({Knob::cross_entropy, Knob::stage},
                    "training.cross_entropy chunked with strategy.stage zero3: Liger's fused loss reads the untied LM head's weight "
                    "outside its module, where ZeRO-3 never gathers it (a size mismatch at the first step); use "
                    "training.cross_entropy standard, ZeRO-1/2, or FSDP (profile hf)");
  if (is_zero_stage(s.stage) && in.profile == RuntimeProfile::hf)
    throw KnobError({Knob::stage, Knob::profile},
                    fmt::format("strategy.stage {} is DeepSpeed's ZeRO: plan it with profile deepspeed (the same transformers + PEFT "
                                "model side under DeepSpeed's engine); profile hf plans ddp and the FSDP strategies", stage));
  // The Trainer's fp16 without FSDP is torch.amp's GradScaler, whose unscale_ refuses fp16
  // gradients (torch/amp/grad_scaler.py _unscale_grads_, allow_fp16=False: "Attempting to unscale
  // FP16 gradients."), so a full fine-tune there keeps fp32 weights under autocast, which this
  // profile does not plan (its trainable weights are in the compute dtype). FSDP's
  // ShardedGradScaler allows fp16 gradients (torch/distributed/fsdp/sharded_grad_scaler.py), and
  // DeepSpeed's fp16 keeps fp32 masters of its fp16 weights.
  if (in.profile == RuntimeProfile::hf && t.precision == Precision::fp16_mixed && in.peft.adapters.empty() && !is_fsdp(s.stage))
    throw KnobError({Knob::precision, Knob::profile},
                    "training.precision fp16 with full fine-tuning under profile hf and strategy.stage ddp: the Trainer's GradScaler "
                    "refuses fp16 weights' gradients, and fp32 weights under autocast are not planned; plan it with profile deepspeed "
                    "(fp32 master weights), an FSDP strategy, or training.precision bf16");
  // The same holds for what PEFT trains in the base's dtype beside its adapters: a
  // modules_to_save copy (ModulesToSaveWrapper deep-copies the module) and the base's biases
  // (bias "all" or "lora_only"). autocast_adapter_dtype upcasts only the tuner layers' own
  // parameters (peft tuners/tuners_utils.py BaseTuner._cast_adapter_dtype skips every module that
  // is not a BaseTunerLayer), so under fp16 those stay fp16 and the first step's unscale_ fails.
  if (in.profile == RuntimeProfile::hf && t.precision == Precision::fp16_mixed && !is_fsdp(s.stage))
    if (const std::string what = trained_in_base_dtype(in); !what.empty())
      throw KnobError({Knob::precision, Knob::profile},
                      fmt::format("training.precision fp16 with {} under profile hf and strategy.stage ddp: PEFT trains it in the base's "
                                  "fp16 (only adapter layers are upcast to fp32), and the Trainer's GradScaler refuses fp16 gradients; "
                                  "plan it with profile deepspeed (fp32 master weights), an FSDP strategy, or training.precision bf16",
                                  what));
  if (in.profile == RuntimeProfile::executor && t.cross_entropy == CrossEntropy::chunked)
    throw KnobError({Knob::cross_entropy, Knob::profile},
                    "training.cross_entropy chunked: our executor computes the standard loss; plan it with profile hf or deepspeed");
  if (in.profile == RuntimeProfile::executor && (t.precision == Precision::fp16_mixed || t.precision == Precision::bf16_pure))
    warnings.push_back(fmt::format("the executor runs fp32 and bf16 mixed precision: training.precision {} is planned as fp32, and the "
                                   "executor refuses it", name_of(t.precision)));
  if (t.seq_len > in.model.max_positions && in.model.max_positions > 0)
    warnings.push_back(fmt::format("training.seq_len {} exceeds max_position_embeddings {}", t.seq_len, in.model.max_positions));
  return warnings;
}

std::string executor_limitation(const PlanInput& in) {
  if (in.profile != RuntimeProfile::executor)
    return fmt::format("profile is {}; plans for the executor use the executor profile", name_of(in.profile));
  const auto arch = in.model.arch;
  if (arch != models::Arch::llama && arch != models::Arch::mistral && arch != models::Arch::qwen2)
    return fmt::format("model_type {} (supported: llama, mistral, qwen2)", models::name_of(arch));
  if (in.model.is_moe()) return "mixture-of-experts models";
  if (in.model.sliding_window && *in.model.sliding_window < in.training.seq_len)
    return fmt::format("sliding_window {} < seq_len {} (the executor attends over the whole sequence)", *in.model.sliding_window,
                       in.training.seq_len);
  if (in.model.out_bias || in.model.mlp_bias) return "bias on o_proj or the MLP";
  const auto& st = in.strategy;
  if (st.offload_param != OffloadDevice::none && !can_offload_params(st.stage)) return "parameter offload without ZeRO-3 (it needs strategy.stage zero3)";
  if (st.offload_optimizer != OffloadDevice::none && !can_offload_optimizer(st.stage)) return "optimizer offload with ddp (it needs a ZeRO stage)";
  if (is_fsdp(st.stage)) return fmt::format("strategy {} (supported: ddp, zero1, zero2, zero3)", name_of(st.stage));
  const auto& t = in.training;
  if (t.optimizer != Optimizer::adamw) return fmt::format("optimizer {} (supported: adamw)", name_of(t.optimizer));
  if (t.full_finetune || in.peft.adapters.empty()) return "full fine-tuning (LoRA only)";
  if (in.peft.quantization) return "quantised base weights";
  if (t.base_storage && *t.base_storage != DType::fp32 && *t.base_storage != DType::bf16)
    return fmt::format("base storage {} (supported: fp32, bf16)", peftplan::name_of(*t.base_storage));
  if (in.peft.adapters.size() != 1) return fmt::format("{} adapters (one LoRA adapter)", in.peft.adapters.size());
  const auto& a = in.peft.adapters[0];
  if (a.type != models::PeftType::lora) return fmt::format("adapter type {} (LoRA only)", models::name_of(a.type));
  if (a.lora.use_dora || a.lora.lora_bias || a.lora.bias != "none" || !a.lora.modules_to_save.empty())
    return "DoRA, LoRA bias, bias != \"none\" or modules_to_save";
  if (t.cross_entropy != CrossEntropy::standard) return "the chunked cross-entropy (use standard)";
  if (t.precision == Precision::fp16_mixed || t.precision == Precision::bf16_pure)
    return fmt::format("precision {} (supported: fp32, bf16: fp16 needs loss scaling, pure bf16 bf16 moments)", name_of(t.precision));
  return {};
}

BuiltProgram build_program(const PlanInput& input, const BuildOptions& options) {
  validate(input);
  return builder::Builder(input, options).build();
}

}  // namespace peftplan::planner
