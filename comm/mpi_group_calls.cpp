// The MPI transport's group calls (sum, reduce-scatter, gather over a group of ranks, for
// data parallelism): point to point between the members, several in flight, the arithmetic
// in group order here, never MPI's.
#ifdef CONVEYOR_WITH_MPI
#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/group_arithmetic.h"
#include "comm/mpi_endpoint.h"

namespace conveyor::comm {

using detail::Backoff;
using detail::kGroupTag;
using detail::kScatterTag;
using detail::MpiClock;
using detail::MpiTransport;

namespace {

// What the group calls share: point-to-point requests on a tag of their own (no
// communicator per group, which every process would have to create together), polled
// against the deadline, cancelled if the call is dropped unfinished.
//
// Several calls may be in flight: each posts its receives and sends when it starts, and
// members start their calls in the same order, so by MPI's non-overtaking rule (per source,
// tag and communicator, messages match receives in the order both were posted) the k-th
// call's receive from a member matches that member's k-th call's send on the same tag,
// whichever call is tested first. Sums and gathers share kGroupTag and reduce-scatters have
// kScatterTag: each tag's calls are a subsequence of the calls, in the same order on every
// member, so the pairing holds for any interleaving of the three.
class GroupExchange : public PendingGroupCall {
 public:
  GroupExchange(MpiTransport& transport, std::vector<int> group, std::string what,
                int tag = kGroupTag)
      : t_(transport), group_(std::move(group)), what_(std::move(what)), tag_(tag) {}
  // Dropped unfinished (an error elsewhere in the rank, while peers still run): MPI may go
  // on reading or writing the buffers of requests it has matched, which a cancel cannot
  // stop, so the requests go to the transport with the buffers they use, kept until they
  // complete (or, at the transport's end, beyond). Every buffer a request uses is owned
  // here, never the caller's, for this reason.
  ~GroupExchange() override {
    std::vector<MPI_Request> open;
    for (MPI_Request r : requests_)
      if (r != MPI_REQUEST_NULL) open.push_back(r);
    if (!open.empty()) t_.keep_until_done(std::move(open), std::move(buffers_));
  }

  // The deadline counts from the wait, not from the start: a call started long before it
  // is waited for (one of several in flight, behind the others) has not waited yet.
  void wait() override {
    const auto deadline = MpiClock::now() + t_.timeout();
    Backoff backoff;
    while (!test()) {
      if (MpiClock::now() >= deadline) {
        std::vector<int> missing;
        for (size_t i = 0; i < receive_from_.size(); ++i)
          if (requests_[i] != MPI_REQUEST_NULL) missing.push_back(receive_from_[i]);
        t_.give_up(what_ + " waited " + std::to_string(t_.timeout().count()) + " ms for rank(s) " +
                   (missing.empty() ? std::string("(sends pending)") : rank_list(missing)) +
                   " (did one of them stop?)");
      }
      backoff.pause();
    }
  }

 protected:
  // A buffer of the call's own (see the destructor), in place until the call is gone.
  std::vector<float>& own_buffer(size_t floats) {
    return *buffers_.emplace_back(std::make_unique<std::vector<float> >(floats));
  }
  // Every receive is posted before any send, so that receives_from_ matches requests_.
  void receive(std::vector<float>& into, int peer) {
    MPI_Request request;
    t_.check(MPI_Irecv(into.data(), t_.byte_count(into.size() * sizeof(float)), MPI_BYTE, peer,
                       tag_, t_.comm(), &request),
             "MPI_Irecv");
    requests_.push_back(request);
    receive_from_.push_back(peer);
  }
  void send(const std::vector<float>& from, int peer) {
    MPI_Request request;
    t_.check(MPI_Isend(from.data(), t_.byte_count(from.size() * sizeof(float)), MPI_BYTE, peer,
                       tag_, t_.comm(), &request),
             "MPI_Isend");
    requests_.push_back(request);
  }
  bool exchanged() {
    t_.throw_if_aborted();
    t_.reap_sends();
    int all = 0;
    t_.check(MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &all,
                         MPI_STATUSES_IGNORE),
             "MPI_Testall");
    return all != 0;
  }

  MpiTransport& t_;
  std::vector<int> group_;

 private:
  std::string what_;
  int tag_;
  std::vector<MPI_Request> requests_;  // receives (in receive_from_ order), then sends
  std::vector<int> receive_from_;
  std::vector<std::unique_ptr<std::vector<float> > > buffers_;  // what the requests use
};

// Every member sends its values to every other member and receives theirs, then adds them
// in group order, so the bits never depend on MPI.
class GroupSum : public GroupExchange {
 public:
  GroupSum(MpiTransport& transport, std::vector<float>& values, const std::vector<int>& group)
      : GroupExchange(transport, group, "the gradient sum over replicas"),
        values_(values),
        mine_(own_buffer(values.size())),
        parts_(group.size(), nullptr) {
    std::copy(values.begin(), values.end(), mine_.begin());
    for (size_t i = 0; i < group_.size(); ++i) {
      if (group_[i] == t_.rank()) continue;
      parts_[i] = &own_buffer(values.size());
      receive(*parts_[i], group_[i]);
    }
    for (int peer : group_)
      if (peer != t_.rank()) send(mine_, peer);
  }

  bool test() override {
    if (done_) return true;
    if (!exchanged()) return false;
    std::vector<const float*> parts;
    for (size_t i = 0; i < group_.size(); ++i)
      parts.push_back(group_[i] == t_.rank() ? mine_.data() : parts_[i]->data());
    add_in_group_order(values_.data(), values_.size(), parts);
    done_ = true;
    return true;
  }

 private:
  std::vector<float>& values_;
  std::vector<float>& mine_;                // sent from here
  std::vector<std::vector<float>*> parts_;  // the other members', by position in the group
  bool done_ = false;
};

// The reduce-scatter: to each other member its range, copied; from each, its part of the
// own range; then the own range summed in group order, as GroupSum adds.
class GroupReduceScatter : public GroupExchange {
 public:
  GroupReduceScatter(MpiTransport& transport, std::vector<float>& values,
                     const std::vector<int>& group, const std::vector<size_t>& bounds, size_t me)
      : GroupExchange(transport, group, "the gradient reduce-scatter over replicas", kScatterTag),
        values_(values),
        begin_(bounds[me]),
        end_(bounds[me + 1]),
        me_(me),
        parts_(group.size(), nullptr) {
    for (size_t i = 0; i < group_.size(); ++i) {
      if (i == me_) continue;
      parts_[i] = &own_buffer(end_ - begin_);
      receive(*parts_[i], group_[i]);
    }
    for (size_t i = 0; i < group_.size(); ++i) {
      if (i == me_) continue;
      std::vector<float>& range = own_buffer(bounds[i + 1] - bounds[i]);
      std::copy(values.begin() + bounds[i], values.begin() + bounds[i + 1], range.begin());
      send(range, group_[i]);
    }
  }

  bool test() override {
    if (done_) return true;
    if (!exchanged()) return false;
    std::vector<const float*> parts;
    for (size_t i = 0; i < group_.size(); ++i)
      parts.push_back(i == me_ ? values_.data() + begin_ : parts_[i]->data());
    add_in_group_order(values_.data() + begin_, end_ - begin_, parts);
    done_ = true;
    return true;
  }

 private:
  std::vector<float>& values_;
  size_t begin_, end_;  // this member's range
  size_t me_;
  std::vector<std::vector<float>*> parts_;  // the others' parts of the range, by position
  bool done_ = false;
};

// The gather: the own range to every other member, the others' received, then copied into
// their ranges.
class GroupGather : public GroupExchange {
 public:
  GroupGather(MpiTransport& transport, std::vector<float>& values, const std::vector<int>& group,
              const std::vector<size_t>& bounds, size_t me)
      : GroupExchange(transport, group, "the weight gather over replicas"),
        values_(values),
        bounds_(bounds),
        me_(me),
        parts_(group.size(), nullptr) {
    for (size_t i = 0; i < group_.size(); ++i) {
      if (i == me) continue;
      parts_[i] = &own_buffer(bounds[i + 1] - bounds[i]);
      receive(*parts_[i], group_[i]);
    }
    std::vector<float>& mine = own_buffer(bounds[me + 1] - bounds[me]);
    std::copy(values.begin() + bounds[me], values.begin() + bounds[me + 1], mine.begin());
    for (size_t i = 0; i < group_.size(); ++i)
      if (i != me) send(mine, group_[i]);
  }

  bool test() override {
    if (done_) return true;
    if (!exchanged()) return false;
    for (size_t i = 0; i < group_.size(); ++i)
      if (i != me_) std::copy(parts_[i]->begin(), parts_[i]->end(), values_.begin() + bounds_[i]);
    done_ = true;
    return true;
  }

 private:
  std::vector<float>& values_;
  std::vector<size_t> bounds_;
  size_t me_;
  std::vector<std::vector<float>*> parts_;  // the others' ranges, by position in the group
  bool done_ = false;
};

}  // namespace

namespace detail {

std::unique_ptr<PendingGroupCall> MpiTransport::start_group_gather(
    std::vector<float>& values, const std::vector<int>& group, const std::vector<size_t>& bounds) {
  check_ranges(values, group, bounds, "group gather");
  throw_if_aborted();
  return std::make_unique<GroupGather>(*this, values, group, bounds, position_in(group));
}

std::unique_ptr<PendingGroupCall> MpiTransport::start_group_reduce_scatter(
    std::vector<float>& values, const std::vector<int>& group, const std::vector<size_t>& bounds) {
  check_ranges(values, group, bounds, "group reduce-scatter");
  throw_if_aborted();
  return std::make_unique<GroupReduceScatter>(*this, values, group, bounds, position_in(group));
}

std::unique_ptr<PendingGroupCall> MpiTransport::start_group_sum(std::vector<float>& values,
                                                                const std::vector<int>& group) {
  check_group(group);
  throw_if_aborted();
  return std::make_unique<GroupSum>(*this, values, group);
}

}  // namespace detail

}  // namespace conveyor::comm

#endif
