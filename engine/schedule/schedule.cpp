#include "engine/schedule/schedule.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <map>

#include "engine/schedule/input_file.h"

namespace conveyor::schedule {

const char* kind_name(ActionKind kind) {
  switch (kind) {
    case ActionKind::kForward:
      return "F";
    case ActionKind::kBackward:
      return "B";
    case ActionKind::kBackwardInput:
      return "I";
    case ActionKind::kBackwardWeight:
      return "W";
    case ActionKind::kSendAct:
      return "SEND_ACT";
    case ActionKind::kRecvAct:
      return "RECV_ACT";
    case ActionKind::kSendGrad:
      return "SEND_GRAD";
    case ActionKind::kRecvGrad:
      return "RECV_GRAD";
    case ActionKind::kAllReduceGrad:
      return "ALLREDUCE_GRAD";
  }
  return "?";
}

Action forward(int stage, int mb) { return {ActionKind::kForward, stage, mb, -1}; }
Action backward(int stage, int mb) { return {ActionKind::kBackward, stage, mb, -1}; }
Action backward_input(int stage, int mb) { return {ActionKind::kBackwardInput, stage, mb, -1}; }
Action backward_weight(int stage, int mb) { return {ActionKind::kBackwardWeight, stage, mb, -1}; }
Action allreduce_grad(int stage, int bucket) {
  return {ActionKind::kAllReduceGrad, stage, bucket, -1};
}

void throw_not_a_transfer(const Action& a) {
  throw ScheduleError(to_string(a) + " is not a transfer; it carries no message");
}

namespace {
const char* short_name(ActionKind kind) {
  switch (kind) {
    case ActionKind::kSendAct:
      return "SA";
    case ActionKind::kRecvAct:
      return "RA";
    case ActionKind::kSendGrad:
      return "SG";
    case ActionKind::kRecvGrad:
      return "RG";
    case ActionKind::kAllReduceGrad:
      return "AR";
    default:
      return kind_name(kind);
  }
}

bool parse_int(std::string_view text, int* out) {
  if (text.empty()) return false;
  const auto* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, *out);
  return ec == std::errc() && ptr == end && *out >= 0;
}

// Digits alone that do not fit an int: a number, only too large, not a malformed one.
bool past_int(std::string_view text) {
  int ignored = 0;
  const auto* end = text.data() + text.size();
  return !text.empty() && text.find_first_not_of("0123456789") == std::string_view::npos &&
         std::from_chars(text.data(), end, ignored).ec == std::errc::result_out_of_range;
}
}  // namespace

std::string to_string(const Action& a) {
  std::string out = short_name(a.kind);
  // Bucket 0 is written as the stage alone, so a stage of one bucket reads AR2.
  if (is_reduce(a.kind)) {
    out += std::to_string(a.stage);
    if (a.microbatch > 0) out.append(".").append(std::to_string(a.microbatch));
    return out;
  }
  out.append(std::to_string(a.stage)).append(".").append(std::to_string(a.microbatch));
  if (is_send(a.kind)) out.append(">").append(std::to_string(a.peer));
  if (is_recv(a.kind)) out.append("<").append(std::to_string(a.peer));
  return out;
}

Action parse_action(std::string_view token) {
  auto fail = [&](const char* why) {
    return ScheduleError("malformed action '" + message_excerpt(token) + "': " + why +
                         " (expected e.g. F0.3, B0.3, I0.3, W0.3, SA0.3>1, RA1.3<0, SG1.3>0, "
                         "RG0.3<1, AR0, AR0.1)");
  };
  // Said as the header's numbers are: which number, and the largest a file may name.
  auto read = [&](std::string_view text, int* out, const char* field, int max, const char* why) {
    if (parse_int(text, out)) return;
    if (past_int(text))
      throw ScheduleError("action '" + message_excerpt(token) + "': " + field + " " +
                          message_excerpt(text) + " is larger than supported (" +
                          std::to_string(max) + ")");
    throw fail(why);
  };
  static const std::pair<const char*, ActionKind> kPrefixes[] = {
      {"SA", ActionKind::kSendAct},       {"RA", ActionKind::kRecvAct},
      {"SG", ActionKind::kSendGrad},      {"RG", ActionKind::kRecvGrad},
      {"AR", ActionKind::kAllReduceGrad}, {"F", ActionKind::kForward},
      {"B", ActionKind::kBackward},       {"I", ActionKind::kBackwardInput},
      {"W", ActionKind::kBackwardWeight}};
  Action a;
  std::string_view rest;
  bool matched = false;
  for (const auto& [prefix, kind] : kPrefixes) {
    std::string_view p(prefix);
    if (token.substr(0, p.size()) == p) {
      a.kind = kind;
      rest = token.substr(p.size());
      matched = true;
      break;
    }
  }
  if (!matched) throw fail("unknown kind");
  if (is_reduce(a.kind)) {
    const auto dot = rest.find('.');
    const char* why = "an all-reduce names its stage and maybe its bucket, as in AR2 or AR2.1";
    read(rest.substr(0, dot), &a.stage, "stage", kMaxFileStage, why);
    if (dot != std::string_view::npos)
      read(rest.substr(dot + 1), &a.microbatch, "bucket", kMaxFileMicrobatch, why);
    return a;
  }
  if (is_transfer(a.kind)) {
    const char sep = is_send(a.kind) ? '>' : '<';
    const auto at = rest.find(sep);
    if (at == std::string_view::npos)
      throw fail(is_send(a.kind) ? "a send needs '>peer'" : "a receive needs '<peer'");
    read(rest.substr(at + 1), &a.peer, "peer rank", kMaxFileRank, "bad peer rank");
    rest = rest.substr(0, at);
  }
  const auto dot = rest.find('.');
  if (dot == std::string_view::npos) throw fail("missing '.' between stage and micro-batch");
  read(rest.substr(0, dot), &a.stage, "stage", kMaxFileStage, "bad stage");
  read(rest.substr(dot + 1), &a.microbatch, "micro-batch", kMaxFileMicrobatch, "bad micro-batch");
  return a;
}

const char* layout_name(Layout layout) { return layout == Layout::kLooped ? "looped" : "v"; }

int Placement::stage_of(int rank, int chunk) const {
  const bool reversed = layout == Layout::kVShape && chunk % 2 == 1;
  return chunk * num_ranks + (reversed ? num_ranks - 1 - rank : rank);
}

std::vector<int> Placement::stages_of(int rank) const {
  std::vector<int> out;
  for (int c = 0; c < chunks; ++c) out.push_back(stage_of(rank, c));
  return out;
}

void add_gradient_all_reduces(Schedule* schedule, int replicas, const std::vector<int>& buckets) {
  if (replicas < 1)
    throw ScheduleError("data parallelism needs at least 1 replica, got " +
                        std::to_string(replicas));
  const int stages = schedule->num_stages();
  if (buckets.size() > 1 && static_cast<int>(buckets.size()) != stages)
    throw ScheduleError("gradient buckets are given for " + std::to_string(buckets.size()) +
                        " stages, the schedule has " + std::to_string(stages));
  for (int k : buckets)
    if (k < 1)
      throw ScheduleError("a stage needs at least 1 gradient bucket, got " + std::to_string(k));
  auto buckets_of = [&](int stage) {
    return buckets.empty() ? 1 : buckets[buckets.size() == 1 ? 0 : stage];
  };
  schedule->replicas = replicas;
  for (auto& list : schedule->ranks) {
    std::erase_if(list, [](const Action& a) { return is_reduce(a.kind); });
    if (replicas == 1) continue;
    // Right after the last weight-gradient action of each stage: the earliest point at which
    // the stage's gradients are final.
    std::map<int, size_t> last;
    for (size_t i = 0; i < list.size(); ++i)
      if (is_weight_grad(list[i].kind)) last[list[i].stage] = i;
    std::vector<Action> out;
    out.reserve(list.size() + last.size());
    for (size_t i = 0; i < list.size(); ++i) {
      out.push_back(list[i]);
      if (is_weight_grad(list[i].kind) && last[list[i].stage] == i)
        for (int b = 0; b < buckets_of(list[i].stage); ++b)
          out.push_back(allreduce_grad(list[i].stage, b));
    }
    list = std::move(out);
  }
}

int gradient_buckets(const Schedule& schedule, int stage) {
  int count = 0;
  for (const auto& list : schedule.ranks)
    for (const Action& a : list) count += is_reduce(a.kind) && a.stage == stage;
  return count;
}

int gradient_bucket_count(double gradient_bytes, double bucket_bytes) {
  if (!(bucket_bytes > 0) || !(gradient_bytes > bucket_bytes)) return 1;
  const double elements = std::floor(gradient_bytes / 4.0);
  const double count = std::min({std::ceil(gradient_bytes / bucket_bytes), elements,
                                 static_cast<double>(std::numeric_limits<int>::max())});
  return std::max(1, static_cast<int>(count));
}

BucketRange gradient_bucket(size_t elements, int bucket, int buckets) {
  const auto k = static_cast<size_t>(buckets), b = static_cast<size_t>(bucket);
  return {elements * b / k, elements * (b + 1) / k};
}

bool Schedule::splits_backward() const {
  for (const auto& list : ranks)
    for (const auto& a : list)
      if (a.kind == ActionKind::kBackwardInput || a.kind == ActionKind::kBackwardWeight)
        return true;
  return false;
}

ActionRef find_action(const Schedule& schedule, ActionKind kind, int stage, int mb) {
  for (int r = 0; r < static_cast<int>(schedule.ranks.size()); ++r) {
    const auto& list = schedule.ranks[r];
    for (int i = 0; i < static_cast<int>(list.size()); ++i)
      if (list[i].kind == kind && list[i].stage == stage && list[i].microbatch == mb) return {r, i};
  }
  return {};
}

int last_activation_use(const Schedule& schedule, int stage, int mb) {
  const int rank = schedule.placement.rank_of(stage);
  if (rank >= static_cast<int>(schedule.ranks.size())) return -1;
  const auto& list = schedule.ranks[rank];
  int last = -1;
  for (int i = 0; i < static_cast<int>(list.size()); ++i) {
    const auto& a = list[i];
    if (a.stage == stage && a.microbatch == mb &&
        (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput ||
         a.kind == ActionKind::kBackwardWeight))
      last = i;
  }
  return last;
}

std::vector<InFlight> in_flight_per_rank(const Schedule& schedule,
                                         const std::vector<double>& activation_bytes) {
  auto bytes_of = [&](int stage) {
    if (activation_bytes.empty()) return 0.0;
    if (activation_bytes.size() == 1) return activation_bytes[0];
    return stage < static_cast<int>(activation_bytes.size()) ? activation_bytes[stage] : 0.0;
  };
  const Placement& pl = schedule.placement;
  const int chunks = std::max(pl.chunks, 1), mbs = std::max(schedule.num_microbatches, 1);
  std::vector<InFlight> out(schedule.ranks.size());
  std::vector<int> last_use;  // per (chunk, mb) of the rank: position of its B or W
  for (size_t r = 0; r < schedule.ranks.size(); ++r) {
    const auto& list = schedule.ranks[r];
    auto slot = [&](const Action& a) -> int* {
      const int chunk = a.stage / std::max(pl.num_ranks, 1);
      if (a.stage < 0 || chunk >= chunks || a.microbatch < 0 || a.microbatch >= mbs) return nullptr;
      return &last_use[static_cast<size_t>(chunk) * mbs + a.microbatch];
    };
    // Index of the last use of each (stage, mb) held on this rank: B or W (I when no W).
    // Only computes hold activations: transfers (half the list) are skipped before the slot's
    // division.
    last_use.assign(static_cast<size_t>(chunks) * mbs, -1);
    for (int i = 0; i < static_cast<int>(list.size()); ++i) {
      const auto k = list[i].kind;
      if (k != ActionKind::kBackward && k != ActionKind::kBackwardWeight &&
          k != ActionKind::kBackwardInput)
        continue;
      int* last = slot(list[i]);
      if (last && (k != ActionKind::kBackwardInput || *last < 0)) *last = i;
    }
    int in_flight = 0, held = 0;
    double in_flight_bytes = 0, held_bytes = 0;
    InFlight& o = out[r];
    for (int i = 0; i < static_cast<int>(list.size()); ++i) {
      const auto& a = list[i];
      if (!is_compute(a.kind)) continue;
      const double b = bytes_of(a.stage);
      if (a.kind == ActionKind::kForward) {
        ++in_flight, ++held, in_flight_bytes += b, held_bytes += b;
        o.peak_in_flight = std::max(o.peak_in_flight, in_flight);
        o.peak_held = std::max(o.peak_held, held);
        o.peak_in_flight_bytes = std::max(o.peak_in_flight_bytes, in_flight_bytes);
        o.peak_held_bytes = std::max(o.peak_held_bytes, held_bytes);
        continue;
      }
      if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput)
        --in_flight, in_flight_bytes -= b;
      const int* last = slot(a);
      if (last && *last == i) --held, held_bytes -= b;
    }
  }
  return out;
}

bool weight_grads_ascending(const Schedule& schedule, std::string* why) {
  std::map<int, int> last_mb;  // stage -> last micro-batch whose weight gradient was applied
  for (size_t r = 0; r < schedule.ranks.size(); ++r)
    for (const auto& a : schedule.ranks[r]) {
      if (a.kind != ActionKind::kBackward && a.kind != ActionKind::kBackwardWeight) continue;
      auto it = last_mb.find(a.stage);
      if (it != last_mb.end() && a.microbatch < it->second) {
        if (why)
          *why = "rank " + std::to_string(r) + ": " + to_string(a) + " comes after micro-batch " +
                 std::to_string(it->second) + " of stage " + std::to_string(a.stage);
        return false;
      }
      last_mb[a.stage] = a.microbatch;
    }
  return true;
}

}  // namespace conveyor::schedule
