// `conveyor schedule`: generate or load a pipeline schedule, validate it, simulate it under a
// cost model, print the timeline and statistics, and write SVG, Chrome trace or text/CSV.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/schedule/ascii.h"
#include "engine/schedule/chrome_trace.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/simulator.h"
#include "engine/schedule/svg.h"
#include "engine/schedule/text_format.h"
#include "engine/schedule/validator.h"
#include "tools/cli_common.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"
#include "tools/output_file.h"

namespace conveyor::cli {
namespace {

namespace sc = conveyor::schedule;

struct ScheduleOptions {
  std::string kind = "1f1b";
  int stages = 0;
  int microbatches = 0;
  int chunks = 0;  // 0: 1, or 2 for interleaved
  std::string costs = "1,1,1";
  int dp = 1;                   // data-parallel replicas
  double grad_bytes = 1.0;      // one rank's share of the gradients, all-reduced per step
  double reduce_bandwidth = 1;  // bytes per time unit of the all-reduce
  std::string svg, trace, dump, load;
  bool compare = false;
  int timeline_columns = 160;  // the printed timeline is scaled to fit
};

struct Costs {
  double f = 1, i = 1, w = 1, comm = 0;
};

Costs parse_costs(const std::string& text) {
  std::vector<double> values;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    // Plain decimal, as every number flag: stod took spaces around it and hex (0x10).
    double value = 0.0;
    try {
      value = parse_float(item, "--costs", 0.0, std::numeric_limits<double>::max());
    } catch (const UsageError&) {
      throw UsageError("--costs expects non-negative numbers F,I,W[,comm], got '" +
                       escaped_for_message(text) + "'");
    }
    values.push_back(refuse_vanishing(value, item, "--costs", true));
  }
  // getline drops an empty last item: "1,1,1," would read as "1,1,1".
  if (!text.empty() && text.back() == ',')
    throw UsageError("--costs expects non-negative numbers F,I,W[,comm], got '" +
                     escaped_for_message(text) + "'");
  if (values.size() != 3 && values.size() != 4)
    throw UsageError(
        "--costs expects 3 or 4 numbers F,I,W[,comm] (forward, input-gradient and "
        "weight-gradient time per micro-batch on one rank, transfer time), got '" +
        escaped_for_message(text) + "'");
  if (values[0] + values[1] + values[2] <= 0)
    throw UsageError("--costs: F + I + W must be positive");
  return {values[0], values[1], values[2], values.size() == 4 ? values[3] : 0.0};
}

std::string fmt(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// `v`, a time of a simulation whose makespan is `makespan` over `actions` actions, in at most
// 6 significant digits and none finer than the makespan holds: each action's end rounds to
// the makespan's last bit, so with costs 1e13 apart an idle time of 6.6 read 6.60156.
std::string fmt_time(double v, double makespan, size_t actions) {
  const double resolution =
      static_cast<double>(actions) * (std::nextafter(makespan, HUGE_VAL) - makespan);
  if (v == 0 || !(resolution > 0)) return fmt(v);
  const int digits = static_cast<int>(std::floor(std::log10(std::fabs(v)))) + 1 +
                     static_cast<int>(std::ceil(-std::log10(resolution)));
  if (digits < 1) return "0";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*g", std::min(digits, 6), v);
  return buf;
}

// The closed-form bubble for this kind and these costs where docs/schedules.md has one.
std::string closed_form(const std::string& kind, int p, int m, int v, const Costs& c) {
  if (c.comm != 0) return "";
  auto ratio = [](long num, long den) {
    const long g = std::gcd(num, den);
    char buf[96];
    std::snprintf(buf, sizeof buf, "%ld/%ld = %.4f", num / (g ? g : 1), den / (g ? g : 1),
                  den ? static_cast<double>(num) / den : 0.0);
    return std::string(buf);
  };
  if (kind == "gpipe" || kind == "1f1b") return "(p-1)/(m+p-1) = " + ratio(p - 1, m + p - 1);
  if (kind == "interleaved" && m % p == 0)
    return "(p-1)/(v*m+p-1) = " + ratio(p - 1, static_cast<long>(v) * m + p - 1);
  if (kind == "zbh1" && c.f == c.i && c.i == c.w && m >= p)
    return "(p-1)/(3m+p-1) at F=I=W = " + ratio(p - 1, 3L * m + p - 1);
  if (kind == "zbv" && c.f == c.i && c.i == c.w && m >= 2 * p - 1)
    return "(p-1)/(6m+p-1) at F=I=W = " + ratio(p - 1, 6L * m + p - 1);
  return "";
}

// --costs are for one rank's share of the model; with v chunks per rank each chunk (virtual
// stage) costs 1/v of it, so schedules with different v compare fairly.
sc::CostModel cost_model(const Costs& c, int chunks, const ScheduleOptions& o) {
  const double v = chunks > 0 ? chunks : 1;
  sc::CostModel model = sc::CostModel::uniform(c.f / v, c.i / v, c.w / v, c.comm);
  model.gradient_bytes = {o.grad_bytes / v};
  model.reduce_bandwidth = o.reduce_bandwidth;
  return model;
}

// ZB-H1 places its W passes by list scheduling; give it the costs it will run under.
sc::Schedule make_schedule(sc::ScheduleKind kind, int p, int m, int v, const Costs& c, int dp) {
  if (kind == sc::ScheduleKind::kZBH1 && v == 1 && c.f > 0 && c.i > 0 && c.w > 0) {
    sc::Schedule s = sc::generate_zbh1(p, m, c.f, c.i, c.w);
    if (dp > 1) sc::add_gradient_all_reduces(&s, dp);
    return s;
  }
  return sc::generate(kind, p, m, v, dp);
}

// An output flag's file, opened before any work so that a bad path (a folder, a folder that
// takes no new file) fails at once, and replaced only by the whole text: a run that fails, or
// a full disk, leaves the old file as it was, also when it is the --load file itself.
// "wrote FILE" is printed only for a complete file.
class ScheduleOutput {
 public:
  ScheduleOutput(const std::string& path, const char* flag) {
    if (!path.empty()) file_.emplace(path, flag);
  }
  explicit operator bool() const { return file_.has_value(); }
  void write(const std::string& content) {
    append(content);
    finish();
  }
  // A text too large to hold whole (a trace of a million actions), written as it is made.
  void append(std::string_view piece) { file_->append(piece); }
  void finish() {
    file_->commit();
    std::printf("wrote %s\n", escaped_for_message(file_->path()).c_str());
  }

 private:
  std::optional<ReplacedFile> file_;
};

// Largest p x m x v generated: 1F1B at p = 1024, m = 4096 (25 million actions) generates,
// validates and simulates in a few seconds and about 1 GB; the printed timeline draws the
// first ranks only, and --svg has caps of its own.
constexpr int64_t kMaxScheduleCells = int64_t{1} << 22;
// --trace and --dump write every action: a Chrome trace takes about 240 bytes per action (its
// slice, and half an arrow per transfer), 1.5 GB for 1F1B at a million (stage, micro-batch)
// cells; past that the file would run to many gigabytes. It is written as it is made, so
// memory stays that of the schedule and its simulation.
constexpr int64_t kMaxWrittenCells = int64_t{1} << 20;
// What --dump writes, --load and train --schedule-file read back: a cell has at most 8 actions
// (F, and B or I and W; a send and a receive each way across a link; its stage's all-reduce),
// each a CSV row of at most 45 bytes (rank 1023, step 8388607, ALLREDUCE_GRAD, stage and
// micro-batch 65535, peer 1023, commas and the line end); the text form is shorter.
static_assert(kMaxWrittenCells * 8 * 45 <= sc::kMaxScheduleFileBytes,
              "a schedule --dump writes must load again");

// The widest timeline printed: 64 ranks of it are a few MB of text.
constexpr int kMaxTimelineColumns = 65536;

// Why p x m x `chunks` cells are not generated, or nothing when they are.
std::string past_the_cells_generated(int p, int m, int chunks) {
  const int64_t cells = int64_t{p} * m * chunks;
  if (cells <= kMaxScheduleCells) return "";
  return (chunks > 1 ? "--stages x --microbatches x " + std::to_string(chunks) + " chunks is "
                     : std::string("--stages x --microbatches is ")) +
         std::to_string(cells) + "; at most " + std::to_string(kMaxScheduleCells) +
         " are generated";
}

// Checks p, m and the chunks `v` to generate with, before anything is generated.
void check_pm(const ScheduleOptions& o, int v) {
  // The flags themselves are range-checked as they are parsed: 0 here is a flag left out.
  for (const auto& [flag, value, example] :
       {std::tuple{"--stages (-p)", o.stages, "-p 4"},
        std::tuple{"--microbatches (-m)", o.microbatches, "-m 8"}})
    if (value < 1)
      throw UsageError(std::string(flag) + " is needed to generate a schedule (such as " + example +
                       ")" + (o.compare ? "" : ", or give --load FILE"));
  if (o.chunks < 0)
    throw UsageError("--chunks must be at least 1, got " + std::to_string(o.chunks));
  if (const std::string past = past_the_cells_generated(o.stages, o.microbatches, v); !past.empty())
    throw UsageError(past);
  const int64_t cells = int64_t{o.stages} * o.microbatches * v;
  for (const auto& [flag, file] : {std::pair{"--trace", &o.trace}, std::pair{"--dump", &o.dump}})
    if (!file->empty() && cells > kMaxWrittenCells)
      throw UsageError(std::string(flag) + " writes every action, for at most " +
                       std::to_string(kMaxWrittenCells) +
                       " cells of --stages x --microbatches x chunks; this schedule has " +
                       std::to_string(cells) + " (leave " + flag +
                       " out, or use fewer --stages or --microbatches)");
}

// --grad-bytes and --reduce-bandwidth price the all-reduce of data-parallel replicas: with one
// replica there is none, and they would change nothing without a word (as train refuses
// --bucket-mb without --dp).
// A loaded file (`load`) decides the replicas, and --dp must agree with it: the way out is
// another file, not --dp.
void refuse_reduce_flags_without_replicas(const CLI::App& cmd, int replicas,
                                          const std::string& load = "") {
  if (replicas > 1) return;
  for (const char* flag : {"--grad-bytes", "--reduce-bandwidth"})
    if (cmd.count(flag))
      throw UsageError(
          std::string(flag) + " prices the gradient all-reduce of data-parallel replicas, and " +
          (load.empty()
               ? std::string("this schedule has one replica; give --dp 2 or more, or leave ") +
                     flag + " out"
               : "schedule file " + quoted_file_name(load) + " has one replica; leave " + flag +
                     " out, or load a schedule of several (conveyor schedule --dp 2 "
                     "... --dump FILE writes one)"));
}

// How fast the replicas' all-reduce runs: --reduce-bandwidth 0 prices it at nothing, not at an
// endless 0 bytes a unit.
std::string reduce_rate(const ScheduleOptions& o) {
  return o.reduce_bandwidth > 0 ? "at " + fmt(o.reduce_bandwidth) + " bytes per time unit"
                                : "in no time (--reduce-bandwidth 0: infinite)";
}

void run_compare(const ScheduleOptions& o, const Costs& costs) {
  const int p = o.stages, m = o.microbatches;
  const int v = o.chunks > 1 ? o.chunks : 2;
  // The one-chunk rows decide whether there is a table; a row of several chunks past the
  // cells generated says so in its place.
  check_pm(o, 1);
  std::printf("p=%d rank%s, m=%d micro-batch%s, costs F=%s I=%s W=%s comm=%s", p, p == 1 ? "" : "s",
              m, m == 1 ? "" : "es", fmt(costs.f).c_str(), fmt(costs.i).c_str(),
              fmt(costs.w).c_str(), fmt(costs.comm).c_str());
  if (o.dp > 1)
    std::printf(", %d replicas (each rank's gradients, %s bytes, all-reduced %s)", o.dp,
                fmt(o.grad_bytes).c_str(), reduce_rate(o).c_str());
  std::printf("\n");
  std::printf("%-16s %10s %8s %13s %10s  %s\n", "schedule", "makespan", "bubble", "peak in-flight",
              "peak held", "closed-form bubble");
  for (const auto& [kind, kind_name] : sc::schedule_kinds()) {
    const bool inter = kind == sc::ScheduleKind::kInterleaved;
    std::string name = kind_name;
    if (inter) name += " v=" + std::to_string(v);
    const int chunks = sc::chunks_per_rank(kind, inter ? v : 1);
    if (const std::string past = past_the_cells_generated(p, m, chunks); !past.empty()) {
      std::printf("%-16s n/a: %s\n", name.c_str(), past.c_str());
      continue;
    }
    try {
      const sc::Schedule s = make_schedule(kind, p, m, inter ? v : 1, costs, o.dp);
      const sc::SimResult sim =
          sc::validate_and_simulate(s, cost_model(costs, s.placement.chunks, o));
      int in_flight = 0, held = 0;
      for (const auto& r : sim.ranks)
        in_flight = std::max(in_flight, r.memory.peak_in_flight),
        held = std::max(held, r.memory.peak_held);
      // The closed forms are for one pipeline: the all-reduces of replicas add to its makespan.
      const std::string form = o.dp > 1 ? "" : closed_form(kind_name, p, m, inter ? v : 1, costs);
      std::printf("%-16s %10s %8.4f %13d %10d  %s\n", name.c_str(), fmt(sim.makespan).c_str(),
                  sim.bubble_fraction, in_flight, held, form.c_str());
    } catch (const sc::ScheduleError& e) {
      std::printf("%-16s n/a: %s\n", name.c_str(), e.what());
    }
  }
  std::printf(
      "(with several chunks per rank, in-flight and held count micro-batch x chunk, each "
      "1/v of a rank's activations)\n");
  if (o.dp > 1)
    std::printf(
        "(no closed-form bubble with --dp %d: the closed forms are for one pipeline without the "
        "all-reduces at its end)\n",
        o.dp);
}

// Whether `s` is exactly what its kind's generator makes for its p, m, v and replicas. A file's
// name is only a label that an edited schedule keeps, and the closed form of the schedule it
// was dumped from says nothing about what the edits made of it.
bool is_generated_as_named(const sc::Schedule& s, const Costs& costs) {
  const auto kind = sc::parse_schedule_kind(s.name);
  if (!kind) return false;
  try {
    return make_schedule(*kind, s.num_ranks(), s.num_microbatches, s.placement.chunks, costs,
                         s.replicas) == s;
  } catch (const sc::ScheduleError&) {
    return false;  // a layout the generator refuses, so not one it made
  }
}

// A loaded schedule fixes p, m, v and the kind; flags given next to --load must agree.
void check_load_agrees(const ScheduleOptions& o, const CLI::App& cmd, const sc::Schedule& s) {
  auto disagree = [&](const std::string& flag, const std::string& given, const std::string& has) {
    throw UsageError(flag + " " + given + " disagrees with schedule file '" +
                     escaped_for_message(o.load) + "', which has " + has +
                     "; the file decides, so leave " + flag + " out or make it agree");
  };
  if (cmd.count("--stages") && o.stages != s.num_ranks())
    disagree("--stages", std::to_string(o.stages), std::to_string(s.num_ranks()) + " rank(s)");
  if (cmd.count("--microbatches") && o.microbatches != s.num_microbatches)
    disagree("--microbatches", std::to_string(o.microbatches),
             std::to_string(s.num_microbatches) + " micro-batch(es)");
  if (cmd.count("--chunks") && o.chunks != s.placement.chunks)
    disagree("--chunks", std::to_string(o.chunks),
             std::to_string(s.placement.chunks) + " chunk(s) per rank");
  if (cmd.count("--dp") && o.dp != s.replicas)
    disagree("--dp", std::to_string(o.dp), std::to_string(s.replicas) + " replica(s)");
  if (cmd.count("--kind") && !s.name.empty() && o.kind != s.name)
    disagree("--kind", o.kind, "schedule '" + escaped_for_message(s.name) + "'");
}

void run(const ScheduleOptions& o, const CLI::App& cmd) {
  const Costs costs = parse_costs(o.costs);
  if (o.compare) {
    // The table covers every kind and writes nothing: a flag for one schedule would be ignored.
    for (const char* flag :
         {"--kind", "--load", "--svg", "--trace", "--dump", "--timeline-columns"})
      if (cmd.count(flag))
        throw UsageError(std::string("--compare prints a table of every schedule kind and writes "
                                     "no file; ") +
                         flag + " is for one schedule: leave it out, or leave out --compare");
    // --chunks sets the interleaved row's v there; one chunk would make that row 1F1B's.
    if (cmd.count("--chunks") && o.chunks < 2)
      throw UsageError(
          "--compare takes --chunks as the interleaved row's chunks per rank, 2 or "
          "more (got " +
          std::to_string(o.chunks) + "; with 1 that row is 1f1b's); leave --chunks out for 2");
    refuse_reduce_flags_without_replicas(cmd, o.dp);
    return run_compare(o, costs);
  }
  // Each output flag writes a file of its own: a name given twice would end with the second
  // file over the first and "wrote" printed for both. A device or a FIFO (/dev/null for all)
  // is written in place and keeps nothing to lose, as train's outputs may share one.
  const std::vector<std::pair<const char*, const std::string*>> outputs = {
      {"--dump", &o.dump}, {"--svg", &o.svg}, {"--trace", &o.trace}};
  for (size_t a = 0; a < outputs.size(); ++a)
    for (size_t b = a + 1; b < outputs.size(); ++b) {
      const std::string& x = *outputs[a].second;
      const std::string& y = *outputs[b].second;
      if (x.empty() || y.empty()) continue;
      if (written_in_place(x)) continue;
      if (same_file(x, y))
        throw UsageError(std::string(outputs[a].first) + " and " + outputs[b].first +
                         " both name '" + escaped_for_message(y) +
                         "'; each writes a file of its own, so give each its own name");
    }
  // A picture or a trace over the --load file would replace the schedule by something that
  // does not load again; --dump over it writes the same schedule back and is allowed.
  for (const auto& [flag, path] : {outputs[1], outputs[2]}) {
    if (o.load.empty() || path->empty()) continue;
    if (written_in_place(*path)) continue;
    if (same_file(*path, o.load))
      throw UsageError(std::string(flag) + " file " + quoted_file_name(*path) +
                       " is the file --load reads, which writing it would destroy; give " + flag +
                       " a file of its own");
  }
  ScheduleOutput dump(o.dump, "--dump"), svg_file(o.svg, "--svg"), trace(o.trace, "--trace");
  sc::Schedule schedule;
  sc::SimResult sim;
  try {
    if (!o.load.empty()) {
      schedule = sc::load_schedule(o.load);
      check_load_agrees(o, cmd, schedule);
      try {
        sc::validate(schedule);
      } catch (const sc::ScheduleError& e) {
        throw UsageError("schedule file '" + escaped_for_message(o.load) +
                         "' is not a valid schedule: " + e.what());
      }
    } else {
      const auto kind = sc::parse_schedule_kind(o.kind);
      if (!kind) throw not_one_of("--kind", schedule_choices_text(), o.kind);
      const int v = o.chunks > 0 ? o.chunks : (*kind == sc::ScheduleKind::kInterleaved ? 2 : 1);
      if (o.chunks > 0) check_chunks_flag(*kind, o.chunks);
      check_pm(o, sc::chunks_per_rank(*kind, v));
      schedule = make_schedule(*kind, o.stages, o.microbatches, v, costs, o.dp);
    }
    sim = sc::validate_and_simulate(schedule, cost_model(costs, schedule.placement.chunks, o));
  } catch (const sc::ScheduleError& e) {
    throw UsageError(e.what());
  }
  refuse_reduce_flags_without_replicas(cmd, schedule.replicas, o.load);
  const int p = schedule.num_ranks(), m = schedule.num_microbatches, v = schedule.placement.chunks;
  std::printf("schedule %s: p=%d rank%s, v=%d chunk%s per rank (%s), m=%d micro-batch%s\n",
              schedule.name.empty() ? "(loaded)" : escaped_for_message(schedule.name).c_str(), p,
              p == 1 ? "" : "s", v, v == 1 ? "" : "s", sc::layout_name(schedule.placement.layout),
              m, m == 1 ? "" : "es");
  std::printf("costs: F=%s I=%s W=%s (B=I+W=%s) per rank%s, transfer=%s\n\n", fmt(costs.f).c_str(),
              fmt(costs.i).c_str(), fmt(costs.w).c_str(), fmt(costs.i + costs.w).c_str(),
              v > 1 ? ", each chunk 1/v of it" : "", fmt(costs.comm).c_str());
  if (schedule.replicas > 1) {
    const std::string rate = reduce_rate(o);
    std::printf(
        "data parallel: %d replicas, each rank's gradients (%s bytes) all-reduced %s, on a "
        "stream of their own (rows 'ar')\n\n",
        schedule.replicas, fmt(o.grad_bytes).c_str(), rate.c_str());
  }
  std::printf("%s", sc::format_timeline(schedule, sim, o.timeline_columns).c_str());
  // A scaled picture hides the actions that share a cell: say how to see every one.
  if (const int64_t unscaled = sc::timeline_columns_unscaled(schedule, sim);
      unscaled > o.timeline_columns && unscaled <= kMaxTimelineColumns)
    std::printf("(--timeline-columns %lld draws it unscaled)\n", static_cast<long long>(unscaled));
  std::printf("\n");
  std::printf("makespan: %s\n", fmt(sim.makespan).c_str());
  // The closed forms are for one pipeline; the all-reduces at the end add to its makespan.
  std::string form = schedule.replicas > 1 ? "" : closed_form(schedule.name, p, m, v, costs);
  const bool edited = !form.empty() && !o.load.empty() && !is_generated_as_named(schedule, costs);
  if (edited) form.clear();
  std::printf("bubble: %.4f%s\n", sim.bubble_fraction,
              form.empty() ? "" : ("  (closed form " + form + ")").c_str());
  // The kind is the file's name for its schedule, which may not have been given as a flag; the
  // ZB-H1 generator places W passes by the costs, so a file it made at other costs differs.
  if (edited)
    std::printf(
        "(no closed form: the file's actions are not those the %s generator makes for these p, m "
        "and v%s)\n",
        escaped_for_message(schedule.name).c_str(),
        schedule.name == "zbh1" && v == 1 ? " at F=I=W; it places the W passes by the costs, so a "
                                            "file made at other costs differs"
                                          : "");
  std::printf("\n%-6s %10s %10s %16s %16s\n", "rank", "busy", "idle", "peak in-flight",
              "peak held");
  size_t actions = 0;
  for (const auto& list : schedule.ranks) actions += list.size();
  for (int r = 0; r < p; ++r) {
    const auto& st = sim.ranks[r];
    std::printf("%-6d %10s %10s %16d %16d\n", r, fmt_time(st.busy, sim.makespan, actions).c_str(),
                fmt_time(st.idle, sim.makespan, actions).c_str(), st.memory.peak_in_flight,
                st.memory.peak_held);
  }
  std::printf(
      "(peak in-flight: micro-batches between F and the end of its B or I; held: until its last "
      "use, its W when the backward is split)\n");
  // With v chunks a rank holds up to v entries per micro-batch: 11 on rank 0 of interleaved
  // p=4 m=8 would read as more micro-batches than the step has.
  if (v > 1)
    std::printf(
        "(with %d chunks per rank, in-flight and held count micro-batch x chunk, each 1/%d of a "
        "rank's activations)\n",
        v, v);
  if (schedule.replicas > 1) {
    std::printf("\n%-6s %10s %14s\n", "rank", "all-reduce", "ends at");
    for (int r = 0; r < p; ++r)
      std::printf("%-6d %10s %14s\n", r, fmt(sim.ranks[r].reduce).c_str(),
                  fmt(sim.ranks[r].end).c_str());
  }
  if (dump) {
    const bool csv = o.dump.size() >= 4 && o.dump.substr(o.dump.size() - 4) == ".csv";
    dump.write(csv ? sc::dump_csv(schedule) : sc::dump_text(schedule));
  }
  if (svg_file) {
    sc::SvgOptions svg;
    char title[160];
    const std::string comm = costs.comm != 0 ? " comm=" + fmt(costs.comm) : "";
    std::snprintf(title, sizeof title, "%s: p=%d, m=%d%s, costs F=%s I=%s W=%s%s; bubble %.4f",
                  schedule.name.empty() ? "schedule" : schedule.name.c_str(), p, m,
                  v > 1 ? (", v=" + std::to_string(v)).c_str() : "", fmt(costs.f).c_str(),
                  fmt(costs.i).c_str(), fmt(costs.w).c_str(), comm.c_str(), sim.bubble_fraction);
    svg.title = title;
    // A fixed 30 px per time unit keeps pictures of different schedules comparable.
    if (sim.makespan * 30 <= 1600) svg.px_per_unit = 30;
    svg_file.write(sc::render_svg(schedule, sim, svg));
  }
  if (trace) {
    sc::write_chrome_trace(schedule, sim, /*us_per_unit=*/1000.0,
                           [&](std::string_view piece) { trace.append(piece); });
    trace.finish();
  }
}

}  // namespace

void register_schedule_command(CLI::App& app) {
  auto opts = std::make_shared<ScheduleOptions>();
  CLI::App* cmd = app.add_subcommand(
      "schedule", "Generate or load a pipeline schedule, validate, simulate and draw it");
  cmd->add_option("--kind", opts->kind, "Schedule: " + schedule_choices_text())
      ->capture_default_str();
  add_int_flag(cmd, "--stages,-p", opts->stages, 1, 1024,
               "Pipeline ranks p (stages when --chunks is 1)")
      ->default_str("required unless --load");
  add_int_flag(cmd, "--microbatches,-m", opts->microbatches, 1, 65536, "Micro-batches m per step")
      ->default_str("required unless --load");
  add_int_flag(cmd, "--chunks,-v", opts->chunks, 1, 64,
               "Chunks (virtual stages) per rank, as in `conveyor train`; zbv always has 2; with "
               "--compare, the interleaved row's (2 or more)")
      ->default_str("2 for interleaved, else 1");
  cmd->add_option("--costs", opts->costs,
                  "F,I,W[,comm]: time of forward, input-grad, weight-grad per micro-batch "
                  "on one rank (each of its chunks 1/v of it), and of one transfer")
      ->default_str("1,1,1,0");
  add_int_flag(cmd, "--dp", opts->dp, 1, 1024,
               "Data-parallel replicas D: each stage's gradients are all-reduced after its last "
               "weight gradient (AR actions, on a stream of their own)")
      ->capture_default_str();
  constexpr double kMaxAmount = 1e30;  // bytes and bytes per time unit: finite, printable
  add_float_flag(cmd, "--grad-bytes", opts->grad_bytes, 0.0, kMaxAmount, false,
                 "With --dp: one rank's gradient bytes (each chunk 1/v of it); an all-reduce "
                 "takes bytes / --reduce-bandwidth");
  add_float_flag(cmd, "--reduce-bandwidth", opts->reduce_bandwidth, 0.0, kMaxAmount, false,
                 "With --dp: bytes per time unit of the gradient all-reduce (0: infinite)");
  add_path_flag(cmd, "--svg", opts->svg,
                "Write an SVG timeline to FILE (at most 256 ranks and 20000 boxes drawn)")
      ->type_name("FILE");
  add_path_flag(cmd, "--trace", opts->trace, "Write Chrome-trace JSON (Perfetto) to FILE")
      ->type_name("FILE");
  add_path_flag(cmd, "--dump", opts->dump,
                "Write the schedule to FILE as text (or CSV if the name ends in .csv)")
      ->type_name("FILE");
  add_path_flag(cmd, "--load", opts->load,
                "Read a schedule from FILE (text or CSV, a regular file of at most 512 MiB) "
                "instead of generating one")
      ->type_name("FILE");
  add_int_flag(cmd, "--timeline-columns", opts->timeline_columns, 1, kMaxTimelineColumns,
               "Columns of the printed timeline: a wider one is scaled, several time units a "
               "cell, and a cell where several actions start shows the first, marked +")
      ->capture_default_str();
  add_switch(cmd, "--compare", opts->compare,
             "Print a table of all schedules for these p, m and costs (default off)");
  cmd->footer(std::string("Example: conveyor schedule --kind zbh1 -p 4 -m 8 --svg zbh1.svg\n") +
              exit_status_text("an output file or stdout could not be written"));
  cmd->callback([opts, cmd] { run(*opts, *cmd); });
}

}  // namespace conveyor::cli
