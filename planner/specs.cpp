// Names of the spec enums, as flags and JSON spell them.
#include "peftplan/planner/specs.h"

namespace peftplan::planner {

std::string_view name_of(Precision p) {
  switch (p) {
    case Precision::fp32: return "fp32";
    case Precision::fp16_mixed: return "fp16";
    case Precision::bf16_mixed: return "bf16";
    case Precision::bf16_pure: return "bf16-pure";
  }
  return "?";
}

std::string_view name_of(Checkpointing c) {
  switch (c) {
    case Checkpointing::none: return "none";
    case Checkpointing::full: return "full";
    case Checkpointing::every_k: return "every-k";
  }
  return "?";
}

std::string_view name_of(Attention a) { return a == Attention::eager ? "eager" : "flash"; }

std::string_view name_of(Optimizer o) {
  switch (o) {
    case Optimizer::adamw: return "adamw";
    case Optimizer::adamw_8bit: return "adamw-8bit";
    case Optimizer::sgd_momentum: return "sgd";
  }
  return "?";
}

std::string_view name_of(CrossEntropy c) {
  switch (c) {
    case CrossEntropy::standard: return "standard";
    case CrossEntropy::chunked: return "chunked";
  }
  return "?";
}

std::string_view name_of(Stage s) {
  switch (s) {
    case Stage::ddp: return "ddp";
    case Stage::zero1: return "zero1";
    case Stage::zero2: return "zero2";
    case Stage::zero3: return "zero3";
    case Stage::fsdp_full_shard: return "fsdp-full-shard";
    case Stage::fsdp_shard_grad_op: return "fsdp-shard-grad-op";
    case Stage::fsdp_no_shard: return "fsdp-no-shard";
    case Stage::fsdp_hybrid_shard: return "fsdp-hybrid-shard";
  }
  return "?";
}

std::string_view name_of(OffloadDevice d) { return d == OffloadDevice::cpu ? "cpu" : "none"; }

bool deepspeed_runs(const Strategy& s, const TrainingSpec& t) {
  // Pure bf16 under DeepSpeed is ZeRO's (bf16_master_weights_and_grads: write_ds_config refuses
  // it for stage 0), while the Trainer's own DDP trains a bf16 model as it is.
  return !is_fsdp(s.stage) && !(s.stage == Stage::ddp && t.precision == Precision::bf16_pure);
}

bool fsdp_checkpoints_layers(const Strategy& s, const TrainingSpec& t) {
  return is_fsdp(s.stage) && s.fsdp.activation_checkpointing && t.checkpointing == Checkpointing::full && !t.checkpoint_reentrant;
}

DType load_dtype(const TrainingSpec& t) {
  return t.precision == Precision::fp32 ? DType::fp32 : t.precision == Precision::fp16_mixed ? DType::fp16 : DType::bf16;
}

}  // namespace peftplan::planner
