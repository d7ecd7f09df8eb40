#pragma once
// The NCCL communicators of the ranks a process holds, and what every call on them shares:
// one lock per communicator, the waits and settles bounded by the timeout, the abort of them
// all, and the warm-up that makes every connection when they are made. The NCCL transport
// (comm/nccl.h) is its public face; only comm/nccl*.cpp include this.
#ifdef CONVEYOR_WITH_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/nccl.h"
#include "comm/nccl_check.h"
#include "comm/poll.h"
#include "engine/core/cuda_device_guard.h"
#include "engine/core/stream.h"

namespace conveyor::comm::detail {

using Clock = std::chrono::steady_clock;
using conveyor::detail::CudaDeviceGuard;

inline cudaStream_t cuda_stream(const Stream& stream) {
  return static_cast<cudaStream_t>(stream.native());
}

// Where nothing may throw (aborts, teardown): makes `device` current when it can; when it
// cannot (a broken context), the caller goes on, on the current device.
void make_current_if_possible(std::optional<CudaDeviceGuard>& guard, int device) noexcept;

// ncclGroupStart ... ncclGroupEnd, where the end also comes when a call in between throws
// (an unclosed group would swallow every later NCCL call of this thread). Over non-blocking
// communicators the end may leave the group's work in progress: settle each of them after.
class NcclGroup {
 public:
  NcclGroup() { CONVEYOR_NCCL_CHECK(ncclGroupStart()); }
  ~NcclGroup() {
    if (open_) (void)ncclGroupEnd();
  }
  void end() {
    open_ = false;
    CONVEYOR_NCCL_START(ncclGroupEnd());
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

 private:
  bool open_ = true;
};

// What settle() throws when a communicator did not settle: raised where the caller may hold
// the communicator's lock, it is turned into an abort of the clique once the lock is let go
// (the abort takes every communicator's lock).
struct NcclUnsettled : std::runtime_error {
  NcclUnsettled(const std::string& why, bool peer) : std::runtime_error(why), peer_aborted(peer) {}
  bool peer_aborted;  // the abort watch heard of another rank's abort
};

// One communicator handle and the lock that keeps it to one thread at a time.
struct NcclComm {
  ncclComm_t handle = nullptr;
  int device = 0;
  std::timed_mutex mutex;
  bool dead = false;  // aborted or destroyed
};

// Shared by the NCCL transports of the ranks this process holds, one transport per rank.
class NcclClique {
 public:
  // Every rank in this process, rank r on devices[r], made with ncclCommInitAll. Those are
  // blocking communicators, unless NCCL_COMM_BLOCKING=0 in the environment makes every
  // communicator non-blocking: each is settled after it is made, so that works too.
  NcclClique(std::vector<int> devices, std::chrono::milliseconds timeout, NcclGroups groups);

  // Rank `rank` of `ranks` alone, on `device`: its ends of the communicators, made from
  // `ids` (one per slot of nccl_slot_count) while every other process makes its own.
  NcclClique(int rank, int ranks, int device, const std::vector<ncclUniqueId>& ids,
             std::chrono::milliseconds timeout, NcclGroups groups);

  ~NcclClique();

  int size() const { return static_cast<int>(devices_.size()); }
  int device(int rank) const { return devices_.at(rank); }
  bool holds(int rank) const { return devices_.at(rank) != kHeldElsewhere; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  NcclComm& world(int rank) { return *world_.at(rank); }
  // The communicator of link src -> dst on the sender's side (its peer is rank 1) or on
  // the receiver's side (its peer is rank 0).
  NcclComm& link_sender(int src, int dst) { return *links_.at(link_index(src, dst, 0)); }
  NcclComm& link_receiver(int src, int dst) { return *links_.at(link_index(src, dst, 1)); }
  // The index of `group` among the groups made at creation (TransportError naming it if none),
  // and the communicator of its member at `position`, which this process holds.
  int group_index(const std::vector<int>& group) const { return find_nccl_group(groups_, group); }
  NcclComm& group_comm(int group, size_t position) {
    return *group_comms_.at(static_cast<size_t>(group)).at(position);
  }

  void set_abort_watch(std::function<void()> check) {
    std::lock_guard lock(watch_mutex_);
    abort_watch_ = std::move(check);
  }

  bool aborted() const { return aborted_.load(); }
  std::string abort_reason() const {
    std::lock_guard lock(reason_mutex_);
    return reason_;
  }

  // Records the first reason, then aborts every communicator this process holds (those of
  // other processes are theirs to abort). A communicator whose lock is held longer than the
  // timeout (a thread stuck inside NCCL) is left for its owner, which sees the abort at its
  // next call or wait.
  void abort_all(const std::string& reason);

  // Polls `stream` until done; gives up (aborting everything) when the clique was aborted,
  // NCCL reports an asynchronous error on one of `rank`'s communicators, or the deadline
  // passes.
  void wait(int rank, const Stream& stream, const std::string& what);
  // The same for `event`: the work recorded before it, not what its stream was given since
  // (a group call's, not those started after it).
  void wait(int rank, const Event& event, const std::string& what);

  // After a call on `comm` that NCCL may still be carrying out in its own threads (a call on a
  // non-blocking communicator, or the end of a group over one): polls the communicator until
  // that is done, as NCCL asks before the next call on it or the next work on the call's
  // stream. A blocking communicator is settled at the first ask. Throws TransportAborted when
  // the clique was aborted meanwhile, and NcclUnsettled (for the caller to abort the clique
  // with, once it lets go of `comm`'s lock) on an NCCL error or when the timeout passes first.
  // `what()` says what was waited for; it is only called on a failure, since sends and
  // receives settle on every call.
  template <class What>
  void settle(int rank, const NcclComm& comm, What&& what) const {
    ncclResult_t state = ncclInProgress;
    const bool settled = poll_until(Clock::now() + timeout_, [&] {
      if (aborted()) throw TransportAborted(rank, abort_reason());
      if (const auto reason = watched_abort()) throw NcclUnsettled(*reason, true);
      const ncclResult_t asked = ncclCommGetAsyncError(comm.handle, &state);
      if (asked != ncclSuccess) state = asked;
      return state != ncclInProgress;
    });
    if (settled && state == ncclSuccess) return;
    std::string reason = "rank " + std::to_string(rank) + ": ";
    if (settled) {
      reason += "NCCL error while " + what() + ": " + ncclGetErrorString(state);
      const char* last = ncclGetLastError(comm.handle);
      if (last && *last) reason += " (" + std::string(last) + ")";
    } else {
      reason += what() + " did not finish within " + std::to_string(timeout_.count()) + " ms";
    }
    throw NcclUnsettled(reason, false);
  }

  // settle() where this thread holds no communicator's lock: a communicator that does not
  // settle aborts the clique here.
  void settle_now(int rank, const NcclComm& comm, const std::string& what);

 private:
  static constexpr int kHeldElsewhere = -1;  // the device of a rank of another process

  // The reason of another rank's abort, if the abort watch has heard of one. One wait asks at
  // a time; a wait that finds the watch in use goes on without it this time. (That orders the
  // waits only: the MPI transport the watch asks is otherwise used by this process's one
  // rank thread alone, its failure reports and abort included, as MPI_THREAD_SERIALIZED
  // needs.)
  std::optional<std::string> watched_abort() const;

  // The waits above: polls `finished_now` (which may throw a CUDA error) as they say.
  void wait_until(int rank, const std::function<bool()>& finished_now, const std::string& what);

  size_t link_index(int src, int dst, int side) const {
    return (static_cast<size_t>(src) * size() + dst) * 2 + side;
  }

  void resize_group_comms() {
    group_comms_.resize(groups_.size());
    for (size_t g = 0; g < groups_.size(); ++g) group_comms_[g].resize(groups_[g].size());
  }

  // The communicators rank `rank` takes part in: the all-rank one, its links and its groups'.
  std::vector<NcclComm*> comms_of(int rank);

  // Aborts `comms` all at once, one thread each. ncclCommAbort frees device memory, and a
  // free can synchronise the device: one after another, the first abort's free would wait for
  // a kernel of a communicator not yet aborted (on the same GPU, waiting for a peer that
  // will not come), and that kernel only exits once its own communicator is aborted - a
  // deadlock NCCL warns of when several communicators are aborted (NVIDIA/nccl PR 564,
  // issue 1013). Started together, every abort raises its communicator's abort flag without
  // waiting for the others, so every kernel a free waits for does exit. The lock waits run
  // side by side too, so the whole abort takes one timeout at most, not one per comm.
  //
  // Communicators still forming are aborted one after another instead: those made in one
  // NCCL group share its set-up job, which only the first ncclCommAbort waits for, so aborts
  // at once could free a communicator that job still uses. No kernel runs before they have
  // formed, so the deadlock above cannot happen then.
  void abort_comms(const std::vector<NcclComm*>& comms) noexcept;

  void abort_comm(NcclComm& comm) noexcept;

  std::vector<NcclComm*> all_comms();

  void check_async_error(int rank, NcclComm& comm, const std::string& what);

  // One exchange on every link, one all-reduce, and on each group's communicator one exchange
  // between every two members, issued from this thread in NCCL groups, so that every
  // connection is made now rather than inside a rank's first call (the group calls use
  // only sends and receives, whose connections are per peer, so these are all they need).
  // Each link and each group is its own NCCL group, waited for before the next, so no two
  // communicators' kernels ever queue on one stream behind each other. This process issues
  // the ends it holds; the links go in ascending (src, dst) order and the groups in their
  // order in every process, so the lowest link or group not yet done always has all its
  // members waiting for it.
  void warm_up();

  std::vector<int> devices_;
  std::chrono::milliseconds timeout_;
  NcclGroups groups_;
  std::vector<std::unique_ptr<NcclComm>> world_;
  std::vector<std::unique_ptr<NcclComm>> links_;                     // (src * p + dst) * 2 + side
  std::vector<std::vector<std::unique_ptr<NcclComm>>> group_comms_;  // [group][position]
  std::atomic<bool> aborted_{false};
  std::atomic<bool> formed_{false};  // every communicator made and settled
  mutable std::mutex watch_mutex_;
  std::function<void()> abort_watch_;  // set_abort_watch
  mutable std::mutex reason_mutex_;
  std::string reason_;
};

// Runs `issue` on `comm` under its lock, with its device current; throws when aborted. When
// `issue` finds the communicator unsettled (NcclClique::settle), the clique is aborted once
// the lock is let go.
template <class F>
void with_comm(NcclComm& comm, int rank, NcclClique& clique, F&& issue) {
  std::string reason;
  bool peer_aborted = false;
  try {
    std::unique_lock lock(comm.mutex);
    if (comm.dead || clique.aborted()) throw TransportAborted(rank, clique.abort_reason());
    CudaDeviceGuard guard(comm.device);
    issue(comm.handle);
    return;
  } catch (const NcclUnsettled& failure) {
    reason = failure.what(), peer_aborted = failure.peer_aborted;
  }
  clique.abort_all(reason);
  if (peer_aborted) throw TransportAborted(rank, reason);
  throw TransportError(reason);
}

}  // namespace conveyor::comm::detail

#endif  // CONVEYOR_WITH_CUDA
