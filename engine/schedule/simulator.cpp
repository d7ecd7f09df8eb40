// The cost model, and the two ways of timing a schedule under it: simulate(), one run of the
// stream-run engine (stream_run.h), and Replay, which records one run and then times it again
// under each cost model a search asks about. check_progress runs the engine without times.
#include "engine/schedule/simulator.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "engine/schedule/checked_progress.h"
#include "engine/schedule/stream_run.h"

namespace conveyor::schedule {

using detail::per_stage;
using detail::StreamRun;

CostModel CostModel::uniform(double f, double i, double w, double comm) {
  CostModel c;
  c.forward = {f};
  c.backward_input = {i};
  c.backward_weight = {w};
  c.latency = comm;
  return c;
}

double reduce_bucket_cost(double whole, double latency, int buckets) {
  return buckets > 1 ? latency + (whole - latency) / buckets : whole;
}

double CostModel::cost(const Action& a) const {
  const int s = a.stage;
  switch (a.kind) {
    case ActionKind::kForward:
      return per_stage(forward, s);
    case ActionKind::kBackward:
      return backward.empty() ? per_stage(backward_input, s) + per_stage(backward_weight, s)
                              : per_stage(backward, s);
    case ActionKind::kBackwardInput:
      return per_stage(backward_input, s);
    case ActionKind::kBackwardWeight:
      return per_stage(backward_weight, s);
    case ActionKind::kAllReduceGrad:
      return reduce_latency +
             (reduce_bandwidth > 0 ? per_stage(gradient_bytes, s) / reduce_bandwidth : 0.0);
    default: {
      // The boundary tensor between stage b and b+1 (activation one way, gradient the other).
      const int boundary = (a.kind == ActionKind::kSendAct)    ? s
                           : (a.kind == ActionKind::kRecvAct)  ? s - 1
                           : (a.kind == ActionKind::kSendGrad) ? s - 1
                                                               : s;
      const double bytes = per_stage(message_bytes, boundary);
      return latency + (bandwidth > 0 ? bytes / bandwidth : 0.0);
    }
  }
}

void check_progress(const Schedule& schedule) {
  StreamRun<false>(schedule, nullptr, nullptr).run();
}

void detail::check_progress_of_checked(const Schedule& schedule) {
  StreamRun<false>(schedule, nullptr, nullptr, /*checked=*/true).run();
}

namespace {

// Each rank's idle time and the bubble, from the makespan and the ranks' busy times: what
// simulate() and Replay report alike.
void set_idle_and_bubble(SimResult& result) {
  double total_idle = 0;
  for (auto& st : result.ranks) st.idle = result.makespan - st.busy, total_idle += st.idle;
  // idle / (R * makespan) rather than 1 - busy / (...): one rounding, so integer costs give
  // the correctly rounded closed form.
  const double ranks = static_cast<double>(result.ranks.size());
  result.bubble_fraction = result.makespan > 0 ? total_idle / (ranks * result.makespan) : 0.0;
}

// Every time and size of the model a finite number >= 0: a NaN would pass through max()
// unseen and a negative cost would run time backwards.
void check_costs(const CostModel& c) {
  auto check = [](const char* name, double v, size_t index, bool vector) {
    if (std::isfinite(v) && v >= 0) return;
    char value[32];
    std::snprintf(value, sizeof value, "%g", v);
    throw ScheduleError(std::string("cost model: ") + name +
                        (vector ? "[" + std::to_string(index) + "]" : std::string()) + " is " +
                        value + "; costs, sizes and bandwidths must be finite and >= 0");
  };
  const std::pair<const char*, const std::vector<double>*> vectors[] = {
      {"forward", &c.forward},
      {"backward_input", &c.backward_input},
      {"backward_weight", &c.backward_weight},
      {"backward", &c.backward},
      {"message_bytes", &c.message_bytes},
      {"activation_bytes", &c.activation_bytes},
      {"gradient_bytes", &c.gradient_bytes}};
  for (const auto& [name, values] : vectors)
    for (size_t i = 0; i < values->size(); ++i) check(name, (*values)[i], i, true);
  check("latency", c.latency, 0, false);
  check("bandwidth", c.bandwidth, 0, false);
  check("reduce_latency", c.reduce_latency, 0, false);
  check("reduce_bandwidth", c.reduce_bandwidth, 0, false);
}

}  // namespace

SimResult simulate(const Schedule& schedule, const CostModel& costs) {
  check_costs(costs);
  const int R = static_cast<int>(schedule.ranks.size());
  SimResult result;
  StreamRun<true> run(schedule, &costs, &result.timing);
  run.run();

  // Summary.
  result.ranks.resize(R);
  if (!run.summarize(&result.ranks)) {
    const auto memory = in_flight_per_rank(schedule, costs.activation_bytes);
    for (int r = 0; r < R; ++r) result.ranks[r].memory = memory[r];
  }
  for (int r = 0; r < R; ++r) result.makespan = std::max(result.makespan, result.ranks[r].end);
  // Finite costs can still add up past the largest double (a huge size over a tiny bandwidth).
  if (!std::isfinite(result.makespan))
    throw ScheduleError(
        "the cost model's times overflow: the makespan is not a finite number; use smaller "
        "costs or sizes, or larger bandwidths");
  set_idle_and_bubble(result);
  return result;
}

namespace {
constexpr int kKinds = static_cast<int>(ActionKind::kAllReduceGrad) + 1;
}  // namespace

Replay::Replay(const Schedule& schedule)
    : ranks_(static_cast<int>(schedule.ranks.size())), stages_(schedule.num_stages()) {
  first_.assign(ranks_ + 1, 0);
  for (int r = 0; r < ranks_; ++r)
    first_[r + 1] = first_[r] + static_cast<int>(schedule.ranks[r].size());
  std::vector<std::vector<ActionTiming>> timing;
  const CostModel unit;
  StreamRun<true> recorded(schedule, &unit, &timing, /*checked=*/false, &steps_);
  recorded.run();
  buckets_.assign(std::max(stages_, 0), 0);
  for (const auto& list : schedule.ranks)
    for (const Action& a : list)
      if (is_reduce(a.kind)) ++buckets_[a.stage];
  // The (kind, stage) pairs the steps cost, each once.
  std::vector<int> slot_of(static_cast<size_t>(kKinds) * std::max(stages_, 0), -1);
  for (ReplayStep& s : steps_) {
    int& slot = slot_of[static_cast<size_t>(s.kind) * stages_ + s.stage];
    if (slot < 0)
      slot = static_cast<int>(slots_.size()), slots_.push_back({s.kind, s.stage, 0, -1});
    s.stage = slot;
  }
  per_slot_.assign(slots_.size(), 0.0);
  timing_.assign(first_[ranks_], {0, 0});
  step_of_.assign(first_[ranks_], -1);
  for (size_t i = 0; i < steps_.size(); ++i) {
    step_of_[steps_[i].action] = static_cast<int>(i);
    if (steps_[i].received >= 0) step_of_[steps_[i].received] = static_cast<int>(i);
  }
  busy_.assign(ranks_, 0), reduce_.assign(ranks_, 0), end_.assign(ranks_, 0);
}

double Replay::run(const CostModel& costs) {
  // CostModel::cost reads only the kind and the stage.
  for (size_t k = 0; k < slots_.size(); ++k) {
    const Action& a = slots_[k];
    per_slot_[k] = a.kind == ActionKind::kAllReduceGrad
                       ? reduce_bucket_cost(costs.cost(a), costs.reduce_latency,
                                            std::max(buckets_[a.stage], 1))
                       : costs.cost(a);
  }
  std::fill(busy_.begin(), busy_.end(), 0.0);
  std::fill(reduce_.begin(), reduce_.end(), 0.0);
  std::fill(end_.begin(), end_.end(), 0.0);
  ActionTiming* const t = timing_.data();
  for (const ReplayStep& s : steps_) {
    double start = 0;
    for (int d : s.after)
      if (d >= 0) start = std::max(start, t[d].end);
    const double end = start + per_slot_[s.stage];
    t[s.action] = {start, end};
    end_[s.rank] = std::max(end_[s.rank], end);
    if (s.type == ReplayStep::kCompute) {
      // The cost itself: end - start loses the digits of a short action late in a long run.
      busy_[s.rank] += per_slot_[s.stage];
    } else if (s.type == ReplayStep::kReduce) {
      reduce_[s.rank] += end - start;
    } else {
      t[s.received] = {start, end};
      end_[s.receiver] = std::max(end_[s.receiver], end);
    }
  }
  makespan_ = 0;
  for (int r = 0; r < ranks_; ++r) makespan_ = std::max(makespan_, end_[r]);
  return makespan_;
}

std::vector<Action> Replay::critical_path() const {
  std::vector<Action> path;
  // The steps that end last are recorded last: search from the end.
  int at = -1;
  for (size_t i = steps_.size(); i-- > 0 && at < 0;)
    if (timing_[steps_[i].action].end == makespan_) at = static_cast<int>(i);
  while (at >= 0) {
    const ReplayStep& s = steps_[at];
    path.push_back(slots_[s.stage]);
    // start = max(0, the ends of what the step waited for): the dependency that set it.
    const double start = timing_[s.action].start;
    int before = -1;
    for (int d : s.after)
      if (d >= 0 && timing_[d].end == start) before = d;
    at = start > 0 && before >= 0 ? step_of_[before] : -1;
  }
  std::reverse(path.begin(), path.end());
  return path;
}

SimResult Replay::result() const {
  SimResult out;
  out.timing.resize(ranks_);
  out.ranks.resize(ranks_);
  for (int r = 0; r < ranks_; ++r) {
    out.timing[r].assign(timing_.begin() + first_[r], timing_.begin() + first_[r + 1]);
    out.ranks[r].busy = busy_[r], out.ranks[r].reduce = reduce_[r], out.ranks[r].end = end_[r];
  }
  out.makespan = makespan_;
  set_idle_and_bubble(out);
  return out;
}

}  // namespace conveyor::schedule