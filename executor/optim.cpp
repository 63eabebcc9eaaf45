// Optimizer steps, clipping and DeepSpeed LR schedules (see optim.h for the contracts).
// Each update mirrors PyTorch's element-wise operation order, with the Python-side scalars
// (bias corrections, step size) computed in double and cast to the tensor type as ATen does.
#include "peftplan/executor/optim.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <type_traits>

#include "peftplan/common/error.h"

namespace peftplan::executor {

namespace {
constexpr std::int64_t kParallelMin = 1 << 14;
}

AdamWScalars adamw_scalars(std::int64_t step, double lr, const AdamWConfig& cfg) {
  PEFTPLAN_CHECK_MSG(step >= 1, "AdamW step count is 1-based, got {}", step);
  // torch/optim/adam.py _single_tensor_adam (AdamW = decoupled_weight_decay=True); scalars are
  // Python floats there, i.e. double, then cast to the tensor dtype by each ATen op.
  const double bias_correction1 = 1.0 - std::pow(cfg.beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(cfg.beta2, static_cast<double>(step));
  return {1.0 - lr * cfg.weight_decay, 1.0 - cfg.beta1, cfg.beta2, 1.0 - cfg.beta2, -(lr / bias_correction1),
          std::sqrt(bias_correction2), cfg.eps, cfg.weight_decay != 0.0};
}

template <typename T>
void adamw_step(T* param, const T* grad, T* m, T* v, std::int64_t n, std::int64_t step, double lr,
                const AdamWConfig& cfg) {
  const AdamWScalars c = adamw_scalars(step, lr, cfg);
  const T decay = static_cast<T>(c.decay);
  const T lerp_w = static_cast<T>(c.lerp_w);
  const T beta2 = static_cast<T>(c.beta2);
  const T one_m_beta2 = static_cast<T>(c.one_m_beta2);
  const T neg_step_size = static_cast<T>(c.neg_step_size);
  const T bc2_sqrt = static_cast<T>(c.bc2_sqrt);
  const T eps = static_cast<T>(c.eps);
  const bool decoupled = c.decoupled;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (std::int64_t i = 0; i < n; ++i) {
    T p = param[i];
    const T g = grad[i];
    if (decoupled) p = p * decay;
    // ATen lerp: weight < 0.5 ? self + weight·(end − self) : end − (end − self)·(1 − weight)
    T mi = m[i];
    mi = std::abs(lerp_w) < T(0.5) ? mi + lerp_w * (g - mi) : g - (g - mi) * (T(1) - lerp_w);
    T vi = v[i] * beta2;
    vi = vi + one_m_beta2 * g * g;  // addcmul: self + value·t1·t2
    const T denom = std::sqrt(vi) / bc2_sqrt + eps;
    p = p + neg_step_size * mi / denom;  // addcdiv: self + value·t1/t2
    m[i] = mi;
    v[i] = vi;
    param[i] = p;
  }
}

template <typename T>
void sgd_step(T* param, const T* grad, T* momentum_buf, std::int64_t n, bool first_step, double lr,
              const SgdConfig& cfg) {
  PEFTPLAN_CHECK(cfg.momentum == 0.0 || momentum_buf != nullptr);
  // torch/optim/sgd.py _single_tensor_sgd
  const T wd = static_cast<T>(cfg.weight_decay);
  const T mom = static_cast<T>(cfg.momentum);
  const T one_m_damp = static_cast<T>(1.0 - cfg.dampening);
  const T neg_lr = static_cast<T>(-lr);
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (std::int64_t i = 0; i < n; ++i) {
    T g = grad[i];
    if (cfg.weight_decay != 0.0) g = g + wd * param[i];  // grad.add(param, alpha=wd)
    if (cfg.momentum != 0.0) {
      T buf = first_step ? g : momentum_buf[i] * mom + one_m_damp * g;  // clone / mul_.add_
      momentum_buf[i] = buf;
      g = cfg.nesterov ? g + mom * buf : buf;
    }
    param[i] = param[i] + neg_lr * g;  // param.add_(grad, alpha=-lr)
  }
}

double global_grad_norm(double sum_of_squares) { return std::sqrt(sum_of_squares); }

double clip_coefficient(double total_norm, double max_norm) {
  // torch/nn/utils/clip_grad.py: clip_coef = max_norm / (total_norm + 1e-6);
  // clip_coef_clamped = torch.clamp(clip_coef, max=1.0)  (clamp propagates NaN)
  const double coef = max_norm / (total_norm + 1e-6);
  return std::isnan(coef) ? coef : std::min(coef, 1.0);
}

namespace {
// WarmupLR._get_gamma / WarmupCosineLR.get_lr_ratio warmup part, for iteration < warmup steps.
double warmup_gamma(WarmupType type, std::int64_t warmup_num_steps, std::int64_t it) {
  if (type == WarmupType::log)  // inverse_log_warm_up · log(it + 1)
    return std::log(static_cast<double>(it + 1)) / std::log(static_cast<double>(warmup_num_steps));
  return static_cast<double>(it) / static_cast<double>(warmup_num_steps);
}

// DeepSpeed: raise ValueError for warmup_num_steps <= 0, then self.warmup_num_steps = max(2, ·).
std::int64_t effective_warmup(std::int64_t warmup_num_steps) {
  PEFTPLAN_CHECK_MSG(warmup_num_steps > 0, "warmup_num_steps must be a positive integer, got {}",
                     warmup_num_steps);
  return std::max<std::int64_t>(2, warmup_num_steps);
}
}  // namespace

double lr_at(const WarmupLR& s, double optimizer_lr, std::int64_t it) {
  const std::int64_t warm = effective_warmup(s.warmup_num_steps);
  const double max_lr = s.warmup_max_lr.value_or(optimizer_lr);
  if (it < 0) return s.warmup_min_lr;  // get_lr before the first step(): min_lrs
  const double gamma = it < warm ? warmup_gamma(s.warmup_type, warm, it) : 1.0;
  return s.warmup_min_lr + (max_lr - s.warmup_min_lr) * gamma;
}

double lr_at(const WarmupDecayLR& s, double /*optimizer_lr*/, std::int64_t it) {
  const std::int64_t warm = effective_warmup(s.warmup_num_steps);
  if (it < 0) return s.warmup_min_lr;
  double gamma;
  if (it < warm) {
    gamma = warmup_gamma(s.warmup_type, warm, it);
  } else {
    // max(0, (total − it) / max(1, total − warmup))
    gamma = std::max(0.0, static_cast<double>(s.total_num_steps - it) /
                              std::max(1.0, static_cast<double>(s.total_num_steps - warm)));
  }
  return s.warmup_min_lr + (s.warmup_max_lr - s.warmup_min_lr) * gamma;
}

double lr_at(const WarmupCosineLR& s, double optimizer_lr, std::int64_t it) {
  const std::int64_t warm = effective_warmup(s.warmup_num_steps);
  if (it < 0) return 0.0;  // get_lr before the first step(): [0.0 for _ in org_lrs]
  double ratio;
  if (it < warm) {
    const double r = warmup_gamma(s.warmup_type, warm, it);
    ratio = s.warmup_min_ratio + r * (1.0 - s.warmup_min_ratio);
  } else {
    const double real_last_step = static_cast<double>(it - warm + 1);
    const double real_total_steps =
        static_cast<double>(std::max<std::int64_t>(1, s.total_num_steps - warm));
    const double progress = std::min(1.0, real_last_step / real_total_steps);  // clamped (22779f2c)
    const double cosine = (1.0 + std::cos(std::numbers::pi * progress)) / 2.0;
    ratio = std::max(0.0, s.cos_min_ratio + (1.0 - s.cos_min_ratio) * cosine);
  }
  return optimizer_lr * ratio;
}

double lr_at(const LrSchedule& s, double optimizer_lr, std::int64_t it) {
  return std::visit(
      [&](const auto& sched) -> double {
        if constexpr (std::is_same_v<std::decay_t<decltype(sched)>, ConstantLR>)
          return optimizer_lr;
        else
          return lr_at(sched, optimizer_lr, it);
      },
      s);
}

double lr_for_step(const LrSchedule& s, double optimizer_lr, std::int64_t step) {
  PEFTPLAN_CHECK_MSG(step >= 1, "optimizer steps are 1-based, got {}", step);
  return lr_at(s, optimizer_lr, step - 2);
}

template void adamw_step<float>(float*, const float*, float*, float*, std::int64_t, std::int64_t,
                                double, const AdamWConfig&);
template void adamw_step<double>(double*, const double*, double*, double*, std::int64_t,
                                 std::int64_t, double, const AdamWConfig&);
template void sgd_step<float>(float*, const float*, float*, std::int64_t, bool, double,
                              const SgdConfig&);
template void sgd_step<double>(double*, const double*, double*, std::int64_t, bool, double,
                               const SgdConfig&);

}  // namespace peftplan::executor
