// Tests of the executor's CPU kernels (executor/include/peftplan/executor/kernels.h).
// Every backward is checked against central finite differences of the double instantiation
// (loss = Σ out ⊙ G for a random G); every float forward against the double forward with the
// tolerance abs + |ref|·eps; attention against a naive triple loop, RoPE against HF's formula
// written out directly, and the bf16/fp16 conversions against known bit patterns.
// Not here: performance (bench/bench_kernels.cpp) and the model built from these kernels.
#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "peftplan/common/error.h"
#include "peftplan/executor/kernels.h"

namespace {

using namespace peftplan::executor::cpu;
using Vec = std::vector<double>;

Vec random_vec(std::size_t n, unsigned seed, double lo = -1.0, double hi = 1.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  Vec v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

template <typename T>
std::vector<T> cast(const Vec& v) {
  return std::vector<T>(v.begin(), v.end());
}

double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Central differences of loss() with respect to every element of x, against `analytic`.
// h = 1e-6 keeps truncation (~h²) and cancellation (~1e-16/h) errors far below the tolerance.
void expect_fd(Vec& x, const Vec& analytic, const std::function<double()>& loss,
               const std::string& what) {
  ASSERT_EQ(x.size(), analytic.size()) << what;
  constexpr double h = 1e-6;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double lp = loss();
    x[i] = x0 - h;
    const double lm = loss();
    x[i] = x0;
    const double fd = (lp - lm) / (2 * h);
    EXPECT_NEAR(analytic[i], fd, 1e-7 + 1e-6 * std::abs(fd)) << what << "[" << i << "]";
  }
}

// float result against the double reference: |f − d| <= abs + |d|·rel.
void expect_close(const std::vector<float>& f, const Vec& d, double abs, double rel,
                  const std::string& what) {
  ASSERT_EQ(f.size(), d.size()) << what;
  for (std::size_t i = 0; i < d.size(); ++i)
    EXPECT_NEAR(f[i], d[i], abs + std::abs(d[i]) * rel) << what << "[" << i << "]";
}

void expect_close(const Vec& a, const Vec& b, double abs, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (std::size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i], b[i], abs + std::abs(b[i]) * 1e-12) << what << "[" << i << "]";
}

// Tolerance for fp32 forwards of short reductions (K up to a few tens).
constexpr double kF32Rel = 64 * FLT_EPSILON;
constexpr double kF32Abs = 1e-5;

// ------------------------------------------------------------------------------- conversion

TEST(Convert, Bf16KnownBitPatterns) {
  auto bits = [](float f) { return fp32_to_bf16(f); };
  EXPECT_EQ(bits(1.0f), 0x3F80);
  EXPECT_EQ(bits(-2.0f), 0xC000);
  EXPECT_EQ(bits(0.0f), 0x0000);
  EXPECT_EQ(bits(-0.0f), 0x8000);
  EXPECT_EQ(bits(std::bit_cast<float>(0x40490FDBu)), 0x4049);  // pi: low half 0x0FDB rounds down
  // Ties go to even: 0x3F808000 is halfway between 0x3F80 and 0x3F81 (even: 0x3F80);
  // 0x3F818000 halfway between 0x3F81 and 0x3F82 (even: 0x3F82); just above a tie rounds up.
  EXPECT_EQ(bits(std::bit_cast<float>(0x3F808000u)), 0x3F80);
  EXPECT_EQ(bits(std::bit_cast<float>(0x3F818000u)), 0x3F82);
  EXPECT_EQ(bits(std::bit_cast<float>(0x3F808001u)), 0x3F81);
  EXPECT_EQ(bits(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(bits(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(bits(std::numeric_limits<float>::max()), 0x7F80);  // rounds past bf16 max: inf
  EXPECT_EQ(bits(std::bit_cast<float>(0x7FC00000u)), 0x7FC0);  // quiet NaN
  EXPECT_EQ(bits(std::bit_cast<float>(0x7F800001u)), 0x7FC0);  // signalling NaN stays NaN
  EXPECT_EQ(bits(std::bit_cast<float>(0xFFFFFFFFu)), 0xFFFF);  // NaN with all-ones payload
  EXPECT_EQ(bits(std::bit_cast<float>(0x00000001u)), 0x0000);  // tiny subnormal -> +0
  EXPECT_EQ(bf16_to_fp32(0x3F80), 1.0f);
  EXPECT_EQ(bf16_to_fp32(0xC049), std::bit_cast<float>(0xC0490000u));
  EXPECT_TRUE(std::isnan(bf16_to_fp32(0x7FC1)));
}

TEST(Convert, Bf16RoundTripsEveryPattern) {
  for (std::uint32_t b = 0; b <= 0xFFFF; ++b) {
    const float f = bf16_to_fp32(static_cast<std::uint16_t>(b));
    if (std::isnan(f))
      EXPECT_TRUE(std::isnan(bf16_to_fp32(fp32_to_bf16(f)))) << b;
    else
      EXPECT_EQ(fp32_to_bf16(f), b) << b;
  }
}

TEST(Convert, Fp16KnownBitPatterns) {
  EXPECT_EQ(fp32_to_fp16(1.0f), 0x3C00);
  EXPECT_EQ(fp32_to_fp16(-2.0f), 0xC000);
  EXPECT_EQ(fp32_to_fp16(0.1f), 0x2E66);
  EXPECT_EQ(fp32_to_fp16(65504.0f), 0x7BFF);   // largest finite half
  EXPECT_EQ(fp32_to_fp16(65519.0f), 0x7BFF);   // below the rounding boundary
  EXPECT_EQ(fp32_to_fp16(65520.0f), 0x7C00);   // the tie at max + ulp/2 rounds to inf
  EXPECT_EQ(fp32_to_fp16(0x1p-24f), 0x0001);   // smallest subnormal
  EXPECT_EQ(fp32_to_fp16(0x1p-25f), 0x0000);   // tie between 0 and 2^-24: even (0)
  EXPECT_EQ(fp32_to_fp16(0x1.8p-25f), 0x0001);
  EXPECT_EQ(fp32_to_fp16(0x1p-14f), 0x0400);   // smallest normal
  EXPECT_EQ(fp32_to_fp16(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(fp32_to_fp16(std::bit_cast<float>(0x7FC00000u)), 0x7E00);
  EXPECT_EQ(fp16_to_fp32(0x0001), 0x1p-24f);
  EXPECT_EQ(fp16_to_fp32(0x7BFF), 65504.0f);
  EXPECT_EQ(fp16_to_fp32(0x3555), 0.333251953125f);
  EXPECT_EQ(fp16_to_fp32(0x8000), -0.0f);
  EXPECT_TRUE(std::signbit(fp16_to_fp32(0x8000)));
}

TEST(Convert, Fp16RoundTripsEveryPattern) {
  for (std::uint32_t b = 0; b <= 0xFFFF; ++b) {
    const float f = fp16_to_fp32(static_cast<std::uint16_t>(b));
    if (std::isnan(f))
      EXPECT_TRUE(std::isnan(fp16_to_fp32(fp32_to_fp16(f)))) << b;
    else
      EXPECT_EQ(fp32_to_fp16(f), b) << b;
  }
}

TEST(Convert, ArrayFormsMatchScalar) {
  const auto src = cast<float>(random_vec(100000, 1, -100, 100));
  std::vector<std::uint16_t> b(src.size()), h(src.size());
  std::vector<float> back(src.size());
  fp32_to_bf16(src.data(), b.data(), static_cast<Index>(src.size()));
  bf16_to_fp32(b.data(), back.data(), static_cast<Index>(src.size()));
  for (std::size_t i = 0; i < src.size(); i += 997) {
    EXPECT_EQ(b[i], fp32_to_bf16(src[i]));
    EXPECT_EQ(back[i], bf16_to_fp32(b[i]));
  }
  fp32_to_fp16(src.data(), h.data(), static_cast<Index>(src.size()));
  fp16_to_fp32(h.data(), back.data(), static_cast<Index>(src.size()));
  for (std::size_t i = 0; i < src.size(); i += 997) {
    EXPECT_EQ(h[i], fp32_to_fp16(src[i]));
    EXPECT_EQ(back[i], fp16_to_fp32(h[i]));
  }
}

// ----------------------------------------------------------------------------------- linear

TEST(Linear, ForwardMatchesNaiveAndFloat) {
  const Index M = 5, K = 7, N = 4;
  const Vec x = random_vec(M * K, 1), W = random_vec(N * K, 2), b = random_vec(N, 3);
  Vec y(M * N);
  linear_forward(x.data(), W.data(), b.data(), y.data(), M, K, N);
  for (Index m = 0; m < M; ++m)
    for (Index n = 0; n < N; ++n) {
      double s = b[n];
      for (Index k = 0; k < K; ++k) s += x[m * K + k] * W[n * K + k];
      EXPECT_NEAR(y[m * N + n], s, 1e-12);
    }
  auto xf = cast<float>(x), Wf = cast<float>(W), bf = cast<float>(b);
  std::vector<float> yf(M * N);
  linear_forward(xf.data(), Wf.data(), bf.data(), yf.data(), M, K, N);
  expect_close(yf, y, kF32Abs, kF32Rel, "y");
  // Accum::add adds the product (and bias) on top of what is there.
  Vec y2 = y;
  linear_forward(x.data(), W.data(), b.data(), y2.data(), M, K, N, Accum::add);
  for (std::size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y2[i], 2 * y[i], 1e-12);
}

TEST(Linear, BackwardMatchesFiniteDifferences) {
  const Index M = 5, K = 7, N = 4;
  Vec x = random_vec(M * K, 1), W = random_vec(N * K, 2), b = random_vec(N, 3);
  const Vec G = random_vec(M * N, 4);
  auto loss = [&] {
    Vec y(M * N);
    linear_forward(x.data(), W.data(), b.data(), y.data(), M, K, N);
    return dot(y, G);
  };
  Vec dx(M * K), dW(N * K), db(N);
  linear_backward_input(G.data(), W.data(), dx.data(), M, K, N, Accum::overwrite);
  linear_backward_weight(G.data(), x.data(), dW.data(), db.data(), M, K, N, Accum::overwrite);
  expect_fd(x, dx, loss, "dx");
  expect_fd(W, dW, loss, "dW");
  expect_fd(b, db, loss, "db");
  // Gradient accumulation: a second call with Accum::add doubles every gradient.
  Vec dx2 = dx, dW2 = dW, db2 = db;
  linear_backward_input(G.data(), W.data(), dx2.data(), M, K, N, Accum::add);
  linear_backward_weight(G.data(), x.data(), dW2.data(), db2.data(), M, K, N, Accum::add);
  for (std::size_t i = 0; i < dx.size(); ++i) EXPECT_NEAR(dx2[i], 2 * dx[i], 1e-12);
  for (std::size_t i = 0; i < dW.size(); ++i) EXPECT_NEAR(dW2[i], 2 * dW[i], 1e-12);
  for (std::size_t i = 0; i < db.size(); ++i) EXPECT_NEAR(db2[i], 2 * db[i], 1e-12);
}

TEST(Linear, Bf16WeightsConvertBeforeGemm) {
  const Index M = 3, K = 8, N = 2;
  const auto x = cast<float>(random_vec(M * K, 5));
  const auto W = cast<float>(random_vec(N * K, 6));
  std::vector<std::uint16_t> Wb(W.size());
  std::vector<float> Wr(W.size()), y(M * N), yr(M * N);
  fp32_to_bf16(W.data(), Wb.data(), static_cast<Index>(W.size()));
  bf16_to_fp32(Wb.data(), Wr.data(), static_cast<Index>(W.size()));
  linear_forward<float>(x.data(), Wr.data(), nullptr, y.data(), M, K, N);
  // bf16 keeps 8 significant bits: rounding moves a weight by at most half an ulp, 2^-8 relative.
  for (std::size_t i = 0; i < W.size(); ++i) EXPECT_NEAR(Wr[i], W[i], std::abs(W[i]) * 0x1p-8);
  linear_forward<float>(x.data(), W.data(), nullptr, yr.data(), M, K, N);
  for (std::size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y[i], yr[i], 0.02);
}

// ------------------------------------------------------------------------------------- LoRA

TEST(Lora, Scaling) {
  EXPECT_DOUBLE_EQ(lora_scaling(16, 8, false), 2.0);           // alpha / r
  EXPECT_DOUBLE_EQ(lora_scaling(16, 16, true), 4.0);           // alpha / sqrt(r) (rsLoRA)
  EXPECT_DOUBLE_EQ(lora_scaling(8, 8, false), 1.0);            // PEFT defaults r=8, alpha=8
}

TEST(Lora, DropoutMaskIsSeededAndHasTheRightRate) {
  const Index n = 200000;
  std::vector<std::uint8_t> a(n), b(n), c(n);
  dropout_mask(42, 0, 0.1, a.data(), n);
  dropout_mask(42, 0, 0.1, b.data(), n);
  dropout_mask(43, 0, 0.1, c.data(), n);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  const double kept = std::count(a.begin(), a.end(), 1) / static_cast<double>(n);
  EXPECT_NEAR(kept, 0.9, 0.005);  // 0.9 ± ~7σ (σ = sqrt(0.09/n) ≈ 6.7e-4)
  // An offset continues the same stream: mask(seed, 100)[i] == mask(seed, 0)[100 + i].
  std::vector<std::uint8_t> d(1000);
  dropout_mask(42, 100, 0.1, d.data(), 1000);
  EXPECT_TRUE(std::equal(d.begin(), d.end(), a.begin() + 100));
}

struct LoraCase {
  Index M = 6, K = 5, N = 4, r = 3;
  double p = 0.0;
};

class LoraTest : public ::testing::TestWithParam<LoraCase> {};

TEST_P(LoraTest, ForwardMatchesNaiveAndFloat) {
  const auto c = GetParam();
  const Index M = c.M, K = c.K, N = c.N, r = c.r;
  const Vec x = random_vec(M * K, 1), A = random_vec(r * K, 2), B = random_vec(N * r, 3);
  const Vec y0 = random_vec(M * N, 4);
  const double scale = lora_scaling(16, r, false);
  std::vector<std::uint8_t> mask(M * K);
  dropout_mask(7, 0, c.p, mask.data(), M * K);
  const std::uint8_t* maskp = c.p > 0 ? mask.data() : nullptr;
  Vec y = y0, u(M * r), scratch(lora_forward_scratch_elems(M, K, c.p > 0));
  lora_forward(x.data(), A.data(), B.data(), scale, maskp, c.p, u.data(), y.data(),
               scratch.data(), M, K, N, r);
  for (Index m = 0; m < M; ++m) {
    Vec um(r, 0.0);
    for (Index j = 0; j < r; ++j)
      for (Index k = 0; k < K; ++k) {
        const double xd = maskp ? (mask[m * K + k] ? x[m * K + k] / (1 - c.p) : 0.0) : x[m * K + k];
        um[j] += xd * A[j * K + k];
      }
    for (Index j = 0; j < r; ++j) EXPECT_NEAR(u[m * r + j], um[j], 1e-12);
    for (Index n = 0; n < N; ++n) {
      double s = 0;
      for (Index j = 0; j < r; ++j) s += um[j] * B[n * r + j];
      EXPECT_NEAR(y[m * N + n], y0[m * N + n] + scale * s, 1e-12);
    }
  }
  auto xf = cast<float>(x), Af = cast<float>(A), Bf = cast<float>(B), yf = cast<float>(y0);
  std::vector<float> uf(M * r), sf(scratch.size());
  lora_forward<float>(xf.data(), Af.data(), Bf.data(), static_cast<float>(scale), maskp,
                      static_cast<float>(c.p), uf.data(), yf.data(), sf.data(), M, K, N, r);
  expect_close(yf, y, kF32Abs, kF32Rel, "y");
  expect_close(uf, u, kF32Abs, kF32Rel, "u");
}

TEST_P(LoraTest, BackwardMatchesFiniteDifferences) {
  const auto c = GetParam();
  const Index M = c.M, K = c.K, N = c.N, r = c.r;
  Vec x = random_vec(M * K, 1), A = random_vec(r * K, 2), B = random_vec(N * r, 3);
  const Vec G = random_vec(M * N, 5);
  const double scale = lora_scaling(16, r, true);
  std::vector<std::uint8_t> mask(M * K);
  dropout_mask(9, 0, c.p, mask.data(), M * K);
  const std::uint8_t* maskp = c.p > 0 ? mask.data() : nullptr;
  Vec fscratch(lora_forward_scratch_elems(M, K, c.p > 0));
  auto loss = [&] {
    Vec y(M * N, 0.0), u(M * r);
    lora_forward(x.data(), A.data(), B.data(), scale, maskp, c.p, u.data(), y.data(),
                 fscratch.data(), M, K, N, r);
    return dot(y, G);
  };
  Vec y(M * N, 0.0), u(M * r);
  lora_forward(x.data(), A.data(), B.data(), scale, maskp, c.p, u.data(), y.data(),
               fscratch.data(), M, K, N, r);
  Vec dA(r * K), dB(N * r), dx(M * K, 0.5), bscratch(lora_backward_scratch_elems(M, K, r, c.p > 0));
  lora_backward(G.data(), x.data(), A.data(), B.data(), u.data(), scale, maskp, c.p, dA.data(),
                dB.data(), dx.data(), bscratch.data(), M, K, N, r, Accum::overwrite, Accum::add);
  for (auto& v : dx) v -= 0.5;  // dx was accumulated onto 0.5
  expect_fd(A, dA, loss, "dA");
  expect_fd(B, dB, loss, "dB");
  expect_fd(x, dx, loss, "dx");
  // Accumulation into existing gradients, and dx overwrite / skip.
  Vec dA2 = dA, dB2 = dB, dx2(M * K, 9.0);
  lora_backward(G.data(), x.data(), A.data(), B.data(), u.data(), scale, maskp, c.p, dA2.data(),
                dB2.data(), dx2.data(), bscratch.data(), M, K, N, r, Accum::add, Accum::overwrite);
  for (std::size_t i = 0; i < dA.size(); ++i) EXPECT_NEAR(dA2[i], 2 * dA[i], 1e-12);
  for (std::size_t i = 0; i < dB.size(); ++i) EXPECT_NEAR(dB2[i], 2 * dB[i], 1e-12);
  expect_close(dx2, dx, 1e-12, "dx overwrite");
  lora_backward(G.data(), x.data(), A.data(), B.data(), u.data(), scale, maskp, c.p, dA2.data(),
                dB2.data(), static_cast<double*>(nullptr), bscratch.data(), M, K, N, r,
                Accum::overwrite, Accum::add);
  expect_close(dA2, dA, 1e-12, "dA without dx");
}

INSTANTIATE_TEST_SUITE_P(Kernels, LoraTest,
                         ::testing::Values(LoraCase{}, LoraCase{6, 5, 4, 3, 0.3},
                                           LoraCase{9, 16, 12, 8, 0.1}, LoraCase{1, 3, 2, 1, 0.0}));

// ---------------------------------------------------------------------------------- RMSNorm

TEST(RmsNorm, ForwardMatchesFormulaAndFloat) {
  const Index M = 4, H = 8;
  const double eps = 1e-5;
  const Vec x = random_vec(M * H, 1, -3, 3), w = random_vec(H, 2, 0.5, 1.5);
  Vec y(M * H), rstd(M);
  rmsnorm_forward(x.data(), w.data(), eps, y.data(), rstd.data(), M, H);
  for (Index m = 0; m < M; ++m) {
    double ms = 0;
    for (Index j = 0; j < H; ++j) ms += x[m * H + j] * x[m * H + j] / H;
    const double rs = 1 / std::sqrt(ms + eps);
    EXPECT_NEAR(rstd[m], rs, 1e-12);
    for (Index j = 0; j < H; ++j) EXPECT_NEAR(y[m * H + j], x[m * H + j] * rs * w[j], 1e-12);
  }
  auto xf = cast<float>(x), wf = cast<float>(w);
  std::vector<float> yf(M * H), rf(M);
  rmsnorm_forward<float>(xf.data(), wf.data(), 1e-5f, yf.data(), rf.data(), M, H);
  expect_close(yf, y, kF32Abs, kF32Rel, "y");
  expect_close(rf, rstd, kF32Abs, kF32Rel, "rstd");
}

TEST(RmsNorm, BackwardMatchesFiniteDifferences) {
  const Index M = 5, H = 7;
  const double eps = 1e-6;
  Vec x = random_vec(M * H, 1, -2, 2), w = random_vec(H, 2, 0.5, 1.5);
  const Vec G = random_vec(M * H, 3);
  auto loss = [&] {
    Vec y(M * H), rstd(M);
    rmsnorm_forward(x.data(), w.data(), eps, y.data(), rstd.data(), M, H);
    return dot(y, G);
  };
  Vec y(M * H), rstd(M), dx(M * H), dw(H);
  rmsnorm_forward(x.data(), w.data(), eps, y.data(), rstd.data(), M, H);
  rmsnorm_backward(G.data(), x.data(), w.data(), rstd.data(), dx.data(), dw.data(), M, H,
                   Accum::overwrite, Accum::overwrite);
  expect_fd(x, dx, loss, "dx");
  expect_fd(w, dw, loss, "dw");
  Vec dx2(M * H, 1.0), dw2 = dw;
  rmsnorm_backward(G.data(), x.data(), w.data(), rstd.data(), dx2.data(), dw2.data(), M, H,
                   Accum::add, Accum::add);
  for (std::size_t i = 0; i < dx.size(); ++i) EXPECT_NEAR(dx2[i], dx[i] + 1.0, 1e-12);
  for (std::size_t i = 0; i < dw.size(); ++i) EXPECT_NEAR(dw2[i], 2 * dw[i], 1e-12);
}

TEST(RmsNorm, WideRowsUseEveryColumnBlock) {
  // H spans several 256-column blocks of the dw reduction, with a ragged last block.
  const Index M = 3, H = 700;
  Vec x = random_vec(M * H, 1), w = random_vec(H, 2), G = random_vec(M * H, 3);
  Vec y(M * H), rstd(M), dx(M * H), dw(H);
  rmsnorm_forward(x.data(), w.data(), 1e-5, y.data(), rstd.data(), M, H);
  rmsnorm_backward(G.data(), x.data(), w.data(), rstd.data(), dx.data(), dw.data(), M, H,
                   Accum::overwrite, Accum::overwrite);
  for (Index j = 0; j < H; ++j) {
    double s = 0;
    for (Index m = 0; m < M; ++m) s += G[m * H + j] * x[m * H + j] * rstd[m];
    EXPECT_NEAR(dw[j], s, 1e-12);
  }
}

// ------------------------------------------------------------------------------------- RoPE

TEST(Rope, ForwardMatchesHfFormula) {
  const Index B = 2, S = 5, nh = 3, d = 8;
  const double theta = 10000.0;
  const Vec x = random_vec(B * S * nh * d, 1);
  Vec cos(rope_table_elems(S, d)), sin(rope_table_elems(S, d));
  rope_tables(cos.data(), sin.data(), S, d, theta);
  Vec y = x;
  rope_forward(y.data(), cos.data(), sin.data(), B, S, nh, d);
  // modeling_llama.py: emb = cat(freqs, freqs); q*cos + rotate_half(q)*sin,
  // rotate_half(x) = cat(-x[d/2:], x[:d/2]); inv_freq_i = 1/theta^(2i/d).
  for (Index b = 0; b < B; ++b)
    for (Index s = 0; s < S; ++s)
      for (Index h = 0; h < nh; ++h) {
        const double* v = x.data() + ((b * S + s) * nh + h) * d;
        for (Index i = 0; i < d; ++i) {
          const Index fi = i % (d / 2);
          const double angle = s / std::pow(theta, 2.0 * fi / d);
          const double rot = i < d / 2 ? -v[i + d / 2] : v[i - d / 2];
          const double want = v[i] * std::cos(angle) + rot * std::sin(angle);
          EXPECT_NEAR(y[((b * S + s) * nh + h) * d + i], want, 1e-12);
        }
      }
  // Position 0 is the identity.
  for (Index i = 0; i < nh * d; ++i) EXPECT_DOUBLE_EQ(y[i], x[i]);
  // float tables and rotation against the double ones.
  std::vector<float> cf(cos.size()), sf(sin.size());
  rope_tables(cf.data(), sf.data(), S, d, theta);
  expect_close(cf, cos, 1e-6, 0, "cos");
  auto yf = cast<float>(x);
  rope_forward(yf.data(), cf.data(), sf.data(), B, S, nh, d);
  expect_close(yf, y, kF32Abs, kF32Rel, "y");
}

TEST(Rope, BackwardMatchesFiniteDifferences) {
  const Index B = 2, S = 4, nh = 2, d = 6;
  Vec x = random_vec(B * S * nh * d, 1);
  const Vec G = random_vec(x.size(), 2);
  Vec cos(rope_table_elems(S, d)), sin(rope_table_elems(S, d));
  rope_tables(cos.data(), sin.data(), S, d, 500000.0);
  auto loss = [&] {
    Vec y = x;
    rope_forward(y.data(), cos.data(), sin.data(), B, S, nh, d);
    return dot(y, G);
  };
  Vec dx = G;
  rope_backward(dx.data(), cos.data(), sin.data(), B, S, nh, d);
  expect_fd(x, dx, loss, "dx");
}

// -------------------------------------------------------------------------------- attention

struct AttnCase {
  Index B, S, nh, nkv, d;
};

// The eager reference: repeat_kv, scores, causal mask, softmax, P·v, written as loops.
Vec naive_attention(const Vec& q, const Vec& k, const Vec& v, const AttnCase& c, Vec* P_out) {
  const Index rep = c.nh / c.nkv;
  Vec out(c.B * c.S * c.nh * c.d, 0.0);
  if (P_out) P_out->assign(c.B * c.nh * c.S * c.S, 0.0);
  for (Index b = 0; b < c.B; ++b)
    for (Index h = 0; h < c.nh; ++h) {
      const Index g = h / rep;
      for (Index i = 0; i < c.S; ++i) {
        Vec sc(i + 1);
        double mx = -1e300;
        for (Index j = 0; j <= i; ++j) {
          double s = 0;
          for (Index t = 0; t < c.d; ++t)
            s += q[((b * c.S + i) * c.nh + h) * c.d + t] * k[((b * c.S + j) * c.nkv + g) * c.d + t];
          sc[j] = s / std::sqrt(static_cast<double>(c.d));
          mx = std::max(mx, sc[j]);
        }
        double z = 0;
        for (Index j = 0; j <= i; ++j) z += std::exp(sc[j] - mx);
        for (Index j = 0; j <= i; ++j) {
          const double p = std::exp(sc[j] - mx) / z;
          if (P_out) (*P_out)[((b * c.nh + h) * c.S + i) * c.S + j] = p;
          for (Index t = 0; t < c.d; ++t)
            out[((b * c.S + i) * c.nh + h) * c.d + t] += p * v[((b * c.S + j) * c.nkv + g) * c.d + t];
        }
      }
    }
  return out;
}

class AttentionTest : public ::testing::TestWithParam<AttnCase> {};

TEST_P(AttentionTest, ForwardMatchesNaiveLoopAndFloat) {
  const auto c = GetParam();
  const Vec q = random_vec(c.B * c.S * c.nh * c.d, 1, -2, 2);
  const Vec k = random_vec(c.B * c.S * c.nkv * c.d, 2, -2, 2);
  const Vec v = random_vec(c.B * c.S * c.nkv * c.d, 3);
  Vec P(c.B * c.nh * c.S * c.S, 7.0), out(q.size()), Pref;
  attention_forward(q.data(), k.data(), v.data(), P.data(), out.data(), c.B, c.S, c.nh, c.nkv, c.d);
  const Vec ref = naive_attention(q, k, v, c, &Pref);
  expect_close(out, ref, 1e-12, "out");
  expect_close(P, Pref, 1e-12, "P");
  auto qf = cast<float>(q), kf = cast<float>(k), vf = cast<float>(v);
  std::vector<float> Pf(P.size()), of(out.size());
  attention_forward(qf.data(), kf.data(), vf.data(), Pf.data(), of.data(), c.B, c.S, c.nh, c.nkv, c.d);
  expect_close(of, ref, kF32Abs, kF32Rel, "out f32");
  expect_close(Pf, Pref, kF32Abs, kF32Rel, "P f32");
}

TEST_P(AttentionTest, BackwardMatchesFiniteDifferences) {
  const auto c = GetParam();
  Vec q = random_vec(c.B * c.S * c.nh * c.d, 1, -2, 2);
  Vec k = random_vec(c.B * c.S * c.nkv * c.d, 2, -2, 2);
  Vec v = random_vec(c.B * c.S * c.nkv * c.d, 3);
  const Vec G = random_vec(q.size(), 4);
  Vec P(c.B * c.nh * c.S * c.S), out(q.size());
  auto loss = [&] {
    Vec Pl(P.size()), o(out.size());
    attention_forward(q.data(), k.data(), v.data(), Pl.data(), o.data(), c.B, c.S, c.nh, c.nkv, c.d);
    return dot(o, G);
  };
  attention_forward(q.data(), k.data(), v.data(), P.data(), out.data(), c.B, c.S, c.nh, c.nkv, c.d);
  for (Index workers : {Index{1}, Index{3}}) {
    Vec scratch(attention_backward_scratch_elems(c.S, workers));
    Vec dq(q.size(), 5.0), dk(k.size(), 5.0), dv(v.size(), 5.0);  // overwritten by the kernel
    attention_backward(G.data(), q.data(), k.data(), v.data(), P.data(), dq.data(), dk.data(),
                       dv.data(), scratch.data(), static_cast<Index>(scratch.size()), c.B, c.S,
                       c.nh, c.nkv, c.d);
    const std::string tag = " workers=" + std::to_string(workers);
    expect_fd(q, dq, loss, "dq" + tag);
    expect_fd(k, dk, loss, "dk" + tag);
    expect_fd(v, dv, loss, "dv" + tag);
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, AttentionTest,
                         ::testing::Values(AttnCase{2, 5, 4, 2, 3},   // GQA, 2 query heads per kv
                                           AttnCase{1, 6, 2, 2, 4},   // MHA
                                           AttnCase{2, 4, 3, 1, 2},   // MQA
                                           AttnCase{1, 1, 2, 1, 3})); // one token

TEST(Attention, LargerShapeFloatAgainstDouble) {
  const AttnCase c{2, 64, 8, 2, 32};
  const Vec q = random_vec(c.B * c.S * c.nh * c.d, 1), k = random_vec(c.B * c.S * c.nkv * c.d, 2);
  const Vec v = random_vec(c.B * c.S * c.nkv * c.d, 3), G = random_vec(q.size(), 4);
  Vec P(c.B * c.nh * c.S * c.S), out(q.size()), dq(q.size()), dk(k.size()), dv(v.size());
  Vec scratch(attention_backward_scratch_elems(c.S, 4));
  attention_forward(q.data(), k.data(), v.data(), P.data(), out.data(), c.B, c.S, c.nh, c.nkv, c.d);
  attention_backward(G.data(), q.data(), k.data(), v.data(), P.data(), dq.data(), dk.data(), dv.data(),
                     scratch.data(), static_cast<Index>(scratch.size()), c.B, c.S, c.nh, c.nkv, c.d);
  auto qf = cast<float>(q), kf = cast<float>(k), vf = cast<float>(v), Gf = cast<float>(G);
  std::vector<float> Pf(P.size()), of(out.size()), dqf(q.size()), dkf(k.size()), dvf(v.size());
  std::vector<float> sf(scratch.size());
  attention_forward(qf.data(), kf.data(), vf.data(), Pf.data(), of.data(), c.B, c.S, c.nh, c.nkv, c.d);
  attention_backward(Gf.data(), qf.data(), kf.data(), vf.data(), Pf.data(), dqf.data(), dkf.data(),
                     dvf.data(), sf.data(), static_cast<Index>(sf.size()), c.B, c.S, c.nh, c.nkv, c.d);
  expect_close(of, out, 1e-5, kF32Rel, "out");
  expect_close(dqf, dq, 1e-4, kF32Rel, "dq");
  expect_close(dkf, dk, 1e-4, kF32Rel, "dk");
  expect_close(dvf, dv, 1e-4, kF32Rel, "dv");
}

// ------------------------------------------------------------------------- flash attention

// Each row's log Σ_{j<=i} exp(score) of the naive loop, for the flash kernel's saved lse.
Vec naive_lse(const Vec& q, const Vec& k, const AttnCase& c) {
  const Index rep = c.nh / c.nkv;
  Vec lse(c.B * c.nh * c.S);
  for (Index b = 0; b < c.B; ++b)
    for (Index h = 0; h < c.nh; ++h)
      for (Index i = 0; i < c.S; ++i) {
        double z = 0;
        for (Index j = 0; j <= i; ++j) {
          double s = 0;
          for (Index t = 0; t < c.d; ++t)
            s += q[((b * c.S + i) * c.nh + h) * c.d + t] * k[((b * c.S + j) * c.nkv + h / rep) * c.d + t];
          z += std::exp(s / std::sqrt(static_cast<double>(c.d)));
        }
        lse[(b * c.nh + h) * c.S + i] = std::log(z);
      }
  return lse;
}

class FlashAttentionTest : public ::testing::TestWithParam<AttnCase> {};

TEST_P(FlashAttentionTest, ForwardMatchesNaiveLoopAndBackwardMatchesEager) {
  // Flash computes eager attention exactly in real arithmetic (Dao 2023, Algorithm 1 and 2 are
  // rearrangements of softmax(QKᵀ/√d)V), so in double both agree to rounding.
  const auto c = GetParam();
  const Vec q = random_vec(c.B * c.S * c.nh * c.d, 1, -2, 2), k = random_vec(c.B * c.S * c.nkv * c.d, 2, -2, 2);
  const Vec v = random_vec(c.B * c.S * c.nkv * c.d, 3), G = random_vec(q.size(), 4);
  Vec lse(c.B * c.nh * c.S, 7.0), out(q.size(), 7.0);
  flash_attention_forward(q.data(), k.data(), v.data(), lse.data(), out.data(), c.B, c.S, c.nh, c.nkv, c.d);
  expect_close(out, naive_attention(q, k, v, c, nullptr), 1e-12, "out");
  expect_close(lse, naive_lse(q, k, c), 1e-12, "lse");
  Vec P(c.B * c.nh * c.S * c.S), eo(q.size()), scratch(attention_backward_scratch_elems(c.S, 2));
  Vec edq(q.size()), edk(k.size()), edv(v.size());
  attention_forward(q.data(), k.data(), v.data(), P.data(), eo.data(), c.B, c.S, c.nh, c.nkv, c.d);
  attention_backward(G.data(), q.data(), k.data(), v.data(), P.data(), edq.data(), edk.data(), edv.data(), scratch.data(),
                     static_cast<Index>(scratch.size()), c.B, c.S, c.nh, c.nkv, c.d);
  Vec dq(q.size(), 5.0), dk(k.size(), 5.0), dv(v.size(), 5.0);  // overwritten by the kernel
  flash_attention_backward(G.data(), q.data(), k.data(), v.data(), out.data(), lse.data(), dq.data(), dk.data(), dv.data(), c.B,
                           c.S, c.nh, c.nkv, c.d);
  expect_close(dq, edq, 1e-11, "dq");
  expect_close(dk, edk, 1e-11, "dk");
  expect_close(dv, edv, 1e-11, "dv");
  // fp32 against the double reference
  auto qf = cast<float>(q), kf = cast<float>(k), vf = cast<float>(v), Gf = cast<float>(G);
  std::vector<float> lf(lse.size()), of(out.size()), dqf(q.size()), dkf(k.size()), dvf(v.size());
  flash_attention_forward(qf.data(), kf.data(), vf.data(), lf.data(), of.data(), c.B, c.S, c.nh, c.nkv, c.d);
  flash_attention_backward(Gf.data(), qf.data(), kf.data(), vf.data(), of.data(), lf.data(), dqf.data(), dkf.data(), dvf.data(),
                           c.B, c.S, c.nh, c.nkv, c.d);
  expect_close(of, out, kF32Abs, kF32Rel, "out f32");
  expect_close(lf, lse, kF32Abs, kF32Rel, "lse f32");
  expect_close(dqf, dq, 1e-4, kF32Rel, "dq f32");
  expect_close(dkf, dk, 1e-4, kF32Rel, "dk f32");
  expect_close(dvf, dv, 1e-4, kF32Rel, "dv f32");
}

// Finite differences on the small shapes (each costs two forwards per element).
class FlashAttentionFdTest : public ::testing::TestWithParam<AttnCase> {};

TEST_P(FlashAttentionFdTest, BackwardMatchesFiniteDifferences) {
  const auto c = GetParam();
  Vec q = random_vec(c.B * c.S * c.nh * c.d, 1, -2, 2), k = random_vec(c.B * c.S * c.nkv * c.d, 2, -2, 2);
  Vec v = random_vec(c.B * c.S * c.nkv * c.d, 3);
  const Vec G = random_vec(q.size(), 4);
  Vec lse(c.B * c.nh * c.S), out(q.size());
  auto loss = [&] {
    Vec l(lse.size()), o(out.size());
    flash_attention_forward(q.data(), k.data(), v.data(), l.data(), o.data(), c.B, c.S, c.nh, c.nkv, c.d);
    return dot(o, G);
  };
  flash_attention_forward(q.data(), k.data(), v.data(), lse.data(), out.data(), c.B, c.S, c.nh, c.nkv, c.d);
  Vec dq(q.size()), dk(k.size()), dv(v.size());
  flash_attention_backward(G.data(), q.data(), k.data(), v.data(), out.data(), lse.data(), dq.data(), dk.data(), dv.data(), c.B,
                           c.S, c.nh, c.nkv, c.d);
  expect_fd(q, dq, loss, "dq");
  expect_fd(k, dk, loss, "dk");
  expect_fd(v, dv, loss, "dv");
}

// The small shapes of AttentionTest, and shapes over several kExecAttentionRows (64) query tiles:
// a partial last tile (S 150 = 64 + 64 + 22), an exact multiple (128), GQA and MQA across tiles,
// and two key tiles of 256 (S 300); finite differences on the small ones and one of two query
// tiles (S 66, d 2).
INSTANTIATE_TEST_SUITE_P(Kernels, FlashAttentionTest,
                         ::testing::Values(AttnCase{2, 5, 4, 2, 3}, AttnCase{1, 6, 2, 2, 4}, AttnCase{2, 4, 3, 1, 2},
                                           AttnCase{1, 1, 2, 1, 3}, AttnCase{1, 150, 4, 2, 8}, AttnCase{2, 128, 2, 1, 5},
                                           AttnCase{1, 65, 3, 3, 4}, AttnCase{1, 300, 2, 1, 4}));
INSTANTIATE_TEST_SUITE_P(Kernels, FlashAttentionFdTest,
                         ::testing::Values(AttnCase{2, 5, 4, 2, 3}, AttnCase{1, 6, 2, 2, 4}, AttnCase{2, 4, 3, 1, 2},
                                           AttnCase{1, 1, 2, 1, 3}, AttnCase{1, 66, 2, 1, 2}));

// ----------------------------------------------------------------------------------- SwiGLU

TEST(SwiGlu, ForwardAndBackward) {
  const Index n = 40;
  Vec g = random_vec(n, 1, -6, 6), u = random_vec(n, 2);
  const Vec G = random_vec(n, 3);
  Vec a(n);
  swiglu_forward(g.data(), u.data(), a.data(), n);
  for (Index i = 0; i < n; ++i) EXPECT_NEAR(a[i], g[i] / (1 + std::exp(-g[i])) * u[i], 1e-14);
  auto loss = [&] {
    Vec out(n);
    swiglu_forward(g.data(), u.data(), out.data(), n);
    return dot(out, G);
  };
  Vec dg(n), du(n);
  swiglu_backward(G.data(), g.data(), u.data(), dg.data(), du.data(), n);
  expect_fd(g, dg, loss, "dg");
  expect_fd(u, du, loss, "du");
  auto gf = cast<float>(g), uf = cast<float>(u);
  std::vector<float> af(n);
  swiglu_forward(gf.data(), uf.data(), af.data(), n);
  expect_close(af, a, 1e-6, 8 * FLT_EPSILON, "a");
}

// -------------------------------------------------------------------------------- embedding

TEST(Embedding, ForwardGathersAndBackwardScatterAdds) {
  const Index M = 7, V = 5, H = 300;  // H crosses a 256-column block
  const std::vector<std::int32_t> tok{3, 0, 3, 4, 1, 3, 0};  // repeated ids accumulate
  Vec table = random_vec(V * H, 1);
  const Vec G = random_vec(M * H, 2);
  Vec out(M * H);
  embedding_forward(tok.data(), table.data(), out.data(), M, V, H);
  for (Index m = 0; m < M; ++m)
    for (Index j = 0; j < H; ++j) EXPECT_EQ(out[m * H + j], table[tok[m] * H + j]);
  auto loss = [&] {
    Vec o(M * H);
    embedding_forward(tok.data(), table.data(), o.data(), M, V, H);
    return dot(o, G);
  };
  Vec dtable(V * H, 3.0);
  embedding_backward(tok.data(), G.data(), dtable.data(), M, V, H, Accum::overwrite);
  expect_fd(table, dtable, loss, "dtable");
  Vec dt2 = dtable;
  embedding_backward(tok.data(), G.data(), dt2.data(), M, V, H, Accum::add);
  for (std::size_t i = 0; i < dt2.size(); ++i) EXPECT_NEAR(dt2[i], 2 * dtable[i], 1e-12);
  const std::vector<std::int32_t> bad{0, 5};
  EXPECT_THROW(embedding_forward(bad.data(), table.data(), out.data(), 2, V, H),
               peftplan::InternalError);
}

// ---------------------------------------------------------------------------- cross-entropy

TEST(CrossEntropy, LossMatchesFormulaAndGradientMatchesFiniteDifferences) {
  const Index M = 6, V = 9;
  Vec logits = random_vec(M * V, 1, -4, 4);
  const std::vector<std::int32_t> tgt{2, kIgnoreIndex, 8, 0, kIgnoreIndex, 5};
  const double count = 10.0;  // e.g. the global token count over micro-batches and ranks
  double want = 0;
  for (Index m = 0; m < M; ++m) {
    if (tgt[m] == kIgnoreIndex) continue;
    double z = 0;
    for (Index j = 0; j < V; ++j) z += std::exp(logits[m * V + j]);
    want += std::log(z) - logits[m * V + tgt[m]];
  }
  EXPECT_NEAR(cross_entropy_forward(logits.data(), tgt.data(), M, V), want, 1e-12);
  Vec dl(M * V, 1.0);
  const double sum = cross_entropy_backward(logits.data(), tgt.data(), dl.data(), count, M, V);
  EXPECT_NEAR(sum, want, 1e-12);
  auto loss = [&] { return cross_entropy_forward(logits.data(), tgt.data(), M, V) / count; };
  expect_fd(logits, dl, loss, "dlogits");
  for (Index j = 0; j < V; ++j) EXPECT_EQ(dl[1 * V + j], 0.0);  // ignored row
  // In place over the logits buffer gives the same gradient.
  Vec inplace = logits;
  cross_entropy_backward(inplace.data(), tgt.data(), inplace.data(), count, M, V);
  expect_close(inplace, dl, 1e-15, "in place");
  // float against double.
  auto lf = cast<float>(logits);
  EXPECT_NEAR(cross_entropy_forward(lf.data(), tgt.data(), M, V), want, 1e-5 * std::abs(want));
  std::vector<float> dlf(M * V);
  cross_entropy_backward(lf.data(), tgt.data(), dlf.data(), count, M, V);
  expect_close(dlf, dl, 1e-7, kF32Rel, "dlogits f32");
}

TEST(CrossEntropy, SplitAcrossMicroBatchesSumsExactly) {
  // Mean over the whole batch = Σ over micro-batches of (loss sum / global count).
  const Index M = 8, V = 11;
  const Vec logits = random_vec(M * V, 3, -3, 3);
  std::vector<std::int32_t> tgt{1, 2, 3, kIgnoreIndex, 4, 5, 6, 7};
  const double whole = cross_entropy_forward(logits.data(), tgt.data(), M, V);
  const double a = cross_entropy_forward(logits.data(), tgt.data(), 4, V);
  const double b = cross_entropy_forward(logits.data() + 4 * V, tgt.data() + 4, 4, V);
  EXPECT_NEAR(a + b, whole, 1e-12);
  const std::vector<std::int32_t> bad{V};
  EXPECT_THROW(cross_entropy_forward(logits.data(), bad.data(), 1, V), peftplan::InternalError);
}

TEST(CrossEntropy, LargeLogitsStayFinite) {
  const Index V = 4;
  const std::vector<float> logits{1000.0f, -1000.0f, 999.0f, 0.0f};
  const std::vector<std::int32_t> tgt{2};
  const double loss = cross_entropy_forward(logits.data(), tgt.data(), 1, V);
  EXPECT_NEAR(loss, std::log1p(std::exp(1.0)), 1e-6);  // lse − 999 = log(e + 1)
}

// ------------------------------------------------------------------------------ elementwise

TEST(Elementwise, AddScaleAndSumSquares) {
  const Index n = 50000;  // above the threading threshold
  const Vec a = random_vec(n, 1), b = random_vec(n, 2);
  Vec out(n);
  add(a.data(), b.data(), out.data(), n);
  for (Index i = 0; i < n; i += 101) EXPECT_EQ(out[i], a[i] + b[i]);
  Vec y = a;
  add_inplace(y.data(), b.data(), n);
  EXPECT_EQ(y, out);
  scale_inplace(y.data(), 0.5, n);
  for (Index i = 0; i < n; i += 101) EXPECT_EQ(y[i], out[i] * 0.5);
  double want = 0;
  for (double v : a) want += v * v;
  EXPECT_NEAR(sum_squares(a.data(), n), want, 1e-9);
  // float input, double accumulation: 1e6 copies of 0.1f summed exactly enough.
  const std::vector<float> tenths(1000000, 0.1f);
  const double t = static_cast<double>(0.1f);
  EXPECT_NEAR(sum_squares(tenths.data(), 1000000), 1e6 * t * t, 1e-6);
}

TEST(Gemm, PackingEstimateIsCacheSized) {
  // Eigen blocks to its caches: the panels stay far below the operands for large GEMMs.
  for (int threads : {1, 2, 16}) {
    const auto bytes = gemm_packing_bytes(2048, 32000, 768, threads);
    EXPECT_GT(bytes, 0u);
    EXPECT_LT(bytes, 2048ull * 32000 * 4) << threads;
  }
}

}  // namespace
