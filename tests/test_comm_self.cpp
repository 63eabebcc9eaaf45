// The one-rank Communicator (communicator.h make_self_communicator): the cases every
// implementation passes (comm_cases.cpp) at one rank, without mpirun and in builds without MPI,
// and what is particular to it: rank 0 of 1, operations complete before their async form
// returns, a copy from send to recv that leaves the rest of recv alone, and split's one-rank
// communicators counting apart.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "comm_world.h"
#include "peftplan/common/error.h"
#include "peftplan/executor/communicator.h"

namespace {

using namespace peftplan::executor;

TEST(SelfComm, OneRankNamedSelf) {
  auto c = make_self_communicator();
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->backend(), "self");
  EXPECT_EQ(c->progress(), nullptr);
}

// Nothing waits on a peer: the request is complete when the call returns, its time known.
TEST(SelfComm, AsyncOperationsAreDoneOnReturn) {
  auto c = make_self_communicator();
  std::vector<float> x(257, 3.0f), y(257, 0.0f);
  auto r = c->all_reduce_async(x.data(), y.data(), x.size(), CommDType::fp32, ReduceOp::sum);
  EXPECT_TRUE(r->done());
  EXPECT_GE(r->seconds(), 0.0);
  r->wait();
  EXPECT_EQ(y.front(), 3.0f);
  EXPECT_EQ(y.back(), 3.0f);
  EXPECT_TRUE(c->barrier_async()->done());
}

// An out-of-place collective writes exactly its count of elements: one rank's result is its own
// send buffer, and recv beyond it is untouched.
TEST(SelfComm, CopiesExactlyTheCountAndNothingInPlace) {
  auto c = make_self_communicator();
  const std::vector<std::int64_t> send = {1, 2, 3, 4};
  std::vector<std::int64_t> recv(6, -1);
  c->reduce_scatter(send.data(), recv.data(), 3, CommDType::int64);
  EXPECT_EQ(recv, (std::vector<std::int64_t>{1, 2, 3, -1, -1, -1}));
  c->all_gather(send.data(), recv.data() + 2, 4, CommDType::int64);
  EXPECT_EQ(recv, (std::vector<std::int64_t>{1, 2, 1, 2, 3, 4}));
  std::vector<std::uint8_t> bytes = {7, 8, 9};
  c->broadcast(bytes.data(), bytes.data(), bytes.size(), CommDType::uint8, 0);  // in place
  EXPECT_EQ(bytes, (std::vector<std::uint8_t>{7, 8, 9}));
}

TEST(SelfComm, SplitGivesOneRankCommunicatorsWithTheirOwnCounters) {
  auto c = make_self_communicator();
  EXPECT_EQ(c->split(-1, 0), nullptr);
  auto sub = c->split(3, 5);
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->rank(), 0);
  EXPECT_EQ(sub->size(), 1);
  double v = 2.0;
  sub->all_reduce(&v, &v, 1, CommDType::fp64);
  EXPECT_EQ(sub->counters()[CommKind::all_reduce].calls, 1u);
  EXPECT_EQ(sub->counters()[CommKind::all_reduce].bytes, 8u);
  EXPECT_EQ(c->counters()[CommKind::all_reduce].calls, 0u);
}

// The NCCL communicator's factory (communicator.h): made where this build has NCCL and the
// machine a CUDA device, otherwise refused as bad input with the reason nccl_communicator_
// unavailable() gives — what peftplan-exec prints for a GPU job of several ranks without it.
TEST(NcclFactory, MadeWhereAvailableOrRefusedWithTheReason) {
  const std::string why = nccl_communicator_unavailable();
  if (why.empty()) {
    auto c = make_nccl_communicator(make_self_communicator(), nullptr);
    EXPECT_EQ(c->backend(), "nccl");
    EXPECT_EQ(c->size(), 1);
    return;
  }
  try {
    (void)make_nccl_communicator(make_self_communicator(), nullptr);
    ADD_FAILURE() << "made an NCCL communicator although: " << why;
  } catch (const peftplan::InputError& e) {
    EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
  }
}

}  // namespace

// The shared cases (comm_cases.cpp) run on one one-rank communicator, as test_comm's run on MPI's.
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto world = make_self_communicator();
  peftplan::testing::g_world = world.get();
  const int result = RUN_ALL_TESTS();
  peftplan::testing::g_world = nullptr;
  return result;
}
