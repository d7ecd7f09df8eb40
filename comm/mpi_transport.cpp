#include "comm/mpi_transport.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef CONVEYOR_WITH_MPI
#include "comm/mpi_endpoint.h"
#include "comm/poll.h"
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

std::unique_ptr<Transport> make_mpi_transport(std::chrono::milliseconds) {
  throw std::invalid_argument(
      "this build has no MPI (install libopenmpi-dev and reconfigure); use the in-process "
      "transport");
}

#else

namespace detail {

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, static_cast<size_t>(length));
}

void drop(MPI_Request& request) {
  if (request == MPI_REQUEST_NULL) return;
  MPI_Cancel(&request);
  MPI_Request_free(&request);
}

MpiTransport::MpiTransport(std::chrono::milliseconds timeout) : timeout_(timeout) {
  int initialised = 0;
  MPI_Initialized(&initialised);
  if (!initialised)
    throw TransportError(
        "the MPI transport needs MPI to be initialised first: the program must call "
        "MPI_Init_thread, asking for MPI_THREAD_SERIALIZED, before the trainer is built");
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  if (level < MPI_THREAD_SERIALIZED)
    throw TransportError("the MPI transport needs MPI_THREAD_SERIALIZED or more, MPI gave level " +
                         std::to_string(level) + "; initialise MPI with MPI_Init_thread");
  // MPI_Comm_dup waits for every process: only once all are known to be there.
  mpi_roll_call("the MPI transport's set-up", timeout_);
  if (const int code = MPI_Comm_dup(MPI_COMM_WORLD, &comm_); code != MPI_SUCCESS)
    throw TransportError("MPI_Comm_dup failed: " + mpi_error_text(code));
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  sums_with_.assign(static_cast<size_t>(size_), 0);
}

MpiTransport::~MpiTransport() {
  // Let sends already posted (an abort notice above all) leave, for a bounded time: a dead
  // peer must not hold this process. What has not left by then is dropped.
  const auto deadline = MpiClock::now() + std::min<std::chrono::milliseconds>(
                                              timeout_, std::chrono::milliseconds(2000));
  Backoff backoff;
  reap_sends();
  while ((!pending_.empty() || group_calls_open()) && MpiClock::now() < deadline) {
    backoff.pause();
    reap_sends();
  }
  // A run that failed leaves messages behind: sends whose receives were cancelled, or that
  // were dropped here. Its communicator is then left allocated, not freed: MPI may give a
  // freed communicator's context to the next one this process duplicates (a later
  // transport), where a leftover message would match a receive of that transport's.
  const bool clean = !aborted_ && pending_.empty() && !group_calls_open();
  for (Pending& p : pending_) drop(p.request);
  pending_.clear();
  abandon_group_calls();
  if (clean) MPI_Comm_free(&comm_);
}

void MpiTransport::send(const Tensor& tensor, int peer, const Stream&) {
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

void MpiTransport::recv(const Tensor& tensor, int peer, const Stream&) {
  check_peer(peer, "receive from");
  check_cpu(tensor);
  WaitDeadline deadline(timeout_);
  Backoff backoff;
  while (!try_receive(tensor, peer, deadline)) {
    if (deadline.passed())
      give_up("nothing arrived from rank " + std::to_string(peer) + " within " +
              std::to_string(timeout_.count()) + " ms (did rank " + std::to_string(peer) +
              " stop?)");
    backoff.pause();
  }
}

bool MpiTransport::try_recv(const Tensor& tensor, int peer, const Stream&) {
  check_peer(peer, "receive from");
  check_cpu(tensor);
  WaitDeadline deadline(timeout_);
  return try_receive(tensor, peer, deadline);
}

template <class Message>
void MpiTransport::wait_for_arrivals(std::vector<MPI_Request>& arrived, Message message) {
  auto drop_pending = [&] {
    for (MPI_Request& r : arrived) drop(r);
  };
  WaitDeadline deadline(timeout_);
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
    if (deadline.passed()) {
      drop_pending();
      give_up(message(rank_list(missing)));
    }
    reap_sends();
    backoff.pause();
  }
}

void MpiTransport::all_reduce_sum(std::vector<double>& values) {
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

void MpiTransport::exchange_counts(int64_t count) {
  std::vector<int64_t> counts(size_, count);
  std::vector<MPI_Request> arrived(size_, MPI_REQUEST_NULL);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    check(MPI_Irecv(&counts[r], 1, MPI_INT64_T, r, kCountTag, comm_, &arrived[r]), "MPI_Irecv");
    Pending& p = pending_.emplace_back();
    p.bytes.resize(sizeof count);
    std::memcpy(p.bytes.data(), &count, sizeof count);
    check(MPI_Isend(p.bytes.data(), 1, MPI_INT64_T, r, kCountTag, comm_, &p.request), "MPI_Isend");
  }
  wait_for_arrivals(arrived, [&](const std::string& missing) {
    return "the all-reduce waited " + std::to_string(timeout_.count()) + " ms for rank(s) " +
           missing + " (did rank " + missing + " stop?)";
  });
  for (int r = 0; r < size_; ++r)
    if (counts[r] != count)
      give_up("all-reduce of " + std::to_string(count) + " values, but rank " + std::to_string(r) +
              " gave " + std::to_string(counts[r]));
}

std::map<int, std::vector<std::byte> > MpiTransport::collect_failure_reports(
    const std::vector<std::byte>& report, int collector, std::chrono::milliseconds grace) {
  std::map<int, std::vector<std::byte> > reports;
  if (collector < 0 || collector >= size_) return reports;
  if (rank_ != collector) {
    post(report, collector, kReportTag);
    // Wait for the collector to be done before this process may end: a launcher such as
    // mpirun ends the whole job when one process ends with an error, and would end the
    // collector before it has reported. Bounded: the collector may be dead.
    const auto deadline = MpiClock::now() + grace + std::chrono::milliseconds(1000);
    Backoff backoff;
    while (MpiClock::now() < deadline) {
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
  const auto deadline = MpiClock::now() + grace;
  Backoff backoff;
  while (static_cast<int>(reports.size()) < size_ - 1 && MpiClock::now() < deadline) {
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

void MpiTransport::abort(const std::string& reason) {
  if (aborted_) return;
  aborted_ = true;
  abort_reason_ = reason;
  // Best effort: a notice to every other rank, never waited for here.
  std::vector<std::byte> bytes(reason.size());
  std::memcpy(bytes.data(), reason.data(), reason.size());
  for (int r = 0; r < size_; ++r)
    if (r != rank_) post(bytes, r, kAbortTag);
}

void MpiTransport::post(const std::vector<std::byte>& bytes, int peer, int tag) {
  Pending& p = pending_.emplace_back();
  p.bytes = bytes;
  if (MPI_Isend(p.bytes.data(), static_cast<int>(p.bytes.size()), MPI_BYTE, peer, tag, comm_,
                &p.request) != MPI_SUCCESS)
    pending_.pop_back();
}

void MpiTransport::check(int code, const char* call) {
  if (code != MPI_SUCCESS) give_up(std::string(call) + " failed: " + mpi_error_text(code));
}

void MpiTransport::give_up(const std::string& what) {
  const std::string reason = "rank " + std::to_string(rank_) + ": " + what;
  abort(reason);
  throw TransportError(reason);
}

void MpiTransport::check_cpu(const Tensor& tensor) const {
  if (!tensor.device().is_cpu())
    throw TransportError("rank " + std::to_string(rank_) +
                         ": the MPI transport moves CPU tensors, got " + tensor.describe() +
                         "; GPU ranks need NCCL");
}

int MpiTransport::byte_count(size_t bytes) {
  if (bytes > static_cast<size_t>(INT32_MAX))
    give_up("a message of " + std::to_string(bytes) + " bytes is more than one MPI call sends (" +
            std::to_string(INT32_MAX) + ")");
  return static_cast<int>(bytes);
}

void MpiTransport::throw_if_aborted() {
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

void MpiTransport::reap_sends() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    int done = 0;
    MPI_Test(&it->request, &done, MPI_STATUS_IGNORE);
    it = done ? pending_.erase(it) : std::next(it);
  }
  advance_group_calls();
}

bool MpiTransport::try_receive(const Tensor& tensor, int peer, WaitDeadline& deadline) {
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
  // The message is matched: only its payload is still on the way, unless its sender has
  // given up (and may be gone), which its notice says.
  Backoff backoff;
  for (;;) {
    int done = 0;
    check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test");
    if (done) return true;
    throw_if_aborted();
    if (deadline.passed())
      give_up("a message from rank " + std::to_string(peer) +
              " started but did not finish within " + std::to_string(timeout_.count()) + " ms");
    backoff.pause();
  }
}

}  // namespace detail

std::unique_ptr<Transport> make_mpi_transport(std::chrono::milliseconds timeout) {
  check_timeout(timeout, "the MPI transport's timeout");
  return std::make_unique<detail::MpiTransport>(timeout);
}

#endif

}  // namespace conveyor::comm
