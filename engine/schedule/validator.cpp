#include "engine/schedule/validator.h"

#include <algorithm>
#include <optional>
#include <tuple>

#include "engine/schedule/action_index.h"
#include "engine/schedule/ascii.h"
#include "engine/schedule/checked_progress.h"
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

// Everything validate() proves but progress: shapes, placement, peers, completeness, order
// within a rank and the all-reduces.
void check_structure(const Schedule& s) {
  const Placement& pl = s.placement;
  const int R = pl.num_ranks, S = pl.num_stages(), M = s.num_microbatches;
  if (R < 1 || pl.chunks < 1 || M < 1)
    fail(s, -1, -1, "shape",
         "ranks, chunks and micro-batches must be at least 1 (got ranks=" + std::to_string(R) +
             ", chunks=" + std::to_string(pl.chunks) + ", microbatches=" + std::to_string(M) + ")");
  if (s.replicas < 1)
    fail(s, -1, -1, "shape",
         "replicas must be at least 1 (got " + std::to_string(s.replicas) + ")");
  if (static_cast<int>(s.ranks.size()) != R)
    fail(s, -1, -1, "shape",
         "the placement has " + std::to_string(R) + " ranks but the schedule lists " +
             std::to_string(s.ranks.size()));

  table_cells(S, M);  // throws when (stage, micro-batch) tables would be too large

  // Rank by rank: the position of each of the rank's actions in its list, by (kind, chunk, mb),
  // with per-action placement, range and peer checks and duplicates; then completeness and
  // order of the rank's (stage, micro-batch) cells, which read that rank's positions only. One
  // rank's table stays in cache, where a table of every cell would be written and read back
  // from memory. The errors are those of checking every action first and then every cell in
  // stage order: an action's error is thrown at once (the ranks before have none), a cell's is
  // kept until every action has been checked, the one of the first cell in stage order.
  std::vector<int> owner(S);  // rank of each stage, asked of every action
  for (int st = 0; st < S; ++st) owner[st] = pl.rank_of(st);
  ActionIndex index(pl.chunks, M);
  std::vector<int> reduce_at(S, -1);   // position of each stage's first ALLREDUCE_GRAD
  std::vector<int> next_bucket(S, 0);  // the bucket of each stage's next ALLREDUCE_GRAD
  auto check_actions = [&](int r) {
    for (int i = 0; i < static_cast<int>(s.ranks[r].size()); ++i) {
      const Action& a = s.ranks[r][i];
      if (a.stage < 0 || a.stage >= S)
        fail(s, r, i, "placement",
             "stage " + std::to_string(a.stage) + " does not exist (stages 0.." +
                 std::to_string(S - 1) + ")");
      if (!is_reduce(a.kind) && (a.microbatch < 0 || a.microbatch >= M))
        fail(s, r, i, "placement",
             "micro-batch " + std::to_string(a.microbatch) + " does not exist (micro-batches 0.." +
                 std::to_string(M - 1) + ")");
      if (owner[a.stage] != r)
        fail(s, r, i, "placement",
             "stage " + std::to_string(a.stage) + " belongs to rank " +
                 std::to_string(owner[a.stage]) + " (" + layout_name(pl.layout) +
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
        if (owner[other] == r)
          fail(s, r, i, "peer",
               "stage " + std::to_string(other) +
                   " is on the same rank; hand the data over locally, without a transfer");
        if (a.peer != owner[other])
          fail(s, r, i, "peer",
               "the peer must be rank " + std::to_string(owner[other]) + " (owner of stage " +
                   std::to_string(other) + "), not " + std::to_string(a.peer));
      }
      if (is_reduce(a.kind)) {
        if (s.replicas == 1)
          fail(s, r, i, "allreduce",
               "a schedule of one replica has no gradient all-reduce (remove it, or say "
               "replicas=D in the header)");
        // Buckets 0, 1, ... of the stage, each once and in order: the members of a replica
        // group start their sums in the same order.
        if (a.microbatch < next_bucket[a.stage]) {
          // The place of this bucket's first copy, not of the stage's bucket 0.
          const auto& list = s.ranks[r];
          const auto same = std::find_if(list.begin(), list.begin() + i, [&](const Action& b) {
            return is_reduce(b.kind) && b.stage == a.stage && b.microbatch == a.microbatch;
          });
          const int64_t first = same == list.begin() + i ? reduce_at[a.stage] : same - list.begin();
          fail(s, r, i, "allreduce",
               "the gradient all-reduce of stage " + std::to_string(a.stage) +
                   (a.microbatch > 0 ? " (bucket " + std::to_string(a.microbatch) + ")" : "") +
                   " appears twice (first at position " + std::to_string(first) +
                   "); each stage needs exactly one of each bucket");
        }
        if (a.microbatch > next_bucket[a.stage]) {
          const int want = next_bucket[a.stage];
          const std::string of = " of the gradient all-reduce of stage " + std::to_string(a.stage);
          // A bucket skipped for good is missing, not out of order: say which.
          const auto& list = s.ranks[r];
          const bool later = std::any_of(list.begin() + i + 1, list.end(), [&](const Action& b) {
            return is_reduce(b.kind) && b.stage == a.stage && b.microbatch == want;
          });
          if (later)
            fail(s, r, i, "allreduce",
                 "bucket " + std::to_string(a.microbatch) + of + " comes before bucket " +
                     std::to_string(want) + "; the buckets go in order from 0");
          const bool one = a.microbatch - want == 1;
          fail(s, r, i, "allreduce",
               "bucket " + std::to_string(a.microbatch) + of + " is there but bucket " +
                   std::to_string(want) +
                   " is missing; the buckets go in order from 0, each once, so " +
                   (one ? "bucket " + std::to_string(want) + " comes"
                        : "buckets " + std::to_string(want) + " to " +
                              std::to_string(a.microbatch - 1) + " come") +
                   " before it");
        }
        if (reduce_at[a.stage] < 0) reduce_at[a.stage] = i;
        ++next_bucket[a.stage];
        continue;
      }
      const int first = index.insert(a.kind, pl.chunk_of(a.stage), a.microbatch, i);
      if (first >= 0)
        fail(s, r, i, "duplicate",
             std::string(kind_name(a.kind)) + " of " + sm(a.stage, a.microbatch) +
                 " appears twice (first at position " + std::to_string(first) + ")");
    }
  };
  // Every stage and micro-batch of rank r is in range from here on: the checks below read the
  // cells of its index directly.
  auto pos = [](const int* cell, ActionKind k) { return cell[static_cast<int>(k)]; };

  // Completeness and order within a rank.
  auto check_cell = [&](int st, int k) {
    const int r = owner[st];
    const int rn = st + 1 < S ? owner[st + 1] : -1, rp = st > 0 ? owner[st - 1] : -1;
    const int* cell = index.cell(pl.chunk_of(st), k);
    const int f = pos(cell, ActionKind::kForward), b = pos(cell, ActionKind::kBackward);
    const int in = pos(cell, ActionKind::kBackwardInput),
              w = pos(cell, ActionKind::kBackwardWeight);
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
    if (s.replicas > 1) {
      const int grad = b >= 0 ? b : w;
      if (reduce_at[st] < 0)
        fail(s, r, grad, "allreduce",
             "stage " + std::to_string(st) + " has no ALLREDUCE_GRAD (AR" + std::to_string(st) +
                 "): with " + std::to_string(s.replicas) +
                 " replicas its gradients must be summed after its last weight gradient");
      if (reduce_at[st] < grad)
        fail(s, r, reduce_at[st], "allreduce",
             "the all-reduce of stage " + std::to_string(st) + " comes before " +
                 kind_name(s.ranks[r][grad].kind) + " of " + sm(st, k) +
                 ", which still adds to the gradients it sums; put it after every B or W of "
                 "the stage");
    }
    // Cross-stage data flow.
    if (st + 1 < S) {
      if (rn == r) {
        const int* next = index.cell(pl.chunk_of(st + 1), k);
        const int fn = pos(next, ActionKind::kForward);
        if (fn >= 0 && fn < f)
          fail(s, r, fn, "order",
               "F of " + sm(st + 1, k) + " comes before F of stage " + std::to_string(st));
        int bn = pos(next, ActionKind::kBackward);
        if (bn < 0) bn = pos(next, ActionKind::kBackwardInput);
        if (bn >= 0 && bn > bwd)
          fail(s, r, bwd, "order",
               "the backward of " + sm(st, k) + " comes before the backward of stage " +
                   std::to_string(st + 1));
      } else {
        const int sa = pos(cell, ActionKind::kSendAct);
        if (sa < 0)
          fail(s, r, f, "missing",
               "no SEND_ACT sends this output of " + sm(st, k) + " to rank " + std::to_string(rn));
        if (sa < f)
          fail(s, r, sa, "order",
               "SEND_ACT of " + sm(st, k) + " comes before the F that produces it");
        const int rg = pos(cell, ActionKind::kRecvGrad);
        if (rg < 0)
          fail(s, r, bwd, "missing",
               "no RECV_GRAD receives the output gradient of " + sm(st, k) + " from rank " +
                   std::to_string(rn));
        if (rg > bwd)
          fail(s, r, rg, "order",
               "RECV_GRAD of " + sm(st, k) + " comes after the backward that needs it");
      }
    }
    if (st > 0 && rp != r) {
      const int ra = pos(cell, ActionKind::kRecvAct);
      if (ra < 0)
        fail(s, r, f, "missing",
             "no RECV_ACT receives the input of " + sm(st, k) + " from rank " + std::to_string(rp));
      if (ra > f)
        fail(s, r, ra, "order", "RECV_ACT of " + sm(st, k) + " comes after the F that needs it");
      const int sg = pos(cell, ActionKind::kSendGrad);
      if (sg < 0)
        fail(s, r, bwd, "missing",
             "no SEND_GRAD sends the input gradient of " + sm(st, k) + " to rank " +
                 std::to_string(rp));
      if (sg < bwd)
        fail(s, r, sg, "order",
             "SEND_GRAD of " + sm(st, k) + " comes before the backward that produces it");
    }
  };

  std::optional<ValidationError> cell_error;
  int error_stage = S, error_mb = 0;  // the first failing cell in stage order so far
  for (int r = 0; r < R; ++r) {
    index.clear();
    check_actions(r);
    for (int c = 0; c < pl.chunks; ++c) {
      const int st = pl.stage_of(r, c);
      for (int k = 0; k < M && std::tie(st, k) < std::tie(error_stage, error_mb); ++k) {
        try {
          check_cell(st, k);
        } catch (const ValidationError& e) {
          cell_error = e, error_stage = st, error_mb = k;
        }
      }
    }
  }
  if (cell_error) throw *cell_error;
}

// Fails naming the first message of link src -> dst that its receiver expects out of order.
void fail_fifo(const Schedule& s, int src, int dst) {
  std::vector<int> out, in;
  for (int i = 0; i < static_cast<int>(s.ranks[src].size()); ++i)
    if (is_send(s.ranks[src][i].kind) && s.ranks[src][i].peer == dst) out.push_back(i);
  for (int i = 0; i < static_cast<int>(s.ranks[dst].size()); ++i)
    if (is_recv(s.ranks[dst][i].kind) && s.ranks[dst][i].peer == src) in.push_back(i);
  for (size_t n = 0; n < out.size() && n < in.size(); ++n) {
    const Action& sa = s.ranks[src][out[n]];
    if (message_key(sa) != message_key(s.ranks[dst][in[n]]))
      fail(s, dst, in[n], "fifo",
           "on link rank " + std::to_string(src) + " -> rank " + std::to_string(dst) +
               " message #" + std::to_string(n) + " is sent by " + to_string(sa) + " (rank " +
               std::to_string(src) + ", position " + std::to_string(out[n]) +
               ") but this receive expects another one; an in-order transport (NCCL) would "
               "mismatch or deadlock: receives must follow the order of the sends");
  }
}

// FIFO per link: the n-th receive on (src -> dst) is the n-th send's message. Every message
// is sent and received once (checked by check_structure), so this holds exactly when, on each
// link, the receives find their sends in increasing position. That needs one number per peer,
// not tables per pair of ranks; the message names the first mismatch of the broken link.
void check_fifo(const Schedule& s) {
  const int R = s.placement.num_ranks;
  // The positions of every send, by (stage, mb): only a stuck run needs them.
  ActionIndex sends(s.placement.num_stages(), s.num_microbatches);
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < static_cast<int>(s.ranks[r].size()); ++i)
      if (is_send(s.ranks[r][i].kind))
        sends.insert(s.ranks[r][i].kind, s.ranks[r][i].stage, s.ranks[r][i].microbatch, i);
  std::vector<int> last_send(R, -1), touched;
  for (int dst = 0; dst < R; ++dst) {
    for (int p : touched) last_send[p] = -1;
    touched.clear();
    for (const Action& a : s.ranks[dst]) {
      if (!is_recv(a.kind)) continue;
      const int send = a.kind == ActionKind::kRecvAct
                           ? sends.at(ActionKind::kSendAct, a.stage - 1, a.microbatch)
                           : sends.at(ActionKind::kSendGrad, a.stage + 1, a.microbatch);
      int& last = last_send[a.peer];
      if (last < 0) touched.push_back(a.peer);
      if (send < last) fail_fifo(s, a.peer, dst);
      last = send;
    }
  }
}

// Why a run of a structurally sound schedule is stuck: a broken FIFO link when there is
// one, reported before the deadlock it causes; else the deadlock, at the earliest stuck
// receive.
[[noreturn]] void fail_stuck(const Schedule& s, const DeadlockError& e) {
  check_fifo(s);
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

}  // namespace

// Progress: a zero-cost run must reach the end. A run that does has also proven FIFO order:
// on a link, sends leave in send-stream order and receives complete in receive-stream order,
// each together with its own send, so the n-th of each carry one message. The links are
// thus read only when the run is stuck.
void validate(const Schedule& s) {
  check_structure(s);
  try {
    detail::check_progress_of_checked(s);
  } catch (const DeadlockError& e) {
    fail_stuck(s, e);
  }
}

// Which actions can run does not depend on their costs (every wait is for an action to
// finish or for a peer's head to reach a message, never for a time), so the timed run
// reaches the end exactly when the zero-cost run does, and stops at the same heads when it
// does not: one run proves progress and gives the times.
SimResult validate_and_simulate(const Schedule& s, const CostModel& costs) {
  check_structure(s);
  try {
    return simulate(s, costs);
  } catch (const DeadlockError& e) {
    fail_stuck(s, e);
  }
}

}  // namespace conveyor::schedule
