// The runtime profiles' rules (runtime.h). Each rule of the `hf` profile was read in the source
// of the versions it names; docs/research/hf-memory-model.md walks through them with line
// numbers and checks them, byte for byte, against the published fms-acceleration runs.
#include "peftplan/planner/runtime.h"

#include "peftplan/planner/program.h"

namespace peftplan::planner {

// aten/src/ATen/cuda/CublasHandlePool.cpp (torch 2.4), parseChosenWorkspaceSize: without
// CUBLAS_WORKSPACE_CONFIG the default is ":4096:8" (32 MiB) on sm90 and ":4096:2:16:8"
// (4096 KiB x 2 + 16 KiB x 8 = 8,519,680 B) elsewhere; getNewWorkspace takes it from the caching
// allocator, so it counts in torch.cuda.memory_allocated.
std::uint64_t cublas_workspace_bytes(int sm) {
  if (sm == 90) return 4096ull * 1024 * 8;
  return 4096ull * 1024 * 2 + 16ull * 1024 * 8;
}

namespace {

// What transformers' model code and PEFT do under any launcher (the Trainer, accelerate,
// DeepSpeed): the saved tensors, the loss, the batch, eager PyTorch's kernels and allocations.
void model_side(RuntimeRules& r) {
  // Saved tensors (tools/autograd/derivatives.yaml, gen_variable_type.py guard_for): a frozen
  // mm saves no activation; PEFT lora.Linear.forward casts x to lora_A's dtype and drops it out
  // per target module (native_dropout saves the bool mask, the mm saves the dropped input);
  // MistralRMSNorm / LlamaRMSNorm compute in fp32 (pow and mul save hidden_states.to(fp32));
  // flash-attn's FlashAttnFunc saves q, k, v, out and the log-sum-exp; MistralMLP computes
  // down(act(gate(x)) * up(x)), so the mul keeps act(gate(x)) and up(x), SiLU keeps gate(x).
  r.adapter_owns_input = true;
  r.norm_saves_fp32_input = true;
  r.unfused_swiglu = true;
  // The Llama family's eager_attention_forward: softmax(..., dtype=torch.float32).to(query.dtype).
  r.eager_softmax_fp32 = true;
  r.layer_input_only_if_saved = true;
  r.free_at_last_use = true;  // eager PyTorch frees a tensor with its last reference
  // Eager PyTorch runs each op of the Python module code as a kernel of its own (no fusion);
  // an fp32 matmul stays fp32 (torch.backends.cuda.matmul.allow_tf32 is False by default since
  // torch 1.12, and the Trainer's tf32 flag is unset).
  r.eager_elementwise = true;
  r.loss = LossChain::hf_shift_copy;
  r.cublas_workspaces = 2;  // the main thread's and the autograd device thread's handles
  // The Trainer's default DataCollatorWithPadding: input_ids, attention_mask and labels, int64.
  r.batch_bytes_per_token = 24;
  // LlamaRotaryEmbedding / MistralRotaryEmbedding: cos and sin of shape [1, S, head_dim] in the
  // compute dtype (emb = cat(freqs, freqs)).
  r.rope_table_elems_per_pos = 2;  // x head_dim
  // The CUDA context with lazy module loading (CUDA >= 11.7): pytorch/pytorch#107667 and
  // #20532 report 300-400 MiB; outside the caching allocator (nvidia-smi sees it,
  // torch.cuda.memory_allocated does not).
  r.context_bytes = 300ull << 20;
  // NCCL allocates its channels, proxy and scratch buffers (and loads its device code) itself,
  // outside PyTorch's allocator. A process's first communicator: NVIDIA/nccl#864 reports about
  // 1.6 GB in use once one communicator is set up and has run an all-reduce, the CUDA context
  // included, so NCCL's share is 1.6 GB less the context above. Each further communicator (a
  // second process group): NVIDIA/nccl#964 measures about 544 MB per 2-GPU group on 4 x A100
  // with NVLink, group after group.
  r.nccl_first_bytes = 1'600'000'000 - r.context_bytes;
  r.nccl_bytes = 544'000'000;
  // Eager PyTorch's kernels over a whole training step reach this share of the roofline's rates
  // (GEMMs on the MAMF curve, elementwise kernels at the streaming bandwidth): sustained clocks
  // under a full load, kernel tails and the gaps between ~10^4 launches per step, which no single
  // benchmark sees. Fitted, not cited: tools/fit_sustained.py on the published dense one-GPU rows
  // (tests/data/published/A1, A3, A4: transformers 4.48.1 + PEFT 0.13.2 on an A100-80GB) prints
  //   sustained = 0.904  (fitted on A1, A3, A4; rms log error 0.0210)
  // and the other seven rows are its check (README, "Published measurements").
  r.sustained = 0.904;
}

}  // namespace

RuntimeRules runtime_rules(const PlanInput& in) {
  RuntimeRules r;
  switch (in.profile) {
    case RuntimeProfile::executor:
      // Our executor (executor/): every buffer is in the program; tokens are int32 ids and
      // targets; no library outside it. Under bf16 mixed precision it keeps fp32 master weights
      // of its partition, as DeepSpeed does (fp32_master_for_mixed, the rule's default).
      return r;
    case RuntimeProfile::deepspeed:
      // The HF model under DeepSpeed's engine: the model side as under hf. DeepSpeed casts the
      // whole module to the 16-bit dtype (engine.py _configure_distributed_model:
      // module.bfloat16() / half()), adapters and norms included, and keeps fp32 master weights
      // and moments in its optimizer (stage_1_and_2.py single_partition_of_fp32_groups); its
      // Adam is fused (no foreach temporary); its gradient partitions and buckets persist.
      model_side(r);
      r.versions = "DeepSpeed ZeRO (runtime/zero/config.py defaults) with transformers 4.48.1 and peft 0.13.2 model code";
      return r;
    case RuntimeProfile::hf:
      break;
  }
  // transformers 4.48.1 + PEFT 0.13.2 (+ TRL 0.13.0, accelerate 1.0.1, bitsandbytes 0.43.3) on
  // torch 2.4.1: the Trainer's training_step in eager PyTorch.
  model_side(r);
  r.versions = "torch 2.4.1, transformers 4.48.1, peft 0.13.2, trl 0.13.0, accelerate 1.0.1, bitsandbytes 0.43.3";
  // FSDP2 needs accelerate >= 1.6 (fsdp_version: 2; FSDP2_PYTORCH_VERSION 2.6.0 from 1.7) and
  // so a newer torch: its sharding, all-gather and reduce-scatter buffers are read from torch
  // 2.6's torch/distributed/fsdp/_fully_shard (Builder::fsdp2_copy_out, unit_gradients_done).
  if (is_fsdp(in.strategy.stage) && in.strategy.fsdp.version == 2)
    r.versions = "torch 2.6 (FSDP2 fully_shard; the model side as torch 2.4.1), transformers 4.48.1, peft 0.13.2, trl 0.13.0, "
                 "accelerate 1.7 (fsdp_version 2), bitsandbytes 0.43.3";
  const bool mixed = in.training.precision == Precision::bf16_mixed || in.training.precision == Precision::fp16_mixed;
  // PEFT get_peft_model(autocast_adapter_dtype=True) (mapping.py, the default) upcasts bf16 and
  // fp16 adapters to fp32 (tuners_utils.py _cast_adapter_dtype); on a 4-bit base they are created
  // in fp32 and never cast (the base weight is uint8).
  r.adapter_dtype = DType::fp32;
  // peft utils/other.py prepare_model_for_kbit_training casts every non-quantised parameter to
  // fp32; TRL's peft_module_casting_to_bf16 (trainer/utils.py) casts embed_tokens and lm_head
  // back to bf16 and leaves modules named "norm" in fp32. Linear4bit returns out.to(x.dtype), so
  // an fp32 norm's output keeps the residual stream and the MLP in fp32.
  r.fp32_norms_on_kbit = true;
  // torch/optim/adamw.py: exp_avg and exp_avg_sq are zeros_like(param); _multi_tensor_adamw (the
  // foreach default on CUDA) computes exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs), a copy of v.
  r.states_follow_params = true;
  r.foreach_step_temp = true;
  r.fp32_master_for_mixed = false;  // torch.optim steps the parameters in their own dtype
  // Trainer: optimizer.step() then model.zero_grad() (set_to_none=True since torch 2.0):
  // AccumulateGrad allocates .grad in backward, and the step frees it.
  r.grads_only_in_backward = true;
  // The caching allocator sees these as tensors of their own, not one flat buffer: AccumulateGrad
  // allocates each parameter's .grad when backward first reaches it (torch/csrc/autograd/
  // functions/accumulate_grad.h), AdamW's _init_group creates exp_avg and exp_avg_sq with
  // zeros_like(p) per parameter on the first step() (torch/optim/adamw.py), and _foreach_sqrt
  // returns one tensor per parameter. Only DDP's unsharded parameters (FSDP steps flat shards).
  r.per_tensor_allocations = true;
  // torch autocast caches the casts of leaf tensors that require grad (the fp32 adapters)
  // until the autocast region that accelerate opens around forward closes.
  r.autocast_weight_cache = mixed;
  // torch 2.4 FSDP1 (see Builder::layer_backward); docs/research/fsdp-memory-model.md §2.5.
  r.fsdp_hook_retains_checkpoint_grads = true;
  // FSDP1's hooks run in Python per unit per pass (_runtime_utils.py _pre_forward /
  // _post_forward / _pre_backward_hook / _post_backward_hook: unshard, _use_unsharded_views,
  // reshard), and limit_all_gathers (_limiter_utils.py, two reshards in flight) keeps the CPU
  // from running further ahead, so with PEFT's hundreds of adapter units the host time sets a
  // floor under the step. The published A5 and A7 measure the same step (2.78 s) with 0.3 s
  // different GPU work, which only a floor gives. Fitted, not cited: tools/fit_fsdp_host.py on
  // every published FSDP row (A2, A5, A7, A8, A10) prints
  //   fsdp_unit_pass_host_s = 0.003209  (fitted on A10, A2, A5, A7, A8; rms log error 0.0874)
  r.fsdp_unit_pass_host_s = 0.003209;
  return r;
}

}  // namespace peftplan::planner
