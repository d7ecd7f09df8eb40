#include "engine/schedule/validator.h"

#include <tuple>

#include "engine/schedule/ascii.h"
#include "engine/schedule/simulator.h"

namespace conveyor::schedule {
namespace {

[[noreturn]] void fail(const Schedule& s, int rank, int index, const std::string& rule,
                       const std::string& what) {
  std::string msg;
  if (rank >= 0 && index >= 0 && rank < static_cast<int>(s.ranks.size()) &&
      index < static_cast<int>(s.ranks[rank].size()))
    msg = "rank " + std::to_string(rank) + ", position " + std::to_string(index) + ", " +
          to_string(s.ranks[rank][index]) + ": ";
  msg += what + " [rule: " + rule + "]";
  if (!s.ranks.empty()) msg += "\n" + format_step_grid(s, rank, index);
  throw ValidationError(msg, rank, index, rule);
}

std::string sm(int stage, int mb) {
  return "stage " + std::to_string(stage) + " micro-batch " + std::to_string(mb);
}

}  // namespace

void validate(const Schedule& s) {
  const Placement& pl = s.placement;
  const int R = pl.num_ranks, S = pl.num_stages(), M = s.num_microbatches;
  if (R < 1 || pl.chunks < 1 || M < 1)
    fail(s, -1, -1, "shape",
         "ranks, chunks and micro-batches must be at least 1 (got ranks=" + std::to_string(R) +
             ", chunks=" + std::to_string(pl.chunks) + ", microbatches=" + std::to_string(M) + ")");
  if (static_cast<int>(s.ranks.size()) != R)
    fail(s, -1, -1, "shape",
         "the placement has " + std::to_string(R) + " ranks but the schedule lists " +
             std::to_string(s.ranks.size()));

  // Position of each action; per-action placement, range and peer checks; duplicates.
  // Position of each action in its rank's list, by (kind, stage, mb); a flat table because
  // the validator runs before every execution.
  const size_t table = static_cast<size_t>(S) * static_cast<size_t>(M);
  if (table > (size_t{1} << 25))
    fail(s, -1, -1, "shape",
         "stages x micro-batches = " + std::to_string(table) +
             " is larger than supported (33554432)");
  std::vector<int> pos(8 * table, -1);
  auto key = [&](ActionKind k, int stage, int mb) {
    return (static_cast<size_t>(k) * S + stage) * M + mb;
  };
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < static_cast<int>(s.ranks[r].size()); ++i) {
      const Action& a = s.ranks[r][i];
      if (a.stage < 0 || a.stage >= S)
        fail(s, r, i, "placement",
             "stage " + std::to_string(a.stage) + " does not exist (stages 0.." +
                 std::to_string(S - 1) + ")");
      if (a.microbatch < 0 || a.microbatch >= M)
        fail(s, r, i, "placement",
             "micro-batch " + std::to_string(a.microbatch) + " does not exist (micro-batches 0.." +
                 std::to_string(M - 1) + ")");
      if (pl.rank_of(a.stage) != r)
        fail(s, r, i, "placement",
             "stage " + std::to_string(a.stage) + " belongs to rank " +
                 std::to_string(pl.rank_of(a.stage)) + " (" + layout_name(pl.layout) +
                 " layout), not rank " + std::to_string(r));
      if (is_transfer(a.kind)) {
        const bool act = a.kind == ActionKind::kSendAct || a.kind == ActionKind::kRecvAct;
        const int other = (a.kind == ActionKind::kSendAct || a.kind == ActionKind::kRecvGrad)
                              ? a.stage + 1
                              : a.stage - 1;
        if (other < 0 || other >= S)
          fail(s, r, i, "peer",
               std::string(act ? "an activation" : "a gradient") + " of stage " +
                   std::to_string(a.stage) + " has no neighbour stage " + std::to_string(other) +
                   " to exchange with");
        if (pl.rank_of(other) == r)
          fail(s, r, i, "peer",
               "stage " + std::to_string(other) +
                   " is on the same rank; hand the data over locally, without a transfer");
        if (a.peer != pl.rank_of(other))
          fail(s, r, i, "peer",
               "the peer must be rank " + std::to_string(pl.rank_of(other)) + " (owner of stage " +
                   std::to_string(other) + "), not " + std::to_string(a.peer));
      }
      int& slot = pos[key(a.kind, a.stage, a.microbatch)];
      if (slot >= 0)
        fail(s, r, i, "duplicate",
             std::string(kind_name(a.kind)) + " of " + sm(a.stage, a.microbatch) +
                 " appears twice (first at position " + std::to_string(slot) + ")");
      slot = i;
    }
  auto at = [&](ActionKind k, int stage, int mb) { return pos[key(k, stage, mb)]; };

  // Completeness and order within a rank.
  for (int st = 0; st < S; ++st) {
    const int r = pl.rank_of(st);
    for (int k = 0; k < M; ++k) {
      const int f = at(ActionKind::kForward, st, k), b = at(ActionKind::kBackward, st, k);
      const int in = at(ActionKind::kBackwardInput, st, k),
                w = at(ActionKind::kBackwardWeight, st, k);
      if (f < 0) {
        const int any = b >= 0 ? b : in >= 0 ? in : w;
        fail(s, r, any, "missing", "the forward F of " + sm(st, k) + " is missing");
      }
      if (b >= 0 && (in >= 0 || w >= 0))
        fail(s, r, b, "duplicate",
             sm(st, k) + " has both a full backward B and a split backward (I/W)");
      if (b < 0 && in < 0 && w < 0)
        fail(s, r, f, "missing",
             "the backward of " + sm(st, k) + " is missing (expected B, or I then W)");
      if (b < 0 && in < 0)
        fail(s, r, w, "missing", "W of " + sm(st, k) + " has no I (input-gradient backward)");
      if (b < 0 && w < 0)
        fail(s, r, in, "missing", "I of " + sm(st, k) + " has no W (weight-gradient backward)");
      const int bwd = b >= 0 ? b : in;
      if (bwd < f)
        fail(s, r, bwd, "order", "the backward of " + sm(st, k) + " comes before its forward");
      if (w >= 0 && w < in) fail(s, r, w, "order", "W of " + sm(st, k) + " comes before its I");
      // Cross-stage data flow.
      if (st + 1 < S) {
        const int rn = pl.rank_of(st + 1);
        if (rn == r) {
          const int fn = at(ActionKind::kForward, st + 1, k);
          if (fn >= 0 && fn < f)
            fail(s, r, fn, "order",
                 "F of " + sm(st + 1, k) + " comes before F of stage " + std::to_string(st));
          int bn = at(ActionKind::kBackward, st + 1, k);
          if (bn < 0) bn = at(ActionKind::kBackwardInput, st + 1, k);
          if (bn >= 0 && bn > bwd)
            fail(s, r, bwd, "order",
                 "the backward of " + sm(st, k) + " comes before the backward of stage " +
                     std::to_string(st + 1));
        } else {
          const int sa = at(ActionKind::kSendAct, st, k);
          if (sa < 0)
            fail(
                s, r, f, "missing",
                "no SEND_ACT sends this output of " + sm(st, k) + " to rank " + std::to_string(rn));
          if (sa < f)
            fail(s, r, sa, "order",
                 "SEND_ACT of " + sm(st, k) + " comes before the F that produces it");
          const int rg = at(ActionKind::kRecvGrad, st, k);
          if (rg < 0)
            fail(s, r, bwd, "missing",
                 "no RECV_GRAD receives the output gradient of " + sm(st, k) + " from rank " +
                     std::to_string(rn));
          if (rg > bwd)
            fail(s, r, rg, "order",
                 "RECV_GRAD of " + sm(st, k) + " comes after the backward that needs it");
        }
      }
      if (st > 0 && pl.rank_of(st - 1) != r) {
        const int rp = pl.rank_of(st - 1);
        const int ra = at(ActionKind::kRecvAct, st, k);
        if (ra < 0)
          fail(s, r, f, "missing",
               "no RECV_ACT receives the input of " + sm(st, k) + " from rank " +
                   std::to_string(rp));
        if (ra > f)
          fail(s, r, ra, "order", "RECV_ACT of " + sm(st, k) + " comes after the F that needs it");
        const int sg = at(ActionKind::kSendGrad, st, k);
        if (sg < 0)
          fail(s, r, bwd, "missing",
               "no SEND_GRAD sends the input gradient of " + sm(st, k) + " to rank " +
                   std::to_string(rp));
        if (sg < bwd)
          fail(s, r, sg, "order",
               "SEND_GRAD of " + sm(st, k) + " comes before the backward that produces it");
      }
    }
  }

  // FIFO per link: the k-th receive on (src -> dst) is the k-th send's message.
  std::vector<std::vector<std::vector<int>>> sends(R, std::vector<std::vector<int>>(R));
  std::vector<std::vector<std::vector<int>>> recvs(R, std::vector<std::vector<int>>(R));
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < static_cast<int>(s.ranks[r].size()); ++i) {
      const Action& a = s.ranks[r][i];
      if (is_send(a.kind)) sends[r][a.peer].push_back(i);
      if (is_recv(a.kind)) recvs[r][a.peer].push_back(i);
    }
  for (int src = 0; src < R; ++src)
    for (int dst = 0; dst < R; ++dst) {
      const auto& out = sends[src][dst];
      const auto& in = recvs[dst][src];
      for (size_t n = 0; n < out.size() && n < in.size(); ++n) {
        const Action& sa = s.ranks[src][out[n]];
        const Action& ra = s.ranks[dst][in[n]];
        if (message_key(sa) != message_key(ra))
          fail(s, dst, in[n], "fifo",
               "on link rank " + std::to_string(src) + " -> rank " + std::to_string(dst) +
                   " message #" + std::to_string(n) + " is sent by " + to_string(sa) + " (rank " +
                   std::to_string(src) + ", position " + std::to_string(out[n]) +
                   ") but this receive expects another one; an in-order transport (NCCL) would "
                   "mismatch or deadlock: receives must follow the order of the sends");
      }
      // Counts match because every send and receive is present exactly once (checked above).
    }

  // Progress: a zero-cost run must reach the end.
  try {
    simulate(s, CostModel::uniform(0, 0, 0, 0));
  } catch (const DeadlockError& e) {
    // Mark the earliest stuck receive: the head of a receive stream waiting on a message that
    // cannot come is usually the cause; compute heads merely wait on it.
    StuckAction mark;
    for (const auto& st : e.stuck()) {
      const bool recv = is_recv(s.ranks[st.rank][st.index].kind);
      const bool mark_recv = mark.rank >= 0 && is_recv(s.ranks[mark.rank][mark.index].kind);
      if (mark.rank < 0 || (recv && !mark_recv) ||
          (recv == mark_recv && std::tie(st.index, st.rank) < std::tie(mark.index, mark.rank)))
        mark = st;
    }
    fail(s, mark.rank, mark.index, "deadlock", e.what());
  }
}

}  // namespace conveyor::schedule
