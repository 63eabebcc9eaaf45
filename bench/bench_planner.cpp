// Planner speed: build the step program, walk its memory and simulate its timeline for
// Llama-2-70B with LoRA on 64 GPUs (8 nodes x 8 H100 over InfiniBand NDR). The GUI and searches
// call this thousands of times; the target is well under a millisecond per configuration.
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include "peftplan/common/heap.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/plan.h"
#include "peftplan/planner/program.h"
#include "peftplan/planner/recommend.h"
#include "peftplan/sim/caching_allocator.h"
#include "peftplan/sim/cluster.h"
#include "peftplan/sim/memory.h"
#include "peftplan/sim/timeline.h"
#include "peftplan/sim/verify.h"

namespace {

using namespace peftplan;

planner::PlanInput llama70b(planner::Stage stage, std::int64_t grad_accum) {
  planner::PlanInput in;
  in.model = models::load_model("llama-2-70b");
  models::AdapterSpec a;
  a.lora.r = 16;
  a.lora.alpha = 32;
  in.peft.adapters.push_back(a);
  in.training.micro_batch = 1;
  in.training.seq_len = 4096;
  in.training.grad_accum = grad_accum;
  in.training.checkpointing = planner::Checkpointing::full;
  in.strategy.stage = stage;
  in.strategy.ranks = 64;
  return in;
}

// Search mode: no buffer names (they are for people: traces, peak_op, the executor).
void BM_BuildWalkSimulate(benchmark::State& state) {
  const auto stage = static_cast<planner::Stage>(state.range(0));
  const planner::BuildOptions options{state.range(2) != 0};
  planner::PlanInput in = llama70b(stage, state.range(1));
  // A search holds the model inventory once (state.range(3) = 0 measures the cold build).
  if (state.range(3) != 0) in.inventory = std::make_shared<const planner::ModelInventory>(planner::make_inventory(in.model, in.peft));
  const sim::Cluster cluster = sim::resolve_cluster("8x8xH100-SXM-NDR");
  std::size_t ops = 0;
  for (auto _ : state) {
    planner::BuiltProgram built = planner::build_program(in, options);
    sim::MemoryProfile m = sim::walk_memory(built.program);
    sim::Timeline t = sim::simulate(built.program, cluster);
    benchmark::DoNotOptimize(m.device_peak_bytes);
    benchmark::DoNotOptimize(t.step_s);
    ops = built.program.ops.size();
  }
  state.counters["ops"] = static_cast<double>(ops);
  state.SetLabel(fmt::format("{} accum {}{}{}", planner::name_of(stage), state.range(1), options.names ? " named" : "",
                             in.inventory ? " cached-inventory" : ""));
}
// Args: stage (0 ddp .. 3 zero3), gradient accumulation, buffer names, cached model inventory.
BENCHMARK(BM_BuildWalkSimulate)
    ->ArgsProduct({{0, 1, 2, 3}, {1}, {0}, {1}})
    ->Args({3, 4, 0, 1})
    ->Args({0, 1, 0, 0})
    ->Args({3, 1, 0, 0})
    ->Args({0, 1, 1, 0})
    ->Args({3, 1, 1, 0})
    ->Unit(benchmark::kMicrosecond);

// The structural contract check alone (sim::verify, which walk_memory runs first), on the same
// program as BM_BuildWalkSimulate's: its share of a plan.
void BM_Verify(benchmark::State& state) {
  const auto stage = static_cast<planner::Stage>(state.range(0));
  planner::PlanInput in = llama70b(stage, 1);
  const planner::BuiltProgram built = planner::build_program(in, {false});
  for (auto _ : state) benchmark::DoNotOptimize(sim::verify(built.program).size());
  state.counters["ops"] = static_cast<double>(built.program.ops.size());
  state.SetLabel(std::string(planner::name_of(stage)));
}
BENCHMARK(BM_Verify)->Arg(0)->Arg(3)->Unit(benchmark::kMicrosecond);

void BM_MakePlan(benchmark::State& state) {  // what `peftplan plan` does, explanation included
  const planner::PlanInput in = llama70b(planner::Stage::zero3, 1);
  const sim::Cluster cluster = sim::resolve_cluster("8x8xH100-SXM-NDR");
  for (auto _ : state) benchmark::DoNotOptimize(planner::make_plan(in, cluster).fits);
}
BENCHMARK(BM_MakePlan)->Unit(benchmark::kMicrosecond);

// What each of the explorer's columns costs (reports::seed_strategies: no DDP reference for an
// explanation; buffer names kept for the hover formulas and the timeline).
void BM_MakePlanNoExplanation(benchmark::State& state) {
  const planner::PlanInput in = llama70b(planner::Stage::zero3, 1);
  const sim::Cluster cluster = sim::resolve_cluster("8x8xH100-SXM-NDR");
  planner::PlanOptions po;
  po.explain = false;
  for (auto _ : state) benchmark::DoNotOptimize(planner::make_plan(in, cluster, po).fits);
}
BENCHMARK(BM_MakePlanNoExplanation)->Unit(benchmark::kMicrosecond);

// Each of the explorer's seven columns alone (reports::seed_strategies plans them the same way:
// no explanation, buffer names kept for the hover formulas, the PEFT columns sharing one inventory): full fine-tuning under
// DDP, then LoRA under DDP, ZeRO-1, ZeRO-2, ZeRO-3, ZeRO-2 with the optimizer offloaded, ZeRO-3
// with both offloaded. Their sum over the cores is one keystroke (bench_gui; budget 16 ms).
void BM_ExplorerColumn(benchmark::State& state) {
  using planner::OffloadDevice, planner::Stage;
  struct Column {
    const char* label;
    Stage stage;
    OffloadDevice opt, param;
  };
  static constexpr Column kColumns[] = {{"full FT ddp", Stage::ddp, OffloadDevice::none, OffloadDevice::none},
                                        {"ddp", Stage::ddp, OffloadDevice::none, OffloadDevice::none},
                                        {"zero1", Stage::zero1, OffloadDevice::none, OffloadDevice::none},
                                        {"zero2", Stage::zero2, OffloadDevice::none, OffloadDevice::none},
                                        {"zero3", Stage::zero3, OffloadDevice::none, OffloadDevice::none},
                                        {"zero2 + offload optimizer", Stage::zero2, OffloadDevice::cpu, OffloadDevice::none},
                                        {"zero3 + offload optimizer and param", Stage::zero3, OffloadDevice::cpu, OffloadDevice::cpu}};
  const Column& c = kColumns[state.range(0)];
  planner::PlanInput in = llama70b(c.stage, 1);
  in.strategy.offload_optimizer = c.opt;
  in.strategy.offload_param = c.param;
  if (state.range(0) == 0) {
    in.peft = {};
    in.training.full_finetune = true;
  } else {
    in.inventory = std::make_shared<const planner::ModelInventory>(planner::make_inventory(in.model, in.peft));
  }
  const sim::Cluster cluster = sim::resolve_cluster("8x8xH100-SXM-NDR");
  planner::PlanOptions po;
  po.explain = false;
  for (auto _ : state) benchmark::DoNotOptimize(planner::make_plan(in, cluster, po).fits);
  state.SetLabel(c.label);
}
BENCHMARK(BM_ExplorerColumn)->DenseRange(0, 6)->Unit(benchmark::kMicrosecond);

// The caching allocator's replay over the same program (two steps): `reserved` and `used`.
void BM_ReplayCachingAllocator(benchmark::State& state) {
  planner::PlanInput in = llama70b(planner::Stage::zero3, 1);
  const planner::BuiltProgram built = planner::build_program(in, {false});
  const sim::AllocatorConfig config = sim::AllocatorConfig::parse("", 80ull << 30);
  for (auto _ : state) benchmark::DoNotOptimize(sim::replay_caching_allocator(built.program, config).reserved_peak_bytes);
  state.counters["ops"] = static_cast<double>(built.program.ops.size());
}
BENCHMARK(BM_ReplayCachingAllocator)->Unit(benchmark::kMicrosecond);

}  // namespace

namespace {

// Runs recommend per iteration; counters: plans per search and plans per second.
void run_recommend(benchmark::State& state, const planner::PlanInput& in, const sim::Cluster& cluster, const planner::SearchSpace& space) {
  std::int64_t plans = 0;
  for (auto _ : state) {
    const planner::Recommendation r = planner::recommend(in, cluster, space, planner::Constraints{}, planner::Objective::tokens_per_s);
    plans += r.evaluated;
    benchmark::DoNotOptimize(r.ranked.size());
  }
  state.counters["plans"] = benchmark::Counter(static_cast<double>(plans) / static_cast<double>(state.iterations()));
  state.counters["plans_per_s"] = benchmark::Counter(static_cast<double>(plans), benchmark::Counter::kIsRate);
}

}  // namespace

// `peftplan recommend` for Llama-2-70B LoRA on 8 nodes x 8 H100 over NDR, at 8, 16, 32 and 64
// GPUs: every family x checkpointing x GPU count, the micro-batch bisected on memory, then timed.
// One thread (state.range(0) = 1) is the per-core rate; candidates/s counts every plan made.
void BM_Recommend(benchmark::State& state) {
  planner::SearchSpace space;
  space.gpus = {8, 16, 32, 64};
  space.threads = static_cast<unsigned>(state.range(0));
  run_recommend(state, llama70b(planner::Stage::ddp, 1), sim::resolve_cluster("8x8xH100-SXM-NDR"), space);
  state.SetLabel(fmt::format("{} thread(s)", state.range(0)));
}
BENCHMARK(BM_Recommend)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

// `recommend` for Llama-2-7B LoRA r 16 at 4,096 tokens on 8 x A100-80GB, one thread: a model
// whose largest fitting micro-batches run to tens, where the micro-batch series (series.h)
// replaces the builds and bounds the bisection.
void BM_RecommendSevenB(benchmark::State& state) {
  planner::PlanInput in = llama70b(planner::Stage::ddp, 1);
  in.model = models::load_model("llama-2-7b");
  in.strategy.ranks = 8;
  planner::SearchSpace space;
  space.threads = 1;
  run_recommend(state, in, sim::resolve_cluster("8xA100-80GB"), space);
}
BENCHMARK(BM_RecommendSevenB)->Unit(benchmark::kMillisecond)->UseRealTime();

// `recommend --global-batch 512` for Llama-2-70B LoRA r 16 at 4,096 tokens on 8 x 8 H100 at 8, 16, 32 and 64 GPUs
// (recommend's --help example), one thread: the global batch fixes each micro-batch's
// accumulation, up to 64 micro-steps a step at 8 GPUs. Arg 1: plan_candidate's accumulation
// series (a long accumulation from the plans at 3, 4 and 5); arg 0: every plan in full.
void BM_RecommendGlobalBatch(benchmark::State& state) {
  planner::SearchSpace space;
  space.gpus = {8, 16, 32, 64};
  space.global_batch = 512;
  space.threads = 1;
  space.accumulation_series = state.range(0) != 0;
  run_recommend(state, llama70b(planner::Stage::ddp, 1), sim::resolve_cluster("8x8xH100-SXM-NDR"), space);
  state.SetLabel(state.range(0) ? "accumulation series" : "every plan in full");
}
BENCHMARK(BM_RecommendGlobalBatch)->Arg(1)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(1)->Repetitions(3);

int main(int argc, char** argv) {
  peftplan::keep_freed_heap_memory();  // as peftplan's and peftplan-gui's main do
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
