// End-to-end checks of `peftplan estimate`: JSON keys and numbers, DeepSpeed's exact table with
// --deepspeed-compat, and exit code 2 with a one-line message for bad input.
#include <algorithm>
#include <array>
#include <cstdio>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli_run.h"

namespace {

using Result = peftplan::testing::CliResult;

Result run(const std::string& args) { return peftplan::testing::run_cli(args); }

}  // namespace

// ZeRO (arXiv 1910.02054) Figure 1: Ψ = 7.5B on 64 GPUs, P_os+g = 2Ψ + 14Ψ/64 = 16.64 GB.
TEST(EstimateCli, ZeroPaperJson) {
  Result r = run("estimate --params 7500000000 --gpus-per-node 8 --nodes 8 --stage 2 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  for (const char* k : {"model_states_bytes", "base_weights_bytes", "trainable_weights_bytes", "gradients_bytes",
                        "optimizer_states_bytes", "host_bytes", "ranks", "stage"})
    EXPECT_TRUE(j.contains(k)) << k;
  EXPECT_EQ(j["model_states_bytes"].get<std::uint64_t>(), 16'640'625'000u);
  EXPECT_EQ(j["ranks"], 64);
}

TEST(EstimateCli, PeftAwareText) {
  Result r = run("estimate --params 6746804224 --trainable-params 8388608 --gpus-per-node 8 --stage 3");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("GiB"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" GB"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("total per GPU"), std::string::npos) << r.out;
}

// DeepSpeed's estimate_zero2_model_states_mem_needs for memory.rst's model (2851M, 1x8 GPUs):
// gpu = 2P + int(18P/8) = 12,116,750,000 with the current code.
TEST(EstimateCli, DeepSpeedCompatJson) {
  Result r = run("estimate --params 2851000000 --gpus-per-node 8 --stage 2 --deepspeed-compat --json");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["gpu_bytes"].get<std::uint64_t>(), 12'116'750'000u);
  EXPECT_EQ(j["cpu_bytes"].get<std::uint64_t>(), 136'848'000'000u);
  r = run("estimate --params 2851000000 --largest-layer-params 32000000 --gpus-per-node 8 --stage 3 "
          "--offload-optimizer --offload-param --zero-init --deepspeed-compat --json");
  ASSERT_EQ(r.code, 0) << r.out;
  j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["gpu_bytes"].get<std::uint64_t>(), 128'000'000u);
  EXPECT_EQ(j["cpu_bytes"].get<std::uint64_t>(), 76'977'000'000u);
}

TEST(EstimateCli, DeepSpeedCompatText) {
  Result r = run("estimate --params 2851000000 --largest-layer-params 32000000 --gpus-per-node 8 --stage 3 "
                 "--deepspeed-compat");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.rfind("Estimated memory needed for params, optim states and gradients for a:\n"
                        "HW: Setup with 1 node, 8 GPUs per node.\n"
                        "SW: Model with 2851M total params, 32M largest layer params.\n"
                        "  per CPU  |  per GPU |   Options\n",
                        0),
            0u)
      << r.out;
  EXPECT_NE(r.out.find("    1.43GB |   6.09GB | offload_param=none, offload_optimizer=none, zero_init=1\n"),
            std::string::npos);
}

// --model counts P and T as `params` does and DeepSpeed's largest layer as model_to_params does;
// --gpus spreads over --nodes; without --stage, one row per stage. Each stage's figures are the
// ones --params / --trainable-params / --gpus-per-node give for the same counts.
TEST(EstimateCli, ModelAndGpusCountAsParamsDoes) {
  Result r = run("estimate --model llama-2-7b --lora-r 16 --gpus 16 --nodes 2 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto rows = nlohmann::json::parse(r.out);
  ASSERT_TRUE(rows.is_array());
  ASSERT_EQ(rows.size(), 4u);
  for (int st = 0; st < 4; ++st) {
    const auto& j = rows[static_cast<std::size_t>(st)];
    EXPECT_EQ(j["stage"], st);
    EXPECT_EQ(j["ranks"], 16);
    EXPECT_EQ(j["total_params"], 6'746'804'224);  // PEFT's "all params" for LoRA r 16 on q, v
    EXPECT_EQ(j["trainable_params"], 8'388'608);
    Result one = run(fmt::format("estimate --params 6746804224 --trainable-params 8388608 --gpus-per-node 8 --nodes 2 --stage {} --json", st));
    ASSERT_EQ(one.code, 0) << one.out;
    EXPECT_EQ(j["model_states_bytes"], nlohmann::json::parse(one.out)["model_states_bytes"]) << "stage " << st;
  }
  // The text: one row per stage the offload flags allow (optimizer offload: stages 1-3).
  r = run("estimate --model llama-2-7b --lora-r 16 --gpus 8 --offload-optimizer");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("llama-2-7b, 8,388,608 trainable"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("0 ddp"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\n  3 "), std::string::npos) << r.out;
  // DeepSpeed's estimators on the model: every parameter, and the embedding's V·H as the largest layer.
  r = run("estimate --model llama-2-7b --full-finetune --gpus 8 --stage 3 --deepspeed-compat");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("SW: Model with 6738M total params, 131M largest layer params."), std::string::npos) << r.out;
}

TEST(EstimateCli, BadInputIsOneLineAndExitCodeTwo) {
  struct Case {
    std::string args, expect;
  };
  const Case cases[] = {
      {"estimate --params 1000 --gpus-per-node 8 --stage 4", "--stage: must be 0, 1, 2 or 3, got 4"},
      {"estimate --params=-5 --gpus-per-node 8 --stage 2", "--params: must be a non-negative integer, got -5"},
      // 2^60: 16 B each wrapped 64 bits (the trainable column printed 0.00 GiB)
      {"estimate --params 1152921504606846976 --gpus 1", "--params: must be at most 1,000,000,000,000,000 (10^15), got 1152921504606846976"},
      {"estimate --params 1000 --gpus-per-node 8 --stage 2 --offload-param", "--offload-param: needs --stage 3"},
      {"estimate --params 1000 --trainable-params 2000 --gpus-per-node 8 --stage 2", "--trainable-params"},
      {"estimate --model llama-2-7b --params 1000 --gpus 8", "--params: and --model are two sources of the parameter count: give one, got 1000"},
      {"estimate --model llama-2-7b --trainable-params 1000 --gpus 8", "--trainable-params: comes from --model"},
      {"estimate --params 1000 --lora-r 16 --gpus 8", "--model: is needed by the adapter flags"},
      {"estimate --gpus 8 --stage 2", "--params: or --model is required"},
      {"estimate --model llama-2-7b --stage 2", "--gpus: or --gpus-per-node is required"},
      {"estimate --model llama-2-7b --gpus 8 --gpus-per-node 8", "--gpus: and --gpus-per-node both set the GPU count"},
      {"estimate --model llama-2-7b --gpus 9 --nodes 2", "--gpus: must be a multiple of --nodes (2): the GPUs are spread evenly over the nodes, got 9"},
      {"estimate --model llama-2-7b --gpus 8 --quant nf4", "--quant: is not in estimate's closed forms"},
      {"estimate --model llama-2-7b --gpus 8 --deepspeed-compat", "--stage: is required with --deepspeed-compat"},
      {"estimate --model no-such-model --gpus 8", "no-such-model"},
      {"estimate --params 1000 --gpus-per-node 8 --stage 3 --deepspeed-compat", "--largest-layer-params"},
      {"estimate --params 1000 --gpus-per-node 0 --stage 1", "--gpus-per-node: must be a positive integer, got 0"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.args);
    Result r = run(c.args);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  }
}
