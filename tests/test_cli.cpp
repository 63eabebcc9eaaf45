// End-to-end checks of the peftplan binary: output lines, JSON keys and exit codes for bad input.
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli_run.h"

namespace {

using Result = peftplan::testing::CliResult;

Result run(const std::string& args) { return peftplan::testing::run_cli(args); }

const std::string kData = PEFTPLAN_TEST_DATA;

}  // namespace

TEST(Cli, ParamsPrintsPeftLine) {
  Result r = run("params --model llama-2-7b --lora-r 16 --lora-alpha 32 --lora-targets q_proj,v_proj");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out, "trainable params: 8,388,608 || all params: 6,746,804,224 || trainable%: 0.1243\n");
  r = run("params --model llama-2-7b --peft " + kData + "/adapters/qv16/adapter_config.json");
  EXPECT_EQ(r.out, "trainable params: 8,388,608 || all params: 6,746,804,224 || trainable%: 0.1243\n");
}

// An adapter config whose target list names a module the model lacks loads as PEFT loads it
// (the other names' modules adapted) with a warning naming it; exit 0.
TEST(Cli, ParamsWarnsOfATargetTheModelLacks) {
  const std::string dir = ::testing::TempDir() + "mixed-targets";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/adapter_config.json")
      << R"({"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "query_key_value"]})";
  const Result r = run("params --model llama-2-7b --peft " + dir + "/adapter_config.json");
  EXPECT_EQ(r.code, 0) << r.out;
  // q_proj alone: r 16 × (4,096 + 4,096) × 32 layers = 4,194,304; PEFT's printout for q and v at
  // r 8 has the same count (Peft.Llama2QvMatchesPeftPrintout).
  EXPECT_NE(r.out.find("trainable params: 4,194,304 || all params: 6,742,609,920"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("warning: " + dir + "/adapter_config.json (adapter \"default\"): target_modules names \"query_key_value\""),
            std::string::npos)
      << r.out;
  // plan carries it in --json's warnings, once.
  const Result p = run("plan --model llama-2-7b --json --peft " + dir + "/adapter_config.json");
  ASSERT_EQ(p.code, 0) << p.out;
  const auto j = nlohmann::json::parse(p.out.substr(p.out.find('{')));
  std::size_t named = 0;
  for (const auto& w : j["warnings"]) named += w.get<std::string>().find("\"query_key_value\"") != std::string::npos;
  EXPECT_EQ(named, 1u) << j["warnings"].dump();
  std::filesystem::remove_all(dir);
}

TEST(Cli, ParamsJson) {
  Result r = run("params --model mixtral-8x7b --lora-r 8 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  for (const char* k : {"total_params", "active_params", "trainable_params", "all_params", "trainable_percent"})
    EXPECT_TRUE(j.contains(k)) << k;
  EXPECT_LT(j["active_params"].get<std::int64_t>(), j["total_params"].get<std::int64_t>());
}

TEST(Cli, ModelsListsTheZoo) {
  Result r = run("models");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("6,738,415,616"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("tiny-llama-2l"), std::string::npos);
}

// Bad input: one line naming the file/flag, field and value; exit code 2; no stack trace.
// Every command's --help ends with an example, and the example runs as printed (exit 0), in a
// folder of its own for the ones that write files. Not here: `run` and `calibrate` (minutes of
// MPI; their own suites run them), `compare` and the examples that read what `run` writes.
TEST(Cli, EveryHelpExampleRuns) {
  const std::string dir = ::testing::TempDir() + "help-examples";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::size_t ran = 0;
  for (const char* command : {"models", "params", "plan", "recommend", "sweep", "explain", "report", "clusters", "estimate", "calibrate", "run",
                              "compare"}) {
    const Result help = run(std::string(command) + " --help");
    ASSERT_EQ(help.code, 0) << command;
    const auto at = help.out.find("example: peftplan ");
    ASSERT_NE(at, std::string::npos) << command << " --help has no example:\n" << help.out;
    // The example line, and the lines under it that are examples too ("         peftplan ...").
    std::vector<std::string> examples;
    std::istringstream lines(help.out.substr(at + 9));
    for (std::string line; std::getline(lines, line);) {
      const auto p = line.find_first_not_of(' ');
      if (p == std::string::npos || line.compare(p, 9, "peftplan ") != 0) break;
      examples.push_back(line.substr(p + 9));
    }
    for (const auto& example : examples) {
      EXPECT_TRUE(example.rfind(std::string(command) + " ", 0) == 0 || example == command) << example;
      if (std::string_view(command) == "run" || std::string_view(command) == "calibrate" || std::string_view(command) == "compare") continue;
      if (example.find("out/run/") != std::string::npos) continue;  // reads what run's example writes
      const Result r = peftplan::testing::run_cli(example, "cd '" + dir + "' &&");
      EXPECT_EQ(r.code, 0) << "peftplan " << example << "\n" << r.out;
      EXPECT_EQ(r.out.find("//"), std::string::npos) << "peftplan " << example << "\n" << r.out;
      ++ran;
    }
  }
  EXPECT_GE(ran, 10u);
  std::filesystem::remove_all(dir);
}

TEST(Cli, BadInputIsOneLineAndExitCodeTwo) {
  struct Case {
    std::string args, expect;
  };
  const Case cases[] = {
      {"params --model " + kData + "/bad/malformed_config.json", "malformed_config.json: is not valid JSON"},
      {"params --model " + kData + "/bad/unknown_type_config.json", "unknown_type_config.json: model_type is not supported"},
      {"params --model " + kData + "/bad/missing_field_config.json",
       "missing_field_config.json: intermediate_size is required but missing"},
      {"params --model llama-2-7b --peft " + kData + "/bad/bad_target_adapter_config.json", "query_key_value"},
      // The file is named beside the module (the adapter came from it).
      {"params --model llama-2-7b --peft " + kData + "/bad/bad_target_adapter_config.json", "bad_target_adapter_config.json (adapter \"default\")"},
      // A count beyond any model's: refused with its range, not planned as a model with no layers.
      {"params --model " + kData + "/bad/huge_layers_config.json", "huge_layers_config.json: num_hidden_layers must be an integer in [1, 10,000], got 1000000000000000"},
      {"params --model llama-2-7b --peft " + kData + "/bad/negative_rank_adapter_config.json",
       "negative_rank_adapter_config.json: r must be an integer in [1, 1,048,576], got -4"},
      {"params --model llama-2-7b --lora-r 0", "--lora-r: must be an integer in [1, 1,048,576], got 0"},
      {"params --model no-such-model", "is neither a zoo model nor a config.json path"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.args);
    Result r = run(c.args);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  }
}

// ---- peftplan plan ----

TEST(CliPlan, JsonHasCategoriesTimeAndVerdict) {
  Result r = run("plan --model llama-2-7b --lora-r 16 --lora-alpha 32 --lora-targets q_proj,v_proj --gpus 8 "
                 "--strategy zero3 --micro-batch 2 --seq-len 1024 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  for (const char* k : {"base_weights_bytes", "gathered_weights_bytes", "trainable_weights_bytes", "gradients_bytes",
                        "optimizer_states_bytes", "activations_bytes", "workspace_bytes", "comm_buffers_bytes",
                        "runtime_overhead_bytes", "peak_bytes", "peak_op"})
    EXPECT_TRUE(j["memory"]["device"].contains(k)) << k;
  for (const char* k : {"host_optimizer_states_bytes", "host_weights_bytes", "host_pinned_buffers_bytes", "host_other_bytes",
                        "peak_bytes"})
    EXPECT_TRUE(j["memory"]["host"].contains(k)) << k;
  for (const char* k : {"step_s", "compute_s", "comm_s", "exposed_comm_s", "optimizer_s", "offload_s", "tokens_per_s", "mfu"})
    EXPECT_TRUE(j["time"].contains(k)) << k;
  for (const char* k : {"all_reduce_bytes", "reduce_scatter_bytes", "all_gather_bytes", "broadcast_bytes"})
    EXPECT_TRUE(j["comm"].contains(k)) << k;
  EXPECT_TRUE(j["fits"].get<bool>());
  EXPECT_GT(j["memory"]["device"]["gathered_weights_bytes"].get<std::uint64_t>(), 0u);
}

// "Does not fit" is a result with reasons and exit code 1, so scripts can gate on it.
TEST(CliPlan, DoesNotFitIsExitCodeOneWithReasons) {
  Result r = run("plan --model llama-2-70b --gpus 1 --strategy ddp --micro-batch 4 --seq-len 4096");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("verdict: does not fit"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("needs "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("try "), std::string::npos) << r.out;
}

TEST(CliPlan, BadInputIsExitCodeTwo) {
  struct Case {
    std::string args, expect;
  };
  const Case cases[] = {
      {"plan --strategy zero2 --offload-param cpu",
       "strategy.offload_param cpu: parameter offload needs sharded parameters (strategy.stage zero3, fsdp-full-shard, fsdp-shard-grad-op or "
       "fsdp-hybrid-shard), got strategy.stage zero2 (strategy.offload_param is --offload-param; strategy.stage is --strategy)"},
      {"plan --micro-batch -2", "training.micro_batch must be a positive integer, got -2 (training.micro_batch is --micro-batch)"},
      {"plan --strategy zero4", "--strategy: must be one of ddp, zero1, zero2, zero3, fsdp-full-shard, fsdp-shard-grad-op, fsdp-no-shard, fsdp-hybrid-shard, got \"zero4\""},
      {"plan --gpus 8 --ds-config " + kData + "/ds/bad_batch.json", "train_batch_size"},
      {"plan --gpus 8 --ds-config " + kData + "/ds/offload_param_stage2.json", "offload_param"},
      {"plan --cluster 8xB300", "8xB300"},
      {"plan --gpus 2 --strategy fsdp-full-shard --profile deepspeed", "strategy.stage fsdp-full-shard: FSDP is planned with profile hf"},
      {"plan --gpus 2 --strategy fsdp-full-shard --profile hf --offload-optimizer cpu",
       "strategy.offload_optimizer cpu: FSDP has no optimizer-only offload"},
      {"plan --gpus 2 --strategy fsdp-full-shard --profile hf --write-ds-config /tmp/peftplan-test-fsdp-ds.json",
       "has no FSDP sharding strategy"},
      {"plan --accelerate-config " + kData + "/accelerate/malformed.yaml", "accelerate/malformed.yaml: not a valid YAML file"},
      {"plan --accelerate-config " + kData + "/accelerate/bad_strategy.yaml", "fsdp_config.fsdp_sharding_strategy must be"},
      {"plan --gpus 2 --profile hf --strategy fsdp-full-shard --ds-config " + kData + "/ds/zero3_unknown_key.json",
       "a DeepSpeed config runs ZeRO, not FSDP"},
      {"plan --gpus 2 --strategy zero3 --accelerate-config " + kData + "/accelerate/fms-acceleration-benchmarks.yaml",
       "the accelerate config sets the strategy"},
      {"plan --gpus 2 --profile hf --strategy zero3", "strategy.stage zero3 is DeepSpeed's ZeRO: plan it with profile deepspeed"},
      {"plan --headroom 120", "--headroom: must be a percentage in [0, 100), got 120"},
      {"plan --alloc-conf garbage_collection_threshold:0.6", "garbage_collection_threshold"},
      {"plan --gpus 2 --strategy zero3 --fsdp-version 2", "--fsdp-version 2 with --strategy zero3: the FSDP version applies to the fsdp-* strategies"},
      {"plan --gpus 2 --profile hf --strategy fsdp-no-shard --fsdp-version 2", "strategy.fsdp.version 2 with strategy.stage fsdp-no-shard: FSDP2's fully_shard plans"},
      {"plan --gpus 2 --profile hf --strategy fsdp-full-shard --fsdp-version 3", "--fsdp-version: must be 1 or 2, got 3"},
      // Numbers a comparison-based range check lets through (NaN), signs a spelling would drop,
      // sizes past 64-bit byte counts, and flags that contradict each other.
      {"plan --lora-alpha nan", "--lora-alpha: must be a positive finite number (the adapter's scale is alpha / r), got nan"},
      {"plan --lora-alpha inf", "--lora-alpha: must be a positive finite number"},
      {"plan --lora-dropout nan", "--lora-dropout: must be in [0, 1), got nan"},
      {"plan --cluster -1xA100-80GB", "cluster \"-1xA100-80GB\": starts with a sign: counts are positive integers"},
      {"plan --seq-len 99999999999999", "training.seq_len must be at most 1048576 (2^20 tokens), got 99999999999999 (training.seq_len is --seq-len)"},
      {"plan --seq-len 1048576 --micro-batch 4096", "training.micro_batch × training.seq_len must be at most 2^31 tokens per micro-batch"},
      {"plan --micro-batch 1e10", "peftplan: error: Could not convert: --micro-batch = 1e10 (see peftplan plan --help)"},
      {"plan --no-such-flag", "peftplan: error: The following argument was not expected: --no-such-flag (see peftplan plan --help)"},
      {"plan --quant nf4 --base-dtype fp32", "--base-dtype: contradicts --quant nf4 (the quantised base is stored as nf4): give one of them, got \"fp32\""},
      {"plan --quant int8 --double-quant", "--double-quant needs --quant nf4 or --quant fp4, got --quant int8"},
      {"plan --quant nf4 --full-finetune", "--quant nf4 with --full-finetune: transformers' Trainer refuses to fine-tune a purely quantised model"},
      {"plan --full-finetune --model " + kData + "/quantised/llama-3-8b-bnb-4bit",
       "llama-3-8b-bnb-4bit was saved quantised (bitsandbytes nf4 with double quantisation, its config.json's quantization_config): "
       "transformers' Trainer refuses to fine-tune a purely quantised model"},
      // What peftplan-exec cannot run is refused before `run` writes anything or starts MPI.
      {"run --quant nf4 --lora-r 4 --steps 1 --out " + ::testing::TempDir() + "never-written",
       "run: the executor cannot run this plan (quantised base weights): `peftplan plan` plans it for the GPU runtimes"},
      {"plan --lora-r 16 --base-dtype bf16 --model " + kData + "/quantised/llama-3-8b-bnb-4bit",
       "--base-dtype: contradicts the model's quantization_config (saved quantised, bitsandbytes nf4 with double quantisation, and loaded so)"},
      {"plan --lora-r 16 --profile hf --strategy fsdp-full-shard --gpus 8 --model " + kData + "/quantised/llama-3-8b-bnb-4bit",
       "strategy.stage fsdp-full-shard with a checkpoint saved quantised in integer storage: FSDP1 flattens a unit's parameters"},
      {"params --full-finetune --model " + kData + "/quantised/llama-3-8b-bnb-4bit",
       "transformers' Trainer refuses to fine-tune a purely quantised model"},
      {"estimate --gpus 8 --model " + kData + "/quantised/llama-3-8b-bnb-4bit",
       "--model: names a checkpoint saved quantised (bitsandbytes nf4 with double quantisation"},
      // Combinations the runtime refuses when it starts: bitsandbytes' 8-bit AdamW on the host
      // (ZeRO-Offload, FSDP's CPUOffload), and fp16 gradients under torch.amp's GradScaler.
      {"plan --gpus 2 --strategy zero2 --optimizer adamw-8bit --offload-optimizer cpu",
       "training.optimizer adamw-8bit with strategy.offload_optimizer cpu: bitsandbytes' 8-bit AdamW runs only on the GPU"},
      {"plan --gpus 2 --profile hf --strategy fsdp-full-shard --optimizer adamw-8bit --offload-param cpu",
       "training.optimizer adamw-8bit with strategy.offload_param cpu: bitsandbytes' 8-bit AdamW runs only on the GPU"},
      {"plan --gpus 2 --strategy zero3 --cross-entropy chunked",
       "training.cross_entropy chunked with strategy.stage zero3: Liger's fused loss reads the untied LM head's weight"},
      {"plan --gpus 2 --profile deepspeed --precision bf16-pure",
       "training.precision bf16-pure with strategy.stage ddp under profile deepspeed: DeepSpeed runs pure bf16 only under ZeRO"},
      {"plan --gpus 2 --profile hf --full-finetune --precision fp16",
       "training.precision fp16 with full fine-tuning under profile hf and strategy.stage ddp: the Trainer's GradScaler"},
      // ... and so are the fp16 tensors PEFT trains beside its fp32 adapters (peft's
      // _cast_adapter_dtype upcasts tuner layers only).
      {"plan --gpus 2 --profile hf --precision fp16 --peft " + kData + "/adapters/qv16_lm_head",
       "training.precision fp16 with modules_to_save (lm_head) under profile hf and strategy.stage ddp: PEFT trains it in the base's fp16"},
      {"plan --gpus 2 --profile hf --precision fp16 --model qwen2.5-7b --peft " + kData + "/adapters/qv16_bias_all",
       "training.precision fp16 with bias \"all\" under profile hf and strategy.stage ddp"},
      // bias "lora_only" trains the adapted Linears' biases only (PEFT's _mark_only_adapters_as_trainable):
      // Qwen2.5's q_proj has one; its o_proj has none, so that adapter trains no fp16 tensor.
      {"plan --gpus 2 --profile hf --precision fp16 --model qwen2.5-7b --peft " + kData + "/adapters/qv16_bias_lora_only",
       "training.precision fp16 with bias \"lora_only\" (model.layers.0.self_attn.q_proj has a bias) under profile hf"},
      // Typed flags that contradict a launcher config are refused; ones that agree with it plan
      // (CliPlan.LauncherConfigFlagsThatAgreePlan).
      // The evaluation batch is bounded as the training one is, and named (it was blamed on --micro-batch).
      {"plan --profile hf --eval-batch 100000", "training.eval_batch must be at most 65536 (2^16 sequences), got 100000 (training.eval_batch is --eval-batch)"},
      {"recommend --top -1", "--top: Value -1 not in range 1 to 1000000"},
      // An empty value (an unset shell variable) is no default: "not given" is leaving the flag out.
      {"plan --ds-config ''", "peftplan: error: --ds-config: must not be empty (leave the flag out for its default)"},
      {"plan --profile ''", "peftplan: error: --profile: must not be empty"},
      {"recommend --cluster ''", "peftplan: error: --cluster: must not be empty"},
      {"plan --base-dtype ''", "peftplan: error: --base-dtype: must not be empty"},
      {"compare a.json b.json --tolerance-time nan", "--tolerance-time: must be a finite number >= 0, got nan"},
      {"run --tolerance-memory -0.5", "--tolerance-memory: must be a finite number >= 0, got -0.5"},
      {"plan --gpus 8 --ds-config " + kData + "/ds/zero3_unknown_key.json --strategy zero1",
       "the ds_config sets the strategy (zero_optimization.stage zero3); drop --strategy"},
      // --strategy given as ddp (the default's spelling) is still a flag that contradicts the file
      {"plan --gpus 8 --ds-config " + kData + "/ds/zero3_unknown_key.json --strategy ddp",
       "with --strategy ddp: the ds_config sets the strategy (zero_optimization.stage zero3); drop --strategy"},
      // Any flag the launcher config also sets, typed and contradicted, is refused naming the file's field.
      {"plan --gpus 8 --ds-config " + kData + "/ds/zero3_unknown_key.json --precision fp16",
       "zero3_unknown_key.json: bf16.enabled is true, and the Trainer's own fp16 (training.precision) would enable fp16 beside it: "
       "accelerate says \"`--mixed_precision` arg cannot be set to `fp16` when `bf16` is set in the DeepSpeed config file.\"; give one"},
      {"plan --gpus 8 --ds-config " + kData + "/ds/zero3_unknown_key.json --precision fp32",
       "with --precision fp32: the ds_config sets the precision (bf16.enabled true with fp32 master weights: bf16); drop --precision"},
      {"plan --gpus 8 --ds-config " + kData + "/ds/zero3_unknown_key.json --offload-param cpu",
       "with --offload-param cpu: the ds_config sets the parameter offload (zero_optimization.offload_param.device none); drop --offload-param"},
      {"plan --gpus 8 --ds-config " + kData + "/ds/fixed_batch.json --micro-batch 2",
       "with --micro-batch 2: the ds_config sets the micro-batch (train_micro_batch_size_per_gpu 4); drop --micro-batch"},
      {"plan --gpus 8 --ds-config " + kData + "/ds/fixed_batch.json --grad-accum 1",
       "with --grad-accum 1: the ds_config sets the accumulation (gradient_accumulation_steps 2); drop --grad-accum"},
      {"plan --gpus 8 --ds-config " + kData + "/ds/fixed_batch.json --optimizer adamw-8bit",
       "with --optimizer adamw-8bit: the ds_config sets the optimizer (optimizer.type: adamw, which DeepSpeed builds in place of the Trainer's)"},
      {"plan --gpus 2 --accelerate-config " + kData + "/accelerate/fms-acceleration-benchmarks.yaml --offload-param cpu",
       "with --offload-param cpu: the accelerate config sets the parameter offload (fsdp_config.fsdp_offload_params false); drop --offload-param"},
      {"plan --gpus 2 --accelerate-config " + kData + "/accelerate/fms-acceleration-benchmarks.yaml --offload-optimizer cpu",
       "the accelerate config sets the optimizer offload (none: accelerate has no optimizer-only offload)"},
      {"plan --gpus 2 --accelerate-config " + kData + "/accelerate/fsdp_checkpointing.yaml --checkpointing every-2",
       "with --checkpointing every-2: the accelerate config sets the checkpointing (fsdp_config.fsdp_activation_checkpointing true: every layer)"},
      {"plan --gpus 2 --accelerate-config " + kData + "/accelerate/fsdp_checkpointing.yaml --precision fp32",
       "with --precision fp32: the accelerate config sets the precision (mixed_precision: bf16); drop --precision"},
      {"compare a.json b.json --out " + kData + "/ds/bad_batch.json", "--out: is a file, not a folder (validation.json and report.md go into a folder)"},
      // A path that never ends is read up to a bound, not forever.
      {"plan --gpus 2 --ds-config /dev/zero", "/dev/zero: is larger than 256 MiB, the most read of an input file"},
      {"plan --gpus 2 --profile hf --accelerate-config /dev/zero", "/dev/zero: is larger than 256 MiB"},
      {"plan --gpus 2000000", "--gpus: must be at most 1,000,000, got 2000000"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.args);
    Result r = run(c.args);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << r.out;
  }
  // Refused before anything is written: run's --out was never made.
  EXPECT_FALSE(std::filesystem::exists(::testing::TempDir() + "never-written"));
}

// Flags typed beside a launcher config that say what it says, or what it leaves to them, plan.
// The same fp16 adapters the GradScaler rule refuses plan where PEFT's copies are fp32 (a QLoRA
// base, which prepare_model_for_kbit_training upcasts; an fp32 base), under FSDP's
// ShardedGradScaler, and where the model has no bias to train (Llama under bias "all").
TEST(CliPlan, LauncherConfigFlagsThatAgreePlan) {
  struct Case {
    std::string args, expect;  // expect: a fragment of the output ("" for none)
  };
  const Case cases[] = {
      {"plan --gpus 8 --ds-config " + kData + "/ds/fixed_batch.json --micro-batch 4 --grad-accum 2 --precision bf16 --optimizer adamw", ""},
      // "auto" takes the flags' values
      {"plan --gpus 8 --ds-config " + kData + "/ds/zero3_unknown_key.json --micro-batch 2 --grad-accum 3", "micro-batch 2 × seq 2048 × accum 3"},
      // no precision section: accelerate adds the Trainer's
      {"plan --gpus 8 --ds-config " + kData + "/ds/no_precision.json --strategy zero2 --precision fp16", "· fp16 ·"},
      {"plan --gpus 2 --accelerate-config " + kData + "/accelerate/fsdp_checkpointing.yaml --precision fp16 --checkpointing full",
       "--precision fp16 overrides mixed_precision 'bf16' (the Trainer's fp16=True overrides accelerate's)"},
      {"plan --gpus 2 --profile hf --precision fp16 --quant nf4 --peft " + kData + "/adapters/qv16_lm_head", ""},
      {"plan --gpus 2 --profile hf --precision fp16 --base-dtype fp32 --peft " + kData + "/adapters/qv16_lm_head", ""},
      {"plan --gpus 2 --profile hf --precision fp16 --strategy fsdp-full-shard --peft " + kData + "/adapters/qv16_lm_head", ""},
      {"plan --gpus 2 --profile hf --precision fp16 --peft " + kData + "/adapters/qv16_bias_all", ""},
      {"plan --gpus 2 --profile hf --precision fp16 --model qwen2.5-7b --peft " + kData + "/adapters/o16_bias_lora_only", ""},
      // Valid files that the refusals of empty target lists, IA3 subsets and cut-short YAML lines
      // must let through: an empty exclude_modules, a regex feedforward_modules, an explicit key.
      {"plan --model tiny-llama-2l --peft " + kData + "/adapters/exclude_none", ""},
      {"plan --model tiny-llama-2l --peft " + kData + "/adapters/ia3_ff_regex", ""},
      {"plan --gpus 2 --accelerate-config " + kData + "/accelerate/explicit_key.yaml", "fsdp-full-shard"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.args);
    Result r = run(c.args);
    EXPECT_TRUE(r.code == 0 || r.code == 1) << r.out;
    EXPECT_EQ(r.out.find("error"), std::string::npos) << r.out;
    if (!c.expect.empty()) {
      EXPECT_NE(r.out.find(c.expect), std::string::npos) << r.out;
    }
  }
  // A ds_config that leaves the micro-batch out derives it from train_batch_size, and says so.
  const std::filesystem::path ds = std::filesystem::path(::testing::TempDir()) / "peftplan-train-batch-only.json";
  std::ofstream(ds) << R"({"train_batch_size": 64, "zero_optimization": {"stage": 2}})";
  Result r = run("plan --gpus 8 --ds-config " + ds.string() + " --micro-batch 2");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("the ds_config sets the micro-batch (train_micro_batch_size_per_gpu 8, derived from train_batch_size 64); drop "
                       "--micro-batch"),
            std::string::npos)
      << r.out;
  std::filesystem::remove(ds);
}

// V100 (compute capability 7.0) has fp16 tensor cores and no bf16 ones (NVIDIA's V100 datasheet:
// 125 TFLOP/s of fp16 tensor math): bf16 is planned at the fp32 rate, and the plan says so.
TEST(CliPlan, Bf16OnAGpuWithoutBf16TensorCoresWarns) {
  Result bf16 = run("plan --cluster 8xV100 --precision bf16");
  ASSERT_EQ(bf16.code, 0) << bf16.out;
  EXPECT_NE(bf16.out.find("warning: V100 has no bf16 tensor cores (compute capability 7.0): bf16 GEMMs run at its fp32 rate"), std::string::npos)
      << bf16.out;
  for (const char* other : {"plan --cluster 8xV100 --precision fp16", "plan --cluster 8xA100-80GB --precision bf16"}) {
    Result r = run(other);
    EXPECT_EQ(r.out.find("no bf16 tensor cores"), std::string::npos) << other << r.out;
  }
}

// DeepSpeed runs pure bf16 under ZeRO only (bf16_master_weights_and_grads): pure-bf16 DDP is the
// Trainer's own DDP, so without --profile it is planned with hf, and says so; ZeRO stays deepspeed.
TEST(CliPlan, PureBf16DdpIsPlannedAsTheTrainersDdp) {
  Result ddp = run("plan --gpus 2 --precision bf16-pure --json");
  ASSERT_EQ(ddp.code, 0) << ddp.out;
  EXPECT_EQ(nlohmann::json::parse(ddp.out.substr(ddp.out.find('{')))["profile"], "hf") << ddp.out;
  Result text = run("plan --gpus 2 --precision bf16-pure");
  EXPECT_NE(text.out.find("warning: --precision bf16-pure with --strategy ddp is planned with --profile hf"), std::string::npos) << text.out;
  // FSDP is accelerate's: without --profile it is planned with hf, and says so.
  Result fsdp = run("plan --gpus 2 --strategy fsdp-full-shard");
  ASSERT_EQ(fsdp.code, 0) << fsdp.out;
  EXPECT_NE(fsdp.out.find("warning: --strategy fsdp-full-shard is planned with --profile hf: torch FSDP runs under accelerate, not DeepSpeed"),
            std::string::npos)
      << fsdp.out;
  Result zero = run("plan --gpus 2 --precision bf16-pure --strategy zero2 --json");
  ASSERT_EQ(zero.code, 0) << zero.out;
  EXPECT_EQ(nlohmann::json::parse(zero.out.substr(zero.out.find('{')))["profile"], "deepspeed") << zero.out;
}

// Settings under which the planner refuses some strategies (8-bit AdamW with an offload, Liger's
// loss under ZeRO-3 with an untied head, fp16 full fine-tuning under the Trainer's DDP) still give
// a report and a search: those columns and families are left out, each with its reason. (Pure-bf16
// DDP is no longer one: it is planned as the Trainer's DDP, "ddp (hf)".)
TEST(CliPlan, RefusedStrategiesAreLeftOutOfReportsAndSearches) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "peftplan-left-out";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  for (const std::string& flags : {std::string("--optimizer adamw-8bit"), std::string("--cross-entropy chunked"),
                                   std::string("--profile hf --full-finetune --precision fp16 --strategy fsdp-full-shard")}) {
    SCOPED_TRACE(flags);
    const std::string out = (dir / std::to_string(std::hash<std::string>{}(flags))).string();
    Result r = run("report --gpus 2 --no-recommend " + flags + " --out " + out);
    ASSERT_EQ(r.code, 0) << r.out;
    std::ifstream md(out + "/report.md");
    const std::string text((std::istreambuf_iterator<char>(md)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("| strategy left out | "), std::string::npos) << text.substr(0, 2000);
  }
  {  // pure-bf16 DDP under deepspeed: its columns are the Trainer's DDP, labelled so
    const std::string out = (dir / "pure").string();
    Result p = run("report --gpus 2 --no-recommend --profile deepspeed --precision bf16-pure --strategy zero2 --out " + out);
    ASSERT_EQ(p.code, 0) << p.out;
    std::ifstream md(out + "/report.md");
    const std::string text((std::istreambuf_iterator<char>(md)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("ddp (hf)"), std::string::npos) << text.substr(0, 2000);
    EXPECT_EQ(text.find("| strategy left out | "), std::string::npos) << text.substr(0, 2000);
  }
  Result r = run("recommend --cluster 2xA100-80GB --profile hf --full-finetune --precision fp16 --top 1");
  EXPECT_EQ(r.code == 0 || r.code == 1, true) << r.out;
  EXPECT_NE(r.out.find("ddp: not planned: training.precision fp16 with full fine-tuning under profile hf"), std::string::npos) << r.out;
  std::filesystem::remove_all(dir);
}

TEST(CliPlan, DsConfigAutoValuesAndUnknownKeyWarning) {
  Result r = run("plan --gpus 8 --micro-batch 2 --ds-config " + kData + "/ds/zero3_unknown_key.json");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("strategy zero3"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("not_a_deepspeed_knob"), std::string::npos) << r.out;
}

// plan's files are all made and their folders checked before any is written: a missing folder
// or a refused file (FSDP has no ds_config) leaves none of them behind.
TEST(CliPlan, OutputsAreAllOrNothing) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "peftplan-plan-outputs";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string plan = (dir / "p.json").string();
  Result r = run("plan --write-plan " + plan + " --trace " + (dir / "no" / "t.json").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--trace: its folder " + (dir / "no").string() + " does not exist (nothing was written)"), std::string::npos) << r.out;
  r = run("plan --gpus 2 --profile hf --strategy fsdp-full-shard --write-plan " + plan + " --write-ds-config " + (dir / "ds.json").string());
  EXPECT_EQ(r.code, 2) << r.out;
  r = run("plan --write-plan " + dir.string());
  EXPECT_NE(r.out.find("is a folder, not a file"), std::string::npos) << r.out;
  EXPECT_TRUE(std::filesystem::is_empty(dir));
  // A file that cannot be written (where no file can be made) after one that can: neither stays.
  r = run("plan --write-plan " + plan + " --trace /proc/peftplan-t.json");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--trace /proc/peftplan-t.json: cannot be written"), std::string::npos) << r.out;
  // One file for two flags would keep only the last.
  r = run("plan --write-plan " + plan + " --trace " + plan);
  EXPECT_NE(r.out.find("--trace: is also --write-plan's file: give each its own (nothing was written)"), std::string::npos) << r.out;
  r = run("plan --write-plan ''");
  EXPECT_NE(r.out.find("--write-plan: must not be empty"), std::string::npos) << r.out;
  EXPECT_TRUE(std::filesystem::is_empty(dir));
  r = run("plan --write-plan " + plan + " --trace " + (dir / "t.json").string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(std::filesystem::exists(plan) && std::filesystem::exists(dir / "t.json"));
  std::filesystem::remove_all(dir);
}

// What is not a regular file is written to, not replaced by one: a link to /dev/null stays a link
// to the device (renaming over it made a 3.6 kB file of it; as root, --trace /dev/null replaced
// the device itself). A link to a file is followed: the file is rewritten, the link stays.
TEST(CliPlan, OutputsAreWrittenThroughDevicesAndLinks) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "peftplan-plan-devices";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::filesystem::create_symlink("/dev/null", dir / "null");
  Result r = run("plan --model tiny-llama-2l --seq-len 64 --trace " + (dir / "null").string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(std::filesystem::is_symlink(dir / "null"));
  EXPECT_TRUE(std::filesystem::is_character_file("/dev/null"));
  std::ofstream(dir / "real.json") << "old\n";
  std::filesystem::create_symlink("real.json", dir / "link.json");
  r = run("plan --model tiny-llama-2l --seq-len 64 --write-plan " + (dir / "link.json").string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(std::filesystem::is_symlink(dir / "link.json"));
  EXPECT_GT(std::filesystem::file_size(dir / "real.json"), 100u);
  // A link to a file not made yet: the file is made, the link stays.
  std::filesystem::create_symlink("later.json", dir / "dangling.json");
  r = run("plan --model tiny-llama-2l --seq-len 64 --write-plan " + (dir / "dangling.json").string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(std::filesystem::is_symlink(dir / "dangling.json"));
  EXPECT_TRUE(std::filesystem::is_regular_file(dir / "later.json"));
  // One device for two outputs is no clash; /dev/stdout into a file keeps both the trace and the text.
  r = run("plan --model tiny-llama-2l --seq-len 64 --trace /dev/null --memory-trace /dev/null");
  EXPECT_EQ(r.code, 0) << r.out;
  const std::string out = (dir / "out.txt").string();
  ASSERT_EQ(std::system((std::string(PEFTPLAN_CLI) + " plan --model tiny-llama-2l --seq-len 64 --trace /dev/stdout > " + out).c_str()), 0);
  std::ifstream f(out);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("traceEvents"), std::string::npos);
  EXPECT_NE(text.find("verdict: fits"), std::string::npos);
  std::filesystem::remove_all(dir);
}

// A file's key echoed in a warning cannot drive the terminal: its control bytes are escaped and its
// newline shown as \n, one line per warning.
TEST(CliPlan, WarningsAreOnePrintableLineEach) {
  const Result r = run("plan --gpus 2 --ds-config " + kData + "/ds/escape_in_key.json");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("escape_in_key.json: bad\\nkey\\x1b[31mRED is not a DeepSpeed config key; ignored\n"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find('\x1b'), std::string::npos);
}

// The trace parses back with the Trace Event Format's required fields (traceEvents, ph "X" with
// microsecond ts/dur, thread_name metadata naming the streams).
TEST(CliPlan, TraceFilesParseBack) {
  const std::string dir = ::testing::TempDir();
  Result r = run("plan --strategy zero3 --trace " + dir + "/t.json --memory-trace " + dir + "/m.json");
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream tin(dir + "/t.json");
  const auto t = nlohmann::json::parse(tin);
  ASSERT_TRUE(t.contains("traceEvents"));
  int complete = 0, threads = 0;
  for (const auto& e : t["traceEvents"]) {
    if (e["ph"] == "X") {
      ++complete;
      EXPECT_TRUE(e["ts"].is_number() && e["dur"].is_number());
    }
    if (e["ph"] == "M" && e["name"] == "thread_name") ++threads;
  }
  EXPECT_GT(complete, 100);
  EXPECT_GE(threads, 2);
  std::ifstream min(dir + "/m.json");
  const auto m = nlohmann::json::parse(min);
  bool counter = false;
  for (const auto& e : m["traceEvents"]) counter = counter || e["ph"] == "C";
  EXPECT_TRUE(counter);
}

// ds_config.json out and back in: the second plan sees the same strategy and batch.
TEST(CliPlan, WriteDsConfigRoundTrips) {
  const std::string file = ::testing::TempDir() + "/ds_round.json";
  Result a = run("plan --gpus 8 --strategy zero3 --offload-optimizer cpu --micro-batch 2 --grad-accum 4 --json "
                 "--write-ds-config " + file);
  ASSERT_EQ(a.code, 0) << a.out;
  std::ifstream in(file);
  const auto ds = nlohmann::json::parse(in);
  EXPECT_EQ(ds["train_batch_size"], 2 * 4 * 8);  // DeepSpeed's rule: micro x accumulation x ranks
  EXPECT_EQ(ds["zero_optimization"]["stage"], 3);
  Result b = run("plan --gpus 8 --ds-config " + file + " --json");
  ASSERT_EQ(b.code, 0) << b.out;
  const auto ja = nlohmann::json::parse(a.out), jb = nlohmann::json::parse(b.out);
  EXPECT_EQ(ja["memory"], jb["memory"]);
  EXPECT_EQ(jb["strategy"], "zero3");
}

// --accelerate-config: the fms-acceleration benchmarks' launch file plans FSDP FULL_SHARD under
// the hf profile; its mixed_precision 'no' plans pure bf16; --gpus overrides num_processes.
TEST(CliPlan, AccelerateConfigPlansTheFileStrategy) {
  Result r = run("plan --json --gpus 2 --cluster 1x2xA100-80GB --lora-r 16 --checkpointing full --seq-len 1024 --accelerate-config " + kData +
                 "/accelerate/fms-acceleration-benchmarks.yaml");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
  EXPECT_EQ(j["strategy"], "fsdp-full-shard");
  EXPECT_EQ(j["profile"], "hf");
  EXPECT_EQ(j["ranks"], 2);
  const std::string warnings = j["warnings"].dump();
  EXPECT_NE(warnings.find("mixed_precision 'no' is planned as --precision bf16-pure"), std::string::npos) << warnings;
  EXPECT_NE(warnings.find("--gpus 2 overrides num_processes 1"), std::string::npos) << warnings;
  // An explicit --profile is kept.
  Result d = run("plan --gpus 2 --cluster 1x2xA100-80GB --profile deepspeed --accelerate-config " + kData +
                 "/accelerate/fms-acceleration-benchmarks.yaml");
  EXPECT_EQ(d.code, 2) << d.out;
  EXPECT_NE(d.out.find("FSDP is planned with profile hf"), std::string::npos) << d.out;
}

// A checkpoint saved quantised (its config.json's quantization_config, as unsloth's and
// bitsandbytes' 4-bit uploads are) plans as the same model quantised by flags: the same bytes in
// every category, the same step time. A --quant that asks otherwise is a warning, not a new plan.
TEST(Cli, ACheckpointSavedQuantisedPlansAsItsQuantisation) {
  const std::string flags = " --lora-r 16 --profile hf --gpus 1 --seq-len 1024 --eval-batch 0 --json";
  const Result saved = run("plan --model " + kData + "/quantised/llama-3-8b-bnb-4bit" + flags);
  const Result by_flags = run("plan --model llama-3-8b --quant nf4 --double-quant" + flags);
  ASSERT_EQ(saved.code, 0) << saved.out;
  ASSERT_EQ(by_flags.code, 0) << by_flags.out;
  const auto a = nlohmann::json::parse(saved.out.substr(saved.out.find('{')));
  const auto b = nlohmann::json::parse(by_flags.out.substr(by_flags.out.find('{')));
  EXPECT_EQ(a["memory"], b["memory"]);  // every category, the three peaks, the host
  EXPECT_EQ(a["time"], b["time"]);
  EXPECT_TRUE(a["warnings"].empty()) << a["warnings"].dump();
  // Loading reads the packed checkpoint: on the device the weights alone, no bf16 Linear beside
  // them as when bitsandbytes quantises at load.
  EXPECT_LT(a["lifecycle"]["load_device_bytes"].get<double>(), b["lifecycle"]["load_device_bytes"].get<double>());
  const Result fp4 = run("plan --model " + kData + "/quantised/llama-3-8b-bnb-4bit --quant fp4" + flags);
  ASSERT_EQ(fp4.code, 0) << fp4.out;
  const auto c = nlohmann::json::parse(fp4.out.substr(fp4.out.find('{')));
  EXPECT_EQ(c["memory"], a["memory"]);
  ASSERT_EQ(c["warnings"].size(), 1u) << c["warnings"].dump();
  EXPECT_NE(c["warnings"][0].get<std::string>().find("planned as bitsandbytes nf4 with double quantisation, not bitsandbytes fp4"), std::string::npos) << c["warnings"].dump();
}

// Every command that reads plan's flags says what reading them warns of: sweep once per grid, not
// once per row; recommend and explain on stderr, where --json output does not hold it.
TEST(Cli, EveryPlanningCommandWarnsOfItsInputs) {
  const std::string model = " --model " + kData + "/quantised/llama-3-8b-bnb-4bit --lora-r 16 --gpus 1 --cluster 1xA100-80GB";
  auto count = [](const std::string& text, const std::string& what) {
    std::size_t n = 0;
    for (std::size_t at = 0; (at = text.find(what, at)) != std::string::npos; at += what.size()) ++n;
    return n;
  };
  const std::string saved = "warning: llama-3-8b-bnb-4bit was saved quantised (its config.json's quantization_config)";
  const Result s = run("sweep" + model + " --quant none,nf4 --micro-batch 1,2");
  ASSERT_EQ(s.code, 0) << s.out;
  EXPECT_EQ(count(s.out, saved), 2u) << s.out;  // two --quant values that ask otherwise, four rows
  EXPECT_EQ(count(s.out, "planned as bitsandbytes nf4 with double quantisation, not unquantised"), 1u) << s.out;
  EXPECT_EQ(count(s.out, "planned as bitsandbytes nf4 with double quantisation, not bitsandbytes nf4\n"), 1u) << s.out;
  const Result r = run("recommend" + model + " --quant fp4 --top 1");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(count(r.out, saved), 1u) << r.out;
  const Result e = run("explain" + model + " --quant fp4");
  EXPECT_EQ(e.code, 0) << e.out;
  EXPECT_EQ(count(e.out, saved), 1u) << e.out;
  const std::string dir = ::testing::TempDir() + "warned-report";
  const Result rep = run("report" + model + " --quant fp4 --out " + dir);
  EXPECT_EQ(rep.code, 0) << rep.out;
  EXPECT_EQ(count(rep.out, saved), 1u) << rep.out;
  std::filesystem::remove_all(dir);
  // On stderr: --json's stdout parses whole.
  const Result j = peftplan::testing::run_cli("recommend" + model + " --quant fp4 --top 1 --json 2>/dev/null; true");
  EXPECT_TRUE(nlohmann::json::accept(j.out)) << j.out;
}

// Under FSDP1 a checkpoint saved quantised plans when its 4-bit weights are stored in the other
// parameters' dtype (bnb_4bit_quant_storage bfloat16 under bf16), and is refused otherwise: FSDP1
// flattens a unit into one tensor of one dtype. The run directory must not appear either.
TEST(Cli, FsdpTakesACheckpointSavedQuantisedInItsOwnDtypeOnly) {
  nlohmann::json c = nlohmann::json::parse(std::ifstream(kData + "/quantised/llama-3-8b-bnb-4bit/config.json"));
  const std::string dir = ::testing::TempDir() + "fsdp-storage";
  std::filesystem::create_directories(dir);
  auto plan_with = [&](const nlohmann::json& qc, const std::string& extra) {
    c["quantization_config"] = qc;
    std::ofstream(dir + "/config.json") << c.dump();
    return run("plan --model " + dir + " --lora-r 16 --profile hf --strategy fsdp-full-shard --gpus 8" + extra);
  };
  nlohmann::json qc = c["quantization_config"];
  qc["bnb_4bit_quant_storage"] = "bfloat16";
  Result r = plan_with(qc, "");
  EXPECT_EQ(r.code, 0) << r.out;
  r = plan_with(qc, " --fsdp-version 2");
  EXPECT_EQ(r.code, 0) << r.out;
  qc["bnb_4bit_quant_storage"] = "float16";  // beside bf16 parameters
  r = plan_with(qc, "");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("in fp16 storage: FSDP1 flattens a unit's parameters into one tensor of one dtype and cannot hold those 4-bit "
                       "weights beside the bf16 ones"),
            std::string::npos)
      << r.out;
  r = plan_with(nlohmann::json{{"load_in_8bit", true}}, "");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("with a checkpoint saved in 8-bit: FSDP1 flattens"), std::string::npos) << r.out;
  std::filesystem::remove_all(dir);
}
