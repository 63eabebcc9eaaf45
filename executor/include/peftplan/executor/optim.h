// Optimizer updates, gradient clipping and DeepSpeed learning-rate schedules as pure functions.
// The updates follow PyTorch's single-tensor (for-loop) implementations operation by operation,
// so a run here and a run in PyTorch agree to fp32 rounding; schedules follow DeepSpeed's
// deepspeed/runtime/lr_schedules.py with its parameter names and code defaults.
// Not here: parsing ds_config.json (the planner does that at the edge), sharding (ZeRO decides
// which slice of p/g/m/v a rank passes in), fp16 loss scaling.
#pragma once

#include <cstdint>
#include <optional>
#include <variant>

namespace peftplan::executor {

// ------------------------------------------------------------------------------- optimizers

// torch.optim.AdamW hyper-parameters (PyTorch defaults). The learning rate comes from the
// schedule at each step, so it is an argument of adamw_step, not a field here.
struct AdamWConfig {
  double beta1 = 0.9;          // betas[0]
  double beta2 = 0.999;        // betas[1]
  double eps = 1e-8;           // added after sqrt of the bias-corrected second moment
  double weight_decay = 1e-2;  // decoupled: p *= 1 - lr·weight_decay
};

// One AdamW step over n elements (a whole tensor or this rank's shard). `step` is the 1-based
// step count after incrementing (PyTorch's state["step"]). m and v start at zero. As in
// torch/optim/adamw.py (_single_tensor_adam with decoupled weight decay):
//   p *= 1 − lr·wd;  m.lerp_(g, 1 − β1);  v = v·β2 + (1 − β2)·g·g
//   denom = sqrt(v) / sqrt(1 − β2^step) + eps;  p += −(lr / (1 − β1^step)) · m / denom
template <typename T>
void adamw_step(T* param, const T* grad, T* m, T* v, std::int64_t n, std::int64_t step, double lr,
                const AdamWConfig& cfg);

// The per-step scalars of that update, in double as PyTorch's Python floats are (each ATen op
// casts its scalar to the tensor dtype): every backend's AdamW forms them here.
struct AdamWScalars {
  double decay;          // 1 − lr·wd (param.mul_)
  double lerp_w;         // 1 − β1 (exp_avg.lerp_)
  double beta2;          // β2 (exp_avg_sq.mul_)
  double one_m_beta2;    // 1 − β2 (addcmul_ value)
  double neg_step_size;  // −lr / (1 − β1^step) (addcdiv_ value)
  double bc2_sqrt;       // sqrt(1 − β2^step)
  double eps;
  bool decoupled;        // wd != 0
};
AdamWScalars adamw_scalars(std::int64_t step, double lr, const AdamWConfig& cfg);

// torch.optim.SGD hyper-parameters (PyTorch defaults, plus the momentum we normally use).
struct SgdConfig {
  double momentum = 0.0;      // 0 disables the buffer
  double dampening = 0.0;     // buf = momentum·buf + (1 − dampening)·g after the first step
  double weight_decay = 0.0;  // coupled (L2): g += weight_decay·p
  bool nesterov = false;      // g += momentum·buf instead of g = buf
};

// One SGD step (torch/optim/sgd.py _single_tensor_sgd). `first_step` says the momentum buffer
// does not exist yet: PyTorch then initialises it to a copy of the gradient (no dampening).
// momentum_buf may be nullptr when cfg.momentum == 0.
template <typename T>
void sgd_step(T* param, const T* grad, T* momentum_buf, std::int64_t n, bool first_step, double lr,
              const SgdConfig& cfg);

// ---------------------------------------------------------------------------- grad clipping

// The global 2-norm from the sum of squares over all gradients (summed across ranks first).
double global_grad_norm(double sum_of_squares);
// torch.nn.utils.clip_grad_norm_: clip_coef = max_norm / (total_norm + 1e-6), clamped to at most
// 1.0; PyTorch multiplies every gradient by it (a no-op at 1.0). A non-finite norm gives a NaN or
// zero coefficient exactly as in PyTorch with error_if_nonfinite=False.
double clip_coefficient(double total_norm, double max_norm);

// ----------------------------------------------------------------------- DeepSpeed schedules
//
// deepspeed/runtime/lr_schedules.py (deepspeedai/DeepSpeed 22779f2c). Each schedule is a pure
// function of last_batch_iteration, DeepSpeed's own counter: it is −1 when the scheduler is built
// and the engine calls scheduler.step() after every optimizer step (engine.py _take_model_step),
// so optimizer step k (1-based) runs with last_batch_iteration = k − 2. Use lr_for_step for that.

enum class WarmupType { log, linear };  // "log" is the code default

// WarmupLR: min → max over warmup_num_steps, then constant.
struct WarmupLR {
  double warmup_min_lr = 0.0;                // "warmup_min_lr"
  std::optional<double> warmup_max_lr;       // "warmup_max_lr"; unset: the optimizer's lr
  std::int64_t warmup_num_steps = 1000;      // "warmup_num_steps" (>0; DeepSpeed uses max(2, ·))
  WarmupType warmup_type = WarmupType::log;  // "warmup_type"
};

// WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps.
struct WarmupDecayLR {
  std::int64_t total_num_steps = 0;          // "total_num_steps" (required)
  double warmup_min_lr = 0.0;                // "warmup_min_lr"
  double warmup_max_lr = 0.001;              // "warmup_max_lr" (this class's default is 0.001)
  std::int64_t warmup_num_steps = 1000;      // "warmup_num_steps"
  WarmupType warmup_type = WarmupType::log;  // "warmup_type"
};

// WarmupCosineLR: ratio of the optimizer's lr, warmup_min_ratio → 1, then cosine to cos_min_ratio.
struct WarmupCosineLR {
  std::int64_t total_num_steps = 0;          // "total_num_steps" (required)
  double warmup_min_ratio = 0.0;             // "warmup_min_ratio"
  std::int64_t warmup_num_steps = 1000;      // "warmup_num_steps"
  double cos_min_ratio = 0.0001;             // "cos_min_ratio"
  WarmupType warmup_type = WarmupType::log;  // "warmup_type"
};

// No scheduler: the optimizer's lr throughout.
struct ConstantLR {};

using LrSchedule = std::variant<ConstantLR, WarmupLR, WarmupDecayLR, WarmupCosineLR>;

// The lr DeepSpeed's get_lr() returns at last_batch_iteration (>= −1); optimizer_lr is the lr in
// the optimizer's param group (ds_config "optimizer.params.lr").
double lr_at(const WarmupLR& s, double optimizer_lr, std::int64_t last_batch_iteration);
double lr_at(const WarmupDecayLR& s, double optimizer_lr, std::int64_t last_batch_iteration);
double lr_at(const WarmupCosineLR& s, double optimizer_lr, std::int64_t last_batch_iteration);
double lr_at(const LrSchedule& s, double optimizer_lr, std::int64_t last_batch_iteration);
// The lr that optimizer step `step` (1-based) uses under the DeepSpeed engine.
double lr_for_step(const LrSchedule& s, double optimizer_lr, std::int64_t step);

}  // namespace peftplan::executor
