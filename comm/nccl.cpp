#include "comm/nccl.h"

#include <algorithm>
#include <set>
#include <stdexcept>

#include "engine/core/device.h"

#ifdef CONVEYOR_WITH_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <thread>

#include "comm/nccl_check.h"
#include "engine/core/cuda_device_guard.h"
#include "kernels/cuda_check.h"
#endif

namespace conveyor::comm {
namespace {

void check_clique_rank(int rank, int ranks, const char* what) {
  if (ranks < 1)
    throw std::invalid_argument("an NCCL clique needs at least one rank, got " +
                                std::to_string(ranks));
  if (rank < 0 || rank >= ranks)
    throw std::invalid_argument(std::string(what) + " " + std::to_string(rank) +
                                " is out of range for " + std::to_string(ranks) + " rank(s)");
}

std::string describe_group(const std::vector<int>& group) {
  std::string out = "{";
  for (size_t i = 0; i < group.size(); ++i) {
    if (i > 0) out += ',';
    out += std::to_string(group[i]);
  }
  out += '}';
  return out;
}

}  // namespace

void check_nccl_groups(const NcclGroups& groups, int ranks) {
  check_clique_rank(0, ranks, "rank");
  std::set<std::vector<int>> seen;
  for (const std::vector<int>& group : groups) {
    bool ok = group.size() >= 2;
    for (size_t i = 0; ok && i < group.size(); ++i)
      ok = group[i] >= 0 && group[i] < ranks && (i == 0 || group[i - 1] < group[i]);
    if (!ok)
      throw std::invalid_argument("an NCCL group needs at least two ascending ranks in 0.." +
                                  std::to_string(ranks - 1) + ", got " + describe_group(group));
    if (!seen.insert(group).second)
      throw std::invalid_argument("the NCCL group " + describe_group(group) +
                                  " is listed twice; list each group once");
  }
}

int find_nccl_group(const NcclGroups& groups, const std::vector<int>& group) {
  const auto at = std::find(groups.begin(), groups.end(), group);
  if (at != groups.end()) return static_cast<int>(at - groups.begin());
  std::string made;
  for (const auto& g : groups) made += (made.empty() ? "" : ", ") + describe_group(g);
  throw TransportError("the NCCL transport has no communicator for the group " +
                       describe_group(group) + "; it was made for " +
                       (made.empty() ? std::string("no groups") : "the groups " + made) +
                       " (pass every group that makes group calls when creating it)");
}

int nccl_slot_count(int ranks, int groups) {
  check_clique_rank(0, ranks, "rank");
  if (groups < 0)
    throw std::invalid_argument("an NCCL clique cannot have " + std::to_string(groups) + " groups");
  return ranks * (ranks - 1) + 1 + groups;
}

int nccl_link_slot(int src, int dst, int ranks) {
  check_clique_rank(src, ranks, "link source");
  check_clique_rank(dst, ranks, "link destination");
  if (src == dst)
    throw std::invalid_argument("a link joins two ranks, got " + std::to_string(src) + " -> " +
                                std::to_string(dst));
  return src * (ranks - 1) + (dst < src ? dst : dst - 1);
}

int nccl_world_slot(int ranks) { return nccl_slot_count(ranks) - 1; }

int nccl_group_slot(int group, int ranks, int groups) {
  if (group < 0 || group >= groups)
    throw std::invalid_argument("group " + std::to_string(group) + " is out of range for " +
                                std::to_string(groups) + " group(s)");
  return nccl_slot_count(ranks) + group;
}

std::vector<NcclMembership> nccl_memberships(int rank, int ranks, const NcclGroups& groups) {
  check_clique_rank(rank, ranks, "rank");
  check_nccl_groups(groups, ranks);
  std::vector<NcclMembership> out;
  out.push_back({nccl_world_slot(ranks), -1, -1, -1, ranks, rank});
  for (int src = 0; src < ranks; ++src)
    for (int dst = 0; dst < ranks; ++dst)
      if (src != dst && (src == rank || dst == rank))
        out.push_back({nccl_link_slot(src, dst, ranks), src, dst, -1, 2, rank == src ? 0 : 1});
  const int count = static_cast<int>(groups.size());
  for (int g = 0; g < count; ++g) {
    const auto& group = groups[g];
    const auto at = std::find(group.begin(), group.end(), rank);
    if (at != group.end())
      out.push_back({nccl_group_slot(g, ranks, count), -1, -1, g, static_cast<int>(group.size()),
                     static_cast<int>(at - group.begin())});
  }
  return out;
}

#ifndef CONVEYOR_WITH_CUDA

bool nccl_available() { return false; }

#else

bool nccl_available() {
  int version = 0;
  return cuda_device_count() > 0 && ncclGetVersion(&version) == ncclSuccess;
}

void throw_nccl_error(ncclResult_t result, const char* call, const char* file, int line) {
  std::string message = std::string("NCCL error: ") + call + " failed at " + file + ":" +
                        std::to_string(line) + ": " + ncclGetErrorString(result);
  const char* last = ncclGetLastError(nullptr);
  if (last && *last) message += " (" + std::string(last) + ")";
  throw TransportError(message);
}

namespace detail {
namespace {

using Clock = std::chrono::steady_clock;
using conveyor::detail::CudaDeviceGuard;

cudaStream_t cuda_stream(const Stream& stream) {
  return static_cast<cudaStream_t>(stream.native());
}

// Where nothing may throw (aborts, teardown): makes `device` current when it can; when it
// cannot (a broken context), the caller goes on, on the current device.
void make_current_if_possible(std::optional<CudaDeviceGuard>& guard, int device) noexcept {
  try {
    guard.emplace(device);
  } catch (...) {
  }
}

// The device to enter NCCL's set-up from. ncclCommInitAll makes the devices of a clique
// current in turn and may leave the thread on any of them; entering from a clique device
// other than the caller's makes the guard take the thread back to the caller's device. When
// the clique is the caller's device alone, NCCL has nowhere else to go.
int set_up_entry_device(const std::vector<int>& clique_devices) {
  int current = 0;
  CONVEYOR_CUDA_CHECK(cudaGetDevice(&current));
  for (int device : clique_devices)
    if (device != current) return device;
  return current;
}

// ncclGroupStart ... ncclGroupEnd, where the end also comes when a call in between throws
// (an unclosed group would swallow every later NCCL call of this thread).
class NcclGroup {
 public:
  NcclGroup() { CONVEYOR_NCCL_CHECK(ncclGroupStart()); }
  ~NcclGroup() {
    if (open_) (void)ncclGroupEnd();
  }
  void end() {
    open_ = false;
    CONVEYOR_NCCL_CHECK(ncclGroupEnd());
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

 private:
  bool open_ = true;
};

}  // namespace

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return ncclFloat;
    case DType::kI32:
      return ncclInt32;
    default:
      return ncclChar;
  }
}

size_t nccl_count(const Tensor& t) {
  return nccl_type(t.dtype()) == ncclChar ? t.nbytes() : static_cast<size_t>(t.numel());
}

// One communicator handle and the lock that keeps it to one thread at a time.
struct NcclComm {
  ncclComm_t handle = nullptr;
  int device = 0;
  std::timed_mutex mutex;
  bool dead = false;  // aborted or destroyed
};

class NcclClique {
 public:
  // Every rank in this process, rank r on devices[r], made with ncclCommInitAll.
  NcclClique(std::vector<int> devices, std::chrono::milliseconds timeout)
      : devices_(std::move(devices)), timeout_(timeout) {
    const int p = size();
    world_.reserve(p);
    for (int r = 0; r < p; ++r) world_.push_back(std::make_unique<NcclComm>());
    links_.resize(static_cast<size_t>(p) * p * 2);
    try {
      CudaDeviceGuard restore(set_up_entry_device(devices_));
      std::vector<ncclComm_t> handles(p);
      CONVEYOR_NCCL_CHECK(ncclCommInitAll(handles.data(), p, devices_.data()));
      for (int r = 0; r < p; ++r) world_[r]->handle = handles[r], world_[r]->device = devices_[r];
      for (int src = 0; src < p; ++src)
        for (int dst = 0; dst < p; ++dst) {
          if (src == dst) continue;
          ncclComm_t pair[2] = {nullptr, nullptr};
          const int pair_devices[2] = {devices_[src], devices_[dst]};
          CONVEYOR_NCCL_CHECK(ncclCommInitAll(pair, 2, pair_devices));
          for (int side = 0; side < 2; ++side) {
            auto comm = std::make_unique<NcclComm>();
            comm->handle = pair[side];
            comm->device = pair_devices[side];
            links_[link_index(src, dst, side)] = std::move(comm);
          }
        }
      warm_up();
    } catch (...) {
      abort_all("set-up failed");
      throw;
    }
  }

  // Rank `rank` of `ranks` alone, on `device`: its ends of the communicators, made from
  // `ids` (one per slot of nccl_slot_count) while every other process makes its own.
  NcclClique(int rank, int ranks, int device, const std::vector<ncclUniqueId>& ids,
             std::chrono::milliseconds timeout)
      : devices_(static_cast<size_t>(ranks), kHeldElsewhere), timeout_(timeout) {
    devices_.at(rank) = device;
    world_.resize(ranks);
    links_.resize(static_cast<size_t>(ranks) * ranks * 2);
    try {
      // ncclCommInitRank takes the current device. One thread making several communicators
      // needs a group, which also lets them form in any order across the processes.
      CudaDeviceGuard guard(device);
      NcclGroup group;
      for (const NcclMembership& m : nccl_memberships(rank, ranks)) {
        auto comm = std::make_unique<NcclComm>();
        comm->device = device;
        ncclComm_t* handle = &comm->handle;
        if (m.src < 0)
          world_[rank] = std::move(comm);
        else
          links_[link_index(m.src, m.dst, m.comm_rank)] = std::move(comm);
        CONVEYOR_NCCL_CHECK(ncclCommInitRank(handle, m.comm_size, ids.at(m.slot), m.comm_rank));
      }
      group.end();
      warm_up();
    } catch (...) {
      abort_all("set-up failed");
      throw;
    }
  }

  ~NcclClique() {
    // Every communicator is aborted, never destroyed: ncclCommDestroy finalizes with its
    // peers, which hangs when a peer is gone or, from one thread, waits on the next comm.
    // Abort is local and frees any kernel still waiting; work still pending is dropped, so
    // ranks synchronise their streams before they let the transports go.
    abort_comms(all_comms());
  }

  int size() const { return static_cast<int>(devices_.size()); }
  int device(int rank) const { return devices_.at(rank); }
  bool holds(int rank) const { return devices_.at(rank) != kHeldElsewhere; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  NcclComm& world(int rank) { return *world_.at(rank); }
  // The communicator of link src -> dst on the sender's side (its peer is rank 1) or on
  // the receiver's side (its peer is rank 0).
  NcclComm& link_sender(int src, int dst) { return *links_.at(link_index(src, dst, 0)); }
  NcclComm& link_receiver(int src, int dst) { return *links_.at(link_index(src, dst, 1)); }

  bool aborted() const { return aborted_.load(); }
  std::string abort_reason() const {
    std::lock_guard lock(reason_mutex_);
    return reason_;
  }

  // Records the first reason, then aborts every communicator this process holds (those of
  // other processes are theirs to abort). A communicator whose lock is held longer than the
  // timeout (a thread stuck inside NCCL) is left for its owner, which sees the abort at its
  // next call or wait.
  void abort_all(const std::string& reason) {
    {
      std::lock_guard lock(reason_mutex_);
      if (!aborted_.load()) reason_ = reason;
      aborted_.store(true);
    }
    abort_comms(all_comms());
  }

  // Polls `stream` until done; gives up (aborting everything) when the clique was aborted,
  // NCCL reports an asynchronous error on one of `rank`'s communicators, or the deadline
  // passes.
  void wait(int rank, const Stream& stream, const std::string& what) {
    const auto deadline = Clock::now() + timeout_;
    auto pause = std::chrono::microseconds(20);
    for (;;) {
      if (aborted()) throw TransportAborted(rank, abort_reason());
      bool done = false;
      try {
        done = stream.query();
      } catch (const std::exception& e) {
        abort_all("rank " + std::to_string(rank) + ": CUDA error while waiting for " + what + ": " +
                  e.what());
        throw;
      }
      if (done) return;
      for (NcclComm* comm : comms_of(rank)) check_async_error(rank, *comm, what);
      if (Clock::now() > deadline) {
        const std::string reason = "rank " + std::to_string(rank) + ": " + what +
                                   " did not finish within " + std::to_string(timeout_.count()) +
                                   " ms";
        abort_all(reason);
        throw TransportError(reason);
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }

 private:
  static constexpr int kHeldElsewhere = -1;  // the device of a rank of another process

  size_t link_index(int src, int dst, int side) const {
    return (static_cast<size_t>(src) * size() + dst) * 2 + side;
  }

  // The communicators rank `rank` takes part in: the all-rank one and its links.
  std::vector<NcclComm*> comms_of(int rank) {
    std::vector<NcclComm*> out;
    if (world_[rank]) out.push_back(world_[rank].get());
    for (int peer = 0; peer < size(); ++peer) {
      if (peer == rank) continue;
      if (auto& c = links_[link_index(rank, peer, 0)]) out.push_back(c.get());
      if (auto& c = links_[link_index(peer, rank, 1)]) out.push_back(c.get());
    }
    return out;
  }

  // Aborts `comms` all at once, one thread each. ncclCommAbort frees device memory, and a
  // free can synchronise the device: one after another, the first abort's free would wait for
  // a kernel of a communicator not yet aborted (on the same GPU, waiting for a peer that
  // will not come), and that kernel only exits once its own communicator is aborted - a
  // deadlock NCCL warns of when several communicators are aborted (NVIDIA/nccl PR 564,
  // issue 1013). Started together, every abort raises its communicator's abort flag without
  // waiting for the others, so every kernel a free waits for does exit. The lock waits run
  // side by side too, so the whole abort takes one timeout at most, not one per comm.
  void abort_comms(const std::vector<NcclComm*>& comms) noexcept {
    std::vector<std::thread> threads;
    for (NcclComm* comm : comms) {
      if (!comm->handle) continue;
      try {
        threads.emplace_back([this, comm] { abort_comm(*comm); });
      } catch (...) {
        abort_comm(*comm);  // no thread to be had: abort here, in order
      }
    }
    for (auto& t : threads) t.join();
  }

  void abort_comm(NcclComm& comm) noexcept {
    try {
      std::unique_lock lock(comm.mutex, std::defer_lock);
      if (!lock.try_lock_for(timeout_) || comm.dead || !comm.handle) return;
      std::optional<CudaDeviceGuard> guard;
      make_current_if_possible(guard, comm.device);
      (void)ncclCommAbort(comm.handle);  // never throws: abort is on error paths
      comm.dead = true;
    } catch (...) {
      // Locking failed (system error): leave the communicator to the destructor.
    }
  }

  std::vector<NcclComm*> all_comms() {
    std::vector<NcclComm*> out;
    for (auto& c : world_)
      if (c) out.push_back(c.get());
    for (auto& c : links_)
      if (c) out.push_back(c.get());
    return out;
  }

  void check_async_error(int rank, NcclComm& comm, const std::string& what) {
    std::unique_lock lock(comm.mutex, std::try_to_lock);
    if (!lock.owns_lock() || comm.dead) return;
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm.handle, &async) != ncclSuccess) return;
    if (async == ncclSuccess || async == ncclInProgress) return;
    lock.unlock();
    const std::string reason = "rank " + std::to_string(rank) + ": NCCL error while waiting for " +
                               what + ": " + ncclGetErrorString(async);
    abort_all(reason);
    throw TransportError(reason);
  }

  // One exchange on every link and one all-reduce, issued from this thread in NCCL groups,
  // so that every connection is made now rather than inside a rank's first call. Each link
  // is its own group, waited for before the next, so no two communicators' kernels ever
  // queue on one stream behind each other. This process issues the ends it holds; the links
  // go in ascending (src, dst) order in every process, so the lowest link not yet done always
  // has both its ends waiting for it.
  void warm_up() {
    const int p = size();
    if (p < 2) return;
    std::vector<std::unique_ptr<Stream>> streams(p);
    std::vector<char*> buffers(p, nullptr);
    auto release = [&] {
      for (int r = 0; r < p; ++r) {
        if (!buffers[r]) continue;
        std::optional<CudaDeviceGuard> guard;
        make_current_if_possible(guard, devices_[r]);
        (void)cudaFree(buffers[r]);
      }
      streams.clear();
    };
    // Per device: one double for the all-reduce, then one byte per source.
    const size_t bytes = sizeof(double) + static_cast<size_t>(p);
    try {
      for (int r = 0; r < p; ++r) {
        if (!holds(r)) continue;
        streams[r] = std::make_unique<Stream>(Device::cuda(devices_[r]));
        CudaDeviceGuard guard(devices_[r]);
        CONVEYOR_CUDA_CHECK(cudaMalloc(&buffers[r], bytes));
        CONVEYOR_CUDA_CHECK(cudaMemsetAsync(buffers[r], 0, bytes, cuda_stream(*streams[r])));
      }
      for (int src = 0; src < p; ++src)
        for (int dst = 0; dst < p; ++dst) {
          if (src == dst || (!holds(src) && !holds(dst))) continue;
          NcclGroup group;
          if (holds(src)) {
            CudaDeviceGuard guard(devices_[src]);
            CONVEYOR_NCCL_CHECK(ncclSend(buffers[src], 1, ncclChar, /*peer=*/1,
                                         link_sender(src, dst).handle, cuda_stream(*streams[src])));
          }
          if (holds(dst)) {
            CudaDeviceGuard guard(devices_[dst]);
            CONVEYOR_NCCL_CHECK(ncclRecv(buffers[dst] + sizeof(double) + src, 1, ncclChar,
                                         /*peer=*/0, link_receiver(src, dst).handle,
                                         cuda_stream(*streams[dst])));
          }
          group.end();
          const std::string what = "the NCCL set-up exchange on link " + std::to_string(src) +
                                   " -> " + std::to_string(dst);
          if (holds(src)) wait(src, *streams[src], what);
          if (holds(dst)) wait(dst, *streams[dst], what);
        }
      {
        NcclGroup group;
        for (int r = 0; r < p; ++r) {
          if (!holds(r)) continue;
          CudaDeviceGuard guard(devices_[r]);
          CONVEYOR_NCCL_CHECK(ncclAllReduce(buffers[r], buffers[r], 1, ncclFloat64, ncclSum,
                                            world_[r]->handle, cuda_stream(*streams[r])));
        }
        group.end();
      }
      for (int r = 0; r < p; ++r)
        if (holds(r)) wait(r, *streams[r], "the NCCL set-up all-reduce");
    } catch (...) {
      abort_all("set-up exchange failed");
      release();
      throw;
    }
    release();
  }

  std::vector<int> devices_;
  std::chrono::milliseconds timeout_;
  std::vector<std::unique_ptr<NcclComm>> world_;
  std::vector<std::unique_ptr<NcclComm>> links_;  // (src * p + dst) * 2 + side
  std::atomic<bool> aborted_{false};
  mutable std::mutex reason_mutex_;
  std::string reason_;
};

}  // namespace detail

using conveyor::detail::CudaDeviceGuard;
using detail::cuda_stream;
using detail::make_current_if_possible;
using detail::nccl_count;
using detail::nccl_type;
using detail::NcclClique;
using detail::NcclComm;

NcclTransport::NcclTransport(std::shared_ptr<NcclClique> clique, int rank)
    : clique_(std::move(clique)), rank_(rank), device_(clique_->device(rank)) {
  reduce_stream_ = std::make_unique<Stream>(Device::cuda(device_));
}

NcclTransport::~NcclTransport() {
  std::optional<CudaDeviceGuard> guard;
  make_current_if_possible(guard, device_);
  // Freeing waits for the device: first make sure no all-reduce kernel can still be waiting
  // for a peer (only after an error: every successful call waited for its stream). A stream
  // that cannot even be asked is treated as busy.
  bool reduce_done = true;
  try {
    reduce_done = reduce_stream_->query();
  } catch (...) {
    reduce_done = false;
  }
  if (!reduce_done)
    clique_->abort_all("rank " + std::to_string(rank_) +
                       ": transport destroyed during an all-reduce");
  if (reduce_device_) (void)cudaFree(reduce_device_);
  if (reduce_host_) (void)cudaFreeHost(reduce_host_);
  reduce_stream_.reset();
}

int NcclTransport::size() const { return clique_->size(); }

void NcclTransport::throw_if_aborted() const {
  if (clique_->aborted()) throw TransportAborted(rank_, clique_->abort_reason());
}

void NcclTransport::check_tensor(const Tensor& tensor, const char* what) const {
  if (!tensor.defined() || !tensor.device().is_cuda() || tensor.device().index != device_)
    throw TransportError(
        "rank " + std::to_string(rank_) + ": cannot " + what + " " +
        (tensor.defined() ? tensor.describe() : std::string("an undefined tensor")) +
        ": the NCCL transport of this rank needs tensors on cuda:" + std::to_string(device_));
}

namespace {

// Runs `issue` on `comm` under its lock, with its device current; throws when aborted.
template <class F>
void with_comm(NcclComm& comm, int rank, const NcclClique& clique, F&& issue) {
  std::unique_lock lock(comm.mutex);
  if (comm.dead || clique.aborted()) throw TransportAborted(rank, clique.abort_reason());
  CudaDeviceGuard guard(comm.device);
  issue(comm.handle);
}

}  // namespace

void NcclTransport::send(const Tensor& tensor, int peer, const Stream& stream) {
  throw_if_aborted();
  check_peer(peer, "send to");
  check_tensor(tensor, "send");
  auto s = cuda_stream(stream);
  with_comm(clique_->link_sender(rank_, peer), rank_, *clique_, [&](ncclComm_t comm) {
    CONVEYOR_NCCL_CHECK(ncclSend(tensor.raw(), nccl_count(tensor), nccl_type(tensor.dtype()),
                                 /*peer=*/1, comm, s));
  });
  record_stream(tensor, stream.native());
}

void NcclTransport::recv(const Tensor& tensor, int peer, const Stream& stream) {
  throw_if_aborted();
  check_peer(peer, "receive from");
  check_tensor(tensor, "receive into");
  auto s = cuda_stream(stream);
  with_comm(clique_->link_receiver(peer, rank_), rank_, *clique_, [&](ncclComm_t comm) {
    CONVEYOR_NCCL_CHECK(ncclRecv(tensor.raw(), nccl_count(tensor), nccl_type(tensor.dtype()),
                                 /*peer=*/0, comm, s));
  });
  record_stream(tensor, stream.native());
}

bool NcclTransport::try_recv(const Tensor& tensor, int peer, const Stream& stream) {
  recv(tensor, peer, stream);
  return true;
}

void NcclTransport::send_recv_self(const Tensor& src, const Tensor& dst, const Stream& stream) {
  throw_if_aborted();
  check_tensor(src, "send");
  check_tensor(dst, "receive into");
  if (src.nbytes() != dst.nbytes())
    throw TransportError("rank " + std::to_string(rank_) + ": send to self of " + src.describe() +
                         " into " + dst.describe() + ": the byte counts differ");
  auto s = cuda_stream(stream);
  with_comm(clique_->world(rank_), rank_, *clique_, [&](ncclComm_t comm) {
    detail::NcclGroup group;
    CONVEYOR_NCCL_CHECK(ncclSend(src.raw(), src.nbytes(), ncclChar, rank_, comm, s));
    CONVEYOR_NCCL_CHECK(ncclRecv(dst.raw(), dst.nbytes(), ncclChar, rank_, comm, s));
    group.end();
  });
  record_stream(src, stream.native());
  record_stream(dst, stream.native());
}

void NcclTransport::all_reduce_sum(std::vector<double>& values) {
  throw_if_aborted();
  if (values.empty()) return;
  CudaDeviceGuard guard(device_);
  const size_t n = values.size();
  auto stream = cuda_stream(*reduce_stream_);
  if (n > reduce_capacity_) {
    // Nothing is in flight on the stream between calls (each call waits for it).
    if (reduce_device_) CONVEYOR_CUDA_CHECK(cudaFree(reduce_device_));
    if (reduce_host_) CONVEYOR_CUDA_CHECK(cudaFreeHost(reduce_host_));
    reduce_device_ = nullptr;
    reduce_host_ = nullptr;
    reduce_capacity_ = 0;
    CONVEYOR_CUDA_CHECK(cudaMalloc(&reduce_device_, n * sizeof(double)));
    CONVEYOR_CUDA_CHECK(cudaMallocHost(&reduce_host_, n * sizeof(double)));
    reduce_capacity_ = n;
  }
  std::memcpy(reduce_host_, values.data(), n * sizeof(double));
  NcclComm& world = clique_->world(rank_);
  with_comm(world, rank_, *clique_, [&](ncclComm_t comm) {
    CONVEYOR_CUDA_CHECK(cudaMemcpyAsync(reduce_device_, reduce_host_, n * sizeof(double),
                                        cudaMemcpyHostToDevice, stream));
    CONVEYOR_NCCL_CHECK(
        ncclAllReduce(reduce_device_, reduce_device_, n, ncclFloat64, ncclSum, comm, stream));
    CONVEYOR_CUDA_CHECK(cudaMemcpyAsync(reduce_host_, reduce_device_, n * sizeof(double),
                                        cudaMemcpyDeviceToHost, stream));
  });
  clique_->wait(rank_, *reduce_stream_, "the all-reduce of " + std::to_string(n) + " values");
  std::memcpy(values.data(), reduce_host_, n * sizeof(double));
}

void NcclTransport::synchronize(const Stream& stream) {
  throw_if_aborted();
  CudaDeviceGuard guard(device_);
  clique_->wait(rank_, stream, "stream " + std::to_string(stream.id()));
}

void NcclTransport::abort(const std::string& reason) { clique_->abort_all(reason); }

namespace {

void check_timeout(std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0)
    throw std::invalid_argument("the NCCL transport timeout must be positive, got " +
                                std::to_string(timeout.count()) + " ms");
}

void check_device(int rank, int device) {
  const int available = cuda_device_count();
  if (device < 0 || device >= available)
    throw std::invalid_argument("rank " + std::to_string(rank) +
                                " asks for cuda:" + std::to_string(device) + ", but " +
                                std::to_string(available) + " CUDA device(s) are usable");
}

}  // namespace

std::vector<std::unique_ptr<Transport>> make_nccl_transports(
    const std::vector<int>& cuda_device_per_rank, std::chrono::milliseconds timeout) {
  if (cuda_device_per_rank.empty())
    throw std::invalid_argument("the NCCL transport needs at least one rank");
  check_timeout(timeout);
  std::set<int> seen;
  for (size_t r = 0; r < cuda_device_per_rank.size(); ++r) {
    const int d = cuda_device_per_rank[r];
    check_device(static_cast<int>(r), d);
    if (!seen.insert(d).second)
      throw std::invalid_argument("rank " + std::to_string(r) +
                                  " asks for cuda:" + std::to_string(d) +
                                  ", which another rank already has: NCCL needs one GPU per "
                                  "rank (use the in-process transport to share a GPU)");
  }
  auto clique = std::make_shared<NcclClique>(cuda_device_per_rank, timeout);
  std::vector<std::unique_ptr<Transport>> out;
  for (int r = 0; r < clique->size(); ++r)
    out.push_back(std::make_unique<NcclTransport>(clique, r));
  return out;
}

std::unique_ptr<Transport> make_nccl_transport_from_ids(int rank, int ranks, int cuda_device,
                                                        const std::vector<std::string>& unique_ids,
                                                        std::chrono::milliseconds timeout) {
  check_timeout(timeout);
  const int slots = nccl_slot_count(ranks);
  check_clique_rank(rank, ranks, "rank");
  check_device(rank, cuda_device);
  if (static_cast<int>(unique_ids.size()) != slots)
    throw std::invalid_argument("a clique of " + std::to_string(ranks) + " rank(s) needs " +
                                std::to_string(slots) + " NCCL unique ids, got " +
                                std::to_string(unique_ids.size()));
  std::vector<ncclUniqueId> ids(unique_ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (unique_ids[i].size() != sizeof(ncclUniqueId))
      throw std::invalid_argument("NCCL unique id " + std::to_string(i) + " has " +
                                  std::to_string(unique_ids[i].size()) + " bytes, expected " +
                                  std::to_string(sizeof(ncclUniqueId)));
    std::memcpy(ids[i].internal, unique_ids[i].data(), sizeof(ncclUniqueId));
  }
  auto clique = std::make_shared<NcclClique>(rank, ranks, cuda_device, ids, timeout);
  return std::make_unique<NcclTransport>(clique, rank);
}

#endif  // CONVEYOR_WITH_CUDA

}  // namespace conveyor::comm
