// The step-program builder and plans: walks checked against sizes computed by hand, strategies
// against what the ZeRO paper and DeepSpeed say they change, and communication volumes against
// the ZeRO paper's §7.
#include <algorithm>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "peftplan/sim/ops.h"
#include "peftplan/common/error.h"
#include "peftplan/models/config.h"
#include "peftplan/models/parameters.h"
#include "peftplan/models/peft.h"
#include "peftplan/planner/closed_forms.h"
#include "peftplan/planner/ds_config.h"
#include "peftplan/planner/plan.h"
#include "peftplan/planner/saved.h"
#include "peftplan/sim/verify.h"
#include "peftplan/sim/cluster.h"

using namespace peftplan;
using namespace peftplan::planner;
using sim::MemCategory;

namespace {

std::uint64_t peak(const sim::MemoryProfile& m, MemCategory c) { return m.category_peak_bytes[static_cast<std::size_t>(c)]; }
sim::MemoryProfile walk_memory_of(const PlanInput& in) { return sim::walk_memory(build_program(in).program); }

models::PeftSpec lora(std::int64_t r, double alpha, std::vector<std::string> targets) {
  models::AdapterSpec a;
  a.lora.r = r;
  a.lora.alpha = alpha;
  a.lora.targets.kind = models::ModuleSelector::Kind::list;
  a.lora.targets.names = std::move(targets);
  return models::PeftSpec{{a}, std::nullopt};
}

PlanInput tiny_input() {
  PlanInput in;
  in.model = models::load_model("tiny-llama-2l");
  in.peft = lora(4, 8, {"q_proj", "v_proj"});
  in.training.micro_batch = 2;
  in.training.seq_len = 8;
  in.training.precision = Precision::fp32;
  in.training.attention = Attention::eager;
  in.profile = RuntimeProfile::executor;
  return in;
}

PlanInput llama7b_lora(Stage stage, std::int32_t ranks) {
  PlanInput in;
  in.model = models::load_model("llama-2-7b");
  in.peft = lora(16, 32, {"q_proj", "v_proj"});
  in.training.micro_batch = 1;
  in.training.seq_len = 2048;
  in.strategy.stage = stage;
  in.strategy.ranks = ranks;
  return in;
}

// GPT-2 small, full fine-tuning in fp16 mixed precision with eager attention, 2 x 512 tokens:
// Korthikanti et al.'s setting (16-bit activations, the scores materialised).
PlanInput gpt2_full_fp16_eager() {
  PlanInput in;
  in.model = models::load_model("gpt2");
  in.training.full_finetune = true;
  in.training.precision = Precision::fp16_mixed;
  in.training.attention = Attention::eager;
  in.training.micro_batch = 2;
  in.training.seq_len = 512;
  return in;
}

}  // namespace

// tiny-llama-2l (H 64, I 176, 4 heads of 16, 2 kv heads, V 256, untied), LoRA r=4 on q_proj and
// v_proj, B=2, S=8 (M=16 tokens), fp32, eager attention, one rank. Every number by hand:
TEST(Program, TinyModelWalkMatchesHandSizes) {
  const auto built = build_program(tiny_input());
  const sim::MemoryProfile m = sim::walk_memory(built.program);
  // Frozen base: 125,248 parameters (models/zoo/SOURCES.md) x 4 bytes.
  EXPECT_EQ(peak(m, MemCategory::base_weights), 125'248u * 4);
  // Adapter: per layer q 4*(64+64) + v 4*(64+32) = 896; two layers = 1,792 parameters.
  EXPECT_EQ(built.facts.trainable_params, 1792);
  EXPECT_EQ(peak(m, MemCategory::trainable_weights), 1792u * 4);
  EXPECT_EQ(peak(m, MemCategory::gradients), 1792u * 4);
  EXPECT_EQ(peak(m, MemCategory::optimizer_states), 1792u * 8);  // AdamW m and v in fp32
  // Saved per layer (bytes, fp32): layer input 16*64*4 = 4096; RMSNorm rstd 16*4 = 64; norm
  // output 4096 (LoRA on q/v reads it); q 4096, k 2048, v 2048; probabilities 2*4*8*8*4 = 2048;
  // LoRA u for q and v 16*4*4 = 256 each; residual after attention 4096; rstd 64; gate and up
  // 16*176*4 = 11264 each. Sum 45,696. Two layers, plus the last layer's output 4096 and the
  // final norm's rstd 64: 95,552.
  EXPECT_EQ(peak(m, MemCategory::activations), 95'552u);
  // Nothing outside the model in our own engine.
  EXPECT_EQ(peak(m, MemCategory::runtime_overhead), 0u);
  EXPECT_EQ(peak(m, MemCategory::comm_buffers), 0u);
  EXPECT_EQ(peak(m, MemCategory::gathered_weights), 0u);
  // Everything allocated in the step is freed by its end; only setup buffers remain.
  std::uint64_t setup = 0;
  for (const auto& op : built.program.ops)
    if (op.kind == sim::OpKind::alloc && op.phase == sim::Phase::setup) setup += built.program.buffers[static_cast<std::size_t>(op.buffer)].bytes;
  std::uint64_t end = 0;
  for (auto b : m.end_bytes) end += b;
  EXPECT_EQ(end, setup);
}

TEST(Program, CheckpointingKeepsOnlyLayerInputs) {
  PlanInput in = tiny_input();
  in.training.checkpointing = Checkpointing::full;
  const sim::MemoryProfile m = sim::walk_memory(build_program(in).program);
  // Layer inputs 2 x 4096, the last output 4096, final rstd 64.
  EXPECT_EQ(peak(m, MemCategory::activations), 3u * 4096 + 64);
  in.training.checkpointing = Checkpointing::none;
  EXPECT_GT(peak(sim::walk_memory(build_program(in).program), MemCategory::activations), 3u * 4096 + 64);
}

// A tied head (GPT-2, Gemma: lm_head is the embedding's weight) computes with the embedding unit's
// gathered weight under the executor's ZeRO-3 in its forward and in its backward, each a gather of
// its own: the program kept the forward's view for the backward, a buffer no longer live
// (found by tests/test_series.cpp's random sample).
TEST(Program, TiedHeadReadsTheGatherOfItsOwnPhaseUnderExecutorZero3) {
  for (const char* model : {"gpt2", "gemma-2-9b"})
    for (Checkpointing ck : {Checkpointing::none, Checkpointing::full}) {
      PlanInput in;
      in.model = models::load_model(model);
      models::AdapterSpec a;
      a.lora.r = 8;
      in.peft.adapters.push_back(a);
      in.profile = RuntimeProfile::executor;
      in.strategy.stage = Stage::zero3;
      in.strategy.ranks = 2;
      in.training.seq_len = 256;
      in.training.micro_batch = 2;
      in.training.checkpointing = ck;
      const sim::Program p = build_program(in, BuildOptions{.names = false}).program;
      EXPECT_TRUE(sim::verify(p).empty()) << model << " " << name_of(ck) << ": " << sim::verify(p).front().detail;
    }
}

TEST(Program, PlanJsonIsTheWalk) {
  const Plan p = make_plan(tiny_input(), sim::default_cluster(1));
  const auto j = plan_to_json(p);
  const sim::MemoryProfile m = sim::walk_memory(p.program);
  for (int c = 0; c < sim::kNumDeviceCategories; ++c) {
    const std::string key = std::string(sim::name_of(static_cast<MemCategory>(c))) + "_bytes";
    EXPECT_EQ(j["memory"]["device"][key].get<std::uint64_t>(), m.category_peak_bytes[static_cast<std::size_t>(c)]) << key;
  }
  EXPECT_EQ(j["memory"]["device"]["peak_bytes"].get<std::uint64_t>(), m.device_peak_bytes);
  EXPECT_TRUE(j["fits"].get<bool>());
}

// With LoRA on a base that fits, ZeRO-1/2 shard only the adapter's gradients and optimizer states
// (the seed text and peft docs/accelerate/deepspeed.md); ZeRO-3 divides base_weights by N and
// adds gathered_weights.
TEST(Strategies, LoraZero12ChangeOnlyAdapterTerms) {
  const auto ddp = make_plan(llama7b_lora(Stage::ddp, 8), sim::resolve_cluster("8xA100-80GB"));
  for (Stage s : {Stage::zero1, Stage::zero2}) {
    const auto z = make_plan(llama7b_lora(s, 8), sim::resolve_cluster("8xA100-80GB"));
    for (auto c : {MemCategory::base_weights, MemCategory::trainable_weights, MemCategory::activations, MemCategory::workspace,
                   MemCategory::gathered_weights})
      EXPECT_EQ(peak(z.memory, c), peak(ddp.memory, c)) << sim::name_of(c);
    EXPECT_LT(peak(z.memory, MemCategory::optimizer_states), peak(ddp.memory, MemCategory::optimizer_states));
    EXPECT_NE(z.explanation.front().find("adapter only"), std::string::npos) << z.explanation.front();
  }
  const auto z3 = make_plan(llama7b_lora(Stage::zero3, 8), sim::resolve_cluster("8xA100-80GB"));
  const std::uint64_t base = peak(ddp.memory, MemCategory::base_weights);
  // Shards of every flattened unit plus the small persistent tensors (norms) kept whole.
  EXPECT_NEAR(static_cast<double>(peak(z3.memory, MemCategory::base_weights)), static_cast<double>(base) / 8.0, 0.01 * static_cast<double>(base) / 8.0);
  EXPECT_GT(peak(z3.memory, MemCategory::gathered_weights), 0u);
  EXPECT_NE(z3.explanation.front().find("base_weights is divided by N"), std::string::npos);
}

// DeepSpeed's estimate_zero2_model_states_mem_needs (stage_1_and_2.py, after PR #5099):
// gpu = 2P + 18P/N, "2 = params_16bit, 18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit +
// 8_optimizer_states_32bit". The program's model-state buffers (16-bit weights, 16-bit gradient
// partition, fp32 master and Adam partitions, and the fp32 gradient partition at the step) add
// up to the same for full fine-tuning.
TEST(ClosedForms, WalkEqualsDeepSpeedZero2Estimate) {
  PlanInput in;
  in.model = models::load_model("tiny-llama-2l");
  in.training.full_finetune = true;
  in.training.precision = Precision::bf16_mixed;
  in.strategy.stage = Stage::zero2;
  in.strategy.ranks = 4;
  const auto built = build_program(in);
  const std::int64_t P = 125'248;  // divisible by 4: no padding
  std::uint64_t states = 0;
  for (const auto& op : built.program.ops) {
    if (op.kind != sim::OpKind::alloc) continue;
    const auto& b = built.program.buffers[static_cast<std::size_t>(op.buffer)];
    const bool model_state = b.category == MemCategory::trainable_weights || b.category == MemCategory::optimizer_states ||
                             b.name == "grad.shard" || b.name == "grad.fp32";
    if (model_state) states += b.bytes;
  }
  const auto ds = ds_estimate_zero2(P, 4, 1, false);
  EXPECT_EQ(states, ds.gpu_bytes);
  EXPECT_EQ(states, 2u * P + 18u * P / 4);
}

// ZeRO paper §7: per step and rank, DDP and ZeRO-1/2 move 2Ψ(n-1)/n elements, ZeRO-3 3Ψ(n-1)/n
// (two all-gathers of the parameters and one reduce-scatter of the gradients).
TEST(Communication, FullFineTuningVolumesFollowTheZeroPaper) {
  for (std::int32_t n : {4, 8}) {
    for (Stage s : {Stage::ddp, Stage::zero1, Stage::zero2, Stage::zero3}) {
      PlanInput in;
      in.model = models::load_model("tiny-llama-2l");
      in.training.full_finetune = true;
      in.training.seq_len = 64;
      in.strategy.stage = s;
      in.strategy.ranks = n;
      const Plan p = make_plan(in, sim::resolve_cluster(fmt::format("{}xA100-80GB", n)), {true, false});
      const double psi_bytes = 125'248.0 * 2;  // bf16 parameters and gradients
      const double factor = s == Stage::zero3 ? 3.0 : 2.0;
      EXPECT_DOUBLE_EQ(static_cast<double>(p.time->intra_node_bytes), factor * psi_bytes * (n - 1) / n)
          << name_of(s) << " n=" << n;
    }
  }
}

// With LoRA, DDP moves only adapter gradients; ZeRO-3 moves the frozen base twice (forward and
// backward gathers) plus the adapter (gathered twice, its gradients reduce-scattered once).
TEST(Communication, LoraTrafficIsAdapterForDdpAndBaseForZero3) {
  const auto cluster = sim::resolve_cluster("8xA100-80GB");
  const Plan ddp = make_plan(llama7b_lora(Stage::ddp, 8), cluster);
  const std::uint64_t adapter = 8'388'608u * 2;
  EXPECT_EQ(ddp.time->collective_bytes[static_cast<std::size_t>(sim::Collective::all_reduce)], adapter);
  EXPECT_EQ(ddp.time->collective_bytes[static_cast<std::size_t>(sim::Collective::all_gather)], 0u);
  PlanInput z3in = llama7b_lora(Stage::zero3, 8);
  z3in.strategy.ds.stage3_param_persistence_threshold = 0;  // gather every tensor
  const Plan z3 = make_plan(z3in, cluster);
  const std::uint64_t base = 6'738'415'616u * 2;  // bf16, divisible by 8 per unit here
  EXPECT_EQ(z3.time->collective_bytes[static_cast<std::size_t>(sim::Collective::all_gather)], 2 * base + 2 * adapter);
  EXPECT_EQ(z3.time->collective_bytes[static_cast<std::size_t>(sim::Collective::reduce_scatter)], adapter);
  EXPECT_GT(z3.time->intra_node_bytes, 300 * ddp.time->intra_node_bytes);
}

// The seed's argument: on a slow network ZeRO-3's gathers are exposed, on NVLink mostly hidden.
TEST(Communication, EthernetExposesZero3NvlinkHidesIt) {
  const auto eth = sim::resolve_cluster("2x8xA100-80GB-100GbE");
  const auto nvl = sim::resolve_cluster("8xA100-80GB");
  const Plan ddp_eth = make_plan(llama7b_lora(Stage::ddp, 16), eth);
  const Plan z3_eth = make_plan(llama7b_lora(Stage::zero3, 16), eth);
  const Plan z3_nvl = make_plan(llama7b_lora(Stage::zero3, 8), nvl);
  EXPECT_GT(z3_eth.time->exposed_comm_s, 50 * ddp_eth.time->exposed_comm_s);
  EXPECT_GT(z3_eth.time->step_s, ddp_eth.time->step_s);
  EXPECT_LT(z3_nvl.time->exposed_comm_s, 0.25 * z3_nvl.time->comm_s);
}

// Korthikanti et al. 2022 (arXiv 2205.05198) Table 2, no parallelism: sbh(34 + 5as/h) bytes per
// layer with 16-bit activations, which counts dropout masks (attention 1·as²b, two residual
// dropouts 1·sbh each) and the attention dropout output (2·as²b). We train without dropout, so
// the same layer saves sbh(34 + 5as/h) - 2sbh - 3as²b, plus the LayerNorm statistics (mean and
// rstd in fp32, 2 x 4sb per norm) that the paper leaves out.
TEST(Activations, GptLayerMatchesKorthikantiWithoutDropout) {
  const PlanInput in = gpt2_full_fp16_eager();
  const auto built = build_program(in);
  std::uint64_t layer0 = 0;
  for (const auto& b : built.program.buffers)
    if (b.category == MemCategory::activations && b.name.rfind("layers.0.", 0) == 0 && b.name.find("resid_out") == std::string::npos)
      layer0 += b.bytes;
  for (const auto& b : built.program.buffers)  // the layer input is the embedding output
    if (b.name == "embed.mb0.out") layer0 += b.bytes;
  for (const auto& b : built.program.buffers)  // fused c_attn output and the projections' outputs
    if (b.category == MemCategory::activations && b.name.rfind("transformer.h.0.", 0) == 0) layer0 += b.bytes;
  const double s = 512, bsz = 2, h = 768, a = 12;
  const double korthikanti = s * bsz * h * (34 + 5 * a * s / h);
  const double without_dropout = korthikanti - 2 * s * bsz * h - 3 * a * s * s * bsz;
  EXPECT_EQ(static_cast<double>(layer0), without_dropout + 2 * 2 * 4 * s * bsz);
}

// The same GPT-2 layer through its saved-for-backward table, row by row against Korthikanti et
// al.'s itemisation (arXiv 2205.05198 §4.1, 16-bit activations): the QKV input (LN1's output)
// 2sbh, Q, K and V 6sbh (the fused c_attn output), the softmax output 2as²b, the output
// projection's input 2sbh, LN2's input 2sbh, FC1's input 2sbh, GELU's input 8sbh and FC2's
// input 8sbh; the layer's output is the next layer's LN1 input, 2sbh.
TEST(SavedTable, GptLayerRowsAreKorthikantisItems) {
  const PlanInput in = gpt2_full_fp16_eager();
  const SavedTable t = saved_for_backward(in, 3);
  const std::uint64_t s = 512, b = 2, h = 768, a = 12, sbh = s * b * h;
  auto kept = [&](std::string_view name, std::string_view module = {}) {
    const SavedTensor* r = t.find(name, module);
    EXPECT_NE(r, nullptr) << name;
    if (!r) return std::uint64_t{0};
    EXPECT_TRUE(r->kept) << name;
    return r->bytes();
  };
  EXPECT_EQ(kept("norm1.out"), 2 * sbh);
  EXPECT_EQ(kept("out", "transformer.h.3.attn.c_attn"), 6 * sbh);
  EXPECT_EQ(kept("attn.probs"), 2 * a * s * s * b);
  EXPECT_EQ(shape_text(*t.find("attn.probs")), "[2, 12, 512, 512]");
  EXPECT_EQ(kept("attn.out"), 2 * sbh);
  EXPECT_EQ(kept("resid_mid"), 2 * sbh);
  EXPECT_EQ(kept("norm2.out"), 2 * sbh);
  EXPECT_EQ(kept("out", "transformer.h.3.mlp.c_fc"), 8 * sbh);
  EXPECT_EQ(kept("mlp.act"), 8 * sbh);
  EXPECT_EQ(kept("resid_out"), 2 * sbh);
  EXPECT_EQ(kept("norm1.stats") + kept("norm2.stats"), 2 * 2 * 4 * s * b);  // LayerNorm mean and rstd in fp32
  // The two projections whose outputs only the residual adds read are not kept.
  ASSERT_NE(t.find("out", "transformer.h.3.attn.c_proj"), nullptr);
  EXPECT_FALSE(t.find("out", "transformer.h.3.attn.c_proj")->kept);
  EXPECT_FALSE(t.find("out", "transformer.h.3.mlp.c_proj")->kept);
  const double korthikanti = static_cast<double>(sbh) * (34 + 5.0 * a * s / h);
  EXPECT_EQ(static_cast<double>(t.kept_bytes()), korthikanti - 2.0 * sbh - 3.0 * a * s * s * b + 2 * 2 * 4 * s * b);
  EXPECT_THROW(saved_for_backward(in, 12), InputError);  // gpt2 has layers 0-11
}

// The table is what the program allocates: for each runtime profile, the activations layer 1's
// forward allocates and still holds when the forward ends are the table's kept rows. A builder
// that allocated another size, dtype or set than its table would fail here.
TEST(SavedTable, IsWhatEachProfileAllocates) {
  for (const RuntimeProfile profile : {RuntimeProfile::executor, RuntimeProfile::deepspeed, RuntimeProfile::hf}) {
    // The executor: eager and flash attention (it runs no quantised base); the HF profiles:
    // flash, with and without a 4-bit base.
    const bool exec = profile == RuntimeProfile::executor;
    for (const auto& [qlora, attention] : {std::pair{false, exec ? Attention::eager : Attention::flash}, std::pair{!exec, Attention::flash}}) {
      PlanInput in = llama7b_lora(Stage::ddp, 1);
      in.profile = profile;
      in.model = models::load_model("tiny-llama-2l");
      in.model.layers = 4;  // layer 1 has a layer after it (the last one's output is the head's input)
      in.peft.adapters[0].lora.dropout = 0.05;
      in.training.seq_len = 64;
      in.training.micro_batch = 2;
      in.training.attention = attention;
      if (qlora) in.peft.quantization = models::Quantization{};
      if (profile == RuntimeProfile::executor) in.training.precision = Precision::fp32;
      const SavedTable t = saved_for_backward(in, 1);
      const sim::Program p = build_program(in).program;
      std::set<std::int32_t> live;
      for (const sim::Op& op : p.ops) {
        if (op.micro_batch != 0 || (op.kind != sim::OpKind::alloc && op.kind != sim::OpKind::free)) continue;
        if (op.phase != sim::Phase::forward) continue;
        const std::string& name = p.buffers[static_cast<std::size_t>(op.buffer)].name;
        if (name.rfind("layers.1.mb0.", 0) != 0 && name.rfind("model.layers.1.", 0) != 0) continue;
        if (op.kind == sim::OpKind::alloc) live.insert(op.buffer);
        else live.erase(op.buffer);
      }
      std::uint64_t held = 0;
      for (std::int32_t b : live)
        if (p.buffers[static_cast<std::size_t>(b)].category == MemCategory::activations) held += p.buffers[static_cast<std::size_t>(b)].bytes;
      EXPECT_EQ(held, t.kept_bytes()) << name_of(profile) << " " << name_of(in.training.attention) << (in.peft.quantization ? " QLoRA" : "");
      EXPECT_GT(t.kept_bytes(), 0u);
    }
  }
  // The runtime rules show in the rows: transformers' LlamaRMSNorm saves its fp32 input, our
  // executor's norm does not.
  PlanInput in = llama7b_lora(Stage::ddp, 1);
  in.model = models::load_model("tiny-llama-2l");
  in.profile = RuntimeProfile::hf;
  EXPECT_NE(saved_for_backward(in, 1).find("norm1.x_fp32"), nullptr);
  in.profile = RuntimeProfile::executor;
  in.training.precision = Precision::fp32;
  in.training.attention = Attention::eager;
  EXPECT_EQ(saved_for_backward(in, 1).find("norm1.x_fp32"), nullptr);
  // Attention's output, o_proj's input, with o_proj frozen: flash attention keeps it for its
  // backward (FlashAttnFunc's save_for_backward; SDPA's flash kernel's backward takes `output`);
  // eager attention's P·V matmul saves its inputs instead and the frozen o_proj's mm saves none.
  for (const RuntimeProfile profile : {RuntimeProfile::hf, RuntimeProfile::deepspeed, RuntimeProfile::executor})
    for (const Attention attention : {Attention::eager, Attention::flash}) {
      in.profile = profile;
      in.training.attention = attention;
      const SavedTable table = saved_for_backward(in, 1);
      const SavedTensor* out = table.find("attn.out");
      ASSERT_NE(out, nullptr);
      EXPECT_EQ(out->kept, attention == Attention::flash) << name_of(profile) << " " << name_of(attention);
    }
}

// --- FSDP (torch FSDP1 through accelerate, --profile hf) ---------------------------------------
// Model states per GPU against hand sizes: every unit (the embedding, each decoder layer, the
// head) flattened and split over N ranks, ceil(numel / N) elements each (torch
// distributed/fsdp/_flat_param.py _get_shard pads the flat parameter to a multiple of N).
namespace fsdp_hand {

struct Units {
  std::vector<std::int64_t> frozen, trainable;  // per unit: embedding, layers, head
};

Units units_of(const PlanInput& in) {
  const auto tensors = models::parameter_tensors(in.model);
  Units u;
  u.frozen.assign(static_cast<std::size_t>(in.model.layers) + 2, 0);
  u.trainable = u.frozen;
  const bool full = in.peft.adapters.empty();
  for (const auto& t : tensors) {
    const std::size_t i = t.layer >= 0 ? static_cast<std::size_t>(t.layer) + 1
                          : t.role == models::ParamRole::embedding ? 0 : u.frozen.size() - 1;
    (full ? u.trainable : u.frozen)[i] += t.numel();
  }
  if (!full) {
    const auto linears = models::linear_modules(in.model, tensors);
    for (const auto& t : models::trainable_tensors(in.model, in.peft, tensors, linears)) {
      const std::size_t i = t.name.find("layers.") != std::string::npos
                                ? static_cast<std::size_t>(std::stoll(t.name.substr(t.name.find("layers.") + 7))) + 1
                                : u.frozen.size() - 1;
      u.trainable[i] += t.numel();
    }
  }
  return u;
}

std::uint64_t bytes_named(const sim::Program& p, const std::string& name) {
  for (const auto& b : p.buffers)
    if (b.name == name) return b.bytes;
  ADD_FAILURE() << "no buffer " << name;
  return 0;
}

PlanInput mistral(std::int32_t ranks, bool lora_adapter) {
  PlanInput in;
  in.model = models::load_model("mistral-7b");
  if (lora_adapter) in.peft = lora(16, 16, {"q_proj", "k_proj", "v_proj", "o_proj"});
  in.training.micro_batch = 1;
  in.training.seq_len = 512;
  in.training.precision = Precision::bf16_pure;
  in.training.checkpointing = Checkpointing::full;
  in.strategy.stage = Stage::fsdp_full_shard;
  in.strategy.ranks = ranks;
  in.profile = RuntimeProfile::hf;
  return in;
}

}  // namespace fsdp_hand

TEST(Fsdp, FullShardModelStatesAreAShardOfEveryUnit) {
  using namespace fsdp_hand;
  for (std::int32_t n : {2, 8}) {
    for (bool adapter : {false, true}) {
      SCOPED_TRACE(fmt::format("{} ranks, {}", n, adapter ? "LoRA" : "full fine-tuning"));
      const PlanInput in = mistral(n, adapter);
      const sim::Program p = build_program(in).program;
      const Units u = units_of(in);
      auto sh = [&](std::int64_t x) { return static_cast<std::uint64_t>((x + n - 1) / n); };
      // Trainable weights: bf16 in full fine-tuning, fp32 adapters (PEFT autocast_adapter_dtype).
      const std::uint64_t tw = adapter ? 4 : 2;
      std::int64_t trainable = 0;
      for (std::size_t i = 0; i < u.frozen.size(); ++i) {
        const std::string name = i == 0 ? "embedding" : i + 1 == u.frozen.size() ? "head" : fmt::format("layers.{}", i - 1);
        if (u.frozen[i] > 0) {
          EXPECT_EQ(bytes_named(p, name + ".frozen.shard"), sh(2 * u.frozen[i])) << name;
        }
        if (u.trainable[i] > 0) {
          EXPECT_EQ(bytes_named(p, name + ".trainable.shard"), tw * sh(u.trainable[i])) << name;
        }
        trainable += u.trainable[i];
      }
      // Gradients: a shard in the parameters' dtype; AdamW's m and v in it too (torch.optim).
      EXPECT_EQ(bytes_named(p, "grad.shard"), tw * sh(trainable));
      EXPECT_EQ(bytes_named(p, "optimizer.states"), 2 * tw * sh(trainable));
    }
  }
}

// FSDP2 (fully_shard) shards each parameter on dim 0: ceil(d0 / N) rows on every rank, padded
// (torch/distributed/fsdp/_fully_shard/_fsdp_param.py _init_sharded_param, _chunk_with_empty),
// so a unit's shard is the sum over its parameters, not ceil(unit numel / N). With Mistral's
// dims the two agree at 2 and 8 ranks; at 3 ranks the rows of k_proj (1024), the norms (4096)
// and lora_A (r = 16) do not divide and each parameter pads on its own.
TEST(Fsdp, Fsdp2ShardsEveryParameterOnItsFirstDimension) {
  using namespace fsdp_hand;
  for (std::int32_t n : {2, 8, 3}) {
    for (bool adapter : {false, true}) {
      SCOPED_TRACE(fmt::format("{} ranks, {}", n, adapter ? "LoRA" : "full fine-tuning"));
      PlanInput in = mistral(n, adapter);
      in.strategy.fsdp.version = 2;
      const sim::Program p = build_program(in).program;
      EXPECT_TRUE(sim::verify(p).empty());
      auto rows = [&](std::int64_t d0) { return (d0 + n - 1) / n; };
      std::vector<std::int64_t> frozen(static_cast<std::size_t>(in.model.layers) + 2, 0), trainable = frozen;
      const auto tensors = models::parameter_tensors(in.model);
      for (const auto& t : tensors) {
        const std::size_t i = t.layer >= 0 ? static_cast<std::size_t>(t.layer) + 1 : t.role == models::ParamRole::embedding ? 0 : frozen.size() - 1;
        (adapter ? frozen : trainable)[i] += rows(t.shape[0]) * (t.numel() / t.shape[0]);
      }
      if (adapter) {
        const auto linears = models::linear_modules(in.model, tensors);
        for (const auto& t : models::trainable_tensors(in.model, in.peft, tensors, linears))
          trainable[static_cast<std::size_t>(t.layer) + 1] += rows(t.shape[0]) * (t.numel() / t.shape[0]);  // [16, in], [out, 16]
      }
      const std::uint64_t tw = adapter ? 4 : 2;
      std::int64_t total = 0;
      for (std::size_t i = 0; i < frozen.size(); ++i) {
        const std::string name = i == 0 ? "embedding" : i + 1 == frozen.size() ? "head" : fmt::format("layers.{}", i - 1);
        if (frozen[i] > 0) {
          EXPECT_EQ(bytes_named(p, name + ".frozen.shard"), 2 * static_cast<std::uint64_t>(frozen[i])) << name;
        }
        if (trainable[i] > 0) {
          EXPECT_EQ(bytes_named(p, name + ".trainable.shard"), tw * static_cast<std::uint64_t>(trainable[i])) << name;
        }
        total += trainable[i];
      }
      EXPECT_EQ(bytes_named(p, "grad.shard"), tw * static_cast<std::uint64_t>(total));
      EXPECT_EQ(bytes_named(p, "optimizer.states"), 2 * tw * static_cast<std::uint64_t>(total));
      // Against FSDP1's flat shards: equal where every dim-0 divides, more at 3 ranks.
      PlanInput v1 = in;
      v1.strategy.fsdp.version = 1;
      const sim::Program p1 = build_program(v1).program;
      if (n == 3) {
        const std::string layer0 = adapter ? "layers.0.frozen.shard" : "layers.0.trainable.shard";
        EXPECT_GT(bytes_named(p, layer0), bytes_named(p1, layer0));
      } else {
        EXPECT_EQ(bytes_named(p, "grad.shard"), bytes_named(p1, "grad.shard"));
      }
    }
  }
}

// FSDP2's buffers around one unit: the flat all-gather output beside the unsharded parameters it
// is copied into, and in backward a reduce-scatter input per unit; no record_stream flag, and no
// FSDP1 input-hook retention.
TEST(Fsdp, Fsdp2CopiesOutEachAllGatherAndHoldsOneReduceScatterInput) {
  using namespace fsdp_hand;
  PlanInput in = mistral(2, false);
  in.strategy.fsdp.version = 2;
  const sim::Program p = build_program(in).program;
  int copy_outs = 0, chunk_cats = 0;
  for (const auto& op : p.ops) {
    if (op.kind != sim::OpKind::compute) continue;
    if (op.label == "fsdp_copy_out") {
      ++copy_outs;
      const auto& flat = p.buffers[static_cast<std::size_t>(sim::ops::read<sim::ops::Accumulate>(p, op).in)];
      const auto& unsharded = p.buffers[static_cast<std::size_t>(sim::ops::read<sim::ops::Accumulate>(p, op).out)];
      EXPECT_EQ(flat.bytes, unsharded.bytes);
      EXPECT_FALSE(flat.reuse_after_next_recorded_free);
    }
    if (op.label == "fsdp_chunk_cat") ++chunk_cats;
  }
  // Each decoder layer: forward, the recompute and backward; the root's two units (the
  // embedding, the final norm and head) once, gathered from forward to the end of backward.
  EXPECT_EQ(copy_outs, 3 * static_cast<int>(in.model.layers) + 2);
  EXPECT_EQ(chunk_cats, static_cast<int>(in.model.layers) + 1);  // each layer's gradients, then the root's
  for (const auto& b : p.buffers) EXPECT_EQ(b.name.find("retained"), std::string::npos) << b.name;
  PlanInput lora_in = mistral(2, true);
  lora_in.strategy.fsdp.version = 2;
  for (const auto& b : build_program(lora_in).program.buffers) EXPECT_EQ(b.name.find("retained"), std::string::npos) << b.name;
  // FSDP2 has no NO_SHARD or HYBRID_SHARD.
  lora_in.strategy.stage = Stage::fsdp_no_shard;
  EXPECT_THROW(validate(lora_in), peftplan::InputError);
}

// FSDP1's units as accelerate wraps a PEFT model, each running its hooks per pass: A5's root,
// 32 decoder layers and 256 adapter Linears (lora_A and lora_B on q, k, v, o), each layer
// checkpointed (forward, recompute, backward), the root twice; FSDP2 and DDP count none.
TEST(Fsdp, UnitPassesCountTheHooksThatRunPerStep) {
  using namespace fsdp_hand;
  PlanInput in = mistral(2, true);
  EXPECT_EQ(build_program(in).facts.fsdp_unit_passes, 2 + 32 * 3 + 256 * 3);
  in.training.checkpointing = Checkpointing::none;
  EXPECT_EQ(build_program(in).facts.fsdp_unit_passes, 2 + 32 * 2 + 256 * 2);
  in.strategy.fsdp.version = 2;
  EXPECT_EQ(build_program(in).facts.fsdp_unit_passes, 0);
}

TEST(Fsdp, ShardedQloraKeepsTheQuantStateWholeOnEveryRank) {
  using namespace fsdp_hand;
  PlanInput in = mistral(2, true);
  in.peft.quantization = models::Quantization{DType::nf4, true, 64};
  in.training.precision = Precision::bf16_mixed;
  const sim::Program p = build_program(in).program;
  // One decoder layer's linear weights: q, k, v, o, gate, up, down of Mistral-7B.
  const std::int64_t H = 4096, I = 14336, kv = 1024;
  const std::int64_t w[] = {H * H, kv * H, kv * H, H * H, I * H, I * H, H * I};
  std::uint64_t packed = 0, state = 0;
  for (std::int64_t n : w) {
    packed += static_cast<std::uint64_t>(n / 2);  // nf4: two per byte
    const std::uint64_t blocks = static_cast<std::uint64_t>(n / 64);  // QLoRA §3: one int8 absmax per block,
    state += blocks + 4 * ((blocks + 255) / 256);                     // one fp32 constant per 256 blocks
  }
  const std::uint64_t norms = 2 * 2 * static_cast<std::uint64_t>(H);  // bf16: TRL leaves sharded QLoRA's norms alone
  EXPECT_EQ(bytes_named(p, "layers.0.frozen.shard"), (packed + norms) / 2);
  EXPECT_EQ(bytes_named(p, "layers.0.frozen.persistent"), state);
}

TEST(Fsdp, RetainedCheckpointGradientsPutTheLoraPeakInTheFirstLayersBackward) {
  using namespace fsdp_hand;
  PlanInput in = mistral(2, true);  // fms-acceleration's A5: 2 x 4096 tokens per GPU
  in.training.micro_batch = 2;
  in.training.seq_len = 4096;
  const Plan p = make_plan(in, sim::resolve_cluster("1x2xA100-80GB"));
  const auto& op = p.program.ops[static_cast<std::size_t>(p.memory.device_peak_op)];
  EXPECT_EQ(op.phase, sim::Phase::backward);
  EXPECT_EQ(p.program.buffers[static_cast<std::size_t>(op.buffer)].name.rfind("layers.0.", 0), 0u)
      << p.program.buffers[static_cast<std::size_t>(op.buffer)].name;
  std::uint64_t retained = 0;
  for (const auto& b : p.program.buffers)
    if (b.name.find("input_grad.retained") != std::string::npos) retained += b.bytes;
  // The input gradients of layers 1..L-1 (bf16, 2 H T bytes each, T = 8192 tokens).
  EXPECT_EQ(retained, static_cast<std::uint64_t>(in.model.layers - 1) * 2 * 4096 * 8192);
  // Without checkpointing FSDP registers no such hook: nothing is retained.
  PlanInput none = in;
  none.training.checkpointing = Checkpointing::none;
  for (const auto& b : build_program(none).program.buffers) EXPECT_EQ(b.name.find("retained"), std::string::npos) << b.name;
}

TEST(Fsdp, RefusesWhatFsdpDoesNotHave) {
  PlanInput in = fsdp_hand::mistral(2, true);
  in.profile = RuntimeProfile::deepspeed;
  EXPECT_THROW(validate(in), peftplan::InputError);
  in.profile = RuntimeProfile::hf;
  in.strategy.offload_optimizer = OffloadDevice::cpu;
  EXPECT_THROW(validate(in), peftplan::InputError);
  in.strategy.offload_optimizer = OffloadDevice::none;
  in.strategy.offload_param = OffloadDevice::cpu;
  EXPECT_NO_THROW(validate(in));
  EXPECT_THROW(write_ds_config(in.strategy, in.training), peftplan::InputError);
}

// --- peaks outside the step (planner/lifecycle.h) ----------------------------------------------
TEST(Lifecycle, LoadAndSavePeaksAgainstHandSizes) {
  const std::uint64_t P = 7'241'732'096;  // Mistral-7B-v0.1 parameters (vocab 32000, untied)
  const std::uint64_t lora = 4 * 13'631'488;  // fp32 adapters, r 16 on q, k, v, o
  sim::Cluster c = sim::resolve_cluster("1x2xA100-80GB");
  c.host_ram_bytes_per_node = 64ull << 30;
  // DDP: both ranks build the whole bf16 model in host RAM.
  PlanInput in = fsdp_hand::mistral(2, true);
  in.strategy.stage = Stage::ddp;
  Plan p = make_plan(in, c);
  ASSERT_TRUE(p.lifecycle.has_value());
  EXPECT_EQ(p.lifecycle->load_host_per_rank_bytes, 2 * P);
  EXPECT_EQ(p.lifecycle->load_host_per_node_bytes, 4 * P);
  EXPECT_EQ(p.lifecycle->save_host_bytes, lora);  // PEFT writes the adapter only
  // Two 13.5 GiB copies fit in 64 GiB of node RAM, not in 16.
  EXPECT_TRUE(std::none_of(p.warnings.begin(), p.warnings.end(), [](const std::string& w) { return w.starts_with("loading needs"); }));
  c.host_ram_bytes_per_node = 16ull << 30;
  p = make_plan(in, c);
  EXPECT_TRUE(std::any_of(p.warnings.begin(), p.warnings.end(), [](const std::string& w) { return w.starts_with("loading needs"); }));
  // FSDP with cpu_ram_efficient_loading: one copy per node; FULL_STATE_DICT: the whole model
  // and the adapter on rank 0's host when saving.
  in.strategy.stage = Stage::fsdp_full_shard;
  in.strategy.fsdp.state_dict_type = "FULL_STATE_DICT";
  p = make_plan(in, c);
  EXPECT_EQ(p.lifecycle->load_host_per_node_bytes, 2 * P);
  EXPECT_EQ(p.lifecycle->save_host_bytes, 2 * P + lora);
  // The largest unit gathered whole: the root (embedding, head, final norm) in bf16.
  EXPECT_EQ(p.lifecycle->save_device_bytes, 2ull * (2 * 32000 * 4096 + 4096));
}

// A checkpoint saved quantised loads its packed weights as they are (transformers' bitsandbytes
// quantizer rebuilds Params4bit from the saved pieces): host RAM holds the quantised checkpoint
// (under one 5 GB shard here), and the device never holds a bf16 Linear beside them as it does
// when bitsandbytes quantises at load.
TEST(Lifecycle, ACheckpointSavedQuantisedLoadsPacked) {
  nlohmann::json c = nlohmann::json::parse(models::zoo_config_text("llama-2-7b"));
  c["quantization_config"] = {{"quant_method", "bitsandbytes"}, {"load_in_4bit", true}, {"bnb_4bit_quant_type", "nf4"}};
  PlanInput saved;
  saved.model = models::model_from_config(c, "config.json", "llama-2-7b-bnb-4bit");
  saved.peft.adapters.push_back(models::AdapterSpec{});
  ASSERT_TRUE(models::apply_checkpoint_quantization(saved.model, saved.peft, false).empty());
  saved.profile = RuntimeProfile::hf;
  saved.strategy.ranks = 1;
  PlanInput by_flags = saved;
  by_flags.model = models::load_model("llama-2-7b");
  const sim::Cluster cluster = sim::resolve_cluster("1x1xA100-80GB");
  const Plan a = make_plan(saved, cluster), b = make_plan(by_flags, cluster);
  ASSERT_TRUE(a.lifecycle && b.lifecycle);
  // Llama-2-7B's decoder Linears: 32 × (4 × 4096² + 3 × 11008 × 4096) = 6,476,005,376 weights at
  // half a byte plus a 4-byte absmax per 64 (0.5625 B each); the embedding and the untied head in
  // bf16, 2 × 32000 × 4096 × 2 B; 65 RMSNorm weights of 4096 in bf16.
  const std::uint64_t linear = 6'476'005'376ull;
  const std::uint64_t checkpoint = linear / 2 + 4 * (linear / 64) + 2ull * 32000 * 4096 * 2 + 65ull * 4096 * 2;
  EXPECT_EQ(checkpoint, 4'167'573'504ull);
  EXPECT_EQ(a.lifecycle->load_host_per_rank_bytes, checkpoint);
  EXPECT_EQ(b.lifecycle->load_host_per_rank_bytes, 5'000'000'000ull);  // a bf16 shard of 5 GB
  // Quantising at load holds the largest Linear (down_proj, 11008 × 4096) in bf16, its packed
  // output and its absmax beside the weights: 90,177,536 + 22,544,384 + 2,818,048 B.
  EXPECT_EQ(b.lifecycle->load_device_bytes - a.lifecycle->load_device_bytes, 115'539'968ull);
}

// The evaluation loop (transformers Trainer.evaluate -> prediction_step under torch.no_grad, with
// labels and prediction_loss_only when there are no compute_metrics): the model states the step
// keeps between steps, plus the forward's last live tensors at the cross-entropy, which at a
// 32,000-token vocabulary are the loss chain of transformers 4.48.1's ForCausalLMLoss at the
// eval batch: the bf16 logits, their fp32 upcast, the shifted .contiguous() copy and
// log_softmax's result, with the final norm's output (the head's input) and the batch.
TEST(Lifecycle, EvaluationPeakIsTheStatesPlusTheLossChainAtTheEvalBatch) {
  PlanInput in = fsdp_hand::mistral(1, true);  // the published A3 run: Mistral-7B LoRA, one A100
  in.strategy.stage = Stage::ddp;
  in.training.micro_batch = 4;
  in.training.seq_len = 4096;
  in.training.eval_batch = 8;  // the Trainer's default per_device_eval_batch_size
  const Plan p = make_plan(in, sim::resolve_cluster("1x1xA100-80GB"));
  ASSERT_TRUE(p.lifecycle.has_value());
  PlanInput ev = in;
  ev.training.micro_batch = 8;
  ev.training.checkpointing = Checkpointing::full;
  const sim::Program e = build_program(ev, BuildOptions{.names = true, .evaluation = true}).program;
  std::uint64_t states = 0;  // what lives between steps: weights, adapters, AdamW states, cuBLAS
  for (const auto& op : e.ops)
    if (op.kind == sim::OpKind::alloc && op.phase == sim::Phase::setup && !sim::on_host(e.buffers[static_cast<std::size_t>(op.buffer)].category))
      states += e.buffers[static_cast<std::size_t>(op.buffer)].bytes;
  // A3's memory still allocated after train() (the CSV's mem_torch_mem_alloc_in_bytes,
  // 14,664,493,056 B) is these states to within 1 MiB.
  EXPECT_NEAR(static_cast<double>(states), 14'664'493'056.0, 1048576.0);
  const std::uint64_t T = 8 * 4096, Tv = T - 8, V = 32000, H = 4096, head_dim = 128;
  const std::uint64_t chain = 2 * T * V + 4 * T * V + 4 * Tv * V + 4 * Tv * V;  // logits, .float(), shift, log_softmax
  const std::uint64_t around = 2 * T * H + 24 * T + 2 * (2 * head_dim) * 4096;  // final norm out, batch, RoPE cos/sin
  EXPECT_EQ(p.lifecycle->eval_device_bytes, states + chain + around);
  EXPECT_NE(std::find_if(p.warnings.begin(), p.warnings.end(), [](const std::string& w) { return w.find("evaluation peaks at") != std::string::npos; }),
            p.warnings.end());
  // The eval program is well-formed and stops at the loss: no backward, no optimizer step.
  EXPECT_TRUE(sim::verify(e).empty());
  for (const auto& op : e.ops) EXPECT_TRUE(op.phase != sim::Phase::backward && op.phase != sim::Phase::optimizer);
  // --eval-batch 0: no evaluation, no figure.
  in.training.eval_batch = 0;
  EXPECT_EQ(make_plan(in, sim::resolve_cluster("1x1xA100-80GB")).lifecycle->eval_device_bytes, 0u);
}

TEST(Lifecycle, QloraQuantisesTheLargestLinearOnTheDevice) {
  PlanInput in = fsdp_hand::mistral(1, true);
  in.strategy.stage = Stage::ddp;
  in.peft.quantization = models::Quantization{DType::nf4, true, 64};
  in.training.precision = Precision::bf16_mixed;
  const Plan p = make_plan(in, sim::resolve_cluster("1x1xA100-80GB"));
  // The quantised model as the step holds it (its weights, not yet its optimizer states)...
  std::uint64_t weights = 0;
  for (const auto& op : p.program.ops)
    if (op.kind == sim::OpKind::alloc && op.phase == sim::Phase::setup) {
      const auto& b = p.program.buffers[static_cast<std::size_t>(op.buffer)];
      if (b.category == MemCategory::base_weights || b.category == MemCategory::trainable_weights) weights += b.bytes;
    }
  EXPECT_GT(weights, 3'800'000'000u);  // nf4 Mistral-7B with bf16 embeddings and fp32 norms: ~3.84 GiB
  EXPECT_LT(weights, 4'300'000'000u);
  const std::uint64_t n = 14336ull * 4096;  // gate_proj / up_proj / down_proj
  // ...plus, for the largest Linear, bitsandbytes quantize_4bit's bf16 input, its packed output
  // and an fp32 absmax per 64 elements.
  EXPECT_EQ(p.lifecycle->load_device_bytes, weights + 2 * n + n / 2 + 4 * (n / 64));
}

// --cross-entropy chunked: Liger's fused linear cross-entropy never holds the whole logits: a
// chunk of next_power_of_2(ceil(BT / ceil(V / H))) rows of them (fused_linear_cross_entropy.py).
TEST(CrossEntropy, ChunkedHoldsAChunkOfLogitsAndGradInput) {
  PlanInput in;
  in.model = models::load_model("llama-3-8b");  // V 128256, H 4096
  in.peft = lora(16, 16, {"q_proj", "v_proj"});
  in.training.micro_batch = 4;
  in.training.seq_len = 4096;
  in.training.precision = Precision::bf16_pure;
  in.training.checkpointing = Checkpointing::full;
  in.training.cross_entropy = CrossEntropy::chunked;
  in.profile = RuntimeProfile::hf;
  const sim::Program p = build_program(in).program;
  const std::uint64_t chunk = 512;  // ceil(16384 / ceil(128256 / 4096) = 32) = 512, a power of two
  std::uint64_t chunks = 0, largest_loss = 0;
  for (std::size_t i = 0; i < p.ops.size(); ++i) {
    const auto& op = p.ops[i];
    if (op.kind != sim::OpKind::alloc || op.phase != sim::Phase::loss) continue;
    const auto& b = p.buffers[static_cast<std::size_t>(op.buffer)];
    largest_loss = std::max(largest_loss, b.bytes);
    if (b.name.find("logits_chunk") != std::string::npos) {
      EXPECT_EQ(b.bytes, 2 * chunk * 128256);
      ++chunks;
    }
  }
  EXPECT_EQ(chunks, 16384 / chunk);
  EXPECT_EQ(largest_loss, 2ull * 16384 * 4096);  // grad_input [BT, H] in bf16 is the largest
  for (const auto& b : p.buffers)  // nothing anywhere holds the whole logits, forward or backward
    EXPECT_LT(b.bytes, 2ull * 16384 * 128256) << b.name;
  // A trainable head (full fine-tuning) is refused: its weight gradient is not planned.
  PlanInput full = in;
  full.peft.adapters.clear();
  EXPECT_THROW(validate(full), peftplan::InputError);
  in.profile = RuntimeProfile::executor;
  in.training.precision = Precision::fp32;
  EXPECT_THROW(validate(in), peftplan::InputError);
}

// The other FSDP strategies: SHARD_GRAD_OP keeps every unit gathered from its forward to its
// backward, NO_SHARD shards nothing, HYBRID_SHARD shards inside a node and all-reduces the
// gradient shards across nodes (one member per node: inter-node traffic).
TEST(Fsdp, OtherShardingStrategies) {
  using namespace fsdp_hand;
  const sim::Cluster two_nodes = sim::resolve_cluster("2x8xH100-SXM-NDR");
  PlanInput full = mistral(16, true);
  const Plan fs = make_plan(full, two_nodes);
  PlanInput grad_op = full;
  grad_op.strategy.stage = Stage::fsdp_shard_grad_op;
  const Plan go = make_plan(grad_op, two_nodes);
  // All 32 decoder units gathered at once at SHARD_GRAD_OP's peak, against one (plus the root).
  EXPECT_GT(peak(go.memory, MemCategory::gathered_weights), 20 * peak(fs.memory, MemCategory::gathered_weights) / 2);
  EXPECT_EQ(peak(go.memory, MemCategory::base_weights), peak(fs.memory, MemCategory::base_weights));
  PlanInput none = full;
  none.strategy.stage = Stage::fsdp_no_shard;
  const Plan ns = make_plan(none, two_nodes);
  EXPECT_EQ(peak(ns.memory, MemCategory::gathered_weights), 0u);
  EXPECT_GT(peak(ns.memory, MemCategory::base_weights), 15 * peak(fs.memory, MemCategory::base_weights));
  EXPECT_GT(ns.time->collective_bytes[static_cast<std::size_t>(sim::Collective::all_reduce)], 0u);
  PlanInput hybrid = full;
  hybrid.strategy.stage = Stage::fsdp_hybrid_shard;
  hybrid.strategy.shard_group = 8;
  const Plan hy = make_plan(hybrid, two_nodes);
  // Shards of 8 ranks: twice FULL_SHARD's over 16.
  EXPECT_NEAR(static_cast<double>(peak(hy.memory, MemCategory::base_weights)), 2.0 * static_cast<double>(peak(fs.memory, MemCategory::base_weights)),
              0.001 * static_cast<double>(peak(hy.memory, MemCategory::base_weights)));
  EXPECT_GT(hy.time->inter_node_bytes, 0u);       // the cross-node all-reduce of the gradient shards
  EXPECT_GT(fs.time->inter_node_bytes, hy.time->inter_node_bytes);  // FULL_SHARD gathers across nodes
  EXPECT_GT(hy.outside_allocator_bytes, fs.outside_allocator_bytes);  // two NCCL communicators
}

TEST(Profiles, HfPlansDdpAndFsdpNotZero) {
  PlanInput in = fsdp_hand::mistral(2, true);
  in.strategy.stage = Stage::zero3;
  EXPECT_THROW(validate(in), peftplan::InputError);
  in.profile = RuntimeProfile::deepspeed;
  EXPECT_NO_THROW(validate(in));
}

// BACKWARD_PRE gathers the next unit while the current one is still gathered; BACKWARD_POST
// after the current one is resharded (without checkpointing, where FSDP prefetches at all).
TEST(Fsdp, BackwardPostHoldsOneUnitWherePreHoldsTwo) {
  PlanInput in = fsdp_hand::mistral(2, true);
  in.training.checkpointing = Checkpointing::none;
  const std::uint64_t pre = peak(walk_memory_of(in), MemCategory::gathered_weights);
  in.strategy.fsdp.backward_prefetch = FsdpPrefetch::backward_post;
  const std::uint64_t post = peak(walk_memory_of(in), MemCategory::gathered_weights);
  const std::uint64_t layer = 2ull * 218'112'000;  // one decoder unit, whole, in bf16
  EXPECT_GE(pre - post, layer - layer / 100);
}

// --- knobs: the planner names fields, front ends spell them ------------------------------------
TEST(Knobs, RefusalsNameFieldsAndCarryTheirKnobs) {
  PlanInput in = llama7b_lora(Stage::zero2, 8);
  in.strategy.offload_param = OffloadDevice::cpu;
  try {
    validate(in);
    FAIL() << "parameter offload under ZeRO-2 was accepted";
  } catch (const KnobError& e) {
    EXPECT_EQ(e.knobs(), (std::vector<Knob>{Knob::offload_param, Knob::stage}));
    EXPECT_EQ(std::string(e.what()).rfind("strategy.offload_param cpu: parameter offload needs sharded parameters", 0), 0u) << e.what();
    EXPECT_EQ(std::string(e.what()).find("--"), std::string::npos) << "a CLI flag in a library message: " << e.what();
  }
  in = llama7b_lora(Stage::ddp, 8);
  in.training.micro_batch = 0;
  EXPECT_THROW(validate(in), KnobError);
  // Every knob has its own field name.
  std::set<std::string_view> fields;
  for (int k = 0; k < kNumKnobs; ++k) fields.insert(field_of(static_cast<Knob>(k)));
  EXPECT_EQ(fields.size(), static_cast<std::size_t>(kNumKnobs));
}

TEST(Knobs, SuggestionsAreStructuredAndSpelledByTheFrontEnd) {
  // Llama-2-70B's bf16 base (129 GiB) on one 80 GB GPU under DDP: the base weights bind, and the
  // suggestions are to shard them (ZeRO-3 on the DeepSpeed stack, FULL_SHARD on the hf stack) or
  // quantise them.
  PlanInput in = llama7b_lora(Stage::ddp, 1);
  in.model = models::load_model("llama-2-70b");
  const Plan p = make_plan(in, sim::resolve_cluster("1xA100-80GB"));
  ASSERT_FALSE(p.fits);
  const std::vector<Suggestion> want = {{Knob::stage, Change::set, "zero3", "shards the frozen base"},
                                        {Knob::quantization, Change::set, "nf4", "QLoRA"}};
  EXPECT_EQ(fit_suggestions(MemCategory::base_weights, in), want);
  EXPECT_EQ(p.suggestions, want);
  in.profile = RuntimeProfile::hf;
  EXPECT_EQ(fit_suggestions(MemCategory::base_weights, in)[0].value, "fsdp-full-shard");
  EXPECT_EQ(suggestion_text(want), "try strategy.stage zero3 (shards the frozen base) or peft.quantization nf4 (QLoRA)");
  auto flags = [](Knob k) { return k == Knob::stage ? std::string("--strategy") : std::string("--quant"); };
  EXPECT_EQ(suggestion_text(want, +flags), "try --strategy zero3 (shards the frozen base) or --quant nf4 (QLoRA)");
  const nlohmann::json j = plan_to_json(p);
  ASSERT_TRUE(j.at("suggestions").is_array());
  ASSERT_FALSE(j.at("suggestions").empty());
  EXPECT_EQ(j.at("suggestions")[0].at("knob"), "strategy.stage");
  EXPECT_EQ(j.at("suggestions")[0].at("change"), "set");
  EXPECT_EQ(j.at("suggestions")[0].at("value"), "zero3");
  EXPECT_EQ(j.at("suggestions")[1].at("knob"), "peft.quantization");
  for (const std::string& r : p.reasons) EXPECT_EQ(r.find("--"), std::string::npos) << r;
}
