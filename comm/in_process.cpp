#include "comm/in_process.h"

#include <algorithm>
#include <cstring>

#include "comm/group_arithmetic.h"

namespace conveyor::comm {
namespace {

// What the reduce-scatter and the gather share: at its start a call claims, on the queue from each
// other member, the number of the post that member makes for it (InProcessHub::claim_group_slot),
// and takes that post alone, so that calls in flight at once never take each other's parts,
// whichever of them is tested first.
class InProcessGroupCall : public PendingGroupCall {
 public:
  void wait() override {
    while (!test()) {
      std::vector<InProcessHub::GroupSlot> awaited;
      std::vector<int> missing;
      for (size_t i = 0; i < group_.size(); ++i)
        if (i != me_ && !arrived(i)) {
          awaited.push_back(slots_[i]);
          missing.push_back(group_[i]);
        }
      if (!hub_->wait_group_values(rank_, awaited, rank_))
        hub_->fail(rank_, std::string(what_) + " waited " +
                              std::to_string(hub_->timeout().count()) + " ms for rank(s) " +
                              rank_list(missing));
    }
  }

  // Dropped unfinished (its rank failed elsewhere with calls in flight, while the peers run
  // on): the posts it claimed and has not taken would stay in the hub until the hub goes.
  ~InProcessGroupCall() override {
    std::vector<InProcessHub::GroupSlot> untaken;
    for (size_t i = 0; i < group_.size(); ++i)
      if (i != me_ && !taken_[i]) untaken.push_back(slots_[i]);
    if (!untaken.empty()) hub_->release_group_slots(rank_, untaken);
  }

 protected:
  // `me`: this member's position in `group`; `what` names the call in a timeout's error.
  InProcessGroupCall(std::shared_ptr<InProcessHub> hub, int rank, const std::vector<int>& group,
                     size_t me, const char* what)
      : hub_(std::move(hub)),
        rank_(rank),
        group_(group),
        me_(me),
        what_(what),
        taken_(group.size(), false) {
    for (size_t i = 0; i < group_.size(); ++i)
      slots_.push_back({group_[i], i == me_ ? 0 : hub_->claim_group_slot(group_[i], rank_)});
  }
  // Whether the part of the member at position i (not this one) has been taken.
  virtual bool arrived(size_t i) const = 0;
  // The part of the member at position i for this call, if it came; never waits.
  InProcessHub::GroupValues try_take(size_t i) {
    InProcessHub::GroupValues part = hub_->try_take_group_values(slots_[i], rank_, rank_);
    if (part) taken_[i] = true;
    return part;
  }

  std::shared_ptr<InProcessHub> hub_;
  int rank_;
  std::vector<int> group_;
  size_t me_;  // this member's position in the group

 private:
  const char* what_;
  std::vector<InProcessHub::GroupSlot> slots_;  // by position in the group; own unused
  std::vector<bool> taken_;                     // by position: its post taken by this call
};

// One member's reduce-scatter: each other member's range is posted to that member alone; the
// others' parts of this member's range are taken as they come, and summed in group order,
// with this member's own values in its place, once all are in.
class InProcessGroupReduceScatter : public InProcessGroupCall {
 public:
  InProcessGroupReduceScatter(std::shared_ptr<InProcessHub> hub, int rank,
                              std::vector<float>& values, const std::vector<int>& group,
                              const std::vector<size_t>& bounds, size_t me)
      : InProcessGroupCall(std::move(hub), rank, group, me,
                           "the gradient reduce-scatter over replicas"),
        values_(values),
        begin_(bounds[me]),
        end_(bounds[me + 1]),
        parts_(group.size()) {
    for (size_t i = 0; i < group_.size(); ++i)
      if (i != me_)
        hub_->post_group_values_to(rank_, group_[i],
                                   std::make_shared<const std::vector<float>>(
                                       values.begin() + bounds[i], values.begin() + bounds[i + 1]));
  }

  bool test() override {
    if (done_) return true;
    bool all = true;
    for (size_t i = 0; i < group_.size(); ++i) {
      if (i == me_ || parts_[i]) continue;
      parts_[i] = try_take(i);
      if (!parts_[i]) {
        all = false;
        continue;
      }
      if (parts_[i]->size() != end_ - begin_)
        hub_->fail(rank_, "group reduce-scatter expected " + std::to_string(end_ - begin_) +
                              " values from rank " + std::to_string(group_[i]) + ", got " +
                              std::to_string(parts_[i]->size()));
    }
    if (!all) return false;
    // The additions of the group sum on this range.
    std::vector<const float*> parts;
    for (size_t i = 0; i < group_.size(); ++i)
      parts.push_back(i == me_ ? values_.data() + begin_ : parts_[i]->data());
    add_in_group_order(values_.data() + begin_, end_ - begin_, parts);
    parts_.clear();
    done_ = true;
    return true;
  }

 private:
  bool arrived(size_t i) const override { return done_ || parts_[i] != nullptr; }

  std::vector<float>& values_;
  size_t begin_, end_;                            // this member's range
  std::vector<InProcessHub::GroupValues> parts_;  // the others' parts of the range, by position
  bool done_ = false;
};

// One member's group gather: its own range is posted at the start; the others' ranges are
// copied into place as they come.
class InProcessGroupGather : public InProcessGroupCall {
 public:
  InProcessGroupGather(std::shared_ptr<InProcessHub> hub, int rank, std::vector<float>& values,
                       const std::vector<int>& group, const std::vector<size_t>& bounds, size_t me)
      : InProcessGroupCall(std::move(hub), rank, group, me, "the weight gather over replicas"),
        values_(values),
        bounds_(bounds),
        arrived_(group.size(), false) {
    arrived_[me_] = true;
    hub_->post_group_values(rank_, group_,
                            std::make_shared<const std::vector<float>>(
                                values.begin() + bounds[me], values.begin() + bounds[me + 1]));
  }

  bool test() override {
    bool all = true;
    for (size_t i = 0; i < group_.size(); ++i) {
      if (arrived_[i]) continue;
      InProcessHub::GroupValues part = try_take(i);
      if (!part) {
        all = false;
        continue;
      }
      if (part->size() != bounds_[i + 1] - bounds_[i])
        hub_->fail(rank_, "group gather expected " + std::to_string(bounds_[i + 1] - bounds_[i]) +
                              " values from rank " + std::to_string(group_[i]) + ", got " +
                              std::to_string(part->size()));
      std::copy(part->begin(), part->end(), values_.begin() + bounds_[i]);
      arrived_[i] = true;
    }
    return all;
  }

 private:
  bool arrived(size_t i) const override { return arrived_[i]; }

  std::vector<float>& values_;
  std::vector<size_t> bounds_;
  std::vector<bool> arrived_;
};

class InProcessTransport : public Transport {
 public:
  InProcessTransport(std::shared_ptr<InProcessHub> hub, int rank)
      : hub_(std::move(hub)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return hub_->size(); }

  void send(const Tensor& tensor, int peer, const Stream& stream) override {
    check_peer(peer, "send to");
    InProcessHub::Message message;
    message.bytes = tensor.nbytes();
    if (tensor.device().is_cpu()) {
      message.host_bytes.resize(message.bytes);
      std::memcpy(message.host_bytes.data(), tensor.raw(), message.bytes);
    } else {
      message.device_tensor = tensor;
      message.ready = std::make_shared<Event>(tensor.device(), /*timing=*/false);
      message.ready->record(stream);
    }
    hub_->push(rank_, peer, std::move(message));
  }

  void recv(const Tensor& tensor, int peer, const Stream& stream) override {
    check_peer(peer, "receive from");
    deliver(hub_->pop(peer, rank_, rank_), tensor, peer, stream);
  }

  bool try_recv(const Tensor& tensor, int peer, const Stream& stream) override {
    check_peer(peer, "receive from");
    std::optional<InProcessHub::Message> message = hub_->try_pop(peer, rank_, rank_);
    if (!message) return false;
    deliver(std::move(*message), tensor, peer, stream);
    return true;
  }

  void all_reduce_sum(std::vector<double>& values) override { hub_->all_reduce(rank_, values); }
  std::unique_ptr<PendingGroupCall> start_group_sum(std::vector<float>& values,
                                                    const std::vector<int>& group) override {
    check_group(group);
    return hub_->start_group_sum(rank_, values, group, position_in(group));
  }
  std::unique_ptr<PendingGroupCall> start_group_reduce_scatter(
      std::vector<float>& values, const std::vector<int>& group,
      const std::vector<size_t>& bounds) override {
    check_ranges(values, group, bounds, "group reduce-scatter");
    return std::make_unique<InProcessGroupReduceScatter>(hub_, rank_, values, group, bounds,
                                                         position_in(group));
  }
  std::unique_ptr<PendingGroupCall> start_group_gather(std::vector<float>& values,
                                                       const std::vector<int>& group,
                                                       const std::vector<size_t>& bounds) override {
    check_ranges(values, group, bounds, "group gather");
    return std::make_unique<InProcessGroupGather>(hub_, rank_, values, group, bounds,
                                                  position_in(group));
  }
  void abort(const std::string& reason) override { hub_->abort(reason); }

 private:
  // Puts a message popped from the link `peer` -> this rank into `tensor`, on `stream`.
  void deliver(InProcessHub::Message message, const Tensor& tensor, int peer,
               const Stream& stream) const {
    if (message.bytes != tensor.nbytes())
      throw TransportError("rank " + std::to_string(rank_) + ": message from rank " +
                           std::to_string(peer) + " has " + std::to_string(message.bytes) +
                           " bytes, the receiving tensor " + tensor.describe() + " has " +
                           std::to_string(tensor.nbytes()));
    if (!message.device_tensor.defined()) {
      copy_from_host(tensor, message.host_bytes.data(), message.bytes);
      return;
    }
    // Device data: order the copy after the producer, on the receiver's stream, and keep the
    // sender's block, and the receiving one if it was made for another stream, from being
    // reused until that stream has passed the copy (as the NCCL transport marks both).
    message.ready->wait(stream);
    copy_tensor(tensor, message.device_tensor, stream.native());
    const auto& storage = message.device_tensor.storage();
    storage->allocator().record_stream(storage->data(), stream.native());
    record_stream(tensor, stream.native());
  }

  std::shared_ptr<InProcessHub> hub_;
  int rank_;
};

}  // namespace

std::shared_ptr<InProcessHub> InProcessHub::create(int size, std::chrono::milliseconds timeout) {
  if (size < 1) throw std::invalid_argument("in-process transport needs at least one rank");
  check_timeout(timeout, "the in-process transport's timeout");
  return std::shared_ptr<InProcessHub>(new InProcessHub(size, timeout));
}

InProcessHub::InProcessHub(int size, std::chrono::milliseconds timeout)
    : size_(size),
      timeout_(timeout),
      arrived_for_(size),
      links_(static_cast<size_t>(size) * size),
      group_links_(static_cast<size_t>(size) * size),
      group_bytes_sent_(size, 0),
      contributions_(size) {}

std::unique_ptr<Transport> InProcessHub::endpoint(int rank) {
  if (rank < 0 || rank >= size_)
    throw std::invalid_argument("rank " + std::to_string(rank) + " out of range for " +
                                std::to_string(size_) + " ranks");
  return std::make_unique<InProcessTransport>(shared_from_this(), rank);
}

void InProcessHub::throw_if_aborted(int rank) const {
  if (aborted_) throw TransportAborted(rank, abort_reason_);
}

void InProcessHub::push(int src, int dst, Message message) {
  {
    std::lock_guard lock(mutex_);
    throw_if_aborted(src);
    links_[static_cast<size_t>(src) * size_ + dst].push_back(std::move(message));
  }
  arrived_for_[dst].notify_all();  // only the receiver waits on it
}

InProcessHub::Message InProcessHub::pop(int src, int dst, int waiting_rank) {
  std::unique_lock lock(mutex_);
  auto& queue = links_[static_cast<size_t>(src) * size_ + dst];
  const bool ready =
      arrived_for_[dst].wait_for(lock, timeout_, [&] { return aborted_ || !queue.empty(); });
  throw_if_aborted(waiting_rank);
  if (!ready)
    fail_locked(waiting_rank, "nothing arrived from rank " + std::to_string(src) + " within " +
                                  std::to_string(timeout_.count()) + " ms");
  Message message = std::move(queue.front());
  queue.pop_front();
  return message;
}

std::optional<InProcessHub::Message> InProcessHub::try_pop(int src, int dst, int waiting_rank) {
  std::lock_guard lock(mutex_);
  throw_if_aborted(waiting_rank);
  auto& queue = links_[static_cast<size_t>(src) * size_ + dst];
  if (queue.empty()) return std::nullopt;
  Message message = std::move(queue.front());
  queue.pop_front();
  return message;
}

void InProcessHub::all_reduce(int rank, std::vector<double>& values) {
  std::unique_lock lock(mutex_);
  throw_if_aborted(rank);
  const uint64_t round = round_;
  contributions_[rank] = values;
  if (++arrived_ == size_) {
    result_.assign(values.size(), 0.0);
    for (int r = 0; r < size_; ++r) {
      if (contributions_[r].size() != values.size())
        fail_locked(rank, "all-reduce of " + std::to_string(values.size()) + " values, but rank " +
                              std::to_string(r) + " gave " +
                              std::to_string(contributions_[r].size()));
      for (size_t i = 0; i < values.size(); ++i) result_[i] += contributions_[r][i];
    }
    arrived_ = 0;
    ++round_;
    reduced_.notify_all();
  } else {
    const bool done =
        reduced_.wait_for(lock, timeout_, [&] { return aborted_ || round_ != round; });
    throw_if_aborted(rank);
    if (!done)
      fail_locked(rank, "all-reduce waited " + std::to_string(timeout_.count()) +
                            " ms for the other ranks");
  }
  values = result_;
}

void InProcessHub::post_group_values(int src, const std::vector<int>& group, GroupValues values) {
  {
    std::lock_guard lock(mutex_);
    throw_if_aborted(src);
    for (int dst : group)
      if (dst != src) {
        group_link(src, dst).post(values);
        group_bytes_sent_[src] += values->size() * sizeof(float);
      }
  }
  for (int dst : group)
    if (dst != src) arrived_for_[dst].notify_all();
}

void InProcessHub::post_group_values_to(int src, int dst, GroupValues values) {
  {
    std::lock_guard lock(mutex_);
    throw_if_aborted(src);
    group_bytes_sent_[src] += values->size() * sizeof(float);
    group_link(src, dst).post(std::move(values));
  }
  arrived_for_[dst].notify_all();
}

size_t InProcessHub::group_bytes_sent(int rank) const {
  std::lock_guard lock(mutex_);
  return group_bytes_sent_.at(rank);
}

uint64_t InProcessHub::claim_group_slot(int src, int dst) {
  std::lock_guard lock(mutex_);
  return group_link(src, dst).next_claim++;
}

InProcessHub::GroupValues InProcessHub::try_take_group_values(GroupSlot slot, int dst,
                                                              int waiting_rank) {
  std::lock_guard lock(mutex_);
  throw_if_aborted(waiting_rank);
  auto& posted = group_link(slot.src, dst).posted;
  const auto found = posted.find(slot.number);
  if (found == posted.end()) return nullptr;
  GroupValues values = std::move(found->second);
  posted.erase(found);
  return values;
}

bool InProcessHub::wait_group_values(int dst, const std::vector<GroupSlot>& awaited,
                                     int waiting_rank) {
  std::unique_lock lock(mutex_);
  const bool ready = arrived_for_[dst].wait_for(lock, timeout_, [&] {
    if (aborted_ || awaited.empty()) return true;
    for (const GroupSlot& slot : awaited)
      if (group_link(slot.src, dst).posted.count(slot.number)) return true;
    return false;
  });
  throw_if_aborted(waiting_rank);
  return ready;
}

void InProcessHub::release_group_slots(int dst, const std::vector<GroupSlot>& slots) noexcept {
  std::lock_guard lock(mutex_);
  for (const GroupSlot& slot : slots) {
    GroupLink& link = group_link(slot.src, dst);
    if (link.posted.erase(slot.number) > 0 || slot.number < link.next_post) continue;
    try {
      link.released.insert(slot.number);
    } catch (...) {
      // Out of memory: the post is kept when it comes, as before, held until the hub goes.
    }
  }
}

size_t InProcessHub::group_posts_held() const {
  std::lock_guard lock(mutex_);
  size_t held = 0;
  for (const GroupLink& link : group_links_) held += link.posted.size();
  return held + sum_parts_held_locked();
}

void InProcessHub::fail(int rank, const std::string& what) {
  std::lock_guard lock(mutex_);
  fail_locked(rank, what);
}

void InProcessHub::fail_locked(int rank, const std::string& what) {
  // A rank that gives up takes the others down with it, so none waits for it in vain.
  const std::string reason = "rank " + std::to_string(rank) + ": " + what;
  if (!aborted_) {
    aborted_ = true;
    abort_reason_ = reason;
  }
  wake_everyone();
  throw TransportError(reason);
}

void InProcessHub::abort(const std::string& reason) {
  {
    std::lock_guard lock(mutex_);
    if (!aborted_) {
      aborted_ = true;
      abort_reason_ = reason;
    }
  }
  wake_everyone();
}

void InProcessHub::wake_everyone() {
  for (auto& cv : arrived_for_) cv.notify_all();
  reduced_.notify_all();
}

}  // namespace conveyor::comm
