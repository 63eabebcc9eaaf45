// Building the step program (sim/program.h) for one rank and one optimizer step from the model,
// the adapters, the training settings and the strategy. One builder serves every strategy: the
// strategy decides where gathers, reductions, offload copies and frees go; the runtime profile
// decides what sits outside the model (framework buffers, CUDA context).
//
// What is saved for backward (the executor does exactly this; GPU frameworks approximately):
//   per layer: the layer input, norm statistics, q/k/v after RoPE, attention probabilities
//   (eager) or log-sum-exp (flash), the attention output before o_proj only when o_proj trains
//   (adapter or full fine-tuning), the input of a frozen projection only when an adapter on it
//   needs it, the MLP gate and up outputs, and each adapter's [M, r] intermediate.
// Full checkpointing keeps only the layer input and recomputes the rest in backward (workspace).
//
// The program is complete for the executor (RuntimeProfile::executor, replicated strategies):
// every compute op names its operands in Op::args (the convention of each kernel is documented
// where program.cpp emits it), every temporary a kernel needs is a buffer (LoRA backward scratch,
// attention-backward scratch, RoPE tables, bf16 -> fp32 weight copies, logits), and adapter
// tensors and their gradients are views (sim::Buffer::view_of) into trainable.flat and grad.flat
// in the order of the trainable inventory.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "peftplan/models/model_spec.h"
#include "peftplan/models/peft.h"
#include "peftplan/planner/specs.h"
#include "peftplan/sim/program.h"

namespace peftplan::planner {

// What sits outside the model and how precise the prediction is.
enum class RuntimeProfile {
  executor,   // our own engine (exact): fp32 or bf16 mixed-precision compute, no framework buffers,
              // no CUDA context
  deepspeed,  // DeepSpeed ZeRO: bucket buffers, persistence threshold, CUDA context
  hf,         // transformers + PEFT in eager PyTorch (Trainer / TRL / accelerate, DDP's 25 MiB
              // buckets): runtime.cpp lists its rules and the versions they were read from
};
std::string_view name_of(RuntimeProfile p);
inline constexpr std::array kRuntimeProfiles = {RuntimeProfile::executor, RuntimeProfile::deepspeed, RuntimeProfile::hf};
static_assert(lists_every(kRuntimeProfiles, RuntimeProfile::hf));

// Rows per causal block in the executor's attention, eager and flash (executor/cpu/attention.cpp):
// each block of rows multiplies only the key columns up to its last row. The builder counts that
// work for RuntimeProfile::executor; the executor's CPU kernels use this constant.
inline constexpr std::int64_t kExecAttentionRows = 64;

// What the builder derives from the model and adapters alone (inventories and adapter
// resolution). It is a third of a build's time; a search over strategies and batch sizes makes it
// once with make_inventory() and shares it through PlanInput::inventory.
struct ModelInventory {
  std::vector<models::TensorInfo> tensors;
  std::vector<models::LinearModule> linears;
  std::vector<models::TrainableTensor> trainables;  // empty for full fine-tuning
  std::vector<models::LoraModule> loras;
};
ModelInventory make_inventory(const models::ModelSpec& model, const models::PeftSpec& peft);

struct PlanInput {
  models::ModelSpec model;
  models::PeftSpec peft;            // no adapters => full fine-tuning
  TrainingSpec training;
  Strategy strategy;
  RuntimeProfile profile = RuntimeProfile::deepspeed;
  std::shared_ptr<const ModelInventory> inventory;  // optional: make_inventory(model, peft)
  std::string alloc_conf;  // PYTORCH_CUDA_ALLOC_CONF for the caching allocator model ("": defaults)
  int device_sm = 0;  // the GPU's compute capability (major x 10 + minor; make_plan sets it from
                      // the cluster), for library defaults that depend on it; 0: unknown
};

// Byte sizes the builder derived (also shown to users as the "why" of a plan).
struct ProgramFacts {
  std::int64_t base_params = 0;        // frozen parameters (unique)
  std::int64_t trainable_params = 0;   // parameters with gradients
  std::uint64_t base_bytes = 0;        // frozen weights in storage dtype, whole model
  std::int64_t largest_layer_params = 0;
  DType compute_dtype = DType::bf16;   // activations and GEMM inputs
  DType base_dtype = DType::bf16;      // frozen weight storage
  DType trainable_dtype = DType::bf16; // trainable weights and their gradients
  bool master_weights = false;         // fp32 master copy in the optimizer
  std::int64_t fsdp_unit_passes = 0;   // FSDP1: Σ over its units (the root, each decoder layer,
                                       //   each PEFT adapter Linear) of the forward, recompute
                                       //   and backward passes that run its hooks, per step
  friend bool operator==(const ProgramFacts&, const ProgramFacts&) = default;
};

// The dtype a frozen tensor is stored in, the one rule the builder's sizes and the executor's
// weights both follow: Linear weights in the base storage dtype (`base`: bf16, or a quantised
// dtype, which applies to Linear weights only since bitsandbytes replaces nn.Linear), every other
// frozen tensor (embeddings, norms, biases) in the compute dtype (`compute`).
DType frozen_storage_dtype(const models::TensorInfo& t, DType base, DType compute);

struct BuiltProgram {
  sim::Program program;
  ProgramFacts facts;
};

struct BuildOptions {
  bool names = true;  // name every buffer ("layers.3.mb0.attn.probs"); searches turn it off
  // The evaluation loop's forward instead of a training step: every layer under torch.no_grad
  // (nothing saved, each layer's input freed once it has run), the loss, and nothing after it
  // (no backward, no optimizer step). Only the hf loss chain stops there; the input's training
  // spec gives the batch.
  bool evaluation = false;
  // Take the layout (the modules, units, buckets and offsets: planner/layout.h) from the cache of
  // recent ones when the input brings an inventory; false makes it afresh (tests compare the two).
  bool reuse_layout = true;
};

// What keeps the CPU executor from running this input, in words ("mixture-of-experts models"),
// or empty when it can: an executor-profile program of such an input is marked
// Program::executable (every operand named and sized, sim/ops.h). The executor refuses the
// others with this text.
std::string executor_limitation(const PlanInput& input);

// Throws InputError for combinations no engine supports (offload_param without ZeRO-3, ...).
BuiltProgram build_program(const PlanInput& input, const BuildOptions& options = {});

// Checks the input for contradictions; returns warnings, throws KnobError (knobs.h: an
// InputError whose message names the PlanInput fields) for errors.
std::vector<std::string> validate(const PlanInput& input);

}  // namespace peftplan::planner
