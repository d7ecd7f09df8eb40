#pragma once
// Transport between the ranks of one process (one thread per rank). On the CPU a send copies
// the tensor into the link's queue, so the sender may reuse its memory at once. On CUDA the
// message carries the sender's tensor and an event recorded after it was produced; the
// receiver's stream waits for that event and copies device to device (or peer to peer), and
// the sender's block is tagged with the receiver's stream so that the caching allocator does
// not reuse it before the copy has run. The host never waits for a copy: recv() waits only
// until the message is in the link's queue, and try_recv() not even for that.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "comm/buffer_pool.h"
#include "comm/transport.h"

namespace conveyor::comm {

class InProcessHub : public std::enable_shared_from_this<InProcessHub> {
 public:
  // `timeout`: how long a receive or an all-reduce waits before it fails, from 1 ms to
  // kMaxTimeoutMs (else std::invalid_argument).
  static std::shared_ptr<InProcessHub> create(int size, std::chrono::milliseconds timeout);
  std::unique_ptr<Transport> endpoint(int rank);
  int size() const { return size_; }

  struct Message {
    std::vector<std::byte> host_bytes;  // CPU senders: a copy of the data
    Tensor device_tensor;               // CUDA senders: the tensor itself ...
    std::shared_ptr<Event> ready;       // ... and when it is ready
    size_t bytes = 0;
  };

  // Used by the endpoints.
  void push(int src, int dst, Message message);
  Message pop(int src, int dst, int waiting_rank);
  // The next message on the link, if it has arrived; never waits.
  std::optional<Message> try_pop(int src, int dst, int waiting_rank);
  void all_reduce(int rank, std::vector<double>& values);
  // Reduce-scatters and gathers: each member posts its values (or the range that is theirs)
  // to the other members of the group; a member's result is ready once the others' posts are
  // in (group sums meet on a board instead, below). Posts are numbered per (src, dst) in the
  // order src makes them. Members start their calls of a group in the same order, so the
  // k-th post from src to dst belongs to dst's k-th call with src: each call claims its
  // number on every other member's queue when it starts (claim_group_slot), and takes that
  // post and no other, whatever order the calls in flight are tested in.
  using GroupValues = std::shared_ptr<const std::vector<float>>;
  void post_group_values(int src, const std::vector<int>& group, GroupValues values);
  // The same to one member only (a reduce-scatter sends each member its own range).
  void post_group_values_to(int src, int dst, GroupValues values);
  // Bytes of group values `rank` has sent so far, counted once per receiving member: what
  // the MPI transport would have sent (a sum: a reduce-scatter and a gather of its ranges).
  size_t group_bytes_sent(int rank) const;
  // The number of the next post from `src` to `dst` that no call of `dst` has claimed yet,
  // claimed now.
  uint64_t claim_group_slot(int src, int dst);
  // A post awaited from `src`: the number its call claimed.
  struct GroupSlot {
    int src;
    uint64_t number;
  };
  // The post of `slot` to `dst`, if it came; never waits.
  GroupValues try_take_group_values(GroupSlot slot, int dst, int waiting_rank);
  // Waits, up to the deadline, for the post of one of `awaited` to `dst` (empty: returns).
  // False when the deadline passed.
  bool wait_group_values(int dst, const std::vector<GroupSlot>& awaited, int waiting_rank);
  // A call of `dst` dropped unfinished gives back the posts it claimed and did not take:
  // those that came are freed now, and those still to come when they come. No other call can
  // take them (claims only move forward), and the peers' own calls do not need them (each
  // takes what `dst` posted for it, which stays), so nothing any call waits for goes.
  // Never throws: it runs while the dropping rank unwinds.
  void release_group_slots(int dst, const std::vector<GroupSlot>& slots) noexcept;
  // Posts made and not yet taken, over every link, and the parts of group sums not yet
  // summed: what the hub holds for group calls.
  size_t group_posts_held() const;

  // Group sums (in_process_sum.cpp). The k-th sum each member starts over a group meets the
  // others' k-th on one board: every member puts a copy of its values there when it starts,
  // and once all are in, the sum is computed once, a range at a time, by whichever member
  // gets to a range first (its own range first), so that each addition is made once in the
  // process and members that test or wait at the same time share the work; each then copies
  // the whole sum. A member never needs another's help to finish: one that tests or waits
  // computes every range nobody has taken. Boards are met by group and number, not by
  // posts, so sums need no order across groups.
  std::unique_ptr<PendingGroupCall> start_group_sum(int rank, std::vector<float>& values,
                                                    const std::vector<int>& group, size_t me);
  struct SumBoard;
  // Puts a copy of `mine`, the values of the member at position `me`, on its call's board.
  std::shared_ptr<SumBoard> join_group_sum(int rank, const std::vector<int>& group, size_t me,
                                           const std::vector<float>& mine);
  // Computes the board's ranges nobody has taken (position `me`'s first), if every part is
  // in; never waits for another member. Whether the sum is complete.
  bool advance_group_sum(SumBoard& board, size_t me, int rank);
  // Waits, up to the deadline, until the board's parts are all in and a range is free to
  // take, or the sum is complete. False when the deadline passed.
  bool wait_group_sum(SumBoard& board, int rank);
  // The ranks a board waits for: the members whose values are not in, or, once all are, the
  // members computing a range.
  std::vector<int> group_sum_waits_for(const SumBoard& board) const;
  // Floats the hub keeps for later sums' copies and results, between calls.
  size_t group_sum_floats_kept() const { return sum_buffers_->kept_floats(); }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // Fails the transport for every rank, naming `rank` and `what`; throws TransportError.
  [[noreturn]] void fail(int rank, const std::string& what);
  void abort(const std::string& reason);

 private:
  InProcessHub(int size, std::chrono::milliseconds timeout);
  void throw_if_aborted(int rank) const;
  [[noreturn]] void fail_locked(int rank, const std::string& what);
  void wake_everyone();

  int size_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex mutex_;
  // One condition variable per receiving rank, so a message wakes only its receiver; the
  // all-reduce has its own.
  std::vector<std::condition_variable> arrived_for_;
  std::condition_variable reduced_;
  std::vector<std::deque<Message>> links_;  // src * size + dst
  // The group values from one member to another, by post number; each taken once.
  struct GroupLink {
    std::map<uint64_t, GroupValues> posted;  // not yet taken
    std::set<uint64_t> released;             // not yet posted, and dropped: not to be kept
    uint64_t next_post = 0, next_claim = 0;
    // Keeps the post of number `next_post` unless its call was dropped; the next number.
    void post(GroupValues values) {
      const uint64_t number = next_post++;
      if (released.erase(number) == 0) posted.emplace(number, std::move(values));
    }
  };
  GroupLink& group_link(int src, int dst) {
    return group_links_[static_cast<size_t>(src) * size_ + dst];
  }
  std::vector<GroupLink> group_links_;    // src * size + dst
  std::vector<size_t> group_bytes_sent_;  // by src
  // The group sums' boards by (group, number), until every member has joined and the sum is
  // complete; and, by group, how many sums the member at each position has started.
  std::map<std::pair<std::vector<int>, uint64_t>, std::shared_ptr<SumBoard>> sum_boards_;
  std::map<std::vector<int>, std::vector<uint64_t>> sums_started_;
  // The boards' copies and sums, kept between calls: a gradient sum of megabytes each step
  // would otherwise map fresh pages for every member's copy and for the sum. Shared with the
  // boards, which give their buffers back when they go.
  std::shared_ptr<detail::LockedFloatBufferPool> sum_buffers_ =
      std::make_shared<detail::LockedFloatBufferPool>();
  void notify_members(const std::vector<int>& group);
  size_t sum_parts_held_locked() const;  // values on boards not summed yet, with mutex_ held
  bool aborted_ = false;
  std::string abort_reason_;
  // All-reduce rendezvous: contributions of the current round, by rank.
  std::vector<std::vector<double>> contributions_;
  int arrived_ = 0;
  uint64_t round_ = 0;
  std::vector<double> result_;
};

}  // namespace conveyor::comm
