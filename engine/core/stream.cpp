#include "engine/core/stream.h"

#include <atomic>
#include <stdexcept>
#include <string>
#include <utility>

#ifdef CONVEYOR_WITH_CUDA
#include <cuda_runtime_api.h>

#include "engine/core/cuda_device_guard.h"
#include "kernels/cuda_check.h"
#endif

namespace conveyor {
namespace {

uint64_t next_stream_id() {
  static std::atomic<uint64_t> counter{0};
  return ++counter;  // ids start at 1; 0 marks a moved-from stream
}

[[noreturn]] void throw_no_cuda(Device device) {
  throw std::runtime_error("cannot use " + device.to_string() +
                           ": this binary was built without the CUDA backend");
}

#ifdef CONVEYOR_WITH_CUDA
// The answer of cudaStreamQuery / cudaEventQuery: done, or not yet. The runtime keeps "not
// ready" as the thread's last error, and the next kernel-launch check on this thread would
// throw it, so it is cleared here; any other error throws, naming `call`.
bool finished(cudaError_t status, const char* call) {
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  if (status != cudaSuccess) kernels::cuda::throw_cuda_error(status, call, __FILE__, __LINE__);
  return true;
}
#endif

void check_same_device(Device a, Device b, const char* what) {
  if (!(a == b))
    throw std::invalid_argument(std::string(what) + ": event is on " + a.to_string() +
                                " but the stream is on " + b.to_string());
}

}  // namespace

// ---------------------------------------------------------------------------------- Stream

Stream::Stream(Device device) : device_(device), id_(next_stream_id()) {
  if (device.is_cpu()) return;
#ifdef CONVEYOR_WITH_CUDA
  detail::CudaDeviceGuard guard(device.index);
  cudaStream_t stream = nullptr;
  // Non-blocking: our streams must not serialise with the legacy default stream.
  CONVEYOR_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  handle_ = stream;
#else
  throw_no_cuda(device);
#endif
}

Stream::~Stream() {
#ifdef CONVEYOR_WITH_CUDA
  if (handle_ != nullptr) {
    // Wait before destroying: the allocator tags cached blocks with the handle, and a new
    // stream may get the same handle value while this one still has work in flight.
    auto stream = static_cast<cudaStream_t>(handle_);
    (void)cudaStreamSynchronize(stream);
    (void)cudaStreamDestroy(stream);
  }
#endif
}

Stream::Stream(Stream&& other) noexcept
    : device_(other.device_),
      handle_(std::exchange(other.handle_, nullptr)),
      id_(std::exchange(other.id_, 0)) {}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    Stream old(std::move(*this));  // releases our handle at the end of this scope
    device_ = other.device_;
    handle_ = std::exchange(other.handle_, nullptr);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

void Stream::synchronize() const {
#ifdef CONVEYOR_WITH_CUDA
  if (handle_ != nullptr)
    CONVEYOR_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(handle_)));
#endif
}

bool Stream::query() const {
#ifdef CONVEYOR_WITH_CUDA
  if (handle_ != nullptr)
    return finished(cudaStreamQuery(static_cast<cudaStream_t>(handle_)), "cudaStreamQuery");
#endif
  return true;
}

// ----------------------------------------------------------------------------------- Event

Event::Event(Device device, bool timing) : device_(device) {
  if (device.is_cpu()) return;
#ifdef CONVEYOR_WITH_CUDA
  detail::CudaDeviceGuard guard(device.index);
  cudaEvent_t event = nullptr;
  CONVEYOR_CUDA_CHECK(
      cudaEventCreateWithFlags(&event, timing ? cudaEventDefault : cudaEventDisableTiming));
  handle_ = event;
#else
  throw_no_cuda(device);
#endif
}

Event::~Event() {
#ifdef CONVEYOR_WITH_CUDA
  if (handle_ != nullptr) (void)cudaEventDestroy(static_cast<cudaEvent_t>(handle_));
#endif
}

Event::Event(Event&& other) noexcept
    : device_(other.device_),
      handle_(std::exchange(other.handle_, nullptr)),
      cpu_time_(other.cpu_time_) {}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    Event old(std::move(*this));
    device_ = other.device_;
    handle_ = std::exchange(other.handle_, nullptr);
    cpu_time_ = other.cpu_time_;
  }
  return *this;
}

void Event::record(const Stream& stream) {
  check_same_device(device_, stream.device(), "Event::record");
  if (device_.is_cpu()) {
    cpu_time_ = std::chrono::steady_clock::now();
    return;
  }
#ifdef CONVEYOR_WITH_CUDA
  detail::CudaDeviceGuard guard(device_.index);
  CONVEYOR_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(handle_),
                                      static_cast<cudaStream_t>(stream.native())));
#endif
}

void Event::wait(const Stream& stream) const {
  if (device_.is_cpu() && stream.device().is_cpu()) return;  // CPU work is already done
#ifdef CONVEYOR_WITH_CUDA
  if (device_.is_cpu()) return;  // a CPU event is always complete
  if (stream.device().is_cpu()) {
    synchronize();  // a CPU stream "waits" by blocking the host
    return;
  }
  // Cross-device waits are allowed by CUDA; the current device must be the stream's.
  detail::CudaDeviceGuard guard(stream.device().index);
  CONVEYOR_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream.native()),
                                          static_cast<cudaEvent_t>(handle_), 0));
#endif
}

void Event::synchronize() const {
#ifdef CONVEYOR_WITH_CUDA
  if (handle_ != nullptr)
    CONVEYOR_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(handle_)));
#endif
}

bool Event::query() const {
#ifdef CONVEYOR_WITH_CUDA
  if (handle_ != nullptr)
    return finished(cudaEventQuery(static_cast<cudaEvent_t>(handle_)), "cudaEventQuery");
#endif
  return true;
}

float Event::elapsed_ms(const Event& start, const Event& end) {
  if (!(start.device_ == end.device_))
    throw std::invalid_argument("Event::elapsed_ms: events on different devices (" +
                                start.device_.to_string() + " and " + end.device_.to_string() +
                                ")");
  if (start.device_.is_cpu())
    return std::chrono::duration<float, std::milli>(end.cpu_time_ - start.cpu_time_).count();
  float ms = 0.0f;
#ifdef CONVEYOR_WITH_CUDA
  CONVEYOR_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.handle_),
                                           static_cast<cudaEvent_t>(end.handle_)));
#endif
  return ms;
}

}  // namespace conveyor
