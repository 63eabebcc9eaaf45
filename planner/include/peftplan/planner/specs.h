// TrainingSpec and Strategy: how a model is trained (batch, precision, checkpointing, optimizer,
// base storage) and how it is distributed (DDP or ZeRO stage, offload, DeepSpeed's knobs).
// Plain aggregates; parsing of ds_config.json lives in ds_config.h, flags in cli/.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "peftplan/common/dtype.h"

namespace peftplan::planner {

enum class Precision {
  fp32,        // weights, activations and gradients in fp32
  fp16_mixed,  // fp16 compute, fp32 master weights and optimizer states (loss scaling)
  bf16_mixed,  // bf16 compute, fp32 master weights and optimizer states
  bf16_pure,   // bf16 everywhere, including optimizer states (no master copy)
};

enum class Checkpointing {
  none,         // every layer keeps its saved tensors
  full,         // each layer keeps only its input; the layer is recomputed in backward
  every_k,      // every k-th layer is checkpointed (TrainingSpec::checkpoint_every)
};

enum class Attention {
  eager,  // scores and probabilities [B, nh, S, S] materialised
  flash,  // fused kernel: only the log-sum-exp [B, nh, S] is saved
};

// How the loss is computed from the LM head: `standard` materialises the logits (and the runtime
// profile's loss chain upcasts them); `chunked` is a fused linear cross-entropy that never holds
// the whole logits (Liger-Kernel's LigerFusedLinearCrossEntropyLoss; torchtune's chunked loss is
// close to it).
enum class CrossEntropy { standard, chunked };

enum class Optimizer {
  adamw,        // two fp32 moments per trainable parameter (PyTorch AdamW)
  adamw_8bit,   // bitsandbytes 8-bit AdamW: two 1-byte moments + block quantisation state
  sgd_momentum, // one momentum buffer
};

// Bounds that keep every byte count of a plan inside 64 bits (an eager attention's scores,
// B × heads × S² × 4 bytes, are the largest) and are far beyond any run: a million-token
// sequence, 65,536 sequences per micro-batch, a million micro-steps, 2^31 tokens per micro-batch.
// validate() holds a plan to them; readers of files that set them (ds_config.json) name their key.
inline constexpr std::int64_t kMaxSeqLen = std::int64_t{1} << 20;
inline constexpr std::int64_t kMaxMicroBatch = std::int64_t{1} << 16;
inline constexpr std::int64_t kMaxGradAccum = std::int64_t{1} << 20;
inline constexpr std::int64_t kMaxBatchTokens = std::int64_t{1} << 31;
// The most ranks a job may name (an accelerate config's num_processes, a ds_config's implied
// world, recommend's --gpus list): a thousand times the largest published training job.
inline constexpr std::int64_t kMaxRanks = 1'000'000;

struct TrainingSpec;
// The dtype from_pretrained(torch_dtype=...) builds the model in for a training precision: fp32,
// fp16 under fp16 mixed precision, else bf16. The load peaks and FSDP1's one-dtype units read it.
DType load_dtype(const TrainingSpec& t);

struct TrainingSpec {
  std::int64_t micro_batch = 1;        // B: sequences per rank per micro-step
  std::int64_t seq_len = 2048;         // S: tokens per sequence
  std::int64_t grad_accum = 1;         // micro-steps per optimizer step
  Precision precision = Precision::bf16_mixed;
  Checkpointing checkpointing = Checkpointing::none;
  std::int64_t checkpoint_every = 1;   // k for Checkpointing::every_k
  bool checkpoint_reentrant = true;    // torch.utils.checkpoint(use_reentrant=True), what the
                                       // Trainer's gradient_checkpointing uses; false for FSDP's
                                       // own activation checkpointing (NO_REENTRANT)
  Attention attention = Attention::flash;
  CrossEntropy cross_entropy = CrossEntropy::standard;
  Optimizer optimizer = Optimizer::adamw;
  std::optional<DType> base_storage;   // frozen weights' dtype; default: the compute dtype
                                       // (nf4/int8 when PeftSpec::quantization is set)
  bool full_finetune = false;          // every weight trains (no adapter)
  // The evaluation loop's sequences per rank (the Trainer's per_device_eval_batch_size, 8 by
  // default); 0: the job does not evaluate. Only the evaluation peak reads it.
  std::int64_t eval_batch = 8;
  // Optimisation hyper-parameters: carried to the executor and to ds_config.json.
  double lr = 1e-4;
  double weight_decay = 0.0;
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_eps = 1e-8;
  double grad_clip = 0.0;              // global-norm clipping; 0 = off (DeepSpeed code default)
};

// How data parallelism places model states: DDP; DeepSpeed's ZeRO stages; torch FSDP's sharding
// strategies as accelerate names them (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD).
enum class Stage { ddp, zero1, zero2, zero3, fsdp_full_shard, fsdp_shard_grad_op, fsdp_no_shard, fsdp_hybrid_shard };

constexpr bool is_fsdp(Stage s) {
  return s == Stage::fsdp_full_shard || s == Stage::fsdp_shard_grad_op || s == Stage::fsdp_no_shard || s == Stage::fsdp_hybrid_shard;
}
// Parameters sharded at rest (gathered for compute).
constexpr bool shards_params(Stage s) {
  return s == Stage::zero3 || s == Stage::fsdp_full_shard || s == Stage::fsdp_shard_grad_op || s == Stage::fsdp_hybrid_shard;
}
// Gradients reduce-scattered into shards (with more than one rank).
constexpr bool shards_grads(Stage s) { return s == Stage::zero2 || shards_params(s); }
constexpr bool is_zero_stage(Stage s) { return s == Stage::zero1 || s == Stage::zero2 || s == Stage::zero3; }
// Optimizer states sharded.
constexpr bool shards_optimizer(Stage s) { return s != Stage::ddp && s != Stage::fsdp_no_shard; }
// How many kinds of model state a stage shards: 0 DDP and FSDP NO_SHARD, 1 ZeRO-1 (optimizer
// states), 2 ZeRO-2 and SHARD_GRAD_OP (+ gradients), 3 ZeRO-3, FULL_SHARD and HYBRID_SHARD
// (+ parameters at rest). The recommender orders strategies by it.
constexpr int sharding_level(Stage s) {
  switch (s) {
    case Stage::ddp: case Stage::fsdp_no_shard: return 0;
    case Stage::zero1: return 1;
    case Stage::zero2: case Stage::fsdp_shard_grad_op: return 2;
    case Stage::zero3: case Stage::fsdp_full_shard: case Stage::fsdp_hybrid_shard: return 3;
  }
  return 0;
}
enum class OffloadDevice { none, cpu };
// What a strategy can keep on the host: the one statement of the rule, which ds_config, the
// builder, the closed forms, `estimate` and the executor all ask (each names its own field or
// flag in its message). Parameters: a strategy that shards them (DeepSpeed's offload_param is
// stage 3 only, deepspeed/runtime/zero/config.py; FSDP's CPUOffload with a sharding strategy).
// The optimizer alone: a ZeRO stage (ZeRO-Offload; DDP has no optimizer partition to move, and
// FSDP has no optimizer-only offload: fsdp_offload_params moves parameters, gradients and the
// step together).
constexpr bool can_offload_params(Stage s) { return shards_params(s); }
constexpr bool can_offload_optimizer(Stage s) { return is_zero_stage(s); }

// DeepSpeed's zero_optimization knobs with DeepSpeed's *code* defaults
// (deepspeed/runtime/zero/config.py; the docs differ where marked).
struct DeepSpeedKnobs {
  std::int64_t reduce_bucket_size = 500'000'000;        // elements
  std::int64_t allgather_bucket_size = 500'000'000;     // elements
  std::optional<bool> overlap_comm;                     // code: None => true for stage 3, else false
  bool contiguous_gradients = true;
  std::int64_t stage3_prefetch_bucket_size = 50'000'000;        // elements (docs table: 5e8)
  std::int64_t stage3_param_persistence_threshold = 100'000;    // elements
  std::int64_t stage3_max_live_parameters = 1'000'000'000;      // elements
  std::int64_t stage3_max_reuse_distance = 1'000'000'000;       // elements
  std::int64_t sub_group_size = 1'000'000'000;                  // elements (docs example: 1e12)
  bool offload_pin_memory = false;                      // offload_*.pin_memory (code default)

  bool overlap(bool stage3) const { return overlap_comm.value_or(stage3); }
};

// torch FSDP's knobs as accelerate's FullyShardedDataParallelPlugin sets them (accelerate 1.0.1
// utils/dataclasses.py defaults; `accelerate launch` sets use_orig_params, sync_module_states and
// cpu_ram_efficient_loading to true).
enum class FsdpPrefetch { backward_pre, backward_post, none };
struct FsdpKnobs {
  FsdpPrefetch backward_prefetch = FsdpPrefetch::backward_pre;
  bool forward_prefetch = false;
  bool use_orig_params = true;
  bool cpu_ram_efficient_loading = true;
  bool sync_module_states = true;
  bool activation_checkpointing = false;  // FSDP's checkpoint_wrapper (non-reentrant)
  std::string auto_wrap_policy = "TRANSFORMER_BASED_WRAP";
  std::string state_dict_type = "SHARDED_STATE_DICT";
  // 1: FSDP1, FullyShardedDataParallel's flat parameters; 2: FSDP2, fully_shard's per-parameter
  // DTensor shards (accelerate fsdp_version: 2, where fsdp_reshard_after_forward true / false is
  // FULL_SHARD / SHARD_GRAD_OP).
  std::int32_t version = 1;
  bool operator==(const FsdpKnobs&) const = default;
};

struct Strategy {
  Stage stage = Stage::ddp;
  std::int32_t ranks = 1;                        // N: data-parallel size (all GPUs)
  OffloadDevice offload_optimizer = OffloadDevice::none;  // ZeRO-Offload (stages 1-3)
  OffloadDevice offload_param = OffloadDevice::none;      // ZeRO-3 only
  std::int32_t shard_group = 0;  // FSDP HYBRID_SHARD: ranks that shard among themselves (a node);
                                 // 0: all of them
  DeepSpeedKnobs ds;
  FsdpKnobs fsdp;
};

// Whether FSDP's own activation checkpointing (accelerate's fsdp_activation_checkpointing: a
// non-reentrant checkpoint_wrapper on every decoder layer) carries a configuration's
// checkpointing: an FSDP strategy whose knob asks for it, on a row that checkpoints every layer
// without reentrancy. The launch files then leave the Trainer's gradient_checkpointing off
// (transformers trainer.py, create_accelerator_and_postprocess, refuses the two together), and
// a row that checkpoints otherwise writes the knob off.
bool fsdp_checkpoints_layers(const Strategy& s, const TrainingSpec& t);

// Whether DeepSpeed can run the strategy at all (not FSDP; DDP not in pure bf16, which DeepSpeed
// runs under ZeRO only): what a ds_config.json can say. Plan files say the rest in accelerate's
// YAML, and the planner plans the rest with the hf profile (what runs them).
bool deepspeed_runs(const Strategy& strategy, const TrainingSpec& training);

// Whether the optimizer steps on the host: ZeRO-Offload's optimizer offload, or FSDP's
// CPUOffload (fsdp_offload_params: parameters, gradients and the step on the host).
constexpr bool steps_on_host(const Strategy& s) {
  return s.offload_optimizer == OffloadDevice::cpu || (is_fsdp(s.stage) && s.offload_param == OffloadDevice::cpu);
}

// An optimizer that cannot step where the strategy steps it: bitsandbytes' 8-bit AdamW, a GPU
// kernel, with the step on the host (planner::validate says why).
constexpr bool host_step_refused(Optimizer o, const Strategy& s) { return o == Optimizer::adamw_8bit && steps_on_host(s); }

// Spellings, as flags, plan.json, reports and the GUI write them: each value's in name_of alone
// (specs.cpp), and every reader parses through it (from_name below), so a new spelling is one
// line. Checkpointing::every_k is "every-k" (flags spell it every-K with the K).
std::string_view name_of(Precision p);
std::string_view name_of(Checkpointing c);
std::string_view name_of(Attention a);
std::string_view name_of(Optimizer o);
std::string_view name_of(CrossEntropy c);
std::string_view name_of(Stage s);
std::string_view name_of(OffloadDevice d);

// Every enumerator, in order; the static_asserts tie each list to its enum (a new enumerator
// that is not listed, or a reordering, does not compile).
inline constexpr std::array kPrecisions = {Precision::fp32, Precision::fp16_mixed, Precision::bf16_mixed, Precision::bf16_pure};
inline constexpr std::array kCheckpointings = {Checkpointing::none, Checkpointing::full, Checkpointing::every_k};
inline constexpr std::array kAttentions = {Attention::eager, Attention::flash};
inline constexpr std::array kCrossEntropies = {CrossEntropy::standard, CrossEntropy::chunked};
inline constexpr std::array kOptimizers = {Optimizer::adamw, Optimizer::adamw_8bit, Optimizer::sgd_momentum};
inline constexpr std::array kStages = {Stage::ddp,           Stage::zero1,           Stage::zero2,
                                       Stage::zero3,         Stage::fsdp_full_shard, Stage::fsdp_shard_grad_op,
                                       Stage::fsdp_no_shard, Stage::fsdp_hybrid_shard};
inline constexpr std::array kOffloadDevices = {OffloadDevice::none, OffloadDevice::cpu};

// The list holds enumerators 0 .. last in order.
template <typename E, std::size_t N>
constexpr bool lists_every(const std::array<E, N>& all, E last) {
  for (std::size_t i = 0; i < N; ++i)
    if (static_cast<std::size_t>(all[i]) != i) return false;
  return static_cast<std::size_t>(last) + 1 == N;
}
static_assert(lists_every(kPrecisions, Precision::bf16_pure));
static_assert(lists_every(kCheckpointings, Checkpointing::every_k));
static_assert(lists_every(kAttentions, Attention::flash));
static_assert(lists_every(kCrossEntropies, CrossEntropy::chunked));
static_assert(lists_every(kOptimizers, Optimizer::sgd_momentum));
static_assert(lists_every(kStages, Stage::fsdp_hybrid_shard));
static_assert(lists_every(kOffloadDevices, OffloadDevice::cpu));

// The value among `values` whose name_of() is `name`.
template <typename E, std::size_t N>
std::optional<E> from_name(std::string_view name, const std::array<E, N>& values) {
  for (E e : values)
    if (name_of(e) == name) return e;
  return std::nullopt;
}
// "a, b, c": the valid spellings, for messages.
template <typename E, std::size_t N>
std::string names_of(const std::array<E, N>& values) {
  std::string out;
  for (E e : values) (out += out.empty() ? "" : ", ") += name_of(e);
  return out;
}

}  // namespace peftplan::planner
