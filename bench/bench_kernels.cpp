// Throughput of the executor's CPU kernels at the shapes a Llama+LoRA step runs: the linear
// GEMM y[M,K]·W[N,K]^T (M = batch·seq tokens), eager and flash attention forward/backward and
// RMSNorm.
// Counters: "GFLOP/s" (FLOPs the kernel executes, 2 per multiply-add; attention counts the full
// S×S score matrix it computes, not the causal half) and "GB/s" for memory-bound kernels.
// Times are wall-clock (UseRealTime): the kernels run on every OpenMP thread.
// Not here: end-to-end step timing (the executor's measurement output does that).
#include <cstdint>
#include <random>
#include <vector>

#include <benchmark/benchmark.h>

#include "peftplan/executor/kernels.h"

namespace {

using namespace peftplan::executor::cpu;

std::vector<float> random_floats(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

void gflops(benchmark::State& state, double flops_per_iter) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops_per_iter / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

// Args: M, K, N.
void BM_LinearForward(benchmark::State& state) {
  const Index M = state.range(0), K = state.range(1), N = state.range(2);
  const auto x = random_floats(M * K, 1), W = random_floats(N * K, 2);
  std::vector<float> y(M * N);
  for (auto _ : state) {
    linear_forward<float>(x.data(), W.data(), nullptr, y.data(), M, K, N);
    benchmark::DoNotOptimize(y.data());
  }
  gflops(state, 2.0 * M * K * N);
}

// The backward's two GEMMs: dx = dy·W and dW = dy^T·x (full fine-tuning).
void BM_LinearBackward(benchmark::State& state) {
  const Index M = state.range(0), K = state.range(1), N = state.range(2);
  const auto x = random_floats(M * K, 1), W = random_floats(N * K, 2), dy = random_floats(M * N, 3);
  std::vector<float> dx(M * K), dW(N * K);
  for (auto _ : state) {
    linear_backward_input<float>(dy.data(), W.data(), dx.data(), M, K, N, Accum::overwrite);
    linear_backward_weight<float>(dy.data(), x.data(), dW.data(), nullptr, M, K, N, Accum::overwrite);
    benchmark::DoNotOptimize(dW.data());
  }
  gflops(state, 4.0 * M * K * N);
}

void GemmShapes(benchmark::internal::Benchmark* b) {
  for (std::int64_t M : {512, 2048}) {
    for (std::int64_t s : {64, 128, 256, 512, 1024, 2048}) b->Args({M, s, s});
    b->Args({M, 768, 2048});
    b->Args({M, 2048, 768});
    b->Args({M, 768, 32000});
  }
  b->ArgNames({"M", "K", "N"})->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_LinearForward)->Apply(GemmShapes);
BENCHMARK(BM_LinearBackward)
    ->Args({2048, 768, 2048})
    ->Args({2048, 2048, 768})
    ->Args({2048, 2048, 2048})
    ->ArgNames({"M", "K", "N"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// LoRA branch at r = 16 on a 2048-wide projection (forward, no dropout).
void BM_LoraForward(benchmark::State& state) {
  const Index M = state.range(0), K = state.range(1), N = state.range(1), r = state.range(2);
  const auto x = random_floats(M * K, 1), A = random_floats(r * K, 2), B = random_floats(N * r, 3);
  std::vector<float> u(M * r), y(M * N);
  for (auto _ : state) {
    lora_forward<float>(x.data(), A.data(), B.data(), 2.0f, nullptr, 0.0f, u.data(), y.data(),
                        nullptr, M, K, N, r);
    benchmark::DoNotOptimize(y.data());
  }
  gflops(state, 2.0 * M * r * (K + N));
}
BENCHMARK(BM_LoraForward)->Args({2048, 2048, 16})->ArgNames({"M", "H", "r"})->UseRealTime();

// Args: B, S, nh, nkv, d.
void BM_AttentionForward(benchmark::State& state) {
  const Index B = state.range(0), S = state.range(1), nh = state.range(2), nkv = state.range(3),
              d = state.range(4);
  const auto q = random_floats(B * S * nh * d, 1), k = random_floats(B * S * nkv * d, 2),
             v = random_floats(B * S * nkv * d, 3);
  std::vector<float> P(B * nh * S * S), out(B * S * nh * d);
  for (auto _ : state) {
    attention_forward<float>(q.data(), k.data(), v.data(), P.data(), out.data(), B, S, nh, nkv, d);
    benchmark::DoNotOptimize(out.data());
  }
  gflops(state, 4.0 * B * nh * S * S * d);
}

void BM_AttentionBackward(benchmark::State& state) {
  const Index B = state.range(0), S = state.range(1), nh = state.range(2), nkv = state.range(3),
              d = state.range(4);
  const auto q = random_floats(B * S * nh * d, 1), k = random_floats(B * S * nkv * d, 2),
             v = random_floats(B * S * nkv * d, 3), dout = random_floats(B * S * nh * d, 4);
  std::vector<float> P(B * nh * S * S), out(B * S * nh * d), dq(q.size()), dk(k.size()),
      dv(v.size());
  std::vector<float> scratch(attention_backward_scratch_elems(S, B * nkv));
  attention_forward<float>(q.data(), k.data(), v.data(), P.data(), out.data(), B, S, nh, nkv, d);
  for (auto _ : state) {
    attention_backward<float>(dout.data(), q.data(), k.data(), v.data(), P.data(), dq.data(),
                              dk.data(), dv.data(), scratch.data(),
                              static_cast<Index>(scratch.size()), B, S, nh, nkv, d);
    benchmark::DoNotOptimize(dq.data());
  }
  gflops(state, 8.0 * B * nh * S * S * d);
}

void AttnShapes(benchmark::internal::Benchmark* b) {
  b->Args({4, 128, 12, 12, 64});   // tiny-Llama-like MHA, M = 512
  b->Args({4, 512, 16, 4, 64});    // GQA 4:1, M = 2048
  b->Args({1, 2048, 16, 4, 64});   // one long sequence, M = 2048
  b->ArgNames({"B", "S", "nh", "nkv", "d"})->UseRealTime()->Unit(benchmark::kMillisecond);
}
BENCHMARK(BM_AttentionForward)->Apply(AttnShapes);
BENCHMARK(BM_AttentionBackward)->Apply(AttnShapes);

// Flash attention at the same shapes (GFLOP/s on the same full-matrix count as eager's, so the
// two rates compare as times do; the backward's recompute of the scores is not counted).
void BM_FlashAttentionForward(benchmark::State& state) {
  const Index B = state.range(0), S = state.range(1), nh = state.range(2), nkv = state.range(3),
              d = state.range(4);
  const auto q = random_floats(B * S * nh * d, 1), k = random_floats(B * S * nkv * d, 2),
             v = random_floats(B * S * nkv * d, 3);
  std::vector<float> lse(B * nh * S), out(B * S * nh * d);
  for (auto _ : state) {
    flash_attention_forward<float>(q.data(), k.data(), v.data(), lse.data(), out.data(), B, S, nh, nkv, d);
    benchmark::DoNotOptimize(out.data());
  }
  gflops(state, 4.0 * B * nh * S * S * d);
}

void BM_FlashAttentionBackward(benchmark::State& state) {
  const Index B = state.range(0), S = state.range(1), nh = state.range(2), nkv = state.range(3),
              d = state.range(4);
  const auto q = random_floats(B * S * nh * d, 1), k = random_floats(B * S * nkv * d, 2),
             v = random_floats(B * S * nkv * d, 3), dout = random_floats(B * S * nh * d, 4);
  std::vector<float> lse(B * nh * S), out(B * S * nh * d), dq(q.size()), dk(k.size()), dv(v.size());
  flash_attention_forward<float>(q.data(), k.data(), v.data(), lse.data(), out.data(), B, S, nh, nkv, d);
  for (auto _ : state) {
    flash_attention_backward<float>(dout.data(), q.data(), k.data(), v.data(), out.data(), lse.data(), dq.data(),
                                    dk.data(), dv.data(), B, S, nh, nkv, d);
    benchmark::DoNotOptimize(dq.data());
  }
  gflops(state, 8.0 * B * nh * S * S * d);
}
BENCHMARK(BM_FlashAttentionForward)->Apply(AttnShapes);
BENCHMARK(BM_FlashAttentionBackward)->Apply(AttnShapes);

// RMSNorm forward + backward (with dw); memory-bound: reports GB/s over the bytes touched.
void BM_RmsNorm(benchmark::State& state) {
  const Index M = state.range(0), H = state.range(1);
  const auto x = random_floats(M * H, 1), w = random_floats(H, 2), dy = random_floats(M * H, 3);
  std::vector<float> y(M * H), rstd(M), dx(M * H), dw(H);
  for (auto _ : state) {
    rmsnorm_forward<float>(x.data(), w.data(), 1e-5f, y.data(), rstd.data(), M, H);
    rmsnorm_backward<float>(dy.data(), x.data(), w.data(), rstd.data(), dx.data(), dw.data(), M, H,
                            Accum::overwrite, Accum::overwrite);
    benchmark::DoNotOptimize(dx.data());
  }
  // forward reads x, writes y; backward reads dy, x twice (dx and dw passes) and dy again, writes dx
  const double bytes = 4.0 * M * H * (2 + 5);
  state.counters["GB/s"] =
      benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  gflops(state, 12.0 * M * H);
}
BENCHMARK(BM_RmsNorm)->Args({2048, 768})->Args({2048, 2048})->ArgNames({"M", "H"})->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
