// sim::verify, the step program's structural contract (sim/verify.h): every program the builder
// makes, for every strategy, profile, offload, checkpointing and quantisation it supports, with
// names on and off, is well-formed; and a program broken by hand in one way is rejected with the
// rule it breaks, one test per rule.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "peftplan/common/error.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/launcher_config.h"
#include "peftplan/planner/plan_file.h"
#include "peftplan/planner/program.h"
#include "peftplan/sim/cluster.h"
#include "peftplan/sim/ops.h"
#include "peftplan/sim/verify.h"

using namespace peftplan;
using namespace peftplan::planner;
using sim::Collective;
using sim::CopyDir;
using sim::Kernel;
using sim::MemCategory;
using sim::Op;
using sim::OpKind;
using sim::Phase;
using sim::Program;
using sim::Rule;
using sim::Stream;
using ::testing::HasSubstr;

namespace {

models::PeftSpec lora(std::int64_t r) {
  models::AdapterSpec a;
  a.lora.r = r;
  a.lora.alpha = 2.0 * static_cast<double>(r);
  a.lora.targets.kind = models::ModuleSelector::Kind::list;
  a.lora.targets.names = {"q_proj", "v_proj"};
  return models::PeftSpec{{a}, std::nullopt};
}

std::vector<Rule> rules_of(const Program& p) {
  std::vector<Rule> out;
  for (const auto& v : sim::verify(p)) out.push_back(v.rule);
  return out;
}

// A small well-formed program: a setup weight, a step buffer used by a compute op and a
// collective, a host buffer a copy fills, a view inside the weight.
struct Hand {
  Program p;
  std::int32_t weight = -1, act = -1, host = -1, view = -1, compute = -1;
  Hand() {
    p.ranks = 2;
    weight = p.add_buffer("w", MemCategory::base_weights, 1024);
    act = p.add_buffer("a", MemCategory::activations, 512);
    host = p.add_buffer("h", MemCategory::host_other, 512);
    view = p.add_view("w[0:256]", weight, 0, 256);
    p.add_op(alloc(weight, Phase::setup));
    p.add_op(alloc(host, Phase::setup));
    p.add_op(alloc(act, Phase::forward));
    Op c;
    c.kind = OpKind::compute;
    sim::ops::emit(p, c, sim::ops::LinearFwd{.x = view, .w = act});
    compute = p.add_op(c);
    Op ar;
    ar.kind = OpKind::collective;
    ar.stream = Stream::comm;
    ar.collective = Collective::all_gather;
    ar.group_size = 2;
    ar.bytes = 512;
    ar.buffer = act;
    p.add_op(ar, {compute});
    Op cp;
    cp.kind = OpKind::copy;
    cp.stream = Stream::copy;
    cp.copy_dir = CopyDir::device_to_host;
    cp.bytes = 512;
    cp.buffer = act;
    cp.buffer_out = host;
    p.add_op(cp, {compute});
    p.add_op(free(act, Phase::forward));
  }
  static Op alloc(std::int32_t b, Phase ph) {
    Op o;
    o.kind = OpKind::alloc;
    o.phase = ph;
    o.buffer = b;
    return o;
  }
  static Op free(std::int32_t b, Phase ph) {
    Op o = alloc(b, ph);
    o.kind = OpKind::free;
    return o;
  }
};


// Every strategy, profile, offload, checkpointing and quantisation the builder supports.
std::vector<PlanInput> every_kind_of_input() {
  struct Case {
    Stage stage;
    std::int32_t ranks;
    RuntimeProfile profile;
    OffloadDevice opt = OffloadDevice::none, param = OffloadDevice::none;
    Checkpointing ckpt = Checkpointing::none;
    bool quant = false, full = false;
    std::int64_t accum = 1;
    std::int32_t fsdp_version = 1;
  };
  const std::vector<Case> cases = {
      {Stage::ddp, 1, RuntimeProfile::executor},
      {Stage::ddp, 2, RuntimeProfile::executor, OffloadDevice::none, OffloadDevice::none, Checkpointing::full, false, false, 2},
      {Stage::zero1, 2, RuntimeProfile::executor},
      {Stage::zero2, 2, RuntimeProfile::executor, OffloadDevice::cpu},
      {Stage::zero3, 2, RuntimeProfile::executor},
      {Stage::zero3, 2, RuntimeProfile::executor, OffloadDevice::cpu, OffloadDevice::cpu, Checkpointing::full},
      {Stage::zero3, 4, RuntimeProfile::executor, OffloadDevice::none, OffloadDevice::none, Checkpointing::none, false, true},
      {Stage::ddp, 8, RuntimeProfile::deepspeed},
      {Stage::zero2, 8, RuntimeProfile::deepspeed, OffloadDevice::cpu, OffloadDevice::none, Checkpointing::every_k},
      {Stage::zero3, 8, RuntimeProfile::deepspeed, OffloadDevice::cpu, OffloadDevice::cpu, Checkpointing::full},
      {Stage::zero3, 8, RuntimeProfile::deepspeed, OffloadDevice::none, OffloadDevice::none, Checkpointing::none, true},
      {Stage::ddp, 1, RuntimeProfile::hf, OffloadDevice::none, OffloadDevice::none, Checkpointing::full, true},
      {Stage::ddp, 2, RuntimeProfile::hf, OffloadDevice::none, OffloadDevice::none, Checkpointing::none, false, true},
      {Stage::fsdp_full_shard, 2, RuntimeProfile::hf, OffloadDevice::none, OffloadDevice::none, Checkpointing::full},
      {Stage::fsdp_full_shard, 2, RuntimeProfile::hf, OffloadDevice::none, OffloadDevice::none, Checkpointing::full, true},
      {Stage::fsdp_full_shard, 8, RuntimeProfile::hf, OffloadDevice::none, OffloadDevice::cpu},
      {Stage::fsdp_shard_grad_op, 8, RuntimeProfile::hf, OffloadDevice::none, OffloadDevice::none, Checkpointing::full, false, true},
      {Stage::fsdp_no_shard, 4, RuntimeProfile::hf},
      {Stage::fsdp_hybrid_shard, 16, RuntimeProfile::hf},
      {Stage::fsdp_full_shard, 8, RuntimeProfile::hf, OffloadDevice::none, OffloadDevice::none, Checkpointing::full, false, false, 2, 2},
      {Stage::fsdp_full_shard, 2, RuntimeProfile::hf, OffloadDevice::none, OffloadDevice::none, Checkpointing::full, true, false, 1, 2},
      {Stage::fsdp_shard_grad_op, 4, RuntimeProfile::hf, OffloadDevice::none, OffloadDevice::none, Checkpointing::none, false, true, 1, 2},
  };
  std::vector<PlanInput> out;
  for (const Case& c : cases) {
    PlanInput in;
    in.model = models::load_model(c.profile == RuntimeProfile::executor ? "tiny-llama-2l" : "llama-2-7b");
    if (!c.full) in.peft = lora(c.profile == RuntimeProfile::executor ? 4 : 16);
    if (c.quant) in.peft.quantization = models::Quantization{};
    in.training.micro_batch = 2;
    in.training.seq_len = c.profile == RuntimeProfile::executor ? 8 : 512;
    in.training.grad_accum = c.accum;
    in.training.checkpointing = c.ckpt;
    in.training.checkpoint_every = 2;
    if (c.profile == RuntimeProfile::executor) {
      in.training.precision = Precision::fp32;
      in.training.attention = Attention::eager;
    }
    in.strategy.stage = c.stage;
    in.strategy.ranks = c.ranks;
    in.strategy.offload_optimizer = c.opt;
    in.strategy.offload_param = c.param;
    if (c.stage == Stage::fsdp_hybrid_shard) in.strategy.shard_group = 8;
    in.strategy.fsdp.version = c.fsdp_version;
    if (is_fsdp(c.stage) && c.ckpt == Checkpointing::full && c.quant) {  // FSDP's own checkpoint_wrapper
      in.strategy.fsdp.activation_checkpointing = true;
      in.training.checkpoint_reentrant = false;
    }
    in.profile = c.profile;
    out.push_back(std::move(in));
  }
  return out;
}

std::string describe(const PlanInput& in) {
  return fmt::format("{} v{} x{} profile {} opt {} param {} ckpt {} quant {} full {}", name_of(in.strategy.stage), in.strategy.fsdp.version, in.strategy.ranks,
                     name_of(in.profile), name_of(in.strategy.offload_optimizer), name_of(in.strategy.offload_param),
                     name_of(in.training.checkpointing), in.peft.quantization.has_value(), in.peft.adapters.empty());
}

}  // namespace

TEST(Verify, TheHandProgramIsWellFormed) { EXPECT_TRUE(sim::verify(Hand().p).empty()); }

TEST(Verify, EveryBuiltProgramIsWellFormedWithNamesOnAndOff) {
  for (const PlanInput& in : every_kind_of_input())
    for (bool names : {true, false}) {
      SCOPED_TRACE(describe(in) + fmt::format(" names {}", names));
      const auto built = build_program(in, {.names = names});
      // The executor's LoRA programs are executable: their operand slots and sizes are checked too.
      EXPECT_EQ(built.program.executable, in.profile == RuntimeProfile::executor && !in.peft.adapters.empty());
      const auto v = sim::verify(built.program);
      EXPECT_TRUE(v.empty()) << (v.empty() ? "" : fmt::format("{} at op {}: {}", name_of(v[0].rule), v[0].op, v[0].detail));
    }
}

// plan.json carries everything the program depends on: written and read back, every kind of
// input builds the program the writer hashed (sim/program_hash.h), QLoRA's quantisation, FSDP's
// accelerate config and a non-reentrant checkpoint included.
TEST(PlanFile, EveryKindOfInputReadsBackToTheProgramItsWriterBuilt) {
  for (const PlanInput& in : every_kind_of_input()) {
    SCOPED_TRACE(describe(in));
    PlanFile pf;
    pf.input = in;
    pf.cluster = sim::resolve_cluster(in.strategy.stage == Stage::fsdp_hybrid_shard ? "2x8xH100-SXM-NDR" : "8xH100-SXM");
    const nlohmann::json j = plan_file_to_json(pf);
    const PlanFile back = plan_file_from_json(j, "plan.json");
    EXPECT_EQ(back.program_hash, j.at("program").at("hash").get<std::string>());
    EXPECT_NO_THROW(check_program_hash(back, "plan.json"));
    EXPECT_EQ(back.input.peft.quantization.has_value(), in.peft.quantization.has_value());
    EXPECT_EQ(back.input.strategy.stage, in.strategy.stage);
    // the launcher's own file: accelerate's YAML for what accelerate launches alone (FSDP, hf DDP)
    EXPECT_EQ(j.contains("accelerate_config"), !launches_with_deepspeed(in));
    EXPECT_EQ(j.contains("accelerate_config"), is_fsdp(in.strategy.stage) || in.profile == RuntimeProfile::hf);
  }
}

TEST(Verify, RejectsAnUnknownBuffer) {
  Hand h;
  sim::ops::value(h.p, h.p.ops[static_cast<std::size_t>(h.compute)], 5) = 99;  // LinearFwd::y (after M, K, N, x, w)
  EXPECT_THAT(rules_of(h.p), ::testing::ElementsAre(Rule::buffer_id));
}

TEST(Verify, RejectsAViewPastItsParent) {
  Hand h;
  h.p.buffers[static_cast<std::size_t>(h.view)].offset = 900;  // 900 + 256 > 1024
  EXPECT_THAT(rules_of(h.p), ::testing::ElementsAre(Rule::view_bounds));
}

TEST(Verify, RejectsAnAllocOfAView) {
  Hand h;
  h.p.add_op(Hand::alloc(h.view, Phase::backward));
  EXPECT_THAT(rules_of(h.p), ::testing::ElementsAre(Rule::view_alloc));
}

TEST(Verify, RejectsADoubleAlloc) {
  Hand h;
  h.p.add_op(Hand::alloc(h.weight, Phase::backward));  // the setup weight is live all step
  EXPECT_THAT(rules_of(h.p), ::testing::ElementsAre(Rule::double_alloc));
}

TEST(Verify, RejectsAFreeOfWhatIsNotLive) {
  Hand h;
  h.p.add_op(Hand::free(h.act, Phase::backward));  // freed at the end of forward already
  EXPECT_THAT(rules_of(h.p), ::testing::ElementsAre(Rule::free_not_live));
}

TEST(Verify, RejectsAUseOfWhatIsNotLiveAndSaysWhichParent) {
  Hand h;
  Op c;
  c.kind = OpKind::compute;
  sim::ops::emit(h.p, c, sim::ops::LinearBwdData{.dy = h.act});  // freed
  h.p.add_op(c);
  EXPECT_THAT(rules_of(h.p), ::testing::ElementsAre(Rule::use_not_live));
  Hand g;
  g.p.add_op(Hand::free(g.weight, Phase::optimizer));
  Op d = c;
  sim::ops::emit(g.p, d, sim::ops::LinearBwdData{.dy = g.view});  // a view of the freed weight
  g.p.add_op(d);
  const auto v = sim::verify(g.p);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].rule, Rule::use_not_live);
  EXPECT_THAT(v[0].detail, HasSubstr("its parent buffer #0 (w) is not"));
}

TEST(Verify, RejectsADependencyOnALaterOp) {
  Hand h;
  h.p.deps[h.p.ops[4].deps_begin] = 6;  // the all_gather (op 4) waits for op 6
  EXPECT_THAT(rules_of(h.p), ::testing::ElementsAre(Rule::dep_order));
}

TEST(Verify, RejectsAComputeOpWithoutAKernel) {
  Hand h;
  h.p.ops[static_cast<std::size_t>(h.compute)].kernel = Kernel::none;
  EXPECT_THAT(rules_of(h.p), ::testing::ElementsAre(Rule::kernel_none));
}

TEST(Verify, RejectsACollectiveItsGroupCannotSplit) {
  Hand h;
  h.p.ops[4].bytes = 511;  // an all_gather over 2 ranks of an odd total
  EXPECT_THAT(rules_of(h.p), ::testing::ElementsAre(Rule::collective_group));
  Hand g;
  g.p.ops[4].group_size = 0;
  EXPECT_THAT(rules_of(g.p), ::testing::ElementsAre(Rule::collective_group));
}

TEST(Verify, RejectsACopyTheWrongWayRound) {
  Hand h;
  h.p.ops[5].copy_dir = CopyDir::host_to_device;  // from the device buffer into the host one
  EXPECT_THAT(rules_of(h.p), ::testing::ElementsAre(Rule::copy_direction));
  Hand g;
  g.p.ops[5].buffer_out = g.view;  // device-to-host into a device buffer
  EXPECT_THAT(rules_of(g.p), ::testing::ElementsAre(Rule::copy_direction));
}

TEST(Verify, RejectsASetupOpInsideTheStep) {
  Hand h;
  const std::int32_t late = h.p.add_buffer("late", MemCategory::optimizer_states, 64);
  h.p.add_op(Hand::alloc(late, Phase::setup));
  EXPECT_THAT(rules_of(h.p), ::testing::ElementsAre(Rule::setup_order));
}

TEST(Verify, RejectsAllocationPiecesThatDoNotTileTheirBuffer) {
  Hand h;
  h.p.buffers[static_cast<std::size_t>(h.weight)].pieces = {512, 256};  // the weight has 1024 B
  EXPECT_THAT(rules_of(h.p), ::testing::ElementsAre(Rule::pieces));
  Hand g;
  g.p.buffers[static_cast<std::size_t>(g.view)].pieces = {256};  // a view allocates nothing
  EXPECT_THAT(rules_of(g.p), ::testing::ElementsAre(Rule::pieces));
  Hand ok;
  ok.p.buffers[static_cast<std::size_t>(ok.weight)].pieces = {512, 256, 256};
  EXPECT_TRUE(sim::verify(ok.p).empty());
}

TEST(Verify, ThrowsNamingTheRuleAndTheOp) {
  Hand h;
  h.p.ops[static_cast<std::size_t>(h.compute)].kernel = Kernel::none;
  try {
    sim::verify_or_throw(h.p);
    FAIL() << "no throw";
  } catch (const InternalError& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("kernel_none at op 3"));
  }
  EXPECT_NO_THROW(sim::verify_or_throw(Hand().p));
}

// An executable program: tiny-llama-2l LoRA on q,v under the executor profile, two ranks of DDP.
Program executable_program(Stage stage = Stage::ddp, std::int32_t ranks = 2) {
  PlanInput in;
  in.model = models::load_model("tiny-llama-2l");
  in.peft = lora(4);
  in.training.micro_batch = 2;
  in.training.seq_len = 8;
  in.training.precision = Precision::fp32;
  in.training.attention = Attention::eager;
  in.profile = RuntimeProfile::executor;
  in.strategy.stage = stage;
  in.strategy.ranks = ranks;
  Program p = build_program(in, {.names = false}).program;
  EXPECT_TRUE(p.executable);
  EXPECT_TRUE(sim::verify(p).empty());
  return p;
}

std::int32_t first_op(const Program& p, Kernel k) {
  for (std::size_t i = 0; i < p.ops.size(); ++i)
    if (p.ops[i].kind == OpKind::compute && p.ops[i].kernel == k) return static_cast<std::int32_t>(i);
  ADD_FAILURE() << "no " << sim::name_of(k);
  return 0;
}

TEST(Verify, RejectsAnExecutableOpWithARequiredSlotEmpty) {
  Program p = executable_program();
  Op& op = p.ops[static_cast<std::size_t>(first_op(p, Kernel::linear_fwd))];
  sim::ops::value(p, op, 4) = -1;  // LinearFwd::w (after M, K, N, x)
  const auto v = sim::verify(p);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].rule, Rule::operand_missing);
  EXPECT_THAT(v[0].detail, HasSubstr("slot 1 (w)"));
  // The optional bias may stay empty; a cost-only program may leave any slot empty.
  Program q = executable_program();
  q.executable = false;
  sim::ops::value(q, q.ops[static_cast<std::size_t>(first_op(q, Kernel::linear_fwd))], 4) = -1;
  EXPECT_TRUE(sim::verify(q).empty());
}

// A wrong size in the builder is caught where both interpreters look, before either runs: the
// attention's saved probabilities one element short of B·nh·S·S (the memory walk and the
// executor would agree with each other on the wrong size; the shape does not).
TEST(Verify, RejectsAnOperandWhoseSizeTheShapeDoesNotGive) {
  Program p = executable_program();
  const std::int32_t a = first_op(p, Kernel::attention_fwd);
  const auto att = sim::ops::read<sim::ops::AttentionFwd>(p, p.ops[static_cast<std::size_t>(a)]);
  p.buffers[static_cast<std::size_t>(att.probs)].bytes -= 4;
  const auto v = sim::verify(p);
  ASSERT_FALSE(v.empty());
  EXPECT_EQ(v[0].rule, Rule::operand_size);
  EXPECT_EQ(v[0].op, a);
  EXPECT_THAT(v[0].detail, HasSubstr("slot 3 (P)"));
  // So does a shape that disagrees with its buffers: LoRA's rank one too large.
  Program q = executable_program();
  Op& lo = q.ops[static_cast<std::size_t>(first_op(q, Kernel::lora_fwd))];
  ++sim::ops::value(q, lo, 3);  // LoraFwd::r (M, K, N, r)
  const auto w = sim::verify(q);
  ASSERT_FALSE(w.empty());
  EXPECT_EQ(w[0].rule, Rule::operand_size);
  EXPECT_THAT(w[0].detail, HasSubstr("(A)"));
}

TEST(Verify, RejectsAScalarReductionThatIsNotOneAndAnUnnamedCollective) {
  Hand h;
  Op ar;
  ar.kind = OpKind::collective;
  ar.stream = Stream::comm;
  ar.phase = Phase::optimizer;
  ar.collective = Collective::all_reduce;
  ar.group_size = 2;
  ar.bytes = 16;  // two doubles: not a scalar
  ar.reduction = sim::ScalarReduction::loss_sum;
  h.p.add_op(ar);
  EXPECT_THAT(rules_of(h.p), ::testing::ElementsAre(Rule::scalar_reduction));
  // In an executable program every collective of no buffer says what scalar it sums.
  Program p = executable_program();
  bool found = false;
  for (Op& op : p.ops)
    if (op.kind == OpKind::collective && op.reduction == sim::ScalarReduction::loss_sum) {
      op.reduction = sim::ScalarReduction::none;
      found = true;
    }
  ASSERT_TRUE(found);
  EXPECT_THAT(rules_of(p), ::testing::ElementsAre(Rule::scalar_reduction));
}

TEST(Verify, RejectsAStateRoleHeldTwiceAndATensorRoleWithoutItsIndex) {
  Hand h;
  h.p.buffers[static_cast<std::size_t>(h.weight)].role = sim::BufferRole::trainable_flat;
  h.p.buffers[static_cast<std::size_t>(h.act)].role = sim::BufferRole::trainable_flat;
  EXPECT_THAT(rules_of(h.p), ::testing::ElementsAre(Rule::buffer_role));
  Hand g;
  g.p.buffers[static_cast<std::size_t>(g.view)].role = sim::BufferRole::base_tensor;  // tensor -1
  EXPECT_THAT(rules_of(g.p), ::testing::ElementsAre(Rule::buffer_role));
}

// The operand structs write and read the same op: every slot, dim, scalar and parameter.
TEST(Ops, EmitThenReadIsTheIdentity) {
  Program p;
  Op op;
  sim::ops::emit(p, op, sim::ops::LoraBwd{.dy = 1, .x_in = 2, .a = 3, .b = 4, .u = 5, .scratch = 6, .dx = -1, .da = 8, .db = 9,
                                       .M = 16, .K = 32, .N = 48, .r = 4, .scale = 2.0, .p = 0.1, .adapter = 7});
  EXPECT_EQ(op.kernel, Kernel::lora_bwd);
  op.kind = OpKind::compute;
  const auto o = sim::ops::read<sim::ops::LoraBwd>(p, op);
  EXPECT_EQ(o.dy, 1);
  EXPECT_EQ(o.scratch, 6);
  EXPECT_EQ(o.dx, -1);
  EXPECT_EQ(o.db, 9);
  EXPECT_EQ(o.K, 32);
  EXPECT_EQ(o.r, 4);
  EXPECT_DOUBLE_EQ(o.scale, 2.0);
  EXPECT_DOUBLE_EQ(o.p, 0.1);
  EXPECT_EQ(o.adapter, 7);
  EXPECT_THROW(sim::ops::read<sim::ops::LoraFwd>(p, op), InternalError);  // another kernel's struct
  std::vector<std::string> names;
  sim::ops::for_each_slot(p, op, [&](std::size_t, std::int32_t, const sim::ops::SlotSpec& s) { names.emplace_back(s.name); });
  EXPECT_THAT(names, ::testing::ElementsAre("dy", "x_in", "A", "B", "u", "scratch", "dx", "dA", "dB"));
}
