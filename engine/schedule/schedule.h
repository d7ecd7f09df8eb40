#pragma once
// Pipeline schedule IR: for each rank, the ordered list of actions it runs.
//
// Stages are virtual: a model cut into num_stages = num_ranks * chunks stages. Stage s
// consumes the activation of stage s-1 and produces the input gradient of stage s-1.
// Transfer actions name the stage on the local side of the link:
//   SEND_ACT(s, mb, peer)  on rank_of(s):   output of F(s) to stage s+1 on `peer`
//   RECV_ACT(s, mb, peer)  on rank_of(s):   input of F(s) from stage s-1 on `peer`
//   SEND_GRAD(s, mb, peer) on rank_of(s):   input gradient of stage s to stage s-1 on `peer`
//   RECV_GRAD(s, mb, peer) on rank_of(s):   output gradient of stage s from stage s+1 on `peer`
// Neighbouring stages on the same rank hand data over locally, without transfer actions.
//
// Data parallelism: a schedule with replicas = D > 1 is run by D copies of the pipeline, each
// on its own micro-batches; every rank's list is the same in every replica. ALLREDUCE_GRAD(s)
// (token AR<s>), on rank_of(s) after every weight-gradient action (B or W) of stage s, sums
// the stage's gradients over the D replicas. It runs on a stream of its own (the reduction
// stream), so it overlaps the backward work that remains. D = 1 schedules have none.
#include <compare>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace conveyor::schedule {

enum class ActionKind : uint8_t {
  kForward,         // F
  kBackward,        // B: full backward (input and weight gradients)
  kBackwardInput,   // I: input-gradient backward
  kBackwardWeight,  // W: weight-gradient backward
  kSendAct,
  kRecvAct,
  kSendGrad,
  kRecvGrad,
  kAllReduceGrad,  // AR: the stage's gradients summed over the data-parallel replicas
};

// Inline: the validator and the simulator ask these of every action, millions of times.
constexpr bool is_compute(ActionKind kind) { return static_cast<int>(kind) <= 3; }
constexpr bool is_send(ActionKind kind) {
  return kind == ActionKind::kSendAct || kind == ActionKind::kSendGrad;
}
constexpr bool is_recv(ActionKind kind) {
  return kind == ActionKind::kRecvAct || kind == ActionKind::kRecvGrad;
}
// A point-to-point transfer between two ranks of one pipeline (it has a peer).
constexpr bool is_transfer(ActionKind kind) { return is_send(kind) || is_recv(kind); }
// The gradient all-reduce across replicas; it has no micro-batch and no peer.
constexpr bool is_reduce(ActionKind kind) { return kind == ActionKind::kAllReduceGrad; }
// A backward that adds to the weight gradients: B, or W when the backward is split.
constexpr bool is_weight_grad(ActionKind kind) {
  return kind == ActionKind::kBackward || kind == ActionKind::kBackwardWeight;
}
// "F", "B", "I", "W", "SEND_ACT", ..., "ALLREDUCE_GRAD"
const char* kind_name(ActionKind kind);

struct Action {
  ActionKind kind = ActionKind::kForward;
  int stage = 0;
  // ALLREDUCE_GRAD covers every micro-batch: there, the bucket of the stage's gradients it
  // sums (0 when the stage's gradients go as one).
  int microbatch = 0;
  int peer = -1;  // the other rank of a transfer; -1 for compute and all-reduce

  bool operator==(const Action&) const = default;
};

Action forward(int stage, int mb);
Action backward(int stage, int mb);
Action backward_input(int stage, int mb);
Action backward_weight(int stage, int mb);
Action allreduce_grad(int stage, int bucket = 0);

// The message a transfer carries, the same at both ends of the link: activation or
// gradient, the stage that produced it, and the micro-batch. SEND_ACT(s) and RECV_ACT(s+1)
// carry {false, s, mb}; SEND_GRAD(s) and RECV_GRAD(s-1) carry {true, s, mb}.
struct MessageKey {
  bool gradient = false;
  int producer_stage = 0;
  int microbatch = 0;
  auto operator<=>(const MessageKey&) const = default;
};
// Inline for the same reason as the kind predicates; throws for a compute action.
[[noreturn]] void throw_not_a_transfer(const Action& action);
inline MessageKey message_key(const Action& a) {
  switch (a.kind) {
    case ActionKind::kSendAct:
      return {false, a.stage, a.microbatch};
    case ActionKind::kRecvAct:
      return {false, a.stage - 1, a.microbatch};
    case ActionKind::kSendGrad:
      return {true, a.stage, a.microbatch};
    case ActionKind::kRecvGrad:
      return {true, a.stage + 1, a.microbatch};
    default:
      throw_not_a_transfer(a);
  }
}

// A message's place among a schedule's 2 x stages x micro-batches messages (activations,
// then gradients), for flat tables that pair a send with its receive; the key must lie
// within `stages` and `microbatches`.
inline int64_t message_index(const MessageKey& k, int64_t stages, int64_t microbatches) {
  return ((k.gradient ? stages : 0) + k.producer_stage) * microbatches + k.microbatch;
}

// Compact token: F0.3, B0.3, I0.3, W0.3 (stage.microbatch); transfers carry the peer:
// SA0.3>1 (send act to rank 1), RA1.3<0 (recv act from rank 0), SG1.3>0, RG0.3<1; the
// all-reduce of stage 2's gradients is AR2.
std::string to_string(const Action& action);
// The largest stage, micro-batch (also all-reduce bucket) and rank a schedule file may name.
inline constexpr int kMaxFileStage = 65535;
inline constexpr int kMaxFileMicrobatch = 1048575;
inline constexpr int kMaxFileRank = 65535;

// Parses one token; throws ScheduleError naming the token on malformed input, and on a number
// past int, naming the limit above.
Action parse_action(std::string_view token);

// Errors in a schedule or its text form: the message says what is wrong and where.
class ScheduleError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

enum class Layout : uint8_t {
  kLooped,  // rank r owns stages r, r+p, r+2p, ...
  kVShape,  // chunk c on rank r: stage c*p + r for even c, c*p + (p-1-r) for odd c
};
const char* layout_name(Layout layout);

struct Placement {
  int num_ranks = 1;
  int chunks = 1;  // stages per rank (v)
  Layout layout = Layout::kLooped;

  int num_stages() const { return num_ranks * chunks; }
  int rank_of(int stage) const {  // inline: asked of every action
    const int chunk = stage / num_ranks, offset = stage % num_ranks;
    return (layout == Layout::kVShape && chunk % 2 == 1) ? num_ranks - 1 - offset : offset;
  }
  int chunk_of(int stage) const { return stage / num_ranks; }
  int stage_of(int rank, int chunk) const;
  std::vector<int> stages_of(int rank) const;  // ascending chunk order
  bool operator==(const Placement&) const = default;
};

// The whole schedule: placement, micro-batch count and one action list per rank.
struct Schedule {
  std::string name;  // e.g. "1f1b"; informational
  Placement placement;
  int num_microbatches = 1;                // per replica
  int replicas = 1;                        // data-parallel copies of the pipeline (D)
  std::vector<std::vector<Action>> ranks;  // ranks[r] is rank r's ordered list

  int num_ranks() const { return placement.num_ranks; }
  int num_stages() const { return placement.num_stages(); }
  // Whether the backward is split into I and W (any I or W action present).
  bool splits_backward() const;
  bool operator==(const Schedule& o) const {
    return placement == o.placement && num_microbatches == o.num_microbatches &&
           replicas == o.replicas && ranks == o.ranks;
  }
};

// Sets schedule->replicas and places one ALLREDUCE_GRAD per stage right after the stage's
// last weight-gradient action (B or W) when replicas > 1; removes any when replicas = 1.
// Throws ScheduleError for replicas < 1.
//
// Buckets: `buckets[s]` ALLREDUCE_GRADs for stage s (size 1: the same for every stage; empty:
// one), buckets 0..k-1 in order, each summing the k-th part of the stage's flattened
// gradients (gradient_bucket): k calls in flight one after the other on the reduction stream
// instead of one message of the whole stage, so staging memory is bounded by a bucket and
// the executor packs the next bucket while one is summed.
void add_gradient_all_reduces(Schedule* schedule, int replicas,
                              const std::vector<int>& buckets = {});

// How many buckets of at most `bucket_bytes` a stage of `gradient_bytes` of f32 gradients is
// all-reduced in: ceil(gradient_bytes / bucket_bytes), at least 1 and at most one per element
// (a bucket sums whole elements); `bucket_bytes` <= 0 means one bucket, as does a stage no
// larger than a bucket.
int gradient_bucket_count(double gradient_bytes, double bucket_bytes);

// How many buckets stage `stage`'s gradients are all-reduced in (its ALLREDUCE_GRADs; 0 with
// one replica).
int gradient_buckets(const Schedule& schedule, int stage);

// Elements [begin, end) of a stage's `elements` flattened gradients that bucket `bucket` of
// `buckets` sums: equal parts, the last ones one element longer where they do not divide.
struct BucketRange {
  size_t begin = 0, end = 0;
};
BucketRange gradient_bucket(size_t elements, int bucket, int buckets);

// Position of an action in its rank's list; {-1, -1} when absent.
struct ActionRef {
  int rank = -1;
  int index = -1;
  bool found() const { return index >= 0; }
};
ActionRef find_action(const Schedule& schedule, ActionKind kind, int stage, int mb);

// The last action on `rank` that reads the activations saved by F(stage, mb): its B, or W
// when the backward is split. Index into schedule.ranks[rank_of(stage)], -1 if absent.
int last_activation_use(const Schedule& schedule, int stage, int mb);

// Micro-batch activations held over a rank's list, counted in list order. "in flight": from
// F to the end of its B or I (the full activations). "held": from F to its last use (B or W).
struct InFlight {
  int peak_in_flight = 0;
  int peak_held = 0;
  double peak_in_flight_bytes = 0;
  double peak_held_bytes = 0;
};
// activation_bytes[s] per stage (size 1 = same for all stages; empty = 0 bytes).
std::vector<InFlight> in_flight_per_rank(const Schedule& schedule,
                                         const std::vector<double>& activation_bytes = {});

// True when, within every stage, weight gradients (B or W) are applied in ascending
// micro-batch order; otherwise fills *why with the first out-of-order pair.
bool weight_grads_ascending(const Schedule& schedule, std::string* why = nullptr);

}  // namespace conveyor::schedule
