#pragma once
// Streams and events with one interface on both backends. On CUDA they wrap cudaStream_t and
// cudaEvent_t; on the CPU work is synchronous, so a stream is a label and an event is always
// complete (it still records a wall-clock time for timing).
#include <chrono>
#include <cstdint>
#include <memory>

#include "engine/core/device.h"

namespace conveyor {

class Stream {
 public:
  // A new stream on `device` (a fresh non-blocking CUDA stream, or a CPU label).
  explicit Stream(Device device);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  Stream(Stream&&) noexcept;
  Stream& operator=(Stream&&) noexcept;

  Device device() const { return device_; }
  // cudaStream_t on CUDA, null on the CPU.
  void* native() const { return handle_; }
  // Unique id of this stream among live streams (used by the allocator to tag blocks).
  uint64_t id() const { return id_; }
  void synchronize() const;
  // True when all work enqueued so far is done (always on the CPU). Never blocks; a busy
  // stream is an answer, not an error, and leaves no error behind for later CUDA checks.
  bool query() const;

 private:
  Device device_;
  void* handle_ = nullptr;
  uint64_t id_ = 0;
};

class Event {
 public:
  explicit Event(Device device, bool timing = true);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  Event(Event&&) noexcept;
  Event& operator=(Event&&) noexcept;

  void record(const Stream& stream);
  // Makes `stream` wait (on the device, not the host) until this event has completed.
  void wait(const Stream& stream) const;
  void synchronize() const;
  bool query() const;  // true when complete
  // Milliseconds between two recorded events (both must be complete).
  static float elapsed_ms(const Event& start, const Event& end);
  void* native() const { return handle_; }

 private:
  Device device_;
  void* handle_ = nullptr;
  std::chrono::steady_clock::time_point cpu_time_{};
};

}  // namespace conveyor
