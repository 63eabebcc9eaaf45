// MicroBatchSeries (planner/series.h): the program at any micro-batch from the builds at 1 and 2
// must be the program the builder makes there, field for field, and plan to the same numbers as
// make_plan: a seeded random sample of 240 candidates across models (dense, GQA, MoE, GPT-2's
// fused QKV, Gemma-2), runtime profiles, DDP, ZeRO-1/2/3 and the FSDP strategies, offload,
// checkpointing (none, every-k, full), accumulation, GPU counts and micro-batches up to 64.
#include <random>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "peftplan/common/error.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/plan.h"
#include "peftplan/planner/recommend.h"
#include "peftplan/planner/series.h"
#include "peftplan/sim/cluster.h"
#include "peftplan/sim/program_hash.h"

namespace {

using namespace peftplan;
using namespace peftplan::planner;

struct Drawn {
  PlanInput input;
  std::string cluster;
  std::string what;
};

Drawn random_candidate(std::mt19937& rng) {
  auto pick = [&](auto const& list) { return list[std::uniform_int_distribution<std::size_t>(0, list.size() - 1)(rng)]; };
  static const std::vector<std::string> models = {"llama-2-7b", "mistral-7b", "llama-2-70b", "mixtral-8x7b", "gpt2", "gemma-2-9b", "qwen2.5-7b"};
  static const std::vector<std::string> clusters = {"8xA100-80GB", "8x8xH100-SXM-NDR", "4xRTX4090"};
  static const std::vector<int> gpus = {1, 2, 4, 8, 16, 64};
  Drawn c;
  c.cluster = pick(clusters);
  const sim::Cluster cl = sim::resolve_cluster(c.cluster);
  PlanInput& in = c.input;
  const std::string model = pick(models);
  in.model = models::load_model(model);
  models::AdapterSpec a;
  a.lora.r = pick(std::vector<int>{8, 16, 64});
  a.lora.alpha = 2.0 * a.lora.r;
  in.peft.adapters.push_back(a);
  in.profile = pick(std::vector<RuntimeProfile>{RuntimeProfile::deepspeed, RuntimeProfile::hf, RuntimeProfile::executor});
  const bool hf = in.profile == RuntimeProfile::hf;
  in.strategy.stage = hf ? pick(std::vector<Stage>{Stage::ddp, Stage::fsdp_full_shard, Stage::fsdp_shard_grad_op, Stage::fsdp_no_shard})
                         : pick(std::vector<Stage>{Stage::ddp, Stage::zero1, Stage::zero2, Stage::zero3});
  in.strategy.ranks = std::min(pick(gpus), sim::total_gpus(cl));
  const int offload = std::uniform_int_distribution<int>(0, 2)(rng);
  if (!hf && offload >= 1 && in.strategy.stage != Stage::ddp) in.strategy.offload_optimizer = OffloadDevice::cpu;
  if (!hf && offload == 2 && in.strategy.stage == Stage::zero3) in.strategy.offload_param = OffloadDevice::cpu;
  if (hf && offload == 2 && in.strategy.stage == Stage::fsdp_full_shard) in.strategy.offload_param = OffloadDevice::cpu;
  in.training.checkpointing = pick(std::vector<Checkpointing>{Checkpointing::none, Checkpointing::every_k, Checkpointing::full});
  in.training.checkpoint_every = 2;
  in.training.seq_len = pick(std::vector<int>{512, 1024, 4096});
  in.training.grad_accum = pick(std::vector<int>{1, 1, 2});
  in.training.attention = pick(std::vector<Attention>{Attention::flash, Attention::eager});
  in.training.precision = Precision::bf16_mixed;
  in.training.eval_batch = 0;
  in.training.micro_batch = pick(std::vector<int>{4, 5, 7, 8, 13, 16, 32, 64});  // beyond the 1, 2, 3 make() checks
  c.what = fmt::format("{} {} {} x{} offload {} ckpt {} S {} accum {} mb {} on {}", model, name_of(in.profile), name_of(in.strategy.stage),
                       in.strategy.ranks, offload, name_of(in.training.checkpointing), in.training.seq_len, in.training.grad_accum,
                       in.training.micro_batch, c.cluster);
  return c;
}

TEST(MicroBatchSeries, IsTheBuildersProgramAndPlansAsMakePlanAtEveryMicroBatch) {
  std::mt19937 rng(20261204);
  PlanOptions po;
  po.explain = false;
  po.names = false;
  int compared = 0;
  while (compared < 240) {
    const Drawn c = random_candidate(rng);
    const sim::Cluster cluster = sim::resolve_cluster(c.cluster);
    try {
      (void)validate(c.input);
    } catch (const InputError&) {
      continue;  // a combination the planner refuses (the series is not asked for it)
    }
    SCOPED_TRACE(c.what);
    std::optional<MicroBatchSeries> series = MicroBatchSeries::make(input_on(c.input, cluster));
    if (!series) {
      // Only a moving double that is not an integer may refuse a series here: the executor
      // profile's attention, eager or flash (its work share of a block, builder.h
      // score_work_fraction), is the one such case the sample can draw.
      EXPECT_TRUE(c.input.profile == RuntimeProfile::executor) << "no series";
      continue;
    }
    // Lent and given back at two micro-batches, as a search does; the second one is compared.
    {
      PlanInput first = c.input;
      first.training.micro_batch = 1 + c.input.training.micro_batch / 2;
      Plan p = make_plan_with(first, series->take(first.training.micro_batch), cluster, po);
      series->give_back(std::move(p.program));
    }
    const Plan full = make_plan(c.input, cluster, po);
    const Plan fast = make_plan_with(c.input, series->take(c.input.training.micro_batch), cluster, po);
    EXPECT_EQ(sim::program_hash(fast.program), sim::program_hash(full.program));
    for (int k = 0; k < sim::kNumCategories; ++k) {
      EXPECT_EQ(fast.memory.category_peak_bytes[static_cast<std::size_t>(k)], full.memory.category_peak_bytes[static_cast<std::size_t>(k)]) << k;
      EXPECT_EQ(fast.memory.at_peak_bytes[static_cast<std::size_t>(k)], full.memory.at_peak_bytes[static_cast<std::size_t>(k)]) << k;
    }
    EXPECT_EQ(fast.memory.device_peak_bytes, full.memory.device_peak_bytes);
    EXPECT_EQ(fast.memory.host_peak_bytes, full.memory.host_peak_bytes);
    EXPECT_EQ(fast.reserved_peak_bytes, full.reserved_peak_bytes);
    EXPECT_EQ(fast.used_peak_bytes, full.used_peak_bytes);
    EXPECT_EQ(fast.fits, full.fits);
    ASSERT_TRUE(fast.time && full.time);
    EXPECT_EQ(fast.time->step_s, full.time->step_s);  // the same program: the same timeline
    EXPECT_EQ(fast.time->tokens_per_s, full.time->tokens_per_s);
    ++compared;
  }
}

// The search's upper bound: at the largest micro-batch largest_within allows, make_plan's
// allocated peak is within the budget, and one sequence more it is over (the device's, or the
// host's when its RAM is the limit).
TEST(MicroBatchSeries, BoundsTheLargestMicroBatchByItsAllocatedPeak) {
  std::mt19937 rng(4122026);
  PlanOptions po;
  po.explain = false;
  po.names = false;
  po.simulate_time = false;
  int compared = 0;
  while (compared < 60) {
    Drawn c = random_candidate(rng);
    c.input.training.micro_batch = 1;
    const sim::Cluster cluster = sim::resolve_cluster(c.cluster);
    try {
      (void)validate(c.input);
    } catch (const InputError&) {
      continue;
    }
    SCOPED_TRACE(c.what);
    std::optional<MicroBatchSeries> series = MicroBatchSeries::make(input_on(c.input, cluster));
    if (!series) continue;  // refused (the test above says when)
    const Plan one = make_plan(c.input, cluster, po);
    const std::uint64_t headroom = headroom_bytes(one);
    const std::uint64_t outside = one.used_peak_bytes - one.reserved_peak_bytes;  // 0 in the executor's profile
    if (one.device_capacity_bytes < headroom + outside + one.memory.device_peak_bytes) continue;  // nothing fits
    if (one.host_capacity_bytes > 0 && one.memory.host_peak_bytes > one.host_capacity_bytes) continue;
    const std::uint64_t budget = one.device_capacity_bytes - headroom - outside;
    const std::int64_t top = series->largest_within(budget, one.host_capacity_bytes);
    ASSERT_GE(top, 1);
    if (top > 4096) continue;  // a tiny model: the bound is far off and planning there proves little
    auto at = [&](std::int64_t b) {
      PlanInput in = c.input;
      in.training.micro_batch = b;
      return make_plan(in, cluster, po);
    };
    const Plan last = at(top), over = at(top + 1);
    EXPECT_LE(last.memory.device_peak_bytes, budget);
    EXPECT_TRUE(over.memory.device_peak_bytes > budget ||
                (one.host_capacity_bytes > 0 && over.memory.host_peak_bytes > one.host_capacity_bytes))
        << "micro-batch " << top + 1 << " allocates " << over.memory.device_peak_bytes << " of " << budget;
    ++compared;
  }
}

// Liger's fused linear cross-entropy cuts the tokens into power-of-two chunks: its program is not
// affine in the micro-batch, and the series must be refused rather than be wrong anywhere.
TEST(MicroBatchSeries, TheChunkedLossIsRefusedOrExact) {
  for (std::int64_t seq : {512, 4096}) {
    PlanInput in;
    in.model = models::load_model("llama-2-7b");
    models::AdapterSpec a;
    a.lora.r = 16;
    in.peft.adapters.push_back(a);
    in.profile = RuntimeProfile::hf;
    in.training.seq_len = seq;
    in.training.cross_entropy = CrossEntropy::chunked;
    std::optional<MicroBatchSeries> series = MicroBatchSeries::make(in);
    if (!series) continue;
    for (std::int64_t b = 4; b <= 9; ++b) {
      PlanInput at = in;
      at.training.micro_batch = b;
      BuiltProgram p = series->take(b);
      EXPECT_TRUE(sim::same_interpreted_fields(p.program, build_program(at, BuildOptions{.names = false}).program)) << seq << " " << b;
      series->give_back(std::move(p.program));
    }
  }
}

TEST(MicroBatchSeries, LendsOneProgramAtATime) {
  PlanInput in;
  in.model = models::load_model("gpt2");
  models::AdapterSpec a;
  a.lora.r = 8;
  in.peft.adapters.push_back(a);
  in.training.seq_len = 256;
  std::optional<MicroBatchSeries> series = MicroBatchSeries::make(in);
  ASSERT_TRUE(series.has_value());
  EXPECT_GT(series->moving_fields(), 0u);
  BuiltProgram p = series->take(4);
  EXPECT_THROW((void)series->take(5), InternalError);                  // still lent
  EXPECT_THROW(series->give_back(sim::Program(p.program)), InternalError);  // a copy, not the lent one
  series->give_back(std::move(p.program));
  PlanInput at8 = in;
  at8.training.micro_batch = 8;
  EXPECT_EQ(sim::program_hash(series->take(8).program), sim::program_hash(build_program(at8, BuildOptions{.names = false}).program));
}

}  // namespace

// plan_candidate's accumulation series (recommend.h): a long gradient accumulation from the
// plans at 3, 4 and 5 (3 and 4 for memory alone) must give what make_plan gives at that
// accumulation, planned in full: every memory figure exact, step time and its parts, tokens/s and
// MFU within 1e-6 (the bound for the fast path is 0.1%), bytes per step exact. The
// same seeded sample of models, profiles, strategies, offload, checkpointing and GPU counts,
// at accumulations 13 to 24 and micro-batches 1 and 2; the series must be the path taken in
// nearly all of them, or this would test the fallback.
TEST(AccumulationSeries, PlansAsMakePlanAtTheFullAccumulation) {
  std::mt19937 rng(20261206);
  int compared = 0, by_series = 0;
  while (compared < 200) {
    Drawn c = random_candidate(rng);
    c.input.training.grad_accum = std::uniform_int_distribution<std::int64_t>(kAccumulationSeriesFrom, 24)(rng);
    c.input.training.micro_batch = std::uniform_int_distribution<std::int64_t>(1, 2)(rng);
    const bool timed = compared % 3 != 2;
    const sim::Cluster cluster = sim::resolve_cluster(c.cluster);
    try {
      (void)validate(c.input);
    } catch (const InputError&) {
      continue;
    }
    SCOPED_TRACE(fmt::format("{} accum {} mb {} {}", c.what, c.input.training.grad_accum, c.input.training.micro_batch, timed ? "timed" : "memory"));
    CandidateOptions o;
    o.timed = timed;
    std::int64_t plans = 0;
    const planner::Candidate fast = plan_candidate(c.input, cluster, o, &plans);
    o.accumulation_series = false;
    const planner::Candidate full = plan_candidate(c.input, cluster, o);
    by_series += plans == (timed ? 3 : 2);
    EXPECT_EQ(fast.input.training.grad_accum, c.input.training.grad_accum);
    EXPECT_EQ(fast.fits, full.fits);
    EXPECT_EQ(fast.at_peak_bytes, full.at_peak_bytes);
    EXPECT_EQ(fast.allocated_peak_bytes, full.allocated_peak_bytes);
    EXPECT_EQ(fast.reserved_peak_bytes, full.reserved_peak_bytes);
    EXPECT_EQ(fast.used_peak_bytes, full.used_peak_bytes);
    EXPECT_EQ(fast.spare_bytes, full.spare_bytes);
    EXPECT_EQ(fast.host_peak_bytes, full.host_peak_bytes);
    if (timed) {
      auto near = [](double a, double b) { return std::abs(a - b) <= 1e-6 * std::max(std::abs(b), 1e-12); };
      EXPECT_PRED2(near, fast.step_s, full.step_s);
      EXPECT_PRED2(near, fast.compute_s, full.compute_s);
      EXPECT_PRED2(near, fast.exposed_comm_s, full.exposed_comm_s);
      EXPECT_PRED2(near, fast.offload_s, full.offload_s);
      EXPECT_PRED2(near, fast.optimizer_s, full.optimizer_s);
      EXPECT_PRED2(near, fast.tokens_per_s, full.tokens_per_s);
      EXPECT_PRED2(near, fast.mfu, full.mfu);
      EXPECT_EQ(fast.host_bound, full.host_bound);
      EXPECT_PRED2(near, fast.host_floor_s, full.host_floor_s);
      EXPECT_PRED2(near, fast.device_step_s, full.device_step_s);
      EXPECT_EQ(fast.gathered_bytes, full.gathered_bytes);
      EXPECT_EQ(fast.comm_bytes, full.comm_bytes);
      EXPECT_EQ(fast.inter_node_bytes, full.inter_node_bytes);
      ASSERT_EQ(fast.cost_per_mtok_usd.has_value(), full.cost_per_mtok_usd.has_value());
      if (full.cost_per_mtok_usd) {
        EXPECT_PRED2(near, *fast.cost_per_mtok_usd, *full.cost_per_mtok_usd);
      }
    }
    ++compared;
  }
  EXPECT_GE(by_series, 190) << "the series gave " << by_series << " of 200";
}
