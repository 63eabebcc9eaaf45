// What a training runtime does around the model's arithmetic, as rules the step-program builder
// applies: the dtypes it gives adapters and optimizer states, what autograd saves per op, how the
// loss is computed, when gradients exist, and what it allocates outside the model. One rule per
// field, read from the runtime's source (cited where each profile sets it, runtime.cpp); the
// builder asks these questions and never the profile's name.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "peftplan/planner/specs.h"

namespace peftplan::planner {

struct PlanInput;

// How the loss turns the LM head's logits into the cross-entropy and its gradient.
enum class LossChain {
  // The logits upcast to fp32 once (freeing the compute-dtype logits), cross-entropy in place:
  // what our executor does.
  upcast_in_place,
  // transformers 4.46-4.48 ForCausalLMLoss: the model keeps its logits until forward returns,
  // the loss upcasts them (.float()), copies the shifted logits (logits[..., :-1, :].contiguous())
  // and log_softmax saves its fp32 result; backward allocates nll_loss's and log_softmax's
  // gradients, the slice's full-length zero-filled gradient and the cast back.
  hf_shift_copy,
};

struct RuntimeRules {
  std::string_view versions;  // the library versions the rules were read from ("" for executor)
  // --- parameters and optimizer ---
  std::optional<DType> adapter_dtype;  // adapter weights (and their gradients and optimizer
                                       // states); nullopt: the compute dtype
  bool fp32_norms_on_kbit = false;     // a 4/8-bit base keeps its norm weights in fp32, which
                                       // makes the residual stream and the MLP fp32
  bool states_follow_params = false;   // optimizer states in the parameter dtype (torch.optim)
  bool foreach_step_temp = false;      // AdamW's foreach step holds one state-sized temporary
  bool grads_only_in_backward = false; // gradients allocated in backward, freed after the step
  bool per_tensor_allocations = false; // gradients, optimizer states and the foreach temporary
                                       // are one tensor per parameter, each allocated when
                                       // first needed (Buffer::pieces; the allocator replay)
  bool fp32_master_for_mixed = true;   // mixed precision keeps an fp32 master copy of
                                       // low-precision trainable weights in the optimizer
  // --- what autograd saves ---
  bool adapter_owns_input = false;     // each adapter saves its own (cast, dropped-out) input
                                       // and, with dropout, a 1-byte keep mask
  bool norm_saves_fp32_input = false;  // RMSNorm saves x.to(fp32), not x (and not its output)
  bool unfused_swiglu = false;         // SwiGLU as silu(gate) * up: the mul keeps silu(gate)
  bool eager_softmax_fp32 = false;     // eager attention's softmax in fp32, cast back: both kept
  bool layer_input_only_if_saved = false;  // a layer's input lives only while something saves it
  bool autocast_weight_cache = false;  // autocast caches compute-dtype copies of fp32 leaf
                                       // weights (adapters) for the forward
  bool free_at_last_use = false;       // a tensor nothing saves is freed when its last consumer
                                       // has run (reference counting), not at the layer's end
  bool fsdp_hook_retains_checkpoint_grads = false;  // FSDP1's multi-grad hook on a frozen unit's
                                       // checkpointed input keeps it and its gradient to the end
                                       // of backward
  bool eager_elementwise = false;      // every elementwise op of the module code is its own kernel
                                       // (its bytes: Eager in program.cpp); adapter GEMMs in the
                                       // adapter's dtype
  LossChain loss = LossChain::upcast_in_place;
  // --- outside the model ---
  int cublas_workspaces = 0;           // cuBLAS workspaces in the caching allocator
  std::uint64_t batch_bytes_per_token = 8;  // the micro-batch's token tensors on the device
  std::uint64_t rope_table_elems_per_pos = 0;  // cos/sin elements per position (0: the
                                               // builder's [S, d/2] x 2 tables)
  std::uint64_t context_bytes = 0;     // CUDA context and libraries outside the allocator
  std::uint64_t nccl_first_bytes = 0;  // NCCL's own memory for a process's first communicator
                                       // (its device code, channels, proxy), outside the allocator
  std::uint64_t nccl_bytes = 0;        // ... and for each further communicator
  // --- time ---
  double fsdp_unit_pass_host_s = 0.0;  // FSDP1: host seconds per unit pass the device waits
                                       // for (ProgramFacts::fsdp_unit_passes; the step's floor)
  double sustained = 1.0;              // fraction of the GPU roofline's rates (the GEMM curve at
                                       // the MAMF plateau, the streaming bandwidth) the device's
                                       // compute kernels sustain over a whole step (sim
                                       // SimOptions::sustained); a cluster file's
                                       // efficiency.sustained overrides it
};

// The rules of input.profile for this input (dtypes depend on precision and quantisation).
RuntimeRules runtime_rules(const PlanInput& input);

// cuBLAS's default workspace per (handle, stream) on a GPU of compute capability `sm` (major x
// 10 + minor; 0 when unknown).
std::uint64_t cublas_workspace_bytes(int sm);

}  // namespace peftplan::planner
