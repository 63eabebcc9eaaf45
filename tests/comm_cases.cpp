// The Communicator's cases, one set for every implementation (communicator.h): every collective
// (sync and async, in place, odd sizes, several dtypes) against values computed by hand for any
// rank count, the counters' bytes (nccl-tests sizes), split, the progress board, and an
// asynchronous all_reduce that completes while the calling thread computes. They run on
// peftplan::testing::g_world, which each program's main sets: test_comm.cpp's under mpirun with
// 2, 3 and 4 ranks (ctest label `mpi`), test_comm_self.cpp's on the one-rank communicator.
// Where one rank differs by design (nothing to overlap, no board), the case says so.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <memory>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include "peftplan/common/error.h"
#include "comm_world.h"
#include "peftplan/executor/communicator.h"

namespace {

using namespace peftplan;
using namespace peftplan::executor;

using peftplan::testing::g_world;  // set by the program's main (comm_world.h); every test uses it
Communicator& world() { return *g_world; }
using peftplan::testing::Comm;  // the fixture: skips with the reason where there is no communicator

// Triangular numbers: sum over ranks r of (r + 1) = n(n+1)/2; of r = n(n-1)/2.
double tri1(int n) { return n * (n + 1) / 2.0; }
double tri0(int n) { return n * (n - 1) / 2.0; }

TEST_F(Comm, AllReduceSumFp32OddCount) {
  Communicator& c = world();
  const int n = c.size(), r = c.rank();
  const std::size_t count = 1237;  // odd, not a multiple of any rank count
  std::vector<float> send(count), recv(count, -1.0f);
  for (std::size_t i = 0; i < count; ++i) send[i] = static_cast<float>(r + 1) + 0.5f * i;
  c.all_reduce(send.data(), recv.data(), count, CommDType::fp32);
  for (std::size_t i = 0; i < count; ++i)
    ASSERT_EQ(recv[i], static_cast<float>(tri1(n) + n * 0.5 * i)) << "element " << i;
}

TEST_F(Comm, AllReduceFp64InPlaceAndMaxMin) {
  Communicator& c = world();
  const int n = c.size(), r = c.rank();
  std::vector<double> x(5);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 0.25 * (r + 1) * (i + 1);
  c.all_reduce(x.data(), x.data(), x.size(), CommDType::fp64);  // in place
  for (std::size_t i = 0; i < x.size(); ++i) EXPECT_DOUBLE_EQ(x[i], 0.25 * tri1(n) * (i + 1));
  double hi = r, lo = r;
  c.all_reduce(&hi, &hi, 1, CommDType::fp64, ReduceOp::max);
  c.all_reduce(&lo, &lo, 1, CommDType::fp64, ReduceOp::min);
  EXPECT_EQ(hi, n - 1);
  EXPECT_EQ(lo, 0);
  std::int64_t big = (std::int64_t{1} << 40) + r;  // int64 sums exactly beyond 2^32
  c.all_reduce(&big, &big, 1, CommDType::int64);
  EXPECT_EQ(big, n * (std::int64_t{1} << 40) + static_cast<std::int64_t>(tri0(n)));
}

TEST_F(Comm, ReduceScatter) {
  Communicator& c = world();
  const int n = c.size(), r = c.rank();
  const std::size_t rc = 7;  // elements each rank receives
  std::vector<float> send(rc * n), recv(rc, -1.0f);
  for (std::size_t j = 0; j < send.size(); ++j) send[j] = static_cast<float>(j + r);
  c.reduce_scatter(send.data(), recv.data(), rc, CommDType::fp32);
  // Block r, element i: sum over ranks k of (r·rc + i + k) = n(r·rc + i) + n(n-1)/2.
  for (std::size_t i = 0; i < rc; ++i)
    EXPECT_EQ(recv[i], static_cast<float>(n * (r * rc + i) + tri0(n))) << "element " << i;

  // NCCL's in-place form: the result lands at block `rank` of the send buffer.
  std::vector<double> buf(rc * n);
  for (std::size_t j = 0; j < buf.size(); ++j) buf[j] = static_cast<double>(j + r);
  c.reduce_scatter(buf.data(), buf.data() + r * rc, rc, CommDType::fp64);
  for (std::size_t i = 0; i < rc; ++i)
    EXPECT_EQ(buf[r * rc + i], n * static_cast<double>(r * rc + i) + tri0(n)) << "element " << i;
}

TEST_F(Comm, AllGather) {
  Communicator& c = world();
  const int n = c.size(), r = c.rank();
  const std::size_t sc = 5;
  std::vector<float> send(sc), recv(sc * n, -1.0f);
  for (std::size_t i = 0; i < sc; ++i) send[i] = static_cast<float>(100 * r + i);
  c.all_gather(send.data(), recv.data(), sc, CommDType::fp32);
  for (int k = 0; k < n; ++k)
    for (std::size_t i = 0; i < sc; ++i)
      EXPECT_EQ(recv[k * sc + i], static_cast<float>(100 * k + i));

  // In place: this rank's block already sits at its slot. bf16 travels as raw bits.
  std::vector<std::uint16_t> bits(sc * n, 0);
  for (std::size_t i = 0; i < sc; ++i) bits[r * sc + i] = static_cast<std::uint16_t>(0x3f80 + 16 * r + i);
  c.all_gather(bits.data() + r * sc, bits.data(), sc, CommDType::bf16);
  for (int k = 0; k < n; ++k)
    for (std::size_t i = 0; i < sc; ++i) EXPECT_EQ(bits[k * sc + i], 0x3f80 + 16 * k + i);
}

TEST_F(Comm, Broadcast) {
  Communicator& c = world();
  const int n = c.size(), r = c.rank(), root = n - 1;
  std::vector<std::int32_t> send(11, r == root ? 42 : -7), recv(11, 0);
  c.broadcast(send.data(), recv.data(), send.size(), CommDType::int32, root);
  for (auto v : recv) EXPECT_EQ(v, 42);
  std::vector<double> x(3, r == 0 ? 2.5 : 0.0);
  c.broadcast(x.data(), x.data(), x.size(), CommDType::fp64, 0);  // in place
  for (auto v : x) EXPECT_EQ(v, 2.5);
}

TEST_F(Comm, AsyncOperationsCompleteInCallOrder) {
  Communicator& c = world();
  const int n = c.size(), r = c.rank();
  std::vector<float> a(1001, static_cast<float>(r)), b(3 * n, 1.0f), g(2 * n);
  std::vector<float> b_out(3);
  const float mine[2] = {static_cast<float>(r), static_cast<float>(-r)};
  auto ra = c.all_reduce_async(a.data(), a.data(), a.size(), CommDType::fp32, ReduceOp::sum);
  auto rb = c.reduce_scatter_async(b.data(), b_out.data(), 3, CommDType::fp32, ReduceOp::sum);
  auto rg = c.all_gather_async(mine, g.data(), 2, CommDType::fp32);
  auto rbar = c.barrier_async();
  rbar->wait();  // the queue runs in order: everything before the barrier is done
  EXPECT_TRUE(ra->done());
  EXPECT_TRUE(rb->done());
  EXPECT_TRUE(rg->done());
  rg->wait();
  rb->wait();
  ra->wait();
  for (float v : a) EXPECT_EQ(v, static_cast<float>(tri0(n)));
  for (float v : b_out) EXPECT_EQ(v, static_cast<float>(n));
  for (int k = 0; k < n; ++k) {
    EXPECT_EQ(g[2 * k], static_cast<float>(k));
    EXPECT_EQ(g[2 * k + 1], static_cast<float>(-k));
  }
}

TEST_F(Comm, CountersUseNcclTestsSizes) {
  Communicator& c = world();
  const int n = c.size();
  c.barrier();
  c.reset_counters();
  std::vector<float> f(10 * n, 1.0f), fo(10 * n);
  std::vector<double> d(3 * n, 1.0), dout(3);
  std::vector<std::int32_t> bi(6, 1);
  c.all_reduce(f.data(), fo.data(), 10, CommDType::fp32);
  c.reduce_scatter(d.data(), dout.data(), 3, CommDType::fp64);
  c.all_gather(f.data(), fo.data(), 4, CommDType::fp32);
  c.broadcast(bi.data(), bi.data(), 6, CommDType::int32, 0);
  c.barrier();
  const CommCounters k = c.counters();
  // nccl-tests doc/PERFORMANCE.md: all_reduce/broadcast size = the buffer; reduce_scatter and
  // all_gather size = the whole array (shard × ranks).
  EXPECT_EQ(k[CommKind::all_reduce].bytes, 10u * 4);
  EXPECT_EQ(k[CommKind::reduce_scatter].bytes, 3u * 8 * n);
  EXPECT_EQ(k[CommKind::all_gather].bytes, 4u * 4 * n);
  EXPECT_EQ(k[CommKind::broadcast].bytes, 6u * 4);
  EXPECT_EQ(k[CommKind::barrier].bytes, 0u);
  for (const CommCounter& one : k.by_kind) {
    EXPECT_EQ(one.calls, 1u);
    if (n > 1)
      EXPECT_GT(one.seconds, 0.0);
    else
      EXPECT_GE(one.seconds, 0.0);  // one rank's barrier does nothing: its time may read 0
  }
  c.reset_counters();
  EXPECT_EQ(c.counters()[CommKind::all_reduce].calls, 0u);
}

TEST_F(Comm, SplitMakesIndependentGroups) {
  Communicator& c = world();
  const int n = c.size(), r = c.rank();
  auto half = c.split(r % 2, r);
  ASSERT_NE(half, nullptr);
  EXPECT_EQ(half->size(), (n + 1 - r % 2) / 2);
  EXPECT_EQ(half->rank(), r / 2);
  int v = r;
  half->all_reduce(&v, &v, 1, CommDType::int32);
  int expect = 0;
  for (int k = r % 2; k < n; k += 2) expect += k;
  EXPECT_EQ(v, expect);
  auto none = c.split(r == 0 ? 0 : -1, r);  // only rank 0 takes part
  EXPECT_EQ(none != nullptr, r == 0);
  if (none) {
    EXPECT_EQ(none->size(), 1);
  }
}

// The progress board (the watchdog's source for naming a stalled rank): every rank on the node
// sees every other rank's latest post, with its age; nothing is posted before the first post.
TEST_F(Comm, ProgressBoardShowsEveryRanksLastPost) {
  Communicator& c = world();
  ProgressBoard* b = c.progress();
  if (c.size() == 1) {
    EXPECT_EQ(b, nullptr) << "one rank has no peer to name: no board (communicator.h)";
    return;
  }
  ASSERT_NE(b, nullptr) << "ranks on one node share a board";
  const int r = c.rank();
  b->post(7, 100 + r);
  c.barrier();
  for (int peer = 0; peer < c.size(); ++peer) {
    const ProgressBoard::Position p = b->position(peer);
    ASSERT_TRUE(p.known) << "rank " << peer;
    EXPECT_EQ(p.step, 7);
    EXPECT_EQ(p.op, 100 + peer);
    EXPECT_GE(p.age_s, 0.0);
    EXPECT_LT(p.age_s, 60.0);
  }
  EXPECT_FALSE(b->position(c.size()).known);  // not a rank
  EXPECT_FALSE(b->position(-1).known);
  c.barrier();
  b->post(8, r == 0 ? 5 : 9);  // later posts replace earlier ones
  c.barrier();
  EXPECT_EQ(b->position(0).step, 8);
  EXPECT_EQ(b->position(0).op, 5);
  c.barrier();  // nobody posts again before every rank has read
}

TEST_F(Comm, BadArgumentsAreRefusedBeforeMpi) {
  std::uint16_t h[2] = {0, 0};
  // MPI has no 16-bit float type to reduce: bf16 sums are an operation of our own, nothing else
  // (and the one-rank communicator refuses what MPI's does); NCCL has ncclBfloat16 and
  // ncclFloat16 (test_comm_nccl.cpp reduces them).
  if (world().backend() != "nccl") {
    EXPECT_THROW(world().all_reduce(h, h, 2, CommDType::fp16), InternalError);
    EXPECT_THROW(world().all_reduce(h, h, 2, CommDType::bf16, ReduceOp::max), InternalError);
  }
  EXPECT_THROW(world().broadcast(h, h, 2, CommDType::fp16, world().size()), InternalError);
}

// bf16 sums (the gradients of a bf16 mixed-precision program): each rank's values are small
// integers and halves, exact in bf16 and in every partial sum, so the result is exact whatever
// order the reduction takes. (The rounding itself is the backend's conversion, tested there.)
TEST_F(Comm, Bf16SumsWidenAddAndRound) {
  Communicator& c = world();
  const int n = c.size(), r = c.rank();
  auto bf = [](float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<std::uint16_t>(u >> 16);  // exact for the values used here
  };
  auto fl = [](std::uint16_t h) {
    const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  std::vector<std::uint16_t> a = {bf(1.5f), bf(static_cast<float>(r)), bf(-0.5f)};
  c.all_reduce(a.data(), a.data(), a.size(), CommDType::bf16);
  EXPECT_EQ(fl(a[0]), 1.5f * static_cast<float>(n));
  EXPECT_EQ(fl(a[1]), static_cast<float>(tri0(n)));
  EXPECT_EQ(fl(a[2]), -0.5f * static_cast<float>(n));
  std::vector<std::uint16_t> s(2 * static_cast<std::size_t>(n));
  for (std::size_t j = 0; j < s.size(); ++j) s[j] = bf(static_cast<float>(j) + 0.5f * static_cast<float>(r));
  std::vector<std::uint16_t> got(2);
  c.reduce_scatter(s.data(), got.data(), 2, CommDType::bf16);
  for (std::size_t i = 0; i < 2; ++i)
    EXPECT_EQ(fl(got[i]), static_cast<float>(n) * static_cast<float>(2 * r + static_cast<int>(i)) + 0.5f * static_cast<float>(tri0(n)))
        << "element " << i;
  // Sums bf16 must round (values with all 8 significand bits set, differing per rank): every rank
  // gets the same bits (DDP's replicas step their own copies from them, so they must agree), and
  // each is the exact sum within the rounding of the n − 1 additions, 2⁻⁸ relative each.
  const std::size_t m = 64;
  std::vector<std::uint16_t> x(m);
  std::vector<double> exact(m, 0.0);
  for (std::size_t j = 0; j < m; ++j) {
    for (int k = 0; k < n; ++k) exact[j] += fl(bf(1.0f + 127.0f / 128.0f * static_cast<float>((j + 3 * static_cast<std::size_t>(k)) % 7) / 7.0f));
    x[j] = bf(1.0f + 127.0f / 128.0f * static_cast<float>((j + 3 * static_cast<std::size_t>(r)) % 7) / 7.0f);
  }
  c.all_reduce(x.data(), x.data(), m, CommDType::bf16);
  std::vector<std::uint16_t> all(m * static_cast<std::size_t>(n));
  c.all_gather(x.data(), all.data(), m, CommDType::bf16);
  for (int k = 0; k < n; ++k)
    for (std::size_t j = 0; j < m; ++j) EXPECT_EQ(all[static_cast<std::size_t>(k) * m + j], x[j]) << "rank " << k << " element " << j;
  for (std::size_t j = 0; j < m; ++j) EXPECT_NEAR(fl(x[j]), exact[j], std::ldexp(exact[j], -8) * (n - 1) + 1e-12) << "element " << j;
}

}  // namespace
