#pragma once
// NCCL transport for pipeline ranks that are threads of one process, one GPU per rank.
//
// Communicators (all made with ncclCommInitAll by make_nccl_transports, in one thread):
//  - one per ordered link src -> dst (a two-rank communicator: rank 0 = src, rank 1 = dst)
//    that carries only that link's messages. Its operations are issued by the sender on its
//    send stream and by the receiver on its receive stream, in FIFO order, so the only
//    ordering between transfers is that of the streams - exactly the rendezvous model the
//    schedule simulator and validator prove deadlock-free. (One communicator for all traffic
//    would not do: NCCL serialises every operation of a communicator in issue order, across
//    streams, which couples a rank's sends and receives in a way the validator never checked.)
//  - one over all ranks for the host all-reduce and for send_recv_self.
//
// Constraints relied on (NCCL's thread-safety rules):
//  - each communicator is used by one thread at a time: a rank's thread issues its own
//    operations; abort() may come from any thread and takes the same per-communicator lock;
//  - every rank is on a distinct GPU (NCCL rejects two ranks of a clique on one device), so
//    threads never issue in parallel to communicators of one device;
//  - the NCCL kernels of different communicators on one GPU can be resident at once (a
//    handful of blocks each on a 132-SM H200; CUDA does not promise it, NCCL documents the
//    risk under "Using multiple NCCL communicators concurrently").
// Connections are set up at creation (a warm-up exchange on every link and one all-reduce,
// issued from one thread in NCCL groups) so that no later call blocks the host waiting for
// a peer's connection handshake, where no deadline could be kept.
//
// Deadlines: send, recv and try_recv only enqueue work and never block the host. all_reduce_sum and
// synchronize() poll the stream until it is done, the transport is aborted, NCCL reports an
// asynchronous error, or the timeout passes; then they abort every communicator of the clique
// (which frees kernels waiting on a dead peer) and throw TransportError naming the rank
// (TransportAborted when the clique had been aborted already).
//
// Teardown: when the last transport of a clique goes, every communicator is aborted (never
// ncclCommDestroy, which finalizes with peers and can hang); NCCL work still pending on the
// ranks' streams is dropped, so synchronise them first.
//
// Messages are not checked for size on the wire: sender and receiver must agree on the byte
// count (the executor's validated schedule and fixed activation shape guarantee it).
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "comm/transport.h"

namespace conveyor::comm {

// True when this binary was built with NCCL and at least one CUDA device is usable.
bool nccl_available();

#ifdef CONVEYOR_WITH_CUDA

namespace detail {
class NcclClique;  // the communicators of all ranks and the shared abort state
}

class NcclTransport : public Transport {
 public:
  NcclTransport(std::shared_ptr<detail::NcclClique> clique, int rank);
  ~NcclTransport() override;
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  int rank() const override { return rank_; }
  int size() const override;
  int cuda_device() const { return device_; }

  // `tensor` must live on this rank's GPU. F32 goes as ncclFloat, I32 as ncclInt32, anything
  // else as bytes. Both record `stream` on the tensor's block for the caching allocator.
  void send(const Tensor& tensor, int peer, const Stream& stream) override;
  void recv(const Tensor& tensor, int peer, const Stream& stream) override;
  // The receive is only enqueued, so it is always issued: recv(), then true.
  bool try_recv(const Tensor& tensor, int peer, const Stream& stream) override;
  // Sums in NCCL's order, which is not rank order; the sum is exact (and so deterministic)
  // when every slot has at most one non-zero contribution, as the executor arranges.
  void all_reduce_sum(std::vector<double>& values) override;
  // Aborts every communicator of the clique (thread-safe, idempotent); every later call on
  // every rank throws TransportAborted with `reason`.
  void abort(const std::string& reason) override;

  // Copies `src` into `dst` (same byte count, both on this GPU) with a send to self and a
  // receive from self in one NCCL group on the all-rank communicator, ordered on `stream`.
  void send_recv_self(const Tensor& src, const Tensor& dst, const Stream& stream);
  // Waits for `stream` with the transport's deadline (see above). Use instead of
  // Stream::synchronize for streams that carry NCCL work.
  void synchronize(const Stream& stream) override;

 private:
  void throw_if_aborted() const;
  void wait_with_deadline(void* stream, const std::string& what);
  void check_tensor(const Tensor& tensor, const char* what) const;

  std::shared_ptr<detail::NcclClique> clique_;
  int rank_;
  int device_;
  std::unique_ptr<Stream> reduce_stream_;  // for the all-reduce
  double* reduce_device_ = nullptr;
  double* reduce_host_ = nullptr;  // pinned, so the copy back never blocks the host
  size_t reduce_capacity_ = 0;
};

// One transport per rank; rank r runs on CUDA device cuda_device_per_rank[r]. The devices
// must exist and be distinct; a one-element list gives a one-rank communicator. `timeout`
// bounds every wait, including the set-up exchange. Call from one thread.
std::vector<std::unique_ptr<Transport>> make_nccl_transports(
    const std::vector<int>& cuda_device_per_rank, std::chrono::milliseconds timeout);

#endif  // CONVEYOR_WITH_CUDA

}  // namespace conveyor::comm
