// A communicator that moves a device backend's buffers through host memory for a communicator
// that reads host memory only (communicator.h make_staging_communicator): what two ranks sharing
// one GPU run on, since NCCL refuses two ranks on one GPU ("Duplicate GPU detected").
//
// Each operation copies its input into a host buffer of its own with the backend
// (Backend::copy_to_host, which waits for the kernels that wrote it), runs the host
// communicator's operation in place there, and copies the result back
// (Backend::copy_to_device) in its request's wait() — which the runner calls before anything
// reads the result; done() only asks the host communicator, so it never blocks on the device. The in-place layouts are NCCL's (communicator.h): a
// reduce_scatter's block at rank · recv_count of the whole array, an all_gather's at
// rank · send_count. Host pointers are staged too (a copy between host buffers), so the runner's
// scalar reductions need no special case. Counters, the progress board and the refusals are the
// host communicator's.
#include <cstddef>
#include <exception>
#include <memory>
#include <string>
#include <utility>

#include "peftplan/common/error.h"
#include "peftplan/executor/backend.h"
#include "peftplan/executor/communicator.h"

namespace peftplan::executor {
namespace {

// A staging buffer: bytes left uninitialised (every byte read is first written by a copy or by
// the host communicator).
struct HostBytes {
  std::unique_ptr<std::byte[]> data;
  std::size_t size = 0;
  explicit HostBytes(std::size_t n) : data(new std::byte[n == 0 ? 1 : n]), size(n) {}
  std::byte* get() const { return data.get(); }
};

class StagedRequest final : public CommRequest {
 public:
  StagedRequest(std::unique_ptr<CommRequest> inner, Backend& be, HostBytes buf, void* out, std::size_t out_offset,
                std::size_t out_bytes)
      : inner_(std::move(inner)), be_(be), buf_(std::move(buf)), out_(out), out_offset_(out_offset), out_bytes_(out_bytes) {}
  ~StagedRequest() override {
    if (std::uncaught_exceptions() > 0) {
      // While an error unwinds, the host request does not wait either (MPI's returns at once),
      // so its thread may still write the buffer: leave it allocated; the job is being aborted.
      if (!settled_) (void)buf_.data.release();
      return;
    }
    try {
      wait();
    } catch (...) {
      // A destructor does not throw; the failure was reported where the request was waited for.
    }
  }

  void wait() override {
    settle();  // blocks in the host request's wait when it is still running
    if (error_) std::rethrow_exception(error_);
  }
  bool done() override { return settled_ || inner_->done(); }
  // The host communicator's time for the operation; the staging copies are the runner's waits.
  double seconds() override { return inner_->seconds(); }

 private:
  // Once: the host request's outcome (its wait, called once as communicator.h asks), then the
  // result copied to the caller's buffer; a failure is kept for wait() to rethrow.
  void settle() {
    if (settled_) return;
    settled_ = true;
    try {
      inner_->wait();
      if (out_bytes_ > 0) be_.copy_to_device(out_, buf_.get() + out_offset_, out_bytes_);
    } catch (...) {
      error_ = std::current_exception();
    }
  }

  std::unique_ptr<CommRequest> inner_;
  Backend& be_;
  HostBytes buf_;
  void* out_;
  std::size_t out_offset_, out_bytes_;
  bool settled_ = false;
  std::exception_ptr error_;
};

class StagingCommunicator final : public Communicator {
 public:
  StagingCommunicator(std::unique_ptr<Communicator> host, Backend& be)
      : host_(std::move(host)), be_(be), name_(std::string(host_->backend()) + "+staging") {}

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  std::string_view backend() const override { return name_; }

  std::unique_ptr<CommRequest> all_reduce_async(const void* send, void* recv, std::size_t count, CommDType dtype,
                                                ReduceOp op) override {
    const std::size_t bytes = count * bytes_of(dtype);
    HostBytes buf(bytes);
    stage_in(buf.get(), send, bytes);
    auto inner = host_->all_reduce_async(buf.get(), buf.get(), count, dtype, op);
    return std::make_unique<StagedRequest>(std::move(inner), be_, std::move(buf), recv, 0, bytes);
  }

  std::unique_ptr<CommRequest> reduce_scatter_async(const void* send, void* recv, std::size_t recv_count, CommDType dtype,
                                                    ReduceOp op) override {
    const std::size_t block = recv_count * bytes_of(dtype), mine = static_cast<std::size_t>(rank()) * block;
    HostBytes buf(block * static_cast<std::size_t>(size()));
    stage_in(buf.get(), send, buf.size);
    auto inner = host_->reduce_scatter_async(buf.get(), buf.get() + mine, recv_count, dtype, op);
    return std::make_unique<StagedRequest>(std::move(inner), be_, std::move(buf), recv, mine, block);
  }

  std::unique_ptr<CommRequest> all_gather_async(const void* send, void* recv, std::size_t send_count, CommDType dtype) override {
    const std::size_t block = send_count * bytes_of(dtype), mine = static_cast<std::size_t>(rank()) * block;
    HostBytes buf(block * static_cast<std::size_t>(size()));
    stage_in(buf.get() + mine, send, block);
    auto inner = host_->all_gather_async(buf.get() + mine, buf.get(), send_count, dtype);
    const std::size_t whole = buf.size;
    return std::make_unique<StagedRequest>(std::move(inner), be_, std::move(buf), recv, 0, whole);
  }

  std::unique_ptr<CommRequest> broadcast_async(const void* send, void* recv, std::size_t count, CommDType dtype, int root) override {
    const std::size_t bytes = count * bytes_of(dtype);
    HostBytes buf(bytes);
    if (rank() == root) stage_in(buf.get(), send, bytes);  // the root's send only is read
    auto inner = host_->broadcast_async(buf.get(), buf.get(), count, dtype, root);
    return std::make_unique<StagedRequest>(std::move(inner), be_, std::move(buf), recv, 0, bytes);
  }

  std::unique_ptr<CommRequest> barrier_async() override { return host_->barrier_async(); }

  std::unique_ptr<Communicator> split(int color, int key) override {
    std::unique_ptr<Communicator> part = host_->split(color, key);
    if (!part) return nullptr;
    return std::make_unique<StagingCommunicator>(std::move(part), be_);
  }

  ProgressBoard* progress() override { return host_->progress(); }
  CommCounters counters() const override { return host_->counters(); }
  void reset_counters() override { host_->reset_counters(); }

 private:
  void stage_in(std::byte* dst, const void* src, std::size_t bytes) {
    if (bytes > 0) be_.copy_to_host(dst, src, bytes);
  }

  std::unique_ptr<Communicator> host_;
  Backend& be_;
  std::string name_;
};

}  // namespace

std::unique_ptr<Communicator> make_staging_communicator(std::unique_ptr<Communicator> host, Backend& backend) {
  PEFTPLAN_CHECK_MSG(host != nullptr, "make_staging_communicator needs a host communicator");
  return std::make_unique<StagingCommunicator>(std::move(host), backend);
}

}  // namespace peftplan::executor
