// The gradient all-reduce of data parallelism in the schedule IR: generators place one per
// stage after its last weight gradient when D > 1 (and leave D = 1 schedules exactly as they
// were), the text and CSV forms carry it, the validator checks it under its own rule, and the
// simulator runs it on a reduction stream of its own that overlaps the remaining backward.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "engine/schedule/ascii.h"
#include "engine/schedule/chrome_trace.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/measured_timing.h"
#include "engine/schedule/simulator.h"
#include "engine/schedule/svg.h"
#include "engine/schedule/text_format.h"
#include "engine/schedule/validator.h"

namespace conveyor::schedule {
namespace {

constexpr ScheduleKind kAllKinds[] = {ScheduleKind::kGPipe, ScheduleKind::k1F1B,
                                      ScheduleKind::kInterleaved, ScheduleKind::kZBH1,
                                      ScheduleKind::kZBV};

int chunks_for(ScheduleKind kind) {
  return kind == ScheduleKind::kInterleaved || kind == ScheduleKind::kZBV ? 2 : 1;
}

std::string replace(std::string text, const std::string& from, const std::string& to) {
  const auto at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return at == std::string::npos ? text : text.replace(at, from.size(), to);
}

ValidationError rejection(const std::string& text) {
  try {
    validate(parse_text(text));
  } catch (const ValidationError& e) {
    return e;
  }
  ADD_FAILURE() << "accepted:\n" << text;
  return ValidationError("accepted", -1, -1, "none");
}

TEST(DataParallelSchedule, OneAllReducePerStageAfterItsLastWeightGradient) {
  for (ScheduleKind kind : kAllKinds)
    for (int p = 1; p <= 4; ++p)
      for (int m : {2, 4, 8}) {
        const int v = chunks_for(kind);
        if (kind == ScheduleKind::kInterleaved && m % p != 0) continue;
        const Schedule plain = generate(kind, p, m, v);
        const Schedule dp = generate(kind, p, m, v, 3);
        SCOPED_TRACE(std::string(schedule_kind_name(kind)) + " p=" + std::to_string(p) +
                     " m=" + std::to_string(m));
        EXPECT_EQ(plain.replicas, 1);
        EXPECT_EQ(dp.replicas, 3);
        EXPECT_NO_THROW(validate(dp));
        for (int r = 0; r < p; ++r) {
          // Without the all-reduces the lists are those of the single pipeline.
          std::vector<Action> stripped;
          for (const Action& a : dp.ranks[r])
            if (!is_reduce(a.kind)) stripped.push_back(a);
          EXPECT_EQ(stripped, plain.ranks[r]);
          for (int st : dp.placement.stages_of(r)) {
            int reduce_at = -1, reduces = 0, last_grad = -1;
            for (int i = 0; i < static_cast<int>(dp.ranks[r].size()); ++i) {
              const Action& a = dp.ranks[r][i];
              if (a.stage != st) continue;
              if (is_reduce(a.kind)) reduce_at = i, ++reduces;
              if (is_weight_grad(a.kind)) last_grad = i;
            }
            EXPECT_EQ(reduces, 1) << "stage " << st;
            EXPECT_EQ(reduce_at, last_grad + 1) << "stage " << st;
          }
        }
        for (const auto& list : plain.ranks)
          for (const Action& a : list) EXPECT_FALSE(is_reduce(a.kind));
      }
}

TEST(DataParallelSchedule, OneReplicaTextIsUnchanged) {
  const Schedule s = generate(ScheduleKind::k1F1B, 2, 2);
  EXPECT_EQ(dump_text(s),
            "# conveyor schedule: name=1f1b ranks=2 chunks=1 layout=looped microbatches=2\n"
            "r0: F0.0 SA0.0>1 F0.1 SA0.1>1 RG0.0<1 B0.0 RG0.1<1 B0.1\n"
            "r1: RA1.0<0 F1.0 B1.0 SG1.0>0 RA1.1<0 F1.1 B1.1 SG1.1>0\n");
}

TEST(DataParallelSchedule, TextAndCsvRoundTrip) {
  const Schedule s = generate(ScheduleKind::k1F1B, 2, 2, 1, 2);
  const std::string text = dump_text(s);
  EXPECT_EQ(text,
            "# conveyor schedule: name=1f1b ranks=2 chunks=1 layout=looped microbatches=2 "
            "replicas=2\n"
            "r0: F0.0 SA0.0>1 F0.1 SA0.1>1 RG0.0<1 B0.0 RG0.1<1 B0.1 AR0\n"
            "r1: RA1.0<0 F1.0 B1.0 SG1.0>0 RA1.1<0 F1.1 B1.1 AR1 SG1.1>0\n");
  EXPECT_EQ(parse_text(text), s);
  const std::string csv = dump_csv(s);
  EXPECT_NE(csv.find("0,8,ALLREDUCE_GRAD,0,,\n"), std::string::npos) << csv;
  EXPECT_EQ(parse_csv(csv), s);
  for (ScheduleKind kind : kAllKinds) {
    const Schedule g = generate(kind, 3, 6, chunks_for(kind), 4);
    EXPECT_EQ(parse_text(dump_text(g)), g) << schedule_kind_name(kind);
    EXPECT_EQ(parse_csv(dump_csv(g)), g) << schedule_kind_name(kind);
  }
  EXPECT_EQ(to_string(allreduce_grad(12)), "AR12");
  EXPECT_EQ(parse_action("AR12"), allreduce_grad(12));
  // A bucket after the stage: AR1.0 is bucket 0, which reads AR1.
  EXPECT_EQ(parse_action("AR1.0"), allreduce_grad(1));
  EXPECT_EQ(parse_action("AR1.2"), allreduce_grad(1, 2));
  EXPECT_EQ(to_string(allreduce_grad(1, 2)), "AR1.2");
  EXPECT_THROW(parse_action("AR1.x"), ScheduleError);
  EXPECT_THROW(parse_action("AR"), ScheduleError);
  EXPECT_THROW(parse_csv("rank,step,kind,stage,microbatch,peer\n0,0,ALLREDUCE_GRAD,0,x,\n"),
               ScheduleError);
}

constexpr const char* kGood =
    "# conveyor schedule: ranks=2 chunks=1 layout=looped microbatches=2 replicas=2\n"
    "r0: F0.0 SA0.0>1 F0.1 SA0.1>1 RG0.0<1 B0.0 RG0.1<1 B0.1 AR0\n"
    "r1: RA1.0<0 F1.0 B1.0 SG1.0>0 RA1.1<0 F1.1 B1.1 AR1 SG1.1>0\n";

TEST(DataParallelSchedule, ValidatorNamesTheAllReduceRule) {
  EXPECT_NO_THROW(validate(parse_text(kGood)));
  {  // missing
    const auto e = rejection(replace(kGood, " AR1", ""));
    EXPECT_EQ(e.rule(), "allreduce");
    EXPECT_EQ(e.rank(), 1);
    EXPECT_NE(std::string(e.what()).find("stage 1 has no ALLREDUCE_GRAD"), std::string::npos)
        << e.what();
  }
  {  // twice
    const auto e = rejection(replace(kGood, " AR0", " AR0 AR0"));
    EXPECT_EQ(e.rule(), "allreduce");
    EXPECT_EQ(e.index(), 9);
    EXPECT_NE(std::string(e.what()).find("appears twice"), std::string::npos) << e.what();
  }
  {  // before a weight gradient of its stage
    const auto e = rejection(replace(replace(kGood, " AR0", ""), "B0.0", "AR0 B0.0"));
    EXPECT_EQ(e.rule(), "allreduce");
    EXPECT_EQ(e.rank(), 0);
    EXPECT_EQ(e.index(), 5);
    EXPECT_NE(std::string(e.what()).find("comes before B of stage 0 micro-batch 0"),
              std::string::npos)
        << e.what();
  }
  {  // on a schedule of one replica
    const auto e = rejection(replace(kGood, " replicas=2", ""));
    EXPECT_EQ(e.rule(), "allreduce");
    EXPECT_NE(std::string(e.what()).find("one replica"), std::string::npos) << e.what();
  }
  {  // on the wrong rank
    const auto e = rejection(replace(replace(kGood, " AR0", ""), " AR1", " AR1 AR0"));
    EXPECT_EQ(e.rule(), "placement");
  }
  {  // split backward: after W, not after I
    Schedule s = generate(ScheduleKind::kZBH1, 2, 4, 1, 2);
    validate(s);
    auto& list = s.ranks[0];
    int ar = -1, last_w = -1;
    for (int i = 0; i < static_cast<int>(list.size()); ++i) {
      if (is_reduce(list[i].kind)) ar = i;
      if (list[i].kind == ActionKind::kBackwardWeight) last_w = i;
    }
    ASSERT_GT(ar, 0);
    std::swap(list[ar], list[last_w]);
    try {
      validate(s);
      ADD_FAILURE() << "accepted an all-reduce before W";
    } catch (const ValidationError& e) {
      EXPECT_EQ(e.rule(), "allreduce");
      EXPECT_NE(std::string(e.what()).find("comes before W"), std::string::npos) << e.what();
    }
  }
}

TEST(DataParallelSchedule, BucketsGoInOrderAfterTheLastWeightGradient) {
  Schedule s = generate(ScheduleKind::k1F1B, 2, 2, 1, 2);
  add_gradient_all_reduces(&s, 2, {3, 2});
  validate(s);
  EXPECT_EQ(gradient_buckets(s, 0), 3);
  EXPECT_EQ(gradient_buckets(s, 1), 2);
  // Right after B0.1, buckets 0, 1, 2; bucket 0 reads as before.
  const std::string text = dump_text(s);
  EXPECT_NE(text.find("B0.1 AR0 AR0.1 AR0.2"), std::string::npos) << text;
  EXPECT_EQ(parse_text(text), s);
  EXPECT_EQ(parse_csv(dump_csv(s)), s);
  {  // a bucket twice: the first copy's place is named, not that of the stage's bucket 0
    const auto e = rejection(replace(text, "AR0.1 AR0.2", "AR0.1 AR0.1 AR0.2"));
    EXPECT_EQ(e.rule(), "allreduce");
    EXPECT_EQ(e.index(), 10);
    EXPECT_NE(std::string(e.what()).find("stage 0 (bucket 1) appears twice (first at position 9)"),
              std::string::npos)
        << e.what();
  }
  {  // out of order
    const auto e = rejection(replace(text, "AR0 AR0.1", "AR0.1 AR0"));
    EXPECT_EQ(e.rule(), "allreduce");
    EXPECT_NE(std::string(e.what()).find("bucket 1 of the gradient all-reduce of stage 0 comes "
                                         "before bucket 0"),
              std::string::npos)
        << e.what();
  }
  // A bucket left out is named as missing, not as coming later.
  for (const auto& [edit, missing] :
       {std::pair{"AR0.1 AR0.2",
                  "bucket 1 of the gradient all-reduce of stage 0 is there but bucket "
                  "0 is missing; the buckets go in order from 0, each once, so "
                  "bucket 0 comes before it"},
        std::pair{"AR0.2",
                  "bucket 2 of the gradient all-reduce of stage 0 is there but bucket 0 "
                  "is missing; the buckets go in order from 0, each once, so buckets 0 "
                  "to 1 come before it"}}) {
    const auto e = rejection(replace(text, "AR0 AR0.1 AR0.2", edit));
    EXPECT_EQ(e.rule(), "allreduce");
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  // Fewer buckets is another valid schedule: every replica runs the same list.
  EXPECT_NO_THROW(validate(parse_text(replace(text, " AR0.2", ""))));
  EXPECT_THROW(add_gradient_all_reduces(&s, 2, {1, 2, 3}), ScheduleError);
  EXPECT_THROW(add_gradient_all_reduces(&s, 2, {0}), ScheduleError);
  // Equal parts of the flattened gradients, covering them.
  EXPECT_EQ(gradient_bucket(10, 0, 3).begin, 0u);
  EXPECT_EQ(gradient_bucket(10, 0, 3).end, 3u);
  EXPECT_EQ(gradient_bucket(10, 1, 3).end, 6u);
  EXPECT_EQ(gradient_bucket(10, 2, 3).end, 10u);
}

TEST(DataParallelSchedule, BucketCountIsTheStagesBytesOverTheBucketRoundedUp) {
  EXPECT_EQ(gradient_bucket_count(100.0, 0.0), 1);    // 0: one bucket
  EXPECT_EQ(gradient_bucket_count(100.0, 100.0), 1);  // a stage no larger than a bucket
  EXPECT_EQ(gradient_bucket_count(100.0, 1000.0), 1);
  EXPECT_EQ(gradient_bucket_count(101.0, 100.0), 2);
  EXPECT_EQ(gradient_bucket_count(400.0, 100.0), 4);
  EXPECT_EQ(gradient_bucket_count(401.0, 100.0), 5);
  // A bucket sums whole f32 elements: 8 bytes are at most 2 buckets, however small.
  EXPECT_EQ(gradient_bucket_count(8.0, 1.0), 2);
  EXPECT_EQ(gradient_bucket_count(0.0, 1.0), 1);
  EXPECT_EQ(gradient_bucket_count(1e30, 1.0), std::numeric_limits<int>::max());
  EXPECT_EQ(gradient_bucket_count(100.0, std::nan("")), 1);
}

TEST(DataParallelSchedule, SimulatorSplitsAStagesAllReduceOverItsBuckets) {
  // Each bucket costs the latency and its share of the bytes, one after another on the
  // reduction stream: k buckets take k - 1 latencies more than one message.
  Schedule one = generate(ScheduleKind::k1F1B, 2, 2, 1, 2);
  Schedule four = one;
  add_gradient_all_reduces(&four, 2, {4});
  CostModel costs = CostModel::uniform(1, 1, 1);
  costs.gradient_bytes = {80.0};
  costs.reduce_bandwidth = 10.0;
  costs.reduce_latency = 0.5;
  const SimResult a = simulate(one, costs), b = simulate(four, costs);
  for (int r = 0; r < 2; ++r)
    EXPECT_DOUBLE_EQ(b.ranks[r].reduce, a.ranks[r].reduce + 3 * 0.5) << "rank " << r;
  const auto& list = four.ranks[0];
  for (size_t i = 0; i < list.size(); ++i)
    if (is_reduce(list[i].kind))
      EXPECT_DOUBLE_EQ(b.timing[0][i].end - b.timing[0][i].start, 0.5 + 2.0) << i;
}

TEST(DataParallelSchedule, SimulatorOverlapsTheAllReduceWithTheRemainingBackward) {
  // 1F1B p=2, m=2, F=I=W=1 (B=2): rank 1 finishes B1.1 at 7, rank 0 B0.1 at 9.
  const Schedule plain = generate(ScheduleKind::k1F1B, 2, 2);
  const Schedule dp = generate(ScheduleKind::k1F1B, 2, 2, 1, 2);
  CostModel costs = CostModel::uniform(1, 1, 1);
  costs.gradient_bytes = {6.0};
  costs.reduce_bandwidth = 2.0;  // 3 time units per all-reduce
  const SimResult a = simulate(plain, costs);
  const SimResult b = simulate(dp, costs);
  EXPECT_DOUBLE_EQ(a.makespan, 9);
  const ActionRef ar1 = find_action(dp, ActionKind::kAllReduceGrad, 1, 0);
  const ActionRef b11 = find_action(dp, ActionKind::kBackward, 1, 1);
  ASSERT_TRUE(ar1.found() && b11.found());
  const ActionTiming t1 = b.timing[1][ar1.index];
  EXPECT_DOUBLE_EQ(t1.start, b.timing[1][b11.index].end);
  EXPECT_DOUBLE_EQ(t1.end - t1.start, 3.0);
  // Rank 1's all-reduce runs while rank 0 still computes its last backward.
  const ActionRef b01 = find_action(dp, ActionKind::kBackward, 0, 1);
  EXPECT_LT(t1.start, b.timing[0][b01.index].end);
  // Rank 0's comes last: after its last B, adding its own time to the makespan only.
  const ActionRef ar0 = find_action(dp, ActionKind::kAllReduceGrad, 0, 0);
  EXPECT_DOUBLE_EQ(b.timing[0][ar0.index].start, a.makespan);
  EXPECT_DOUBLE_EQ(b.makespan, a.makespan + 3);
  EXPECT_DOUBLE_EQ(b.ranks[0].busy, a.ranks[0].busy);
  EXPECT_DOUBLE_EQ(b.ranks[0].reduce, 3.0);
  // Free all-reduces change nothing.
  const SimResult free = simulate(dp, CostModel::uniform(1, 1, 1));
  EXPECT_DOUBLE_EQ(free.makespan, a.makespan);
  // Computes are timed as without the all-reduces.
  for (int r = 0; r < 2; ++r)
    for (size_t i = 0, j = 0; i < dp.ranks[r].size(); ++i) {
      if (is_reduce(dp.ranks[r][i].kind)) continue;
      EXPECT_DOUBLE_EQ(b.timing[r][i].start, a.timing[r][j].start);
      ++j;
    }
}

TEST(DataParallelSchedule, ReduceStreamIsInOrderWithSeveralChunks) {
  // Interleaved: each rank has two stages, so two all-reduces on one stream.
  const Schedule s = generate(ScheduleKind::kInterleaved, 2, 4, 2, 2);
  CostModel costs = CostModel::uniform(1, 1, 1);
  costs.gradient_bytes = {100.0};
  costs.reduce_bandwidth = 10.0;
  const SimResult sim = simulate(s, costs);
  for (int r = 0; r < 2; ++r) {
    std::vector<ActionTiming> reduces;
    for (size_t i = 0; i < s.ranks[r].size(); ++i)
      if (is_reduce(s.ranks[r][i].kind)) reduces.push_back(sim.timing[r][i]);
    ASSERT_EQ(reduces.size(), 2u);
    EXPECT_DOUBLE_EQ(reduces[0].end - reduces[0].start, 10.0);
    EXPECT_GE(reduces[1].start, reduces[0].end);
    EXPECT_DOUBLE_EQ(sim.ranks[r].reduce, 20.0);
  }
}

TEST(DataParallelSchedule, PicturesShowTheAllReduce) {
  const Schedule dp = generate(ScheduleKind::k1F1B, 2, 2, 1, 2);
  CostModel costs = CostModel::uniform(1, 1, 1);
  costs.gradient_bytes = {2.0};
  costs.reduce_bandwidth = 1.0;
  const SimResult sim = simulate(dp, costs);
  const std::string ascii = format_timeline(dp, sim);
  EXPECT_NE(ascii.find("  ar:"), std::string::npos) << ascii;
  EXPECT_NE(ascii.find("AR0"), std::string::npos) << ascii;
  EXPECT_NE(ascii.find("AR1"), std::string::npos) << ascii;
  const std::string svg = render_svg(dp, sim, {});
  EXPECT_NE(svg.find("AR grad all-reduce"), std::string::npos);
  EXPECT_NE(svg.find("<title>AR1 ["), std::string::npos);
  const std::string trace = chrome_trace_json(dp, sim);
  EXPECT_NE(trace.find("\"allreduce\""), std::string::npos);
  EXPECT_NE(trace.find("\"AR0\""), std::string::npos);
  // One replica: no reduction rows, thread or legend.
  const Schedule plain = generate(ScheduleKind::k1F1B, 2, 2);
  const SimResult plain_sim = simulate(plain, costs);
  EXPECT_EQ(format_timeline(plain, plain_sim).find("ar:"), std::string::npos);
  EXPECT_EQ(chrome_trace_json(plain, plain_sim).find("allreduce"), std::string::npos);
  EXPECT_EQ(render_svg(plain, plain_sim, {}).find("all-reduce"), std::string::npos);
}

TEST(DataParallelSchedule, TraceOfEveryReplicaNamesTheirRanks) {
  // Measured runs draw each replica's ranks as processes of their own, replica d's pipeline
  // rank r as d * P + r, on one clock.
  const Schedule s = generate(ScheduleKind::k1F1B, 2, 2, 1, 2);
  const SimResult sim = simulate(s, CostModel::uniform(1.0, 1.0, 1.0, 0.1));
  std::vector<std::vector<ActionTiming>> world = sim.timing;
  for (const auto& rank : sim.timing) {
    world.push_back(rank);
    for (auto& t : world.back()) t.start += 100, t.end += 100;  // replica 1 starts later
  }
  const auto replicas = summarize_replicas(s, world);
  ASSERT_EQ(replicas.size(), 2u);
  EXPECT_EQ(replica_timeline(s, world, 1)[0][0].start, sim.timing[0][0].start + 100);
  EXPECT_EQ(replicas[1].timing[0][0].start - replicas[0].timing[0][0].start, 100.0);
  const std::string trace = chrome_trace_json(s, replicas, 1.0);
  EXPECT_NE(trace.find("\"rank 3 (replica 1, pipeline rank 1)\""), std::string::npos);
  EXPECT_NE(trace.find("\"rank 1 (replica 0, pipeline rank 1)\""), std::string::npos);
  EXPECT_NE(trace.find("\"pid\": 3"), std::string::npos);
  EXPECT_EQ(trace.find("\"pid\": 4"), std::string::npos);
  // One replica keeps its plain names.
  const std::string one = chrome_trace_json(s, sim, 1.0);
  EXPECT_NE(one.find("\"rank 1\""), std::string::npos);
  EXPECT_EQ(one.find("replica"), std::string::npos);
  EXPECT_THROW(replica_timeline(s, sim.timing, 0), std::invalid_argument);
}

TEST(DataParallelSchedule, RefusesNoReplicas) {
  EXPECT_THROW(generate(ScheduleKind::k1F1B, 2, 2, 1, 0), ScheduleError);
  Schedule s = generate(ScheduleKind::k1F1B, 2, 2);
  EXPECT_THROW(add_gradient_all_reduces(&s, 0), ScheduleError);
  add_gradient_all_reduces(&s, 2);
  add_gradient_all_reduces(&s, 1);  // back to one replica: the all-reduces go
  EXPECT_EQ(s, generate(ScheduleKind::k1F1B, 2, 2));
}

}  // namespace
}  // namespace conveyor::schedule
