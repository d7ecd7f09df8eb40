// The in-process group sum (InProcessHub::start_group_sum): the members of a call share one
// board, and each element of the sum is added once in the process, in group order from zero,
// the same bits as every transport's sum (group_arithmetic.h). Were each member to add every
// member's values over the whole vector, D replicas would make D x D additions per value:
// minutes a step at --dp 1024, where the step itself takes milliseconds.
#include <algorithm>
#include <string>
#include <utility>

#include "comm/group_arithmetic.h"
#include "comm/in_process.h"

namespace conveyor::comm {

struct InProcessHub::SumBoard {
  static constexpr int kOpen = -1;  // running_by: nobody has taken the range
  static constexpr int kDone = -2;  // running_by: the range is summed
  using Buffer = detail::FloatBufferPool::Buffer;

  explicit SumBoard(std::shared_ptr<detail::LockedFloatBufferPool> pool)
      : buffers(std::move(pool)) {}
  SumBoard(const SumBoard&) = delete;
  SumBoard& operator=(const SumBoard&) = delete;
  // The last member's copy of the sum is out (or the run is over): the buffers go back.
  ~SumBoard() {
    for (Buffer& part : parts) give_back(part);
    give_back(sum);
  }
  // Leaves `buffer` without data; none, none given.
  void give_back(Buffer& buffer) {
    if (buffer.data) buffers->give(std::exchange(buffer, Buffer{}));
  }

  std::shared_ptr<detail::LockedFloatBufferPool> buffers;
  std::vector<int> group;
  uint64_t number = 0;              // which sum over the group
  std::vector<Buffer> parts;        // by position; no data until put in, and once summed
  std::vector<size_t> part_values;  // by position, once put in
  size_t joined = 0;                // members whose part has come (and stays counted once summed)
  size_t values = 0;                // per part, from the first part in
  std::vector<size_t> bounds;       // the ranges: [bounds[i], bounds[i + 1])
  std::vector<int> running_by;      // per range: kOpen, the rank summing it, or kDone
  size_t ranges_done = 0;
  Buffer sum;            // written a range at a time, each by one member
  std::string mismatch;  // once all are in: the part whose count differs, if any

  bool complete() const { return ranges_done == running_by.size(); }
  bool all_in() const { return joined == group.size(); }
  // The open range to take next: the member's own, else the first one open; npos if none.
  size_t open_range(size_t me) const {
    if (running_by[me] == kOpen) return me;
    for (size_t r = 0; r < running_by.size(); ++r)
      if (running_by[r] == kOpen) return r;
    return std::string::npos;
  }
};

namespace {

class InProcessGroupSum : public PendingGroupCall {
 public:
  InProcessGroupSum(std::shared_ptr<InProcessHub> hub, int rank, std::vector<float>& values,
                    const std::vector<int>& group, size_t me)
      : hub_(std::move(hub)), rank_(rank), values_(values), me_(me) {
    board_ = hub_->join_group_sum(rank, group, me, values);
  }

  bool test() override {
    if (done_) return true;
    if (!hub_->advance_group_sum(*board_, me_, rank_)) return false;
    // Complete: nothing writes the sum any more, and the hub's lock ordered its writes
    // before the completion advance_group_sum saw.
    std::copy(board_->sum.data.get(), board_->sum.data.get() + values_.size(), values_.begin());
    done_ = true;
    board_.reset();  // the sum's memory goes with the last member's copy
    return true;
  }

  void wait() override {
    while (!test())
      if (!hub_->wait_group_sum(*board_, rank_))
        hub_->fail(rank_, "the gradient sum over replicas waited " +
                              std::to_string(hub_->timeout().count()) + " ms for rank(s) " +
                              rank_list(hub_->group_sum_waits_for(*board_)));
  }

 private:
  std::shared_ptr<InProcessHub> hub_;
  int rank_;
  std::vector<float>& values_;
  size_t me_;
  std::shared_ptr<InProcessHub::SumBoard> board_;
  bool done_ = false;
};

}  // namespace

std::unique_ptr<PendingGroupCall> InProcessHub::start_group_sum(int rank,
                                                                std::vector<float>& values,
                                                                const std::vector<int>& group,
                                                                size_t me) {
  return std::make_unique<InProcessGroupSum>(shared_from_this(), rank, values, group, me);
}

std::shared_ptr<InProcessHub::SumBoard> InProcessHub::join_group_sum(
    int rank, const std::vector<int>& group, size_t me, const std::vector<float>& mine) {
  // Copied before the hub's lock, which the other members' calls need meanwhile.
  SumBoard::Buffer copy = sum_buffers_->take(mine.size());
  std::copy(mine.begin(), mine.end(), copy.data.get());
  std::shared_ptr<SumBoard> board;
  bool all_in = false;
  {
    std::lock_guard lock(mutex_);
    throw_if_aborted(rank);
    std::vector<uint64_t>& started = sums_started_[group];
    started.resize(group.size(), 0);
    const uint64_t number = started[me]++;
    std::shared_ptr<SumBoard>& found = sum_boards_[{group, number}];
    if (!found) {
      found = std::make_shared<SumBoard>(sum_buffers_);
      found->group = group;
      found->number = number;
      found->parts.resize(group.size());
      found->part_values.resize(group.size());
      found->values = mine.size();
      found->bounds = even_ranges(found->values, group.size());
      // Empty ranges (fewer values than members) stay open like the others: taking one
      // adds nothing, and no range is done before every part is in.
      found->running_by.assign(group.size(), SumBoard::kOpen);
      found->sum = sum_buffers_->take(found->values);
    }
    board = found;
    // What the MPI transport sends: every other member's range of these values, then the
    // own range, summed, to every other member.
    const size_t own = board->bounds[me + 1] - board->bounds[me];
    group_bytes_sent_[rank] += (board->values - own + (group.size() - 1) * own) * sizeof(float);
    board->parts[me] = std::move(copy);
    board->part_values[me] = mine.size();
    ++board->joined;
    all_in = board->all_in();
    if (all_in)
      for (size_t i = 0; i < group.size() && board->mismatch.empty(); ++i)
        if (board->part_values[i] != board->values)
          board->mismatch = "group sum of " + std::to_string(board->values) + " values, but rank " +
                            std::to_string(group[i]) + " gave " +
                            std::to_string(board->part_values[i]);
  }
  if (all_in) notify_members(group);
  return board;
}

bool InProcessHub::advance_group_sum(SumBoard& board, size_t me, int rank) {
  std::unique_lock lock(mutex_);
  throw_if_aborted(rank);
  if (!board.all_in()) return false;
  if (!board.mismatch.empty()) fail_locked(rank, board.mismatch);
  for (size_t r = board.open_range(me); r != std::string::npos; r = board.open_range(me)) {
    board.running_by[r] = rank;
    std::vector<const float*> parts;
    for (const SumBoard::Buffer& part : board.parts)
      parts.push_back(part.data.get() + board.bounds[r]);
    lock.unlock();
    add_in_group_order(board.sum.data.get() + board.bounds[r],
                       board.bounds[r + 1] - board.bounds[r], parts);
    lock.lock();
    board.running_by[r] = SumBoard::kDone;
    if (++board.ranges_done < board.running_by.size()) continue;
    // Summed: the parts are not needed any more, and nobody looks the board up again (every
    // member has joined, since every part is in).
    for (SumBoard::Buffer& part : board.parts) board.give_back(part);
    sum_boards_.erase({board.group, board.number});
    lock.unlock();
    notify_members(board.group);
    return true;
  }
  return board.complete();
}

bool InProcessHub::wait_group_sum(SumBoard& board, int rank) {
  std::unique_lock lock(mutex_);
  const bool ready = arrived_for_[rank].wait_for(lock, timeout_, [&] {
    return aborted_ || board.complete() ||
           (board.all_in() && board.open_range(0) != std::string::npos);
  });
  throw_if_aborted(rank);
  return ready;
}

std::vector<int> InProcessHub::group_sum_waits_for(const SumBoard& board) const {
  std::lock_guard lock(mutex_);
  std::vector<int> ranks;
  for (size_t i = 0; i < board.group.size(); ++i)
    if (board.all_in() ? board.running_by[i] >= 0 : board.parts[i].data == nullptr)
      ranks.push_back(board.all_in() ? board.running_by[i] : board.group[i]);
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  return ranks;
}

size_t InProcessHub::sum_parts_held_locked() const {
  size_t held = 0;
  for (const auto& [key, board] : sum_boards_)
    for (const SumBoard::Buffer& part : board->parts) held += part.data != nullptr;
  return held;
}

void InProcessHub::notify_members(const std::vector<int>& group) {
  for (int member : group) arrived_for_[member].notify_all();
}

}  // namespace conveyor::comm
