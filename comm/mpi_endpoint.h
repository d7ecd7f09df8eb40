#pragma once
// The MPI transport's class (comm/mpi_transport.h says what it does), shared by the files
// that implement it: mpi_transport.cpp (set-up, point to point, the all-reduce, aborts and
// failure reports), mpi_group_calls.cpp (the data-parallel group calls) and
// mpi_roll_call.cpp. Only comm/mpi_*.cpp include this, in a build with MPI.
#ifdef CONVEYOR_WITH_MPI
#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/transport.h"

namespace conveyor::comm::detail {

using MpiClock = std::chrono::steady_clock;

inline constexpr int kMessageTag = 1;  // every pipeline message: FIFO per link
inline constexpr int kAbortTag = 2;    // the reason a rank aborted
inline constexpr int kCountTag = 3;    // all-reduce value counts: who has come to the all-reduce
inline constexpr int kGroupTag = 4;    // group sums and gathers: FIFO per pair of members
inline constexpr int kScatterTag =
    5;                             // reduce-scatters: sized by the ranges, apart from the others
inline constexpr int kSumTag = 6;  // all-reduce values, after their counts
inline constexpr int kReportTag = 16;     // after a failure: where a rank stood, to the collector
inline constexpr int kReportAckTag = 17;  // the collector is done: a reporter may end its process
inline constexpr int kRollCallTag = 32;   // mpi_roll_call, on MPI_COMM_WORLD

std::string mpi_error_text(int code);

// A request left unfinished past a deadline: a receive is cancelled, and either is freed
// (a send then goes on by itself).
void drop(MPI_Request& request);

// Waits that poll: spin briefly (a message is often a few microseconds away), then yield the
// core, since oversubscribed ranks share cores with the peers they wait for.
class Backoff {
 public:
  void pause() {
    if (++polls_ > 64)
      std::this_thread::sleep_for(std::chrono::microseconds(polls_ > 4096 ? 200 : 20));
  }

 private:
  int polls_ = 0;
};

class MpiTransport : public Transport {
 public:
  explicit MpiTransport(std::chrono::milliseconds timeout);
  ~MpiTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void send(const Tensor& tensor, int peer, const Stream&) override;
  void recv(const Tensor& tensor, int peer, const Stream&) override;
  bool try_recv(const Tensor& tensor, int peer, const Stream&) override;
  void all_reduce_sum(std::vector<double>& values) override;

  // In mpi_group_calls.cpp.
  std::unique_ptr<PendingGroupCall> start_group_sum(std::vector<float>& values,
                                                    const std::vector<int>& group) override;
  std::unique_ptr<PendingGroupCall> start_group_reduce_scatter(
      std::vector<float>& values, const std::vector<int>& group,
      const std::vector<size_t>& bounds) override;
  std::unique_ptr<PendingGroupCall> start_group_gather(std::vector<float>& values,
                                                       const std::vector<int>& group,
                                                       const std::vector<size_t>& bounds) override;

  std::map<int, std::vector<std::byte> > collect_failure_reports(
      const std::vector<std::byte>& report, int collector,
      std::chrono::milliseconds grace) override;
  void poll_abort() override { throw_if_aborted(); }
  void abort(const std::string& reason) override;

  // What the group calls use of the transport.
  MPI_Comm comm() const { return comm_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // Fails the call (give_up) when `code` is not MPI_SUCCESS.
  void check(int code, const char* call);
  // This rank gives up: the others are told, and this call fails.
  [[noreturn]] void give_up(const std::string& what);
  // `bytes` as an MPI count; give_up past INT32_MAX.
  int byte_count(size_t bytes);
  // Reads an abort notice from any rank if one came, then throws if this transport is aborted.
  void throw_if_aborted();
  // Frees the sends (and dropped group calls) that have completed.
  void reap_sends();
  // The requests of a group call dropped unfinished, kept with the buffers they use until
  // they complete (or, at the transport's end, beyond).
  void keep_until_done(std::vector<MPI_Request> requests,
                       std::vector<std::unique_ptr<std::vector<float> > > buffers);

 private:
  struct Pending {
    std::vector<std::byte> bytes;  // owned by the send until it completes
    MPI_Request request = MPI_REQUEST_NULL;
  };
  // The requests of a group call dropped unfinished, with the buffers they use.
  struct Dropped {
    std::vector<MPI_Request> requests;
    std::vector<std::unique_ptr<std::vector<float> > > buffers;
  };

  // A best-effort send of `bytes` that nobody waits for: left to the destructor's bounded
  // wait, dropped if MPI refuses it.
  void post(const std::vector<std::byte>& bytes, int peer, int tag);
  void check_cpu(const Tensor& tensor) const;
  // Receives the next message from `peer` into `tensor` if it has arrived; false if not.
  bool try_receive(const Tensor& tensor, int peer, MpiClock::time_point deadline);
  // Every rank's value count, point to point before the gather: a rank with another count
  // would make the gather undefined, and a rank that never comes is named, which a pending
  // collective cannot do.
  void exchange_counts(int64_t count);
  // Polls the receives `arrived` (one per rank, null where none was posted) up to the
  // deadline; past it, or on an abort, cancels those still pending and gives up with
  // `message(missing)`, `missing` listing the ranks whose receive has not completed.
  template <class Message>
  void wait_for_arrivals(std::vector<MPI_Request>& arrived, Message message);

  std::chrono::milliseconds timeout_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::list<Pending> pending_;  // sends not yet complete; std::list keeps buffers in place
  std::list<Dropped> dropped_;  // group calls dropped unfinished, until their requests complete
  bool aborted_ = false;
  std::string abort_reason_;
};

}  // namespace conveyor::comm::detail

#endif
