#pragma once
// NCCL transport for pipeline ranks with one GPU each: ranks that are threads of one process
// (make_nccl_transports), or processes started by mpirun / srun, one rank each
// (make_nccl_transport_over_mpi). None of it has run on a GPU yet: it compiles, and its
// CPU-side logic (slots, memberships, group lookup) is tested.
//
// Communicators:
//  - one per ordered link src -> dst (a two-rank communicator: rank 0 = src, rank 1 = dst)
//    that carries only that link's messages. Its operations are issued by the sender on its
//    send stream and by the receiver on its receive stream, in FIFO order, so the only
//    ordering between transfers is that of the streams - exactly the rendezvous model the
//    schedule simulator and validator prove deadlock-free. (One communicator for all traffic
//    would not do: NCCL serialises every operation of a communicator in issue order, across
//    streams, which couples a rank's sends and receives in a way the validator never checked.)
//  - one over all ranks for the host all-reduce and for send_recv_self;
//  - one per group given at creation (data parallelism's replica groups), its ranks in group
//    order, for the group calls only. Members issue them in the same order (the contract),
//    each on its transport's group stream, so NCCL's issue-order serialisation per
//    communicator matches the calls. They use only ncclSend / ncclRecv and sum on the host:
//    NCCL's reductions add in an order of their own, not the group order the other
//    transports add in, and would change the bits.
// Within one process all of them are made with ncclCommInitAll, in one thread. Across
// processes rank 0 makes one NCCL unique id per communicator (slots: nccl_link_slot,
// nccl_world_slot, nccl_group_slot) and broadcasts them over MPI_COMM_WORLD; each process
// then makes the ends of its own rank (nccl_memberships) with ncclCommInitRankConfig inside
// one NCCL group, as NCCL requires when one thread creates several communicators. Those are
// non-blocking communicators: NCCL forms and connects them in its own threads while the
// caller polls them against the timeout (as it polls the broadcast), so a process that never
// comes ends the others' set-up with an error instead of holding it in NCCL's bootstrap.
//
// Constraints relied on (NCCL's thread-safety rules):
//  - each communicator is used by one thread at a time: a rank's thread issues its own
//    operations (its group calls' too: start, test and wait come from the thread that owns
//    the handle); abort() and the asynchronous-error checks may come from any thread and
//    take the same per-communicator lock;
//  - every rank is on a distinct GPU (NCCL rejects two ranks of a clique on one device), so
//    threads never issue in parallel to communicators of one device;
//  - the NCCL kernels of different communicators on one GPU can be resident at once (a
//    handful of blocks each on a 132-SM H200; CUDA does not promise it, NCCL documents the
//    risk under "Using multiple NCCL communicators concurrently").
// Connections are set up at creation (a warm-up exchange on every link, in ascending
// (src, dst) order, one all-reduce, and an exchange between every two members of each group,
// in group order, issued in NCCL groups) so that no later call blocks the host waiting for a
// peer's connection handshake, where no deadline could be kept. Every process walks the links
// and groups in the same order, so the exchanges cannot wait on each other in a cycle. (NCCL
// connects an all-reduce algorithm at its first use: the one-value warm-up connects the one
// for small sizes, which the step's all-reduce of kilobytes is; docs/distributed.md.)
//
// Deadlines: send, recv, try_recv and the group calls' start only enqueue work and never
// block the host (their test() only asks the stream). all_reduce_sum, synchronize() and a
// group call's wait() poll the stream until it is done, the transport is aborted, NCCL
// reports an asynchronous error, or the timeout passes; then they abort every communicator
// this process holds (which frees kernels waiting on a dead peer) and throw TransportError
// naming the rank (TransportAborted when they had been aborted already).
//
// Abort is per process. Within one process it reaches every rank. Across processes it aborts
// this process's communicators only and tells the others nothing: each learns of it through
// its own deadline, or earlier when NCCL reports the broken connection as an asynchronous
// error on one of its communicators.
//
// Teardown: when the last transport of a process goes, its communicators are aborted (never
// ncclCommDestroy, which finalizes with peers and can hang); NCCL work still pending on the
// ranks' streams is dropped, so synchronise them first.
//
// Messages are not checked for size on the wire: sender and receiver must agree on the byte
// count (the executor's validated schedule and fixed activation shape guarantee it).
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/transport.h"

namespace conveyor::comm {

// True when this binary was built with NCCL and at least one CUDA device is usable.
bool nccl_available();

// The groups of ranks that make group calls (Transport::start_group_sum and the others),
// one communicator each: every group ascending, in 0..ranks-1, with at least two members,
// and no group listed twice. Throws std::invalid_argument naming the group otherwise.
using NcclGroups = std::vector<std::vector<int>>;
void check_nccl_groups(const NcclGroups& groups, int ranks);
// The index of `group` in `groups`; throws TransportError naming `group` when it is not there
// (a group call over ranks the transport made no communicator for).
int find_nccl_group(const NcclGroups& groups, const std::vector<int>& group);

// Where each communicator of a clique of `ranks` ranks with `groups` groups finds its unique
// id in the list rank 0 hands out: link src -> dst (src != dst) at src * (ranks - 1) +
// (dst < src ? dst : dst - 1), the all-rank communicator after every link, at
// ranks * (ranks - 1), then group g at ranks * (ranks - 1) + 1 + g. Throws
// std::invalid_argument for ranks or groups out of range or src == dst.
int nccl_slot_count(int ranks, int groups = 0);
int nccl_link_slot(int src, int dst, int ranks);
int nccl_world_slot(int ranks);
int nccl_group_slot(int group, int ranks, int groups);

// One communicator a rank takes part in.
struct NcclMembership {
  int slot = 0;  // its unique id's slot
  int src = -1;  // the link src -> dst it carries; -1, -1 for the others
  int dst = -1;
  int group = -1;     // the index of the group it carries; -1 for the others
  int comm_size = 0;  // 2 for a link, `ranks` for the all-rank communicator, a group's size
  int comm_rank = 0;  // the rank's place in it: 0 sends on a link, 1 receives; in a group
                      // its position there
};

// The communicators rank `rank` of `ranks` takes part in: the all-rank one first, then each
// link it sends or receives on, in ascending (src, dst) order, then each group it belongs
// to, in the order of `groups` (checked by check_nccl_groups).
std::vector<NcclMembership> nccl_memberships(int rank, int ranks, const NcclGroups& groups = {});

namespace detail {
// "{0,2}": a group's ranks, for messages.
std::string describe_group(const std::vector<int>& group);
// Throws std::invalid_argument unless 0 <= rank < ranks (`what` names the rank) and ranks >= 1.
void check_clique_rank(int rank, int ranks, const char* what);
}  // namespace detail

#ifdef CONVEYOR_WITH_CUDA

namespace detail {
class NcclClique;     // the communicators this process holds and their shared abort state
class NcclGroupCall;  // a group call in flight
struct NcclStaging;   // the device and pinned host buffers of the group calls in flight
}  // namespace detail

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
  // The group calls, over the communicator made at creation for `group` (TransportError
  // naming the group when there is none; a group of this rank alone needs none). The values
  // go through device staging buffers and pinned host memory: every member sends its part
  // to each other member with ncclSend / ncclRecv on the group's stream of this transport,
  // and the sums are added on the host in group order from zero, as the other transports
  // add, so the bits are theirs (ncclAllReduce and ncclReduceScatter add in an order of
  // their own). Several may be in flight, each in staging buffers of its own, run on the
  // group stream in start order. start_* never waits; test() asks the event recorded after
  // the call's work; wait() polls it against the deadline as synchronize() does. The handle
  // must not outlive the transport. The members must agree on values.size() and `bounds`:
  // NCCL does not check message sizes.
  std::unique_ptr<PendingGroupCall> start_group_sum(std::vector<float>& values,
                                                    const std::vector<int>& group) override;
  std::unique_ptr<PendingGroupCall> start_group_reduce_scatter(
      std::vector<float>& values, const std::vector<int>& group,
      const std::vector<size_t>& bounds) override;
  std::unique_ptr<PendingGroupCall> start_group_gather(std::vector<float>& values,
                                                       const std::vector<int>& group,
                                                       const std::vector<size_t>& bounds) override;
  // Aborts every communicator this process holds (thread-safe, idempotent); every later call
  // on every rank of this process throws TransportAborted with `reason`.
  void abort(const std::string& reason) override;
  void poll_abort() override { throw_if_aborted(); }
  // `check` is asked in every poll of every wait of the clique's ranks (one thread at a time;
  // a thread that finds it in use goes on); the TransportAborted it throws aborts this
  // process's communicators with its reason and ends the wait with it.
  void check_while_waiting(std::function<void()> check) override;
  bool queues_kernels_that_wait_on_peers() const override { return true; }

  // Copies `src` into `dst` (same byte count, both on this GPU) with a send to self and a
  // receive from self in one NCCL group on the all-rank communicator, ordered on `stream`.
  void send_recv_self(const Tensor& src, const Tensor& dst, const Stream& stream);
  // Waits for `stream` with the transport's deadline (see above). Use instead of
  // Stream::synchronize for streams that carry NCCL work.
  void synchronize(const Stream& stream) override;

 private:
  friend class detail::NcclGroupCall;
  void throw_if_aborted() const;
  void check_tensor(const Tensor& tensor, const char* what) const;

  std::shared_ptr<detail::NcclClique> clique_;
  int rank_;
  int device_;
  std::unique_ptr<Stream> reduce_stream_;  // for the all-reduce
  double* reduce_device_ = nullptr;
  double* reduce_host_ = nullptr;  // pinned, so the copy back never blocks the host
  size_t reduce_capacity_ = 0;
  // Outgrown all-reduce buffers, freed with the transport: cudaFree and cudaFreeHost wait for
  // the whole device, where a link kernel may be waiting on a peer with no deadline kept.
  std::vector<double*> retired_reduce_device_, retired_reduce_host_;
  std::unique_ptr<Stream> group_stream_;          // for the group calls, in start order
  std::unique_ptr<detail::NcclStaging> staging_;  // a slot per group call in flight
};

// One transport per rank; rank r runs on CUDA device cuda_device_per_rank[r]. The devices
// must exist and be distinct; a one-element list gives a one-rank communicator. `timeout`
// bounds every wait, including the set-up exchange (check_timeout: 1 ms to kMaxTimeoutMs, as
// for every transport's timeout here). `groups`: the groups of ranks that will
// make group calls, one communicator each (check_nccl_groups). Call from one thread.
std::vector<std::unique_ptr<Transport>> make_nccl_transports(
    const std::vector<int>& cuda_device_per_rank, std::chrono::milliseconds timeout,
    const NcclGroups& groups = {});

// The transport of rank `rank` of a clique of `ranks` ranks held one per process, on CUDA
// device `cuda_device`, its communicators made from `unique_ids` (one ncclUniqueId's bytes
// per slot of nccl_slot_count(ranks, groups.size()); every process must be given the same
// list, and the same `groups`). Every process of the clique must call it; it returns once
// all have made their communicators and warmed up.
std::unique_ptr<Transport> make_nccl_transport_from_ids(int rank, int ranks, int cuda_device,
                                                        const std::vector<std::string>& unique_ids,
                                                        std::chrono::milliseconds timeout,
                                                        const NcclGroups& groups = {});

// This process's rank over NCCL, bootstrapped over MPI (initialised by the program, with
// MPI_COMM_WORLD holding one process per rank): the process holds its MPI rank r, on CUDA
// device cuda_device_per_rank[r]. Rank 0 makes the unique ids and broadcasts them with
// MPI_Ibcast, polled against `timeout`; every process must call it. Throws std::invalid_argument
// when the process count is not the list's size or the build has no MPI, TransportError when MPI is
// not initialised. Every process must pass the same `groups` (as for make_nccl_transports).
std::unique_ptr<Transport> make_nccl_transport_over_mpi(
    const std::vector<int>& cuda_device_per_rank, std::chrono::milliseconds timeout,
    const NcclGroups& groups = {});

#endif  // CONVEYOR_WITH_CUDA

}  // namespace conveyor::comm
