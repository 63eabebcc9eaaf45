// Tests of the optimizer updates, gradient clipping and DeepSpeed LR schedules (optim.h).
// Expected values are hand calculations from the published algorithms, written out next to
// each number: the AdamW and SGD pseudo-code in the PyTorch documentation (torch.optim.AdamW,
// torch.optim.SGD), clip_grad_norm_'s formula, and deepspeed/runtime/lr_schedules.py.
#include <cmath>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "peftplan/common/error.h"
#include "peftplan/executor/optim.h"

namespace {

using namespace peftplan::executor;

// ------------------------------------------------------------------------------------ AdamW

// PyTorch docs, torch.optim.AdamW algorithm, lr 0.1, betas (0.9, 0.999), eps 1e-8, wd 0.01,
// p0 = 1, g1 = 0.5, g2 = −0.25:
//  t=1: p = 1·(1 − 0.1·0.01) = 0.999; m = 0.1·0.5 = 0.05; v = 0.001·0.25 = 0.00025;
//       m̂ = 0.05/0.1 = 0.5; v̂ = 0.00025/0.001 = 0.25; p = 0.999 − 0.1·0.5/(0.5 + 1e-8)
//       = 0.899000002
//  t=2: p = 0.899000002·0.999 = 0.898101001998; m = 0.9·0.05 + 0.1·(−0.25) = 0.02;
//       v = 0.999·0.00025 + 0.001·0.0625 = 0.00031225; m̂ = 0.02/0.19 = 0.1052631579;
//       v̂ = 0.00031225/0.001999 = 0.1562031016, √v̂ = 0.3952253808;
//       p = 0.898101001998 − 0.1·0.1052631579/0.3952253908 = 0.8714672987
TEST(AdamW, TwoStepsByHand) {
  double p = 1.0, m = 0.0, v = 0.0;
  const AdamWConfig cfg{};  // PyTorch defaults but weight_decay 1e-2 is AdamW's default too
  ASSERT_EQ(cfg.weight_decay, 1e-2);
  double g = 0.5;
  adamw_step(&p, &g, &m, &v, 1, 1, 0.1, cfg);
  EXPECT_NEAR(p, 0.899000002, 1e-12);
  EXPECT_NEAR(m, 0.05, 1e-15);
  EXPECT_NEAR(v, 0.00025, 1e-15);
  g = -0.25;
  adamw_step(&p, &g, &m, &v, 1, 2, 0.1, cfg);
  EXPECT_NEAR(m, 0.02, 1e-15);
  EXPECT_NEAR(v, 0.00031225, 1e-15);
  EXPECT_NEAR(p, 0.8714672987058463, 1e-10);
}

TEST(AdamW, FloatMatchesDoubleAndThreadedPathMatchesSerial) {
  const std::int64_t n = 40000;  // above the threading threshold
  std::vector<float> pf(n), gf(n), mf(n, 0.f), vf(n, 0.f);
  std::vector<double> pd(n), gd(n), md(n, 0.0), vd(n, 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    pf[i] = static_cast<float>(std::sin(0.001 * i));
    gf[i] = static_cast<float>(std::cos(0.0007 * i));
    pd[i] = pf[i];
    gd[i] = gf[i];
  }
  const AdamWConfig cfg{0.9, 0.95, 1e-6, 0.1};
  for (int step = 1; step <= 3; ++step) {
    adamw_step(pf.data(), gf.data(), mf.data(), vf.data(), n, step, 1e-3, cfg);
    adamw_step(pd.data(), gd.data(), md.data(), vd.data(), n, step, 1e-3, cfg);
  }
  for (std::int64_t i = 0; i < n; i += 37) EXPECT_NEAR(pf[i], pd[i], 1e-6) << i;
  // One element stepped alone (serial path) equals the same element in the threaded call.
  float p1 = static_cast<float>(std::sin(0.001 * 123)), g1 = static_cast<float>(std::cos(0.0007 * 123));
  float m1 = 0, v1 = 0;
  for (int step = 1; step <= 3; ++step) adamw_step(&p1, &g1, &m1, &v1, 1, step, 1e-3, cfg);
  EXPECT_EQ(p1, pf[123]);
}

TEST(AdamW, ZeroGradientOnlyDecays) {
  double p = 2.0, g = 0.0, m = 0.0, v = 0.0;
  adamw_step(&p, &g, &m, &v, 1, 1, 0.5, AdamWConfig{0.9, 0.999, 1e-8, 0.1});
  EXPECT_DOUBLE_EQ(p, 2.0 * (1 - 0.5 * 0.1));  // m = 0 so the Adam term is 0/(0 + eps) = 0
  EXPECT_THROW(adamw_step(&p, &g, &m, &v, 1, 0, 0.5, AdamWConfig{}), peftplan::InternalError);
}

// -------------------------------------------------------------------------------------- SGD

// PyTorch docs, torch.optim.SGD: g += wd·p; b1 = g (first step), b_t = μ·b + (1 − τ)·g;
// nesterov: g += μ·b, else g = b; p −= lr·g.
TEST(Sgd, MomentumWithWeightDecayByHand) {
  // lr 0.1, μ 0.9, wd 0.1, p0 = 1, g = 0.5 then −0.25:
  //  t=1: g = 0.5 + 0.1 = 0.6; b = 0.6; p = 1 − 0.06 = 0.94
  //  t=2: g = −0.25 + 0.094 = −0.156; b = 0.54 − 0.156 = 0.384; p = 0.94 − 0.0384 = 0.9016
  double p = 1.0, buf = 123.0, g = 0.5;
  const SgdConfig cfg{0.9, 0.0, 0.1, false};
  sgd_step(&p, &g, &buf, 1, true, 0.1, cfg);
  EXPECT_NEAR(p, 0.94, 1e-15);
  EXPECT_NEAR(buf, 0.6, 1e-15);
  g = -0.25;
  sgd_step(&p, &g, &buf, 1, false, 0.1, cfg);
  EXPECT_NEAR(buf, 0.384, 1e-15);
  EXPECT_NEAR(p, 0.9016, 1e-15);
}

TEST(Sgd, NesterovWithDampeningByHand) {
  // lr 0.1, μ 0.9, τ 0.5: t=1: b = 0.5, g = 0.5 + 0.45 = 0.95, p = 0.905
  //                        t=2: b = 0.45 − 0.125 = 0.325, g = −0.25 + 0.2925 = 0.0425, p = 0.90075
  double p = 1.0, buf = 0.0, g = 0.5;
  const SgdConfig cfg{0.9, 0.5, 0.0, true};
  sgd_step(&p, &g, &buf, 1, true, 0.1, cfg);
  EXPECT_NEAR(p, 0.905, 1e-15);
  g = -0.25;
  sgd_step(&p, &g, &buf, 1, false, 0.1, cfg);
  EXPECT_NEAR(buf, 0.325, 1e-15);
  EXPECT_NEAR(p, 0.90075, 1e-15);
}

TEST(Sgd, PlainSgdNeedsNoBuffer) {
  float p = 1.0f, g = 2.0f;
  sgd_step<float>(&p, &g, nullptr, 1, true, 0.25, SgdConfig{});
  EXPECT_EQ(p, 0.5f);
}

// --------------------------------------------------------------------------------- clipping

TEST(Clip, PyTorchClipGradNormCoefficient) {
  // Gradients (3, 4): Σg² = 25, norm 5. clip_coef = max_norm / (5 + 1e-6), clamped to 1.
  EXPECT_DOUBLE_EQ(global_grad_norm(25.0), 5.0);
  EXPECT_DOUBLE_EQ(clip_coefficient(5.0, 1.0), 1.0 / (5.0 + 1e-6));
  EXPECT_DOUBLE_EQ(clip_coefficient(5.0, 10.0), 1.0);
  EXPECT_DOUBLE_EQ(clip_coefficient(0.0, 1.0), 1.0);  // 1/1e-6 clamped
  EXPECT_TRUE(std::isnan(clip_coefficient(std::numeric_limits<double>::quiet_NaN(), 1.0)));
  EXPECT_EQ(clip_coefficient(std::numeric_limits<double>::infinity(), 1.0), 0.0);
}

// ------------------------------------------------------------------------- DeepSpeed schedules

TEST(WarmupLR, LogWarmupDefaults) {
  // Code defaults: warmup_min_lr 0, warmup_max_lr = optimizer lr, 1000 steps, "log".
  // gamma = log(it + 1) / log(1000).
  const WarmupLR s{};
  const double lr = 1e-3;
  EXPECT_EQ(lr_at(s, lr, -1), 0.0);                      // before the first step(): min_lr
  EXPECT_EQ(lr_at(s, lr, 0), 0.0);                       // log 1 = 0
  EXPECT_NEAR(lr_at(s, lr, 9), 1e-3 / 3.0, 1e-15);       // log 10 / log 1000 = 1/3
  EXPECT_NEAR(lr_at(s, lr, 99), 2e-3 / 3.0, 1e-15);      // log 100 / log 1000 = 2/3
  EXPECT_NEAR(lr_at(s, lr, 998), 1e-3 * std::log(999.0) / std::log(1000.0), 1e-15);
  EXPECT_EQ(lr_at(s, lr, 999), 1e-3);                    // it >= warmup: gamma = 1
  EXPECT_EQ(lr_at(s, lr, 50000), 1e-3);
}

TEST(WarmupLR, LinearWarmupAndExplicitMax) {
  WarmupLR s;
  s.warmup_min_lr = 0.1;
  s.warmup_max_lr = 1.1;
  s.warmup_num_steps = 10;
  s.warmup_type = WarmupType::linear;
  EXPECT_NEAR(lr_at(s, 123.0, 5), 0.6, 1e-15);  // 0.1 + 1.0 · 5/10; optimizer lr unused
  EXPECT_NEAR(lr_at(s, 123.0, 0), 0.1, 1e-15);
  EXPECT_NEAR(lr_at(s, 123.0, 10), 1.1, 1e-15);
  // warmup_num_steps = 1 becomes max(2, 1) = 2: log warmup reaches max at it = 1.
  WarmupLR one;
  one.warmup_num_steps = 1;
  EXPECT_EQ(lr_at(one, 0.5, 0), 0.0);
  EXPECT_EQ(lr_at(one, 0.5, 1), 0.5);
  one.warmup_num_steps = 0;
  EXPECT_THROW(lr_at(one, 0.5, 1), peftplan::InternalError);
}

TEST(WarmupDecayLR, LinearWarmupThenLinearDecay) {
  // total 100, warmup 10 (linear), min 0, max 0.001 (this class's default):
  // decay gamma = max(0, (100 − it) / max(1, 100 − 10)).
  WarmupDecayLR s;
  s.total_num_steps = 100;
  s.warmup_num_steps = 10;
  s.warmup_type = WarmupType::linear;
  EXPECT_EQ(s.warmup_max_lr, 0.001);
  EXPECT_NEAR(lr_at(s, 0.0, 5), 0.0005, 1e-18);
  EXPECT_NEAR(lr_at(s, 0.0, 10), 0.001, 1e-18);   // 90/90
  EXPECT_NEAR(lr_at(s, 0.0, 55), 0.0005, 1e-18);  // 45/90
  EXPECT_NEAR(lr_at(s, 0.0, 100), 0.0, 1e-18);
  EXPECT_EQ(lr_at(s, 0.0, 150), 0.0);              // clamped at 0
  // Log warmup with the defaults: it = 9 of 1000 → log 10 / log 1000 = 1/3 of 0.001.
  WarmupDecayLR d;
  d.total_num_steps = 5000;
  EXPECT_NEAR(lr_at(d, 0.0, 9), 0.001 / 3.0, 1e-15);
}

TEST(WarmupCosineLR, WarmupThenCosineToMinRatio) {
  // total 100, warmup 10 linear, warmup_min_ratio 0, cos_min_ratio 1e-4 (default), lr 0.01.
  WarmupCosineLR s;
  s.total_num_steps = 100;
  s.warmup_num_steps = 10;
  s.warmup_type = WarmupType::linear;
  const double lr = 0.01;
  EXPECT_EQ(lr_at(s, lr, -1), 0.0);
  EXPECT_NEAR(lr_at(s, lr, 5), 0.005, 1e-15);  // ratio 5/10
  EXPECT_NEAR(lr_at(s, lr, 9), 0.009, 1e-15);
  // it = 10: real_last_step = 1, real_total = 90: ratio = 1e-4 + 0.9999·(1 + cos(π/90))/2
  //        = 1e-4 + 0.9999·0.9996954135 = 0.9996954440
  EXPECT_NEAR(lr_at(s, lr, 10), 0.01 * 0.999695444, 1e-11);
  // it = 54: progress 45/90 = 0.5, cosine term 0.5: ratio = 1e-4 + 0.9999·0.5 = 0.50005
  EXPECT_NEAR(lr_at(s, lr, 54), 0.0050005, 1e-15);
  EXPECT_NEAR(lr_at(s, lr, 99), 1e-6, 1e-15);   // progress 1: cos_min_ratio
  EXPECT_NEAR(lr_at(s, lr, 500), 1e-6, 1e-15);  // clamped past the end
  // Log warmup from a min ratio: warmup 100, it = 9: r = log 10 / log 100 = 0.5;
  // ratio = 0.1 + 0.5 · 0.9 = 0.55.
  WarmupCosineLR w;
  w.total_num_steps = 1000;
  w.warmup_num_steps = 100;
  w.warmup_min_ratio = 0.1;
  EXPECT_NEAR(lr_at(w, 2.0, 9), 1.1, 1e-14);
}

TEST(LrSchedule, OptimizerStepMapping) {
  // DeepSpeed builds the scheduler at last_batch_iteration −1 and steps it after each
  // optimizer step: step 1 runs at −1, step 2 at 0, step k at k − 2.
  WarmupLR w;
  w.warmup_min_lr = 1e-5;
  w.warmup_num_steps = 10;
  w.warmup_type = WarmupType::linear;
  const LrSchedule s = w;
  EXPECT_EQ(lr_for_step(s, 1e-3, 1), 1e-5);
  EXPECT_EQ(lr_for_step(s, 1e-3, 2), 1e-5);                              // it 0: gamma 0
  EXPECT_NEAR(lr_for_step(s, 1e-3, 7), 1e-5 + (1e-3 - 1e-5) * 0.5, 1e-18);  // it 5
  EXPECT_EQ(lr_for_step(LrSchedule{ConstantLR{}}, 3e-4, 1), 3e-4);
  EXPECT_EQ(lr_at(LrSchedule{ConstantLR{}}, 3e-4, 100), 3e-4);
}

}  // namespace
