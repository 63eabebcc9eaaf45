// accelerate's launch config YAML in and out (planner/accelerate_config.h), against accelerate
// 1.0.1's spellings: sharding strategies by name or by torch's ShardingStrategy number, the
// deprecated fsdp_backward_prefetch_policy key, and the fms-acceleration benchmarks' own file.
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "peftplan/common/error.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/accelerate_config.h"
#include "peftplan/planner/launcher_config.h"

using namespace peftplan;
using namespace peftplan::planner;

namespace {

const std::string kDir = std::string(PEFTPLAN_TEST_DATA) + "/accelerate";

std::string error_of(std::string_view yaml) {
  try {
    read_accelerate_config(yaml, "cfg.yaml");
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

TEST(AccelerateConfig, ReadsTheFmsBenchmarksFile) {
  const AccelerateConfig c = read_accelerate_config_file(kDir + "/fms-acceleration-benchmarks.yaml");
  EXPECT_EQ(c.strategy.stage, Stage::fsdp_full_shard);  // fsdp_sharding_strategy: 1
  EXPECT_EQ(c.strategy.offload_param, OffloadDevice::none);
  EXPECT_EQ(c.strategy.fsdp.backward_prefetch, FsdpPrefetch::backward_pre);
  EXPECT_FALSE(c.strategy.fsdp.forward_prefetch);
  EXPECT_TRUE(c.strategy.fsdp.cpu_ram_efficient_loading);
  EXPECT_TRUE(c.strategy.fsdp.sync_module_states);
  EXPECT_TRUE(c.strategy.fsdp.use_orig_params);  // accelerate launch's default
  EXPECT_EQ(c.strategy.fsdp.state_dict_type, "SHARDED_STATE_DICT");
  EXPECT_EQ(c.strategy.ranks, 1);
  EXPECT_EQ(c.num_machines, 1);
  EXPECT_FALSE(c.precision.has_value());  // mixed_precision: 'no'
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_NE(c.warnings[0].find("fsdp_backward_prefetch_policy is the deprecated name"), std::string::npos);
}

TEST(AccelerateConfig, ShardingStrategyByNameOrNumber) {
  const std::pair<std::string, Stage> cases[] = {
      {"1", Stage::fsdp_full_shard},        {"FULL_SHARD", Stage::fsdp_full_shard},
      {"2", Stage::fsdp_shard_grad_op},     {"SHARD_GRAD_OP", Stage::fsdp_shard_grad_op},
      {"3", Stage::fsdp_no_shard},          {"NO_SHARD", Stage::fsdp_no_shard},
      {"4", Stage::fsdp_hybrid_shard},      {"HYBRID_SHARD", Stage::fsdp_hybrid_shard},
  };
  for (const auto& [v, stage] : cases) {
    SCOPED_TRACE(v);
    const auto c = read_accelerate_config("distributed_type: FSDP\nnum_processes: 16\nnum_machines: 2\nfsdp_config:\n  fsdp_sharding_strategy: " + v + "\n", "cfg.yaml");
    EXPECT_EQ(c.strategy.stage, stage);
    EXPECT_EQ(c.strategy.ranks, 16);
    if (stage == Stage::fsdp_hybrid_shard) {
      EXPECT_EQ(c.strategy.shard_group, 8);  // a node's ranks
    }
  }
}

TEST(AccelerateConfig, WriteThenReadIsTheSameStrategy) {
  for (Stage stage : {Stage::fsdp_full_shard, Stage::fsdp_shard_grad_op, Stage::fsdp_no_shard, Stage::fsdp_hybrid_shard, Stage::ddp}) {
    for (bool offload : {false, true}) {
      if (offload && !shards_params(stage)) continue;
      Strategy s;
      s.stage = stage;
      s.ranks = 16;
      s.offload_param = offload ? OffloadDevice::cpu : OffloadDevice::none;
      s.fsdp.backward_prefetch = FsdpPrefetch::backward_post;
      s.fsdp.forward_prefetch = true;
      s.fsdp.state_dict_type = "FULL_STATE_DICT";
      s.fsdp.activation_checkpointing = true;
      if (stage == Stage::fsdp_hybrid_shard) s.shard_group = 8;
      TrainingSpec t;
      t.precision = Precision::bf16_mixed;
      t.checkpointing = Checkpointing::full;  // as reading the knob sets it (apply_accelerate_config)
      t.checkpoint_reentrant = false;
      const std::string yaml = write_accelerate_config(s, t, 2);
      SCOPED_TRACE(yaml);
      const AccelerateConfig c = read_accelerate_config(yaml, "written.yaml");
      EXPECT_TRUE(c.warnings.empty());
      EXPECT_EQ(c.strategy.stage, s.stage);
      EXPECT_EQ(c.strategy.ranks, 16);
      EXPECT_EQ(c.num_machines, 2);
      EXPECT_EQ(c.precision, Precision::bf16_mixed);
      if (is_fsdp(stage)) {
        EXPECT_EQ(c.strategy.offload_param, s.offload_param);
        EXPECT_EQ(c.strategy.fsdp, s.fsdp);
        EXPECT_EQ(c.strategy.shard_group, s.shard_group);
      }
    }
  }
}

// fsdp_activation_checkpointing is what the configuration checkpoints: FSDP's non-reentrant
// wrapper on every layer. A row that checkpoints otherwise (none, every-k, reentrant) writes it
// off, so the launch runs what was planned.
TEST(AccelerateConfig, ActivationCheckpointingIsWrittenOnlyForTheRowsItRuns) {
  Strategy s;
  s.stage = Stage::fsdp_full_shard;
  s.ranks = 2;
  s.fsdp.activation_checkpointing = true;
  auto written = [&](Checkpointing c, bool reentrant) {
    TrainingSpec t;
    t.checkpointing = c;
    t.checkpoint_every = 2;
    t.checkpoint_reentrant = reentrant;
    return read_accelerate_config(write_accelerate_config(s, t, 1), "written.yaml").strategy.fsdp.activation_checkpointing;
  };
  EXPECT_TRUE(written(Checkpointing::full, false));
  EXPECT_FALSE(written(Checkpointing::full, true));
  EXPECT_FALSE(written(Checkpointing::none, false));
  EXPECT_FALSE(written(Checkpointing::every_k, false));
  s.fsdp.activation_checkpointing = false;
  EXPECT_FALSE(written(Checkpointing::full, false));
}

// accelerate >= 1.6 (utils/dataclasses.py FullyShardedDataParallelPlugin): fsdp_version 2 is
// torch's fully_shard; fsdp_reshard_after_forward is a boolean there (true = FULL_SHARD, false =
// SHARD_GRAD_OP), and the FSDP1-only options are ignored with a warning. Under version 1 the
// same key holds the sharding strategy (its newer name).
TEST(AccelerateConfig, Fsdp2ReadsReshardAfterForwardAndWarnsOnFsdp1Options) {
  const auto a = read_accelerate_config("distributed_type: FSDP\nfsdp_config:\n  fsdp_reshard_after_forward: false\n  fsdp_version: 2\n"
                                        "  fsdp_backward_prefetch: BACKWARD_PRE\n  fsdp_use_orig_params: true\n", "v2.yaml");
  EXPECT_EQ(a.strategy.fsdp.version, 2);
  EXPECT_EQ(a.strategy.stage, Stage::fsdp_shard_grad_op);
  ASSERT_EQ(a.warnings.size(), 2u);
  EXPECT_NE(a.warnings[0].find("fsdp_config.fsdp_backward_prefetch is an FSDP1 option"), std::string::npos) << a.warnings[0];
  const auto b = read_accelerate_config("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: true\n", "v2.yaml");
  EXPECT_EQ(b.strategy.stage, Stage::fsdp_full_shard);
  EXPECT_TRUE(b.warnings.empty());
  const auto c = read_accelerate_config("distributed_type: FSDP\nfsdp_config:\n  fsdp_reshard_after_forward: SHARD_GRAD_OP\n", "v1.yaml");
  EXPECT_EQ(c.strategy.fsdp.version, 1);
  EXPECT_EQ(c.strategy.stage, Stage::fsdp_shard_grad_op);
  // Written and read back, FSDP2's file holds only FSDP2's keys.
  for (Stage stage : {Stage::fsdp_full_shard, Stage::fsdp_shard_grad_op}) {
    Strategy s;
    s.stage = stage;
    s.ranks = 8;
    s.fsdp.version = 2;
    const std::string yaml = write_accelerate_config(s, TrainingSpec{}, 1);
    SCOPED_TRACE(yaml);
    EXPECT_EQ(yaml.find("fsdp_sharding_strategy"), std::string::npos);
    EXPECT_EQ(yaml.find("fsdp_use_orig_params"), std::string::npos);
    const AccelerateConfig back = read_accelerate_config(yaml, "written.yaml");
    EXPECT_TRUE(back.warnings.empty());
    EXPECT_EQ(back.strategy.stage, stage);
    EXPECT_EQ(back.strategy.fsdp.version, 2);
  }
  Strategy hybrid;
  hybrid.stage = Stage::fsdp_hybrid_shard;
  hybrid.fsdp.version = 2;
  EXPECT_THROW(write_accelerate_config(hybrid, TrainingSpec{}, 1), InputError);
}

TEST(AccelerateConfig, BadFilesNameTheFileAndTheKey) {
  const std::pair<std::string, std::string> cases[] = {
      {"[1, 2", "cfg.yaml: not a valid YAML file"},
      {"- a\n- b\n", "cfg.yaml: must be a YAML mapping"},
      {"num_processes: 2\n", "cfg.yaml: distributed_type is missing"},
      {"distributed_type: DEEPSPEED\n", "cfg.yaml: distributed_type DEEPSPEED: give DeepSpeed's own config (ds_config.json) instead"},
      {"distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: 5\n", "fsdp_config.fsdp_sharding_strategy HYBRID_SHARD_ZERO2 (5) is not planned"},
      {"distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: QUARTER\n", "fsdp_config.fsdp_sharding_strategy must be FULL_SHARD"},
      {"distributed_type: FSDP\nfsdp_config:\n  fsdp_offload_params: maybe\n", "fsdp_config.fsdp_offload_params must be true or false, got \"maybe\""},
      {"distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 3\n", "fsdp_config.fsdp_version must be an integer in [1, 2], got \"3\""},
      {"distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: FULL_SHARD\n",
       "fsdp_config.fsdp_reshard_after_forward must be true or false, got \"FULL_SHARD\""},
      {"distributed_type: FSDP\nnum_processes: -3\n", "cfg.yaml: num_processes must be an integer in [1, 1,000,000], got \"-3\""},
      {"distributed_type: FSDP\nnum_processes: 3\nnum_machines: 2\n", "num_processes must be a multiple of num_machines (2)"},
      {"distributed_type: FSDP\nmixed_precision: fp8\n", "mixed_precision fp8 is not planned"},
      {"distributed_type: FSDP\nfsdp_config: 7\n", "fsdp_config must be a mapping"},
  };
  for (const auto& [yaml, expect] : cases) {
    SCOPED_TRACE(yaml);
    EXPECT_NE(error_of(yaml).find(expect), std::string::npos) << error_of(yaml);
  }
}

TEST(AccelerateConfig, UnknownKeysAreWarningsNamingTheKey) {
  const auto c = read_accelerate_config("distributed_type: FSDP\nfsdp_config:\n  fsdp_fancy: 1\nzeta: 2\nmachine_rank: 0\n", "cfg.yaml");
  ASSERT_EQ(c.warnings.size(), 2u);
  EXPECT_NE(c.warnings[0].find("fsdp_config.fsdp_fancy"), std::string::npos);
  EXPECT_NE(c.warnings[1].find("zeta"), std::string::npos);
}

// mixed_precision beside a --precision: transformers' TrainingArguments.__post_init__ lets the
// Trainer's bf16 / fp16 override accelerate's ("if training args is specified, it will override
// the one specified in the accelerate config"); with neither, the YAML's value is what runs.
TEST(AccelerateConfig, TheTrainersMixedPrecisionOverridesTheYamls) {
  const sim::Cluster cluster = sim::resolve_cluster("8xA100-80GB");
  struct Case {
    const char* yaml_precision;
    Precision asked;
    bool given;
    Precision planned;
    const char* warning;  // a fragment of the one warning about precision, or "" for none
  };
  const Case cases[] = {
      {"bf16", Precision::fp16_mixed, true, Precision::fp16_mixed, "--precision fp16 overrides mixed_precision 'bf16' (the Trainer's fp16=True"},
      {"'no'", Precision::bf16_mixed, true, Precision::bf16_mixed, "--precision bf16 overrides mixed_precision 'no'"},
      {"'no'", Precision::bf16_mixed, false, Precision::bf16_pure, "mixed_precision 'no' is planned as --precision bf16-pure"},
      {"fp16", Precision::bf16_mixed, false, Precision::fp16_mixed, ""},
      {"bf16", Precision::bf16_mixed, true, Precision::bf16_mixed, ""},
      {"bf16", Precision::bf16_pure, true, Precision::bf16_pure, ""},  // autocast to bf16 of bf16 weights
      {"bf16", Precision::fp32, true, Precision::bf16_mixed, ""},      // no Trainer flag: accelerate autocasts (the CLI refuses this pair)
      {"'no'", Precision::fp32, true, Precision::fp32, ""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("{} {} {}", c.yaml_precision, name_of(c.asked), c.given));
    PlanInput in;
    in.model = models::load_model("llama-2-7b");
    in.training.precision = c.asked;
    std::vector<std::string> warnings;
    const AccelerateConfig ac = read_accelerate_config(fmt::format("distributed_type: MULTI_GPU\nmixed_precision: {}\n", c.yaml_precision), "m.yaml");
    apply_accelerate_config(in, ac, "m.yaml", cluster, {.gpus = 2, .precision_given = c.given}, warnings);
    EXPECT_EQ(in.training.precision, c.planned);
    std::string about;
    for (const std::string& w : warnings)
      if (w.find("mixed_precision") != std::string::npos) about += w;
    if (*c.warning) EXPECT_NE(about.find(c.warning), std::string::npos) << about;
    else EXPECT_EQ(about, "");
  }
}

TEST(AccelerateConfig, RefusesToWriteZero) {
  Strategy s;
  s.stage = Stage::zero3;
  EXPECT_THROW(write_accelerate_config(s, TrainingSpec{}, 1), InputError);
}

}  // namespace
