#include "comm/nccl_clique.h"

#ifdef CONVEYOR_WITH_CUDA
#include <algorithm>
#include <thread>

#include "kernels/cuda_check.h"

namespace conveyor::comm::detail {
namespace {

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

}  // namespace

void make_current_if_possible(std::optional<CudaDeviceGuard>& guard, int device) noexcept {
  try {
    guard.emplace(device);
  } catch (...) {
  }
}

NcclClique::NcclClique(std::vector<int> devices, std::chrono::milliseconds timeout,
                       NcclGroups groups)
    : devices_(std::move(devices)), timeout_(timeout), groups_(std::move(groups)) {
  const int p = size();
  world_.reserve(p);
  for (int r = 0; r < p; ++r) world_.push_back(std::make_unique<NcclComm>());
  links_.resize(static_cast<size_t>(p) * p * 2);
  resize_group_comms();
  try {
    CudaDeviceGuard restore(set_up_entry_device(devices_));
    std::vector<ncclComm_t> handles(p);
    CONVEYOR_NCCL_START(ncclCommInitAll(handles.data(), p, devices_.data()));
    for (int r = 0; r < p; ++r) world_[r]->handle = handles[r], world_[r]->device = devices_[r];
    for (int r = 0; r < p; ++r) settle_now(r, *world_[r], "making the NCCL communicators");
    for (int src = 0; src < p; ++src)
      for (int dst = 0; dst < p; ++dst) {
        if (src == dst) continue;
        ncclComm_t pair[2] = {nullptr, nullptr};
        const int pair_devices[2] = {devices_[src], devices_[dst]};
        CONVEYOR_NCCL_START(ncclCommInitAll(pair, 2, pair_devices));
        for (int side = 0; side < 2; ++side) {
          auto comm = std::make_unique<NcclComm>();
          comm->handle = pair[side];
          comm->device = pair_devices[side];
          links_[link_index(src, dst, side)] = std::move(comm);
        }
        for (int side = 0; side < 2; ++side)
          settle_now(side == 0 ? src : dst, *links_[link_index(src, dst, side)],
                     "making the NCCL communicators");
      }
    for (size_t g = 0; g < groups_.size(); ++g) {
      const std::vector<int>& group = groups_[g];
      std::vector<ncclComm_t> members(group.size(), nullptr);
      std::vector<int> member_devices;
      for (int r : group) member_devices.push_back(devices_[r]);
      CONVEYOR_NCCL_START(
          ncclCommInitAll(members.data(), static_cast<int>(group.size()), member_devices.data()));
      for (size_t i = 0; i < group.size(); ++i) {
        auto comm = std::make_unique<NcclComm>();
        comm->handle = members[i];
        comm->device = member_devices[i];
        group_comms_[g][i] = std::move(comm);
      }
      for (size_t i = 0; i < group.size(); ++i)
        settle_now(group[i], *group_comms_[g][i], "making the NCCL communicators");
    }
    formed_.store(true);
    warm_up();
  } catch (...) {
    abort_all("set-up failed");
    throw;
  }
}

NcclClique::NcclClique(int rank, int ranks, int device, const std::vector<ncclUniqueId>& ids,
                       std::chrono::milliseconds timeout, NcclGroups groups)
    : devices_(static_cast<size_t>(ranks), kHeldElsewhere),
      timeout_(timeout),
      groups_(std::move(groups)) {
  devices_.at(rank) = device;
  world_.resize(ranks);
  links_.resize(static_cast<size_t>(ranks) * ranks * 2);
  resize_group_comms();
  try {
    // Non-blocking communicators: NCCL forms them in threads of its own while this one
    // polls them against the timeout, so a process that never comes, or a host the others
    // cannot reach, ends the set-up with an error where a blocking one would wait forever.
    // (NCCL_COMM_BLOCKING=1 in the environment makes them blocking; every poll then finds
    // them settled at once.)
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    // ncclCommInitRankConfig takes the current device. One thread making several
    // communicators needs a group, which also lets them form in any order across the
    // processes.
    CudaDeviceGuard guard(device);
    NcclGroup group;
    for (const NcclMembership& m : nccl_memberships(rank, ranks, groups_)) {
      auto comm = std::make_unique<NcclComm>();
      comm->device = device;
      ncclComm_t* handle = &comm->handle;
      if (m.group >= 0)
        group_comms_[m.group][m.comm_rank] = std::move(comm);
      else if (m.src < 0)
        world_[rank] = std::move(comm);
      else
        links_[link_index(m.src, m.dst, m.comm_rank)] = std::move(comm);
      CONVEYOR_NCCL_START(
          ncclCommInitRankConfig(handle, m.comm_size, ids.at(m.slot), m.comm_rank, &config));
    }
    group.end();
    for (NcclComm* comm : all_comms())
      settle_now(rank, *comm,
                 "making its NCCL communicators (every process must reach this, and each "
                 "host must reach the others)");
    formed_.store(true);
    warm_up();
  } catch (...) {
    abort_all("set-up failed");
    throw;
  }
}

NcclClique::~NcclClique() {
  // Every communicator is aborted, never destroyed: ncclCommDestroy finalizes with its
  // peers, which hangs when a peer is gone or, from one thread, waits on the next comm.
  // Abort is local and frees any kernel still waiting; work still pending is dropped, so
  // ranks synchronise their streams before they let the transports go.
  abort_comms(all_comms());
}

void NcclClique::abort_all(const std::string& reason) {
  {
    std::lock_guard lock(reason_mutex_);
    if (!aborted_.load()) reason_ = reason;
    aborted_.store(true);
  }
  abort_comms(all_comms());
}

void NcclClique::wait(int rank, const Stream& stream, const std::string& what) {
  wait_until(
      rank, [&] { return stream.query(); }, what);
}

void NcclClique::wait(int rank, const Event& event, const std::string& what) {
  wait_until(
      rank, [&] { return event.query(); }, what);
}

void NcclClique::wait_until(int rank, const std::function<bool()>& finished_now,
                            const std::string& what) {
  const bool done = poll_until(Clock::now() + timeout_, [&] {
    if (aborted()) throw TransportAborted(rank, abort_reason());
    if (const auto reason = watched_abort()) {
      abort_all(*reason);
      throw TransportAborted(rank, *reason);
    }
    bool finished = false;
    try {
      finished = finished_now();
    } catch (const std::exception& e) {
      abort_all("rank " + std::to_string(rank) + ": CUDA error while waiting for " + what + ": " +
                e.what());
      throw;
    }
    if (!finished)
      for (NcclComm* comm : comms_of(rank)) check_async_error(rank, *comm, what);
    return finished;
  });
  // An abort also ends the stream's work, with the data incomplete; it is flagged before any
  // communicator is aborted, so a stream done because of one is caught here, however the
  // abort fell between the checks above.
  if (done && aborted()) throw TransportAborted(rank, abort_reason());
  if (done) return;
  const std::string reason = "rank " + std::to_string(rank) + ": " + what +
                             " did not finish within " + std::to_string(timeout_.count()) + " ms";
  abort_all(reason);
  throw TransportError(reason);
}

void NcclClique::settle_now(int rank, const NcclComm& comm, const std::string& what) {
  try {
    settle(rank, comm, [&] { return what; });
  } catch (const NcclUnsettled& unsettled) {
    abort_all(unsettled.what());
    if (unsettled.peer_aborted) throw TransportAborted(rank, unsettled.what());
    throw TransportError(unsettled.what());
  }
}

std::optional<std::string> NcclClique::watched_abort() const {
  std::unique_lock lock(watch_mutex_, std::try_to_lock);
  if (!lock.owns_lock() || !abort_watch_) return std::nullopt;
  try {
    abort_watch_();
  } catch (const TransportAborted& e) {
    return e.reason();
  }
  return std::nullopt;
}

std::vector<NcclComm*> NcclClique::comms_of(int rank) {
  std::vector<NcclComm*> out;
  if (world_[rank]) out.push_back(world_[rank].get());
  for (int peer = 0; peer < size(); ++peer) {
    if (peer == rank) continue;
    if (auto& c = links_[link_index(rank, peer, 0)]) out.push_back(c.get());
    if (auto& c = links_[link_index(peer, rank, 1)]) out.push_back(c.get());
  }
  for (size_t g = 0; g < groups_.size(); ++g)
    for (size_t i = 0; i < groups_[g].size(); ++i)
      if (groups_[g][i] == rank && group_comms_[g][i]) out.push_back(group_comms_[g][i].get());
  return out;
}

void NcclClique::abort_comms(const std::vector<NcclComm*>& comms) noexcept {
  if (!formed_.load()) {
    for (NcclComm* comm : comms)
      if (comm->handle) abort_comm(*comm);
    return;
  }
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

void NcclClique::abort_comm(NcclComm& comm) noexcept {
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

std::vector<NcclComm*> NcclClique::all_comms() {
  std::vector<NcclComm*> out;
  for (auto& c : world_)
    if (c) out.push_back(c.get());
  for (auto& c : links_)
    if (c) out.push_back(c.get());
  for (auto& members : group_comms_)
    for (auto& c : members)
      if (c) out.push_back(c.get());
  return out;
}

void NcclClique::check_async_error(int rank, NcclComm& comm, const std::string& what) {
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

void NcclClique::warm_up() {
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
          CONVEYOR_NCCL_START(ncclSend(buffers[src], 1, ncclChar, /*peer=*/1,
                                       link_sender(src, dst).handle, cuda_stream(*streams[src])));
        }
        if (holds(dst)) {
          CudaDeviceGuard guard(devices_[dst]);
          CONVEYOR_NCCL_START(ncclRecv(buffers[dst] + sizeof(double) + src, 1, ncclChar,
                                       /*peer=*/0, link_receiver(src, dst).handle,
                                       cuda_stream(*streams[dst])));
        }
        group.end();
        const std::string what = "the NCCL set-up exchange on link " + std::to_string(src) +
                                 " -> " + std::to_string(dst);
        if (holds(src)) settle_now(src, link_sender(src, dst), "connecting for " + what);
        if (holds(dst)) settle_now(dst, link_receiver(src, dst), "connecting for " + what);
        if (holds(src)) wait(src, *streams[src], what);
        if (holds(dst)) wait(dst, *streams[dst], what);
      }
    {
      NcclGroup group;
      for (int r = 0; r < p; ++r) {
        if (!holds(r)) continue;
        CudaDeviceGuard guard(devices_[r]);
        CONVEYOR_NCCL_START(ncclAllReduce(buffers[r], buffers[r], 1, ncclFloat64, ncclSum,
                                          world_[r]->handle, cuda_stream(*streams[r])));
      }
      group.end();
    }
    for (int r = 0; r < p; ++r)
      if (holds(r)) settle_now(r, *world_[r], "connecting for the NCCL set-up all-reduce");
    for (int r = 0; r < p; ++r)
      if (holds(r)) wait(r, *streams[r], "the NCCL set-up all-reduce");
    for (size_t g = 0; g < groups_.size(); ++g) {
      const std::vector<int>& group = groups_[g];
      if (std::none_of(group.begin(), group.end(), [&](int r) { return holds(r); })) continue;
      {
        NcclGroup nccl_group;
        for (size_t i = 0; i < group.size(); ++i) {
          const int r = group[i];
          if (!holds(r)) continue;
          CudaDeviceGuard guard(devices_[r]);
          ncclComm_t comm = group_comms_[g][i]->handle;
          for (size_t j = 0; j < group.size(); ++j) {
            if (j == i) continue;
            CONVEYOR_NCCL_START(ncclSend(buffers[r], 1, ncclChar, static_cast<int>(j), comm,
                                         cuda_stream(*streams[r])));
            CONVEYOR_NCCL_START(ncclRecv(buffers[r] + sizeof(double) + group[j], 1, ncclChar,
                                         static_cast<int>(j), comm, cuda_stream(*streams[r])));
          }
        }
        nccl_group.end();
      }
      const std::string what = "the NCCL set-up exchange in group " + describe_group(group);
      for (size_t i = 0; i < group.size(); ++i)
        if (holds(group[i])) settle_now(group[i], *group_comms_[g][i], "connecting for " + what);
      for (int r : group)
        if (holds(r)) wait(r, *streams[r], what);
    }
  } catch (...) {
    abort_all("set-up exchange failed");
    release();
    throw;
  }
  release();
}

}  // namespace conveyor::comm::detail

#endif  // CONVEYOR_WITH_CUDA
