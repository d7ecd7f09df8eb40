#include "engine/schedule/chrome_trace.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <span>
#include <stdexcept>
#include <vector>

#include "engine/schedule/trace_time.h"

namespace conveyor::schedule {
namespace {

// The document's text: appended to one piece, handed to the sink once the piece has grown to
// kTracePieceBytes at the end of an event, so that what is held stays one piece.
class TraceText {
 public:
  explicit TraceText(const TraceSink& sink) : sink_(sink) {
    text_.reserve(kTracePieceBytes + 1024);
  }
  TraceText& raw(std::string_view s) {
    text_.append(s);
    return *this;
  }
  TraceText& integer(int64_t v) {
    char buf[24];
    const auto end = std::to_chars(buf, buf + sizeof buf, v).ptr;
    text_.append(buf, end);
    return *this;
  }
  // The shortest text that reads back as the same double; JSON has no infinity or NaN.
  TraceText& number(double v) {
    if (!std::isfinite(v)) return raw("null");
    char buf[32];
    const auto end = std::to_chars(buf, buf + sizeof buf, v).ptr;
    text_.append(buf, end);
    return *this;
  }
  TraceText& string(std::string_view s) {
    for (const char c : s)
      if (static_cast<unsigned char>(c) >= 0x80) {
        // Not plain ASCII (a loaded schedule's name): nlohmann writes valid UTF-8 as it is
        // and replaces what is not valid with U+FFFD, so the document stays JSON.
        text_ += nlohmann::json(std::string(s))
                     .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
        return *this;
      }
    text_ += '"';
    for (const char c : s) {
      if (c == '"' || c == '\\') {
        text_ += '\\';
        text_ += c;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
        text_ += buf;
      } else {
        text_ += c;
      }
    }
    text_ += '"';
    return *this;
  }
  // A time of the document's grid, as exact text.
  TraceText& time(const TraceGrid& grid, int64_t ticks) {
    grid.append(text_, ticks);
    return *this;
  }
  // An event's process, thread and start: `, "pid": .., "tid": .., "ts": ..`.
  TraceText& placed(int64_t pid, int64_t tid, const TraceGrid& grid, int64_t ts) {
    return raw(", \"pid\": ")
        .integer(pid)
        .raw(", \"tid\": ")
        .integer(tid)
        .raw(", \"ts\": ")
        .time(grid, ts);
  }
  // Starts an event of the traceEvents array: one a line.
  TraceText& event() {
    if (text_.size() >= kTracePieceBytes) flush();
    raw(first_event_ ? "\n{" : ",\n{");
    first_event_ = false;
    return *this;
  }
  void flush() {
    if (text_.empty()) return;
    sink_(text_);
    text_.clear();
  }

 private:
  const TraceSink& sink_;
  std::string text_;
  bool first_event_ = true;
};

std::string number_text(double v) {
  char buf[32];
  return std::string(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
}

// What write_chrome_trace needs of the schedule and timelines, checked before anything is
// written: a timeline for every action, and every message inside the schedule's stages and
// micro-batches (which its flow id is made of), and finite times. Returns the grid that holds
// them all.
TraceGrid check_trace_input(const Schedule& schedule, std::span<const SimResult> replicas,
                            double us_per_unit) {
  if (replicas.empty()) throw std::invalid_argument("a trace needs at least one timeline");
  const size_t R = schedule.ranks.size();
  for (size_t d = 0; d < replicas.size(); ++d) {
    bool fits = replicas[d].timing.size() == R;
    for (size_t r = 0; fits && r < R; ++r)
      fits = replicas[d].timing[r].size() == schedule.ranks[r].size();
    if (!fits)
      throw std::invalid_argument("a trace needs a time for every action: timeline " +
                                  std::to_string(d) + " does not have the schedule's shape");
  }
  const int S = schedule.num_stages(), M = schedule.num_microbatches;
  for (const auto& list : schedule.ranks)
    for (const Action& a : list) {
      if (!is_transfer(a.kind)) continue;
      const MessageKey k = message_key(a);
      if (k.producer_stage < 0 || k.producer_stage >= S || k.microbatch < 0 || k.microbatch >= M)
        throw std::invalid_argument("a trace needs a valid schedule: " + to_string(a) +
                                    " carries a message outside its " + std::to_string(S) +
                                    " stages and " + std::to_string(M) + " micro-batches");
    }
  double largest = 0;
  for (size_t d = 0; d < replicas.size(); ++d)
    for (size_t r = 0; r < R; ++r)
      for (size_t i = 0; i < schedule.ranks[r].size(); ++i) {
        const ActionTiming& t = replicas[d].timing[r][i];
        const double start = t.start * us_per_unit, end = t.end * us_per_unit;
        if (!std::isfinite(start) || !std::isfinite(end))
          throw std::invalid_argument(
              "a trace needs times that are finite numbers of microseconds: " +
              to_string(schedule.ranks[r][i]) + " of rank " + std::to_string(r) + " in timeline " +
              std::to_string(d) + " runs from " + number_text(t.start) + " to " +
              number_text(t.end) + " units of " + number_text(us_per_unit) +
              " us; use smaller costs");
        largest = std::max({largest, std::fabs(start), std::fabs(end)});
      }
  return TraceGrid(largest);
}

void write_trace(const Schedule& schedule, std::span<const SimResult> replicas, double us_per_unit,
                 const TraceSink& sink, const TraceProcesses& processes) {
  const TraceGrid grid = check_trace_input(schedule, replicas, us_per_unit);
  TraceText out(sink);
  out.raw("{\"displayTimeUnit\": \"ms\", \"otherData\": {\"schedule\": ")
      .string(schedule.name)
      .raw(", \"makespan\": ")
      .number(replicas[0].makespan)
      .raw(", \"bubble\": ")
      .number(replicas[0].bubble_fraction)
      .raw("}, \"traceEvents\": [");
  constexpr int kCompute = 0, kSend = 1, kRecv = 2, kReduce = 3;
  const char* thread_names[] = {"compute", "send", "recv"};
  const int R = static_cast<int>(schedule.ranks.size());
  const int D = static_cast<int>(replicas.size());
  // The reduction stream is a thread of its own, named only where the schedule has one. A
  // measured step has several buckets in flight at once, and viewers drop slices that overlap
  // on one thread without nesting (Perfetto does): each all-reduce takes the first of the
  // stream's threads that is free when it starts, "allreduce", "allreduce 2", ...
  std::vector<std::vector<int>> reduce_lanes(static_cast<size_t>(D) * R);
  std::vector<int> lanes(static_cast<size_t>(D) * R, schedule.replicas > 1 ? 1 : 0);
  for (int d = 0; d < D; ++d)
    for (int r = 0; r < R; ++r) {
      const size_t k = static_cast<size_t>(d) * R + r;
      std::vector<double> free_from;  // per lane, when its last all-reduce ends
      for (size_t i = 0; i < schedule.ranks[r].size(); ++i) {
        if (!is_reduce(schedule.ranks[r][i].kind)) continue;
        const ActionTiming& t = replicas[d].timing[r][i];
        size_t lane = 0;
        while (lane < free_from.size() && free_from[lane] > t.start) ++lane;
        if (lane == free_from.size()) free_from.push_back(t.end);
        free_from[lane] = t.end;
        reduce_lanes[k].push_back(static_cast<int>(lane));
      }
      lanes[k] = std::max(lanes[k], static_cast<int>(free_from.size()));
    }
  // Replica d's rank r: d * R + r among the document's processes, numbered from first_pid.
  auto process = [&](int d, int r) { return processes.first_pid + int64_t{d} * R + r; };
  for (int d = 0; d < D; ++d)
    for (int r = 0; r < R; ++r) {
      const int64_t pid = process(d, r);
      const std::string name =
          processes.name_prefix +
          (D > 1 ? "rank " + std::to_string(d * R + r) + " (replica " + std::to_string(d) +
                       ", pipeline rank " + std::to_string(r) + ")"
                 : "rank " + std::to_string(r));
      out.event()
          .raw("\"ph\": \"M\", \"name\": \"process_name\", \"pid\": ")
          .integer(pid)
          .raw(", \"args\": {\"name\": ")
          .string(name)
          .raw("}}");
      out.event()
          .raw("\"ph\": \"M\", \"name\": \"process_sort_index\", \"pid\": ")
          .integer(pid)
          .raw(", \"args\": {\"sort_index\": ")
          .integer(pid)
          .raw("}}");
      if (D > 1)
        out.event()
            .raw("\"ph\": \"M\", \"name\": \"process_labels\", \"pid\": ")
            .integer(pid)
            .raw(", \"args\": {\"labels\": \"replica ")
            .integer(d)
            .raw("\"}}");
      const int reduce_threads = lanes[static_cast<size_t>(d) * R + r];
      for (int t = 0; t < kReduce + reduce_threads; ++t)
        out.event()
            .raw("\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": ")
            .integer(pid)
            .raw(", \"tid\": ")
            .integer(t)
            .raw(", \"args\": {\"name\": ")
            .string(t < kReduce    ? thread_names[t]
                    : t == kReduce ? "allreduce"
                                   : "allreduce " + std::to_string(t - kReduce + 1))
            .raw("}}");
    }
  // Flow ids: one per message (replica, gradient?, producing stage, micro-batch), numbered
  // from those four so that both ends find it with nothing remembered in between. At most
  // replicas x 2 x stages x micro-batches, far inside the 2^53 a viewer reads exactly.
  const int64_t S = schedule.num_stages(), M = schedule.num_microbatches;
  auto message_id = [&](int d, const Action& a) {
    return 1 + int64_t{d} * 2 * S * M + message_index(message_key(a), S, M);
  };
  // Each arrow ends in its receive where its send began, or at the nearer end of the receive.
  // A measured receive is posted ahead of its send, so an arrow to the receive's start would
  // point back in time, and a viewer drops an arrow whose end comes before its start (Perfetto
  // does). In a simulation both begin together (rendezvous): the arrow ends at the start.
  std::vector<double> send_start(static_cast<size_t>(trace_flow_ids(schedule, D)),
                                 std::numeric_limits<double>::quiet_NaN());
  for (int d = 0; d < D; ++d)
    for (int r = 0; r < R; ++r)
      for (size_t i = 0; i < schedule.ranks[r].size(); ++i)
        if (const Action& a = schedule.ranks[r][i]; is_send(a.kind))
          send_start[message_id(d, a) - 1] = replicas[d].timing[r][i].start;
  for (int d = 0; d < D; ++d)
    for (int r = 0; r < R; ++r) {
      size_t reduces = 0;  // of this rank's, so far
      for (size_t i = 0; i < schedule.ranks[r].size(); ++i) {
        const int64_t pid = process(d, r);
        const Action& a = schedule.ranks[r][i];
        const auto& t = replicas[d].timing[r][i];
        const int tid = is_compute(a.kind) ? kCompute
                        : is_reduce(a.kind)
                            ? kReduce + reduce_lanes[static_cast<size_t>(d) * R + r][reduces++]
                        : is_send(a.kind) ? kSend
                                          : kRecv;
        // Start and end each on the grid: a slice that ends where the next begins is
        // written to end there. A zero-cost action lasts 0.
        const int64_t ts = grid.ticks(t.start * us_per_unit);
        const int64_t end = std::max(ts, grid.ticks(t.end * us_per_unit));
        out.event()
            .raw("\"ph\": \"X\", \"name\": ")
            .string(to_string(a))
            .raw(", \"cat\": ")
            .string(kind_name(a.kind))
            .placed(pid, tid, grid, ts)
            .raw(", \"dur\": ")
            .time(grid, end - ts)
            .raw(", \"args\": {\"stage\": ")
            .integer(a.stage);
        if (!is_reduce(a.kind)) out.raw(", \"microbatch\": ").integer(a.microbatch);
        out.raw(", \"position\": ").integer(static_cast<int64_t>(i));
        if (is_transfer(a.kind)) out.raw(", \"peer\": ").integer(process(d, a.peer));
        out.raw("}}");
        if (is_transfer(a.kind)) {
          const bool grad = a.kind == ActionKind::kSendGrad || a.kind == ActionKind::kRecvGrad;
          const int64_t id = message_id(d, a);
          int64_t at = ts;
          if (const double sent = send_start[id - 1]; !is_send(a.kind) && !std::isnan(sent))
            at = std::clamp(grid.ticks(std::min(std::max(t.start, sent), t.end) * us_per_unit), ts,
                            end);
          out.event()
              .raw(is_send(a.kind) ? "\"ph\": \"s\"" : "\"ph\": \"f\", \"bp\": \"e\"")
              .raw(grad ? ", \"name\": \"grad\"" : ", \"name\": \"act\"")
              .raw(", \"cat\": \"transfer\", \"id\": ")
              .integer(processes.first_flow_id + id)
              .placed(pid, tid, grid, at)
              .raw("}");
        }
      }
    }
  out.raw("\n]}\n");
  out.flush();
}

std::string trace_string(const Schedule& schedule, std::span<const SimResult> replicas,
                         double us_per_unit, const TraceProcesses& processes) {
  std::string doc;
  write_trace(
      schedule, replicas, us_per_unit, [&](std::string_view piece) { doc += piece; }, processes);
  return doc;
}

}  // namespace

int64_t trace_flow_ids(const Schedule& schedule, int replicas) {
  return int64_t{replicas} * 2 * schedule.num_stages() * schedule.num_microbatches;
}

void write_chrome_trace(const Schedule& schedule, const SimResult& sim, double us_per_unit,
                        const TraceSink& sink, const TraceProcesses& processes) {
  write_trace(schedule, std::span<const SimResult>(&sim, 1), us_per_unit, sink, processes);
}

void write_chrome_trace(const Schedule& schedule, const std::vector<SimResult>& replicas,
                        double us_per_unit, const TraceSink& sink,
                        const TraceProcesses& processes) {
  write_trace(schedule, replicas, us_per_unit, sink, processes);
}

std::string chrome_trace_json(const Schedule& schedule, const SimResult& sim, double us_per_unit,
                              const TraceProcesses& processes) {
  return trace_string(schedule, std::span<const SimResult>(&sim, 1), us_per_unit, processes);
}

std::string chrome_trace_json(const Schedule& schedule, const std::vector<SimResult>& replicas,
                              double us_per_unit, const TraceProcesses& processes) {
  return trace_string(schedule, replicas, us_per_unit, processes);
}

}  // namespace conveyor::schedule
