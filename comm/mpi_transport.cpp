#include "comm/mpi_transport.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <list>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/group_arithmetic.h"
#include "comm/poll.h"

#ifdef CONVEYOR_WITH_MPI
#include <mpi.h>
#endif

namespace conveyor::comm {

bool mpi_built() {
#ifdef CONVEYOR_WITH_MPI
  return true;
#else
  return false;
#endif
}

#ifndef CONVEYOR_WITH_MPI

void mpi_roll_call(const std::string&, std::chrono::milliseconds) {}

std::unique_ptr<Transport> make_mpi_transport(std::chrono::milliseconds) {
  throw std::invalid_argument(
      "this build has no MPI (install libopenmpi-dev and reconfigure); use the in-process "
      "transport");
}

#else

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kMessageTag = 1;     // every pipeline message: FIFO per link
constexpr int kAbortTag = 2;       // the reason a rank aborted
constexpr int kCountTag = 3;       // all-reduce value counts: who has come to the all-reduce
constexpr int kGroupTag = 4;       // group sums and gathers: FIFO per pair of members
constexpr int kScatterTag = 5;     // reduce-scatters: sized by the ranges, so apart from the others
constexpr int kSumTag = 6;         // all-reduce values, after their counts
constexpr int kReportTag = 16;     // after a failure: where a rank stood, to the collector
constexpr int kReportAckTag = 17;  // the collector is done: a reporter may end its process
constexpr int kRollCallTag = 32;   // mpi_roll_call, on MPI_COMM_WORLD

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, static_cast<size_t>(length));
}

// Waits that poll: spin briefly (a message is often a few microseconds away), then yield the
// core, since oversubscribed ranks share cores with the peers they wait for.
class Backoff {
 public:
  void pause() {
    if (++polls_ > 64)
      std::this_thread::sleep_for(std::chrono::microseconds(polls_ > 4096 ? 200 : 20));
  }

 private:
  int polls_ = 0;
};

// A request left unfinished past a deadline: a receive is cancelled, and either is freed
// (a send then goes on by itself).
void drop(MPI_Request& request) {
  if (request == MPI_REQUEST_NULL) return;
  MPI_Cancel(&request);
  MPI_Request_free(&request);
}

// Rank 0's answer to a roll call: every process came, or some did not.
constexpr unsigned char kAllHere = 0, kSomeMissing = 1;
const unsigned char kAnswers[2] = {kAllHere, kSomeMissing};  // static: sends may outlive a call

}  // namespace

void mpi_roll_call(const std::string& what, std::chrono::milliseconds timeout) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size == 1) return;
  if (rank == 0) {
    // Rank 0 decides: it waits `timeout` for the others, then answers every one that came.
    // A request MPI_Test finds done becomes MPI_REQUEST_NULL, so what is left names who has
    // not come.
    std::vector<MPI_Request> here(static_cast<size_t>(size), MPI_REQUEST_NULL);
    for (int r = 1; r < size; ++r)
      MPI_Irecv(nullptr, 0, MPI_BYTE, r, kRollCallTag, MPI_COMM_WORLD, &here[r]);
    const bool all = poll_until(PollClock::now() + timeout, [&] {
      bool every = true;
      for (int r = 1; r < size; ++r) {
        int done = 0;
        if (here[r] != MPI_REQUEST_NULL) MPI_Test(&here[r], &done, MPI_STATUS_IGNORE);
        every = every && here[r] == MPI_REQUEST_NULL;
      }
      return every;
    });
    std::vector<int> missing;
    for (int r = 1; r < size; ++r) {
      if (here[r] != MPI_REQUEST_NULL) {
        missing.push_back(r);
        drop(here[r]);
        continue;
      }
      MPI_Request sent = MPI_REQUEST_NULL;
      MPI_Isend(&kAnswers[all ? kAllHere : kSomeMissing], 1, MPI_BYTE, r, kRollCallTag,
                MPI_COMM_WORLD, &sent);
      MPI_Request_free(&sent);
    }
    if (!all)
      throw TransportError("rank 0: rank(s) " + rank_list(missing) + " did not reach " + what +
                           " within " + std::to_string(timeout.count()) +
                           " ms (stopped, hung, or slower than --timeout allows)");
    return;
  }
  // The others wait twice as long, so that rank 0, which started its wait at most `timeout`
  // after them unless it is the one late, always answers first and names who was missing.
  MPI_Request sent = MPI_REQUEST_NULL, answer = MPI_REQUEST_NULL;
  MPI_Isend(nullptr, 0, MPI_BYTE, 0, kRollCallTag, MPI_COMM_WORLD, &sent);
  MPI_Request_free(&sent);
  auto verdict = std::make_unique<unsigned char>(kAllHere);
  MPI_Irecv(verdict.get(), 1, MPI_BYTE, 0, kRollCallTag, MPI_COMM_WORLD, &answer);
  const bool answered = poll_until(PollClock::now() + 2 * timeout, [&] {
    int done = 0;
    MPI_Test(&answer, &done, MPI_STATUS_IGNORE);
    return done != 0;
  });
  if (!answered) {
    drop(answer);
    (void)verdict.release();  // left to MPI with the request, should the cancel not take
    throw TransportError("rank " + std::to_string(rank) + ": no word from rank 0 at " + what +
                         " within " + std::to_string(2 * timeout.count()) +
                         " ms (rank 0 is stopped, hung, or slower than --timeout allows)");
  }
  if (*verdict != kAllHere)
    throw TransportError("rank " + std::to_string(rank) + ": another process did not reach " +
                         what + " within " + std::to_string(timeout.count()) +
                         " ms (rank 0's error names it)");
}

namespace {

class MpiTransport : public Transport {
 public:
  explicit MpiTransport(std::chrono::milliseconds timeout) : timeout_(timeout) {
    int initialised = 0;
    MPI_Initialized(&initialised);
    if (!initialised)
      throw TransportError(
          "the MPI transport needs MPI to be initialised first: the program must call "
          "MPI_Init_thread (conveyor train does when started by mpirun)");
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    if (level < MPI_THREAD_SERIALIZED)
      throw TransportError(
          "the MPI transport needs MPI_THREAD_SERIALIZED or more, MPI gave level " +
          std::to_string(level) + "; initialise MPI with MPI_Init_thread");
    // MPI_Comm_dup waits for every process: only once all are known to be there.
    mpi_roll_call("the MPI transport's set-up", timeout_);
    if (const int code = MPI_Comm_dup(MPI_COMM_WORLD, &comm_); code != MPI_SUCCESS)
      throw TransportError("MPI_Comm_dup failed: " + mpi_error_text(code));
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }

  ~MpiTransport() override {
    // Let sends already posted (an abort notice above all) leave, for a bounded time: a dead
    // peer must not hold this process. What has not left by then is dropped.
    const auto deadline = Clock::now() + std::min<std::chrono::milliseconds>(
                                             timeout_, std::chrono::milliseconds(2000));
    Backoff backoff;
    while ((!pending_.empty() || !dropped_.empty()) && Clock::now() < deadline) {
      reap_sends();
      backoff.pause();
    }
    for (Pending& p : pending_) {
      MPI_Cancel(&p.request);
      MPI_Request_free(&p.request);
    }
    pending_.clear();
    // A freed request that MPI had matched may still complete into its buffer (a cancel
    // cannot stop it), so the dropped calls' buffers are left allocated, not freed: the
    // process is ending, and a leak cannot corrupt what is still running.
    for (Dropped& d : dropped_) {
      for (MPI_Request& r : d.requests)
        if (r != MPI_REQUEST_NULL) {
          MPI_Cancel(&r);
          MPI_Request_free(&r);
        }
      for (auto& buffer : d.buffers) (void)buffer.release();
    }
    dropped_.clear();
    MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void send(const Tensor& tensor, int peer, const Stream&) override {
    check_peer(peer, "send to");
    check_cpu(tensor);
    throw_if_aborted();
    const int count = byte_count(tensor.nbytes());
    Pending& p = pending_.emplace_back();
    p.bytes.resize(tensor.nbytes());
    std::memcpy(p.bytes.data(), tensor.raw(), p.bytes.size());
    check(MPI_Isend(p.bytes.data(), count, MPI_BYTE, peer, kMessageTag, comm_, &p.request),
          "MPI_Isend");
    reap_sends();
  }

  void recv(const Tensor& tensor, int peer, const Stream&) override {
    check_peer(peer, "receive from");
    check_cpu(tensor);
    const auto deadline = Clock::now() + timeout_;
    Backoff backoff;
    while (!try_receive(tensor, peer, deadline)) {
      if (Clock::now() >= deadline)
        give_up("nothing arrived from rank " + std::to_string(peer) + " within " +
                std::to_string(timeout_.count()) + " ms (did rank " + std::to_string(peer) +
                " stop?)");
      backoff.pause();
    }
  }

  bool try_recv(const Tensor& tensor, int peer, const Stream&) override {
    check_peer(peer, "receive from");
    check_cpu(tensor);
    return try_receive(tensor, peer, Clock::now() + timeout_);
  }

  void all_reduce_sum(std::vector<double>& values) override {
    throw_if_aborted();
    const int64_t count = static_cast<int64_t>(values.size());
    exchange_counts(count);
    // Point to point rather than one collective: a wait then knows whose values have not
    // come (a rank stopped inside a collective looks like every other rank waiting in it),
    // and a receive can be cancelled where a collective cannot.
    const size_t n = values.size(), bytes = n * sizeof(double);
    std::vector<double> all(n * size_);
    std::copy(values.begin(), values.end(), all.begin() + static_cast<std::ptrdiff_t>(rank_ * n));
    std::vector<MPI_Request> arrived(size_, MPI_REQUEST_NULL);
    for (int r = 0; r < size_; ++r)
      if (r != rank_)
        check(MPI_Irecv(all.data() + r * n, byte_count(bytes), MPI_BYTE, r, kSumTag, comm_,
                        &arrived[r]),
              "MPI_Irecv");
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      Pending& p = pending_.emplace_back();
      p.bytes.resize(bytes);
      std::memcpy(p.bytes.data(), values.data(), bytes);
      check(MPI_Isend(p.bytes.data(), byte_count(bytes), MPI_BYTE, r, kSumTag, comm_, &p.request),
            "MPI_Isend");
    }
    wait_for_arrivals(arrived, [&](const std::string& missing) {
      return "the all-reduce waited " + std::to_string(timeout_.count()) + " ms for rank(s) " +
             missing + " (their values did not come: did rank(s) " + missing + " stop?)";
    });
    // Rank order from zero, as the in-process transport adds them.
    for (size_t i = 0; i < n; ++i) {
      double sum = 0.0;
      for (int r = 0; r < size_; ++r) sum += all[static_cast<size_t>(r) * n + i];
      values[i] = sum;
    }
  }

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
      const auto deadline = Clock::now() + t_.timeout_;
      Backoff backoff;
      while (!test()) {
        if (Clock::now() >= deadline) {
          std::vector<int> missing;
          for (size_t i = 0; i < receive_from_.size(); ++i)
            if (requests_[i] != MPI_REQUEST_NULL) missing.push_back(receive_from_[i]);
          t_.give_up(what_ + " waited " + std::to_string(t_.timeout_.count()) + " ms for rank(s) " +
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
                         tag_, t_.comm_, &request),
               "MPI_Irecv");
      requests_.push_back(request);
      receive_from_.push_back(peer);
    }
    void send(const std::vector<float>& from, int peer) {
      MPI_Request request;
      t_.check(MPI_Isend(from.data(), t_.byte_count(from.size() * sizeof(float)), MPI_BYTE, peer,
                         tag_, t_.comm_, &request),
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
        if (group_[i] == t_.rank_) continue;
        parts_[i] = &own_buffer(values.size());
        receive(*parts_[i], group_[i]);
      }
      for (int peer : group_)
        if (peer != t_.rank_) send(mine_, peer);
    }

    bool test() override {
      if (done_) return true;
      if (!exchanged()) return false;
      std::vector<const float*> parts;
      for (size_t i = 0; i < group_.size(); ++i)
        parts.push_back(group_[i] == t_.rank_ ? mine_.data() : parts_[i]->data());
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

  std::unique_ptr<PendingGroupCall> start_group_gather(std::vector<float>& values,
                                                       const std::vector<int>& group,
                                                       const std::vector<size_t>& bounds) override {
    check_ranges(values, group, bounds, "group gather");
    throw_if_aborted();
    return std::make_unique<GroupGather>(*this, values, group, bounds, position_in(group));
  }

  std::unique_ptr<PendingGroupCall> start_group_reduce_scatter(
      std::vector<float>& values, const std::vector<int>& group,
      const std::vector<size_t>& bounds) override {
    check_ranges(values, group, bounds, "group reduce-scatter");
    throw_if_aborted();
    return std::make_unique<GroupReduceScatter>(*this, values, group, bounds, position_in(group));
  }

  std::unique_ptr<PendingGroupCall> start_group_sum(std::vector<float>& values,
                                                    const std::vector<int>& group) override {
    check_group(group);
    throw_if_aborted();
    return std::make_unique<GroupSum>(*this, values, group);
  }

  std::map<int, std::vector<std::byte> > collect_failure_reports(
      const std::vector<std::byte>& report, int collector,
      std::chrono::milliseconds grace) override {
    std::map<int, std::vector<std::byte> > reports;
    if (collector < 0 || collector >= size_) return reports;
    if (rank_ != collector) {
      post(report, collector, kReportTag);
      // Wait for the collector to be done before this process may end: a launcher such as
      // mpirun ends the whole job when one process ends with an error, and would end the
      // collector before it has reported. Bounded: the collector may be dead.
      const auto deadline = Clock::now() + grace + std::chrono::milliseconds(1000);
      Backoff backoff;
      while (Clock::now() < deadline) {
        int flag = 0;
        if (MPI_Iprobe(collector, kReportAckTag, comm_, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS)
          break;
        if (flag) {
          MPI_Recv(nullptr, 0, MPI_BYTE, collector, kReportAckTag, comm_, MPI_STATUS_IGNORE);
          break;
        }
        backoff.pause();
      }
      return reports;
    }
    const auto deadline = Clock::now() + grace;
    Backoff backoff;
    while (static_cast<int>(reports.size()) < size_ - 1 && Clock::now() < deadline) {
      int flag = 0;
      MPI_Status status;
      if (MPI_Iprobe(MPI_ANY_SOURCE, kReportTag, comm_, &flag, &status) != MPI_SUCCESS) break;
      if (!flag) {
        backoff.pause();
        continue;
      }
      int length = 0;
      MPI_Get_count(&status, MPI_BYTE, &length);
      std::vector<std::byte> bytes(static_cast<size_t>(length));
      MPI_Recv(bytes.data(), length, MPI_BYTE, status.MPI_SOURCE, kReportTag, comm_,
               MPI_STATUS_IGNORE);
      reports[status.MPI_SOURCE] = std::move(bytes);
    }
    for (const auto& report : reports) post({}, report.first, kReportAckTag);
    return reports;
  }

  void poll_abort() override { throw_if_aborted(); }

  void abort(const std::string& reason) override {
    if (aborted_) return;
    aborted_ = true;
    abort_reason_ = reason;
    // Best effort: a notice to every other rank, never waited for here.
    std::vector<std::byte> bytes(reason.size());
    std::memcpy(bytes.data(), reason.data(), reason.size());
    for (int r = 0; r < size_; ++r)
      if (r != rank_) post(bytes, r, kAbortTag);
  }

 private:
  struct Pending {
    std::vector<std::byte> bytes;  // owned by the send until it completes
    MPI_Request request = MPI_REQUEST_NULL;
  };
  // The requests of a group call dropped unfinished, with the buffers they use.
  struct Dropped {
    std::vector<MPI_Request> requests;
    std::vector<std::unique_ptr<std::vector<float> > > buffers;
  };

  void keep_until_done(std::vector<MPI_Request> requests,
                       std::vector<std::unique_ptr<std::vector<float> > > buffers) {
    dropped_.push_back({std::move(requests), std::move(buffers)});
  }

  // A best-effort send of `bytes` that nobody waits for: left to the destructor's bounded
  // wait, dropped if MPI refuses it.
  void post(const std::vector<std::byte>& bytes, int peer, int tag) {
    Pending& p = pending_.emplace_back();
    p.bytes = bytes;
    if (MPI_Isend(p.bytes.data(), static_cast<int>(p.bytes.size()), MPI_BYTE, peer, tag, comm_,
                  &p.request) != MPI_SUCCESS)
      pending_.pop_back();
  }

  void check(int code, const char* call) {
    if (code != MPI_SUCCESS) give_up(std::string(call) + " failed: " + mpi_error_text(code));
  }

  // This rank gives up: the others are told, and this call fails.
  [[noreturn]] void give_up(const std::string& what) {
    const std::string reason = "rank " + std::to_string(rank_) + ": " + what;
    abort(reason);
    throw TransportError(reason);
  }

  void check_cpu(const Tensor& tensor) const {
    if (!tensor.device().is_cpu())
      throw TransportError("rank " + std::to_string(rank_) +
                           ": the MPI transport moves CPU tensors, got " + tensor.describe() +
                           "; GPU ranks need NCCL");
  }

  int byte_count(size_t bytes) {
    if (bytes > static_cast<size_t>(INT32_MAX))
      give_up("a message of " + std::to_string(bytes) + " bytes is more than one MPI call sends (" +
              std::to_string(INT32_MAX) + ")");
    return static_cast<int>(bytes);
  }

  // Reads an abort notice from any rank if one came, then throws if this transport is aborted.
  void throw_if_aborted() {
    if (!aborted_) {
      int flag = 0;
      MPI_Status status;
      if (MPI_Iprobe(MPI_ANY_SOURCE, kAbortTag, comm_, &flag, &status) == MPI_SUCCESS && flag) {
        int length = 0;
        MPI_Get_count(&status, MPI_BYTE, &length);
        std::string reason(static_cast<size_t>(length), '\0');
        MPI_Recv(reason.data(), length, MPI_BYTE, status.MPI_SOURCE, kAbortTag, comm_,
                 MPI_STATUS_IGNORE);
        aborted_ = true;
        abort_reason_ = reason;
      }
    }
    if (aborted_) throw TransportAborted(rank_, abort_reason_);
  }

  void reap_sends() {
    for (auto it = pending_.begin(); it != pending_.end();) {
      int done = 0;
      MPI_Test(&it->request, &done, MPI_STATUS_IGNORE);
      it = done ? pending_.erase(it) : std::next(it);
    }
    for (auto it = dropped_.begin(); it != dropped_.end();) {
      int done = 0;
      MPI_Testall(static_cast<int>(it->requests.size()), it->requests.data(), &done,
                  MPI_STATUSES_IGNORE);
      it = done ? dropped_.erase(it) : std::next(it);
    }
  }

  // Receives the next message from `peer` into `tensor` if it has arrived; false if not.
  bool try_receive(const Tensor& tensor, int peer, Clock::time_point deadline) {
    throw_if_aborted();
    reap_sends();
    int found = 0;
    MPI_Message message;
    MPI_Status status;
    check(MPI_Improbe(peer, kMessageTag, comm_, &found, &message, &status), "MPI_Improbe");
    if (!found) return false;
    int bytes = 0;
    MPI_Get_count(&status, MPI_BYTE, &bytes);
    if (static_cast<size_t>(bytes) != tensor.nbytes()) {
      // Take it off the link anyway, so the error is the only thing left to report.
      std::vector<std::byte> discard(static_cast<size_t>(bytes));
      MPI_Mrecv(discard.data(), bytes, MPI_BYTE, &message, MPI_STATUS_IGNORE);
      give_up("message from rank " + std::to_string(peer) + " has " + std::to_string(bytes) +
              " bytes, the receiving tensor " + tensor.describe() + " has " +
              std::to_string(tensor.nbytes()));
    }
    MPI_Request request;
    check(MPI_Imrecv(tensor.raw(), bytes, MPI_BYTE, &message, &request), "MPI_Imrecv");
    // The message is matched: only its payload is still on the way.
    Backoff backoff;
    for (;;) {
      int done = 0;
      check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test");
      if (done) return true;
      if (Clock::now() >= deadline)
        give_up("a message from rank " + std::to_string(peer) +
                " started but did not finish within " + std::to_string(timeout_.count()) + " ms");
      backoff.pause();
    }
  }

  // Every rank's value count, point to point before the gather: a rank with another count
  // would make the gather undefined, and a rank that never comes is named, which a pending
  // collective cannot do.
  void exchange_counts(int64_t count) {
    std::vector<int64_t> counts(size_, count);
    std::vector<MPI_Request> arrived(size_, MPI_REQUEST_NULL);
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      check(MPI_Irecv(&counts[r], 1, MPI_INT64_T, r, kCountTag, comm_, &arrived[r]), "MPI_Irecv");
      Pending& p = pending_.emplace_back();
      p.bytes.resize(sizeof count);
      std::memcpy(p.bytes.data(), &count, sizeof count);
      check(MPI_Isend(p.bytes.data(), 1, MPI_INT64_T, r, kCountTag, comm_, &p.request),
            "MPI_Isend");
    }
    wait_for_arrivals(arrived, [&](const std::string& missing) {
      return "the all-reduce waited " + std::to_string(timeout_.count()) + " ms for rank(s) " +
             missing + " (did rank " + missing + " stop?)";
    });
    for (int r = 0; r < size_; ++r)
      if (counts[r] != count)
        give_up("all-reduce of " + std::to_string(count) + " values, but rank " +
                std::to_string(r) + " gave " + std::to_string(counts[r]));
  }

  // Polls the receives `arrived` (one per rank, null where none was posted) up to the
  // deadline; past it, or on an abort, cancels those still pending and gives up with
  // `message(missing)`, `missing` listing the ranks whose receive has not completed.
  template <class Message>
  void wait_for_arrivals(std::vector<MPI_Request>& arrived, Message message) {
    auto drop_pending = [&] {
      for (MPI_Request& r : arrived)
        if (r != MPI_REQUEST_NULL) {
          MPI_Cancel(&r);
          MPI_Request_free(&r);
        }
    };
    const auto deadline = Clock::now() + timeout_;
    Backoff backoff;
    for (;;) {
      std::vector<int> missing;
      for (int r = 0; r < size_; ++r) {
        if (arrived[r] == MPI_REQUEST_NULL) continue;
        int done = 0;
        MPI_Test(&arrived[r], &done, MPI_STATUS_IGNORE);  // done: the request is nulled
        if (!done) missing.push_back(r);
      }
      if (missing.empty()) return;
      try {
        throw_if_aborted();
      } catch (...) {
        drop_pending();
        throw;
      }
      if (Clock::now() >= deadline) {
        drop_pending();
        give_up(message(rank_list(missing)));
      }
      reap_sends();
      backoff.pause();
    }
  }

  std::chrono::milliseconds timeout_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::list<Pending> pending_;  // sends not yet complete; std::list keeps buffers in place
  std::list<Dropped> dropped_;  // group calls dropped unfinished, until their requests complete
  bool aborted_ = false;
  std::string abort_reason_;
};

}  // namespace

std::unique_ptr<Transport> make_mpi_transport(std::chrono::milliseconds timeout) {
  return std::make_unique<MpiTransport>(timeout);
}

#endif

}  // namespace conveyor::comm
