// The layout as a reusable value (planner/layout.h): a build that takes its layout from the cache
// of recent ones (BuildOptions::reuse_layout, the default when the input brings an inventory) is
// the build that makes it afresh, field for field. A seeded random sample of base inputs, each
// followed by variants that share its inventory and change one field: every field the layout is
// keyed by (the stage, the GPU count, FSDP's shard group and version, the profile, the precision,
// the base's storage and quantisation, DeepSpeed's persistence threshold and bucket size) and
// fields it must not depend on (micro-batch, sequence, checkpointing, accumulation, offload,
// attention). Built one after another in that order, a key that missed a field the layout reads
// would hand a variant its predecessor's layout, and its program would differ from the fresh one.
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "peftplan/common/error.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/program.h"
#include "peftplan/sim/program_hash.h"
#include "../planner/layout.h"  // the cache itself (private to the planner)

namespace {

using namespace peftplan;
using namespace peftplan::planner;

struct Variant {
  PlanInput input;
  std::string what;
};

std::vector<Variant> variants_of(std::mt19937& rng) {
  auto pick = [&](auto const& list) { return list[std::uniform_int_distribution<std::size_t>(0, list.size() - 1)(rng)]; };
  static const std::vector<std::string> models = {"tiny-llama-2l", "llama-2-7b", "mistral-7b", "mixtral-8x7b", "gpt2", "gemma-2-9b", "qwen2.5-7b"};
  PlanInput base;
  const std::string model = pick(models);
  base.model = models::load_model(model);
  models::AdapterSpec a;
  a.lora.r = pick(std::vector<int>{8, 16, 64});
  a.lora.alpha = 2.0 * a.lora.r;
  a.lora.dropout = pick(std::vector<double>{0.0, 0.05});
  base.peft.adapters.push_back(a);
  base.inventory = std::make_shared<const ModelInventory>(make_inventory(base.model, base.peft));
  base.profile = pick(std::vector<RuntimeProfile>{RuntimeProfile::deepspeed, RuntimeProfile::hf, RuntimeProfile::executor});
  const bool hf = base.profile == RuntimeProfile::hf;
  base.strategy.stage = hf ? pick(std::vector<Stage>{Stage::ddp, Stage::fsdp_full_shard, Stage::fsdp_shard_grad_op, Stage::fsdp_hybrid_shard})
                           : pick(std::vector<Stage>{Stage::ddp, Stage::zero1, Stage::zero2, Stage::zero3});
  base.strategy.ranks = pick(std::vector<int>{1, 2, 4, 8});
  if (base.strategy.stage == Stage::fsdp_hybrid_shard) base.strategy.shard_group = 2, base.strategy.ranks = 4;
  base.training.precision = base.profile == RuntimeProfile::executor ? Precision::fp32 : Precision::bf16_mixed;
  base.training.seq_len = pick(std::vector<int>{128, 512});
  base.training.micro_batch = pick(std::vector<int>{1, 2, 3});
  base.training.eval_batch = 0;
  base.training.attention = pick(std::vector<Attention>{Attention::flash, Attention::eager});
  const std::string label = fmt::format("{} {} {} x{}", model, name_of(base.profile), name_of(base.strategy.stage), base.strategy.ranks);

  std::vector<Variant> out = {{base, label}};
  auto with = [&](std::string what, auto&& change) {
    Variant v{out.back().input, label + " then " + what};
    change(v.input);
    out.push_back(std::move(v));
  };
  // Fields the layout does not read: the cached layout must serve them all.
  with("micro-batch 5", [](PlanInput& in) { in.training.micro_batch = 5; });
  with("seq 256", [](PlanInput& in) { in.training.seq_len = 256; });
  with("checkpointing every-2", [](PlanInput& in) { in.training.checkpointing = Checkpointing::every_k, in.training.checkpoint_every = 2; });
  with("accumulation 2", [](PlanInput& in) { in.training.grad_accum = 2; });
  with("optimizer offload", [&](PlanInput& in) {
    if (!hf && in.strategy.stage != Stage::ddp) in.strategy.offload_optimizer = OffloadDevice::cpu;
  });
  // Fields the layout is keyed by, one at a time.
  with("ranks x2", [](PlanInput& in) { in.strategy.ranks *= 2; });
  with("shard group 4", [](PlanInput& in) { in.strategy.shard_group = in.strategy.shard_group > 0 ? 4 : 0; });
  with("reduce bucket 10^5", [](PlanInput& in) { in.strategy.ds.reduce_bucket_size = 100'000; });
  with("precision fp16-mixed", [&](PlanInput& in) {
    if (in.profile != RuntimeProfile::executor) in.training.precision = Precision::fp16_mixed;
  });
  with("the other ZeRO profile", [&](PlanInput& in) {
    if (!hf) in.profile = in.profile == RuntimeProfile::executor ? RuntimeProfile::deepspeed : RuntimeProfile::executor;
  });
  with(hf ? "stage fsdp-full-shard" : "stage zero3", [&](PlanInput& in) {
    in.strategy.stage = hf ? Stage::fsdp_full_shard : Stage::zero3;
    in.strategy.offload_optimizer = OffloadDevice::none;
  });
  with("ranks 8 (a bucket per rank count)", [](PlanInput& in) { in.strategy.ranks = 8; });
  with("FSDP2", [&](PlanInput& in) {
    if (hf) in.strategy.fsdp.version = 2;
  });
  with("persistence threshold 10^9", [](PlanInput& in) { in.strategy.ds.stage3_param_persistence_threshold = 1'000'000'000; });
  with("reduce bucket 10^6", [](PlanInput& in) { in.strategy.ds.reduce_bucket_size = 1'000'000; });
  with("precision bf16-pure", [&](PlanInput& in) {
    if (in.profile != RuntimeProfile::executor) in.training.precision = Precision::bf16_pure;
  });
  with("base storage fp32", [&](PlanInput& in) {
    if (in.profile != RuntimeProfile::executor) in.training.base_storage = DType::fp32;
  });
  with("nf4 base", [&](PlanInput& in) {
    if (in.profile == RuntimeProfile::executor) return;
    in.training.base_storage.reset();
    in.peft.quantization = models::Quantization{};
  });
  with("nf4 double quantised", [&](PlanInput& in) {
    if (in.peft.quantization) in.peft.quantization->double_quant = true;
  });
  with("profile deepspeed", [](PlanInput& in) {
    in.profile = RuntimeProfile::deepspeed;
    if (is_fsdp(in.strategy.stage)) in.strategy.stage = Stage::zero2, in.strategy.fsdp.version = 1;
  });
  return out;
}

TEST(Layout, ACachedLayoutBuildsTheProgramAFreshOneBuilds) {
  std::mt19937 rng(20261205);
  int compared = 0, named = 0;
  for (int base = 0; base < 40; ++base) {
    for (const Variant& v : variants_of(rng)) {
      try {
        (void)validate(v.input);
      } catch (const InputError&) {
        continue;  // a combination the planner refuses
      }
      SCOPED_TRACE(v.what);
      const bool names = compared % 7 == 0;  // now and then with buffer names, which the layout's units give
      const BuiltProgram cached = build_program(v.input, BuildOptions{.names = names, .reuse_layout = true});
      const BuiltProgram fresh = build_program(v.input, BuildOptions{.names = names, .reuse_layout = false});
      ASSERT_EQ(sim::program_hash(cached.program), sim::program_hash(fresh.program));
      ASSERT_TRUE(sim::same_interpreted_fields(cached.program, fresh.program));
      ASSERT_EQ(cached.facts, fresh.facts);
      if (names) {
        ASSERT_EQ(cached.program.buffers.size(), fresh.program.buffers.size());
        for (std::size_t i = 0; i < cached.program.buffers.size(); ++i) ASSERT_EQ(cached.program.buffers[i].name, fresh.program.buffers[i].name) << i;
        ++named;
      }
      ++compared;
    }
  }
  EXPECT_GE(compared, 500);  // 40 bases x 21 variants, less the refused combinations
  EXPECT_GE(named, 50);  // every 7th of them
}

// LoRA r on `model` under `stage` over `ranks` GPUs, with its own shared inventory.
PlanInput lora_on(const std::string& model, int r, Stage stage, int ranks) {
  PlanInput in;
  in.model = models::load_model(model);
  models::AdapterSpec ad;
  ad.lora.r = r;
  in.peft.adapters.push_back(ad);
  in.inventory = std::make_shared<const ModelInventory>(make_inventory(in.model, in.peft));
  in.strategy.stage = stage;
  in.strategy.ranks = ranks;
  return in;
}

// The cache is keyed, not a single slot: alternating between two keys (as a search's threads
// and the explorer's columns do) gives each its own layout every time.
TEST(Layout, AlternatingKeysEachGetTheirOwnLayout) {
  PlanInput a = lora_on("llama-2-7b", 16, Stage::zero3, 8);
  a.training.seq_len = 512;
  PlanInput b = a;
  b.strategy.stage = Stage::zero2;
  b.strategy.ranks = 2;
  const std::uint64_t ha = sim::program_hash(build_program(a, BuildOptions{.names = false, .reuse_layout = false}).program);
  const std::uint64_t hb = sim::program_hash(build_program(b, BuildOptions{.names = false, .reuse_layout = false}).program);
  ASSERT_NE(ha, hb);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(sim::program_hash(build_program(a, BuildOptions{.names = false}).program), ha) << i;
    EXPECT_EQ(sim::program_hash(build_program(b, BuildOptions{.names = false}).program), hb) << i;
  }
}

// The cache hands out one value per key: the same layout for a build that differs only in what
// the layout does not read, another for another key, and a fresh one for an input without an
// inventory (nothing to key the model by).
TEST(Layout, TheCacheKeepsOneLayoutPerKey) {
  const PlanInput a = lora_on("mistral-7b", 8, Stage::zero2, 4);
  PlanInput same = a;
  same.training.micro_batch = 7;
  same.training.seq_len = 333;
  same.training.checkpointing = Checkpointing::full;
  same.strategy.offload_optimizer = OffloadDevice::cpu;
  PlanInput other = a;
  other.strategy.ranks = 8;
  const auto la = builder::layout_of(a);
  EXPECT_EQ(builder::layout_of(same).get(), la.get());
  EXPECT_NE(builder::layout_of(other).get(), la.get());
  EXPECT_EQ(builder::layout_of(a).get(), la.get());
  EXPECT_EQ(la->inventory, a.inventory);  // the input's own, shared
  PlanInput bare = a;
  bare.inventory.reset();
  const auto lb = builder::layout_of(bare);
  EXPECT_NE(lb.get(), builder::layout_of(bare).get());
  EXPECT_EQ(lb->facts, la->facts);
  EXPECT_EQ(lb->units.size(), la->units.size());
}

}  // namespace
