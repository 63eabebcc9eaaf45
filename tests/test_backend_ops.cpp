// Every Backend method (executor/backend.h) on every backend this build has (backend_names()),
// against plain double-precision loops written here from the formulas the header states: the
// test a new backend inherits (ggml's test-backend-ops is the model). The references are naive
// on purpose; the kernels' own tests (test_kernels) check the CPU kernels against finite
// differences and PyTorch's formulas.
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "peftplan/common/error.h"
#include "peftplan/executor/backend.h"
#include "peftplan/executor/kernels.h"

using namespace peftplan;
using namespace peftplan::executor;

namespace {

using Vec = std::vector<float>;

Vec random_vec(std::size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  Vec v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// Device buffers of a backend, filled from and read back to the host through the Backend.
class Dev {
 public:
  Dev(Backend& be, const Vec& host) : be_(be), n_(host.size()) {
    p_ = static_cast<float*>(be.device_memory().allocate(std::max<std::size_t>(4, 4 * n_)));
    if (n_ > 0) be.copy_to_device(p_, host.data(), 4 * n_);
  }
  Dev(Backend& be, std::size_t n) : Dev(be, Vec(n, 0.0f)) {}
  ~Dev() { be_.device_memory().deallocate(p_, std::max<std::size_t>(4, 4 * n_)); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  float* get() { return p_; }
  Vec host() {
    Vec out(n_);
    be_.synchronize();
    if (n_ > 0) be_.copy_to_host(out.data(), p_, 4 * n_);
    return out;
  }

 private:
  Backend& be_;
  std::size_t n_;
  float* p_ = nullptr;
};

void expect_near(const Vec& got, const std::vector<double>& want, double tol, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], tol * (1.0 + std::abs(want[i]))) << what << " element " << i;
}

class BackendOps : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    // A GPU backend built here but with no GPU to run on skips, saying why.
    if (const std::string why = backend_unavailable(GetParam()); !why.empty()) GTEST_SKIP() << GetParam() << ": " << why;
    be_ = make_backend(GetParam(), 1);
  }
  Backend& be() { return *be_; }
  std::unique_ptr<Backend> be_;
};

constexpr Index M = 6, K = 5, N = 7, R = 3;

TEST_P(BackendOps, CopiesAndFill) {
  const Vec a = random_vec(33, 1);
  Dev d(be(), a), e(be(), a.size());
  be().copy_device(e.get(), d.get(), 4 * a.size());
  EXPECT_EQ(e.host(), a);
  be().fill_zero(d.get(), 4 * a.size());
  EXPECT_EQ(d.host(), Vec(a.size(), 0.0f));
}

// The copy queue (backend.h): a copy ordered after a compute mark sees what the kernels before
// the mark wrote, a kernel ordered after a copy's end mark reads what it brought, and the host
// reads a copy's destination once it waited for its mark. Host memory is the backend's (pinned on
// CUDA), as the step's offload copies use it. The copy's source is written last, after a few
// hundred kernels, so that a copy the device started without waiting would read zeros.
void check_copy_queue(Backend& be) {
  const std::size_t n = 1 << 16;  // 256 KiB
  const Vec a = random_vec(n, 50), b = random_vec(n, 51);
  auto* host = static_cast<float*>(be.host_memory().allocate(4 * n));
  std::memcpy(host, b.data(), 4 * n);
  Dev x(be, a), y(be, n), z(be, n);
  be.reserve_marks(5);
  // Device to host, after the kernels that write the source: x·2 into y, then y to the host.
  for (int i = 0; i < 255; ++i) be.scale(DType::fp32, x.get(), i % 2 == 0 ? 2.0f : 0.5f, static_cast<Index>(n));  // 2^128 · 2^-127, exact
  be.copy_device(y.get(), x.get(), 4 * n);
  be.record_mark(0);
  be.wait_mark(Backend::Queue::copy, 0);
  be.record_copy_mark(1);
  be.copy_async(host, y.get(), 4 * n);
  be.record_copy_mark(2);
  be.wait_mark_on_host(2);
  for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(host[i], 2.0f * a[i]) << "device to host, element " << i;
  // Host to device, then a kernel that reads the destination: b into z, z into y.
  std::memcpy(host, b.data(), 4 * n);
  be.record_copy_mark(3);
  be.copy_async(z.get(), host, 4 * n);
  be.record_copy_mark(4);
  be.wait_mark(Backend::Queue::compute, 4);
  be.copy_device(y.get(), z.get(), 4 * n);
  EXPECT_EQ(y.host(), b) << "host to device, read by the compute queue";
  EXPECT_GE(be.seconds_between(3, 4), 0.0);  // marks on the copy queue read like the compute queue's
  be.host_memory().deallocate(host, 4 * n);
}

TEST_P(BackendOps, CopyQueueIsOrderedByItsMarks) { check_copy_queue(be()); }

// The same on the CPU backend's late copy queue (CpuCopyQueue::when_waited), which holds a copy
// back until a wait needs it: the marks' waits alone bring the bytes.
TEST(CpuCopyQueue, LateQueueIsOrderedByItsMarks) {
  const std::unique_ptr<Backend> late = make_cpu_backend(1, CpuCopyQueue::when_waited);
  check_copy_queue(*late);
}

// The late copy queue holds a copy back until a wait needs it, and then runs it with the source
// as it is at that point: what a device's copy engine may do, and what the executor's
// ExecutorCopyQueue test trains on.
TEST(CpuCopyQueue, LateCopiesRunWhenAWaitNeedsThem) {
  const std::unique_ptr<Backend> be = make_cpu_backend(1, CpuCopyQueue::when_waited);
  Vec src = {1, 2, 3, 4}, dst(4, 0.0f), other(4, 0.0f);
  be->reserve_marks(4);
  be->copy_async(dst.data(), src.data(), 16);
  be->record_copy_mark(0);
  be->copy_async(other.data(), src.data(), 16);
  be->record_copy_mark(1);
  EXPECT_EQ(dst, Vec(4, 0.0f));      // nothing has waited: nothing ran
  src[0] = 9;                        // the copy reads the source when it runs
  be->wait_mark(Backend::Queue::copy, 0);  // the copy queue waiting needs nothing of it
  EXPECT_EQ(dst, Vec(4, 0.0f));
  be->wait_mark(Backend::Queue::compute, 0);
  EXPECT_EQ(dst, (Vec{9, 2, 3, 4}));  // through mark 0 ...
  EXPECT_EQ(other, Vec(4, 0.0f));     // ... and no further
  be->wait_mark_on_host(1);
  EXPECT_EQ(other, (Vec{9, 2, 3, 4}));
  const Vec last = {5, 6, 7, 8};
  be->copy_async(other.data(), last.data(), 16);
  be->synchronize();  // runs everything queued
  EXPECT_EQ(other, last);
}

TEST_P(BackendOps, LinearForwardAndBackwardInput) {
  const Vec x = random_vec(M * K, 2), W = random_vec(N * K, 3), b = random_vec(N, 4), y0 = random_vec(M * N, 5);
  std::vector<double> y(M * N), yacc(M * N), dx(M * K);
  for (Index m = 0; m < M; ++m)
    for (Index n = 0; n < N; ++n) {
      double s = b[n];
      for (Index k = 0; k < K; ++k) s += double(x[m * K + k]) * W[n * K + k];
      y[m * N + n] = s;
      yacc[m * N + n] = s + y0[m * N + n];
    }
  for (Index m = 0; m < M; ++m)
    for (Index k = 0; k < K; ++k) {
      double s = 0;
      for (Index n = 0; n < N; ++n) s += double(y0[m * N + n]) * W[n * K + k];
      dx[m * K + k] = s;
    }
  Dev dxv(be(), x), dw(be(), W), db(be(), b), dy(be(), M * N), dacc(be(), y0), ddx(be(), M * K);
  be().linear_forward(DType::fp32, dxv.get(), dw.get(), db.get(), dy.get(), M, K, N, false);
  be().linear_forward(DType::fp32, dxv.get(), dw.get(), db.get(), dacc.get(), M, K, N, true);
  Dev dy0(be(), y0);
  be().linear_backward_input(DType::fp32, dy0.get(), dw.get(), ddx.get(), M, K, N, false);
  expect_near(dy.host(), y, 1e-5, "y");
  expect_near(dacc.host(), yacc, 1e-5, "y accumulated");
  expect_near(ddx.host(), dx, 1e-5, "dx");
}

// A device fp64 scalar (the loss sum, the squared norm), read back through the backend.
class DevScalar {
 public:
  explicit DevScalar(Backend& be, double v = 0.0) : be_(be) {
    p_ = static_cast<double*>(be.device_memory().allocate(8));
    be.copy_to_device(p_, &v, 8);
  }
  ~DevScalar() { be_.device_memory().deallocate(p_, 8); }
  DevScalar(const DevScalar&) = delete;
  DevScalar& operator=(const DevScalar&) = delete;
  double* get() { return p_; }
  double host() {
    double v = 0;
    be_.synchronize();
    be_.copy_to_host(&v, p_, 8);
    return v;
  }

 private:
  Backend& be_;
  double* p_ = nullptr;
};

// Raw device bytes, filled from and read back to the host.
std::vector<std::uint16_t> convert_16(Backend& be, const void* src, DType from, std::size_t n, DType to) {
  const std::uint64_t in = storage_bytes(from, static_cast<std::int64_t>(n)), out = storage_bytes(to, static_cast<std::int64_t>(n));
  void* s = be.device_memory().allocate(in);
  void* d = be.device_memory().allocate(out);
  be.copy_to_device(s, src, in);
  be.convert(s, from, d, to, static_cast<Index>(n));
  std::vector<std::uint16_t> got(n);
  be.synchronize();
  be.copy_to_host(got.data(), d, out);
  be.device_memory().deallocate(s, in);
  be.device_memory().deallocate(d, out);
  return got;
}

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bf16 -> fp32 is exact: the 16 bits become the high half of the fp32 pattern.
TEST_P(BackendOps, ConvertBf16ToFp32IsExact) {
  const std::vector<std::uint16_t> bits = {0x3f80, 0xbf80, 0x4049, 0x0000, 0x7f80, 0x3e00};
  void* src = be().device_memory().allocate(2 * bits.size());
  be().copy_to_device(src, bits.data(), 2 * bits.size());
  Dev out(be(), bits.size());
  be().convert(src, DType::bf16, out.get(), DType::fp32, static_cast<Index>(bits.size()));
  const Vec got = out.host();
  for (std::size_t i = 0; i < bits.size(); ++i) EXPECT_EQ(got[i], from_bits(std::uint32_t(bits[i]) << 16)) << i;
  be().device_memory().deallocate(src, 2 * bits.size());
}

// fp32 -> bf16 rounds to nearest, ties to even (torch's .to(torch.bfloat16)): 1 + 2^-8 lies
// halfway between 1 and 1 + 2^-7 and goes to the even 1.0; one ulp of fp32 above it goes up;
// 1 + 3·2^-8 is halfway with an odd lower neighbour and goes up to 1 + 2^-6.
TEST_P(BackendOps, ConvertFp32ToBf16RoundsToNearestEven) {
  if (!be().supports_storage(DType::bf16)) {  // a backend without bf16 must refuse it, not guess
    Dev a(be(), 4), b(be(), 4);
    EXPECT_THROW(be().convert(a.get(), DType::fp32, b.get(), DType::bf16, 4), InternalError);
    return;
  }
  const std::vector<float> x = {1.0f, from_bits(0x3f808000), from_bits(0x3f808001), from_bits(0x3f818000), -2.5f, 0.0f};
  const std::vector<std::uint16_t> want = {0x3f80, 0x3f80, 0x3f81, 0x3f82, 0xc020, 0x0000};
  EXPECT_EQ(convert_16(be(), x.data(), DType::fp32, x.size(), DType::bf16), want);
  // And back: every bf16 value survives the round trip (bf16 -> fp32 -> bf16).
  const auto back = convert_16(be(), x.data(), DType::fp32, x.size(), DType::bf16);
  Dev wide(be(), back.size());
  void* s = be().device_memory().allocate(2 * back.size());
  be().copy_to_device(s, back.data(), 2 * back.size());
  be().convert(s, DType::bf16, wide.get(), DType::fp32, static_cast<Index>(back.size()));
  const Vec w = wide.host();
  EXPECT_EQ(convert_16(be(), w.data(), DType::fp32, w.size(), DType::bf16), back);
  be().device_memory().deallocate(s, 2 * back.size());
}

// fp32 -> fp16 (IEEE binary16): 1 + 2^-11 is halfway and goes to the even 1.0; 65520 overflows
// to +inf; bf16 -> fp16 goes through fp32 (one rounding).
TEST_P(BackendOps, ConvertFp16BothWays) {
  if (!be().supports_storage(DType::fp16)) {  // a backend without fp16 must refuse it, not guess
    Dev a(be(), 4), b(be(), 4);
    EXPECT_THROW(be().convert(a.get(), DType::fp32, b.get(), DType::fp16, 4), InternalError);
    return;
  }
  const std::vector<float> x = {1.0f, 1.0f + 0x1p-11f, -0.5f, 65520.0f};
  const std::vector<std::uint16_t> want = {0x3c00, 0x3c00, 0xb800, 0x7c00};
  EXPECT_EQ(convert_16(be(), x.data(), DType::fp32, x.size(), DType::fp16), want);
  const std::vector<std::uint16_t> bf = {0x3f80, 0xbf00};  // 1.0, -0.5 in bf16
  EXPECT_EQ(convert_16(be(), bf.data(), DType::bf16, bf.size(), DType::fp16), (std::vector<std::uint16_t>{0x3c00, 0xb800}));
}

TEST_P(BackendOps, ConvertRefusesQuantisedStorageNamingIt) {
  EXPECT_FALSE(be().supports_storage(DType::nf4));
  Dev a(be(), 4), b(be(), 4);
  try {
    be().convert(a.get(), DType::nf4, b.get(), DType::fp32, 4);
    FAIL() << "no throw";
  } catch (const InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("nf4"), std::string::npos) << e.what();
  }
}

// Marks time what ran between them, read after one synchronize: a mark around a large GEMM is
// later than one around nothing, and the intervals add up.
TEST_P(BackendOps, MarksTimeTheWorkBetweenThem) {
  const Index side = 192;  // a square GEMM large enough to take measurable time
  Dev x(be(), random_vec(side * side, 40)), w(be(), random_vec(side * side, 41)), y(be(), side * side);
  be().reserve_marks(4);
  be().record_mark(0);
  be().record_mark(1);
  for (int i = 0; i < 8; ++i) be().linear_forward(DType::fp32, x.get(), w.get(), nullptr, y.get(), side, side, side, false);
  be().record_mark(2);
  be().record_mark(3);
  be().synchronize();
  const double empty = be().seconds_between(0, 1), gemms = be().seconds_between(1, 2), all = be().seconds_between(0, 3);
  EXPECT_GE(empty, 0.0);
  EXPECT_GT(gemms, 0.0);
  EXPECT_GE(all, gemms);
  // Up to the marks' resolution: exact on the host clock; CUDA events resolve about 0.5 µs
  // (CUDA Runtime API, cudaEventElapsedTime) and report float milliseconds.
  EXPECT_NEAR(all, be().seconds_between(0, 1) + be().seconds_between(1, 2) + be().seconds_between(2, 3),
              be().name() == "cpu" ? 1e-9 : 2e-6);
}

TEST_P(BackendOps, DropoutKeepsOneMinusPScaledAndRepeats) {
  const Index n = 20000;
  const Vec x = random_vec(n, 6);
  Dev dx(be(), x), a(be(), n), b(be(), n), c(be(), n);
  const DropoutKey key{0.25, 42}, other{0.25, 43};
  be().dropout_forward(DType::fp32, dx.get(), a.get(), n, key);
  be().dropout_forward(DType::fp32, dx.get(), b.get(), n, key);
  be().dropout_forward(DType::fp32, dx.get(), c.get(), n, other);
  const Vec va = a.host(), vb = b.host(), vc = c.host();
  EXPECT_EQ(va, vb);  // the same key, the same mask
  Index kept = 0, differ = 0;
  for (Index i = 0; i < n; ++i) {
    if (va[i] != 0.0f) {
      ++kept;
      EXPECT_NEAR(va[i], x[i] / 0.75f, 1e-6 * (1 + std::abs(x[i])));
    }
    differ += (va[i] != 0.0f) != (vc[i] != 0.0f);
  }
  EXPECT_NEAR(double(kept) / n, 0.75, 0.02);
  EXPECT_GT(differ, n / 10);
}

TEST_P(BackendOps, LoraForwardAndBackward) {
  const Vec x = random_vec(M * K, 7), A = random_vec(R * K, 8), B = random_vec(N * R, 9), dy = random_vec(M * N, 10);
  const Vec y0 = random_vec(M * N, 11);
  const float s = 1.5f;
  std::vector<double> u(M * R), y(M * N), du(M * R), dA(R * K), dB(N * R), dx(M * K);
  for (Index m = 0; m < M; ++m)
    for (Index j = 0; j < R; ++j) {
      double t = 0;
      for (Index k = 0; k < K; ++k) t += double(x[m * K + k]) * A[j * K + k];
      u[m * R + j] = t;
    }
  for (Index m = 0; m < M; ++m)
    for (Index n = 0; n < N; ++n) {
      double t = 0;
      for (Index j = 0; j < R; ++j) t += u[m * R + j] * B[n * R + j];
      y[m * N + n] = y0[m * N + n] + s * t;
    }
  for (Index m = 0; m < M; ++m)
    for (Index j = 0; j < R; ++j) {
      double t = 0;
      for (Index n = 0; n < N; ++n) t += double(dy[m * N + n]) * B[n * R + j];
      du[m * R + j] = s * t;
    }
  for (Index n = 0; n < N; ++n)
    for (Index j = 0; j < R; ++j) {
      double t = 0;
      for (Index m = 0; m < M; ++m) t += double(dy[m * N + n]) * u[m * R + j];
      dB[n * R + j] = s * t;
    }
  for (Index j = 0; j < R; ++j)
    for (Index k = 0; k < K; ++k) {
      double t = 0;
      for (Index m = 0; m < M; ++m) t += du[m * R + j] * x[m * K + k];
      dA[j * K + k] = t;
    }
  for (Index m = 0; m < M; ++m)
    for (Index k = 0; k < K; ++k) {
      double t = 0;
      for (Index j = 0; j < R; ++j) t += du[m * R + j] * A[j * K + k];
      dx[m * K + k] = t;
    }
  Dev dxin(be(), x), dA_(be(), A), dB_(be(), B), du_(be(), M * R), dy_(be(), y0);
  be().lora_forward(DType::fp32, dxin.get(), dA_.get(), dB_.get(), s, du_.get(), dy_.get(), M, K, N, R);
  expect_near(du_.host(), u, 1e-5, "u");
  expect_near(dy_.host(), y, 1e-5, "y");
  Dev g(be(), dy), gA(be(), R * K), gB(be(), N * R), gx(be(), M * K), scratch(be(), M * R);
  be().lora_backward(DType::fp32, g.get(), dxin.get(), dA_.get(), dB_.get(), du_.get(), s, DropoutKey{}, gA.get(), gB.get(), gx.get(), scratch.get(),
                     M, K, N, R);
  expect_near(gA.host(), dA, 1e-5, "dA");
  expect_near(gB.host(), dB, 1e-5, "dB");
  expect_near(gx.host(), dx, 1e-5, "dx");
}

TEST_P(BackendOps, RmsNormForwardAndBackward) {
  const Index H = 8;
  const Vec x = random_vec(M * H, 12), w = random_vec(H, 13), dy = random_vec(M * H, 14);
  const double eps = 1e-5;
  std::vector<double> y(M * H), rstd(M), dx(M * H);
  for (Index m = 0; m < M; ++m) {
    double ss = 0;
    for (Index h = 0; h < H; ++h) ss += double(x[m * H + h]) * x[m * H + h];
    const double r = 1.0 / std::sqrt(ss / H + eps);
    rstd[m] = r;
    double dot = 0;  // sum_h dy·w·x
    for (Index h = 0; h < H; ++h) {
      y[m * H + h] = w[h] * x[m * H + h] * r;
      dot += double(dy[m * H + h]) * w[h] * x[m * H + h];
    }
    for (Index h = 0; h < H; ++h) dx[m * H + h] = r * dy[m * H + h] * w[h] - r * r * r * x[m * H + h] * dot / H;
  }
  Dev dxv(be(), x), dw(be(), w), dyv(be(), M * H), dr(be(), M), g(be(), dy), gx(be(), M * H);
  be().rmsnorm_forward(DType::fp32, dxv.get(), dw.get(), static_cast<float>(eps), dyv.get(), dr.get(), M, H);
  be().rmsnorm_backward(DType::fp32, g.get(), dxv.get(), dw.get(), dr.get(), gx.get(), M, H, false);
  expect_near(dyv.host(), y, 1e-5, "y");
  expect_near(dr.host(), rstd, 1e-5, "rstd");
  expect_near(gx.host(), dx, 1e-4, "dx");
}

TEST_P(BackendOps, RopeRotatesAndItsBackwardIsTheTranspose) {
  const Index Bb = 2, S = 4, nh = 2, d = 8;
  const double theta = 10000.0;
  Dev tables(be(), S * d);
  be().rope_tables(tables.get(), S, d, theta);
  const Vec t = tables.host();
  for (Index s = 0; s < S; ++s)
    for (Index i = 0; i < d / 2; ++i) {
      const double ang = s * std::pow(theta, -2.0 * i / d);
      EXPECT_NEAR(t[s * (d / 2) + i], std::cos(ang), 1e-5);
      EXPECT_NEAR(t[S * (d / 2) + s * (d / 2) + i], std::sin(ang), 1e-5);
    }
  // rotate_half: x' = x·cos + rotate_half(x)·sin, rotate_half(x) = (−x2, x1) on the two halves.
  const Vec x = random_vec(Bb * S * nh * d, 15);
  std::vector<double> want(x.size());
  for (Index b = 0; b < Bb; ++b)
    for (Index s = 0; s < S; ++s)
      for (Index h = 0; h < nh; ++h)
        for (Index i = 0; i < d; ++i) {
          const std::size_t base = ((b * S + s) * nh + h) * d;
          const Index f = i % (d / 2);
          const double c = t[s * (d / 2) + f], sn = t[S * (d / 2) + s * (d / 2) + f];
          const double rot = i < d / 2 ? -x[base + i + d / 2] : x[base + i - d / 2];
          want[base + i] = x[base + i] * c + rot * sn;
        }
  Dev dx(be(), x);
  be().rope_forward(DType::fp32, dx.get(), tables.get(), Bb, S, nh, d);
  expect_near(dx.host(), want, 1e-5, "rope");
  be().rope_backward(DType::fp32, dx.get(), tables.get(), Bb, S, nh, d);  // a rotation's transpose undoes it
  expect_near(dx.host(), std::vector<double>(x.begin(), x.end()), 1e-5, "rope backward of rope");
}

// Causal GQA attention, forward against a naive softmax; backward against central differences
// of L = Σ dout ⊙ out.
TEST_P(BackendOps, AttentionForwardAndBackward) {
  const Index Bb = 1, S = 5, nh = 2, nkv = 1, d = 4;
  const Vec q = random_vec(Bb * S * nh * d, 16), k = random_vec(Bb * S * nkv * d, 17), v = random_vec(Bb * S * nkv * d, 18);
  const Vec dout = random_vec(Bb * S * nh * d, 19);
  auto naive = [&](const Vec& qq, const Vec& kk, const Vec& vv) {
    std::vector<double> out(qq.size(), 0.0);
    for (Index h = 0; h < nh; ++h) {
      const Index g = h / (nh / nkv);
      for (Index i = 0; i < S; ++i) {
        std::vector<double> sc(i + 1);
        double mx = -1e300;
        for (Index j = 0; j <= i; ++j) {
          double t = 0;
          for (Index e = 0; e < d; ++e) t += double(qq[(i * nh + h) * d + e]) * kk[(j * nkv + g) * d + e];
          sc[j] = t / std::sqrt(double(d));
          mx = std::max(mx, sc[j]);
        }
        double z = 0;
        for (double& s : sc) z += (s = std::exp(s - mx));
        for (Index j = 0; j <= i; ++j)
          for (Index e = 0; e < d; ++e) out[(i * nh + h) * d + e] += sc[j] / z * vv[(j * nkv + g) * d + e];
      }
    }
    return out;
  };
  const auto want = naive(q, k, v);
  Dev dq(be(), q), dk(be(), k), dv(be(), v), P(be(), Bb * nh * S * S), out(be(), q.size());
  be().attention_forward(DType::fp32, dq.get(), dk.get(), dv.get(), P.get(), out.get(), Bb, S, nh, nkv, d);
  expect_near(out.host(), want, 1e-5, "attention out");
  Dev g(be(), dout), gq(be(), q.size()), gk(be(), k.size()), gv(be(), v.size()), scratch(be(), Bb * nh * S * S);
  be().attention_backward(DType::fp32, g.get(), dq.get(), dk.get(), dv.get(), P.get(), gq.get(), gk.get(), gv.get(), scratch.get(), Bb * nh * S * S, Bb, S,
                          nh, nkv, d);
  auto loss = [&](const Vec& qq, const Vec& kk, const Vec& vv) {
    const auto o = naive(qq, kk, vv);
    double l = 0;
    for (std::size_t i = 0; i < o.size(); ++i) l += o[i] * dout[i];
    return l;
  };
  auto fd = [&](int which) {
    std::vector<double> grad;
    const Vec& base = which == 0 ? q : which == 1 ? k : v;
    for (std::size_t i = 0; i < base.size(); ++i) {
      Vec a = base, b = base;
      a[i] += 1e-2f;
      b[i] -= 1e-2f;
      const double la = which == 0 ? loss(a, k, v) : which == 1 ? loss(q, a, v) : loss(q, k, a);
      const double lb = which == 0 ? loss(b, k, v) : which == 1 ? loss(q, b, v) : loss(q, k, b);
      grad.push_back((la - lb) / (double(a[i]) - double(b[i])));
    }
    return grad;
  };
  expect_near(gq.host(), fd(0), 2e-3, "dq");
  expect_near(gk.host(), fd(1), 2e-3, "dk");
  expect_near(gv.host(), fd(2), 2e-3, "dv");
}

// Flash attention with GQA at head dims that take each of the CUDA kernels' tile sets (d up to
// 64, 128 and 256; cuda_kernels.cu) and over several tiles (S 300: five 64-row query tiles, the
// last one partial; the CPU's two key tiles of 256): its output and log-sum-exp against a naive
// softmax in double, its gradients against the same backend's eager backward (held to finite
// differences above): both are softmax(q·kᵀ/√d)·v.
TEST_P(BackendOps, FlashAttentionMatchesNaiveAndEager) {
  struct Shape {
    Index S, d;
  };
  for (const Shape sh : {Shape{300, 8}, Shape{70, 72}, Shape{70, 128}, Shape{40, 200}}) {
    const Index Bb = 2, S = sh.S, nh = 4, nkv = 2, d = sh.d, rep = nh / nkv;
    SCOPED_TRACE(::testing::Message() << "S " << S << ", d " << d);
    const Vec q = random_vec(Bb * S * nh * d, 26), k = random_vec(Bb * S * nkv * d, 27), v = random_vec(Bb * S * nkv * d, 28);
    const Vec dout = random_vec(Bb * S * nh * d, 29);
    std::vector<double> want(q.size(), 0.0), want_lse(Bb * nh * S);
    for (Index b = 0; b < Bb; ++b)
      for (Index h = 0; h < nh; ++h)
        for (Index i = 0; i < S; ++i) {
          std::vector<double> sc(i + 1);
          double mx = -1e300, z = 0;
          for (Index j = 0; j <= i; ++j) {
            double t = 0;
            for (Index e = 0; e < d; ++e) t += double(q[((b * S + i) * nh + h) * d + e]) * k[((b * S + j) * nkv + h / rep) * d + e];
            mx = std::max(mx, sc[j] = t / std::sqrt(double(d)));
          }
          for (double& x : sc) z += (x = std::exp(x - mx));
          want_lse[(b * nh + h) * S + i] = mx + std::log(z);
          for (Index j = 0; j <= i; ++j)
            for (Index e = 0; e < d; ++e) want[((b * S + i) * nh + h) * d + e] += sc[j] / z * v[((b * S + j) * nkv + h / rep) * d + e];
        }
    Dev dq(be(), q), dk(be(), k), dv(be(), v), lse(be(), Bb * nh * S), out(be(), q.size());
    be().flash_attention_forward(DType::fp32, dq.get(), dk.get(), dv.get(), lse.get(), out.get(), Bb, S, nh, nkv, d);
    expect_near(out.host(), want, 1e-5, "flash out");
    expect_near(lse.host(), want_lse, 1e-5, "flash lse");
    Dev g(be(), dout), gq(be(), q.size()), gk(be(), k.size()), gv(be(), v.size());
    be().flash_attention_backward(DType::fp32, g.get(), dq.get(), dk.get(), dv.get(), out.get(), lse.get(), gq.get(), gk.get(), gv.get(), Bb, S, nh,
                                  nkv, d);
    Dev P(be(), Bb * nh * S * S), eo(be(), q.size()), scratch(be(), Bb * nh * S * S), eq(be(), q.size()), ek(be(), k.size()),
        ev(be(), v.size());
    be().attention_forward(DType::fp32, dq.get(), dk.get(), dv.get(), P.get(), eo.get(), Bb, S, nh, nkv, d);
    be().attention_backward(DType::fp32, g.get(), dq.get(), dk.get(), dv.get(), P.get(), eq.get(), ek.get(), ev.get(), scratch.get(),
                            Bb * nh * S * S, Bb, S, nh, nkv, d);
    auto widen = [](const Vec& x) { return std::vector<double>(x.begin(), x.end()); };
    expect_near(gq.host(), widen(eq.host()), 1e-4, "flash dq");
    expect_near(gk.host(), widen(ek.host()), 1e-4, "flash dk");
    expect_near(gv.host(), widen(ev.host()), 1e-4, "flash dv");
  }
}

TEST_P(BackendOps, SwigluForwardAndBackward) {
  const Index n = 50;
  const Vec gte = random_vec(n, 20, 3.0f), up = random_vec(n, 21), da = random_vec(n, 22);
  std::vector<double> a(n), dg(n), du(n);
  for (Index i = 0; i < n; ++i) {
    const double sg = 1.0 / (1.0 + std::exp(-double(gte[i])));
    const double silu = gte[i] * sg;
    a[i] = silu * up[i];
    du[i] = da[i] * silu;
    dg[i] = da[i] * up[i] * (sg + gte[i] * sg * (1 - sg));
  }
  Dev g(be(), gte), u(be(), up), out(be(), n), d(be(), da), gg(be(), n), gu(be(), n);
  be().swiglu_forward(DType::fp32, g.get(), u.get(), out.get(), n);
  be().swiglu_backward(DType::fp32, d.get(), g.get(), u.get(), gg.get(), gu.get(), n);
  expect_near(out.host(), a, 1e-5, "act");
  expect_near(gg.host(), dg, 1e-5, "d_gate");
  expect_near(gu.host(), du, 1e-5, "d_up");
}

TEST_P(BackendOps, EmbeddingAndCrossEntropy) {
  const Index V = 9, H = 4, Mr = 5;
  const std::vector<std::int32_t> tokens = {3, 0, 8, 3, 5};
  const Vec table = random_vec(V * H, 23), logits = random_vec(Mr * V, 24, 2.0f);
  void* tk = be().device_memory().allocate(4 * tokens.size());
  be().copy_to_device(tk, tokens.data(), 4 * tokens.size());
  const auto* t = static_cast<const std::int32_t*>(tk);
  Dev tab(be(), table), out(be(), Mr * H);
  be().embedding_forward(DType::fp32, t, tab.get(), out.get(), Mr, V, H);
  std::vector<double> want(Mr * H);
  for (Index m = 0; m < Mr; ++m)
    for (Index h = 0; h < H; ++h) want[m * H + h] = table[tokens[m] * H + h];
  expect_near(out.host(), want, 0, "embedding");
  double loss = 0;
  std::vector<double> dl(Mr * V);
  const double count = 7.0;
  for (Index m = 0; m < Mr; ++m) {
    double mx = -1e300, z = 0;
    for (Index j = 0; j < V; ++j) mx = std::max(mx, double(logits[m * V + j]));
    for (Index j = 0; j < V; ++j) z += std::exp(logits[m * V + j] - mx);
    loss += -(logits[m * V + tokens[m]] - mx - std::log(z));
    for (Index j = 0; j < V; ++j) dl[m * V + j] = (std::exp(logits[m * V + j] - mx) / z - (j == tokens[m] ? 1.0 : 0.0)) / count;
  }
  Dev lg(be(), logits), dlg(be(), Mr * V);
  DevScalar sum(be(), 1.5);  // the kernel adds to what the scalar holds
  be().cross_entropy_forward(DType::fp32, lg.get(), t, Mr, V, sum.get());
  EXPECT_NEAR(sum.host(), 1.5 + loss, 1e-4);
  be().cross_entropy_backward(DType::fp32, lg.get(), t, dlg.get(), count, Mr, V);
  expect_near(dlg.host(), dl, 1e-5, "d_logits");
  be().cross_entropy_backward(DType::fp32, lg.get(), t, lg.get(), count, Mr, V);  // in place
  expect_near(lg.host(), dl, 1e-5, "d_logits in place");
  be().device_memory().deallocate(tk, 4 * tokens.size());
}

TEST_P(BackendOps, ElementwiseAndReductions) {
  const Index n = 41;
  const Vec a = random_vec(n, 25), b = random_vec(n, 26);
  Dev da(be(), a), db(be(), b), out(be(), n);
  be().add(DType::fp32, da.get(), db.get(), out.get(), n);
  std::vector<double> sum(n), scaled(n);
  double ss = 0;
  for (Index i = 0; i < n; ++i) {
    sum[i] = double(a[i]) + b[i];
    scaled[i] = 0.5 * a[i];
    ss += double(a[i]) * a[i];
  }
  expect_near(out.host(), sum, 1e-6, "add");
  be().add(DType::fp32, da.get(), db.get(), da.get(), n);  // out aliasing a
  expect_near(da.host(), sum, 1e-6, "add in place");
  Dev dc(be(), a);
  DevScalar sq(be(), 99.0);  // overwritten
  be().sum_squares(DType::fp32, dc.get(), n, sq.get());
  EXPECT_NEAR(sq.host(), ss, 1e-5 * ss);
  be().scale(DType::fp32, dc.get(), 0.5f, n);
  expect_near(dc.host(), scaled, 1e-6, "scale");
}

// torch.optim.AdamW (decoupled weight decay, bias-corrected moments), two steps.
TEST_P(BackendOps, AdamwStepIsTorchsAdamW) {
  const Index n = 17;
  const Vec p0 = random_vec(n, 27), g1 = random_vec(n, 28), g2 = random_vec(n, 29);
  const double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1;
  std::vector<double> p(p0.begin(), p0.end()), m(n, 0.0), v(n, 0.0);
  for (int step = 1; step <= 2; ++step) {
    const Vec& g = step == 1 ? g1 : g2;
    for (Index i = 0; i < n; ++i) {
      p[i] *= 1 - lr * wd;
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * double(g[i]) * g[i];
      const double mh = m[i] / (1 - std::pow(b1, step)), vh = v[i] / (1 - std::pow(b2, step));
      p[i] -= lr * mh / (std::sqrt(vh) + eps);
    }
  }
  Dev dp(be(), p0), dm(be(), n), dv(be(), n), dg1(be(), g1), dg2(be(), g2);
  be().adamw_step(dp.get(), dg1.get(), dm.get(), dv.get(), n, 1, lr, b1, b2, eps, wd);
  be().adamw_step(dp.get(), dg2.get(), dm.get(), dv.get(), n, 2, lr, b1, b2, eps, wd);
  expect_near(dp.host(), p, 1e-5, "params");
  expect_near(dm.host(), m, 1e-5, "exp_avg");
  expect_near(dv.host(), v, 1e-5, "exp_avg_sq");
}

// --- bf16 storage ----------------------------------------------------------------------------
// Every kernel with bf16 operands against the CPU backend's fp32 call on the same inputs (values
// bf16 holds exactly, so only the kernel's own roundings differ): the tolerance is
// atol + rtol·|ref| with both at bf16's unit roundoff 2⁻⁸ (an 8-bit significand: the ulp at 1 is
// 2⁻⁷ and a store rounds to half of it). An output computed in fp32 and rounded once is within one
// unit (K = 1: the fp32 sums of two backends differ by far less). An output that sums K values a
// backend may have rounded on the way (LoRA's u and du, eager attention's scores, probabilities
// and their gradients: backend.h) gets √K units, and twice that where those values feed a further
// product.

Vec bf16_exact(Vec v) {
  for (float& x : v) x = cpu::bf16_to_fp32(cpu::fp32_to_bf16(x));
  return v;
}

// A device buffer in a storage dtype, filled from fp32 host values and read back widened.
class Typed {
 public:
  Typed(Backend& be, DType dt, const Vec& host) : be_(be), dt_(dt), n_(host.size()) {
    bytes_ = std::max<std::uint64_t>(4, storage_bytes(dt, static_cast<std::int64_t>(n_)));
    p_ = be.device_memory().allocate(bytes_);
    if (n_ == 0) return;
    if (dt == DType::fp32) {
      be.copy_to_device(p_, host.data(), 4 * n_);
    } else {
      std::vector<std::uint16_t> h(n_);
      cpu::fp32_to_bf16(host.data(), h.data(), static_cast<Index>(n_));
      be.copy_to_device(p_, h.data(), 2 * n_);
    }
  }
  Typed(Backend& be, DType dt, std::size_t n) : Typed(be, dt, Vec(n, 0.0f)) {}
  ~Typed() { be_.device_memory().deallocate(p_, bytes_); }
  Typed(const Typed&) = delete;
  Typed& operator=(const Typed&) = delete;
  void* get() { return p_; }
  Vec host() {
    Vec out(n_);
    be_.synchronize();
    if (n_ == 0) return out;
    if (dt_ == DType::fp32) {
      be_.copy_to_host(out.data(), p_, 4 * n_);
    } else {
      std::vector<std::uint16_t> h(n_);
      be_.copy_to_host(h.data(), p_, 2 * n_);
      cpu::bf16_to_fp32(h.data(), out.data(), static_cast<Index>(n_));
    }
    return out;
  }

 private:
  Backend& be_;
  DType dt_;
  std::size_t n_;
  std::uint64_t bytes_ = 0;
  void* p_ = nullptr;
};

// One method's calls at a storage dtype: its outputs, widened, with each output's reduction
// length K and a factor for stores that feed later products.
struct Bf16Case {
  std::string name;
  std::function<std::vector<Vec>(Backend&, DType)> run;
  std::vector<double> K;
  double factor = 1.0;
};

std::vector<Bf16Case> bf16_cases() {
  constexpr Index Mr = 6, Kd = 40, Nd = 24, Rr = 4, H = 32;
  std::vector<Bf16Case> cs;
  const Vec x = bf16_exact(random_vec(Mr * Kd, 101)), W = bf16_exact(random_vec(Nd * Kd, 102)), bias = bf16_exact(random_vec(Nd, 103));
  const Vec y0 = bf16_exact(random_vec(Mr * Nd, 104)), dy = bf16_exact(random_vec(Mr * Nd, 105));
  cs.push_back({"linear", [=](Backend& be, DType dt) {
                  Typed X(be, dt, x), Wt(be, dt, W), Bi(be, dt, bias), Y(be, dt, Mr * Nd), Ya(be, dt, y0), DY(be, dt, dy), DX(be, dt, x);
                  be.linear_forward(dt, X.get(), Wt.get(), Bi.get(), Y.get(), Mr, Kd, Nd, false);
                  be.linear_forward(dt, X.get(), Wt.get(), nullptr, Ya.get(), Mr, Kd, Nd, true);
                  be.linear_backward_input(dt, DY.get(), Wt.get(), DX.get(), Mr, Kd, Nd, true);
                  return std::vector<Vec>{Y.host(), Ya.host(), DX.host()};
                }, {1.0, 1.0, 1.0}});
  cs.push_back({"dropout", [=](Backend& be, DType dt) {
                  Typed X(be, dt, x), O(be, dt, x.size());
                  be.dropout_forward(dt, X.get(), O.get(), Mr * Kd, DropoutKey{0.25, 7});
                  return std::vector<Vec>{O.host()};
                }, {1.0}});
  const Vec A = bf16_exact(random_vec(Rr * Kd, 106)), B = bf16_exact(random_vec(Nd * Rr, 107));
  cs.push_back({"lora", [=](Backend& be, DType dt) {
                  Typed X(be, dt, x), Am(be, dt, A), Bm(be, dt, B), U(be, dt, Mr * Rr), Y(be, dt, y0);
                  be.lora_forward(dt, X.get(), Am.get(), Bm.get(), 0.5f, U.get(), Y.get(), Mr, Kd, Nd, Rr);
                  std::vector<Vec> out{U.host(), Y.host()};
                  for (const double p : {0.0, 0.1}) {  // without dropout and through its mask
                    Typed DY(be, dt, dy), dA(be, dt, A), dB(be, dt, B), DX(be, dt, x), SC(be, dt, Mr * (Rr + Kd));
                    be.lora_backward(dt, DY.get(), X.get(), Am.get(), Bm.get(), U.get(), 0.5f, DropoutKey{p, 9}, dA.get(), dB.get(), DX.get(),
                                     SC.get(), Mr, Kd, Nd, Rr);
                    for (Typed* t : {&dA, &dB, &DX}) out.push_back(t->host());
                  }
                  return out;
                }, {1.0, double(Rr), double(Mr * Nd), double(Mr), double(Rr * Nd), double(Mr * Nd), double(Mr), double(Rr * Nd)}, 2.0});
  const Vec xh = bf16_exact(random_vec(Mr * H, 108)), w = bf16_exact(random_vec(H, 109)), dyh = bf16_exact(random_vec(Mr * H, 110));
  cs.push_back({"rmsnorm", [=](Backend& be, DType dt) {
                  Typed X(be, dt, xh), Wt(be, dt, w), Y(be, dt, Mr * H), DY(be, dt, dyh), DX(be, dt, xh);
                  Dev rstd(be, Mr);
                  be.rmsnorm_forward(dt, X.get(), Wt.get(), 1e-5f, Y.get(), rstd.get(), Mr, H);
                  be.rmsnorm_backward(dt, DY.get(), X.get(), Wt.get(), rstd.get(), DX.get(), Mr, H, true);
                  return std::vector<Vec>{Y.host(), rstd.host(), DX.host()};
                }, {1.0, 1.0, 1.0}});
  constexpr Index Bb = 2, S = 20, nh = 4, nkv = 2, d = 16;
  const Vec q = bf16_exact(random_vec(Bb * S * nh * d, 111)), k = bf16_exact(random_vec(Bb * S * nkv * d, 112));
  const Vec v = bf16_exact(random_vec(Bb * S * nkv * d, 113)), dout = bf16_exact(random_vec(Bb * S * nh * d, 114));
  cs.push_back({"rope", [=](Backend& be, DType dt) {
                  Dev tables(be, S * d);
                  be.rope_tables(tables.get(), S, d, 10000.0);
                  Typed Q(be, dt, q), G(be, dt, dout);
                  be.rope_forward(dt, Q.get(), tables.get(), Bb, S, nh, d);
                  be.rope_backward(dt, G.get(), tables.get(), Bb, S, nh, d);
                  return std::vector<Vec>{Q.host(), G.host()};
                }, {1.0, 1.0}});
  cs.push_back({"attention", [=](Backend& be, DType dt) {
                  Typed Q(be, dt, q), Kt(be, dt, k), Vt(be, dt, v), P(be, dt, Bb * nh * S * S), O(be, dt, q.size()), G(be, dt, dout);
                  Typed dQ(be, dt, q.size()), dK(be, dt, k.size()), dV(be, dt, v.size()), SC(be, dt, Bb * nh * S * S);
                  be.attention_forward(dt, Q.get(), Kt.get(), Vt.get(), P.get(), O.get(), Bb, S, nh, nkv, d);
                  be.attention_backward(dt, G.get(), Q.get(), Kt.get(), Vt.get(), P.get(), dQ.get(), dK.get(), dV.get(), SC.get(),
                                        Bb * nh * S * S, Bb, S, nh, nkv, d);
                  return std::vector<Vec>{P.host(), O.host(), dQ.host(), dK.host(), dV.host()};
                }, {double(d), double(S), double(S * d), double(S * d * nh / nkv), double(S * nh / nkv)}, 2.0});
  cs.push_back({"flash attention", [=](Backend& be, DType dt) {
                  Typed Q(be, dt, q), Kt(be, dt, k), Vt(be, dt, v), O(be, dt, q.size()), G(be, dt, dout);
                  Typed dQ(be, dt, q.size()), dK(be, dt, k.size()), dV(be, dt, v.size());
                  Dev lse(be, Bb * nh * S);
                  be.flash_attention_forward(dt, Q.get(), Kt.get(), Vt.get(), lse.get(), O.get(), Bb, S, nh, nkv, d);
                  be.flash_attention_backward(dt, G.get(), Q.get(), Kt.get(), Vt.get(), O.get(), lse.get(), dQ.get(), dK.get(), dV.get(), Bb,
                                              S, nh, nkv, d);
                  return std::vector<Vec>{O.host(), lse.host(), dQ.host(), dK.host(), dV.host()};
                }, {1.0, 1.0, 1.0, 1.0, 1.0}});
  const Vec gate = bf16_exact(random_vec(200, 115, 3.0f)), up = bf16_exact(random_vec(200, 116)), da = bf16_exact(random_vec(200, 117));
  cs.push_back({"swiglu", [=](Backend& be, DType dt) {
                  Typed G(be, dt, gate), U(be, dt, up), Ac(be, dt, 200), DA(be, dt, da), DG(be, dt, 200), DU(be, dt, 200);
                  be.swiglu_forward(dt, G.get(), U.get(), Ac.get(), 200);
                  be.swiglu_backward(dt, DA.get(), G.get(), U.get(), DG.get(), DU.get(), 200);
                  return std::vector<Vec>{Ac.host(), DG.host(), DU.host()};
                }, {1.0, 1.0, 1.0}});
  constexpr Index V = 50;
  const Vec table = bf16_exact(random_vec(V * H, 118)), logits = bf16_exact(random_vec(Mr * V, 119, 3.0f));
  cs.push_back({"embedding, cross-entropy", [=](Backend& be, DType dt) {
                  const std::vector<std::int32_t> tokens = {3, 0, 49, 3, 17, cpu::kIgnoreIndex};
                  void* tk = be.device_memory().allocate(4 * tokens.size());
                  be.copy_to_device(tk, tokens.data(), 4 * tokens.size());
                  const auto* t = static_cast<const std::int32_t*>(tk);
                  std::vector<std::int32_t> ids = tokens;
                  for (auto& i : ids) i = i < 0 ? 1 : i;  // the embedding's ids: every row a real token
                  void* ik = be.device_memory().allocate(4 * ids.size());
                  be.copy_to_device(ik, ids.data(), 4 * ids.size());
                  Typed Tb(be, dt, table), E(be, dt, Mr * H), L(be, dt, logits), D(be, dt, Mr * V), Lin(be, dt, logits);
                  be.embedding_forward(dt, static_cast<const std::int32_t*>(ik), Tb.get(), E.get(), Mr, V, H);
                  DevScalar loss(be, 0.0);
                  be.cross_entropy_forward(dt, L.get(), t, Mr, V, loss.get());
                  be.cross_entropy_backward(dt, L.get(), t, D.get(), 5.0, Mr, V);
                  be.cross_entropy_backward(dt, Lin.get(), t, Lin.get(), 5.0, Mr, V);  // in place
                  std::vector<Vec> out{E.host(), Vec{static_cast<float>(loss.host())}, D.host(), Lin.host()};
                  be.device_memory().deallocate(tk, 4 * tokens.size());
                  be.device_memory().deallocate(ik, 4 * ids.size());
                  return out;
                }, {1.0, 1.0, 1.0, 1.0}});
  const Vec ea = bf16_exact(random_vec(300, 120)), eb = bf16_exact(random_vec(300, 121));
  cs.push_back({"add, sum of squares, scale", [=](Backend& be, DType dt) {
                  Typed a(be, dt, ea), b(be, dt, eb), o(be, dt, 300), c(be, dt, ea);
                  be.add(dt, a.get(), b.get(), o.get(), 300);
                  be.add(dt, a.get(), b.get(), a.get(), 300);  // out aliasing a
                  DevScalar sq(be, 5.0);
                  be.sum_squares(dt, c.get(), 300, sq.get());
                  be.scale(dt, c.get(), 0.37f, 300);
                  return std::vector<Vec>{o.host(), a.host(), Vec{static_cast<float>(sq.host())}, c.host()};
                }, {1.0, 1.0, 1.0, 1.0}});
  return cs;
}

TEST_P(BackendOps, Bf16StorageMatchesTheCpuInFp32) {
  ASSERT_TRUE(be().supports_compute(DType::bf16));
  ASSERT_TRUE(be().supports_compute(DType::fp32));
  auto ref_backend = make_backend("cpu", 1);
  const double unit = std::ldexp(1.0, -8);
  for (const Bf16Case& c : bf16_cases()) {
    SCOPED_TRACE(c.name);
    const std::vector<Vec> want = c.run(*ref_backend, DType::fp32), got = c.run(be(), DType::bf16);
    ASSERT_EQ(want.size(), got.size());
    ASSERT_EQ(want.size(), c.K.size());
    for (std::size_t o = 0; o < want.size(); ++o) {
      ASSERT_EQ(want[o].size(), got[o].size()) << "output " << o;
      const double e = c.factor * unit * std::sqrt(c.K[o]);
      double rel_max = 0.0;  // the largest error as a share of its tolerance
      for (std::size_t i = 0; i < want[o].size(); ++i) {
        const double w = want[o][i], g = got[o][i], tol = e * (1.0 + std::abs(w));
        rel_max = std::max(rel_max, std::abs(g - w) / tol);
        ASSERT_NEAR(g, w, tol) << "output " << o << " element " << i;
      }
      RecordProperty(c.name + " output " + std::to_string(o), std::to_string(rel_max));
    }
  }
}

TEST_P(BackendOps, Bf16RoundsWhereItStores) {
  // Sums bf16 cannot hold (its ulp at 1 is 2⁻⁷): 1 + 2⁻⁹ rounds down to 1, 1 + 3·2⁻⁹ up to 1 + 2⁻⁷.
  // Both inputs are exact in bf16 (3 needs two significand bits); the sums are not.
  const Vec a = {1.0f, 1.0f}, b = {std::ldexp(1.0f, -9), 3.0f * std::ldexp(1.0f, -9)};
  Typed da(be(), DType::bf16, a), db(be(), DType::bf16, b), out(be(), DType::bf16, 2);
  be().add(DType::bf16, da.get(), db.get(), out.get(), 2);
  EXPECT_EQ(out.host(), (Vec{1.0f, 1.0f + std::ldexp(1.0f, -7)}));
}

TEST_P(BackendOps, ComputeOnAnUnsupportedDtypeIsRefusedNamingIt) {
  EXPECT_FALSE(be().supports_compute(DType::fp16));
  Typed a(be(), DType::fp32, Vec(4, 1.0f)), o(be(), DType::fp32, 4);
  try {
    be().add(DType::fp16, a.get(), a.get(), o.get(), 2);
    be().synchronize();
    FAIL() << "no throw";
  } catch (const InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("fp16"), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(EveryBackend, BackendOps, ::testing::ValuesIn(backend_names()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

TEST(Backends, AnUnknownNameSaysWhichExist) {
  try {
    make_backend("tpu");
    FAIL() << "no throw";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("this build has cpu"), std::string::npos) << e.what();
  }
}

}  // namespace
