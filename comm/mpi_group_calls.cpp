// The MPI transport's group calls (sum, reduce-scatter, gather over a group of ranks, for
// data parallelism): point to point between the members, several in flight, the arithmetic
// in group order here, never MPI's.
//
// No communicator per group (which every process would have to create together): the calls'
// messages go on the transport's communicator, on tags that keep them apart. Reduce-scatters
// and the first phase of sums share kScatterTag and gathers have kGroupTag, all posted when
// the call starts; members start their calls in the same order, so by MPI's non-overtaking
// rule (per source, tag and communicator, messages match receives in the order both were
// posted) the k-th call's receive from a member on a tag matches that member's k-th call's
// send on it, whichever call is tested first. A sum's second phase is posted when its first
// is done, which happens in another order on each member: each sum takes a tag of its own for
// it, numbered per pair of members, so no two sums in flight between two ranks share one.
#ifdef CONVEYOR_WITH_MPI
#include <algorithm>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "comm/group_arithmetic.h"
#include "comm/mpi_endpoint.h"

namespace conveyor::comm::detail {

MpiGroupCall::MpiGroupCall(MpiTransport& transport, std::vector<int> group, size_t me,
                           std::string what)
    : t_(transport), group_(std::move(group)), me_(me), what_(std::move(what)) {}

std::span<float> MpiGroupCall::own_buffer(size_t floats) {
  // Not zeroed: a receive or a copy fills it whole.
  return {buffers_.emplace_back(t_.buffer_pool().take(floats)).data.get(), floats};
}

void MpiGroupCall::receive(std::span<float> into, size_t from, int tag) {
  MPI_Request request;
  t_.check(MPI_Irecv(into.data(), t_.byte_count(into.size() * sizeof(float)), MPI_BYTE,
                     group_[from], tag, t_.comm(), &request),
           "MPI_Irecv");
  receives_.push_back({request, group_[from], into.size()});
}

void MpiGroupCall::send(std::span<const float> from, size_t to, int tag) {
  MPI_Request request;
  t_.check(MPI_Isend(from.data(), t_.byte_count(from.size() * sizeof(float)), MPI_BYTE, group_[to],
                     tag, t_.comm(), &request),
           "MPI_Isend");
  sends_.push_back(request);
}

bool MpiGroupCall::test_one(MPI_Request& request, int& done, MPI_Status* status) {
  if (const int code = MPI_Test(&request, &done, status); code != MPI_SUCCESS) {
    failure_ = "MPI_Test failed: " + mpi_error_text(code);
    return false;
  }
  return true;
}

bool MpiGroupCall::test_requests() {
  if (!failure_.empty()) return false;
  for (Receive& r : receives_) {
    if (r.request == MPI_REQUEST_NULL) continue;
    int done = 0;
    MPI_Status status;
    if (!test_one(r.request, done, &status)) return false;
    if (!done) continue;
    // A part of another length would leave the rest of the buffer as it was: the members
    // disagree on the call, which only a sum of the wrong values would show otherwise.
    int bytes = 0;
    MPI_Get_count(&status, MPI_BYTE, &bytes);
    if (static_cast<size_t>(bytes) != r.floats * sizeof(float)) {
      failure_ = what_ + ": rank " + std::to_string(r.peer) + " sent " +
                 std::to_string(bytes / sizeof(float)) + " values where " +
                 std::to_string(r.floats) + " were expected (the members' calls differ)";
      return false;
    }
  }
  for (MPI_Request& s : sends_) {
    int done = 0;
    if (s != MPI_REQUEST_NULL && !test_one(s, done, MPI_STATUS_IGNORE)) return false;
  }
  return !requests_open();
}

bool MpiGroupCall::received() const {
  return std::all_of(receives_.begin(), receives_.end(),
                     [](const Receive& r) { return r.request == MPI_REQUEST_NULL; });
}

std::vector<int> MpiGroupCall::pending_peers(size_t begin, size_t end) const {
  std::vector<int> ranks;
  for (size_t k = begin; k < end; ++k)
    if (receive_pending(k)) ranks.push_back(receives_[k].peer);
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  return ranks;
}

MpiGroupCall::~MpiGroupCall() { abandon(); }

bool MpiGroupCall::requests_open() const {
  return !received() || std::any_of(sends_.begin(), sends_.end(),
                                    [](MPI_Request s) { return s != MPI_REQUEST_NULL; });
}

void MpiGroupCall::abandon() {
  FloatBufferPool& pool = t_.buffer_pool();
  if (!requests_open()) {
    for (auto& buffer : buffers_) pool.give(std::move(buffer));
    buffers_.clear();
    return;
  }
  for (Receive& r : receives_) drop(r.request);
  for (MPI_Request& s : sends_) drop(s);
  // A freed request that MPI had matched may still complete into its buffer (a cancel
  // cannot stop it): the buffers stay allocated, out of the pool. The rank is failing or
  // ending, and a leak cannot corrupt what is still running.
  for (auto& buffer : buffers_) {
    pool.forget(buffer.capacity);
    (void)buffer.data.release();
  }
  buffers_.clear();
}

namespace {

// The sum: a reduce-scatter (each member sums one range of the values, bounds[i] =
// count * i / members, in group order from zero), then a gather of the summed ranges, so
// each member sends about 2 (D - 1) / D of the values, where sending all of them to every
// other member would be (D - 1) times them. The bits are those of every transport's sum
// (group_arithmetic.h): each element is added once, in group order, on the member whose
// range holds it.
class SumCall : public MpiGroupCall {
 public:
  SumCall(MpiTransport& transport, const std::vector<float>& values, std::vector<int> group,
          size_t me, const std::vector<int>& second_tags)
      : MpiGroupCall(transport, std::move(group), me, "the gradient sum over replicas"),
        second_tags_(second_tags),
        bounds_(even_ranges(values.size(), group_.size())),
        parts_(group_.size()),
        ranges_(group_.size()) {
    // Only the own range is read after the start: the others' are copied to be sent.
    own_range_ = own_buffer(range_size(me_));
    std::copy(values.begin() + bounds_[me_], values.begin() + bounds_[me_ + 1], own_range_.begin());
    // Every receive is posted now, the second phase's too: only its sends wait.
    for (size_t i = 0; i < group_.size(); ++i) {
      if (i == me_) continue;
      parts_[i] = own_buffer(range_size(me_));
      receive(parts_[i], i, kScatterTag);
    }
    for (size_t i = 0; i < group_.size(); ++i) {
      if (i == me_) continue;
      ranges_[i] = own_buffer(range_size(i));
      receive(ranges_[i], i, second_tags_[i]);
    }
    for (size_t i = 0; i < group_.size(); ++i) {
      if (i == me_) continue;
      const std::span<float> range = own_buffer(range_size(i));
      std::copy(values.begin() + bounds_[i], values.begin() + bounds_[i + 1], range.begin());
      send(range, i, kScatterTag);
    }
  }

  bool advance() override {
    const bool done = test_requests();
    if (summed_ || !failure_.empty() || !first_phase_received()) return done && summed_;
    // The first phase is in: this member's range, summed, goes to every other member.
    // In place: element k of the own range is written after every part's element k is read.
    std::vector<const float*> parts;
    for (size_t i = 0; i < group_.size(); ++i)
      parts.push_back(i == me_ ? own_range_.data() : parts_[i].data());
    add_in_group_order(own_range_.data(), own_range_.size(), parts);
    for (size_t i = 0; i < group_.size(); ++i)
      if (i != me_) send(own_range_, i, second_tags_[i]);
    summed_ = true;
    return test_requests();
  }

  bool has_result() const override { return summed_ && received() && failure_.empty(); }

  // Until this member's first phase is in, the others' second phases wait on it too: the
  // ranks that hold everything up are the first phase's.
  std::vector<int> waits_for() const override {
    const size_t first = group_.size() - 1;
    return first_phase_received() ? pending_peers(first, 2 * first) : pending_peers(0, first);
  }

  void write_result(std::vector<float>& values) const override {
    for (size_t i = 0; i < group_.size(); ++i) {
      const std::span<const float> range = i == me_ ? own_range_ : ranges_[i];
      std::copy(range.begin(), range.end(), values.begin() + bounds_[i]);
    }
  }

 private:
  size_t range_size(size_t i) const { return bounds_[i + 1] - bounds_[i]; }
  // The first phase's receives are the first members - 1 of them.
  bool first_phase_received() const {
    for (size_t k = 0; k + 1 < group_.size(); ++k)
      if (receive_pending(k)) return false;
    return true;
  }

  std::vector<int> second_tags_;          // by position: the tag of the second phase
  std::vector<size_t> bounds_;            // the ranges: [bounds_[i], bounds_[i + 1])
  std::vector<std::span<float>> parts_;   // first phase: the others' parts of my range
  std::vector<std::span<float>> ranges_;  // second phase: the others' summed ranges
  std::span<float> own_range_;            // this member's values there, then their sum
  bool summed_ = false;
};

// The reduce-scatter: to each other member its range, copied; from each, its part of the
// own range; then the own range summed in group order, as the sum adds it.
class ReduceScatterCall : public MpiGroupCall {
 public:
  ReduceScatterCall(MpiTransport& transport, const std::vector<float>& values,
                    std::vector<int> group, const std::vector<size_t>& bounds, size_t me)
      : MpiGroupCall(transport, std::move(group), me, "the gradient reduce-scatter over replicas"),
        begin_(bounds[me]),
        end_(bounds[me + 1]),
        parts_(group_.size()) {
    for (size_t i = 0; i < group_.size(); ++i) {
      if (i == me_) continue;
      parts_[i] = own_buffer(end_ - begin_);
      receive(parts_[i], i, kScatterTag);
    }
    for (size_t i = 0; i < group_.size(); ++i) {
      if (i == me_) continue;
      const std::span<float> range = own_buffer(bounds[i + 1] - bounds[i]);
      std::copy(values.begin() + bounds[i], values.begin() + bounds[i + 1], range.begin());
      send(range, i, kScatterTag);
    }
  }

  bool advance() override { return test_requests(); }
  bool has_result() const override { return received() && failure_.empty(); }
  // The own part is read from `values` here, where the caller left it.
  void write_result(std::vector<float>& values) const override {
    std::vector<const float*> parts;
    for (size_t i = 0; i < group_.size(); ++i)
      parts.push_back(i == me_ ? values.data() + begin_ : parts_[i].data());
    add_in_group_order(values.data() + begin_, end_ - begin_, parts);
  }

 private:
  size_t begin_, end_;                   // this member's range
  std::vector<std::span<float>> parts_;  // the others' parts of the range, by position
};

// The gather: the own range to every other member, the others' received, then copied into
// their ranges.
class GatherCall : public MpiGroupCall {
 public:
  GatherCall(MpiTransport& transport, const std::vector<float>& values, std::vector<int> group,
             const std::vector<size_t>& bounds, size_t me)
      : MpiGroupCall(transport, std::move(group), me, "the weight gather over replicas"),
        bounds_(bounds),
        parts_(group_.size()) {
    for (size_t i = 0; i < group_.size(); ++i) {
      if (i == me_) continue;
      parts_[i] = own_buffer(bounds[i + 1] - bounds[i]);
      receive(parts_[i], i, kGroupTag);
    }
    const std::span<float> mine = own_buffer(bounds[me + 1] - bounds[me]);
    std::copy(values.begin() + bounds[me], values.begin() + bounds[me + 1], mine.begin());
    for (size_t i = 0; i < group_.size(); ++i)
      if (i != me_) send(mine, i, kGroupTag);
  }

  bool advance() override { return test_requests(); }
  bool has_result() const override { return received() && failure_.empty(); }
  void write_result(std::vector<float>& values) const override {
    for (size_t i = 0; i < group_.size(); ++i)
      if (i != me_) std::copy(parts_[i].begin(), parts_[i].end(), values.begin() + bounds_[i]);
  }

 private:
  std::vector<size_t> bounds_;
  std::vector<std::span<float>> parts_;  // the others' ranges, by position in the group
};

// What the caller holds: the call stays with the transport until its requests complete, so
// a handle dropped unfinished (an error elsewhere in the rank, while peers still run) leaves
// it going, and its sends still leave whole.
class PendingMpiGroupCall : public PendingGroupCall {
 public:
  PendingMpiGroupCall(MpiTransport& transport, std::shared_ptr<MpiGroupCall> call,
                      std::vector<float>& values)
      : t_(transport), call_(std::move(call)), values_(values) {}

  bool test() override {
    if (!call_) return true;
    t_.throw_if_aborted();
    t_.reap_sends();  // moves every call in flight on, this one too
    if (!call_->failure().empty()) t_.give_up(call_->failure());
    if (!call_->has_result()) return false;
    call_->write_result(values_);
    call_.reset();
    return true;
  }

  // The deadline counts from the wait, not from the start: a call started long before it
  // is waited for (one of several in flight, behind the others) has not waited yet.
  void wait() override {
    WaitDeadline deadline(t_.timeout());
    Backoff backoff;
    while (!test()) {
      if (deadline.passed()) {
        const std::vector<int> missing = call_->waits_for();
        t_.give_up(call_->what() + " waited " + std::to_string(t_.timeout().count()) +
                   " ms for rank(s) " +
                   (missing.empty() ? std::string("(sends pending)") : rank_list(missing)) +
                   " (did one of them stop?)");
      }
      backoff.pause();
    }
  }

 private:
  MpiTransport& t_;
  std::shared_ptr<MpiGroupCall> call_;  // null once the result is written
  std::vector<float>& values_;
};

}  // namespace

std::unique_ptr<PendingGroupCall> MpiTransport::start_call(std::shared_ptr<MpiGroupCall> call,
                                                           std::vector<float>& values) {
  group_calls_.push_back(call);
  return std::make_unique<PendingMpiGroupCall>(*this, std::move(call), values);
}

std::unique_ptr<PendingGroupCall> MpiTransport::start_group_gather(
    std::vector<float>& values, const std::vector<int>& group, const std::vector<size_t>& bounds) {
  check_ranges(values, group, bounds, "group gather");
  throw_if_aborted();
  return start_call(std::make_shared<GatherCall>(*this, values, group, bounds, position_in(group)),
                    values);
}

std::unique_ptr<PendingGroupCall> MpiTransport::start_group_reduce_scatter(
    std::vector<float>& values, const std::vector<int>& group, const std::vector<size_t>& bounds) {
  check_ranges(values, group, bounds, "group reduce-scatter");
  throw_if_aborted();
  return start_call(
      std::make_shared<ReduceScatterCall>(*this, values, group, bounds, position_in(group)),
      values);
}

std::unique_ptr<PendingGroupCall> MpiTransport::start_group_sum(std::vector<float>& values,
                                                                const std::vector<int>& group) {
  check_group(group);
  throw_if_aborted();
  // Tags cycle per pair of members: two sums between the same pair share one only when
  // kSumRangeTags sums apart, which the calls in flight never are.
  if (group_calls_.size() >= static_cast<size_t>(kSumRangeTags))
    give_up("more than " + std::to_string(kSumRangeTags) + " group calls in flight");
  std::vector<int> second_tags(group.size(), 0);
  for (size_t i = 0; i < group.size(); ++i)
    if (group[i] != rank_)
      second_tags[i] =
          kFirstSumRangeTag +
          static_cast<int>(sums_with_[static_cast<size_t>(group[i])]++ % kSumRangeTags);
  return start_call(
      std::make_shared<SumCall>(*this, values, group, position_in(group), second_tags), values);
}

void MpiTransport::advance_group_calls() {
  for (auto it = group_calls_.begin(); it != group_calls_.end();) {
    MpiGroupCall& call = **it;
    const bool done = call.advance();
    // A call that failed is given up by its handle, or left when dropped: nothing waits
    // for its requests any more. A finished one gives its buffers back once its handle has
    // let go of it, since the handle reads the result from them.
    const bool failed = !call.failure().empty();
    if (failed || (done && it->use_count() == 1)) {
      call.abandon();
      it = group_calls_.erase(it);
      continue;
    }
    ++it;
  }
}

bool MpiTransport::group_calls_open() const {
  return std::any_of(group_calls_.begin(), group_calls_.end(),
                     [](const auto& call) { return call->requests_open(); });
}

void MpiTransport::abandon_group_calls() {
  for (auto& call : group_calls_) call->abandon();
  group_calls_.clear();
}

}  // namespace conveyor::comm::detail

#endif
