#pragma once
// How pipeline ranks exchange tensors: point-to-point sends and receives whose order on each
// (source, destination) link is kept (FIFO), plus the small host-side all-reduce the optimizer
// step needs (squared gradient norms, losses), and the group calls of data parallelism: the
// sum of a stage's gradients over its replicas, and for a sharded optimizer the reduce-scatter
// of the gradients and the gather of the updated weights. Implementations: in-process
// (threads of one process, CPU or CUDA), MPI and NCCL.
//
// Nothing may hang: every wait has a deadline, and when one rank fails it aborts the
// transport, which makes every pending and later call on every rank throw TransportAborted.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/core/stream.h"
#include "engine/core/tensor.h"

namespace conveyor::comm {

// The longest wait for a peer a transport takes, in ms (10^6 s, about 11.6 days): deadlines are
// now() + timeout, and a much longer one overflows the clock's nanoseconds, which libstdc++'s
// wait_for converts it to, into a deadline already past.
inline constexpr int64_t kMaxTimeoutMs = 1000000000;

// Throws std::invalid_argument unless `timeout` is from 1 ms to kMaxTimeoutMs, naming it as
// `what` ("ExecutorOptions::transport_timeout").
void check_timeout(std::chrono::milliseconds timeout, const std::string& what);

class TransportError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A call on a transport that was aborted, by any rank or by a wait that gave up. Its own
// type tells a rank stopped because of another's failure from the failure that started it.
class TransportAborted : public TransportError {
 public:
  // `rank`: the rank whose call failed; `reason`: what the abort was given.
  TransportAborted(int rank, const std::string& reason);
  const std::string& reason() const { return reason_; }

 private:
  std::string reason_;
};

// A group sum, reduce-scatter or gather in flight (Transport::start_group_sum,
// start_group_reduce_scatter, start_group_gather).
class PendingGroupCall {
 public:
  virtual ~PendingGroupCall() = default;
  // True once every member's values are in and the caller's vector holds the result; never
  // waits. Throws TransportAborted when the transport was aborted.
  virtual bool test() = 0;
  // test() until true, up to the transport's deadline; past it the transport is aborted and
  // this throws TransportError naming the members that did not come.
  virtual void wait() = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Enqueues `tensor` for `peer` on `stream`: the stream's earlier work (which produced the
  // tensor) is ordered before the transfer. The caller may drop its reference right away.
  virtual void send(const Tensor& tensor, int peer, const Stream& stream) = 0;
  // Receives the next message from `peer` into `tensor` (same dtype and element count as
  // sent), ordered on `stream`: work enqueued on it afterwards sees the data. Where the
  // message must arrive before the receive can be issued (in-process), the host waits for it,
  // up to the transport's deadline; where the receive is only enqueued (NCCL), it does not.
  virtual void recv(const Tensor& tensor, int peer, const Stream& stream) = 0;
  // recv() without the wait: returns false, having changed nothing, when the next message
  // from `peer` has not arrived yet. Transports whose receive is only enqueued (NCCL) enqueue
  // it and return true at once. Lets an executor run other work until the message is there.
  virtual bool try_recv(const Tensor& tensor, int peer, const Stream& stream) = 0;
  // Element-wise sum of `values` over all ranks, added in rank order (deterministic); every
  // rank gets the result. Blocks the host.
  virtual void all_reduce_sum(std::vector<double>& values) = 0;
  // Starts the element-wise sum of `values` over the ranks of `group` (ascending, this rank
  // among them), added in group order from zero, so every member gets the same bits whatever
  // the order of arrival. Never waits: the handle says when `values` holds the sum; until
  // then `values` must stay alive and untouched. Any two ranks start the group calls (sums,
  // reduce-scatters, gathers) they both take part in in the same order, over every group they
  // share, not only within each group: the transports pair calls per pair of ranks (in one
  // process by post number, under MPI by one tag for all groups, over NCCL on one stream), so
  // two groups' calls started in other orders by two common members would take each other's
  // values or wait on each other. The k-th such call of each member meets the k-th of the
  // others; a member may have several in flight and test() or wait() them in any order, each
  // call getting its own result. The default throws TransportError: the transport has no
  // group sum.
  virtual std::unique_ptr<PendingGroupCall> start_group_sum(std::vector<float>& values,
                                                            const std::vector<int>& group);
  // Starts the reduce-scatter of `values` over `group` (as for start_group_sum): member i
  // ends with the sum of every member's values[bounds[i], bounds[i+1]) in that range, added
  // in group order from zero, so its bits are those start_group_sum gives there. The rest of
  // `values` keeps this member's own values. `bounds` as for start_group_gather. Traffic: a
  // member sends each other member j only j's range, (N - own range) values in all, and
  // receives its own range from each. The default throws
  // TransportError.
  virtual std::unique_ptr<PendingGroupCall> start_group_reduce_scatter(
      std::vector<float>& values, const std::vector<int>& group, const std::vector<size_t>& bounds);
  // Starts the gather of `values` over `group` (as for start_group_sum): member i owns the
  // elements [bounds[i], bounds[i+1]) and sends them to the others, whose elements it
  // receives in place, so every member ends with the same vector. `bounds` has one entry more
  // than `group`, ascending from 0 to values.size(). The default throws TransportError.
  virtual std::unique_ptr<PendingGroupCall> start_group_gather(std::vector<float>& values,
                                                               const std::vector<int>& group,
                                                               const std::vector<size_t>& bounds);
  // Fails the transport for every rank, with `reason` in the errors they see.
  virtual void abort(const std::string& reason) = 0;
  // Throws TransportAborted when this transport has been aborted, by this rank or by another
  // rank whose notice has arrived; never waits. The default knows of no abort.
  virtual void poll_abort() {}
  // Asks `check` now and then while this transport waits, and ends the wait with what it
  // throws: another transport's poll_abort(), for a transport whose own waits cannot hear of
  // a peer's failure (NCCL, beside the MPI transport that carries the failure reports). The
  // default waits nowhere `check` could be asked, and drops it.
  virtual void check_while_waiting(std::function<void()> check) { (void)check; }
  // Waits for `stream`; transports whose transfers can wait on a peer bound the wait.
  virtual void synchronize(const Stream& stream) { stream.synchronize(); }
  // Whether this transport queues device kernels that wait on a peer (NCCL): while they may
  // run, the device's allocator must not synchronise the device, which could wait on them
  // while the peer waits for this rank.
  virtual bool queues_kernels_that_wait_on_peers() const { return false; }
  // After this rank's step failed: what each rank reports about where it stood (opaque bytes)
  // goes to rank `collector`, which returns those of the other ranks that came within
  // `grace`, by rank; a dead or stopped rank sends none. Every other rank sends its
  // `report` and returns at once with nothing. Works on an aborted transport (a failure
  // aborts it first). The default returns nothing: the ranks of a transport within one
  // process have nothing to tell each other that their process does not know.
  virtual std::map<int, std::vector<std::byte>> collect_failure_reports(
      const std::vector<std::byte>& report, int collector, std::chrono::milliseconds grace);

 protected:
  // Throws TransportError unless `peer` is another rank of this transport; `action` says
  // what was asked ("send to", "receive from").
  void check_peer(int peer, const char* action) const;
  // Throws TransportError unless `group` is ascending, in range, and holds this rank.
  void check_group(const std::vector<int>& group) const;
  // check_group, and that `bounds` splits `values` into one range per member; `what` names
  // the call in the error ("group gather").
  void check_ranges(const std::vector<float>& values, const std::vector<int>& group,
                    const std::vector<size_t>& bounds, const char* what) const;
  // This rank's position in `group` (checked by check_group).
  size_t position_in(const std::vector<int>& group) const;
};

// Rank indices for a message: comma-separated, the first 16 of them, then how many there
// are in all ("3, 5, ... (40 in all)"), so a message about many ranks stays one short line.
std::string rank_list(const std::vector<int>& ranks);

}  // namespace conveyor::comm
