#include "comm/nccl.h"

#include <algorithm>
#include <set>
#include <stdexcept>

#include "comm/group_arithmetic.h"
#include "engine/core/device.h"

#ifdef CONVEYOR_WITH_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <thread>

#include "comm/nccl_check.h"
#include "comm/nccl_clique.h"
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

}  // namespace

std::string detail::describe_group(const std::vector<int>& group) {
  std::string out = "{";
  for (size_t i = 0; i < group.size(); ++i) {
    if (i > 0) out += ',';
    out += std::to_string(group[i]);
  }
  out += '}';
  return out;
}

using detail::describe_group;

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

// The buffers of one group call in flight: device staging, pinned host memory (so that the
// copies stay asynchronous), and an event recorded on the group stream after the call's
// last work, which says when the buffers are the host's again.
struct NcclStagingSlot {
  float* device = nullptr;
  size_t device_floats = 0;
  float* host = nullptr;
  size_t host_floats = 0;
  std::unique_ptr<Event> done;
  bool held = false;  // by a call not finished yet

  // Not held, and the group stream has passed the work of its last call (one whose handle
  // was dropped unfinished may still be running). An event that cannot be asked is busy.
  bool available() const {
    if (held) return false;
    try {
      return done->query();
    } catch (...) {
      return false;
    }
  }
  bool fits(size_t device_need, size_t host_need) const {
    return device_floats >= device_need && host_floats >= host_need;
  }
};

// Every group call in flight has a slot of its own, so that a call never overwrites the
// staging of one started before it: the pool grows to the most calls a rank has had in flight
// at once and reuses them. Nothing is freed before the transport goes, because cudaFree and
// cudaFreeHost can wait for the whole device, where NCCL kernels of the pipeline's links may
// be waiting for a peer that waits for this rank; buffers outgrown are kept until then too.
struct NcclStaging {
  std::vector<std::unique_ptr<NcclStagingSlot>> slots;
  std::vector<float*> retired_device, retired_host;

  // An available slot with at least these sizes (one that fits first, else one grown, else a
  // new one), held until release_slot. With the transport's device current.
  NcclStagingSlot& acquire(Device device, size_t device_need, size_t host_need) {
    NcclStagingSlot* pick = nullptr;
    for (const auto& slot : slots) {
      if (!slot->available()) continue;
      if (slot->fits(device_need, host_need)) {
        pick = slot.get();
        break;
      }
      if (!pick) pick = slot.get();
    }
    if (!pick) {
      slots.push_back(std::make_unique<NcclStagingSlot>());
      pick = slots.back().get();
      pick->done = std::make_unique<Event>(device, /*timing=*/false);
    }
    grow(*pick, device_need, host_need);
    pick->held = true;
    return *pick;
  }

  // With the transport's device current, and no work left on its group stream.
  void release() noexcept {
    for (const auto& slot : slots) {
      if (slot->device) retired_device.push_back(slot->device);
      if (slot->host) retired_host.push_back(slot->host);
    }
    slots.clear();
    for (float* d : retired_device) (void)cudaFree(d);
    for (float* h : retired_host) (void)cudaFreeHost(h);
    retired_device.clear();
    retired_host.clear();
  }

 private:
  void grow(NcclStagingSlot& slot, size_t device_need, size_t host_need) {
    if (device_need > slot.device_floats) {
      float* grown = nullptr;
      CONVEYOR_CUDA_CHECK(cudaMalloc(&grown, device_need * sizeof(float)));
      if (slot.device) retired_device.push_back(slot.device);
      slot.device = grown;
      slot.device_floats = device_need;
    }
    if (host_need > slot.host_floats) {
      float* grown = nullptr;
      CONVEYOR_CUDA_CHECK(cudaMallocHost(&grown, host_need * sizeof(float)));
      if (slot.host) retired_host.push_back(slot.host);
      slot.host = grown;
      slot.host_floats = host_need;
    }
  }
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
  group_stream_ = std::make_unique<Stream>(Device::cuda(device_));
  staging_ = std::make_unique<detail::NcclStaging>();
}

NcclTransport::~NcclTransport() {
  std::optional<CudaDeviceGuard> guard;
  make_current_if_possible(guard, device_);
  // Freeing waits for the device: first make sure no all-reduce kernel can still be waiting
  // for a peer (only after an error: every successful call waited for its stream). A stream
  // that cannot even be asked is treated as busy.
  auto done = [](const Stream& stream) {
    try {
      return stream.query();
    } catch (...) {
      return false;
    }
  };
  if (!done(*reduce_stream_))
    clique_->abort_all("rank " + std::to_string(rank_) +
                       ": transport destroyed during an all-reduce");
  if (!done(*group_stream_))
    clique_->abort_all("rank " + std::to_string(rank_) +
                       ": transport destroyed during a group call");
  if (reduce_device_) retired_reduce_device_.push_back(reduce_device_);
  if (reduce_host_) retired_reduce_host_.push_back(reduce_host_);
  for (double* d : retired_reduce_device_) (void)cudaFree(d);
  for (double* h : retired_reduce_host_) (void)cudaFreeHost(h);
  reduce_stream_.reset();
  // After an abort the aborted kernels end; the stream is waited for so that no copy still
  // reads the buffers when they go.
  try {
    group_stream_->synchronize();
  } catch (...) {
  }
  staging_->release();
  group_stream_.reset();
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
  } catch (const detail::NcclUnsettled& failure) {
    reason = failure.what(), peer_aborted = failure.peer_aborted;
  }
  clique.abort_all(reason);
  if (peer_aborted) throw TransportAborted(rank, reason);
  throw TransportError(reason);
}

}  // namespace

void NcclTransport::send(const Tensor& tensor, int peer, const Stream& stream) {
  throw_if_aborted();
  check_peer(peer, "send to");
  check_tensor(tensor, "send");
  auto s = cuda_stream(stream);
  NcclComm& link = clique_->link_sender(rank_, peer);
  with_comm(link, rank_, *clique_, [&](ncclComm_t comm) {
    CONVEYOR_NCCL_START(ncclSend(tensor.raw(), nccl_count(tensor), nccl_type(tensor.dtype()),
                                 /*peer=*/1, comm, s));
    clique_->settle(rank_, link, [&] {
      return "sending " + tensor.describe() + " to rank " + std::to_string(peer) + " over NCCL";
    });
  });
  record_stream(tensor, stream.native());
}

void NcclTransport::recv(const Tensor& tensor, int peer, const Stream& stream) {
  throw_if_aborted();
  check_peer(peer, "receive from");
  check_tensor(tensor, "receive into");
  auto s = cuda_stream(stream);
  NcclComm& link = clique_->link_receiver(peer, rank_);
  with_comm(link, rank_, *clique_, [&](ncclComm_t comm) {
    CONVEYOR_NCCL_START(ncclRecv(tensor.raw(), nccl_count(tensor), nccl_type(tensor.dtype()),
                                 /*peer=*/0, comm, s));
    clique_->settle(rank_, link, [&] {
      return "receiving " + tensor.describe() + " from rank " + std::to_string(peer) + " over NCCL";
    });
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
  NcclComm& world = clique_->world(rank_);
  with_comm(world, rank_, *clique_, [&](ncclComm_t comm) {
    detail::NcclGroup group;
    CONVEYOR_NCCL_START(ncclSend(src.raw(), src.nbytes(), ncclChar, rank_, comm, s));
    CONVEYOR_NCCL_START(ncclRecv(dst.raw(), dst.nbytes(), ncclChar, rank_, comm, s));
    group.end();
    clique_->settle(rank_, world, [] { return std::string("a send to itself over NCCL"); });
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
    // Doubling bounds the retired buffers by the live ones; the retired are freed with the
    // transport (see retired_reduce_device_).
    const size_t capacity = std::max(n, 2 * reduce_capacity_);
    double* grown_device = nullptr;
    double* grown_host = nullptr;
    CONVEYOR_CUDA_CHECK(cudaMalloc(&grown_device, capacity * sizeof(double)));
    const cudaError_t host_status = cudaMallocHost(&grown_host, capacity * sizeof(double));
    if (host_status != cudaSuccess) {
      retired_reduce_device_.push_back(grown_device);
      CONVEYOR_CUDA_CHECK(host_status);
    }
    if (reduce_device_) retired_reduce_device_.push_back(reduce_device_);
    if (reduce_host_) retired_reduce_host_.push_back(reduce_host_);
    reduce_device_ = grown_device;
    reduce_host_ = grown_host;
    reduce_capacity_ = capacity;
  }
  std::memcpy(reduce_host_, values.data(), n * sizeof(double));
  NcclComm& world = clique_->world(rank_);
  with_comm(world, rank_, *clique_, [&](ncclComm_t comm) {
    CONVEYOR_CUDA_CHECK(cudaMemcpyAsync(reduce_device_, reduce_host_, n * sizeof(double),
                                        cudaMemcpyHostToDevice, stream));
    CONVEYOR_NCCL_START(
        ncclAllReduce(reduce_device_, reduce_device_, n, ncclFloat64, ncclSum, comm, stream));
    clique_->settle(rank_, world,
                    [&] { return "starting the all-reduce of " + std::to_string(n) + " values"; });
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

void NcclTransport::check_while_waiting(std::function<void()> check) {
  clique_->set_abort_watch(std::move(check));
}

namespace detail {

// What one member moves in a group call, in floats: values[up_from, up_from + up_count) up to
// the device at up_to; the sends and receives of device ranges to and from other members
// (by position in the group); device[down_from, down_from + down_count) back to the host,
// where `finish` reads it and writes the result into the caller's values.
struct GroupExchange {
  struct Piece {
    int peer;  // position in the group, which is the rank in the group's communicator
    size_t at, count;
  };
  size_t up_from = 0, up_count = 0, up_to = 0;
  std::vector<Piece> sends, recvs;
  size_t device_floats = 0;
  size_t down_from = 0, down_count = 0;
  std::function<void(const float* received)> finish;
};

// A group call in flight. Calls of one transport run on its group stream in start order,
// each in a staging slot of its own, so several can be in flight: each finishes when the
// event recorded after its own work has passed, whatever the later calls do.
class NcclGroupCall : public PendingGroupCall {
 public:
  // Issues `exchange` for `t`'s member of `group` on its group stream; never waits.
  static std::unique_ptr<PendingGroupCall> start(NcclTransport& t, const std::vector<int>& group,
                                                 std::vector<float>& values, GroupExchange exchange,
                                                 const std::string& what) {
    t.throw_if_aborted();
    auto call = std::unique_ptr<NcclGroupCall>(
        new NcclGroupCall(t, what + " of group " + describe_group(group), exchange.finish));
    // A group of this rank alone has no communicator and nothing to move.
    int index = -1;
    try {
      if (group.size() > 1) index = t.clique_->group_index(group);
    } catch (const TransportError& e) {
      throw TransportError("rank " + std::to_string(t.rank_) + ": " + what + ": " + e.what());
    }
    if (exchange.sends.empty() && exchange.recvs.empty()) {
      call->finish_(nullptr);
      call->done_ = true;
      return call;
    }
    CudaDeviceGuard guard(t.device_);
    // Held for good if issuing fails below: work already enqueued may still use it.
    NcclStagingSlot& slot = t.staging_->acquire(Device::cuda(t.device_), exchange.device_floats,
                                                exchange.up_count + exchange.down_count);
    std::memcpy(slot.host, values.data() + exchange.up_from, exchange.up_count * sizeof(float));
    auto stream = cuda_stream(*t.group_stream_);
    NcclComm& comm = t.clique_->group_comm(index, t.position_in(group));
    with_comm(comm, t.rank_, *t.clique_, [&](ncclComm_t handle) {
      if (exchange.up_count > 0)
        CONVEYOR_CUDA_CHECK(cudaMemcpyAsync(slot.device + exchange.up_to, slot.host,
                                            exchange.up_count * sizeof(float),
                                            cudaMemcpyHostToDevice, stream));
      NcclGroup nccl_group;
      for (const auto& piece : exchange.sends)
        CONVEYOR_NCCL_START(
            ncclSend(slot.device + piece.at, piece.count, ncclFloat, piece.peer, handle, stream));
      for (const auto& piece : exchange.recvs)
        CONVEYOR_NCCL_START(
            ncclRecv(slot.device + piece.at, piece.count, ncclFloat, piece.peer, handle, stream));
      nccl_group.end();
      t.clique_->settle(t.rank_, comm, [&] { return "starting " + call->what_; });
      if (exchange.down_count > 0)
        CONVEYOR_CUDA_CHECK(
            cudaMemcpyAsync(slot.host + exchange.up_count, slot.device + exchange.down_from,
                            exchange.down_count * sizeof(float), cudaMemcpyDeviceToHost, stream));
    });
    slot.done->record(*t.group_stream_);
    call->slot_ = &slot;
    call->received_ = slot.host + exchange.up_count;
    return call;
  }

  ~NcclGroupCall() override {
    // A call dropped unfinished gives its slot back; the pool reuses it once its event has
    // passed.
    if (slot_) slot_->held = false;
  }

  bool test() override {
    if (done_) return true;
    t_.throw_if_aborted();
    CudaDeviceGuard guard(t_.device_);
    bool ready = false;
    try {
      ready = slot_->done->query();
    } catch (const std::exception& e) {
      t_.clique_->abort_all("rank " + std::to_string(t_.rank_) + ": CUDA error during " + what_ +
                            ": " + e.what());
      throw;
    }
    if (!ready) return false;
    // An abort also ends the stream's work, with the data incomplete: it is set before any
    // communicator is aborted, so a stream that is done because of one is seen here.
    t_.throw_if_aborted();
    finish_(received_);
    done_ = true;
    slot_->held = false;
    slot_ = nullptr;
    return true;
  }

  // Waits for this call's work only, not for calls started after it. NCCL cannot tell which
  // member did not come: the error names the group.
  void wait() override {
    if (done_) return;
    t_.throw_if_aborted();
    {
      CudaDeviceGuard guard(t_.device_);
      t_.clique_->wait(t_.rank_, *slot_->done, what_);
    }
    test();
  }

 private:
  NcclGroupCall(NcclTransport& t, std::string what, std::function<void(const float*)> finish)
      : t_(t), what_(std::move(what)), finish_(std::move(finish)) {}

  NcclTransport& t_;
  std::string what_;
  std::function<void(const float*)> finish_;
  NcclStagingSlot* slot_ = nullptr;  // this call's, until it finishes
  const float* received_ = nullptr;  // in the slot's host memory
  bool done_ = false;
};

}  // namespace detail

using detail::GroupExchange;

// Every member sends its values to each other member and receives theirs (the traffic of the
// MPI transport's group sum), then adds them in group order from zero.
std::unique_ptr<PendingGroupCall> NcclTransport::start_group_sum(std::vector<float>& values,
                                                                 const std::vector<int>& group) {
  check_group(group);
  const size_t n = values.size(), me = position_in(group), members = group.size();
  GroupExchange x;
  x.up_count = n;
  x.device_floats = n + members * n;  // own values, then one slot per member (own unused)
  x.down_from = n;
  x.down_count = members * n;
  for (size_t j = 0; j < members && n > 0; ++j)
    if (j != me) {
      x.sends.push_back({static_cast<int>(j), 0, n});
      x.recvs.push_back({static_cast<int>(j), n + j * n, n});
    }
  x.finish = [&values, n, me, members](const float* received) {
    std::vector<const float*> parts;
    for (size_t i = 0; i < members; ++i)
      parts.push_back(i == me ? values.data() : received + i * n);
    add_in_group_order(values.data(), n, parts);
  };
  return detail::NcclGroupCall::start(*this, group, values, std::move(x),
                                      "the gradient sum over replicas");
}

// To each other member its range of this member's values; from each, its values of this
// member's range, added to this member's own in group order from zero.
std::unique_ptr<PendingGroupCall> NcclTransport::start_group_reduce_scatter(
    std::vector<float>& values, const std::vector<int>& group, const std::vector<size_t>& bounds) {
  check_ranges(values, group, bounds, "group reduce-scatter");
  const size_t n = values.size(), me = position_in(group), members = group.size();
  const size_t begin = bounds[me], count = bounds[me + 1] - begin;
  GroupExchange x;
  x.up_count = n;
  x.device_floats = n + members * count;  // all values, then one slot per member (own unused)
  x.down_from = n;
  x.down_count = members * count;
  for (size_t j = 0; j < members; ++j) {
    if (j == me) continue;
    if (bounds[j + 1] > bounds[j])
      x.sends.push_back({static_cast<int>(j), bounds[j], bounds[j + 1] - bounds[j]});
    if (count > 0) x.recvs.push_back({static_cast<int>(j), n + j * count, count});
  }
  x.finish = [&values, begin, count, me, members](const float* received) {
    std::vector<const float*> parts;
    for (size_t i = 0; i < members; ++i)
      parts.push_back(i == me ? values.data() + begin : received + i * count);
    add_in_group_order(values.data() + begin, count, parts);
  };
  return detail::NcclGroupCall::start(*this, group, values, std::move(x),
                                      "the gradient reduce-scatter over replicas");
}

// This member's range to every other member; theirs received in place on the device, then
// copied into the caller's values.
std::unique_ptr<PendingGroupCall> NcclTransport::start_group_gather(
    std::vector<float>& values, const std::vector<int>& group, const std::vector<size_t>& bounds) {
  check_ranges(values, group, bounds, "group gather");
  const size_t n = values.size(), me = position_in(group), members = group.size();
  const size_t begin = bounds[me], count = bounds[me + 1] - begin;
  GroupExchange x;
  x.up_from = x.up_to = begin;
  x.up_count = count;
  x.device_floats = n;
  x.down_count = n;
  for (size_t j = 0; j < members; ++j) {
    if (j == me) continue;
    if (count > 0) x.sends.push_back({static_cast<int>(j), begin, count});
    if (bounds[j + 1] > bounds[j])
      x.recvs.push_back({static_cast<int>(j), bounds[j], bounds[j + 1] - bounds[j]});
  }
  x.finish = [&values, bounds, me](const float* received) {
    for (size_t j = 0; j + 1 < bounds.size(); ++j)
      if (j != me)
        std::copy(received + bounds[j], received + bounds[j + 1], values.begin() + bounds[j]);
  };
  return detail::NcclGroupCall::start(*this, group, values, std::move(x),
                                      "the weight gather over replicas");
}

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
    const std::vector<int>& cuda_device_per_rank, std::chrono::milliseconds timeout,
    const NcclGroups& groups) {
  if (cuda_device_per_rank.empty())
    throw std::invalid_argument("the NCCL transport needs at least one rank");
  check_timeout(timeout);
  check_nccl_groups(groups, static_cast<int>(cuda_device_per_rank.size()));
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
  auto clique = std::make_shared<NcclClique>(cuda_device_per_rank, timeout, groups);
  std::vector<std::unique_ptr<Transport>> out;
  for (int r = 0; r < clique->size(); ++r)
    out.push_back(std::make_unique<NcclTransport>(clique, r));
  return out;
}

std::unique_ptr<Transport> make_nccl_transport_from_ids(int rank, int ranks, int cuda_device,
                                                        const std::vector<std::string>& unique_ids,
                                                        std::chrono::milliseconds timeout,
                                                        const NcclGroups& groups) {
  check_timeout(timeout);
  check_clique_rank(rank, ranks, "rank");
  check_nccl_groups(groups, ranks);
  const int slots = nccl_slot_count(ranks, static_cast<int>(groups.size()));
  check_device(rank, cuda_device);
  if (static_cast<int>(unique_ids.size()) != slots)
    throw std::invalid_argument("a clique of " + std::to_string(ranks) + " rank(s) and " +
                                std::to_string(groups.size()) + " group(s) needs " +
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
  auto clique = std::make_shared<NcclClique>(rank, ranks, cuda_device, ids, timeout, groups);
  return std::make_unique<NcclTransport>(clique, rank);
}

#endif  // CONVEYOR_WITH_CUDA

}  // namespace conveyor::comm
