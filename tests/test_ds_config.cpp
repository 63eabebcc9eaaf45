// ds_config.json reading and writing: DeepSpeed's batch rule (deepspeed/runtime/config.py
// _set_batch_related_parameters/_batch_assertion), transformers' "auto" resolution
// (integrations/deepspeed.py HfTrainerDeepSpeedConfig), errors, warnings, and the round trip.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "peftplan/common/error.h"
#include "peftplan/planner/ds_config.h"

using namespace peftplan;
using namespace peftplan::planner;
using nlohmann::json;

namespace {

DsConfigInputs inputs(std::int32_t world, std::int64_t micro = 1, std::int64_t accum = 1) {
  DsConfigInputs in;
  in.world_size = world;
  in.training.micro_batch = micro;
  in.training.grad_accum = accum;
  return in;
}

std::string error_of(const json& j, const DsConfigInputs& in) {
  try {
    read_ds_config(j, "ds.json", in);
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no error)";
}

bool has_warning(const DsConfig& c, std::string_view needle) {
  for (const auto& w : c.warnings)
    if (w.find(needle) != std::string::npos) return true;
  return false;
}

}  // namespace

TEST(DsConfigBatch, InfersTheMissingOne) {
  // tbs + mbs -> gas = tbs // mbs // ws
  DsConfig c = read_ds_config(json{{"train_batch_size", 64}, {"train_micro_batch_size_per_gpu", 4}}, "ds.json", inputs(8));
  EXPECT_EQ(c.training.grad_accum, 2);
  EXPECT_EQ(c.training.micro_batch, 4);
  EXPECT_EQ(c.train_batch_size, 64);
  // tbs + gas -> mbs = tbs // ws // gas
  c = read_ds_config(json{{"train_batch_size", 64}, {"gradient_accumulation_steps", 4}}, "ds.json", inputs(8));
  EXPECT_EQ(c.training.micro_batch, 2);
  // mbs + gas -> tbs = mbs * gas * ws
  c = read_ds_config(json{{"train_micro_batch_size_per_gpu", 3}, {"gradient_accumulation_steps", 5}}, "ds.json", inputs(2));
  EXPECT_EQ(c.train_batch_size, 30);
  // tbs only -> gas = 1, mbs = tbs // ws
  c = read_ds_config(json{{"train_batch_size", 32}}, "ds.json", inputs(4));
  EXPECT_EQ(c.training.grad_accum, 1);
  EXPECT_EQ(c.training.micro_batch, 8);
  // mbs only -> gas = 1, tbs = mbs * ws
  c = read_ds_config(json{{"train_micro_batch_size_per_gpu", 2}}, "ds.json", inputs(4, 9, 9));
  EXPECT_EQ(c.training.grad_accum, 1);
  EXPECT_EQ(c.train_batch_size, 8);
}

TEST(DsConfigBatch, MismatchQuotesDeepSpeed) {
  const std::string e = error_of(json{{"train_batch_size", 10},
                                      {"train_micro_batch_size_per_gpu", 2},
                                      {"gradient_accumulation_steps", 2}},
                                 inputs(2));
  EXPECT_NE(e.find("ds.json: train_batch_size"), std::string::npos) << e;
  EXPECT_NE(e.find("Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
                   "gradient_acc_step * world_size 10 != 2 * 2 * 2"),
            std::string::npos)
      << e;
  // Floor division leaves a remainder: 10 // 4 // 1 = 2, then 10 != 4 * 2 * 1.
  EXPECT_NE(error_of(json{{"train_batch_size", 10}, {"train_micro_batch_size_per_gpu", 4}}, inputs(1))
                .find("10 != 4 * 2 * 1"),
            std::string::npos);
  // Inference to zero: 8 // 16 // 1 = 0.
  EXPECT_NE(error_of(json{{"train_batch_size", 8}, {"train_micro_batch_size_per_gpu", 16}}, inputs(1))
                .find("Gradient accumulation steps: 0 has to be greater than 0"),
            std::string::npos);
  EXPECT_NE(error_of(json::object(), inputs(1)).find("Either train_batch_size or train_micro_batch_size_per_gpu"),
            std::string::npos);
}

TEST(DsConfigAuto, ResolvedLikeTransformers) {
  const json j = json::parse(R"({
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                  "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"}
  })");
  DsConfigInputs in = inputs(8, 4, 2);
  in.training.lr = 2e-4;
  in.training.adam_beta2 = 0.95;
  in.training.weight_decay = 0.1;
  in.training.grad_clip = 1.0;
  in.training.precision = Precision::bf16_mixed;
  in.hidden = 4096;
  in.total_steps = 1000;
  in.warmup_steps = 30;
  const DsConfig c = read_ds_config(j, "ds.json", in);
  EXPECT_EQ(c.training.micro_batch, 4);
  EXPECT_EQ(c.training.grad_accum, 2);
  EXPECT_EQ(c.train_batch_size, 64);  // world_size * per_device_train_batch_size * gradient_accumulation_steps
  EXPECT_EQ(c.training.grad_clip, 1.0);
  EXPECT_EQ(c.training.precision, Precision::bf16_mixed);
  EXPECT_EQ(c.training.lr, 2e-4);
  EXPECT_EQ(c.training.adam_beta2, 0.95);
  EXPECT_EQ(c.training.weight_decay, 0.1);
  EXPECT_EQ(c.strategy.stage, Stage::zero3);
  EXPECT_EQ(c.strategy.ranks, 8);
  EXPECT_EQ(c.strategy.ds.reduce_bucket_size, 4096 * 4096);                      // hidden_size * hidden_size
  EXPECT_EQ(c.strategy.ds.stage3_prefetch_bucket_size, 15'099'494);              // int(0.9 * 4096 * 4096)
  EXPECT_EQ(c.strategy.ds.stage3_param_persistence_threshold, 40'960);           // 10 * hidden_size
  ASSERT_TRUE(c.extras.scheduler);
  EXPECT_EQ(c.extras.scheduler->type, SchedulerType::warmup_decay_lr);
  EXPECT_EQ(c.extras.scheduler->warmup_min_lr, 0.0);   // fill_only(..., 0)
  EXPECT_EQ(c.extras.scheduler->warmup_max_lr, 2e-4);  // learning_rate
  EXPECT_EQ(c.extras.scheduler->warmup_num_steps, 30);
  EXPECT_EQ(c.extras.scheduler->total_num_steps, 1000);
  EXPECT_TRUE(c.warnings.empty()) << c.warnings.front();

  // Without a hidden size the bucket "auto"s cannot be resolved.
  in.hidden.reset();
  EXPECT_NE(error_of(j, in).find("zero_optimization.reduce_bucket_size is \"auto\" but the model hidden size is not known"),
            std::string::npos);
}

TEST(DsConfigPrecision, Fp16AndBf16IsAnError) {
  const json j = {{"train_micro_batch_size_per_gpu", 1}, {"fp16", {{"enabled", true}}}, {"bf16", {{"enabled", true}}}};
  EXPECT_NE(error_of(j, inputs(1)).find("ds.json: fp16.enabled and bf16.enabled are both true"), std::string::npos);
  const DsConfig c = read_ds_config(json{{"train_micro_batch_size_per_gpu", 1}, {"fp16", {{"enabled", true}, {"loss_scale", 128}}}},
                                    "ds.json", inputs(1));
  EXPECT_EQ(c.training.precision, Precision::fp16_mixed);
  EXPECT_EQ(c.extras.loss_scaling.loss_scale, 128.0);
  // No fp16/bf16 section: DeepSpeed trains in fp32.
  EXPECT_EQ(read_ds_config(json{{"train_micro_batch_size_per_gpu", 1}}, "ds.json", inputs(1)).training.precision,
            Precision::fp32);
  // ... unless the Trainer's own precision is given: accelerate's DeepSpeedPlugin.set_mixed_precision
  // adds the missing section enabled (fp32: neither).
  for (Precision p : {Precision::fp32, Precision::fp16_mixed, Precision::bf16_mixed}) {
    DsConfigInputs in = inputs(1);
    in.training.precision = p;
    in.precision_given = true;
    EXPECT_EQ(read_ds_config(json{{"train_micro_batch_size_per_gpu", 1}}, "ds.json", in).training.precision, p);
    // A section present decides: bf16 off stays off. fp16 on beside the Trainer's bf16 is both, which
    // accelerate refuses too ("cannot be set to `bf16` when `fp16` is set in the DeepSpeed config file").
    if (p != Precision::bf16_mixed) continue;
    EXPECT_EQ(read_ds_config(json{{"train_micro_batch_size_per_gpu", 1}, {"bf16", {{"enabled", false}}}}, "ds.json", in).training.precision,
              Precision::fp32);
    EXPECT_NE(error_of(json{{"train_micro_batch_size_per_gpu", 1}, {"fp16", {{"enabled", true}}}}, in)
                  .find("ds.json: fp16.enabled is true, and the Trainer's own bf16 (training.precision) would enable bf16 beside it"),
              std::string::npos);
  }
}

TEST(DsConfigZero, OffloadRules) {
  const json p = json::parse(R"({"train_micro_batch_size_per_gpu": 1,
      "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})");
  const std::string e = error_of(p, inputs(2));
  EXPECT_NE(e.find("ds.json: zero_optimization.offload_param.device \"cpu\" needs ZeRO stage 3"), std::string::npos) << e;
  const json nvme = json::parse(R"({"train_micro_batch_size_per_gpu": 1,
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local"}}})");
  EXPECT_NE(error_of(nvme, inputs(2)).find("offload_optimizer.device \"nvme\" is not supported, use cpu or none"),
            std::string::npos);
  const json neg = json::parse(R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "reduce_bucket_size": -5}})");
  EXPECT_NE(error_of(neg, inputs(1)).find("zero_optimization.reduce_bucket_size must be a non-negative integer, got -5"),
            std::string::npos);
  const json type = json::parse(R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": "two"}})");
  EXPECT_NE(error_of(type, inputs(1)).find("zero_optimization.stage must be 0, 1, 2 or 3, got \"two\""), std::string::npos);
  const json stage4 = json::parse(R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 4}})");
  EXPECT_NE(error_of(stage4, inputs(1)).find("got 4"), std::string::npos);
  const json pin = json::parse(R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "overlap_comm": "yes"}})");
  EXPECT_NE(error_of(pin, inputs(1)).find("zero_optimization.overlap_comm must be true or false, got \"yes\""),
            std::string::npos);

  // Legacy cpu_offload, floats for sizes (5e8), aliases, pin_memory.
  const DsConfig c = read_ds_config(json::parse(R"({"train_micro_batch_size_per_gpu": 1,
      "zero_optimization": {"stage": 2, "cpu_offload": true, "allgather_bucket_size": 2e8,
                            "offload_param": {"device": "none"}}})"),
                                    "ds.json", inputs(4));
  EXPECT_EQ(c.strategy.offload_optimizer, OffloadDevice::cpu);
  EXPECT_EQ(c.strategy.ds.allgather_bucket_size, 200'000'000);
  EXPECT_TRUE(has_warning(c, "zero_optimization.cpu_offload is deprecated"));
  const DsConfig z3 = read_ds_config(json::parse(R"({"train_micro_batch_size_per_gpu": 1,
      "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": true},
                            "offload_optimizer": {"device": "cpu", "pin_memory": true}, "max_live_parameters": 3e8}})"),
                                     "ds.json", inputs(4));
  EXPECT_EQ(z3.strategy.offload_param, OffloadDevice::cpu);
  EXPECT_TRUE(z3.strategy.ds.offload_pin_memory);
  EXPECT_EQ(z3.strategy.ds.stage3_max_live_parameters, 300'000'000);
  EXPECT_FALSE(z3.strategy.ds.overlap_comm.has_value());
  EXPECT_TRUE(z3.strategy.ds.overlap(true));  // DeepSpeed: None => true for stage 3
}

TEST(DsConfigWarnings, UnknownAndUnmodelledKeys) {
  const json j = json::parse(R"({"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10, "wall_clock_breakdown": false,
      "my_typo": 1, "zero_optimization": {"stage": 2, "reduce_scatter": true, "allgather_partitions": false,
      "overlap_comms": true, "offload_optimizer": {"device": "cpu", "colour": "red"}},
      "optimizer": {"type": "adam", "params": {"lr": 3e-5, "betas": [0.9, 0.99], "magic": 1}}})");
  const DsConfig c = read_ds_config(j, "ds.json", inputs(2));
  EXPECT_TRUE(has_warning(c, "ds.json: my_typo is not a DeepSpeed config key"));
  EXPECT_TRUE(has_warning(c, "ds.json: zero_optimization.overlap_comms is not a DeepSpeed config key"));
  EXPECT_TRUE(has_warning(c, "ds.json: zero_optimization.offload_optimizer.colour is not a DeepSpeed config key"));
  EXPECT_TRUE(has_warning(c, "zero_optimization.allgather_partitions = false is not modelled"));
  EXPECT_TRUE(has_warning(c, "optimizer.params.magic"));
  EXPECT_FALSE(has_warning(c, "reduce_scatter"));  // at DeepSpeed's default: silent
  EXPECT_FALSE(has_warning(c, "steps_per_print"));
  EXPECT_EQ(c.training.optimizer, Optimizer::adamw);  // "adam" (case-insensitive) => AdamW
  EXPECT_EQ(c.training.lr, 3e-5);
  EXPECT_EQ(c.training.adam_beta2, 0.99);
  EXPECT_TRUE(has_warning(c, "DeepSpeed trains in fp32"));  // the flags said bf16
  EXPECT_EQ(c.warnings.size(), 6u);
}

TEST(DsConfigRoundTrip, Lossless) {
  Strategy s;
  s.stage = Stage::zero3;
  s.ranks = 16;
  s.offload_optimizer = OffloadDevice::cpu;
  s.offload_param = OffloadDevice::cpu;
  s.ds.reduce_bucket_size = 16'777'216;
  s.ds.allgather_bucket_size = 123'456'789;
  s.ds.overlap_comm = false;
  s.ds.contiguous_gradients = false;
  s.ds.stage3_prefetch_bucket_size = 15'099'494;
  s.ds.stage3_param_persistence_threshold = 40'960;
  s.ds.stage3_max_live_parameters = 300'000'000;
  s.ds.stage3_max_reuse_distance = 200'000'000;
  s.ds.sub_group_size = 100'000'000;
  s.ds.offload_pin_memory = true;
  TrainingSpec t;
  t.micro_batch = 3;
  t.grad_accum = 7;
  t.seq_len = 4096;
  t.precision = Precision::fp16_mixed;
  t.lr = 3.3e-5;
  t.weight_decay = 0.01;
  t.adam_beta1 = 0.85;
  t.adam_beta2 = 0.95;
  t.adam_eps = 1e-6;
  t.grad_clip = 0.7;
  DsExtras x;
  x.loss_scaling.initial_scale_power = 12;
  x.loss_scaling.hysteresis = 3;
  x.scheduler = SchedulerSpec{.type = SchedulerType::warmup_cosine_lr, .warmup_num_steps = 50,
                              .warmup_type = "linear", .total_num_steps = 2000, .warmup_min_ratio = 0.1,
                              .cos_min_ratio = 0.01};

  const json j = write_ds_config(s, t, x);
  EXPECT_EQ(j["train_batch_size"], 3 * 7 * 16);
  DsConfigInputs in;
  in.world_size = 16;
  in.training = t;
  // Through text, as a file would go.
  const DsConfig c = read_ds_config(json::parse(j.dump(2)), "out.json", in);
  EXPECT_TRUE(c.warnings.empty()) << c.warnings.front();
  EXPECT_EQ(c.strategy.stage, s.stage);
  EXPECT_EQ(c.strategy.ranks, s.ranks);
  EXPECT_EQ(c.strategy.offload_optimizer, s.offload_optimizer);
  EXPECT_EQ(c.strategy.offload_param, s.offload_param);
  EXPECT_EQ(c.strategy.ds.reduce_bucket_size, s.ds.reduce_bucket_size);
  EXPECT_EQ(c.strategy.ds.allgather_bucket_size, s.ds.allgather_bucket_size);
  EXPECT_EQ(c.strategy.ds.overlap_comm, s.ds.overlap_comm);
  EXPECT_EQ(c.strategy.ds.contiguous_gradients, s.ds.contiguous_gradients);
  EXPECT_EQ(c.strategy.ds.stage3_prefetch_bucket_size, s.ds.stage3_prefetch_bucket_size);
  EXPECT_EQ(c.strategy.ds.stage3_param_persistence_threshold, s.ds.stage3_param_persistence_threshold);
  EXPECT_EQ(c.strategy.ds.stage3_max_live_parameters, s.ds.stage3_max_live_parameters);
  EXPECT_EQ(c.strategy.ds.stage3_max_reuse_distance, s.ds.stage3_max_reuse_distance);
  EXPECT_EQ(c.strategy.ds.sub_group_size, s.ds.sub_group_size);
  EXPECT_EQ(c.strategy.ds.offload_pin_memory, s.ds.offload_pin_memory);
  EXPECT_EQ(c.training.micro_batch, t.micro_batch);
  EXPECT_EQ(c.training.grad_accum, t.grad_accum);
  EXPECT_EQ(c.training.seq_len, t.seq_len);
  EXPECT_EQ(c.training.precision, t.precision);
  EXPECT_EQ(c.training.optimizer, t.optimizer);
  EXPECT_EQ(c.training.lr, t.lr);
  EXPECT_EQ(c.training.weight_decay, t.weight_decay);
  EXPECT_EQ(c.training.adam_beta1, t.adam_beta1);
  EXPECT_EQ(c.training.adam_beta2, t.adam_beta2);
  EXPECT_EQ(c.training.adam_eps, t.adam_eps);
  EXPECT_EQ(c.training.grad_clip, t.grad_clip);
  EXPECT_EQ(c.extras, x);
  // Writing what was read gives the same document.
  EXPECT_EQ(write_ds_config(c.strategy, c.training, c.extras), j);
}

TEST(DsConfigRoundTrip, EveryStageAndPrecision) {
  for (Stage st : {Stage::ddp, Stage::zero1, Stage::zero2, Stage::zero3}) {
    for (Precision p : {Precision::fp32, Precision::fp16_mixed, Precision::bf16_mixed, Precision::bf16_pure}) {
      if (p == Precision::bf16_pure && st == Stage::ddp) {
        Strategy s;
        TrainingSpec t;
        t.precision = p;
        EXPECT_THROW(write_ds_config(s, t), InputError);
        continue;
      }
      Strategy s;
      s.stage = st;
      s.ranks = 4;
      if (st != Stage::ddp) s.offload_optimizer = OffloadDevice::cpu;
      TrainingSpec t;
      t.precision = p;
      t.optimizer = Optimizer::sgd_momentum;
      DsExtras x;
      x.sgd_momentum = 0.8;
      x.scheduler = SchedulerSpec{};  // WarmupLR defaults
      DsConfigInputs in;
      in.world_size = 4;
      in.training = t;
      const json j = write_ds_config(s, t, x);
      const DsConfig c = read_ds_config(j, "out.json", in);
      EXPECT_EQ(c.strategy.stage, st);
      EXPECT_EQ(c.strategy.offload_optimizer, s.offload_optimizer);
      EXPECT_EQ(c.training.precision, p);
      EXPECT_EQ(c.training.optimizer, Optimizer::sgd_momentum);
      EXPECT_EQ(c.extras, x);
      EXPECT_EQ(write_ds_config(c.strategy, c.training, c.extras), j);
    }
  }
}

TEST(DsConfigWriter, RejectsWhatDeepSpeedRejects) {
  Strategy s;
  s.stage = Stage::zero2;
  s.offload_param = OffloadDevice::cpu;
  EXPECT_THROW(write_ds_config(s, TrainingSpec{}), InputError);
}

// The ZeRO-3/Infinity example of transformers' DeepSpeed guide (docs/source/en/deepspeed.md, "NVMe
// configuration") with its zero_optimization block taken from the guide's "ZeRO-3" example (CPU
// offload; NVMe is not supported here): every key understood, every "auto" resolved, no warnings.
TEST(DsConfigAuto, TransformersZero3Example) {
  const json j = json::parse(R"({
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {
      "stage": 3,
      "offload_optimizer": {"device": "cpu", "pin_memory": true},
      "offload_param": {"device": "cpu", "pin_memory": true},
      "overlap_comm": true, "contiguous_gradients": true, "sub_group_size": 1e9,
      "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
      "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
      "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": true},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": false
  })");
  DsConfigInputs in = inputs(8, 2, 4);
  in.training.precision = Precision::fp16_mixed;
  in.hidden = 4096;
  in.warmup_steps = 100;
  const DsConfig c = read_ds_config(j, "ds_config_zero3.json", in);
  EXPECT_TRUE(c.warnings.empty()) << c.warnings.front();
  EXPECT_EQ(c.training.precision, Precision::fp16_mixed);
  EXPECT_EQ(c.train_batch_size, 64);
  EXPECT_EQ(c.strategy.offload_param, OffloadDevice::cpu);
  EXPECT_EQ(c.strategy.ds.overlap_comm, true);
  EXPECT_EQ(c.strategy.ds.sub_group_size, 1'000'000'000);
  EXPECT_EQ(c.extras.scheduler->warmup_num_steps, 100);
  EXPECT_EQ(c.extras.scheduler->type, SchedulerType::warmup_lr);
}
