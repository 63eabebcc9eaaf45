// End-to-end step throughput of the executor on the CPU backend, for two model sizes
// (models/zoo/tiny-llama-4l.json and the ~100M-parameter models/zoo/llama-100m.json), LoRA r=16
// on q_proj and v_proj, fp32, eager attention, no checkpointing.
// Counters per model:
//   step_s          wall time of one optimizer step (after one warm-up step)
//   tokens/s        B·S / step_s
//   GFLOP/s         model FLOPs from the step program (no recompute) / step_s
//   gemm_GFLOP/s    the same machine's GEMM throughput at the executor's shapes: every dense
//                   GEMM of the program (linear forward and input-gradient ops) timed alone,
//                   Σ FLOPs / Σ time
//   ratio           GFLOP/s / gemm_GFLOP/s (target >= 0.7)
//   gemm_fraction   share of the step spent in GEMM ops (linear, LoRA, attention)
// Not here: kernel-level throughput (bench_kernels), multi-rank runs.
#include <chrono>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include "peftplan/executor/backend.h"
#include "peftplan/executor/runner.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/plan_file.h"

namespace {

using namespace peftplan;
using namespace peftplan::executor;

planner::PlanFile plan_for(const std::string& model, std::int64_t B, std::int64_t S) {
  planner::PlanFile pf;
  pf.input.model = models::load_model(model);
  pf.model_source = model;
  models::AdapterSpec a;
  a.lora.r = 16;
  a.lora.alpha = 32;
  a.lora.targets.kind = models::ModuleSelector::Kind::list;
  a.lora.targets.names = {"q_proj", "v_proj"};
  pf.input.peft.adapters = {a};
  pf.input.training.micro_batch = B;
  pf.input.training.seq_len = S;
  pf.input.training.precision = planner::Precision::fp32;
  pf.input.training.attention = planner::Attention::eager;
  pf.input.profile = planner::RuntimeProfile::executor;
  pf.run.steps = 1000;
  return pf;
}

// Σ FLOPs / Σ seconds of the program's dense GEMMs, each shape timed alone (best of 3).
double gemm_throughput(const sim::Program& program, Backend& be) {
  std::map<std::tuple<int, std::int64_t, std::int64_t, std::int64_t>, std::int64_t> shapes;
  for (const auto& op : program.ops)
    if (op.kind == sim::OpKind::compute && (op.kernel == sim::Kernel::linear_fwd || op.kernel == sim::Kernel::linear_bwd_data))
      ++shapes[{static_cast<int>(op.kernel), op.work.gemm_m, op.work.gemm_n, op.work.gemm_k}];
  double flops = 0, seconds = 0;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  for (const auto& [shape, count] : shapes) {
    const auto [kernel, m, n, k] = shape;
    std::vector<float> a(static_cast<std::size_t>(m * k)), w(static_cast<std::size_t>(n * k)), c(static_cast<std::size_t>(m * n));
    for (auto& x : a) x = u(rng);
    for (auto& x : w) x = u(rng);
    double best = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      if (kernel == static_cast<int>(sim::Kernel::linear_fwd))
        be.linear_forward(DType::fp32, a.data(), w.data(), nullptr, c.data(), m, k, n, false);  // y[m,n] = x[m,k]·W[n,k]ᵀ
      else
        be.linear_backward_input(DType::fp32, a.data(), w.data(), c.data(), m, n, k, false);  // dx[m,n] = dy[m,k]·W[k,n]
      be.synchronize();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      benchmark::DoNotOptimize(c.data());
    }
    flops += 2.0 * static_cast<double>(m * n * k) * static_cast<double>(count);
    seconds += best * static_cast<double>(count);
  }
  return flops / seconds;
}

void BM_ExecutorStep(benchmark::State& state, const std::string& model, std::int64_t B, std::int64_t S) {
  const planner::PlanFile pf = plan_for(model, B, S);
  auto be = make_cpu_backend();
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(B * S * 64));
  std::mt19937 rng(2);
  std::uniform_int_distribution<std::int32_t> tok(0, static_cast<std::int32_t>(pf.input.model.vocab - 1));
  for (auto& t : tokens) t = tok(rng);
  Session session(pf, *be, TokenData::from_tokens(tokens, pf.input.model.vocab, S, "random tokens"));
  session.step();  // warm-up: first touches of every buffer
  const Measurement warm = session.measurement();
  double total = 0;
  for (auto _ : state) {
    const StepStats st = session.step();
    state.SetIterationTime(st.seconds);
    total += st.seconds;
  }
  const Measurement m = session.measurement();
  const double steps = static_cast<double>(state.iterations());
  const double step_s = total / steps;
  const double achieved = m.model_flops_per_step / step_s;
  const double gemm = gemm_throughput(session.program(), *be);
  state.counters["step_s"] = step_s;
  state.counters["tokens/s"] = static_cast<double>(B * S) / step_s;
  state.counters["GFLOP/s"] = achieved / 1e9;
  state.counters["gemm_GFLOP/s"] = gemm / 1e9;
  state.counters["ratio"] = achieved / gemm;
  state.counters["gemm_fraction"] = (m.gemm_s - warm.gemm_s) / total;
  state.counters["model_GFLOP"] = m.model_flops_per_step / 1e9;
  state.SetLabel(fmt::format("{} B={} S={} {}", model, B, S, be->description()));
}

BENCHMARK_CAPTURE(BM_ExecutorStep, tiny_llama_4l, std::string("tiny-llama-4l"), 4, 256)
    ->UseManualTime()->Iterations(10)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_ExecutorStep, llama_100m, std::string("llama-100m"), 1, 512)
    ->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
