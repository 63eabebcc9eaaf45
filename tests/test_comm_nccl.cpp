// The NCCL communicator (communicator.h make_nccl_communicator) at one rank, on a machine with a
// CUDA device and a build with NCCL (ctest label `device`): the cases every implementation passes
// (comm_cases.cpp) on host buffers, which it stages through device memory, and its own on device
// buffers: collectives ordered after the backend's compute stream, and 16-bit floats reduced (NCCL
// has bf16 and fp16 sums, which the MPI communicator refuses). Also the host-staging communicator
// on device buffers (StagingDevice), which needs the GPU but not NCCL. Where there is no GPU or no NCCL,
// every case skips with the reason (the refusal itself is tested in test_comm_self.cpp).
//
// NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so on a one-GPU machine this is
// the NCCL that can be checked; several ranks need a machine with a GPU per rank.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "comm_world.h"
#include "peftplan/executor/backend.h"
#include "peftplan/executor/communicator.h"

namespace {

using namespace peftplan::executor;

// Where the NCCL communicator cannot run, why (empty where it can).
std::string missing() {
  const std::string why = nccl_communicator_unavailable();
  return why.empty() ? why : "NCCL communicator: " + why;
}

// A device buffer of the backend, freed with it.
struct DeviceBuffer {
  Backend& be;
  std::uint64_t bytes;
  void* p;
  DeviceBuffer(Backend& b, std::uint64_t n) : be(b), bytes(n), p(b.device_memory().allocate(n)) {}
  ~DeviceBuffer() { be.device_memory().deallocate(p, bytes); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// bf16 as the top half of an fp32 (exact for the small integers and halves used here).
std::uint16_t bf16(float f) {
  std::uint32_t u = 0;
  std::memcpy(&u, &f, 4);
  return static_cast<std::uint16_t>(u >> 16);
}
float from_bf16(std::uint16_t h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f = 0.0f;
  std::memcpy(&f, &u, 4);
  return f;
}

// On the backend's stream: fill a large device buffer with ones, then zero it — both enqueued on
// the compute stream and not waited for — and all_reduce it out of place into a buffer that holds
// ones. At one rank the all_reduce is a copy, so the destination reads zeros only if the
// communicator's stream waited for the compute stream's work before it (the fill's length keeps
// that work running while the call is made); ones, or a mix, would mean it did not.
TEST(NcclDevice, CollectivesOnDeviceBuffersFollowTheComputeStream) {
  if (const std::string why = missing(); !why.empty()) GTEST_SKIP() << why;
  auto be = make_backend("cuda");
  auto c = make_nccl_communicator(make_self_communicator(), be->native_stream());
  EXPECT_EQ(c->backend(), "nccl");
  const std::size_t n = std::size_t{1} << 26;  // 256 MiB of fp32: zeroing it takes a while on any GPU
  DeviceBuffer src(*be, 4 * n), dst(*be, 4 * n);
  const std::vector<float> ones(n, 1.0f);
  be->copy_to_device(dst.p, ones.data(), 4 * n);
  be->copy_to_device(src.p, ones.data(), 4 * n);
  be->fill_zero(src.p, 4 * n);  // on the compute stream, not waited for here
  auto r = c->all_reduce_async(src.p, dst.p, n, CommDType::fp32, ReduceOp::sum);
  r->wait();
  EXPECT_TRUE(r->done());
  EXPECT_GE(r->seconds(), 0.0);
  std::vector<float> back(n, -1.0f);
  be->copy_to_host(back.data(), dst.p, 4 * n);
  std::size_t nonzero = 0;
  for (float v : back) nonzero += v != 0.0f;
  EXPECT_EQ(nonzero, 0u) << "the collective ran before the compute stream's fill";

  // reduce_scatter and all_gather in NCCL's in-place layouts (one rank: block 0 is the whole array).
  const std::size_t m = 4099;  // odd
  be->copy_to_device(src.p, ones.data(), 4 * m);
  c->reduce_scatter(src.p, src.p, m, CommDType::fp32);
  c->all_gather(src.p, src.p, m, CommDType::fp32);
  be->copy_to_host(back.data(), src.p, 4 * m);
  for (std::size_t i = 0; i < m; ++i) ASSERT_EQ(back[i], 1.0f) << i;
  const CommCounters k = c->counters();
  EXPECT_EQ(k[CommKind::all_reduce].calls, 1u);
  EXPECT_EQ(k[CommKind::all_reduce].bytes, 4u * n);
  EXPECT_EQ(k[CommKind::reduce_scatter].bytes, 4u * m);
  EXPECT_EQ(k[CommKind::all_gather].bytes, 4u * m);
}

// bf16 through NCCL's ncclBfloat16 (NCCL 2.10+) on the device and on staged host memory: at one
// rank a sum is the input itself, so this checks the type is carried, not the arithmetic.
TEST(NcclDevice, ReducesBf16) {
  if (const std::string why = missing(); !why.empty()) GTEST_SKIP() << why;
  auto be = make_backend("cuda");
  auto c = make_nccl_communicator(make_self_communicator(), be->native_stream());
  std::vector<std::uint16_t> h = {bf16(1.5f), bf16(-2.0f), bf16(0.5f)}, out(3, 0);
  DeviceBuffer d(*be, 2 * h.size());
  be->copy_to_device(d.p, h.data(), 2 * h.size());
  c->all_reduce(d.p, d.p, h.size(), CommDType::bf16);
  be->copy_to_host(out.data(), d.p, 2 * h.size());
  EXPECT_EQ(from_bf16(out[0]), 1.5f);
  EXPECT_EQ(from_bf16(out[1]), -2.0f);
  EXPECT_EQ(from_bf16(out[2]), 0.5f);
  std::vector<std::uint16_t> host_out(3, 0);
  c->all_reduce(h.data(), host_out.data(), h.size(), CommDType::bf16);  // staged
  EXPECT_EQ(host_out, h);
}

// Host staging (make_staging_communicator: what two ranks sharing one GPU run on) with the CUDA
// backend's copies, at one rank over the one-rank communicator: every kind's result lands in
// device memory, in NCCL's in-place layouts too, and a host scalar (the runner's loss sum) comes
// through the same copies. Needs a GPU, not NCCL.
TEST(StagingDevice, ResultsLandInDeviceMemory) {
  if (const std::string why = backend_unavailable("cuda"); !why.empty()) GTEST_SKIP() << "cuda: " << why;
  auto be = make_backend("cuda");
  auto c = make_staging_communicator(make_self_communicator(), *be);
  EXPECT_EQ(c->backend(), "self+staging");
  const std::size_t n = 1031;
  std::vector<float> h(n), back(n, -1.0f);
  for (std::size_t i = 0; i < n; ++i) h[i] = static_cast<float>(i) * 0.5f;
  DeviceBuffer src(*be, 4 * n), dst(*be, 4 * n);
  be->copy_to_device(src.p, h.data(), 4 * n);
  be->fill_zero(dst.p, 4 * n);
  c->all_reduce(src.p, dst.p, n, CommDType::fp32);
  be->copy_to_host(back.data(), dst.p, 4 * n);
  EXPECT_EQ(back, h);
  be->fill_zero(dst.p, 4 * n);
  c->all_gather(src.p, dst.p, n, CommDType::fp32);
  be->copy_to_host(back.data(), dst.p, 4 * n);
  EXPECT_EQ(back, h);
  c->reduce_scatter(src.p, src.p, n, CommDType::fp32);  // in place: block 0 is the whole array
  c->broadcast(src.p, dst.p, n, CommDType::fp32, 0);
  be->copy_to_host(back.data(), dst.p, 4 * n);
  EXPECT_EQ(back, h);
  double loss = 2.25;
  c->all_reduce(&loss, &loss, 1, CommDType::fp64);
  EXPECT_EQ(loss, 2.25);
  EXPECT_EQ(c->counters()[CommKind::all_reduce].calls, 2u);
}

}  // namespace

// The shared cases (comm_cases.cpp) on a one-rank NCCL communicator over host buffers (staged),
// with no compute stream to follow, made when the first case runs (not while ctest lists them).
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::unique_ptr<Communicator> world;
  peftplan::testing::g_world_maker = [&world]() -> Communicator* {
    peftplan::testing::g_world_missing = missing();
    if (!peftplan::testing::g_world_missing.empty()) return nullptr;
    if (!world) world = make_nccl_communicator(make_self_communicator(), nullptr);
    return world.get();
  };
  const int result = RUN_ALL_TESTS();
  peftplan::testing::g_world = nullptr;
  peftplan::testing::g_world_maker = nullptr;
  world.reset();
  return result;
}
