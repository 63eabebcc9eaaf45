// The executor against the planner and against calculus: measured memory per category equals
// the executor-profile prediction exactly (the runner allocates what the step program says and
// its kernels write only into those buffers); the whole model's LoRA gradients against central
// finite differences; the loss falls on real text; bad files are clear InputErrors; plan.json
// and the saved adapter round-trip.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include <gtest/gtest.h>

#include "peftplan/common/error.h"
#include "peftplan/executor/backend.h"
#include "peftplan/executor/kernels.h"
#include "peftplan/executor/plan_file.h"
#include "peftplan/executor/runner.h"
#include "peftplan/executor/safetensors.h"
#include "peftplan/models/config.h"
#include "peftplan/models/parameters.h"
#include "peftplan/planner/plan_file.h"
#include "peftplan/planner/validate.h"
#include "peftplan/sim/cluster.h"
#include "peftplan/sim/memory.h"
#include "peftplan/sim/program_hash.h"

using namespace peftplan;
using namespace peftplan::executor;
namespace fs = std::filesystem;

namespace {

const std::string kCorpus = std::string(PEFTPLAN_TEST_DATA) + "/executor/corpus.txt";

struct Config {
  std::string model = "tiny-llama-2l";
  std::vector<std::string> targets = {"q_proj", "v_proj"};
  std::int64_t r = 4;
  double alpha = 8;
  double dropout = 0.0;
  bool rslora = false;
  std::int64_t B = 2, S = 8, accum = 1;
  planner::Checkpointing ckpt = planner::Checkpointing::none;
  std::int64_t ckpt_every = 1;
  std::optional<DType> base;
  planner::Stage stage = planner::Stage::ddp;
  planner::OffloadDevice offload_optimizer = planner::OffloadDevice::none;
  planner::OffloadDevice offload_param = planner::OffloadDevice::none;
  planner::Attention attention = planner::Attention::eager;
  planner::Precision precision = planner::Precision::fp32;
};

planner::PlanFile make_plan(const Config& c) {
  planner::PlanFile pf;
  auto& in = pf.input;
  in.model = models::load_model(c.model);
  pf.model_source = c.model;
  models::AdapterSpec a;
  a.lora.r = c.r;
  a.lora.alpha = c.alpha;
  a.lora.dropout = c.dropout;
  a.lora.use_rslora = c.rslora;
  a.lora.targets.kind = models::ModuleSelector::Kind::list;
  a.lora.targets.names = c.targets;
  in.peft.adapters = {a};
  in.training.micro_batch = c.B;
  in.training.seq_len = c.S;
  in.training.grad_accum = c.accum;
  in.training.precision = c.precision;
  in.training.attention = c.attention;
  in.training.checkpointing = c.ckpt;
  in.training.checkpoint_every = c.ckpt_every;
  in.training.base_storage = c.base;
  in.training.lr = 1e-3;
  in.profile = planner::RuntimeProfile::executor;
  in.strategy.stage = c.stage;
  in.strategy.offload_optimizer = c.offload_optimizer;
  in.strategy.offload_param = c.offload_param;
  pf.run.steps = 2;
  pf.run.seed = 7;
  return pf;
}

TokenData corpus(const planner::PlanFile& pf) {
  return TokenData::load(kCorpus, DataFormat::bytes, pf.input.model.vocab, pf.input.training.seq_len);
}

Backend& cpu_backend() {
  // One thread: these models are tiny, and OpenMP barriers on a loaded machine cost more than
  // the kernels (the kernels' own tests cover the threaded paths).
  static std::unique_ptr<Backend> b = make_cpu_backend(1);
  return *b;
}

// Random trainable weights (B non-zero, so that every adapter gradient is non-zero).
void randomise_adapter(Session& s, unsigned seed, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> w = s.trainable_weights();
  for (float& x : w) x = u(rng);
  s.set_trainable_weights(w);
}

// Three steps of two sessions side by side: the same losses and gradient norms, to these
// relative bounds; `rounds_apart`: the second must not give the first's losses bit for bit.
void expect_trains_alike(Session& want_s, Session& got_s, double loss_tol, double norm_tol, bool rounds_apart) {
  for (int k = 0; k < 3; ++k) {
    const StepStats want = want_s.step(), got = got_s.step();
    EXPECT_NEAR(got.loss, want.loss, loss_tol * std::abs(want.loss)) << "step " << k + 1;
    EXPECT_NEAR(got.grad_norm, want.grad_norm, norm_tol * want.grad_norm) << "step " << k + 1;
    if (rounds_apart) {
      EXPECT_NE(got.loss, want.loss) << "step " << k + 1 << ": its storage should round somewhere";
    }
  }
}

// A command's exit code and its stdout and stderr together, run with one OpenMP thread (under the
// sanitizer build the children check for leaks too; scripts/lsan.supp names Open MPI's own).
std::pair<int, std::string> shell(const std::string& cmd) {
  std::string out;
  FILE* p = popen(("OMP_NUM_THREADS=1 " + cmd + " 2>&1").c_str(), "r");
  char buf[4096];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

fs::path temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("peftplan_test_executor_" + name + "_" + std::to_string(::getpid()));
  fs::create_directories(p);
  return p;
}

}  // namespace

// Measured memory per category, the simultaneous peak and its op equal the planner's executor-
// profile walk of the same program, exactly, over a matrix of configurations.
TEST(ExecutorMemory, MeasuredEqualsPredictedExactly) {
  std::vector<Config> cases;
  cases.push_back({});                                                            // the planner test's tiny config
  { Config c; c.ckpt = planner::Checkpointing::full; cases.push_back(c); }       // full checkpointing
  { Config c; c.base = DType::bf16; cases.push_back(c); }                        // bf16 base storage
  { Config c; c.dropout = 0.1; c.targets = {"q_proj", "k_proj", "v_proj", "o_proj"}; cases.push_back(c); }
  { Config c; c.accum = 3; c.B = 1; cases.push_back(c); }                        // gradient accumulation
  { Config c; c.targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}; c.r = 8; cases.push_back(c); }
  { Config c; c.model = "tiny-llama-tied"; c.dropout = 0.05; c.ckpt = planner::Checkpointing::full; cases.push_back(c); }  // tied head
  { Config c; c.model = "tiny-qwen2"; c.base = DType::bf16; c.rslora = true; c.accum = 2; cases.push_back(c); }  // qwen2 q/k/v bias
  { Config c; c.model = std::string(PEFTPLAN_TEST_DATA) + "/executor/tiny-mistral"; c.targets = {"k_proj", "down_proj"}; cases.push_back(c); }  // GQA 4:1
  { Config c; c.model = "tiny-llama-4l"; c.ckpt = planner::Checkpointing::every_k; c.ckpt_every = 2; c.dropout = 0.1; cases.push_back(c); }
  // Flash attention: the log-sum-exp instead of the probabilities, and its output kept for the
  // backward (o_proj not adapted: only attention keeps it), under checkpointing, and with LoRA
  // on o_proj (whose adapter keeps it too).
  { Config c; c.attention = planner::Attention::flash; c.S = 70; c.B = 1; cases.push_back(c); }
  { Config c; c.attention = planner::Attention::flash; c.ckpt = planner::Checkpointing::full; cases.push_back(c); }
  { Config c; c.attention = planner::Attention::flash; c.dropout = 0.1; c.targets = {"q_proj", "k_proj", "v_proj", "o_proj"};
    c.model = std::string(PEFTPLAN_TEST_DATA) + "/executor/tiny-mistral"; cases.push_back(c); }
  // bf16 mixed precision: bf16 activations, adapter and gradients, an fp32 master and fp32
  // gradients for the optimizer, fp32 logits for the loss; eager and flash, checkpointed, with
  // accumulation, an fp32 base cast per use, and ZeRO-2 / ZeRO-3 on one rank.
  const auto bf16 = planner::Precision::bf16_mixed;
  { Config c; c.precision = bf16; cases.push_back(c); }
  { Config c; c.precision = bf16; c.dropout = 0.1; c.targets = {"q_proj", "k_proj", "v_proj", "o_proj", "down_proj"}; c.accum = 2; cases.push_back(c); }
  { Config c; c.precision = bf16; c.attention = planner::Attention::flash; c.ckpt = planner::Checkpointing::full; c.S = 70; cases.push_back(c); }
  { Config c; c.precision = bf16; c.base = DType::fp32; c.model = "tiny-llama-tied"; cases.push_back(c); }
  { Config c; c.precision = bf16; c.stage = planner::Stage::zero2; c.accum = 2; cases.push_back(c); }
  { Config c; c.precision = bf16; c.stage = planner::Stage::zero3; c.ckpt = planner::Checkpointing::full; cases.push_back(c); }
  { Config c; c.precision = bf16; c.stage = planner::Stage::zero2; c.offload_optimizer = planner::OffloadDevice::cpu; cases.push_back(c); }
  for (const Config& c : cases) {
    const planner::PlanFile pf = make_plan(c);
    Session s(pf, cpu_backend(), corpus(pf));
    s.step();
    s.step();
    const sim::MemoryProfile want = sim::walk_memory(s.program());
    const MemoryStats& got = s.memory();
    const std::string what = fmt::format("{} targets {} dropout {} accum {} ckpt {} base {} attention {} precision {} {}", c.model,
                                         fmt::join(c.targets, ","), c.dropout, c.accum, planner::name_of(c.ckpt), c.base ? name_of(*c.base) : "fp32",
                                         planner::name_of(c.attention), planner::name_of(c.precision), planner::name_of(c.stage));
    for (int k = 0; k < sim::kNumCategories; ++k)
      EXPECT_EQ(got.peak_bytes[static_cast<std::size_t>(k)], want.category_peak_bytes[static_cast<std::size_t>(k)])
          << what << ": " << sim::name_of(static_cast<sim::MemCategory>(k));
    EXPECT_EQ(got.device_peak_bytes, want.device_peak_bytes) << what;
    EXPECT_EQ(got.device_peak_op, want.device_peak_op) << what;
    EXPECT_EQ(got.at_peak_bytes, want.at_peak_bytes) << what;
    // After the step only the setup buffers are live, as the walk says.
    EXPECT_EQ(got.live_bytes, want.end_bytes) << what;
    const nlohmann::json j = measurement_to_json(s.measurement());
    EXPECT_EQ(j["memory"]["device"]["peak_bytes"].get<std::uint64_t>(), want.device_peak_bytes);
  }
}

// A device backend (the CUDA backend, where the build has it) trains as the CPU backend does: the
// same plans give the same losses and gradient norms over three steps to fp32 rounding (the
// kernels differ in summation order, not in arithmetic), and its tracked memory is the walk's,
// category by category, as on the CPU. These cases are ctest entries labelled `device`; without
// a device they skip, saying why (backend.h backend_unavailable).
std::vector<std::string> device_backends() {
  std::vector<std::string> out;
  for (const std::string& n : backend_names())
    if (n != "cpu") out.push_back(n);
  return out;
}

class ExecutorDevice : public ::testing::TestWithParam<std::string> {};
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(ExecutorDevice);

TEST_P(ExecutorDevice, TrainsAsTheCpuBackendDoes) {
  if (const std::string why = backend_unavailable(GetParam()); !why.empty()) GTEST_SKIP() << GetParam() << ": " << why;
  const std::unique_ptr<Backend> dev = make_backend(GetParam());
  std::vector<Config> cases;
  { Config c; c.dropout = 0.1; c.targets = {"q_proj", "k_proj", "v_proj", "o_proj"}; cases.push_back(c); }
  { Config c; c.ckpt = planner::Checkpointing::full; c.base = DType::bf16; cases.push_back(c); }
  { Config c; c.accum = 3; c.B = 1; cases.push_back(c); }
  { Config c; c.model = "tiny-llama-tied"; c.targets = {"q_proj", "v_proj", "gate_proj", "down_proj"}; cases.push_back(c); }
  { Config c; c.model = std::string(PEFTPLAN_TEST_DATA) + "/executor/tiny-mistral"; c.targets = {"k_proj", "down_proj"}; c.S = 32; cases.push_back(c); }
  // The offloaded optimizer: gradients copied to pinned host memory on the copy stream, AdamW on
  // the host; and ZeRO-3's offloaded weights, copied to the device before each unit's gather.
  { Config c; c.stage = planner::Stage::zero2; c.offload_optimizer = planner::OffloadDevice::cpu; cases.push_back(c); }
  { Config c; c.stage = planner::Stage::zero3; c.offload_optimizer = planner::OffloadDevice::cpu; c.offload_param = planner::OffloadDevice::cpu;
    c.accum = 2; c.B = 1; cases.push_back(c); }
  // Flash attention over two tiles, GQA, under checkpointing.
  { Config c; c.model = std::string(PEFTPLAN_TEST_DATA) + "/executor/tiny-mistral"; c.attention = planner::Attention::flash; c.S = 96;
    c.B = 1; c.ckpt = planner::Checkpointing::full; cases.push_back(c); }
  // bf16 mixed precision (cuBLAS's bf16 GEMMs, every kernel on bf16 storage, fp32 masters):
  // eager with dropout, and flash under checkpointing with ZeRO-3.
  { Config c; c.precision = planner::Precision::bf16_mixed; c.dropout = 0.1; c.targets = {"q_proj", "v_proj", "down_proj"}; cases.push_back(c); }
  { Config c; c.precision = planner::Precision::bf16_mixed; c.model = std::string(PEFTPLAN_TEST_DATA) + "/executor/tiny-mistral";
    c.attention = planner::Attention::flash; c.S = 96; c.B = 1; c.ckpt = planner::Checkpointing::full; c.stage = planner::Stage::zero3;
    cases.push_back(c); }
  for (const Config& c : cases) {
    planner::PlanFile pf = make_plan(c);
    pf.input.training.lr = 3e-3;
    const bool bf16 = c.precision == planner::Precision::bf16_mixed;
    Session on_cpu(pf, cpu_backend(), corpus(pf));
    Session on_dev(pf, *dev, corpus(pf));
    const std::string what = fmt::format("{} on {}: {} targets {} dropout {} accum {} ckpt {} {}{}{} {}", c.model, GetParam(), c.targets.size(),
                                         fmt::join(c.targets, ","), c.dropout, c.accum, planner::name_of(c.ckpt), planner::name_of(c.stage),
                                         c.offload_optimizer == planner::OffloadDevice::cpu ? " + offload optimizer" : "",
                                         c.offload_param == planner::OffloadDevice::cpu ? " + offload param" : "", planner::name_of(c.precision));
    // Both compute in fp32 (ε = 2^-23 ≈ 1.2e-7); a reduction of K terms summed in another order
    // differs by about ε·√K (K ≤ 1024 here: ~4e-6 relative), compounded over the ~30 ops of a
    // layer chain and three AdamW updates, whose m/√v turns small gradient differences into
    // parameter differences of the same relative size. The bounds keep 25x and 250x of room over
    // that ~4e-6 for the loss and for the gradient norm (a sum of squares over every gradient).
    // In bf16 a store rounds to 2^-8 relative, and an element whose fp32 sums differ by an ulp may
    // round to neighbouring bf16 values: the same budget at bf16's unit roundoff (as
    // ExecutorPrecision holds bf16 against fp32 on the CPU).
    const double ltol = bf16 ? 4e-3 : 1e-4, ntol = bf16 ? 3e-2 : 1e-3;
    for (int k = 0; k < 3; ++k) {
      const StepStats want = on_cpu.step();
      const StepStats got = on_dev.step();
      EXPECT_NEAR(got.loss, want.loss, ltol * std::abs(want.loss)) << what << ", step " << k + 1;
      EXPECT_NEAR(got.grad_norm, want.grad_norm, ntol * want.grad_norm + 1e-7) << what << ", step " << k + 1;
    }
    const sim::MemoryProfile walk = sim::walk_memory(on_dev.program());
    for (int k = 0; k < sim::kNumCategories; ++k)
      EXPECT_EQ(on_dev.memory().peak_bytes[static_cast<std::size_t>(k)], walk.category_peak_bytes[static_cast<std::size_t>(k)])
          << what << ": " << sim::name_of(static_cast<sim::MemCategory>(k));
    EXPECT_EQ(on_dev.memory().device_peak_bytes, walk.device_peak_bytes) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, ExecutorDevice, ::testing::ValuesIn(device_backends()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

// The executor interprets programs built without names (sim/ops.h: operands by slot, state
// buffers by role, tensors by inventory index) for every strategy and offload it runs: on one
// rank each is the same arithmetic as DDP, so the losses and gradient norms agree, and every
// buffer of the program it ran is unnamed.
// The adapter goes to and from the device only through the Backend (set_trainable_weights,
// trainable_weights): what is written is what is read, for every layout (trainable.flat, ZeRO-2's
// bucket-partitioned flat with optimizer offload, ZeRO-3's shards), and it is what the step
// trains: the same adapter written into every strategy gives DDP's loss and norm.
TEST(ExecutorProgram, TheAdapterWrittenIsTheAdapterReadAndTrained) {
  Config c;
  c.targets = {"q_proj", "v_proj", "down_proj"};
  std::vector<float> adapter;
  std::vector<double> ddp;
  for (const auto& [stage, opt] : {std::pair{planner::Stage::ddp, planner::OffloadDevice::none},
                                   std::pair{planner::Stage::zero2, planner::OffloadDevice::cpu},
                                   std::pair{planner::Stage::zero3, planner::OffloadDevice::none}}) {
    planner::PlanFile pf = make_plan(c);
    pf.input.strategy.stage = stage;
    pf.input.strategy.offload_optimizer = opt;
    SCOPED_TRACE(std::string(planner::name_of(stage)));
    Session s(pf, cpu_backend(), corpus(pf));
    if (adapter.empty()) {
      adapter = s.trainable_weights();
      std::mt19937 rng(5);
      std::uniform_real_distribution<float> u(-0.1f, 0.1f);
      for (float& w : adapter) w = u(rng);
    }
    s.set_trainable_weights(adapter);
    EXPECT_EQ(s.trainable_weights(), adapter);
    const StepStats st = s.step();
    if (ddp.empty()) ddp = {st.loss, st.grad_norm};
    EXPECT_NEAR(st.loss, ddp[0], 1e-6 * ddp[0]);
    EXPECT_NEAR(st.grad_norm, ddp[1], 1e-5 * ddp[1]);
    EXPECT_NE(s.trainable_weights(), adapter);  // the step moved it
  }
}

TEST(ExecutorProgram, RunsProgramsBuiltWithoutNamesForEveryStrategy) {
  struct Strategy {
    planner::Stage stage;
    planner::OffloadDevice opt = planner::OffloadDevice::none, param = planner::OffloadDevice::none;
  };
  const std::vector<Strategy> strategies = {
      {planner::Stage::ddp},
      {planner::Stage::zero1},
      {planner::Stage::zero2},
      {planner::Stage::zero3},
      {planner::Stage::zero2, planner::OffloadDevice::cpu},
      {planner::Stage::zero3, planner::OffloadDevice::cpu},
      {planner::Stage::zero3, planner::OffloadDevice::cpu, planner::OffloadDevice::cpu},
  };
  Config c;
  c.dropout = 0.1;
  c.targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  c.ckpt = planner::Checkpointing::full;
  std::vector<double> ddp;
  for (const Strategy& st : strategies) {
    planner::PlanFile pf = make_plan(c);
    pf.input.strategy.stage = st.stage;
    pf.input.strategy.offload_optimizer = st.opt;
    pf.input.strategy.offload_param = st.param;
    SCOPED_TRACE(fmt::format("{} opt {} param {}", planner::name_of(st.stage), planner::name_of(st.opt), planner::name_of(st.param)));
    Session s(pf, cpu_backend(), corpus(pf));
    for (const sim::Buffer& b : s.program().buffers) EXPECT_TRUE(b.name.empty()) << b.name;
    EXPECT_TRUE(s.program().executable);
    std::vector<double> got;
    for (int k = 0; k < 2; ++k) {
      const StepStats st1 = s.step();
      got.push_back(st1.loss);
      got.push_back(st1.grad_norm);
    }
    if (ddp.empty()) ddp = got;
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], ddp[i], 1e-5 * std::abs(ddp[i])) << i;
    const sim::MemoryProfile want = sim::walk_memory(s.program());
    EXPECT_EQ(s.memory().device_peak_bytes, want.device_peak_bytes);
  }
}

// The copy queue (backend.h): a device may run an offload copy at any time between the marks that
// order it. A CPU backend whose copies run as late as the marks allow (CpuCopyQueue::when_waited:
// at the first wait that needs one, reading its source then) trains bit for bit as the inline one
// only if the runner makes every wait a device needs: a kernel or collective that reads a copy's
// destination before it landed reads stale bytes (taking out the runner's wait_for_copy_deps
// fails the ZeRO-3 parameter-offload cases here). The waits before a free and the host's
// synchronize before the offloaded step are not what these programs depend on (their copies are
// waited for earlier: the gathers that read them, the gradient norm read back), so taking those
// out passes; they guard programs that free a copy's side sooner. Every offload the executor
// runs, with an accumulation, in fp32 and bf16.
TEST(ExecutorCopyQueue, CopiesRunAsLateAsTheMarksAllowTrainAlike) {
  const std::unique_ptr<Backend> late = make_cpu_backend(1, CpuCopyQueue::when_waited);
  struct Offload {
    planner::Stage stage;
    planner::OffloadDevice param = planner::OffloadDevice::none;
  };
  const std::vector<Offload> offloads = {{planner::Stage::zero1},
                                         {planner::Stage::zero2},
                                         {planner::Stage::zero3},
                                         {planner::Stage::zero3, planner::OffloadDevice::cpu}};
  for (const auto precision : {planner::Precision::fp32, planner::Precision::bf16_mixed})
    for (const Offload& o : offloads) {
      Config c;
      c.targets = {"q_proj", "v_proj", "down_proj"};
      c.dropout = 0.1;
      c.accum = 2;
      c.B = 1;
      c.stage = o.stage;
      c.offload_optimizer = planner::OffloadDevice::cpu;
      c.offload_param = o.param;
      c.precision = precision;
      planner::PlanFile pf = make_plan(c);
      pf.input.training.lr = 3e-3;
      SCOPED_TRACE(fmt::format("{}{} {}", planner::name_of(o.stage), o.param == planner::OffloadDevice::cpu ? " + offload param" : "",
                               planner::name_of(precision)));
      Session inline_copies(pf, cpu_backend(), corpus(pf));
      Session late_copies(pf, *late, corpus(pf));
      std::array<int, 2> ways{};  // device to host, host to device
      for (const sim::Op& op : late_copies.program().ops)
        if (op.kind == sim::OpKind::copy && op.phase != sim::Phase::setup) ++ways[static_cast<std::size_t>(op.copy_dir)];
      EXPECT_GE(ways[0], 1);  // the gradients out and the parameters back (ZeRO-3's weights too)
      EXPECT_GE(ways[1], o.param == planner::OffloadDevice::cpu ? 2 : 1);
      randomise_adapter(inline_copies, 3, 0.05f);
      randomise_adapter(late_copies, 3, 0.05f);
      expect_trains_alike(inline_copies, late_copies, 0.0, 0.0, false);  // bit for bit
      EXPECT_EQ(late_copies.trainable_weights(), inline_copies.trainable_weights());
      EXPECT_EQ(late_copies.memory().device_peak_bytes, inline_copies.memory().device_peak_bytes);
    }
}

// The op times a run reports are its steady step's (planner::steady_samples, the step validation
// compares): one step, the fastest after the first, so they add up to no more than that step's
// wall time — a mean over every step would carry the slow steps' share and could exceed it.
TEST(ExecutorTiming, OpTimesAreTheSteadyStepsAndFitInIt) {
  Config c;
  c.model = "tiny-llama-4l";
  c.B = 2;
  c.S = 32;
  planner::PlanFile pf = make_plan(c);
  pf.run.steps = 8;
  Session s(pf, cpu_backend(), corpus(pf));
  for (int k = 0; k < 8; ++k) s.step();
  const Measurement m = s.measurement();
  ASSERT_EQ(m.step_times_s.size(), 8u);
  EXPECT_EQ(m.op_s_steps, 1);
  const double fastest = *std::min_element(m.step_times_s.begin() + 1, m.step_times_s.end());
  EXPECT_DOUBLE_EQ(planner::steady_step_s(m.step_times_s), fastest);
  double ops = 0.0;
  for (double x : m.op_s) ops += x;
  EXPECT_GT(ops, 0.5 * fastest);  // the ops are most of a step
  EXPECT_LE(ops, fastest);
}

// d loss / d adapter against central differences of the loss (fp32 model; directional
// derivatives along random directions, where the step h·|v| keeps the rounding error of the
// loss, ~1e-7 relative, far below the signal). Covers LoRA on every projection, dropout,
// rsLoRA, grad accumulation, checkpointing, GQA, bf16 base storage and qwen2 biases.
TEST(ExecutorGradients, LoraGradientsMatchFiniteDifferences) {
  std::vector<Config> cases;
  { Config c; c.targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}; c.dropout = 0.2; c.accum = 2; cases.push_back(c); }
  { Config c; c.model = "tiny-qwen2"; c.targets = {"q_proj", "v_proj", "down_proj"}; c.rslora = true; c.base = DType::bf16;
    c.ckpt = planner::Checkpointing::full; c.dropout = 0.1; cases.push_back(c); }
  { Config c; c.model = "tiny-llama-tied"; c.targets = {"k_proj", "o_proj", "up_proj"}; c.S = 12; cases.push_back(c); }
  { Config c; c.model = std::string(PEFTPLAN_TEST_DATA) + "/executor/tiny-mistral"; c.targets = {"q_proj", "k_proj", "gate_proj"}; cases.push_back(c); }
  { Config c; c.attention = planner::Attention::flash; c.targets = {"q_proj", "k_proj", "v_proj"}; c.S = 70; c.B = 1;
    c.ckpt = planner::Checkpointing::full; cases.push_back(c); }
  for (const Config& c : cases) {
    const planner::PlanFile pf = make_plan(c);
    Session s(pf, cpu_backend(), corpus(pf));
    randomise_adapter(s, 3, 0.2f);
    const double loss = s.forward_backward(0);
    const std::vector<float> g = s.gradients();
    const std::vector<float> w0 = s.trainable_weights();
    double gnorm = 0;
    for (float x : g) gnorm += static_cast<double>(x) * x;
    ASSERT_GT(gnorm, 0.0);
    std::mt19937 rng(11);
    std::normal_distribution<double> nd;
    for (int dir = 0; dir < 3; ++dir) {
      std::vector<double> v(g.size());
      double vn = 0;
      for (double& x : v) {
        x = nd(rng);
        vn += x * x;
      }
      for (double& x : v) x /= std::sqrt(vn);
      const double h = 1e-2;
      auto shifted = [&](double sign) {
        auto w = s.trainable_weights();
        for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(w0[i] + sign * h * v[i]);
        s.set_trainable_weights(w);
        return s.forward_backward(0);
      };
      const double fd = (shifted(1) - shifted(-1)) / (2 * h);
      double an = 0;
      for (std::size_t i = 0; i < g.size(); ++i) an += g[i] * v[i];
      EXPECT_NEAR(fd, an, 2e-4 + 2e-2 * std::abs(an)) << c.model << " direction " << dir << " loss " << loss;
      s.set_trainable_weights(w0);
    }
    // And the single largest component on its own.
    const auto imax = static_cast<std::size_t>(std::max_element(g.begin(), g.end(), [](float a, float b) { return std::abs(a) < std::abs(b); }) - g.begin());
    const double h = 1e-2;
    auto w = s.trainable_weights();
    w[imax] = w0[imax] + static_cast<float>(h);
    s.set_trainable_weights(w);
    const double up = s.forward_backward(0);
    w[imax] = w0[imax] - static_cast<float>(h);
    s.set_trainable_weights(w);
    const double down = s.forward_backward(0);
    w[imax] = w0[imax];
    s.set_trainable_weights(w);
    EXPECT_NEAR((up - down) / (2 * h), g[imax], 2e-4 + 2e-2 * std::abs(g[imax])) << c.model;
  }
}

// Flash and eager attention are one function (kernels.h §5b): the same plan with either trains
// the same, step for step, to fp32 rounding in another summation order (the bound: 1e-5 relative,
// 80x fp32's ε of 1.2e-7, over three AdamW steps), while the flash step's activations peak is
// lower: it saves no [B, nh, S, S] probabilities.
// GQA (tiny-mistral, 4:1), LoRA with dropout on attention and the MLP: the plan the training
// comparisons below train two ways.
static Config gqa_with_dropout(std::int64_t S) {
  Config c;
  c.model = std::string(PEFTPLAN_TEST_DATA) + "/executor/tiny-mistral";
  c.targets = {"q_proj", "v_proj", "down_proj"};
  c.S = S;
  c.dropout = 0.1;
  return c;
}

TEST(ExecutorAttention, FlashTrainsAsEagerDoes) {
  const Config c = gqa_with_dropout(96);
  Config f = c;
  f.attention = planner::Attention::flash;
  const planner::PlanFile pe = make_plan(c), pfl = make_plan(f);
  Session eager(pe, cpu_backend(), corpus(pe)), flash(pfl, cpu_backend(), corpus(pfl));
  expect_trains_alike(eager, flash, 1e-5, 1e-5, false);
  const auto act = static_cast<std::size_t>(sim::MemCategory::activations);
  EXPECT_LT(flash.memory().peak_bytes[act], eager.memory().peak_bytes[act]);
}

// bf16 mixed precision trains as fp32 does, to bf16's rounding: the same losses and gradient
// norms within a few bf16 units (2^-8 relative) over three steps, with the activations, the
// adapter and its gradients stored in bf16 (the activations and the adapter half the fp32 run's
// bytes; the gradients 1.5x with their fp32 copy) and an fp32 master the bf16 adapter is the
// rounding of.
TEST(ExecutorPrecision, Bf16TrainsAsFp32Does) {
  const Config c = gqa_with_dropout(32);
  Config b = c;
  b.precision = planner::Precision::bf16_mixed;
  const planner::PlanFile pf = make_plan(c), pb = make_plan(b);
  Session fp32(pf, cpu_backend(), corpus(pf)), mixed(pb, cpu_backend(), corpus(pb));
  randomise_adapter(fp32, 5, 0.05f);
  randomise_adapter(mixed, 5, 0.05f);
  expect_trains_alike(fp32, mixed, 4e-3, 3e-2, true);
  // Each AdamW step moves a weight by about lr at most (|m̂/√v̂| ≤ 1), so where a gradient is
  // mostly noise the two runs may step apart by 2·lr a step; beyond that, the bf16 rounding.
  const auto w32 = fp32.trainable_weights(), w16 = mixed.trainable_weights();
  ASSERT_EQ(w32.size(), w16.size());
  const double lr = pf.input.training.lr;
  for (std::size_t i = 0; i < w16.size(); ++i)
    EXPECT_NEAR(w16[i], w32[i], 3 * 2 * lr + std::ldexp(std::abs(w32[i]), -8)) << "element " << i;
  // The adapter is its fp32 master rounded to nearest even, and the master holds what bf16
  // cannot (AdamW's steps below half a bf16 ulp): the checkpoint's master.rank0.bin (a count, then
  // the partition's fp32 values: the whole adapter, in order, on one rank).
  const fs::path dir = temp_dir("bf16_master");
  mixed.save_checkpoint(dir);
  std::ifstream mf(dir / "step-3" / "master.rank0.bin", std::ios::binary);
  std::uint64_t nm = 0;
  mf.read(reinterpret_cast<char*>(&nm), 8);
  ASSERT_EQ(nm, w16.size());
  std::vector<float> master(nm);
  mf.read(reinterpret_cast<char*>(master.data()), static_cast<std::streamsize>(4 * nm));
  ASSERT_TRUE(mf);
  std::size_t finer = 0;
  for (std::size_t i = 0; i < nm; ++i) {
    EXPECT_EQ(w16[i], cpu::bf16_to_fp32(cpu::fp32_to_bf16(master[i]))) << "element " << i;
    finer += master[i] != w16[i];
  }
  EXPECT_GT(finer, nm / 2) << "the master should hold bits the bf16 adapter does not";
  fs::remove_all(dir);
  using sim::MemCategory;
  for (const MemCategory cat : {MemCategory::activations, MemCategory::workspace}) {
    const auto k = static_cast<std::size_t>(cat);
    EXPECT_LT(mixed.memory().peak_bytes[k], fp32.memory().peak_bytes[k]) << sim::name_of(cat);
  }
  // Per trainable element: the adapter 2 B instead of 4; the moments 8 B and the fp32 master 4 B
  // beside them; the bf16 gradients 2 B and, during the step, their fp32 copy 4 B.
  auto peak = [](const Session& s, MemCategory cat) { return s.memory().peak_bytes[static_cast<std::size_t>(cat)]; };
  EXPECT_EQ(peak(mixed, MemCategory::trainable_weights) * 2, peak(fp32, MemCategory::trainable_weights));
  EXPECT_EQ(peak(mixed, MemCategory::optimizer_states) * 2, peak(fp32, MemCategory::optimizer_states) * 3);
  EXPECT_EQ(peak(mixed, MemCategory::gradients) * 2, peak(fp32, MemCategory::gradients) * 3);
}

// What the executor does not run in mixed precision is refused at the session, naming it: fp16
// (it would need loss scaling) and pure bf16 (bf16 moments).
TEST(ExecutorPrecision, UnrunPrecisionsAreRefusedNamingThem) {
  auto refused = [](const Config& c, const std::string& says) {
    const planner::PlanFile pf = make_plan(c);
    try {
      Session s(pf, cpu_backend(), corpus(pf));
      ADD_FAILURE() << says << ": accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  { Config c; c.precision = planner::Precision::fp16_mixed; refused(c, "precision fp16"); }
  { Config c; c.precision = planner::Precision::bf16_pure; refused(c, "precision bf16-pure"); }
}

// Dropout masks in the backend are the kernels' counter-based masks (kernels.h dropout_mask).
TEST(ExecutorKernels, DropoutMatchesTheKernelMask) {
  const std::int64_t n = 40000;
  std::vector<float> x(n, 1.0f), y(n);
  const DropoutKey key{0.3, 12345};
  cpu_backend().dropout_forward(DType::fp32, x.data(), y.data(), n, key);
  std::vector<std::uint8_t> mask(n);
  cpu::dropout_mask(key.seed, 0, key.p, mask.data(), n);
  std::int64_t kept = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(y[static_cast<std::size_t>(i)], mask[static_cast<std::size_t>(i)] ? 1.0f / 0.7f : 0.0f);
    kept += mask[static_cast<std::size_t>(i)];
  }
  EXPECT_NEAR(static_cast<double>(kept) / n, 0.7, 0.01);
}

// The data order of data.h, by hand: S = 4, B = 2, accumulation 2, 1 rank: step 1 uses global
// sequences 4..7; micro-batch 1 of it is sequences 6 and 7 (tokens 24..28 and 28..32).
TEST(ExecutorData, OrderIsTheDocumentedOne) {
  std::vector<std::int32_t> toks(30);
  for (int i = 0; i < 30; ++i) toks[static_cast<std::size_t>(i)] = i;
  const TokenData d = TokenData::from_tokens(toks, 64, 4, "test");
  std::vector<std::int32_t> in(8), tg(8);
  d.micro_batch(1, 0, 1, 1, 2, 2, in, tg);
  EXPECT_EQ(in, (std::vector<std::int32_t>{24, 25, 26, 27, 28, 29, 0, 1}));  // wraps at 30
  EXPECT_EQ(tg, (std::vector<std::int32_t>{25, 26, 27, 28, 29, 0, 1, 2}));
}

// A byte-level tiny Llama learns this repository's design document: LoRA on every projection
// and on the LM head (the frozen random head alone bounds the logits too tightly to learn
// much), 300 steps of AdamW; the loss starts near ln(256) = 5.55 and falls clearly.
TEST(ExecutorTraining, LossFallsOnRealText) {
  Config c;
  c.targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"};
  c.r = 16;
  c.alpha = 32;
  c.B = 4;
  c.S = 32;
  planner::PlanFile pf = make_plan(c);
  pf.input.training.lr = 3e-3;
  Session s(pf, cpu_backend(), corpus(pf));
  std::vector<double> losses;
  for (int k = 0; k < 300; ++k) losses.push_back(s.step().loss);
  auto mean = [&](std::size_t from, std::size_t to) {
    double m = 0;
    for (std::size_t i = from; i < to; ++i) m += losses[i];
    return m / static_cast<double>(to - from);
  };
  std::fprintf(stderr, "loss: step 1 %.3f, steps 1-10 %.3f, 91-100 %.3f, 191-200 %.3f, 291-300 %.3f\n", losses[0],
               mean(0, 10), mean(90, 100), mean(190, 200), mean(290, 300));
  EXPECT_NEAR(losses[0], std::log(256.0), 0.1);
  EXPECT_LT(mean(290, 300), losses[0] - 2.0);
  EXPECT_LT(mean(290, 300), mean(0, 10) - 0.5);
}

// Saving writes PEFT's files; loading them back as the adapter init reproduces the loss.
TEST(ExecutorAdapter, SaveAndReloadRoundTrip) {
  Config c;
  c.targets = {"q_proj", "v_proj", "down_proj"};
  planner::PlanFile pf = make_plan(c);
  const fs::path dir = temp_dir("adapter");
  double loss_after = 0;
  {
    Session s(pf, cpu_backend(), corpus(pf));
    for (int k = 0; k < 3; ++k) s.step();
    loss_after = s.forward_backward(5);
    s.save_adapter(dir);
  }
  const SafetensorsFile f = SafetensorsFile::open(dir / "adapter_model.safetensors");
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_NE(f.find("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"), nullptr);
  EXPECT_EQ(f.at("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight").shape, (std::vector<std::int64_t>{64, 4}));
  const auto cfg = models::read_json_file((dir / "adapter_config.json").string());
  EXPECT_EQ(cfg["peft_type"], "LORA");
  EXPECT_EQ(cfg["r"], 4);
  pf.run.adapter_init = (dir / "adapter_model.safetensors").string();
  Session t(pf, cpu_backend(), corpus(pf));
  EXPECT_DOUBLE_EQ(t.forward_backward(5), loss_after);
  fs::remove_all(dir);
}

// A base checkpoint with Hugging Face names loads; truncated files, shape mismatches and data
// shorter than one sequence are InputErrors naming the file (and the tensor).
TEST(ExecutorInput, CheckpointsAndBadFiles) {
  Config c;
  planner::PlanFile pf = make_plan(c);
  const fs::path dir = temp_dir("weights");
  // Write a checkpoint: every base tensor with a recognisable constant per tensor.
  const auto tensors = models::parameter_tensors(pf.input.model);
  std::vector<std::vector<float>> values;
  std::vector<StTensorView> views;
  for (std::size_t i = 0; i < tensors.size(); ++i) values.emplace_back(static_cast<std::size_t>(tensors[i].numel()), 0.01f * static_cast<float>(i % 7));
  for (std::size_t i = 0; i < tensors.size(); ++i)
    views.push_back({tensors[i].name, StDtype::F32, tensors[i].shape, std::as_bytes(std::span<const float>(values[i]))});
  write_safetensors(dir / "model.safetensors", views);
  pf.run.weights = (dir / "model.safetensors").string();
  { Session s(pf, cpu_backend(), corpus(pf)); EXPECT_TRUE(std::isfinite(s.step().loss)); }
  // Shape mismatch: q_proj of layer 0 written transposed-size.
  auto bad = views;
  std::vector<float> wrong(64 * 32, 0.0f);
  for (auto& v : bad)
    if (v.name == "model.layers.0.self_attn.k_proj.weight") v = {v.name, StDtype::F32, {64, 32}, std::as_bytes(std::span<const float>(wrong))};
  write_safetensors(dir / "bad_shape.safetensors", bad);
  pf.run.weights = (dir / "bad_shape.safetensors").string();
  try {
    Session s(pf, cpu_backend(), corpus(pf));
    FAIL() << "shape mismatch accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("bad_shape.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("model.layers.0.self_attn.k_proj.weight"), std::string::npos) << e.what();
  }
  // Truncated: the good file cut short.
  {
    std::ifstream in(dir / "model.safetensors", std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(dir / "truncated.safetensors", std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  }
  pf.run.weights = (dir / "truncated.safetensors").string();
  EXPECT_THROW({ Session s(pf, cpu_backend(), corpus(pf)); }, InputError);
  // Data shorter than one sequence (S + 1 tokens).
  std::ofstream(dir / "short.txt") << "abc";
  try {
    TokenData::load(dir / "short.txt", DataFormat::bytes, 256, 8);
    FAIL() << "short data accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("short.txt"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("shorter than one sequence"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// A model saved quantised keeps its quantisation through plan.json; a file that drops it, or
// trains no adapter on it, was not written by `plan` and is refused naming the field.
TEST(PlanFile, ACheckpointSavedQuantisedKeepsItsQuantisation) {
  planner::PlanFile pf = make_plan(Config{});
  nlohmann::json cfg = nlohmann::json::parse(models::zoo_config_text("tiny-llama-2l"));
  cfg["quantization_config"] = {{"load_in_4bit", true}, {"bnb_4bit_quant_type", "nf4"}};
  pf.model_source = cfg;
  pf.input.model = models::model_from_config(cfg, "config.json", "tiny-llama-2l-bnb-4bit");
  ASSERT_TRUE(models::apply_checkpoint_quantization(pf.input.model, pf.input.peft, false).empty());
  const nlohmann::json j = planner::plan_file_to_json(pf);
  const planner::PlanFile back = planner::plan_file_from_json(j, "plan.json");
  ASSERT_TRUE(back.input.peft.quantization.has_value());
  EXPECT_EQ(back.input.peft.quantization, pf.input.peft.quantization);
  nlohmann::json dropped = j;
  dropped["quantization"] = nullptr;
  try {
    planner::plan_file_from_json(dropped, "plan.json");
    FAIL() << "a plan without the checkpoint's quantisation was read";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("plan.json: quantization must be the model's own (bitsandbytes nf4"), std::string::npos) << e.what();
  }
  nlohmann::json full = j;
  full["adapters"] = nlohmann::json::array();
  try {
    planner::plan_file_from_json(full, "plan.json");
    FAIL() << "full fine-tuning of a checkpoint saved quantised was read";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("plan.json: adapters must hold an adapter: the model was saved quantised"), std::string::npos) << e.what();
  }
}

// plan.json round trip: what the executor reads is what `peftplan run` wrote.
TEST(PlanFile, RoundTrip) {
  Config c;
  c.dropout = 0.1;
  c.accum = 2;
  c.base = DType::bf16;
  c.ckpt = planner::Checkpointing::full;
  planner::PlanFile pf = make_plan(c);
  pf.input.training.weight_decay = 0.01;
  pf.input.training.grad_clip = 1.0;
  pf.run.data = kCorpus;
  planner::SchedulerSpec sch;
  sch.type = planner::SchedulerType::warmup_decay_lr;
  sch.total_num_steps = 100;
  sch.warmup_num_steps = 10;
  sch.warmup_max_lr = 1e-3;
  pf.extras.scheduler = sch;
  const nlohmann::json j = planner::plan_file_to_json(pf);
  EXPECT_EQ(j["schema"], "peftplan.plan/1");
  const planner::PlanFile back = planner::plan_file_from_json(j, "plan.json");
  EXPECT_EQ(back.input.model.name, "tiny-llama-2l");
  EXPECT_EQ(back.input.training.micro_batch, 2);
  EXPECT_EQ(back.input.training.grad_accum, 2);
  EXPECT_EQ(back.input.training.checkpointing, planner::Checkpointing::full);
  EXPECT_EQ(back.input.training.base_storage, DType::bf16);
  EXPECT_DOUBLE_EQ(back.input.training.weight_decay, 0.01);
  EXPECT_DOUBLE_EQ(back.input.training.grad_clip, 1.0);
  EXPECT_EQ(back.input.peft.adapters.at(0).lora.r, 4);
  EXPECT_DOUBLE_EQ(back.input.peft.adapters.at(0).lora.dropout, 0.1);
  EXPECT_EQ(back.extras.scheduler, pf.extras.scheduler);
  EXPECT_EQ(back.run.data, kCorpus);
  EXPECT_EQ(back.run.seed, 7u);
  // The same program, so the same prediction.
  EXPECT_EQ(sim::walk_memory(planner::build_program(back.input).program).device_peak_bytes,
            sim::walk_memory(planner::build_program(pf.input).program).device_peak_bytes);
  // The file names the program the writer built (sim/program_hash.h); this build makes the same.
  EXPECT_EQ(j["program"]["contract_version"], sim::kProgramContractVersion);
  EXPECT_EQ(back.program_hash, j["program"]["hash"].get<std::string>());
  EXPECT_EQ(back.program_hash, sim::program_hash_hex(planner::build_program(pf.input, {.names = false}).program));
  EXPECT_NO_THROW(planner::check_program_hash(back, "plan.json"));
  nlohmann::json other = j;
  other["program"]["hash"] = "0123456789abcdef";  // another build's program
  try {
    planner::check_program_hash(planner::plan_file_from_json(other, "plan.json"), "plan.json");
    FAIL() << "a foreign program hash passed";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("plan.json: program.hash"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("the two binaries disagree"), std::string::npos) << e.what();
  }
  other["program"]["contract_version"] = 0;
  EXPECT_THROW(planner::plan_file_from_json(other, "plan.json"), InputError);
  other["program"] = {{"contract_version", sim::kProgramContractVersion}, {"hash", "XYZ"}};
  EXPECT_THROW(planner::plan_file_from_json(other, "plan.json"), InputError);
  // A plan for a GPU: the hash is of the program make_plan builds on the recorded cluster (an
  // sm90 GPU's cuBLAS workspaces are larger), and reading it back on that cluster agrees.
  planner::PlanFile gpu = pf;
  gpu.input.profile = planner::RuntimeProfile::deepspeed;
  gpu.cluster = sim::resolve_cluster("8xH100-SXM");
  const planner::PlanFile gpu_back = planner::plan_file_from_json(planner::plan_file_to_json(gpu), "plan.json");
  EXPECT_NO_THROW(planner::check_program_hash(gpu_back, "plan.json"));
  EXPECT_NE(gpu_back.program_hash, planner::plan_file_from_json([&] {
              planner::PlanFile a100 = gpu;
              a100.cluster = sim::resolve_cluster("8xA100-80GB");
              return planner::plan_file_to_json(a100);
            }(), "plan.json").program_hash);
  other.erase("program");  // a plan written before the hash existed still runs
  EXPECT_NO_THROW(planner::check_program_hash(planner::plan_file_from_json(other, "plan.json"), "plan.json"));
  nlohmann::json broken = j;
  broken["training"]["micro_batch"] = -3;
  try {
    planner::plan_file_from_json(broken, "plan.json");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("plan.json: training.micro_batch"), std::string::npos) << e.what();
  }
}

// `peftplan run` end to end: it writes plan.json, runs peftplan-exec, prints predicted vs
// measured memory (equal); bad input from the executor is one line naming the file, exit code 2.
TEST(ExecutorCli, RunEndToEndAndBadInputExitCodeTwo) {
  const fs::path dir = temp_dir("cli");
  auto run = [](const std::string& args) { return shell(std::string(PEFTPLAN_CLI) + " run " + args); };
  // A fixed cluster (no calibration run), time not judged and one round: this test is about the executor.
  const std::string fixed = " --cluster 1xA100-80GB --strategy ddp --tolerance-time 1e9 --rounds 1";
  const std::string common = "--model tiny-llama-2l --seq-len 16 --micro-batch 2 --lora-targets q_proj,v_proj" + fixed + " --data " + kCorpus;
  auto [code, out] = run(common + " --steps 3 --save-adapter " + (dir / "adapter").string() + " --out " + dir.string());
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("step 3/3"), std::string::npos) << out;
  EXPECT_NE(out.find("measured memory equals the prediction exactly"), std::string::npos) << out;
  EXPECT_TRUE(fs::exists(dir / "measurement.json"));
  EXPECT_TRUE(fs::exists(dir / "trace.json"));
  EXPECT_TRUE(fs::exists(dir / "adapter" / "adapter_model.safetensors"));
  const auto m = models::read_json_file((dir / "measurement.json").string());
  EXPECT_EQ(m["losses"].size(), 3u);
  EXPECT_TRUE(m["memory"]["device"].contains("activations_bytes"));
  std::ofstream(dir / "truncated.safetensors", std::ios::binary) << std::string("\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":", 13);
  std::tie(code, out) = run(common + " --weights " + (dir / "truncated.safetensors").string() + " --out " + dir.string());
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("truncated.safetensors"), std::string::npos) << out;
  // A plan.json whose program another build made: peftplan-exec refuses it, naming the field.
#ifdef PEFTPLAN_EXEC
  {
    nlohmann::json pj = models::read_json_file((dir / "plan.json").string());
    pj["program"]["hash"] = "0123456789abcdef";
    std::ofstream(dir / "foreign-plan.json") << pj.dump(2);
    const auto [ecode, eout] = shell(std::string(PEFTPLAN_EXEC) + " " + (dir / "foreign-plan.json").string() + " --out " + (dir / "foreign").string());
    EXPECT_EQ(ecode, 2) << eout;
    EXPECT_NE(eout.find("foreign-plan.json: program.hash"), std::string::npos) << eout;
  }
#endif
  std::ofstream(dir / "short.txt") << "0123456789";
  std::tie(code, out) = run("--model tiny-llama-2l --seq-len 16" + fixed + " --data " + (dir / "short.txt").string() + " --out " + dir.string());
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("short.txt"), std::string::npos) << out;
  // Bad run flags are refused before anything is written: --out is not even made. (The steps,
  // the learning rate, an adapter init that is no file and a save folder that is a file were
  // refused by the executor after plan.json and corpus.txt were written.)
  const fs::path fresh = dir / "fresh";
  const std::pair<std::string, std::string> bad[] = {
      {"--steps 0", "--steps: Value 0 not in range"},
      {"--lr nan", "--lr: must be a finite number >= 0, got nan"},
      {"--adapter-init random", "--adapter-init: must be peft or an existing safetensors file, got random"},
      {"--save-adapter " + (dir / "short.txt").string(), "--save-adapter: must be a folder (or a new name), is a file"},
      {"--data " + dir.string(), "--data: File is actually a directory"},
  };
  for (const auto& [args, expect] : bad) {
    std::tie(code, out) = run("--model tiny-llama-2l --seq-len 16" + fixed + " " + args + " --out " + fresh.string());
    EXPECT_EQ(code, 2) << args << "\n" << out;
    EXPECT_NE(out.find(expect), std::string::npos) << args << "\n" << out;
    EXPECT_FALSE(fs::exists(fresh)) << args;
  }
  // A file in --out's place is bad input (it was an internal error, exit code 3).
  std::tie(code, out) = run(common + " --out " + (dir / "short.txt").string());
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("--out " + (dir / "short.txt").string() + ": is a file, not a folder"), std::string::npos) << out;
  fs::remove_all(dir);
}

#ifdef PEFTPLAN_EXEC
// peftplan-exec: a folder, a device or a place no folder can be made, where the plan names a data
// file or an output folder, is bad input before the first step (exit code 2, not 3 after the last).
TEST(ExecutorCli, PlanPathsThatCannotServeAreBadInput) {
  const fs::path dir = temp_dir("exec-paths");
  const fs::path plan = dir / "plan.json";
  ASSERT_EQ(std::system((std::string(PEFTPLAN_CLI) + " plan --model tiny-llama-2l --profile executor --precision fp32 --attention eager "
                         "--gpus 1 --micro-batch 1 --seq-len 16 --write-plan " + plan.string() + " > /dev/null")
                            .c_str()),
            0);
  const nlohmann::json base = models::read_json_file(plan.string());
  auto exec = [&](const nlohmann::json& pj, const fs::path& out) {
    std::ofstream(dir / "p.json") << pj.dump(2);
    return shell(std::string(PEFTPLAN_EXEC) + " " + (dir / "p.json").string() + " --out " + out.string());
  };
  nlohmann::json pj = base;
  pj["run"]["data"] = dir.string();
  auto [code, out] = exec(pj, dir / "o1");
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find(dir.string() + ": is a folder, not a data file"), std::string::npos) << out;
  pj["run"]["data"] = "/dev/zero";  // it never ends: read whole, it took every byte of memory
  std::tie(code, out) = exec(pj, dir / "o2");
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("/dev/zero: is not a regular file"), std::string::npos) << out;
  std::ofstream(dir / "data.txt") << std::string(4096, 'a');
  pj["run"]["data"] = (dir / "data.txt").string();
  pj["run"]["checkpoint_every"] = 1;
  pj["run"]["checkpoint_dir"] = "/proc/peftplan-checkpoints";
  std::tie(code, out) = exec(pj, dir / "o3");
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("run.checkpoint_dir /proc/peftplan-checkpoints: the folder cannot be made"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(dir / "o3"));
  pj["run"]["checkpoint_every"] = 0;
  std::tie(code, out) = exec(pj, dir / "data.txt");
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("--out " + (dir / "data.txt").string() + ": is a file, not a folder"), std::string::npos) << out;
  fs::remove_all(dir);
}
#endif

// A collective's transfer (the shortest rank's call) and wait (the others' excess) are the mean
// over every recorded step after the first, not one step's sample (runner.h,
// split_collective_time). A session records no row for its first step; a row aligned with it
// (the 9.0 here) is left out all the same. Worked by hand: steps 1-3 of ranks [1, 3, 2] and [2, 1, 4] give
// shortest calls 1, 1, 2 (mean 4/3) and excesses 0.5, 1, 1 (mean 5/6); the fastest step alone
// (step 2) would give 1 and 1.
TEST(ExecutorMeasurement, CollectiveSplitIsTheMeanOverTheStepsAfterTheFirst) {
  Measurement m;
  m.step_times_s = {1.0, 0.5, 0.4, 0.6};
  m.collective_ops = {7};
  m.per_rank = nlohmann::json::array({{{"collective_ops", {7}}, {"collective_op_s_by_step", {{9.0}, {1.0}, {3.0}, {2.0}}}},
                                      {{"collective_ops", {7}}, {"collective_op_s_by_step", {{9.0}, {2.0}, {1.0}, {4.0}}}}});
  split_collective_time(m);
  ASSERT_EQ(m.collective_transfer_s.size(), 1u);
  EXPECT_DOUBLE_EQ(m.collective_transfer_s[0], 4.0 / 3.0);
  EXPECT_DOUBLE_EQ(m.collective_wait_s[0], 5.0 / 6.0);
  EXPECT_DOUBLE_EQ(m.sync_wait_s, 5.0 / 6.0);
  // Only the last 3 of 5 steps recorded (the window): all three are after the first step.
  m.step_times_s = {1.0, 0.5, 0.4, 0.6, 0.5};
  m.per_rank[0]["collective_op_s_by_step"] = {{1.0}, {3.0}, {2.0}};
  m.per_rank[1]["collective_op_s_by_step"] = {{2.0}, {1.0}, {4.0}};
  split_collective_time(m);
  EXPECT_DOUBLE_EQ(m.collective_transfer_s[0], 4.0 / 3.0);
  // A rank whose collective ops differ: nothing is split.
  Measurement other;
  other.step_times_s = {1.0, 0.5};
  other.collective_ops = {7};
  other.per_rank = nlohmann::json::array({{{"collective_ops", {7}}, {"collective_op_s_by_step", {{1.0}, {1.0}}}},
                                          {{"collective_ops", {8}}, {"collective_op_s_by_step", {{1.0}, {1.0}}}}});
  split_collective_time(other);
  EXPECT_TRUE(other.collective_transfer_s.empty());
}

#ifdef PEFTPLAN_EXEC
// Several plans and rounds in one job (executor::run_rounds): round 1 of each plan in its folder,
// round 2 in <folder>/rounds/2/ with its own plan.json (no adapter saved there), a line per
// round; a bad plan anywhere in the list is refused before anything runs; --out takes one plan.
TEST(ExecutorCli, RoundsOfSeveralPlansRunInOneJob) {
  const fs::path dir = temp_dir("rounds");
  const auto sh = shell;
  // A plan.json from `peftplan run` (one round), saving the adapter.
  auto [code, out] = sh(std::string(PEFTPLAN_CLI) + " run --model tiny-llama-2l --seq-len 16 --micro-batch 2 --steps 2 --rounds 1 " +
                        "--cluster 1xA100-80GB --strategy ddp --tolerance-time 1e9 --data " + kCorpus + " --save-adapter " +
                        (dir / "adapter").string() + " --out " + (dir / "first").string());
  ASSERT_EQ(code, 0) << out;
  for (const char* d : {"a", "b"}) {
    fs::create_directories(dir / d);
    fs::copy_file(dir / "first" / "plan.json", dir / d / "plan.json");
  }
  const std::string exec = std::string(PEFTPLAN_EXEC) + " ";
  const std::string a = (dir / "a" / "plan.json").string(), b = (dir / "b" / "plan.json").string();
  std::tie(code, out) = sh(exec + a + " " + b + " --rounds 2");
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("== ddp (1 of 2), round 1 of 2: "), std::string::npos) << out;
  EXPECT_NE(out.find("== ddp (2 of 2), round 1 of 2: "), std::string::npos) << out;
  EXPECT_NE(out.find("round 1/2: ddp "), std::string::npos) << out;
  EXPECT_NE(out.find("round 2/2: ddp "), std::string::npos) << out;
  for (const char* d : {"a", "b"}) {
    EXPECT_TRUE(fs::exists(dir / d / "measurement.json")) << d;
    EXPECT_TRUE(fs::exists(dir / d / "rounds" / "2" / "measurement.json")) << d;
    const auto round2 = models::read_json_file((dir / d / "rounds" / "2" / "plan.json").string());
    const auto round1 = models::read_json_file((dir / d / "plan.json").string());
    EXPECT_EQ(round1.at("run").at("save_adapter"), (dir / "adapter").string()) << d;
    EXPECT_EQ(round2.at("run").at("save_adapter"), "") << d;
    EXPECT_EQ(round2.at("program"), round1.at("program")) << d;  // the same steps
    EXPECT_EQ(models::read_json_file((dir / d / "rounds" / "2" / "measurement.json").string()).at("losses").size(), 2u) << d;
  }
  // Round 2 did not save the adapter: the file round 1 saved is the only one, from before round 2.
  EXPECT_LE(fs::last_write_time(dir / "adapter" / "adapter_model.safetensors"), fs::last_write_time(dir / "a" / "rounds" / "2" / "plan.json"));
  // Only round 1's steps are shown: "step 2/2" appears once per plan.
  std::size_t shown = 0;
  for (std::size_t at = out.find("step 2/2"); at != std::string::npos; at = out.find("step 2/2", at + 1)) ++shown;
  EXPECT_EQ(shown, 2u) << out;
  // A foreign plan second in the list: exit 2 naming it, and the first plan did not run.
  nlohmann::json pj = models::read_json_file(a);
  pj["program"]["hash"] = "0123456789abcdef";
  fs::create_directories(dir / "c");
  std::ofstream(dir / "c" / "foreign.json") << pj.dump(2);
  fs::create_directories(dir / "d");
  fs::copy_file(a, dir / "d" / "plan.json");
  std::tie(code, out) = sh(exec + (dir / "d" / "plan.json").string() + " " + (dir / "c" / "foreign.json").string() + " --rounds 2");
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("foreign.json: program.hash"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(dir / "d" / "measurement.json"));
  std::tie(code, out) = sh(exec + a + " " + b + " --out " + (dir / "x").string());
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("--out"), std::string::npos) << out;
  fs::remove_all(dir);
}
#endif

// The causal row blocks of the attention kernels (64 rows) at a length that spans three blocks
// and ends in a partial one: forward against a naive double reference, backward against
// directional finite differences of <out, G> (double precision).
TEST(ExecutorKernels, BlockedCausalAttentionMatchesReference) {
  const cpu::Index B = 1, S = 150, nh = 4, nkv = 2, d = 8;
  std::mt19937 rng(5);
  std::normal_distribution<double> nd;
  auto randv = [&](std::size_t n) {
    std::vector<double> v(n);
    for (double& x : v) x = nd(rng);
    return v;
  };
  const std::size_t nq = static_cast<std::size_t>(B * S * nh * d), nk = static_cast<std::size_t>(B * S * nkv * d);
  std::vector<double> q = randv(nq), k = randv(nk), v = randv(nk), G = randv(nq);
  std::vector<double> P(static_cast<std::size_t>(B * nh * S * S)), out(nq);
  cpu::attention_forward(q.data(), k.data(), v.data(), P.data(), out.data(), B, S, nh, nkv, d);
  // Naive reference (transformers eager attention with repeat_kv).
  double worst = 0;
  for (cpu::Index h = 0; h < nh; ++h)
    for (cpu::Index i = 0; i < S; ++i) {
      const cpu::Index kh = h / (nh / nkv);
      std::vector<double> s(static_cast<std::size_t>(i + 1));
      double mx = -1e300, sum = 0;
      for (cpu::Index j = 0; j <= i; ++j) {
        double dot = 0;
        for (cpu::Index e = 0; e < d; ++e) dot += q[static_cast<std::size_t>((i * nh + h) * d + e)] * k[static_cast<std::size_t>((j * nkv + kh) * d + e)];
        s[static_cast<std::size_t>(j)] = dot / std::sqrt(static_cast<double>(d));
        mx = std::max(mx, s[static_cast<std::size_t>(j)]);
      }
      for (double& x : s) sum += (x = std::exp(x - mx));
      for (cpu::Index e = 0; e < d; ++e) {
        double o = 0;
        for (cpu::Index j = 0; j <= i; ++j) o += s[static_cast<std::size_t>(j)] / sum * v[static_cast<std::size_t>((j * nkv + kh) * d + e)];
        worst = std::max(worst, std::abs(o - out[static_cast<std::size_t>((i * nh + h) * d + e)]));
      }
    }
  EXPECT_LT(worst, 1e-12);
  // Backward.
  std::vector<double> dq(nq), dk(nk), dv(nk), scratch(static_cast<std::size_t>(cpu::attention_backward_scratch_elems(S, 2)));
  cpu::attention_backward(G.data(), q.data(), k.data(), v.data(), P.data(), dq.data(), dk.data(), dv.data(), scratch.data(),
                          static_cast<cpu::Index>(scratch.size()), B, S, nh, nkv, d);
  auto loss = [&](const std::vector<double>& qq, const std::vector<double>& kk, const std::vector<double>& vv) {
    std::vector<double> PP(P.size()), oo(nq);
    cpu::attention_forward(qq.data(), kk.data(), vv.data(), PP.data(), oo.data(), B, S, nh, nkv, d);
    double l = 0;
    for (std::size_t i = 0; i < nq; ++i) l += oo[i] * G[i];
    return l;
  };
  for (int which = 0; which < 3; ++which) {
    const std::vector<double>& grad = which == 0 ? dq : which == 1 ? dk : dv;
    const std::vector<double> dir = randv(grad.size());
    double an = 0;
    for (std::size_t i = 0; i < grad.size(); ++i) an += grad[i] * dir[i];
    const double h = 1e-5;
    auto at = [&](double sgn) {
      std::vector<double> qq = q, kk = k, vv = v;
      std::vector<double>& x = which == 0 ? qq : which == 1 ? kk : vv;
      for (std::size_t i = 0; i < x.size(); ++i) x[i] += sgn * h * dir[i];
      return loss(qq, kk, vv);
    };
    const double fd = (at(1) - at(-1)) / (2 * h);
    EXPECT_NEAR(fd, an, 1e-6 * (1 + std::abs(an))) << "operand " << which;
  }
}
