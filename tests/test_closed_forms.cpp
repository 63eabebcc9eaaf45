// Closed-form model states: the ZeRO paper's Figure 1 numbers, the PEFT generalisation, and
// DeepSpeed's estimators recomputed by hand from the code formulas.
#include <cmath>

#include <gtest/gtest.h>

#include "peftplan/models/config.h"
#include "peftplan/models/peft.h"
#include "peftplan/planner/closed_forms.h"

using namespace peftplan;
using namespace peftplan::planner;

namespace {

// The paper's "GB" is 1e9 bytes; Figure 1 prints one decimal (three significant digits for 120).
double paper_gb(std::uint64_t bytes) { return std::round(static_cast<double>(bytes) / 1e9 * 10.0) / 10.0; }

}  // namespace

// ZeRO (arXiv 1910.02054) §5, Figure 1: Ψ = 7.5B, N_d = 64, K = 12 (mixed-precision Adam).
TEST(ZeroPaper, Figure1) {
  const std::int64_t psi = 7'500'000'000;
  EXPECT_EQ(paper_gb(zero_paper_model_states_bytes(psi, 64, Stage::ddp)), 120.0);   // (2+2+K)Ψ
  EXPECT_EQ(paper_gb(zero_paper_model_states_bytes(psi, 64, Stage::zero1)), 31.4);  // 4Ψ + KΨ/N
  EXPECT_EQ(paper_gb(zero_paper_model_states_bytes(psi, 64, Stage::zero2)), 16.6);  // 2Ψ + (2+K)Ψ/N
  EXPECT_EQ(paper_gb(zero_paper_model_states_bytes(psi, 64, Stage::zero3)), 1.9);   // (2+2+K)Ψ/N
  // Exact bytes by hand: 16·7.5e9; 30e9 + 12·117,187,500; 15e9 + 14·117,187,500; 16·117,187,500.
  EXPECT_EQ(zero_paper_model_states_bytes(psi, 64, Stage::ddp), 120'000'000'000u);
  EXPECT_EQ(zero_paper_model_states_bytes(psi, 64, Stage::zero1), 31'406'250'000u);
  EXPECT_EQ(zero_paper_model_states_bytes(psi, 64, Stage::zero2), 16'640'625'000u);
  EXPECT_EQ(zero_paper_model_states_bytes(psi, 64, Stage::zero3), 1'875'000'000u);
}

// §3.1: the 1.5B GPT-2 needs at least 24 GB of model states (16Ψ).
TEST(ZeroPaper, Gpt2ModelStates) {
  EXPECT_EQ(zero_paper_model_states_bytes(1'500'000'000, 1, Stage::ddp), 24'000'000'000u);
}

// Partitions are ceil(Ψ/N) elements per rank (DeepSpeed pads flat partitions to N).
TEST(ZeroPaper, PaddedPartitions) {
  EXPECT_EQ(zero_paper_model_states_bytes(10, 3, Stage::zero3), 16u * 4u);
}

// The PEFT generalisation reduces to the paper for Ψ_b = 0, a = 2, K = 12 and otherwise shards
// only what each stage shards.
TEST(PeftModelStates, MatchesPaperForFullFinetune) {
  for (Stage s : {Stage::ddp, Stage::zero1, Stage::zero2, Stage::zero3}) {
    PeftModelStatesInput in{.base_params = 0, .base_dtype = DType::bf16, .trainable_params = 7'500'000'000,
                            .trainable_dtype = DType::bf16, .optimizer_bytes_per_param = 12};
    EXPECT_EQ(peft_model_states_bytes(in, 64, s).gpu_total_bytes(), zero_paper_model_states_bytes(7'500'000'000, 64, s));
  }
}

TEST(PeftModelStates, LoraOnLlama2_7b) {
  // llama-2-7b (6,738,415,616 params) + LoRA r=16 on q,v (8,388,608 trainable), bf16 base, N = 8.
  const PeftModelStatesInput in{.base_params = 6'738'415'616, .base_dtype = DType::bf16,
                                .trainable_params = 8'388'608, .trainable_dtype = DType::bf16,
                                .optimizer_bytes_per_param = 12};
  const ModelStatesBytes ddp = peft_model_states_bytes(in, 8, Stage::ddp);
  EXPECT_EQ(ddp.base_weights_bytes, 2u * 6'738'415'616u);
  EXPECT_EQ(ddp.trainable_weights_bytes, 2u * 8'388'608u);
  EXPECT_EQ(ddp.gradients_bytes, 2u * 8'388'608u);
  EXPECT_EQ(ddp.optimizer_states_bytes, 12u * 8'388'608u);
  const ModelStatesBytes z1 = peft_model_states_bytes(in, 8, Stage::zero1);
  EXPECT_EQ(z1.optimizer_states_bytes, 12u * 1'048'576u);
  EXPECT_EQ(z1.base_weights_bytes, ddp.base_weights_bytes);
  const ModelStatesBytes z2 = peft_model_states_bytes(in, 8, Stage::zero2);
  EXPECT_EQ(z2.gradients_bytes, 2u * 1'048'576u);
  const ModelStatesBytes z3 = peft_model_states_bytes(in, 8, Stage::zero3);
  EXPECT_EQ(z3.base_weights_bytes, 2u * 842'301'952u);  // 6,738,415,616 / 8
  // ZeRO-1/2 save < 1% for LoRA; ZeRO-3 divides the frozen base by N.
  EXPECT_GT(static_cast<double>(z2.gpu_total_bytes()) / static_cast<double>(ddp.gpu_total_bytes()), 0.99);
  EXPECT_LT(z3.gpu_total_bytes(), ddp.gpu_total_bytes() / 7);
  // Optimizer offload moves gradients and optimizer states to the host.
  const ModelStatesBytes off = peft_model_states_bytes(in, 8, Stage::zero2, OffloadDevice::cpu);
  EXPECT_EQ(off.gradients_bytes + off.optimizer_states_bytes, 0u);
  EXPECT_EQ(off.host_bytes, z2.gradients_bytes + z2.optimizer_states_bytes);
  const ModelStatesBytes all = peft_model_states_bytes(in, 8, Stage::zero3, OffloadDevice::cpu, OffloadDevice::cpu);
  EXPECT_EQ(all.gpu_total_bytes(), 0u);
  EXPECT_EQ(all.host_bytes, z3.gpu_total_bytes());
}

TEST(PeftModelStates, QuantisedBaseAndFp32Adapters) {
  const PeftModelStatesInput in{.base_params = 1001, .base_dtype = DType::nf4, .trainable_params = 10,
                                .trainable_dtype = DType::fp32,
                                .optimizer_bytes_per_param = adam_optimizer_bytes_per_param(DType::fp32)};
  const ModelStatesBytes b = peft_model_states_bytes(in, 1, Stage::ddp);
  EXPECT_EQ(b.base_weights_bytes, 501u);  // ceil(1001 / 2)
  EXPECT_EQ(b.trainable_weights_bytes, 40u);
  EXPECT_EQ(b.optimizer_states_bytes, 80u);  // K = 8: m and v only, the weights are the master copy
  EXPECT_EQ(adam_optimizer_bytes_per_param(DType::bf16), 12);
}

// ---- DeepSpeed estimators (deepspeedai/DeepSpeed), recomputed by hand from the code.

// deepspeed/runtime/zero/stage_1_and_2.py estimate_zero2_model_states_mem_needs, docs' model
// (docs/code-docs/source/memory.rst: total_params=2851e6, 1 node x 8 GPUs).
TEST(DeepSpeedZero2, DocsModelCurrentCode) {
  const std::int64_t P = 2'851'000'000;
  // offload: gpu = 2P; cpu = P * max(4*8, 16) * 1.5 = 136,848,000,000 (127.45 "GB" = GiB)
  DsEstimate off = ds_estimate_zero2(P, 8, 1, true);
  EXPECT_EQ(off.gpu_bytes, 5'702'000'000u);
  EXPECT_EQ(off.cpu_bytes, 136'848'000'000u);
  // no offload, current code (PR #5099): 2P + int(18P/8) = 5,702,000,000 + 6,414,750,000.
  DsEstimate none = ds_estimate_zero2(P, 8, 1, false);
  EXPECT_EQ(none.gpu_bytes, 12'116'750'000u);  // 11.28 GiB; the docs still print 15.93GB
  EXPECT_EQ(none.cpu_bytes, 136'848'000'000u);  // P * 4 * 8 * 1.5
  // legacy (before PR #5099): 4P + int(16P/8) = 17,106,000,000 = the docs' 15.93GB.
  EXPECT_EQ(ds_estimate_zero2(P, 8, 1, false, 1.5, Zero2Formula::legacy).gpu_bytes, 17'106'000'000u);
}

TEST(DeepSpeedZero2, TruncatesLikePython) {
  // P = 1,234,567,891 on 3 GPUs: 2P + int(22,222,222,038 / 3) = 2,469,135,782 + 7,407,407,346.
  DsEstimate e = ds_estimate_zero2(1'234'567'891, 3, 1, false);
  EXPECT_EQ(e.gpu_bytes, 9'876'543'128u);
  EXPECT_EQ(e.cpu_bytes, 22'222'222'038u);  // P * 4 * 3 * 1.5
  // Multi-node offload uses total GPUs (N = 16) in max(4N, 16): 6,738,415,616 * 64 * 1.5.
  EXPECT_EQ(ds_estimate_zero2(6'738'415'616, 8, 2, true).cpu_bytes, 646'887'899'136u);
  EXPECT_EQ(ds_estimate_zero2(6'738'415'616, 8, 2, false).gpu_bytes, 13'476'831'232u + 7'580'717'568u);
}

// deepspeed/runtime/zero/stage3.py estimate_zero3_model_states_mem_needs, docs' model:
// total_params=2851e6, largest_layer_params=32e6, 1 node x 8 GPUs. L = 4 * 32e6 = 128,000,000.
TEST(DeepSpeedZero3, DocsModel) {
  const std::int64_t P = 2'851'000'000, L = 32'000'000;
  struct Case {
    bool opt, param, init;
    std::uint64_t cpu, gpu;
  };
  const Case cases[] = {
      {true, true, true, 76'977'000'000u, 128'000'000u},      // P*18*1*1.5 | 4L
      {true, true, false, 136'848'000'000u, 128'000'000u},    // P*max(32, 18.0)*1.5 | 4L
      {true, false, true, 68'424'000'000u, 840'750'000u},     // P*16*1.5 | 4L + int(2P/8)
      {true, false, false, 136'848'000'000u, 840'750'000u},   // P*max(32, 16.0)*1.5
      {false, false, true, 1'536'000'000u, 6'542'750'000u},   // L*4*8*1.5 | 4L + int(18P/8)
      {false, false, false, 136'848'000'000u, 6'542'750'000u},  // P*4*8*1.5
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << c.opt << c.param << c.init);
    DsEstimate3 e = ds_estimate_zero3(P, L, 8, 1, c.opt, c.param, c.init);
    EXPECT_EQ(e.cpu_bytes, c.cpu);
    EXPECT_EQ(e.gpu_bytes, c.gpu);
    EXPECT_EQ(e.largest_layer_bytes, 128'000'000u);
  }
}

TEST(DeepSpeedZero3, FloatBranchOfMaxAndTruncation) {
  // One GPU: max(4*1, 18 * 1.0) picks the float 18.0: 2,851,000,000 * 18.0 * 1.5.
  EXPECT_EQ(ds_estimate_zero3(2'851'000'000, 32'000'000, 1, 1, true, true, false).cpu_bytes, 76'977'000'000u);
  // int(2P/3) truncates 823,045,260.67: 4 * 7,654,321 + 823,045,260.
  DsEstimate3 e = ds_estimate_zero3(1'234'567'891, 7'654'321, 3, 1, true, false, true);
  EXPECT_EQ(e.gpu_bytes, 853'662'544u);
  EXPECT_EQ(e.cpu_bytes, 29'629'629'384u);  // P * 16 * 1.0 * 1.5
  // Three nodes: gpus_factor = 1/3, so P * 18 * (1/3) * 1.5 with zero_init.
  EXPECT_EQ(ds_estimate_zero3(6'738'415'616, 131'072'000, 4, 3, true, true, true).cpu_bytes, 60'645'740'544u);
}

// DeepSpeed's model_to_params (deepspeed/runtime/zero/stage3.py) on Llama-2-7B: every parameter
// once, 6,738,415,616 (Meta's count), and the largest module's own parameters, the embedding's
// (and the untied head's) V·H = 32,000 × 4,096. Under LoRA r 16 on q and v the PeftModel adds
// 8,388,608 in lora_A / lora_B modules of 65,536 each: PEFT's "all params: 6,746,804,224".
TEST(DeepSpeedModelToParams, CountsAsDeepSpeedWalksTheModules) {
  const models::ModelSpec m = models::load_model("llama-2-7b");
  const DsModelParams full = ds_model_to_params(m, models::PeftSpec{});
  EXPECT_EQ(full.total_params, 6'738'415'616);
  EXPECT_EQ(full.largest_layer_params, 131'072'000);
  models::PeftSpec lora;
  models::AdapterSpec a;
  a.lora.r = 16;  // targets: PEFT's default for Llama, q_proj and v_proj
  lora.adapters.push_back(a);
  const DsModelParams with = ds_model_to_params(m, lora);
  EXPECT_EQ(with.total_params, 6'746'804'224);
  EXPECT_EQ(with.total_params, models::count_params(m, lora).all_params);
  EXPECT_EQ(with.largest_layer_params, 131'072'000);
  // A tied head is the embedding's tensor: counted once in the total.
  const models::ModelSpec tied = models::load_model("tiny-llama-tied");
  const DsModelParams t = ds_model_to_params(tied, models::PeftSpec{});
  EXPECT_EQ(t.total_params, models::count_params(tied, models::PeftSpec{}).total_params);
  EXPECT_EQ(t.largest_layer_params, tied.vocab * tied.hidden);
}

// The exact text of estimate_zero3_model_states_mem_needs_all_cold for the docs' model. The
// table equals memory.rst's cold example because the ZeRO-3 formulas did not change.
TEST(DeepSpeedText, Zero3AllCold) {
  EXPECT_EQ(ds_zero3_all_cold_text(2'851'000'000, 32'000'000, 8, 1),
            "Estimated memory needed for params, optim states and gradients for a:\n"
            "HW: Setup with 1 node, 8 GPUs per node.\n"
            "SW: Model with 2851M total params, 32M largest layer params.\n"
            "  per CPU  |  per GPU |   Options\n"
            "   71.69GB |   0.12GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1\n"
            "  127.45GB |   0.12GB | offload_param=cpu , offload_optimizer=cpu , zero_init=0\n"
            "   63.72GB |   0.78GB | offload_param=none, offload_optimizer=cpu , zero_init=1\n"
            "  127.45GB |   0.78GB | offload_param=none, offload_optimizer=cpu , zero_init=0\n"
            "    1.43GB |   6.09GB | offload_param=none, offload_optimizer=none, zero_init=1\n"
            "  127.45GB |   6.09GB | offload_param=none, offload_optimizer=none, zero_init=0\n");
}

// ZeRO-2: the current code prints 11.28GB where memory.rst (pre-PR #5099) shows 15.93GB.
TEST(DeepSpeedText, Zero2AllColdCurrentAndLegacy) {
  const std::string head =
      "Estimated memory needed for params, optim states and gradients for a:\n"
      "HW: Setup with 1 node, 8 GPUs per node.\n"
      "SW: Model with 2851M total params.\n"
      "  per CPU  |  per GPU |   Options\n"
      "  127.45GB |   5.31GB | offload_optimizer=cpu \n";
  EXPECT_EQ(ds_zero2_all_cold_text(2'851'000'000, 8, 1), head + "  127.45GB |  11.28GB | offload_optimizer=none\n");
  EXPECT_EQ(ds_zero2_all_cold_text(2'851'000'000, 8, 1, 1.5, Zero2Formula::legacy),
            head + "  127.45GB |  15.93GB | offload_optimizer=none\n");
}

TEST(DeepSpeedText, SingularAndPluralHeader) {
  const std::string t = ds_zero2_all_cold_text(1'234'567'891, 1, 1);
  EXPECT_NE(t.find("HW: Setup with 1 node, 1 GPU per node.\nSW: Model with 1234M total params.\n"), std::string::npos);
  EXPECT_NE(t.find("   27.59GB |   2.30GB | offload_optimizer=cpu \n"), std::string::npos) << t;
  EXPECT_NE(t.find("    6.90GB |  23.00GB | offload_optimizer=none\n"), std::string::npos) << t;
  EXPECT_NE(ds_zero3_all_cold_text(6'738'415'616, 131'072'000, 4, 3).find("HW: Setup with 3 nodes, 4 GPUs per node."),
            std::string::npos);
  EXPECT_EQ(ds_zero3_all_cold(1, 1, 1, 1).size(), 6u);
  EXPECT_EQ(ds_zero2_all_cold(1, 1, 1).size(), 2u);
}
