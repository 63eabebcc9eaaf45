// The CUDA backend: the Backend interface (backend.h) on one NVIDIA GPU. Every kernel computes on
// fp32 or bf16 storage (supports_compute) and bf16 storage uses fp32 arithmetic and fp32
// accumulation, rounding each stored value once. GEMMs go to cuBLAS: fp32 operands in full fp32
// (cublasSgemm, no TF32: the backend-ops test holds every backend to the same fp64 references),
// bf16 operands through cublasGemmEx with CUBLAS_COMPUTE_32F; the row- and element-wise ops are
// the kernels of cuda_kernels.cu (templates on the storage), launched from here. Kernels are
// enqueued on one compute stream and the step's offload copies on a copy stream of their own
// (backend.h "the copy queue"), between pinned host buffers so that they run asynchronously;
// timing marks are CUDA events on either, and waits between them cudaStreamWaitEvent. Device memory comes exactly as
// asked from a stream-ordered pool of the backend's own (DeviceMemory below: the tracked allocator
// above counts every byte, the pool's reserved high-water mark is the run's `reserved`), host
// memory is pinned (cudaMallocHost).
//
// Row-major operands meet column-major cuBLAS by reading each row-major [r, c] matrix as the
// column-major [c, r] matrix it already is in memory (its transpose): y = x·Wᵀ becomes
// yᵀ = W·xᵀ, i.e. gemm(T, N) of the stored W and x, with no copies. Each call below names the
// product it computes in row-major terms.
//
// Flash attention is the fused kernels of cuda_kernels.cu (FlashAttention-2's tiling in fp32 tiles,
// head dims up to cuda::kFlashMaxHeadDim), eager attention the cuBLAS GEMMs around a softmax kernel.
//
// Deliberately not here: fp16 compute (fp16 is a storage convert() handles, not a compute dtype),
// tensor-core flash attention (its products would run in TF32 or bf16, not fp32), the
// collectives' stream (the Communicator's), and checking token ids on the device (the data
// loader checks them at the edge).
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cuda_backend.h"
#include "cuda_kernels.h"
#include "peftplan/common/error.h"
#include "peftplan/executor/kernels.h"
#include "peftplan/executor/optim.h"

namespace peftplan::executor {
namespace {

// ------------------------------------------------------------------------------- error checks

// Each names the call, where it is, and the library's own error string and name.
void check_cuda(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess)
    throw InternalError(fmt::format("{}:{}: cuda backend: {}: {} ({})", file, line, what, cudaGetErrorString(e), cudaGetErrorName(e)));
}
void check_cublas(cublasStatus_t s, const char* what, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw InternalError(fmt::format("{}:{}: cuda backend: {}: {} ({})", file, line, what, cublasGetStatusString(s), cublasGetStatusName(s)));
}
#define PEFTPLAN_CUDA(call) check_cuda((call), #call, __FILE__, __LINE__)
#define PEFTPLAN_CUBLAS(call) check_cublas((call), #call, __FILE__, __LINE__)
// A kernel launch reports its configuration errors at once, its faults at the next synchronize.
#define PEFTPLAN_LAUNCH(call) check_cuda((call), #call, __FILE__, __LINE__)

// SplitMix64 (Steele, Lea, Flood 2014) of the dropout key, as cpu_backend.cpp mixes it; the
// kernels mix in the element index.
std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
cuda::Storage storage_of(DType d) {
  return d == DType::bf16 ? cuda::Storage::bf16 : d == DType::fp16 ? cuda::Storage::fp16 : cuda::Storage::fp32;
}

int to_int(Index v, const char* what) {
  if (v < 0 || v > 0x7fffffff) throw InternalError(fmt::format("cuda backend: {} = {} does not fit cuBLAS's int", what, v));
  return static_cast<int>(v);
}

// ----------------------------------------------------------------------------- memory sources

// Device memory from CUDA's stream-ordered allocator (cudaMallocAsync on the compute stream):
// a free is ordered after the kernels that use the block and never synchronises the device,
// unlike cudaFree, which would stall every step the program frees an activation in. The backend
// has a pool of its own that keeps what it has reserved (release threshold: everything), so the
// pool's reserved high-water mark is the "reserved" memory kind of our allocator; the tracked
// allocator above still counts exactly the bytes asked for ("allocated").
class DeviceMemory final : public MemoryResource {
 public:
  void bind(cudaStream_t stream, int device) {
    stream_ = stream;
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    PEFTPLAN_CUDA(cudaMemPoolCreate(&pool_, &props));
    std::uint64_t keep_all = ~0ull;
    PEFTPLAN_CUDA(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep_all));
  }
  ~DeviceMemory() override {
    if (pool_ != nullptr) cudaMemPoolDestroy(pool_);
  }
  std::string_view name() const override { return "cuda device"; }
  void* allocate(std::uint64_t bytes) override {
    void* p = nullptr;
    // A 0-byte request still gets its own address.
    const cudaError_t e = cudaMallocFromPoolAsync(&p, bytes == 0 ? 256 : bytes, pool_, stream_);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear the error so later calls are not blamed
      throw std::bad_alloc();
    }
    check_cuda(e, "cudaMallocFromPoolAsync", __FILE__, __LINE__);  // anything else (a fault from an earlier kernel) is not "out of memory"
    return p;
  }
  void deallocate(void* p, std::uint64_t) override { cudaFreeAsync(p, stream_); }
  // The pool's reserved bytes at their highest since reset_peak() (cudaMemPoolAttrReservedMemHigh).
  std::uint64_t reserved_high() const {
    std::uint64_t v = 0;
    PEFTPLAN_CUDA(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &v));
    return v;
  }
  // Returns what no live block uses to the driver and restarts the high-water mark (the only
  // value CUDA lets it be set to is 0). The stream must be idle: the caller synchronises.
  void reset_peak() {
    PEFTPLAN_CUDA(cudaMemPoolTrimTo(pool_, 0));
    std::uint64_t zero = 0;
    PEFTPLAN_CUDA(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &zero));
  }

 private:
  cudaStream_t stream_ = nullptr;
  cudaMemPool_t pool_ = nullptr;
};
class PinnedHostMemory final : public MemoryResource {
 public:
  std::string_view name() const override { return "cuda pinned host"; }
  void* allocate(std::uint64_t bytes) override {
    void* p = nullptr;
    const cudaError_t e = cudaMallocHost(&p, bytes == 0 ? 64 : bytes);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      throw std::bad_alloc();
    }
    check_cuda(e, "cudaMallocHost", __FILE__, __LINE__);
    return p;
  }
  void deallocate(void* p, std::uint64_t) override { cudaFreeHost(p); }
};

// cuBLAS's workspace, set explicitly so its bytes are known: 32 MiB, NVIDIA's recommendation for
// Hopper (cuBLAS documentation, "cublasSetWorkspace()": 32 MiB on Hopper, 4 MiB elsewhere), which
// PyTorch also uses on sm_90 (aten/src/ATen/cuda/CublasHandlePool.cpp,
// getChosenWorkspaceSize's ":4096:8" default).
std::uint64_t cublas_workspace_bytes(int major) { return major >= 9 ? (32ull << 20) : (4ull << 20); }

// What the backend creates beside its memory sources, each released when it was made — also when
// the constructor stops half-way.
struct Handles {
  cudaStream_t stream = nullptr;
  cudaStream_t copy_stream = nullptr;
  cublasHandle_t blas = nullptr;
  void* workspace = nullptr;
  double* discarded_loss = nullptr;  // cross_entropy_backward's loss sum, not read
  std::vector<cudaEvent_t> marks;
  Handles() = default;
  Handles(const Handles&) = delete;
  Handles& operator=(const Handles&) = delete;
  ~Handles() {
    for (cudaEvent_t e : marks) cudaEventDestroy(e);
    if (blas != nullptr) cublasDestroy(blas);
    if (workspace != nullptr) cudaFree(workspace);
    if (discarded_loss != nullptr) cudaFree(discarded_loss);
    if (copy_stream != nullptr) cudaStreamDestroy(copy_stream);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

class CudaBackend final : public Backend {
 public:
  CudaBackend() {
    PEFTPLAN_CUDA(cudaGetDevice(&device_));
    PEFTPLAN_CUDA(cudaGetDeviceProperties(&props_, device_));
    PEFTPLAN_CUDA(cudaStreamCreateWithFlags(&h_.stream, cudaStreamNonBlocking));
    PEFTPLAN_CUDA(cudaStreamCreateWithFlags(&h_.copy_stream, cudaStreamNonBlocking));
    device_memory_.bind(h_.stream, device_);
    PEFTPLAN_CUBLAS(cublasCreate(&h_.blas));
    PEFTPLAN_CUBLAS(cublasSetStream(h_.blas, h_.stream));
    // Full fp32 products: no TF32 (CUBLAS_DEFAULT_MATH is already that; said here for the reader).
    // bf16 products sum in fp32 with no reduction in bf16 either: CUBLAS_MATH_DISALLOW_REDUCED_
    // PRECISION_REDUCTION "forces any reductions during matrix multiplications to use the
    // accumulator type" where the output type is narrower (cuBLAS documentation, "cublasMath_t"; it
    // changes nothing for fp32 outputs). PyTorch sets the same flag for bf16 GEMMs when
    // allow_bf16_reduced_precision_reduction is off (aten/src/ATen/cuda/CUDABlas.cpp).
    PEFTPLAN_CUBLAS(cublasSetMathMode(
        h_.blas, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    workspace_bytes_ = cublas_workspace_bytes(props_.major);
    PEFTPLAN_CUDA(cudaMalloc(&h_.workspace, workspace_bytes_));
    PEFTPLAN_CUBLAS(cublasSetWorkspace(h_.blas, h_.workspace, workspace_bytes_));
    PEFTPLAN_CUDA(cudaMalloc(reinterpret_cast<void**>(&h_.discarded_loss), sizeof(double)));
    int version = 0;
    PEFTPLAN_CUBLAS(cublasGetVersion(h_.blas, &version));
    cublas_version_ = version;
  }
  // Work still queued finishes before the pool and the handles go (members, in reverse order).
  ~CudaBackend() override {
    cudaStreamSynchronize(h_.copy_stream);
    cudaStreamSynchronize(h_.stream);
  }

  std::string_view name() const override { return "cuda"; }
  std::string description() const override {
    return fmt::format("cuda: {} (sm_{}{}, {} SMs, {:.0f} GiB), cuBLAS {}.{}.{}", props_.name, props_.major, props_.minor,
                       props_.multiProcessorCount, props_.totalGlobalMem / double(1ull << 30), cublas_version_ / 10000,
                       cublas_version_ / 100 % 100, cublas_version_ % 100);
  }
  int threads() const override { return 1; }
  bool device_is_host() const override { return false; }
  void* native_stream() override { return h_.stream; }
  // The host's name and the GPU's PCI bus id: bus ids repeat from node to node of a cluster.
  std::string device_identity() const override {
    char bus[32] = {};
    PEFTPLAN_CUDA(cudaDeviceGetPCIBusId(bus, sizeof bus, device_));
    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
    return fmt::format("{}/{}", host, bus);
  }
  // cuBLAS works in the workspace set above and allocates nothing else per call.
  std::uint64_t gemm_library_scratch_bytes(Index, Index, Index) const override { return workspace_bytes_; }

  MemoryResource& device_memory() override { return device_memory_; }
  MemoryResource& host_memory() override { return host_memory_; }
  // Both directions finish before returning: the host buffer may be a temporary (upload) or read
  // at once (download). The step's offload copies, which overlap the kernels, are copy_async's.
  // Every copy says cudaMemcpyDefault: with unified addressing the driver knows which side each
  // pointer is on, and callers do move bytes between two host buffers (offloaded states) through
  // these methods, for which a stated direction would be wrong.
  void copy_to_device(void* dst, const void* src, std::uint64_t bytes) override {
    PEFTPLAN_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, h_.stream));
    PEFTPLAN_CUDA(cudaStreamSynchronize(h_.stream));
  }
  void copy_to_host(void* dst, const void* src, std::uint64_t bytes) override {
    PEFTPLAN_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, h_.stream));
    PEFTPLAN_CUDA(cudaStreamSynchronize(h_.stream));
  }
  void copy_device(void* dst, const void* src, std::uint64_t bytes) override {
    // cudaMemcpy between overlapping device ranges is undefined: stage through the workspace
    // when they overlap (only ever small moves in the program) or copy in two halves.
    const auto* s = static_cast<const char*>(src);
    auto* d = static_cast<char*>(dst);
    if (bytes == 0 || s == d) return;
    const bool overlap = d < s + bytes && s < d + bytes;
    if (!overlap) {
      PEFTPLAN_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, h_.stream));
      return;
    }
    for (std::uint64_t off = 0; off < bytes; off += workspace_bytes_) {
      const std::uint64_t len = std::min<std::uint64_t>(workspace_bytes_, bytes - off);
      const std::uint64_t o = d < s ? off : bytes - off - len;  // move toward the destination's side first
      PEFTPLAN_CUDA(cudaMemcpyAsync(h_.workspace, s + o, len, cudaMemcpyDefault, h_.stream));
      PEFTPLAN_CUDA(cudaMemcpyAsync(d + o, h_.workspace, len, cudaMemcpyDefault, h_.stream));
    }
  }
  void fill_zero(void* dst, std::uint64_t bytes) override { PEFTPLAN_CUDA(cudaMemsetAsync(dst, 0, bytes, h_.stream)); }
  void reset_device_memory_peak() override {
    synchronize();
    device_memory_.reset_peak();
  }
  std::optional<MemoryKinds> device_memory_kinds() override {
    std::size_t free = 0, total = 0;
    PEFTPLAN_CUDA(cudaMemGetInfo(&free, &total));
    return MemoryKinds{device_memory_.reserved_high(), total - free, total};
  }
  void synchronize() override {
    PEFTPLAN_CUDA(cudaStreamSynchronize(h_.copy_stream));
    PEFTPLAN_CUDA(cudaStreamSynchronize(h_.stream));
  }

  void reserve_marks(std::size_t slots) override {
    while (h_.marks.size() < slots) {
      cudaEvent_t e;
      PEFTPLAN_CUDA(cudaEventCreate(&e));
      h_.marks.push_back(e);
    }
  }
  void record_mark(std::size_t slot) override { PEFTPLAN_CUDA(cudaEventRecord(h_.marks.at(slot), h_.stream)); }

  // The copy queue (backend.h): a second stream. Host buffers are pinned (host_memory()), so
  // cudaMemcpyAsync returns at once and the copy engine moves the bytes while kernels run
  // (CUDA C++ Programming Guide, "Asynchronous Concurrent Execution": a copy from pageable memory
  // is staged and may serialise with the host).
  void copy_async(void* dst, const void* src, std::uint64_t bytes) override {
    PEFTPLAN_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, h_.copy_stream));
  }
  void record_copy_mark(std::size_t slot) override { PEFTPLAN_CUDA(cudaEventRecord(h_.marks.at(slot), h_.copy_stream)); }
  void wait_mark(Queue waiter, std::size_t slot) override {
    PEFTPLAN_CUDA(cudaStreamWaitEvent(waiter == Queue::copy ? h_.copy_stream : h_.stream, h_.marks.at(slot), 0));
  }
  void wait_mark_on_host(std::size_t slot) override { PEFTPLAN_CUDA(cudaEventSynchronize(h_.marks.at(slot))); }
  double seconds_between(std::size_t from, std::size_t to) override {
    float ms = 0.0f;
    PEFTPLAN_CUDA(cudaEventElapsedTime(&ms, h_.marks.at(from), h_.marks.at(to)));
    return ms / 1000.0;
  }

  bool supports_storage(DType d) const override { return d == DType::fp32 || d == DType::bf16 || d == DType::fp16; }
  void convert(const void* src, DType from, void* dst, DType to, Index n) override {
    if (!supports_storage(from) || !supports_storage(to))
      throw InternalError(fmt::format("the cuda backend converts fp32, bf16 and fp16, not {} to {}", name_of(from), name_of(to)));
    if (n == 0) return;
    if (from == to) return copy_device(dst, src, storage_bytes(to, n));
    PEFTPLAN_LAUNCH(cuda::convert(h_.stream, src, storage_of(from), dst, storage_of(to), n));
  }

  // fp32 and bf16: the GEMMs below and every kernel of cuda_kernels.cu take either storage; fp16 is
  // converted (supports_storage) but not computed on.
  bool supports_compute(DType dt) const override { return dt == DType::fp32 || dt == DType::bf16; }

  // ------------------------------------------------------------------------------ GEMMs
  // y[M,N] (=|+=) x[M,K]·W[N,K]ᵀ (+ bias): yᵀ = W·xᵀ. In fp32 the bias is added after the product
  // (cuBLAS then the bias kernel). In bf16 that would round y twice, so an overwritten y starts as
  // the bias rows and the GEMM adds its product to them (beta 1): x·Wᵀ + bias summed in fp32,
  // rounded once. An accumulated y with a bias (the program builder accumulates only backward
  // ops, planner/builder_graph.cpp) still takes the bias after the product: two roundings in bf16.
  void linear_forward(DType dt, const void* x, const void* W, const void* bias, void* y, Index M, Index K, Index N,
                      bool accumulate) override {
    const cuda::Storage st = compute_storage(dt, __func__);
    if (bias != nullptr && !accumulate && st == cuda::Storage::bf16) {
      PEFTPLAN_LAUNCH(cuda::broadcast_bias(h_.stream, st, y, bias, M, N));
      gemm(st, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, 1.0f, W, K, x, K, 1.0f, y, N);
      return;
    }
    gemm(st, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, 1.0f, W, K, x, K, accumulate ? 1.0f : 0.0f, y, N);
    if (bias != nullptr) {
      PEFTPLAN_LAUNCH(cuda::add_bias(h_.stream, st, y, bias, M, N));
    }
  }
  // dx[M,K] (=|+=) dy[M,N]·W[N,K]: dxᵀ = Wᵀ·dyᵀ.
  void linear_backward_input(DType dt, const void* dy, const void* W, void* dx, Index M, Index K, Index N,
                             bool accumulate) override {
    const cuda::Storage st = compute_storage(dt, __func__);
    gemm(st, CUBLAS_OP_N, CUBLAS_OP_N, K, M, N, 1.0f, W, K, dy, N, accumulate ? 1.0f : 0.0f, dx, K);
  }
  void dropout_forward(DType dt, const void* x, void* out, Index n, const DropoutKey& key) override {
    const cuda::Storage st = compute_storage(dt, __func__);
    PEFTPLAN_LAUNCH(cuda::dropout(h_.stream, st, x, out, n, splitmix64(key.seed), key.p));
  }
  // u[M,r] = x_in·Aᵀ; y[M,N] += scale·u·Bᵀ. u is stored (rounded to dt) by the first product and
  // the second reads it as stored (backend.h; PEFT's lora_B(lora_A(x)) in bf16 rounds u alike).
  void lora_forward(DType dt, const void* x_in, const void* A, const void* B, float scale, void* u, void* y, Index M,
                    Index K, Index N, Index r) override {
    const cuda::Storage st = compute_storage(dt, __func__);
    gemm(st, CUBLAS_OP_T, CUBLAS_OP_N, r, M, K, 1.0f, A, K, x_in, K, 0.0f, u, r);
    gemm(st, CUBLAS_OP_T, CUBLAS_OP_N, N, M, r, scale, B, r, u, r, 1.0f, y, N);
  }
  // du = scale·dy·B (scratch[0, M·r), in dt); dB += scale·dyᵀ·u; dA += duᵀ·x_in (du as stored);
  // dx += drop'(du·A), with dropout through scratch[M·r, M·r + M·K) (in dt) and the mask kernel.
  void lora_backward(DType dt, const void* dy, const void* x_in, const void* A, const void* B, const void* u,
                     float scale, const DropoutKey& key, void* dA, void* dB, void* dx, void* scratch, Index M, Index K,
                     Index N, Index r) override {
    const cuda::Storage st = compute_storage(dt, __func__);
    void* du = scratch;
    gemm(st, CUBLAS_OP_N, CUBLAS_OP_N, r, M, N, scale, B, r, dy, N, 0.0f, du, r);
    gemm(st, CUBLAS_OP_N, CUBLAS_OP_T, r, N, M, scale, u, r, dy, N, 1.0f, dB, r);
    gemm(st, CUBLAS_OP_N, CUBLAS_OP_T, K, r, M, 1.0f, x_in, K, du, r, 1.0f, dA, K);
    if (dx == nullptr) return;
    if (key.p <= 0.0) {
      gemm(st, CUBLAS_OP_N, CUBLAS_OP_N, K, M, r, 1.0f, A, K, du, r, 1.0f, dx, K);
      return;
    }
    void* g = at(scratch, M * r, dt);
    gemm(st, CUBLAS_OP_N, CUBLAS_OP_N, K, M, r, 1.0f, A, K, du, r, 0.0f, g, K);
    PEFTPLAN_LAUNCH(cuda::dropout_backward_add(h_.stream, st, g, dx, M * K, splitmix64(key.seed), key.p));
  }

  // ------------------------------------------------------------------------- row kernels
  void rmsnorm_forward(DType dt, const void* x, const void* w, float eps, void* y, float* rstd, Index M,
                       Index H) override {
    const cuda::Storage st = compute_storage(dt, __func__);
    PEFTPLAN_LAUNCH(cuda::rmsnorm_forward(h_.stream, st, x, w, eps, y, rstd, M, H));
  }
  void rmsnorm_backward(DType dt, const void* dy, const void* x, const void* w, const float* rstd, void* dx, Index M,
                        Index H, bool accumulate) override {
    const cuda::Storage st = compute_storage(dt, __func__);
    PEFTPLAN_LAUNCH(cuda::rmsnorm_backward(h_.stream, st, dy, x, w, rstd, dx, M, H, accumulate));
  }
  // The tables are made once per run: computed on the host by the CPU kernel (HF's fp32 formula,
  // kernels.h rope_tables) and uploaded, so both backends rotate by the very same angles.
  void rope_tables(float* tables, Index S, Index d, double theta) override {
    const Index half = cpu::rope_table_elems(S, d);
    std::vector<float> host(static_cast<std::size_t>(2 * half));
    cpu::rope_tables(host.data(), host.data() + half, S, d, theta);
    copy_to_device(tables, host.data(), host.size() * sizeof(float));
  }
  void rope_forward(DType dt, void* x, const float* tables, Index B, Index S, Index nheads, Index d) override {
    rope(compute_storage(dt, __func__), x, tables, B, S, nheads, d, 1.0f);
  }
  void rope_backward(DType dt, void* dx, const float* tables, Index B, Index S, Index nheads, Index d) override {
    rope(compute_storage(dt, __func__), dx, tables, B, S, nheads, d, -1.0f);
  }

  // Eager causal GQA attention. Per (batch, kv head), the rep = nh/nkv query heads that share it
  // are one strided-batched GEMM (their q columns are d apart; k and v are shared: stride 0):
  //   scores P_h = q_h·kᵀ·(1/√d)   → Pᵀ = k·q_hᵀ        gemm(T, N)
  //   out_h = P_h·v                → out_hᵀ = vᵀ·P_hᵀ    gemm(N, N)
  // with the causal softmax between them over all B·nh·S rows. P is stored in dt: in bf16 the
  // scores are rounded as the first GEMM stores them and the softmax (fp32 inside) rounds the
  // probabilities once more, like HF's eager attention in bf16 (bf16 scores from its matmul, then
  // softmax(dtype=torch.float32).to(bf16); its 1/√d is a separate multiply, here the GEMM's alpha).
  void attention_forward(DType dt, const void* q, const void* k, const void* v, void* P, void* out, Index B, Index S,
                         Index nh, Index nkv, Index d) override {
    const cuda::Storage st = compute_storage(dt, __func__);
    PEFTPLAN_CHECK_MSG(nkv > 0 && nh % nkv == 0, "heads {} not a multiple of kv heads {}", nh, nkv);
    const Index rep = nh / nkv;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (Index b = 0; b < B; ++b)
      for (Index kvh = 0; kvh < nkv; ++kvh) {
        const Index h0 = kvh * rep;
        gemm_batched(st, CUBLAS_OP_T, CUBLAS_OP_N, S, S, d, scale, head(k, b, kvh, S, nkv, d, dt), nkv * d, 0,
                     head(q, b, h0, S, nh, d, dt), nh * d, d, 0.0f, at(P, (b * nh + h0) * S * S, dt), S, S * S, rep);
      }
    PEFTPLAN_LAUNCH(cuda::causal_softmax(h_.stream, st, P, B * nh * S, S));
    for (Index b = 0; b < B; ++b)
      for (Index kvh = 0; kvh < nkv; ++kvh) {
        const Index h0 = kvh * rep;
        gemm_batched(st, CUBLAS_OP_N, CUBLAS_OP_N, d, S, S, 1.0f, head(v, b, kvh, S, nkv, d, dt), nkv * d, 0,
                     at(P, (b * nh + h0) * S * S, dt), S, S * S, 0.0f, head(out, b, h0, S, nh, d, dt), nh * d, d, rep);
      }
  }
  // Backward per (batch, kv head), in groups of at most `workers` query heads (scratch holds one
  // S×S dP per worker, in dt: scratch_elems counts elements of dt):
  //   dP_h = dout_h·vᵀ       → dP_hᵀ = v·dout_hᵀ      gemm(T, N), batched
  //   dS_h = softmax'(P_h, dP_h)·(1/√d)                k_softmax_backward
  //   dq_h = dS_h·k          → dq_hᵀ = kᵀ·dS_hᵀ       gemm(N, N), batched
  //   dv += P_hᵀ·dout_h      → dvᵀ += dout_hᵀ·P_h     gemm(N, T), one head at a time (shared output)
  //   dk += dS_hᵀ·q_h        → dkᵀ += q_hᵀ·dS_h       gemm(N, T), one head at a time
  // In bf16, dP and dS are rounded as they are stored in the scratch, and dk, dv once per query head
  // that adds into them (rep roundings where nh > nkv).
  void attention_backward(DType dt, const void* dout, const void* q, const void* k, const void* v, const void* P,
                          void* dq, void* dk, void* dv, void* scratch, Index scratch_elems, Index B, Index S, Index nh,
                          Index nkv, Index d) override {
    const cuda::Storage st = compute_storage(dt, __func__);
    PEFTPLAN_CHECK_MSG(nkv > 0 && nh % nkv == 0, "heads {} not a multiple of kv heads {}", nh, nkv);
    const Index workers = scratch_elems / (S * S);
    PEFTPLAN_CHECK_MSG(workers >= 1, "attention backward scratch {} < S*S = {}", scratch_elems, S * S);
    const Index rep = nh / nkv;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (Index b = 0; b < B; ++b)
      for (Index kvh = 0; kvh < nkv; ++kvh) {
        const void* kk = head(k, b, kvh, S, nkv, d, dt);
        const void* vv = head(v, b, kvh, S, nkv, d, dt);
        void* dkk = head(dk, b, kvh, S, nkv, d, dt);
        void* dvv = head(dv, b, kvh, S, nkv, d, dt);
        for (Index g0 = 0; g0 < rep; g0 += workers) {
          const Index heads = std::min(workers, rep - g0), h0 = kvh * rep + g0;
          const void* Ph = at(P, (b * nh + h0) * S * S, dt);
          gemm_batched(st, CUBLAS_OP_T, CUBLAS_OP_N, S, S, d, 1.0f, vv, nkv * d, 0, head(dout, b, h0, S, nh, d, dt),
                       nh * d, d, 0.0f, scratch, S, S * S, heads);
          PEFTPLAN_LAUNCH(cuda::softmax_backward(h_.stream, st, Ph, scratch, heads * S, S, scale));
          gemm_batched(st, CUBLAS_OP_N, CUBLAS_OP_N, d, S, S, 1.0f, kk, nkv * d, 0, scratch, S, S * S, 0.0f,
                       head(dq, b, h0, S, nh, d, dt), nh * d, d, heads);
          for (Index j = 0; j < heads; ++j) {
            const float first = g0 + j == 0 ? 0.0f : 1.0f;  // the first head overwrites dk, dv
            gemm(st, CUBLAS_OP_N, CUBLAS_OP_T, d, S, S, 1.0f, head(dout, b, h0 + j, S, nh, d, dt), nh * d,
                 at(Ph, j * S * S, dt), S, first, dvv, nkv * d);
            gemm(st, CUBLAS_OP_N, CUBLAS_OP_T, d, S, S, 1.0f, head(q, b, h0 + j, S, nh, d, dt), nh * d,
                 at(scratch, j * S * S, dt), S, first, dkk, nkv * d);
          }
        }
      }
  }

  // Flash attention (kernels.h §5b; Dao, FlashAttention-2, 2023, Algorithms 1 and 2): one fused
  // kernel forward, two backward (dq by query tile; dk, dv by key tile over the kv head's query
  // heads), tiles in shared memory and registers, no scratch and no atomics. The operands are in
  // dt, lse in fp32; the tiles are fp32 either way and each output is rounded once.
  void flash_attention_forward(DType dt, const void* q, const void* k, const void* v, float* lse, void* out, Index B,
                               Index S, Index nh, Index nkv, Index d) override {
    const cuda::Storage st = compute_storage(dt, __func__);
    check_flash_shape(B, S, nh, nkv, d);
    PEFTPLAN_LAUNCH(cuda::flash_attention_forward(h_.stream, st, q, k, v, lse, out, B, S, nh, nkv, d));
  }
  void flash_attention_backward(DType dt, const void* dout, const void* q, const void* k, const void* v,
                                const void* out, const float* lse, void* dq, void* dk, void* dv, Index B, Index S,
                                Index nh, Index nkv, Index d) override {
    const cuda::Storage st = compute_storage(dt, __func__);
    check_flash_shape(B, S, nh, nkv, d);
    PEFTPLAN_LAUNCH(
        cuda::flash_attention_backward(h_.stream, st, dout, q, k, v, out, lse, dq, dk, dv, B, S, nh, nkv, d));
  }

  // ------------------------------------------------------------------------- elementwise
  void swiglu_forward(DType dt, const void* gate, const void* up, void* act, Index n) override {
    const cuda::Storage st = compute_storage(dt, __func__);
    PEFTPLAN_LAUNCH(cuda::swiglu_forward(h_.stream, st, gate, up, act, n));
  }
  void swiglu_backward(DType dt, const void* dact, const void* gate, const void* up, void* dgate, void* dup,
                       Index n) override {
    const cuda::Storage st = compute_storage(dt, __func__);
    PEFTPLAN_LAUNCH(cuda::swiglu_backward(h_.stream, st, dact, gate, up, dgate, dup, n));
  }
  void embedding_forward(DType dt, const std::int32_t* tokens, const void* table, void* out, Index M, Index,
                         Index H) override {
    const cuda::Storage st = compute_storage(dt, __func__);
    PEFTPLAN_LAUNCH(cuda::embedding(h_.stream, st, tokens, table, out, M, H));
  }
  void cross_entropy_forward(DType dt, const void* logits, const std::int32_t* targets, Index M, Index V,
                             double* loss_sum) override {
    const cuda::Storage st = compute_storage(dt, __func__);
    PEFTPLAN_LAUNCH(cuda::cross_entropy(h_.stream, st, logits, targets, nullptr, 0.0, M, V, loss_sum));
  }
  // The loss sum of the backward pass is not returned through the Backend (the forward's is);
  // it goes to a scratch scalar of the backend's own.
  void cross_entropy_backward(DType dt, const void* logits, const std::int32_t* targets, void* dlogits, double count,
                              Index M, Index V) override {
    const cuda::Storage st = compute_storage(dt, __func__);
    PEFTPLAN_CHECK_MSG(count > 0, "cross-entropy token count must be positive, got {}", count);
    PEFTPLAN_LAUNCH(
        cuda::cross_entropy(h_.stream, st, logits, targets, dlogits, 1.0 / count, M, V, h_.discarded_loss));
  }
  void add(DType dt, const void* a, const void* b, void* out, Index n) override {
    const cuda::Storage st = compute_storage(dt, __func__);
    PEFTPLAN_LAUNCH(cuda::add(h_.stream, st, a, b, out, n));
  }
  void sum_squares(DType dt, const void* x, Index n, double* out) override {
    const cuda::Storage st = compute_storage(dt, __func__);
    PEFTPLAN_LAUNCH(cuda::sum_squares(h_.stream, st, x, n, out));
  }
  void scale(DType dt, void* x, float s, Index n) override {
    const cuda::Storage st = compute_storage(dt, __func__);
    PEFTPLAN_LAUNCH(cuda::scale(h_.stream, st, x, s, n));
  }
  void adamw_step(float* param, const float* grad, float* m, float* v, Index n, std::int64_t step, double lr,
                  double beta1, double beta2, double eps, double weight_decay) override {
    const AdamWScalars d = adamw_scalars(step, lr, AdamWConfig{beta1, beta2, eps, weight_decay});
    const cuda::AdamWScalars c{static_cast<float>(d.decay),         static_cast<float>(d.lerp_w),
                               static_cast<float>(d.beta2),         static_cast<float>(d.one_m_beta2),
                               static_cast<float>(d.neg_step_size), static_cast<float>(d.bc2_sqrt),
                               static_cast<float>(d.eps),           d.decoupled};
    PEFTPLAN_LAUNCH(cuda::adamw(h_.stream, param, grad, m, v, n, c));
  }

 private:
  // The kernels' storage for compute dtype `dt`; a dtype supports_compute refuses (fp16, the
  // quantised dtypes) is an InternalError naming the backend, the method and the dtype.
  cuda::Storage compute_storage(DType dt, const char* method) const {
    if (!supports_compute(dt))
      throw InternalError(fmt::format("cuda backend: {}: compute dtype {} is not supported (fp32 and bf16 are)", method,
                                      name_of(dt)));
    return storage_of(dt);
  }

  // Column-major gemm on the compute stream: C[m,n] = alpha·op(A)·op(B) + beta·C, A, B and C in
  // the storage `st`, alpha and beta fp32.
  //   fp32: cublasSgemm, full fp32 (CUBLAS_DEFAULT_MATH: no TF32), as before bf16 existed.
  //   bf16: cublasGemmEx with Atype = Btype = Ctype = CUDA_R_16BF, computeType CUBLAS_COMPUTE_32F
  //     and scale type CUDA_R_32F (float alpha, beta): one of the combinations the cuBLAS
  //     documentation's "cublasGemmEx()" table of supported computeType / scaleType / Atype/Btype /
  //     Ctype lists. The products are summed in fp32 and C (beta·C included) rounded to bf16 once,
  //     on store; the handle's CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION (constructor) keeps
  //     split-K partial sums in fp32 too. CUBLAS_GEMM_DEFAULT lets cuBLAS pick the algorithm.
  void gemm(cuda::Storage st, cublasOperation_t ta, cublasOperation_t tb, Index m, Index n, Index k, float alpha,
            const void* A, Index lda, const void* B, Index ldb, float beta, void* C, Index ldc) {
    if (m == 0 || n == 0) return;
    if (st == cuda::Storage::fp32) {
      PEFTPLAN_CUBLAS(cublasSgemm(h_.blas, ta, tb, to_int(m, "m"), to_int(n, "n"), to_int(k, "k"), &alpha,
                                  static_cast<const float*>(A), to_int(lda, "lda"), static_cast<const float*>(B),
                                  to_int(ldb, "ldb"), &beta, static_cast<float*>(C), to_int(ldc, "ldc")));
      return;
    }
    const cudaDataType t = blas_type(st);
    PEFTPLAN_CUBLAS(cublasGemmEx(h_.blas, ta, tb, to_int(m, "m"), to_int(n, "n"), to_int(k, "k"), &alpha, A, t,
                                 to_int(lda, "lda"), B, t, to_int(ldb, "ldb"), &beta, C, t, to_int(ldc, "ldc"),
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  // The same over `batch` products whose operands are sa, sb, sc elements apart (cuBLAS
  // documentation, "cublasGemmStridedBatchedEx()": the types and compute type of cublasGemmEx's
  // table).
  void gemm_batched(cuda::Storage st, cublasOperation_t ta, cublasOperation_t tb, Index m, Index n, Index k,
                    float alpha, const void* A, Index lda, Index sa, const void* B, Index ldb, Index sb, float beta,
                    void* C, Index ldc, Index sc, Index batch) {
    if (m == 0 || n == 0 || batch == 0) return;
    if (st == cuda::Storage::fp32) {
      PEFTPLAN_CUBLAS(cublasSgemmStridedBatched(h_.blas, ta, tb, to_int(m, "m"), to_int(n, "n"), to_int(k, "k"),
                                                &alpha, static_cast<const float*>(A), to_int(lda, "lda"), sa,
                                                static_cast<const float*>(B), to_int(ldb, "ldb"), sb, &beta,
                                                static_cast<float*>(C), to_int(ldc, "ldc"), sc,
                                                to_int(batch, "batch")));
      return;
    }
    const cudaDataType t = blas_type(st);
    PEFTPLAN_CUBLAS(cublasGemmStridedBatchedEx(h_.blas, ta, tb, to_int(m, "m"), to_int(n, "n"), to_int(k, "k"), &alpha,
                                               A, t, to_int(lda, "lda"), sa, B, t, to_int(ldb, "ldb"), sb, &beta, C,
                                               t, to_int(ldc, "ldc"), sc, to_int(batch, "batch"), CUBLAS_COMPUTE_32F,
                                               CUBLAS_GEMM_DEFAULT));
  }
  // cuBLAS's name of a 16-bit storage the Ex GEMMs take (bf16 only: compute_storage refuses fp16).
  static cudaDataType blas_type(cuda::Storage st) {
    if (st == cuda::Storage::bf16) return CUDA_R_16BF;
    throw InternalError("cuda backend: the Ex GEMMs take bf16 operands only");
  }
  // Element i of a buffer of dt (device pointers are byte addresses).
  static const void* at(const void* p, Index i, DType dt) {
    return static_cast<const char*>(p) + i * static_cast<Index>(bytes_of(dt));
  }
  static void* at(void* p, Index i, DType dt) { return static_cast<char*>(p) + i * static_cast<Index>(bytes_of(dt)); }
  // Head h of batch b in [B,S,heads,d] (row stride heads·d) of dt.
  static const void* head(const void* t, Index b, Index h, Index S, Index heads, Index d, DType dt) {
    return at(t, b * S * heads * d + h * d, dt);
  }
  static void* head(void* t, Index b, Index h, Index S, Index heads, Index d, DType dt) {
    return at(t, b * S * heads * d + h * d, dt);
  }
  // The shapes the flash kernels take (cuda_kernels.h flash_shape_refusal), said in words where the
  // launcher would only return cudaErrorInvalidValue.
  static void check_flash_shape(Index B, Index S, Index nh, Index nkv, Index d) {
    const char* why = cuda::flash_shape_refusal(B, S, nh, nkv, d);
    PEFTPLAN_CHECK_MSG(why == nullptr, "cuda flash attention: {} (B {}, S {}, heads {}, kv heads {}, head_dim {}); plan with "
                       "--attention eager for this model", why ? why : "", B, S, nh, nkv, d);
  }
  void rope(cuda::Storage st, void* x, const float* tables, Index B, Index S, Index nheads, Index d, float sign) {
    const Index half = cpu::rope_table_elems(S, d);
    PEFTPLAN_LAUNCH(cuda::rope(h_.stream, st, x, tables, tables + half, B, S, nheads, d, sign));
  }

  int device_ = 0;
  cudaDeviceProp props_{};
  std::uint64_t workspace_bytes_ = 0;
  int cublas_version_ = 0;
  Handles h_;  // before the memory sources: released after them
  DeviceMemory device_memory_;
  PinnedHostMemory host_memory_;
};

}  // namespace

bool cuda_backend_built() { return true; }

std::string cuda_backend_unavailable() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fmt::format("no CUDA device: {}", cudaGetErrorString(e));
  }
  if (count == 0) return "no CUDA device";
  return {};
}

namespace {

// The first of the launchers' variables that is set (Open MPI's mpirun, MPICH/Hydra, Slurm's srun,
// torchrun),
// as an integer; nullopt when launched alone.
std::optional<int> launcher_int(std::initializer_list<const char*> vars) {
  for (const char* var : vars)
    if (const char* v = std::getenv(var); v != nullptr && *v != '\0') return std::atoi(v);
  return std::nullopt;
}
// This rank's place among the ranks on its node.
std::optional<int> local_rank() {
  return launcher_int({"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"});
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() {
  if (const std::string why = cuda_backend_unavailable(); !why.empty())
    throw InputError(fmt::format("backend cuda: {}", why));
  // The node's k-th rank on its k-th device, round robin when the node has more ranks than
  // devices (they then share one: peftplan-exec's world_for sees it in device_identity and runs
  // the collectives through host staging, since NCCL refuses two ranks on one GPU). A launcher
  // that gives each rank one device of its own (CUDA_VISIBLE_DEVICES per rank, Slurm's
  // --gpus-per-task) leaves each rank one device to use.
  if (const std::optional<int> k = local_rank(); k && *k >= 0) {
    int count = 0;
    PEFTPLAN_CUDA(cudaGetDeviceCount(&count));
    PEFTPLAN_CUDA(cudaSetDevice(*k % count));
  }
  return std::make_unique<CudaBackend>();
}

}  // namespace peftplan::executor
