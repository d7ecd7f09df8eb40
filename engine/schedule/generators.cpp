#include "engine/schedule/generators.h"

#include <algorithm>
#include <deque>
#include <map>
#include <tuple>

namespace conveyor::schedule {
namespace {

void check_common(const char* kind, int p, int m) {
  if (p < 1)
    throw ScheduleError(std::string(kind) + " needs at least 1 stage, got p=" + std::to_string(p));
  if (m < 1)
    throw ScheduleError(std::string(kind) +
                        " needs at least 1 micro-batch, got m=" + std::to_string(m));
  // Far beyond any real pipeline; keeps a typo from allocating gigabytes.
  if (p > 4096 || m > 1048576 || static_cast<long long>(p) * m > (1LL << 24))
    throw ScheduleError(
        std::string(kind) + " with p=" + std::to_string(p) + " and m=" + std::to_string(m) +
        " is too large (p <= 4096, m <= 1048576, p*m <= " + std::to_string(1 << 24) + ")");
}

Schedule empty_schedule(const char* name, int p, int m, int v, Layout layout) {
  Schedule s;
  s.name = name;
  s.placement = {p, v, layout};
  s.num_microbatches = m;
  s.ranks.assign(p, {});
  return s;
}

// A kind made by a cast names no schedule; without its number the refusal would not say
// what was given.
void check_kind(ScheduleKind kind) {
  for (const NamedScheduleKind& k : schedule_kinds())
    if (k.kind == kind) return;
  throw ScheduleError("the schedule kind " + std::to_string(static_cast<int>(kind)) +
                      " is none of ScheduleKind::kGPipe, k1F1B, kInterleaved, kZBH1 or kZBV");
}

// One pipeline's schedule of `kind`, without data parallelism.
Schedule generate_pipeline(ScheduleKind kind, int p, int m, int v);

}  // namespace

std::span<const NamedScheduleKind> schedule_kinds() {
  static constexpr NamedScheduleKind kinds[] = {{ScheduleKind::kGPipe, "gpipe"},
                                                {ScheduleKind::k1F1B, "1f1b"},
                                                {ScheduleKind::kInterleaved, "interleaved"},
                                                {ScheduleKind::kZBH1, "zbh1"},
                                                {ScheduleKind::kZBV, "zbv"}};
  return kinds;
}

const char* schedule_kind_name(ScheduleKind kind) {
  for (const auto& k : schedule_kinds())
    if (k.kind == kind) return k.name;
  return "?";
}

std::optional<ScheduleKind> parse_schedule_kind(std::string_view name) {
  for (const auto& k : schedule_kinds())
    if (name == k.name) return k.kind;
  return std::nullopt;
}

std::string schedule_kind_choices() {
  std::string out;
  for (const auto& k : schedule_kinds()) out.append(out.empty() ? "" : "|").append(k.name);
  return out;
}

Schedule generate(ScheduleKind kind, int p, int m, int v, int replicas) {
  if (replicas < 1 || replicas > 65536)
    throw ScheduleError("data parallelism needs 1 to 65536 replicas, got " +
                        std::to_string(replicas));
  Schedule s = generate_pipeline(kind, p, m, v);
  if (replicas > 1) add_gradient_all_reduces(&s, replicas);
  return s;
}

bool takes_chunks(ScheduleKind kind, int64_t v) {
  switch (kind) {
    case ScheduleKind::kInterleaved:
      return true;
    case ScheduleKind::kZBV:
      return v == 1 || v == 2;
    default:
      return v == 1;
  }
}

int chunks_per_rank(ScheduleKind kind, int v) { return kind == ScheduleKind::kZBV ? 2 : v; }

void check_chunks(ScheduleKind kind, int v) {
  check_kind(kind);
  if (takes_chunks(kind, v)) return;
  if (kind == ScheduleKind::kZBV)
    throw ScheduleError("zbv always has 2 chunks per rank in a V; " + std::to_string(v) +
                        " chunks per rank do not apply (give 1 or 2)");
  throw ScheduleError(std::string(schedule_kind_name(kind)) + " has one chunk per rank; " +
                      std::to_string(v) + " chunks per rank are only for 'interleaved' (give 1)");
}

namespace {
Schedule generate_pipeline(ScheduleKind kind, int p, int m, int v) {
  check_chunks(kind, v);
  switch (kind) {
    case ScheduleKind::kGPipe:
      return generate_gpipe(p, m);
    case ScheduleKind::k1F1B:
      return generate_1f1b(p, m);
    case ScheduleKind::kInterleaved:
      return generate_interleaved(p, m, v);
    case ScheduleKind::kZBH1:
      return generate_zbh1(p, m);
    case ScheduleKind::kZBV:
      return generate_zbv(p, m);
  }
  throw ScheduleError("unknown schedule kind");
}
}  // namespace

Schedule generate_gpipe(int p, int m) {
  check_common("gpipe", p, m);
  Schedule s = empty_schedule("gpipe", p, m, 1, Layout::kLooped);
  for (int r = 0; r < p; ++r) {
    for (int k = 0; k < m; ++k) s.ranks[r].push_back(forward(r, k));
    for (int k = 0; k < m; ++k) s.ranks[r].push_back(backward(r, k));
  }
  insert_transfers(&s);
  return s;
}

Schedule generate_1f1b(int p, int m) {
  check_common("1f1b", p, m);
  Schedule s = empty_schedule("1f1b", p, m, 1, Layout::kLooped);
  for (int r = 0; r < p; ++r) {
    auto& list = s.ranks[r];
    const int warmup = std::min(p - 1 - r, m);
    for (int k = 0; k < warmup; ++k) list.push_back(forward(r, k));
    for (int i = 0; i < m - warmup; ++i) {
      list.push_back(forward(r, warmup + i));
      list.push_back(backward(r, i));
    }
    for (int k = m - warmup; k < m; ++k) list.push_back(backward(r, k));
  }
  insert_transfers(&s);
  return s;
}

Schedule generate_interleaved(int p, int m, int v) {
  check_common("interleaved", p, m);
  if (v < 1)
    throw ScheduleError("interleaved needs at least 1 chunk per rank, got v=" + std::to_string(v));
  if (static_cast<long long>(p) * m * v > (1LL << 24))
    throw ScheduleError(
        "interleaved with p*m*v = " + std::to_string(static_cast<long long>(p) * m * v) +
        " is too large (at most " + std::to_string(1 << 24) + ")");
  if (v == 1) {
    Schedule s = generate_1f1b(p, m);
    s.name = "interleaved";
    return s;
  }
  if (m % p != 0) {
    const int lower = (m / p) * p, upper = lower + p;
    throw ScheduleError("interleaved 1F1B needs the micro-batch count to be a multiple of p=" +
                        std::to_string(p) + "; m=" + std::to_string(m) + " is not (try m=" +
                        (lower > 0 ? std::to_string(lower) + " or m=" : std::string()) +
                        std::to_string(upper) + ")");
  }
  Schedule s = empty_schedule("interleaved", p, m, v, Layout::kLooped);
  const int total = m * v;
  // Megatron-LM: the k-th forward (backward) of every rank works on the same virtual
  // micro-batch; groups of p micro-batches run through chunk 0, then chunk 1, ...
  auto chunk_of = [&](int k, bool fwd) {
    const int c = (k % (p * v)) / p;
    return fwd ? c : v - 1 - c;
  };
  auto mb_of = [&](int k) { return (k / (p * v)) * p + k % p; };
  for (int r = 0; r < p; ++r) {
    auto& list = s.ranks[r];
    auto F = [&](int k) {
      list.push_back(forward(s.placement.stage_of(r, chunk_of(k, true)), mb_of(k)));
    };
    auto B = [&](int k) {
      list.push_back(backward(s.placement.stage_of(r, chunk_of(k, false)), mb_of(k)));
    };
    const int warmup = std::min((p - r - 1) * 2 + (v - 1) * p, total);
    for (int k = 0; k < warmup; ++k) F(k);
    for (int i = 0; i < total - warmup; ++i) {
      F(warmup + i);
      B(i);
    }
    for (int k = total - warmup; k < total; ++k) B(k);
  }
  insert_transfers(&s);
  return s;
}

namespace {

struct Zbh1Order {
  std::vector<std::vector<Action>> ranks;
  double makespan = 0;
};

// Event-driven list scheduling of ZB-H1 under the given costs (free transfers). A free rank
// takes I before F (I unblocks the upstream rank), or, with `forward_first`, F before I on
// every rank but the last (F feeds the downstream rank, which may have nothing else to do);
// then a deferred W; with nothing available it waits for the next completion anywhere.
Zbh1Order zbh1_list_order(int p, int m, double f, double i, double w, bool forward_first) {
  Zbh1Order order{std::vector<std::vector<Action>>(p), 0};
  constexpr double kNotYet = -1;
  std::vector<std::vector<double>> f_end(p, std::vector<double>(m, kNotYet));
  std::vector<std::vector<double>> i_end(p, std::vector<double>(m, kNotYet));
  std::vector<int> next_f(p, 0), next_i(p, 0), next_w(p, 0);
  std::vector<double> free_at(p, 0);
  std::vector<double> ends;  // completion times, for waiting
  std::vector<int> waiting;
  auto done_by = [](double end, double t) { return end != kNotYet && end <= t; };
  auto finished = [&](int r) { return next_w[r] == m; };
  for (;;) {
    double t = -1;
    for (int r = 0; r < p; ++r)
      if (!finished(r) && (t < 0 || free_at[r] < t)) t = free_at[r];
    if (t < 0) break;
    bool acted = false;
    for (int r = 0; r < p; ++r) {
      if (finished(r) || free_at[r] > t) continue;
      auto& list = order.ranks[r];
      // Micro-batches between F and W. The smallest cap found (p <= 16, m <= 64) that still
      // reaches the closed-form bubble; the deferred W's hold only the part of the
      // activations the weight gradient needs.
      const int held_cap = p + (p - r + 1) / 2;
      const int nf = next_f[r], ni = next_i[r], nw = next_w[r];
      const bool can_i =
          ni < nf && done_by(f_end[r][ni], t) && (r == p - 1 || done_by(i_end[r + 1][ni], t));
      const bool can_f = nf < m && (r == 0 || done_by(f_end[r - 1][nf], t)) && nf - ni < p - r &&
                         nf - nw < held_cap;
      const bool can_w = nw < ni && done_by(i_end[r][nw], t);
      const bool f_before_i = forward_first && r < p - 1;
      if (can_i && !(can_f && f_before_i)) {
        list.push_back(backward_input(r, ni));
        i_end[r][ni] = free_at[r] = t + i;
        ++next_i[r];
      } else if (can_f) {
        list.push_back(forward(r, nf));
        f_end[r][nf] = free_at[r] = t + f;
        ++next_f[r];
      } else if (can_w) {
        list.push_back(backward_weight(r, nw));
        free_at[r] = t + w;
        ++next_w[r];
      } else {
        waiting.push_back(r);
        continue;
      }
      ends.push_back(free_at[r]);
      acted = true;
    }
    // Ranks with nothing to do wait for the next completion anywhere.
    if (!waiting.empty()) {
      double next = -1;
      for (double e : ends)
        if (e > t && (next < 0 || e < next)) next = e;
      // A cost too small to change t (1 after 1e16) or an infinite one ends a pass at t itself:
      // what it made ready can run at t, after this round, as a later pass would.
      if (next < 0 && acted) next = t;
      if (next < 0) throw ScheduleError("internal error: zbh1 list scheduling is stuck");
      for (int r : waiting) free_at[r] = next;
      waiting.clear();
    }
    // Keep only completions that can still wake a rank.
    std::erase_if(ends, [&](double e) { return e <= t; });
  }
  for (double end : free_at) order.makespan = std::max(order.makespan, end);
  return order;
}

}  // namespace

Schedule generate_zbh1(int p, int m, double f, double i, double w) {
  check_common("zbh1", p, m);
  if (!(f > 0 && i > 0 && w > 0))
    throw ScheduleError("zbh1 needs positive F, I and W costs to order the passes");
  Schedule s = empty_schedule("zbh1", p, m, 1, Layout::kLooped);
  // Neither priority is best for all costs: I first keeps a rank's upstream busy, but when I
  // is dearer than F it starves the downstream ranks of forwards (p=4, m=8, F=1 I=2 W=1 idles
  // 8 per rank instead of (p-1)(F+I-W) = 6). Both orders are cheap, so keep the shorter one;
  // on a tie I first, which is the order the unit costs of generate() have always given.
  Zbh1Order order = zbh1_list_order(p, m, f, i, w, /*forward_first=*/false);
  Zbh1Order other = zbh1_list_order(p, m, f, i, w, /*forward_first=*/true);
  if (other.makespan < order.makespan) order = std::move(other);
  s.ranks = std::move(order.ranks);
  insert_transfers(&s);
  return s;
}

Schedule generate_zbv(int p, int m) {
  check_common("zbv", p, m);
  Schedule s = empty_schedule("zbv", p, m, 2, Layout::kVShape);
  // ZB-V (Qi et al. 2023, section 6), in the formulation of PyTorch's ScheduleZBVZeroBubble:
  // rank r holds stage r (chunk 0) and stage 2p-1-r (chunk 1). It is laid out for
  // max(m, 2p-1) micro-batches and the ones beyond m are dropped, which keeps every
  // dependency order intact.
  const int n = std::max(m, 2 * p - 1);
  for (int r = 0; r < p; ++r) {
    auto& list = s.ranks[r];
    const int s0 = s.placement.stage_of(r, 0), s1 = s.placement.stage_of(r, 1);
    int f0 = 0, f1 = 0, b0 = 0, b1 = 0;  // next F and I per chunk
    auto add = [&](Action a) {
      if (a.microbatch < m) list.push_back(a);
    };
    auto F0 = [&] { add(forward(s0, f0++)); };
    auto F1 = [&] { add(forward(s1, f1++)); };
    auto IW0 = [&] { add(backward_input(s0, b0)), add(backward_weight(s0, b0)), ++b0; };
    auto IW1 = [&] { add(backward_input(s1, b1)), add(backward_weight(s1, b1)), ++b1; };
    // Warm-up: chunk-0 forwards, then alternate chunks, then chunk 1 runs F, I, W.
    for (int k = 0; k < 2 * (p - r) - 1; ++k) F0();
    for (int k = 0; k < r; ++k) F1(), F0();
    for (int k = 0; k < p - r; ++k) F1(), IW1();
    // Steady state: F0 I0 W0 F1 I1 W1 until every forward is done.
    while (f1 < f0 || f0 < n) {
      if (f0 < n) F0();
      IW0();
      F1();
      IW1();
    }
    // Cool-down: the remaining I's, with W's filling the gaps, W's in ascending order.
    int w0 = b0, w1 = b1;
    for (int k = 0; k < r; ++k) add(backward_input(s0, b0++)), add(backward_input(s1, b1++));
    for (int k = 0; k < p - r; ++k) add(backward_input(s0, b0++)), add(backward_weight(s0, w0++));
    while (w1 < b1) add(backward_weight(s1, w1++));
    while (w0 < b0) add(backward_weight(s0, w0++));
  }
  insert_transfers(&s);
  return s;
}

namespace {

// Whether the receives from `src` in `list` are exactly the messages `sent`, in that order:
// then reordering them into the send order would give the list back unchanged.
bool receives_in_send_order(const std::vector<Action>& list, int src,
                            const std::vector<MessageKey>& sent) {
  size_t next = 0;
  for (const Action& a : list) {
    if (!is_recv(a.kind) || a.peer != src) continue;
    if (next == sent.size() || message_key(a) != sent[next]) return false;
    ++next;
  }
  return next == sent.size();
}

}  // namespace

void insert_transfers(Schedule* schedule) {
  const Placement& pl = schedule->placement;
  const int S = pl.num_stages();
  const int R = static_cast<int>(schedule->ranks.size());
  for (int r = 0; r < R; ++r) {
    std::vector<Action> out;
    for (const auto& a : schedule->ranks[r]) {
      if (is_transfer(a.kind)) continue;  // regenerate all transfers
      if (is_reduce(a.kind)) {
        out.push_back(a);
        continue;
      }
      const int s = a.stage, k = a.microbatch;
      const bool has_prev = s > 0 && pl.rank_of(s - 1) != r;
      const bool has_next = s + 1 < S && pl.rank_of(s + 1) != r;
      if (a.kind == ActionKind::kForward) {
        if (has_prev) out.push_back({ActionKind::kRecvAct, s, k, pl.rank_of(s - 1)});
        out.push_back(a);
        if (has_next) out.push_back({ActionKind::kSendAct, s, k, pl.rank_of(s + 1)});
      } else if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) {
        if (has_next) out.push_back({ActionKind::kRecvGrad, s, k, pl.rank_of(s + 1)});
        out.push_back(a);
        if (has_prev) out.push_back({ActionKind::kSendGrad, s, k, pl.rank_of(s - 1)});
      } else {
        out.push_back(a);
      }
    }
    schedule->ranks[r] = std::move(out);
  }
  // FIFO per link: reorder each rank's receives from one peer into the peer's send order,
  // moving a receive earlier (never later than its consumer). The messages of each existing
  // link, kept per link (a table of every pair of ranks would grow with R^2), and visited
  // by destination, then source in ascending order.
  struct Link {
    int src;
    std::vector<MessageKey> sent;
  };
  std::vector<std::vector<Link>> into(R);
  for (int src = 0; src < R; ++src)
    for (const auto& a : schedule->ranks[src]) {
      if (!is_send(a.kind) || a.peer == src || a.peer < 0 || a.peer >= R) continue;
      std::vector<Link>& links = into[a.peer];
      if (links.empty() || links.back().src != src) links.push_back({src, {}});
      links.back().sent.push_back(message_key(a));
    }
  for (int dst = 0; dst < R; ++dst) {
    for (const Link& link : into[dst]) {
      const int src = link.src;
      const auto& sent = link.sent;
      if (receives_in_send_order(schedule->ranks[dst], src, sent)) continue;
      std::map<MessageKey, size_t> order;
      for (size_t i = 0; i < sent.size(); ++i) order[sent[i]] = i;
      // Drop this link's receives; remember where each was (its deadline) in the reduced list.
      std::vector<Action> rest;
      std::vector<Action> recvs(sent.size());
      std::vector<size_t> deadline(sent.size(), 0);
      std::vector<bool> present(sent.size(), false);
      for (const auto& a : schedule->ranks[dst]) {
        if (is_recv(a.kind) && a.peer == src) {
          const auto it = order.find(message_key(a));
          if (it != order.end()) {
            recvs[it->second] = a;
            deadline[it->second] = rest.size();
            present[it->second] = true;
            continue;
          }
        }
        rest.push_back(a);
      }
      size_t limit = rest.size();
      for (size_t i = sent.size(); i-- > 0;) {
        if (!present[i]) continue;
        deadline[i] = std::min(deadline[i], limit);
        limit = deadline[i];
      }
      std::vector<Action> merged;
      size_t next = 0;
      for (size_t pos = 0; pos <= rest.size(); ++pos) {
        for (; next < sent.size() && (!present[next] || deadline[next] == pos); ++next)
          if (present[next]) merged.push_back(recvs[next]);
        if (pos < rest.size()) merged.push_back(rest[pos]);
      }
      schedule->ranks[dst] = std::move(merged);
    }
  }
}

}  // namespace conveyor::schedule
