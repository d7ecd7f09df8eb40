#pragma once
// How pipeline ranks exchange tensors: point-to-point sends and receives whose order on each
// (source, destination) link is kept (FIFO), plus the small host-side all-reduce the optimizer
// step needs (squared gradient norms, losses). Implementations: in-process (threads of one
// process, CPU or CUDA) and NCCL.
//
// Nothing may hang: every wait has a deadline, and when one rank fails it aborts the
// transport, which makes every pending and later call on every rank throw TransportAborted.
#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/core/stream.h"
#include "engine/core/tensor.h"

namespace conveyor::comm {

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
  // Fails the transport for every rank, with `reason` in the errors they see.
  virtual void abort(const std::string& reason) = 0;
  // Waits for `stream`; transports whose transfers can wait on a peer bound the wait.
  virtual void synchronize(const Stream& stream) { stream.synchronize(); }

 protected:
  // Throws TransportError unless `peer` is another rank of this transport; `action` says
  // what was asked ("send to", "receive from").
  void check_peer(int peer, const char* action) const;
};

}  // namespace conveyor::comm
