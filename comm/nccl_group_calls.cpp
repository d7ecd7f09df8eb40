// The NCCL transport's group calls (sum, reduce-scatter, gather over a group of ranks): staged
// through device and pinned host buffers, issued on its group stream, several in flight.
#include "comm/nccl.h"

#ifdef CONVEYOR_WITH_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "comm/group_arithmetic.h"
#include "comm/nccl_check.h"
#include "comm/nccl_clique.h"
#include "comm/nccl_staging.h"
#include "engine/core/cuda_device_guard.h"
#include "kernels/cuda_check.h"

namespace conveyor::comm {

using conveyor::detail::CudaDeviceGuard;
using detail::cuda_stream;
using detail::describe_group;
using detail::NcclComm;
using detail::with_comm;

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

}  // namespace conveyor::comm

#endif  // CONVEYOR_WITH_CUDA
