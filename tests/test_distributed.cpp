// Distributed training against single-rank training (tests/CMakeLists.txt runs this program
// under mpirun with 2, 3 and 4 ranks). For DDP, ZeRO-1, ZeRO-2 (one reduce bucket, and one per
// layer) and ZeRO-3 (persistent and gathered base tensors, fp32 and bf16 storage), with and
// without optimizer offload and activation checkpointing, with gradient accumulation and dropout:
//   - losses equal one rank's with the same global batch (micro-batch B, accumulation A·N) to
//     relative 1e-5, and the final adapters to fp32 tolerance;
//   - every rank's measured memory per category, its simultaneous peak and the op of the peak
//     equal the walk of the program exactly;
//   - the collective bytes the communicator counted equal the program's (nccl-tests sizes),
//     exactly, kind by kind;
// and training interrupted by a checkpoint and resumed gives the uninterrupted run's losses and
// adapter (ZeRO-3 included). ZeRO-3 also runs with parameter offload (--offload-param cpu). Every
// strategy also trains in bf16 mixed precision (bf16 gradients summed across ranks in bf16).
// The adapter of tiny-llama-2l with LoRA r=4 on q_proj and v_proj has 1792 elements: 3 ranks
// need padding (1792 = 3·597 + 1), 2 and 4 do not.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <string_view>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "peftplan/common/error.h"
#include "peftplan/executor/backend.h"
#include "peftplan/executor/communicator.h"
#include "mpi_test_main.h"
#include "peftplan/executor/runner.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/plan_file.h"
#include "peftplan/sim/memory.h"

using namespace peftplan;
using namespace peftplan::executor;
namespace fs = std::filesystem;

namespace {

using peftplan::testing::g_world;  // set by run_mpi_tests()

const std::string kCorpus = std::string(PEFTPLAN_TEST_DATA) + "/executor/corpus.txt";

struct Case {
  planner::Stage stage = planner::Stage::ddp;
  bool offload = false;
  planner::Checkpointing ckpt = planner::Checkpointing::none;
  double dropout = 0.0;
  double clip = 0.0;
  bool bf16_base = false;  // linear base weights stored in bf16 (ZeRO-3: mixed-dtype flat units)
  std::int64_t bucket = 0; // reduce_bucket_size (elements) when set
  bool offload_param = false;  // ZeRO-3: shards on the host, staged on the device per gather
  bool mixed = false;          // bf16 mixed precision: bf16 activations, adapter and gradients, fp32 masters
};

std::string describe(const Case& c, int ranks) {
  return fmt::format("{} ranks {}{}{} ckpt={} dropout={} clip={}{}{}", ranks, planner::name_of(c.stage), c.offload ? "+offload" : "",
                     c.offload_param ? "+offload_param" : "",
                     planner::name_of(c.ckpt), c.dropout, c.clip, c.bf16_base ? " bf16 base" : "",
                     c.bucket ? fmt::format(" reduce_bucket_size={}", c.bucket) : "") + (c.mixed ? " bf16 mixed" : "");
}

planner::PlanFile make_plan(const Case& c, int ranks, std::int64_t accum) {
  planner::PlanFile pf;
  auto& in = pf.input;
  in.model = models::load_model("tiny-llama-2l");
  pf.model_source = "tiny-llama-2l";
  models::AdapterSpec a;
  a.lora.r = 4;
  a.lora.alpha = 8;
  a.lora.dropout = c.dropout;
  a.lora.targets.kind = models::ModuleSelector::Kind::list;
  a.lora.targets.names = {"q_proj", "v_proj"};
  in.peft.adapters = {a};
  in.training.micro_batch = 1;
  in.training.seq_len = 8;
  in.training.grad_accum = accum;
  in.training.precision = c.mixed ? planner::Precision::bf16_mixed : planner::Precision::fp32;
  in.training.attention = planner::Attention::eager;
  in.training.checkpointing = c.ckpt;
  if (c.bf16_base) in.training.base_storage = DType::bf16;
  in.training.lr = 1e-2;  // large enough that three steps move the adapter visibly
  in.training.grad_clip = c.clip;
  in.strategy.stage = c.stage;
  in.strategy.ranks = ranks;
  if (c.offload) in.strategy.offload_optimizer = planner::OffloadDevice::cpu;
  if (c.offload_param) in.strategy.offload_param = planner::OffloadDevice::cpu;
  // ZeRO-3: tensors under 3000 elements stay whole on every rank (the norms [64], k_proj and
  // v_proj [32,64]); q_proj, o_proj, the MLP, the embedding and lm_head are flattened per unit
  // and sharded (a layer's 41984 gathered elements, the embedding's 16384 and the adapter's
  // 896 per layer need padding on 3 ranks).
  in.strategy.ds.stage3_param_persistence_threshold = 3000;
  if (c.bucket > 0) in.strategy.ds.reduce_bucket_size = c.bucket;
  in.profile = planner::RuntimeProfile::executor;
  pf.run.steps = 3;
  pf.run.seed = 11;
  return pf;
}

TokenData corpus(const planner::PlanFile& pf) {
  return TokenData::load(kCorpus, DataFormat::bytes, pf.input.model.vocab, pf.input.training.seq_len);
}

// The CPU backend with the late copy queue (backend.h CpuCopyQueue::when_waited): the offload
// cases' copies run as late as their marks allow, as a device's copy engine may run them, so a
// wait the runner misses between a copy and the kernels, frees or host step after it shows as a
// difference from one rank's training (which runs on it too). Collectives are not checked against
// copies here: the runner drains both queues before each array collective.
Backend& backend() {
  static std::unique_ptr<Backend> b = make_cpu_backend(1, CpuCopyQueue::when_waited);
  return *b;
}

constexpr std::int64_t kAccum = 2;
constexpr int kSteps = 3;

void check_against_single_rank(const Case& c) {
  const int N = g_world->size();
  const std::string what = describe(c, N);
  // One rank, the same global batch: accumulation A·N over the same sequences in the same order.
  Case one = c;
  one.stage = planner::Stage::ddp;
  one.offload = false;
  one.offload_param = false;
  const planner::PlanFile ref_plan = make_plan(one, 1, kAccum * N);
  Session ref(ref_plan, backend(), corpus(ref_plan));
  const planner::PlanFile plan = make_plan(c, N, kAccum);
  Session dist(plan, backend(), corpus(plan), g_world);
  // In bf16 the ranks' gradients are summed in bf16 (each reduction step rounds, as NCCL's do)
  // where one rank accumulates its micro-batches in bf16 in another order: they agree to bf16's
  // rounding, 2^-8 relative per sum, not to fp32's.
  // The weights then part by up to 2·lr per AdamW step where a gradient is mostly noise (each
  // step moves a weight by about lr at most), and the next steps' norms with them.
  const double tol = c.mixed ? 4e-3 : 1e-5, ntol = c.mixed ? 3e-2 : 1e-5;
  for (int k = 0; k < kSteps; ++k) {
    const StepStats want = ref.step();
    const StepStats got = dist.step();
    EXPECT_NEAR(got.loss, want.loss, tol * std::abs(want.loss)) << what << " step " << k;
    EXPECT_NEAR(got.grad_norm, want.grad_norm, ntol * std::abs(want.grad_norm) + 1e-9) << what << " step " << k;
  }
  // The final adapter (ZeRO-1/2 pad trainable.flat to a multiple of N; the padding stays zero).
  const auto w = ref.trainable_weights();
  const auto g = dist.trainable_weights();
  ASSERT_GE(g.size(), w.size());
  double worst = 0.0;
  // Relative to the weight or to the step size lr = 1e-2 (an element that Adam's steps brought
  // near zero keeps the absolute error of the steps, ~1e-7 of lr per ulp of the gradients).
  const double lr = plan.input.training.lr;
  for (std::size_t i = 0; i < w.size(); ++i)
    worst = std::max(worst, c.mixed ? std::abs(double(g[i]) - double(w[i])) / (2 * lr * kSteps + std::ldexp(std::abs(double(w[i])), -8))
                                    : std::abs(double(g[i]) - double(w[i])) / (1e-2 + std::abs(double(w[i]))));
  EXPECT_LT(worst, c.mixed ? 1.0 : 1e-4) << what << ": adapters differ";
  for (std::size_t i = w.size(); i < g.size(); ++i) EXPECT_EQ(g[i], 0.0f) << what << ": padding " << i;
  // Memory: this rank's measurement equals the walk of its program, exactly.
  const sim::MemoryProfile mp = sim::walk_memory(dist.program());
  const MemoryStats& ms = dist.memory();
  for (int k = 0; k < sim::kNumCategories; ++k)
    EXPECT_EQ(ms.peak_bytes[static_cast<std::size_t>(k)], mp.category_peak_bytes[static_cast<std::size_t>(k)])
        << what << ": " << sim::name_of(static_cast<sim::MemCategory>(k)) << " on rank " << g_world->rank();
  EXPECT_EQ(ms.device_peak_bytes, mp.device_peak_bytes) << what;
  EXPECT_EQ(ms.host_peak_bytes, mp.host_peak_bytes) << what;
  EXPECT_EQ(ms.device_peak_op, mp.device_peak_op) << what;
  EXPECT_EQ(ms.live_bytes, mp.end_bytes) << what;
  if (c.offload_param) {  // the shards live on the host; every gather reads a device staging view
    EXPECT_GT(ms.peak_bytes[static_cast<std::size_t>(sim::MemCategory::host_weights)], 0u) << what;
    const sim::Program& p = dist.program();
    int gathers = 0;
    for (const sim::Op& op : p.ops) {
      if (op.kind != sim::OpKind::collective || op.collective != sim::Collective::all_gather || op.buffer_in < 0) continue;
      const sim::Buffer& in = p.buffers[static_cast<std::size_t>(op.buffer_in)];
      ASSERT_GE(in.view_of, 0) << what;
      EXPECT_EQ(p.buffers[static_cast<std::size_t>(in.view_of)].category, sim::MemCategory::comm_buffers) << what;
      ++gathers;
    }
    EXPECT_GT(gathers, 0) << what;
  }
  // Collectives: the communicator's counts and bytes equal the program's, kind by kind.
  const Measurement m = dist.measurement();
  std::uint64_t total = 0;
  for (const CollectiveStat& cs : m.collectives) {
    EXPECT_EQ(cs.bytes, cs.predicted_bytes_per_step * kSteps) << what << ": " << cs.kind;
    EXPECT_EQ(cs.calls, cs.predicted_calls_per_step * kSteps) << what << ": " << cs.kind;
    total += cs.bytes;
  }
  EXPECT_GT(total, 0u) << what;
}

}  // namespace

TEST(Distributed, DdpMatchesSingleRank) {
  check_against_single_rank({planner::Stage::ddp});
  check_against_single_rank({planner::Stage::ddp, false, planner::Checkpointing::none, 0.1, 0.0});
  check_against_single_rank({planner::Stage::ddp, false, planner::Checkpointing::full, 0.0, 0.0});
  check_against_single_rank({planner::Stage::ddp, false, planner::Checkpointing::none, 0.0, 0.5});
  check_against_single_rank({planner::Stage::ddp, false, planner::Checkpointing::full, 0.1, 0.5});
}

TEST(Distributed, Zero1MatchesSingleRank) {
  check_against_single_rank({planner::Stage::zero1});
  check_against_single_rank({planner::Stage::zero1, false, planner::Checkpointing::full, 0.1, 0.5});
  check_against_single_rank({planner::Stage::zero1, true});
  check_against_single_rank({planner::Stage::zero1, true, planner::Checkpointing::full, 0.1, 0.5});
}

TEST(Distributed, Zero2MatchesSingleRank) {
  check_against_single_rank({planner::Stage::zero2});
  check_against_single_rank({planner::Stage::zero2, false, planner::Checkpointing::full, 0.1, 0.5});
  check_against_single_rank({planner::Stage::zero2, true});
  check_against_single_rank({planner::Stage::zero2, true, planner::Checkpointing::full, 0.1, 0.5});
  // Several reduce buckets (one per layer: 896 adapter elements each, padded on 3 ranks): the
  // partition is laid out bucket by bucket (planner/program.cpp, plan_buckets).
  check_against_single_rank({planner::Stage::zero2, false, planner::Checkpointing::none, 0.0, 0.0, false, 500});
  check_against_single_rank({planner::Stage::zero2, false, planner::Checkpointing::full, 0.1, 0.5, false, 500});
  check_against_single_rank({planner::Stage::zero2, true, planner::Checkpointing::full, 0.1, 0.5, false, 500});
}

TEST(Distributed, Zero3MatchesSingleRank) {
  check_against_single_rank({planner::Stage::zero3});
  check_against_single_rank({planner::Stage::zero3, false, planner::Checkpointing::full, 0.1, 0.5});
  check_against_single_rank({planner::Stage::zero3, true});
  check_against_single_rank({planner::Stage::zero3, true, planner::Checkpointing::full, 0.1, 0.5});
  check_against_single_rank({planner::Stage::zero3, false, planner::Checkpointing::none, 0.1, 0.0, true});
  // Parameter offload: the frozen shards and the adapter partition on the host, each gather's
  // input a device staging buffer filled by param_h2d copies (host_weights, comm_buffers).
  check_against_single_rank({planner::Stage::zero3, false, planner::Checkpointing::none, 0.0, 0.0, false, 0, true});
  check_against_single_rank({planner::Stage::zero3, true, planner::Checkpointing::full, 0.1, 0.5, true, 0, true});
}

// bf16 mixed precision (fp32 masters, bf16 gradients summed in bf16 across ranks) for every
// strategy: the same checks, to bf16's tolerance against one rank in bf16.
TEST(Distributed, Bf16MixedPrecisionMatchesSingleRank) {
  Case c;
  c.mixed = true;
  for (const planner::Stage st : {planner::Stage::ddp, planner::Stage::zero1, planner::Stage::zero2, planner::Stage::zero3}) {
    c.stage = st;
    check_against_single_rank(c);
  }
  Case z2{planner::Stage::zero2, false, planner::Checkpointing::full, 0.1, 0.5, false, 500};  // a bucket per layer
  z2.mixed = true;
  check_against_single_rank(z2);
  Case z3{planner::Stage::zero3, false, planner::Checkpointing::full, 0.1, 0.5, true};
  z3.mixed = true;
  check_against_single_rank(z3);
  // The offloaded optimizer: bf16 gradients widened on the host, the host master stepped and
  // rounded into the host copy the copies bring back; and ZeRO-3's parameter offload.
  for (const planner::Stage st : {planner::Stage::zero1, planner::Stage::zero2, planner::Stage::zero3}) {
    Case o{st, true, planner::Checkpointing::none, 0.1, 0.5};
    o.mixed = true;
    check_against_single_rank(o);
  }
  Case zp{planner::Stage::zero3, true, planner::Checkpointing::full, 0.1, 0.5, false, 0, true};
  zp.mixed = true;
  check_against_single_rank(zp);
}

// ZeRO-3 on one rank (no communicator): each gather is a copy of the shard, the gradients are
// the partition itself; the same losses as DDP on one rank.
TEST(Distributed, Zero3OnOneRankMatchesDdp) {
  for (bool bf16 : {false, true}) {
    Case c{planner::Stage::zero3, false, planner::Checkpointing::full, 0.1, 0.5, bf16};
    Case d = c;
    d.stage = planner::Stage::ddp;
    const planner::PlanFile zp = make_plan(c, 1, kAccum), dp = make_plan(d, 1, kAccum);
    Session z(zp, backend(), corpus(zp));
    Session r(dp, backend(), corpus(dp));
    for (int k = 0; k < kSteps; ++k) {
      const double want = r.step().loss, got = z.step().loss;
      EXPECT_NEAR(got, want, 1e-5 * std::abs(want)) << describe(c, 1) << " step " << k;
    }
    const auto w = r.trainable_weights();
    const auto g = z.trainable_weights();
    ASSERT_EQ(g.size(), w.size());
    for (std::size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(g[i], w[i], 1e-4 * (1e-2 + std::abs(w[i]))) << describe(c, 1) << " " << i;
    const sim::MemoryProfile mp = sim::walk_memory(z.program());
    for (int k = 0; k < sim::kNumCategories; ++k)
      EXPECT_EQ(z.memory().peak_bytes[static_cast<std::size_t>(k)], mp.category_peak_bytes[static_cast<std::size_t>(k)]) << describe(c, 1);
  }
}

// Four steps straight, against two steps, a checkpoint, a new session that resumes, and two more
// steps: the same losses (the same arithmetic in the same order: equal to the last bit here;
// the bound leaves room only for nothing).
TEST(Distributed, ResumeFromCheckpointGivesTheSameLosses) {
  const int N = g_world->size();
  std::int64_t id = ::getpid();
  g_world->broadcast(&id, &id, 1, CommDType::int64, 0);
  const fs::path dir = fs::temp_directory_path() / fmt::format("peftplan_test_distributed_{}", id);
  for (const Case& c : {Case{planner::Stage::zero2, true, planner::Checkpointing::none, 0.1, 0.5},
                        Case{planner::Stage::ddp, false, planner::Checkpointing::none, 0.1, 0.0},
                        Case{planner::Stage::zero1},
                        Case{planner::Stage::zero2, true, planner::Checkpointing::none, 0.1, 0.5, false, 500},
                        // ZeRO-3: every rank's adapter partition (trainable.rank<r>.bin), plain and
                        // under optimizer offload (then also the host copy in optimizer.rank<r>.bin)
                        Case{planner::Stage::zero3, false, planner::Checkpointing::none, 0.1, 0.5},
                        Case{planner::Stage::zero3, true, planner::Checkpointing::full, 0.1, 0.5},
                        // and with parameter offload (the partition restored into host memory)
                        Case{planner::Stage::zero3, true, planner::Checkpointing::none, 0.1, 0.5, false, 0, true},
                        // bf16 mixed precision: the fp32 masters too (master.rank<r>.bin)
                        Case{planner::Stage::zero2, false, planner::Checkpointing::none, 0.1, 0.5, false, 500, false, true},
                        Case{planner::Stage::zero3, false, planner::Checkpointing::none, 0.1, 0.5, false, 0, false, true},
                        Case{planner::Stage::zero2, true, planner::Checkpointing::none, 0.1, 0.5, false, 0, false, true}}) {
    const std::string what = describe(c, N);
    planner::PlanFile plan = make_plan(c, N, kAccum);
    std::vector<double> straight;
    std::vector<float> straight_adapter;
    {
      Session s(plan, backend(), corpus(plan), g_world);
      for (int k = 0; k < 4; ++k) straight.push_back(s.step().loss);
      const auto w = s.trainable_weights();
      straight_adapter.assign(w.begin(), w.end());
    }
    std::vector<double> resumed;
    {
      Session s(plan, backend(), corpus(plan), g_world);
      for (int k = 0; k < 2; ++k) resumed.push_back(s.step().loss);
      s.save_checkpoint(dir);
    }
    if (g_world->rank() == 0) {
      EXPECT_TRUE(fs::exists(dir / "latest")) << what;
      EXPECT_TRUE(fs::exists(dir / "step-2" / "adapter_model.safetensors")) << what;
      EXPECT_TRUE(fs::exists(dir / "step-2" / fmt::format("optimizer.rank{}.bin", N - 1))) << what;
      EXPECT_FALSE(fs::exists(dir / "step-2.tmp")) << what;
      if (c.stage == planner::Stage::zero3) {
        EXPECT_TRUE(fs::exists(dir / "step-2" / fmt::format("trainable.rank{}.bin", N - 1))) << what;
      }
      EXPECT_EQ(fs::exists(dir / "step-2" / fmt::format("master.rank{}.bin", N - 1)), c.mixed) << what;
    }
    {
      Session s(plan, backend(), corpus(plan), g_world);
      s.resume(dir);
      EXPECT_EQ(s.steps_done(), 2) << what;
      for (int k = 0; k < 2; ++k) resumed.push_back(s.step().loss);
      const auto w = s.trainable_weights();
      EXPECT_TRUE(std::equal(w.begin(), w.end(), straight_adapter.begin(), straight_adapter.end())) << what << ": adapters differ";
    }
    ASSERT_EQ(resumed.size(), straight.size());
    for (std::size_t k = 0; k < straight.size(); ++k) EXPECT_EQ(resumed[k], straight[k]) << what << " step " << k;
    g_world->barrier();
    if (g_world->rank() == 0) fs::remove_all(dir);
    g_world->barrier();
  }
}

// With --staging every collective goes through the host-staging communicator over MPI's
// (communicator.h make_staging_communicator: what two ranks sharing one GPU train on), so the
// same strategies must train to the same numbers through it.
int main(int argc, char** argv) {
  bool staging = false;
  for (int i = 1; i < argc; ++i) staging = staging || std::string_view(argv[i]) == "--staging";
  if (!staging) return peftplan::testing::run_mpi_tests(argc, argv);
  return peftplan::testing::run_mpi_tests(argc, argv, [](std::unique_ptr<Communicator> mpi) {
    auto staged = make_staging_communicator(std::move(mpi), backend());
    PEFTPLAN_CHECK_MSG(staged->backend() == "mpi+staging", "--staging runs on {}", staged->backend());
    return staged;
  });
}
