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
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/transport.h"

namespace conveyor::comm {

class InProcessHub : public std::enable_shared_from_this<InProcessHub> {
 public:
  // `timeout`: how long a receive or an all-reduce waits before it fails.
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
  // Group sums: each member posts its values to every other member of the group; a member's
  // sum is ready once the others' posts are in. Ordered per (src, dst) like the links.
  using GroupValues = std::shared_ptr<const std::vector<float>>;
  void post_group_values(int src, const std::vector<int>& group, GroupValues values);
  // The same to one member only (a reduce-scatter sends each member its own range).
  void post_group_values_to(int src, int dst, GroupValues values);
  // Bytes of group values `rank` has posted so far, counted once per receiving member: what
  // a transport between processes would have sent.
  size_t group_bytes_sent(int rank) const;
  // The next group values from `src` to `dst`, if they came; never waits.
  GroupValues try_take_group_values(int src, int dst, int waiting_rank);
  // Waits, up to the deadline, for a post to `dst` from one of `from` (empty: returns).
  // False when the deadline passed.
  bool wait_group_values(int dst, const std::vector<int>& from, int waiting_rank);
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
  std::vector<std::deque<Message>> links_;            // src * size + dst
  std::vector<std::deque<GroupValues>> group_links_;  // src * size + dst
  std::vector<size_t> group_bytes_sent_;              // by src
  bool aborted_ = false;
  std::string abort_reason_;
  // All-reduce rendezvous: contributions of the current round, by rank.
  std::vector<std::vector<double>> contributions_;
  int arrived_ = 0;
  uint64_t round_ = 0;
  std::vector<double> result_;
};

}  // namespace conveyor::comm
