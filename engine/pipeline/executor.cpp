#include "engine/pipeline/executor.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "engine/core/number_text.h"
#include "engine/pipeline/rank_step.h"
#include "engine/schedule/measured_timing.h"
#include "engine/schedule/validator.h"

namespace conveyor {
namespace {

using Clock = std::chrono::steady_clock;

// True when `error` is, or was (through std::nested_exception) caused by, a T.
template <class T>
bool is_or_caused_by(const std::exception& error) {
  if (dynamic_cast<const T*>(&error)) return true;
  try {
    std::rethrow_if_nested(error);
  } catch (const T&) {
    return true;
  } catch (...) {
  }
  return false;
}

// The rank was stopped because another failed first: its transport was aborted.
bool stopped_by_abort(const std::exception& error) {
  return is_or_caused_by<comm::TransportAborted>(error);
}

// A transport call failed (a wait that passed its deadline, a lost link, an abort): the ranks'
// positions then say where the run stalled.
bool transport_failure(const std::exception& error) {
  return is_or_caused_by<comm::TransportError>(error);
}

// Where `rank` stands, read after its thread has ended.
RankPosition position_of(const PipelineRank& rank) {
  return {rank.index, rank.pipeline_rank, rank.replica, rank.replica_group, rank.progress};
}

// ZeRO-1 ranges: replica d's piece of every parameter (replica_piece), and per stage the
// bounds of each replica's range in the stage's packing by replica.
std::vector<ParameterShard> shard_parameters(PipelineRank& rank, int replicas) {
  std::vector<ParameterShard> out;
  for (auto& [id, stage] : rank.stages) {
    const std::vector<Parameter*> params = stage->parameters();
    for (const Parameter* p : params)
      out.push_back(replica_piece(p->value.numel(), rank.replica, replicas));
    rank.shard_bounds.push_back(packed_shard_bounds(params, replicas));
  }
  return out;
}

}  // namespace

PipelineExecutor::PipelineExecutor(const ModelDescription& model, schedule::Schedule schedule,
                                   std::vector<StageRange> ranges, std::vector<Device> devices,
                                   const OptimizerConfig& optimizer, uint64_t seed,
                                   ExecutorOptions options)
    : model_(model), schedule_(std::move(schedule)), ranges_(std::move(ranges)) {
  schedule::validate(schedule_);
  const int p = schedule_.num_ranks();
  const int world = num_world_ranks();
  if (static_cast<int>(ranges_.size()) != schedule_.num_stages())
    throw std::invalid_argument("the schedule has " + std::to_string(schedule_.num_stages()) +
                                " stages but the partition has " + std::to_string(ranges_.size()));
  check_stage_ranges(ranges_, model_.num_units);
  if (static_cast<int>(devices.size()) != world)
    throw std::invalid_argument(
        "the schedule has " + std::to_string(p) + " ranks" +
        (schedule_.replicas > 1 ? " x " + std::to_string(schedule_.replicas) + " replicas" : "") +
        " but " + std::to_string(devices.size()) + " devices were given");
  // Before any rank is built, so that an impossible request fails at once.
  options.recompute.check_kind("ExecutorOptions::recompute.kind");
  options.recompute.per_unit(model_.num_units);
  comm::check_transport_kind(options.transport, "ExecutorOptions::transport");
  comm::check_timeout(options.transport_timeout, "ExecutorOptions::transport_timeout");
  transport_kind_ = comm::choose_transport(options.transport, devices);
  transport_timeout_ = options.transport_timeout;
  // Global parameter order: unit order, then each unit's own order.
  std::map<std::string, int> global;
  for (const auto& unit : model_.units(0, model_.num_units))
    for (Parameter* prm : unit->parameters()) global.emplace(prm->name, total_parameters_++);

  // The replica groups {r + d * p : d < D}, one per pipeline rank r, whose members sum their
  // stage's gradients (NCCL makes their communicators with the transport).
  std::vector<std::vector<int>> replica_groups;
  if (schedule_.replicas > 1)
    for (int r = 0; r < p; ++r) {
      replica_groups.emplace_back();
      for (int d = 0; d < schedule_.replicas; ++d) replica_groups.back().push_back(d * p + r);
    }
  // A transport that spans processes tells which rank this process holds; it is made first.
  comm::Transports transports;
  std::vector<int> held;
  if (comm::spans_processes(transport_kind_)) {
    try {
      transports = comm::make_transports(transport_kind_, devices, options.transport_timeout,
                                         replica_groups);
    } catch (const comm::ProcessCountMismatch& e) {
      // The transport sees only ranks; with replicas they are not one pipeline's.
      if (schedule_.replicas < 2) throw;
      throw comm::ProcessCountMismatch(e.ranks(), e.processes(),
                                       counted(p, "pipeline rank") + " x " +
                                           std::to_string(schedule_.replicas) +
                                           " data-parallel replicas");
    }
    held.push_back(transports.per_rank[0]->rank());
  } else {
    for (int r = 0; r < world; ++r) held.push_back(r);
  }
  // One cap per device, shared by the ranks this process holds on it: the memory check before
  // the run adds up their estimates against it, so their allocators together must stay
  // within it too. A process that holds one rank (mpirun) has the cap for that rank alone.
  std::vector<std::pair<Device, std::shared_ptr<MemoryBudget>>> budgets;
  const auto budget_of = [&](Device device) -> std::shared_ptr<MemoryBudget> {
    if (options.device_options.memory_limit_bytes == 0) return nullptr;
    for (const auto& [d, budget] : budgets)
      if (d == device) return budget;
    return budgets
        .emplace_back(device,
                      std::make_shared<MemoryBudget>(options.device_options.memory_limit_bytes))
        .second;
  };
  for (int r : held) {
    auto rank = std::make_unique<PipelineRank>();
    rank->index = r;
    rank->pipeline_rank = r % p;
    rank->replica = r / p;
    for (int d = 0; d < schedule_.replicas; ++d) rank->replica_group.push_back(d * p + r % p);
    OnDevice on_device(devices[r]);  // the stages initialise their parameters on it
    DeviceContextOptions context_options = options.device_options;
    if (auto budget = budget_of(devices[r])) {
      context_options.memory_budget = std::move(budget);
      context_options.allocator_name = "rank " + std::to_string(r);
    }
    rank->ctx = std::make_unique<DeviceContext>(devices[r], context_options);
    rank->send_stream = std::make_unique<Stream>(devices[r]);
    rank->recv_stream = std::make_unique<Stream>(devices[r]);
    for (int s : schedule_.placement.stages_of(rank->pipeline_rank))
      rank->stages[s] = std::make_unique<Stage>(model_, ranges_[s].begin, ranges_[s].end,
                                                *rank->ctx, seed, options.recompute);
    for (Parameter* prm : rank->parameters()) rank->global_index.push_back(global.at(prm->name));
    std::vector<ParameterShard> shards;
    if (options.shard_optimizer && schedule_.replicas > 1)
      shards = shard_parameters(*rank, schedule_.replicas);
    const size_t before = rank->ctx->allocator().stats().allocated_bytes;
    rank->optimizer =
        std::make_unique<Optimizer>(*rank->ctx, rank->parameters(), optimizer, std::move(shards));
    rank->optimizer_state_bytes = rank->ctx->allocator().stats().allocated_bytes - before;
    rank->bucket_bytes_in_flight = options.bucket_bytes_in_flight;
    if (devices[r].is_cuda()) {
      const size_t n = schedule_.ranks[rank->pipeline_rank].size();
      for (size_t i = 0; i < n; ++i) {
        rank->starts.emplace_back(devices[r], true);
        rank->ends.emplace_back(devices[r], true);
        rank->order.emplace_back(devices[r], false);
      }
      rank->reference = std::make_unique<Event>(devices[r], true);
    }
    ranks_.push_back(std::move(rank));
  }
  if (transports.per_rank.empty())
    transports =
        comm::make_transports(transport_kind_, devices, options.transport_timeout, replica_groups);
  set_transports(std::move(transports.per_rank));
  threads_ = std::make_unique<RankThreads>(static_cast<int>(ranks_.size()));
}

PipelineExecutor::~PipelineExecutor() {
  // Transports go first, while every rank's streams still exist. After a failed step the
  // in-process hub may still hold messages whose tensors were marked for the sender's send
  // stream and receivers' streams: freeing them records events on those streams, so it must
  // not happen after an earlier rank's streams were destroyed. An NCCL clique aborts its
  // communicators here, which also frees any of its kernels still queued on those streams
  // before ~Stream waits for them.
  for (auto& rank : ranks_) rank->transport.reset();
  // Then every rank's tensors, before any rank's streams: a block one rank still holds after a
  // failed step may be marked for another rank's stream (an interleaved schedule's
  // activations), and freeing it records an event there.
  for (auto& rank : ranks_) {
    rank->optimizer.reset();
    rank->stages.clear();
  }
}

PipelineRank& PipelineExecutor::held(int rank) const {
  for (const auto& r : ranks_)
    if (r->index == rank) return *r;
  if (rank < 0 || rank >= num_world_ranks())
    throw std::out_of_range("rank " + std::to_string(rank) + " out of range for " +
                            std::to_string(num_world_ranks()) + " ranks");
  throw std::invalid_argument("rank " + std::to_string(rank) +
                              " is held by another process; this one holds rank " +
                              std::to_string(ranks_.front()->index));
}

std::vector<int> PipelineExecutor::local_ranks() const {
  std::vector<int> out;
  for (const auto& r : ranks_) out.push_back(r->index);
  return out;
}

DeviceContext& PipelineExecutor::context(int rank) { return *held(rank).ctx; }
Optimizer& PipelineExecutor::optimizer(int rank) { return *held(rank).optimizer; }
size_t PipelineExecutor::optimizer_state_bytes(int rank) const {
  return held(rank).optimizer_state_bytes;
}
Stage& PipelineExecutor::stage(int stage) {
  if (stage < 0 || stage >= schedule_.num_stages())
    throw std::out_of_range("stage " + std::to_string(stage) + " is not one of the pipeline's " +
                            std::to_string(schedule_.num_stages()) + " stages");
  return *held(schedule_.placement.rank_of(stage)).stages.at(stage);
}
comm::Transport& PipelineExecutor::transport(int rank) { return *held(rank).transport; }
std::vector<Parameter*> PipelineExecutor::rank_parameters(int rank) {
  return held(rank).parameters();
}

std::vector<Parameter*> PipelineExecutor::parameters() {
  std::vector<Parameter*> out(total_parameters_, nullptr);
  for (auto& rank : ranks_) {
    if (rank->replica != 0) continue;
    const auto params = rank->parameters();
    for (size_t i = 0; i < params.size(); ++i) out[rank->global_index[i]] = params[i];
  }
  return out;
}

void PipelineExecutor::set_transports(std::vector<std::unique_ptr<comm::Transport>> transports) {
  if (transports.size() != ranks_.size())
    throw std::invalid_argument("one transport per rank is needed");
  for (size_t r = 0; r < ranks_.size(); ++r) ranks_[r]->transport = std::move(transports[r]);
  // NCCL kernels of a step can wait on a peer: an allocator that released its cache then
  // (cudaFree synchronises the device) could wait for them while the peer waits for this rank.
  // Ranks sharing a device share its kernels, so one such transport marks every allocator.
  bool waits_on_peers = false;
  for (const auto& rank : ranks_)
    waits_on_peers = waits_on_peers || rank->transport->queues_kernels_that_wait_on_peers();
  for (auto& rank : ranks_)
    rank->ctx->allocator().set_device_may_run_communication_kernels(waits_on_peers);
}

PipelineStepResult PipelineExecutor::run_step(const std::vector<MicroBatchData>& microbatches,
                                              float loss_scale, int64_t step, double lr,
                                              bool update) {
  // A NaN rate would pass every comparison and turn each weight into NaN; a negative one
  // climbs the loss. Refused before any rank starts, so nothing is left half done.
  if (update && !(std::isfinite(lr) && lr >= 0.0))
    throw std::invalid_argument("learning rate of step " + std::to_string(step) +
                                " must be a finite number >= 0, got " + std::to_string(lr));
  // The optimizer's step counts from 1 (AdamW's bias correction divides by 1 - beta^step):
  // step 0 would fail on every rank after the whole forward and backward had run.
  if (update && step < 1)
    throw std::invalid_argument("run_step's step must be at least 1, got " + std::to_string(step) +
                                ": the optimizer's steps count from 1");
  if (!std::isfinite(loss_scale))
    throw std::invalid_argument("loss scale of step " + std::to_string(step) +
                                " must be finite, got " + std::to_string(loss_scale));
  const int m = schedule_.num_microbatches * schedule_.replicas;
  if (static_cast<int>(microbatches.size()) != m)
    throw std::invalid_argument("the schedule has " + counted(m, "micro-batch", "micro-batches") +
                                (schedule_.replicas > 1
                                     ? " (" + std::to_string(schedule_.num_microbatches) +
                                           " for each of " + std::to_string(schedule_.replicas) +
                                           " replicas)"
                                     : std::string()) +
                                ", " + std::to_string(microbatches.size()) + " were given");
  for (const auto& mb : microbatches)
    if (mb.tokens.size() != microbatches[0].tokens.size() || mb.targets.size() != mb.tokens.size())
      throw std::invalid_argument("micro-batches must all have the same number of tokens");

  PipelineStepResult result;
  result.timing.resize(num_world_ranks());
  result.peak_activation_bytes.assign(num_world_ranks(), 0);
  result.peak_allocated_bytes.assign(num_world_ranks(), 0);
  const StepInputs inputs{.schedule = schedule_,
                          .microbatches = microbatches,
                          .loss_scale = loss_scale,
                          .model = model_,
                          .ranges = ranges_,
                          .total_parameters = total_parameters_,
                          .step = step,
                          .lr = lr,
                          .update = update,
                          .start = Clock::now(),
                          .reporting_rank = ranks_.front()->index,
                          .gather_peaks = !holds_all_ranks(),
                          .stop_request = stop_request_ ? &stop_request_ : nullptr};
  const int held_count = static_cast<int>(ranks_.size());
  std::vector<std::string> errors(held_count);
  std::vector<bool> follow_on(held_count, false), stalled(held_count, false);
  std::mutex errors_mutex;
  threads_->run([&](int r) {  // r: position among the ranks held here
    PipelineRank& rank = *ranks_[r];
    try {
      RankStep(rank, inputs).run(result);
    } catch (const std::exception& e) {
      const std::string what = error_sentence(e);
      rank.transport->abort(what);
      std::lock_guard lock(errors_mutex);
      errors[r] = what;
      follow_on[r] = stopped_by_abort(e);
      stalled[r] = transport_failure(e);
    } catch (...) {
      // Only code of the caller's (a transport of its own) throws such a thing: a unit's is
      // named by its stage. The step fails as for any other error, never the process.
      const std::string what = "rank " + std::to_string(rank.index) +
                               " threw an exception not derived from std::exception";
      rank.transport->abort(what);
      std::lock_guard lock(errors_mutex);
      errors[r] = what;
    }
  });
  result.seconds = std::chrono::duration<double>(Clock::now() - inputs.start).count();
  const bool any_stalled = std::find(stalled.begin(), stalled.end(), true) != stalled.end();
  const std::vector<RankPosition> others =
      any_stalled ? positions_of_other_processes() : std::vector<RankPosition>{};
  // Report the failure that started it, not the ranks that were stopped because of it.
  for (int pass = 0; pass < 2; ++pass)
    for (int r = 0; r < held_count; ++r)
      if (!errors[r].empty() && (pass == 1 || !follow_on[r]))
        throw PipelineError(stalled[r] ? errors[r] + "\n" + format_positions(r, others)
                                       : errors[r]);
  return result;
}

void PipelineExecutor::gather_timing(PipelineStepResult& result) {
  if (holds_all_ranks()) return;
  const int world = num_world_ranks();
  result.timing.resize(world);
  // Every rank's (start, end) pairs side by side; a process contributes the ranks it measured
  // and zeros elsewhere, so the global sum, exact for x + 0, is the gathered timeline.
  auto actions_of = [&](int r) { return schedule_.ranks[r % num_ranks()].size(); };
  std::vector<size_t> offset(world + 1, 0);
  for (int r = 0; r < world; ++r) offset[r + 1] = offset[r] + 2 * actions_of(r);
  std::vector<double> values(offset[world], 0.0);
  for (int r = 0; r < world; ++r) {
    const auto& mine = result.timing[r];
    if (mine.empty()) continue;
    if (mine.size() != actions_of(r))
      throw std::logic_error("rank " + std::to_string(r) + " measured " +
                             std::to_string(mine.size()) + " actions of its " +
                             std::to_string(actions_of(r)));
    for (size_t i = 0; i < mine.size(); ++i) {
      values[offset[r] + 2 * i] = mine[i].start;
      values[offset[r] + 2 * i + 1] = mine[i].end;
    }
  }
  sum_over_processes(values);
  for (int r = 0; r < world; ++r) {
    result.timing[r].resize(actions_of(r));
    for (size_t i = 0; i < result.timing[r].size(); ++i)
      result.timing[r][i] = {values[offset[r] + 2 * i], values[offset[r] + 2 * i + 1]};
  }
  // Each process counted from its own start of the step: on one clock only once the
  // transfers between them say how far apart those starts were.
  schedule::align_to_transfers(schedule_, result.timing);
}

void PipelineExecutor::sum_over_processes(std::vector<double>& values) {
  // One rank per process under such a transport: a sum over its ranks is one over processes.
  if (!holds_all_ranks()) ranks_.front()->transport->all_reduce_sum(values);
}

void PipelineExecutor::check_replicas_agree() {
  const int replicas = num_replicas(), stages = schedule_.num_stages();
  if (replicas == 1) return;
  // A digest per (replica, stage) (put_u64_in_doubles); a rank fills the slots of its stages,
  // so the sum over the processes gathers them exactly.
  std::vector<double> slots(static_cast<size_t>(replicas) * stages * 2, 0.0);
  std::vector<std::byte> bytes;
  for (auto& rank : ranks_) {
    OnDevice on_device(rank->ctx->device());
    for (auto& [id, stage] : rank->stages) {
      XXH3_state_t state;  // on the stack: nothing to free when a copy throws
      XXH3_64bits_reset(&state);
      for (const Parameter* p : stage->parameters()) {
        bytes.resize(p->value.nbytes());
        copy_to_host(bytes.data(), p->value, bytes.size());
        XXH3_64bits_update(&state, bytes.data(), bytes.size());
      }
      const uint64_t digest = XXH3_64bits_digest(&state);
      put_u64_in_doubles(digest, &slots[(static_cast<size_t>(rank->replica) * stages + id) * 2]);
    }
  }
  sum_over_processes(slots);
  const int p = num_ranks();
  for (int d = 1; d < replicas; ++d)
    for (int s = 0; s < stages; ++s) {
      const size_t mine = (static_cast<size_t>(d) * stages + s) * 2, first = 2 * s;
      if (u64_from_doubles(&slots[mine]) == u64_from_doubles(&slots[first])) continue;
      const int r = schedule_.placement.rank_of(s);
      throw ReplicasDiffer("replica " + std::to_string(d) + " (rank " + std::to_string(d * p + r) +
                           ") ends with other weights of stage " + std::to_string(s) +
                           " than replica 0 (rank " + std::to_string(r) +
                           "): the replicas' gradient sums or optimizer steps went apart");
    }
}

std::vector<RankPosition> PipelineExecutor::positions_of_other_processes() {
  if (holds_all_ranks()) return {};
  // Under such a transport a process holds one rank. The survivors notice the abort within
  // their next poll, so a short wait hears from every rank that can still answer.
  const PipelineRank& mine = *ranks_.front();
  const auto grace = std::min(transport_timeout_, std::chrono::milliseconds(1000));
  std::vector<RankPosition> out;
  for (const auto& [rank, bytes] :
       mine.transport->collect_failure_reports(encode_position(position_of(mine)), 0, grace))
    if (auto decoded = decode_position(bytes, schedule_, num_world_ranks());
        decoded && decoded->index == rank && rank != mine.index)
      out.push_back(std::move(*decoded));
  return out;
}

std::string PipelineExecutor::format_positions(int failed,
                                               const std::vector<RankPosition>& others) const {
  // Every rank thread has ended: their progress is read after they joined.
  std::vector<RankPosition> known;
  for (const auto& rank : ranks_) known.push_back(position_of(*rank));
  known.insert(known.end(), others.begin(), others.end());
  std::sort(known.begin(), known.end(),
            [](const RankPosition& a, const RankPosition& b) { return a.index < b.index; });
  return conveyor::format_positions(schedule_, known, ranks_[failed]->index, num_world_ranks());
}

}  // namespace conveyor
