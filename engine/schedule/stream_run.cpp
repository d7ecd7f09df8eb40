// The stream run (stream_run.h) at work: the work list of ranks, and each rank's compute, send
// and reduction streams moving while they can.
#include "engine/schedule/stream_run.h"

#include <algorithm>
#include <cstdint>

namespace conveyor::schedule::detail {
namespace {

// Whether receive `recv` takes the message of send `send`: message_key(recv) ==
// message_key(send), spelled out for the one pairing the run asks about millions of times.
// SEND_ACT(s) goes to RECV_ACT(s+1), SEND_GRAD(s) to RECV_GRAD(s-1).
bool takes(const Action& recv, const Action& send) {
  const bool act = send.kind == ActionKind::kSendAct;
  return recv.kind == (act ? ActionKind::kRecvAct : ActionKind::kRecvGrad) &&
         recv.stage == send.stage + (act ? 1 : -1) && recv.microbatch == send.microbatch;
}

}  // namespace

template <bool kTimed>
void StreamRun<kTimed>::run() {
  while (!work_.empty()) {
    const int r = work_.back();
    work_.pop_back();
    queued_[r] = 0;
    visit(r);
  }
  if (remaining_ > 0) throw deadlock();
}

// Counts compute `a` at position i of rank q's list.
template <bool kTimed>
void StreamRun<kTimed>::count_activations(Streams& q, const Action& a, int i) const {
  const double b = activation_bytes_[a.stage];
  ActivationCount& m = q.memory;
  if (a.kind == ActionKind::kForward) {
    ++m.in_flight, ++m.held, m.in_flight_bytes += b, m.held_bytes += b;
    m.peak.peak_in_flight = std::max(m.peak.peak_in_flight, m.in_flight);
    m.peak.peak_held = std::max(m.peak.peak_held, m.held);
    m.peak.peak_in_flight_bytes = std::max(m.peak.peak_in_flight_bytes, m.in_flight_bytes);
    m.peak.peak_held_bytes = std::max(m.peak.peak_held_bytes, m.held_bytes);
    return;
  }
  if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput)
    --m.in_flight, m.in_flight_bytes -= b;
  if (q.last_use[static_cast<size_t>(chunk_[a.stage]) * mbs_ + a.microbatch] == i)
    --m.held, m.held_bytes -= b;
}

// Whether the inputs of compute `a` (in cell c) on rank r are there, and when the last one
// ended. The neighbour stages' cells are a row of mbs_ cells away.
template <bool kTimed>
bool StreamRun<kTimed>::inputs_ready(int r, const Action& a, size_t c, double* ready) const {
  const int st = a.stage;
  auto need = [&](typename Done::Kind kind, size_t at) {
    if (!done_.done(at, kind)) return false;
    if constexpr (kTimed) {
      *ready = std::max(*ready, done_.end(at, kind));
      if (trace_) inputs_[inputs_[2]++] = done_.by(at, kind);
    }
    return true;
  };
  switch (a.kind) {
    case ActionKind::kForward:
      if (st == 0) return true;
      return owner_[st - 1] == r ? need(Done::kForwardDone, c - mbs_)
                                 : need(Done::kActivationIn, c);
    case ActionKind::kBackwardWeight:
      return need(Done::kGradientDone, c);
    default:  // B or I: the forward's activations and the output gradient
      if (!need(Done::kForwardDone, c)) return false;
      if (st + 1 == stages_) return true;
      return owner_[st + 1] == r ? need(Done::kGradientDone, c + mbs_) : need(Done::kGradientIn, c);
  }
}

// Runs rank r's streams until none can move. A compute can only be unblocked by a transfer
// into its own cell and a send only by a compute (or by its receiver, which wakes this
// rank), and the reduction stream waits only for computes: after the first round, a stream
// is tried again only when the other one has moved in a way that may unblock it.
template <bool kTimed>
void StreamRun<kTimed>::visit(int r) {
  for (bool first = true;; first = false) {
    const bool computed = run_computes(r);
    if (!computed && !first) break;
    const bool unblocked = run_sends(r);
    run_reduces(r);
    if (!unblocked) break;
  }
}

// Compute stream: runs computes while their inputs are there. Whether any ran.
template <bool kTimed>
bool StreamRun<kTimed>::run_computes(int r) {
  Streams& q = streams_[r];
  bool moved = false;
  while (q.compute < q.size) {
    const Action& a = q.actions[q.compute];
    const size_t c = cell(a);
    double ready = 0;
    if constexpr (kTimed) ready = q.compute_free;
    inputs_ = {-1, -1, 0};
    if (!inputs_ready(r, a, c, &ready)) break;
    double end = 0;
    if constexpr (kTimed) {
      if (trace_) {
        int& prev = last_[4 * r];
        const int at = first_[r] + q.compute;
        trace_->push_back(
            {at, -1, {prev, inputs_[0], inputs_[1]}, r, -1, a.kind, a.stage, ReplayStep::kCompute});
        prev = at;
      }
      end = ready + cost(a);
      q.timing[q.compute] = {ready, end};
      q.compute_free = end;
      // The cost itself: end - ready loses the digits of a short action late in a long run.
      q.busy += cost(a);
      q.end = std::max(q.end, end);
      if (q.last_use) count_activations(q, a, q.compute);
    }
    const int by = trace_ ? first_[r] + q.compute : -1;
    if (a.kind == ActionKind::kForward)
      done_.mark(c, Done::kForwardDone, end, by);
    else if (a.kind != ActionKind::kBackwardWeight)
      done_.mark(c, Done::kGradientDone, end, by);
    q.compute = seek(q, q.compute + 1, is_compute);
    prefetch_ahead(q);
    --remaining_, moved = true;
  }
  return moved;
}

// Send stream, in rendezvous with the receivers' receive streams. Whether a transfer brought
// the input the compute head waits for.
template <bool kTimed>
bool StreamRun<kTimed>::run_sends(int r) {
  Streams& q = streams_[r];
  // The one cell whose marks can unblock the compute head: its received input's.
  const size_t waits_on = q.compute < q.size ? cell(q.actions[q.compute]) : SIZE_MAX;
  bool unblocked = false;
  while (q.send < q.size) {
    const Action& a = q.actions[q.send];
    const size_t c = cell(a);
    const bool act = a.kind == ActionKind::kSendAct;
    const auto produced = act ? Done::kForwardDone : Done::kGradientDone;
    if (!done_.done(c, produced)) break;
    const int dst = a.peer;
    Streams& d = streams_[dst];
    if (d.recv >= d.size) break;
    const Action& b = d.actions[d.recv];
    if (!takes(b, a)) break;
    double end = 0;
    const int at_recv = trace_ ? first_[dst] + d.recv : -1;
    if constexpr (kTimed) {
      if (trace_) {
        int &sent = last_[4 * r + 1], &received = last_[4 * dst + 2];
        const int at = first_[r] + q.send;
        trace_->push_back({at,
                           at_recv,
                           {done_.by(c, produced), sent, received},
                           r,
                           dst,
                           a.kind,
                           a.stage,
                           ReplayStep::kTransfer});
        sent = at, received = at_recv;
      }
      const double start = std::max({done_.end(c, produced), q.send_free, d.recv_free});
      end = start + cost(a);
      q.timing[q.send] = d.timing[d.recv] = {start, end};
      q.send_free = d.recv_free = end;
      q.end = std::max(q.end, end);
      d.end = std::max(d.end, end);
    }
    const size_t marked = cell(b);
    done_.mark(marked, act ? Done::kActivationIn : Done::kGradientIn, end, at_recv);
    unblocked |= marked == waits_on;
    q.send = seek(q, q.send + 1, is_send);
    d.recv = seek(d, d.recv + 1, is_recv);
    prefetch_for(d, d.recv);
    remaining_ -= 2;
    // The receiver's computes may now run, and the sender of its next receive may be
    // waiting for that receive to reach the head.
    if (dst != r) wake(dst);
    if (d.recv < d.size) {
      const Action& next = d.actions[d.recv];
      const int sender = next.peer;
      if (sender >= 0 && sender < ranks_ && sender != r) {
        const Streams& w = streams_[sender];
        if (w.send < w.size && takes(next, w.actions[w.send])) wake(sender);
      }
    }
  }
  return unblocked;
}

// Reduction stream: an all-reduce waits only for its stage's weight gradients here, and for
// the same point in every other replica, which runs the same list.
template <bool kTimed>
void StreamRun<kTimed>::run_reduces(int r) {
  Streams& q = streams_[r];
  for (; q.reduce < q.reduce_end; ++q.reduce) {
    const auto [i, dep] = reduces_[q.reduce];
    if (dep >= 0 && q.compute <= dep) break;
    if constexpr (kTimed) {
      if (trace_) {
        int& prev = last_[4 * r + 3];
        const int at = first_[r] + i;
        trace_->push_back({at,
                           -1,
                           {prev, dep >= 0 ? first_[r] + dep : -1, -1},
                           r,
                           -1,
                           q.actions[i].kind,
                           q.actions[i].stage,
                           ReplayStep::kReduce});
        prev = at;
      }
      const double start = std::max(q.reduce_free, dep >= 0 ? q.timing[dep].end : 0.0);
      q.timing[i] = {start, start + reduce_cost(q.actions[i])};
      q.reduce_free = q.timing[i].end;
      q.reduce_time += q.timing[i].end - q.timing[i].start;
      q.end = std::max(q.end, q.timing[i].end);
    }
    --remaining_;
  }
}

// The members defined in stream_run_setup.cpp are instantiated there.
template void StreamRun<false>::run();
template void StreamRun<true>::run();

}  // namespace conveyor::schedule::detail
