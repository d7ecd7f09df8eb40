#pragma once
// The MPI transport's class (comm/mpi_transport.h says what it does), shared by the files
// that implement it: mpi_transport.cpp (set-up, point to point, the all-reduce, aborts and
// failure reports), mpi_group_calls.cpp (the data-parallel group calls) and
// mpi_roll_call.cpp. Only comm/mpi_*.cpp include this, in a build with MPI.
#ifdef CONVEYOR_WITH_MPI
#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "comm/buffer_pool.h"
#include "comm/poll.h"
#include "comm/transport.h"

namespace conveyor::comm::detail {

using MpiClock = std::chrono::steady_clock;

inline constexpr int kMessageTag = 1;     // every pipeline message: FIFO per link
inline constexpr int kAbortTag = 2;       // the reason a rank aborted
inline constexpr int kCountTag = 3;       // all-reduce value counts: who has come to the all-reduce
inline constexpr int kGroupTag = 4;       // gathers
inline constexpr int kScatterTag = 5;     // reduce-scatters and the first phase of group sums
inline constexpr int kSumTag = 6;         // all-reduce values, after their counts
inline constexpr int kReportTag = 16;     // after a failure: where a rank stood, to the collector
inline constexpr int kReportAckTag = 17;  // the collector is done: a reporter may end its process
inline constexpr int kRollCallTag = 32;   // mpi_roll_call, on MPI_COMM_WORLD
// The second phase of group sums: a tag per sum in flight between two members, cycling
// through kSumRangeTags of them from kFirstSumRangeTag (MPI promises tags up to 32767).
inline constexpr int kFirstSumRangeTag = 1024;
inline constexpr int kSumRangeTags = 16384;

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

class MpiTransport;

// One group call's requests and the buffers they use (mpi_group_calls.cpp). The transport
// holds it from the call's start until every request has completed, whether or not the
// caller still holds the call: MPI may go on reading or writing the buffers of requests it
// has matched, which a cancel cannot stop, so every buffer a request uses is the call's own,
// never the caller's.
class MpiGroupCall {
 public:
  MpiGroupCall(MpiTransport& transport, std::vector<int> group, size_t me, std::string what);
  // Abandons what is left (a constructor that failed half-way leaves requests open).
  virtual ~MpiGroupCall();

  // Tests the requests without waiting, and posts what their completion allows (a sum's
  // second phase); touches no memory of the caller's, so any call's wait may move every
  // other call on. True once every request has completed. Never throws: a failure is kept.
  virtual bool advance() = 0;
  // Everything the result needs has arrived (sends may still be out).
  virtual bool has_result() const = 0;
  // Writes the result into the caller's `values`, once has_result().
  virtual void write_result(std::vector<float>& values) const = 0;
  // Why the call cannot finish (an MPI error, a part of the wrong length); empty if none.
  const std::string& failure() const { return failure_; }
  // The ranks whose messages have not come (a sum names only its first phase's until that
  // is in: the second's wait on the same ranks).
  virtual std::vector<int> waits_for() const { return pending_peers(0, receives_.size()); }
  // "the gradient sum over replicas", for messages.
  const std::string& what() const { return what_; }
  // Lets go of the call: with every request complete its buffers go back to the transport's
  // pool; else the requests left are cancelled and freed, and their buffers stay allocated
  // (at the transport's end, or once the call has failed).
  void abandon();
  bool requests_open() const;

 protected:
  // A buffer of the call's own, uninitialised, in place until the call is gone.
  std::span<float> own_buffer(size_t floats);
  // From and to the member at position `from` / `to` of the group.
  void receive(std::span<float> into, size_t from, int tag);
  void send(std::span<const float> from, size_t to, int tag);
  // Tests every request left (a receive of the wrong length is a failure); true once all
  // have completed.
  bool test_requests();
  // MPI_Test of one request, keeping a failure; false then.
  bool test_one(MPI_Request& request, int& done, MPI_Status* status);
  bool received() const;
  bool receive_pending(size_t k) const { return receives_[k].request != MPI_REQUEST_NULL; }
  // The ranks of the receives [begin, end) not completed, ascending, each once.
  std::vector<int> pending_peers(size_t begin, size_t end) const;

  MpiTransport& t_;
  std::vector<int> group_;
  size_t me_;  // this rank's position in group_
  std::string failure_;

 private:
  struct Receive {
    MPI_Request request;
    int peer;
    size_t floats;
  };
  std::string what_;
  std::vector<Receive> receives_;  // in the order posted
  std::vector<MPI_Request> sends_;
  std::vector<FloatBufferPool::Buffer> buffers_;  // what the requests use, from the pool
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
  // Frees the sends that have completed, and moves the group calls in flight on.
  void reap_sends();
  // Moves every group call in flight on (MpiGroupCall::advance), and lets go of those that
  // failed and of those whose requests have all completed and whose handle is done with them.
  void advance_group_calls();
  FloatBufferPool& buffer_pool() { return buffer_pool_; }

 private:
  struct Pending {
    std::vector<std::byte> bytes;  // owned by the send until it completes
    MPI_Request request = MPI_REQUEST_NULL;
  };
  // Holds `call` until its requests complete, and gives the caller a handle on it.
  std::unique_ptr<PendingGroupCall> start_call(std::shared_ptr<MpiGroupCall> call,
                                               std::vector<float>& values);
  // At the transport's end: every group call left is abandoned.
  void abandon_group_calls();
  // Some group call has requests open (as of its last advance).
  bool group_calls_open() const;

  // A best-effort send of `bytes` that nobody waits for: left to the destructor's bounded
  // wait, dropped if MPI refuses it.
  void post(const std::vector<std::byte>& bytes, int peer, int tag);
  void check_cpu(const Tensor& tensor) const;
  // Receives the next message from `peer` into `tensor` if it has arrived; false if not.
  bool try_receive(const Tensor& tensor, int peer, WaitDeadline& deadline);
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
  std::list<Pending> pending_;   // sends not yet complete; std::list keeps buffers in place
  FloatBufferPool buffer_pool_;  // before group_calls_: their buffers go back to it
  // Group calls started, held or dropped by the caller, until their requests complete.
  std::list<std::shared_ptr<MpiGroupCall> > group_calls_;
  std::vector<uint64_t> sums_with_;  // by rank: group sums started with it, for their tags
  bool aborted_ = false;
  std::string abort_reason_;
};

}  // namespace conveyor::comm::detail

#endif
