#include "engine/pipeline/executor.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <set>
#include <utility>

#include "comm/in_process.h"
#include "comm/nccl.h"
#include "engine/schedule/validator.h"
#include "layers/ops.h"
#ifdef CONVEYOR_WITH_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda_check.h"
#endif

namespace conveyor {

using schedule::Action;
using schedule::ActionKind;
using Clock = std::chrono::steady_clock;

// What one rank owns: its device context, streams, stages (by virtual stage id), optimizer,
// transport endpoint, and the events that time and order its actions.
struct PipelineExecutor::Rank {
  int index = 0;
  std::unique_ptr<DeviceContext> ctx;
  std::shared_ptr<CachingAllocator> host_allocator = make_cpu_allocator();  // staging
  std::unique_ptr<Stream> send_stream, recv_stream;
  std::map<int, std::unique_ptr<Stage>> stages;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<comm::Transport> transport;
  std::vector<int> global_index;  // of each of this rank's parameters, in rank order
  // CUDA: start/end timing events per action, one ordering event per action, and the
  // step's reference event.
  std::vector<Event> starts, ends, order;
  std::unique_ptr<Event> reference;

  std::vector<Parameter*> parameters() {
    std::vector<Parameter*> out;
    for (auto& [id, stage] : stages)
      for (Parameter* p : stage->parameters()) out.push_back(p);
    return out;
  }
};

namespace {

// A tensor handed between actions of one rank, with the event after which it is ready on
// the stream that produced it (CUDA only).
struct Handoff {
  Tensor tensor;
  Event* ready = nullptr;
};

std::string action_label(const Action& a) { return schedule::to_string(a); }

// Tensors between the actions of one rank, per kind and (stage, micro-batch): stage outputs
// and input gradients waiting to be sent or used locally, received ones waiting to be used.
// Keeps the bytes they hold (rounded as the allocator counts them), so the per-action memory
// sample costs O(1).
class Handoffs {
 public:
  enum Kind { kOutAct, kOutGrad, kInAct, kInGrad, kKinds };

  Handoffs(int stages, int microbatches) : m_(microbatches) {
    for (auto& slots : slots_) slots.resize(static_cast<size_t>(stages) * microbatches);
  }
  void put(Kind kind, int stage, int mb, Tensor tensor, Event* ready = nullptr) {
    Handoff& h = slots_[kind][index(stage, mb)];
    if (h.tensor.defined())
      throw std::logic_error("a second tensor for stage " + std::to_string(stage) +
                             ", micro-batch " + std::to_string(mb));
    bytes_ += CachingAllocator::round_size(tensor.nbytes());
    h = {std::move(tensor), ready};
  }
  // The tensor, or throws naming the action that needed it.
  Handoff take(Kind kind, int stage, int mb, const Action& needed_by) {
    Handoff& h = slots_[kind][index(stage, mb)];
    if (!h.tensor.defined())
      throw std::logic_error("no input ready for " + action_label(needed_by));
    bytes_ -= CachingAllocator::round_size(h.tensor.nbytes());
    return std::exchange(h, Handoff{});
  }
  size_t bytes() const { return bytes_; }

 private:
  size_t index(int stage, int mb) const { return static_cast<size_t>(stage) * m_ + mb; }
  int m_;
  std::vector<Handoff> slots_[kKinds];
  size_t bytes_ = 0;
};

void set_current_device(Device device) {
#ifdef CONVEYOR_WITH_CUDA
  if (device.is_cuda()) CONVEYOR_CUDA_CHECK(cudaSetDevice(device.index));
#else
  (void)device;
#endif
}

// [m, n] i32 ids of every micro-batch on the rank's device. A CUDA rank stages them in host
// memory and copies on its compute stream, so it never synchronises the whole GPU that other
// ranks may share.
Tensor upload_ids(DeviceContext& ctx, const std::shared_ptr<CachingAllocator>& host,
                  const std::vector<MicroBatchData>& microbatches,
                  std::vector<int32_t> MicroBatchData::*field) {
  const auto m = static_cast<int64_t>(microbatches.size());
  const auto n = static_cast<int64_t>((microbatches[0].*field).size());
  Tensor staging =
      ctx.is_cuda() ? Tensor::empty({m, n}, DType::I32, host) : ctx.empty({m, n}, DType::I32);
  for (int64_t mb = 0; mb < m; ++mb)
    std::copy((microbatches[mb].*field).begin(), (microbatches[mb].*field).end(),
              staging.data<int32_t>() + mb * n);
  if (!ctx.is_cuda()) return staging;
  Tensor ids = ctx.empty({m, n}, DType::I32);
  copy_tensor(ids, staging, ctx.compute_stream().native());
  return ids;
}

bool one_gpu_per_rank(const std::vector<Device>& devices) {
  std::set<int> seen;
  for (const Device& d : devices)
    if (!d.is_cuda() || !seen.insert(d.index).second) return false;
  return true;
}

const Stream& stream_for(const Action& a, Stream& compute, Stream& send, Stream& recv) {
  if (schedule::is_send(a.kind)) return send;
  if (schedule::is_recv(a.kind)) return recv;
  return compute;
}

}  // namespace

PipelineExecutor::PipelineExecutor(const ModelDescription& model, schedule::Schedule schedule,
                                   std::vector<StageRange> ranges, std::vector<Device> devices,
                                   const OptimizerConfig& optimizer, uint64_t seed,
                                   ExecutorOptions options)
    : model_(model), schedule_(std::move(schedule)), ranges_(std::move(ranges)) {
  schedule::validate(schedule_);
  const int p = schedule_.num_ranks();
  if (static_cast<int>(ranges_.size()) != schedule_.num_stages())
    throw std::invalid_argument("the schedule has " + std::to_string(schedule_.num_stages()) +
                                " stages but the partition has " + std::to_string(ranges_.size()));
  if (static_cast<int>(devices.size()) != p)
    throw std::invalid_argument("the schedule has " + std::to_string(p) + " ranks but " +
                                std::to_string(devices.size()) + " devices were given");
  // Global parameter order: unit order, then each unit's own order.
  std::map<std::string, int> global;
  for (const auto& unit : model_.units(0, model_.num_units))
    for (Parameter* prm : unit->parameters()) global.emplace(prm->name, total_parameters_++);

  const bool distinct_gpus = one_gpu_per_rank(devices);
  uses_nccl_ = options.transport == TransportKind::kNccl ||
               (options.transport == TransportKind::kAuto && p > 1 && distinct_gpus &&
                comm::nccl_available());
  if (uses_nccl_ && !distinct_gpus)
    throw std::invalid_argument("the NCCL transport needs one CUDA device per rank");
  auto hub = comm::InProcessHub::create(p, options.transport_timeout);
  for (int r = 0; r < p; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->index = r;
    set_current_device(devices[r]);
    rank->ctx = std::make_unique<DeviceContext>(devices[r], options.device_options);
    rank->send_stream = std::make_unique<Stream>(devices[r]);
    rank->recv_stream = std::make_unique<Stream>(devices[r]);
    for (int s : schedule_.placement.stages_of(r))
      rank->stages[s] =
          std::make_unique<Stage>(model_, ranges_[s].begin, ranges_[s].end, *rank->ctx, seed);
    for (Parameter* prm : rank->parameters()) rank->global_index.push_back(global.at(prm->name));
    rank->optimizer = std::make_unique<Optimizer>(*rank->ctx, rank->parameters(), optimizer);
    if (!uses_nccl_) rank->transport = hub->endpoint(r);
    if (devices[r].is_cuda()) {
      const size_t n = schedule_.ranks[r].size();
      for (size_t i = 0; i < n; ++i) {
        rank->starts.emplace_back(devices[r], true);
        rank->ends.emplace_back(devices[r], true);
        rank->order.emplace_back(devices[r], false);
      }
      rank->reference = std::make_unique<Event>(devices[r], true);
    }
    ranks_.push_back(std::move(rank));
  }
  if (uses_nccl_) {
#ifdef CONVEYOR_WITH_CUDA
    std::vector<int> ids;
    for (const Device& d : devices) ids.push_back(d.index);
    set_transports(comm::make_nccl_transports(ids, options.transport_timeout));
#else
    throw std::invalid_argument("this build has no NCCL; use the in-process transport");
#endif
  }
  threads_ = std::make_unique<RankThreads>(p);
}

PipelineExecutor::~PipelineExecutor() {
  // Transports go first, while every rank's streams still exist. After a failed step the
  // in-process hub may still hold messages whose tensors were marked for the sender's send
  // stream and receivers' streams: freeing them records events on those streams, so it must
  // not happen after an earlier rank's streams were destroyed. An NCCL clique aborts its
  // communicators here, which also frees any of its kernels still queued on those streams
  // before ~Stream waits for them.
  for (auto& rank : ranks_) rank->transport.reset();
}

DeviceContext& PipelineExecutor::context(int rank) { return *ranks_.at(rank)->ctx; }
Optimizer& PipelineExecutor::optimizer(int rank) { return *ranks_.at(rank)->optimizer; }
Stage& PipelineExecutor::stage(int stage) {
  return *ranks_.at(schedule_.placement.rank_of(stage))->stages.at(stage);
}
std::vector<Parameter*> PipelineExecutor::rank_parameters(int rank) {
  return ranks_.at(rank)->parameters();
}

std::vector<Parameter*> PipelineExecutor::parameters() {
  std::vector<Parameter*> out(total_parameters_, nullptr);
  for (auto& rank : ranks_) {
    const auto params = rank->parameters();
    for (size_t i = 0; i < params.size(); ++i) out[rank->global_index[i]] = params[i];
  }
  return out;
}

void PipelineExecutor::set_transports(std::vector<std::unique_ptr<comm::Transport>> transports) {
  if (transports.size() != ranks_.size())
    throw std::invalid_argument("one transport per rank is needed");
  for (size_t r = 0; r < ranks_.size(); ++r) ranks_[r]->transport = std::move(transports[r]);
}

PipelineStepResult PipelineExecutor::run_step(const std::vector<MicroBatchData>& microbatches,
                                              float loss_scale, int64_t step, double lr,
                                              bool update) {
  const int m = schedule_.num_microbatches;
  if (static_cast<int>(microbatches.size()) != m)
    throw std::invalid_argument("the schedule has " + std::to_string(m) + " micro-batches, " +
                                std::to_string(microbatches.size()) + " were given");
  for (const auto& mb : microbatches)
    if (mb.tokens.size() != microbatches[0].tokens.size() || mb.targets.size() != mb.tokens.size())
      throw std::invalid_argument("micro-batches must all have the same number of tokens");

  PipelineStepResult result;
  const int p = num_ranks();
  result.timing.resize(p);
  result.peak_activation_bytes.assign(p, 0);
  result.peak_allocated_bytes.assign(p, 0);
  std::vector<std::string> errors(p);
  std::vector<bool> secondary(p, false);
  const auto start = Clock::now();
  std::mutex result_mutex;
  threads_->run([&](int r) {
    Rank& rank = *ranks_[r];
    try {
      run_rank(rank, microbatches, loss_scale, step, lr, update, result, start);
    } catch (const std::exception& e) {
      const std::string what = e.what();
      rank.transport->abort(what);
      std::lock_guard lock(result_mutex);
      errors[r] = what;
      secondary[r] = what.find("pipeline aborted") != std::string::npos;
    }
  });
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  // Report the failure that started it, not the ranks that were stopped because of it.
  for (int pass = 0; pass < 2; ++pass)
    for (int r = 0; r < p; ++r)
      if (!errors[r].empty() && (pass == 1 || !secondary[r])) throw PipelineError(errors[r]);
  return result;
}

void PipelineExecutor::run_rank(Rank& rank, const std::vector<MicroBatchData>& microbatches,
                                float loss_scale, int64_t step, double lr, bool update,
                                PipelineStepResult& result, Clock::time_point step_start) {
  const int r = rank.index;
  DeviceContext& ctx = *rank.ctx;
  set_current_device(ctx.device());
  const bool cuda = ctx.is_cuda();
  Stream& compute = ctx.compute_stream();
  Stream& send = *rank.send_stream;
  Stream& recv = *rank.recv_stream;
  const auto& actions = schedule_.ranks[r];
  const auto& placement = schedule_.placement;
  const int last_stage = schedule_.num_stages() - 1;
  const int m = schedule_.num_microbatches;
  const int64_t n = static_cast<int64_t>(microbatches[0].tokens.size());

  const auto parameters = rank.parameters();
  zero_grads(ctx, parameters);
  // The step's token ids, uploaded once: tokens where the first stage lives, targets where
  // the last one does.
  Tensor tokens, targets;
  if (rank.stages.count(0))
    tokens = upload_ids(ctx, rank.host_allocator, microbatches, &MicroBatchData::tokens);
  if (rank.stages.count(last_stage))
    targets = upload_ids(ctx, rank.host_allocator, microbatches, &MicroBatchData::targets);
  if (cuda) rank.reference->record(compute);
  const double reference_us =
      std::chrono::duration<double, std::micro>(Clock::now() - step_start).count();

  Handoffs handoffs(schedule_.num_stages(), m);
  std::vector<Tensor> losses(m);
  size_t loss_bytes = 0;
  const size_t baseline = ctx.allocator().stats().allocated_bytes;
  auto take = [&](Handoffs::Kind kind, int stage, int mb, const Action& a) {
    Handoff h = handoffs.take(kind, stage, mb, a);
    // Received on another stream: the consumer's stream waits for it, and the allocator
    // keeps the block until the consumer's stream is done with it.
    if (cuda && h.ready) {
      h.ready->wait(compute);
      record_stream(h.tensor, compute.native());
    }
    return h.tensor;
  };

  auto& timing = result.timing[r];
  timing.assign(actions.size(), {});
  size_t peak_activations = 0;
  for (size_t i = 0; i < actions.size(); ++i) {
    const Action& a = actions[i];
    const Stream& stream = stream_for(a, compute, send, recv);
    const auto host_start = Clock::now();
    // A send starts once its tensor is ready (recorded below, after the send stream waits for
    // the compute stream); timed from here it would span the compute that makes the tensor,
    // since the idle send stream passes the event as soon as the host enqueues it.
    if (cuda && !schedule::is_send(a.kind)) rank.starts[i].record(stream);
    try {
      const auto found = rank.stages.find(a.stage);
      if (found == rank.stages.end())
        throw std::logic_error("rank does not hold stage " + std::to_string(a.stage));
      Stage* stage = found->second.get();
      const int mb = a.microbatch;
      switch (a.kind) {
        case ActionKind::kForward: {
          Tensor input;
          if (a.stage == 0)
            input = tokens.slice_rows(mb, 1).reshape({n});
          else if (placement.rank_of(a.stage - 1) == r)
            input = take(Handoffs::kOutAct, a.stage - 1, mb, a);
          else
            input = take(Handoffs::kInAct, a.stage, mb, a);
          MicroBatchInputs in;
          in.loss_scale = loss_scale;
          if (a.stage == last_stage) in.targets = targets.slice_rows(mb, 1).reshape({n});
          Tensor out = stage->forward(mb, input, in);
          if (a.stage == last_stage) {
            loss_bytes += CachingAllocator::round_size(out.nbytes());
            losses[mb] = out;
          } else {
            handoffs.put(Handoffs::kOutAct, a.stage, mb, out);
          }
          break;
        }
        case ActionKind::kBackward:
        case ActionKind::kBackwardInput: {
          Tensor dy;
          if (a.stage != last_stage) {
            if (placement.rank_of(a.stage + 1) == r)
              dy = take(Handoffs::kOutGrad, a.stage + 1, mb, a);
            else
              dy = take(Handoffs::kInGrad, a.stage, mb, a);
          }
          Tensor dx = a.kind == ActionKind::kBackward ? stage->backward(mb, dy)
                                                      : stage->backward_input(mb, dy);
          if (a.stage > 0) handoffs.put(Handoffs::kOutGrad, a.stage, mb, dx);
          break;
        }
        case ActionKind::kBackwardWeight:
          stage->backward_weight(mb);
          break;
        case ActionKind::kSendAct:
        case ActionKind::kSendGrad: {
          Tensor t =
              handoffs
                  .take(a.kind == ActionKind::kSendAct ? Handoffs::kOutAct : Handoffs::kOutGrad,
                        a.stage, mb, a)
                  .tensor;
          if (cuda) {
            rank.order[i].record(compute);  // the send waits for the compute that made it
            rank.order[i].wait(send);
            rank.starts[i].record(send);
            record_stream(t, send.native());
          }
          rank.transport->send(t, a.peer, send);
          break;
        }
        case ActionKind::kRecvAct:
        case ActionKind::kRecvGrad: {
          // An activation enters the stage's first unit; a gradient leaves its last one.
          const ActivationSpec spec = model_.activation_at(
              a.kind == ActionKind::kRecvAct ? ranges_[a.stage].begin : ranges_[a.stage].end, n);
          Tensor t = Tensor::empty(spec.shape, spec.dtype, ctx.allocator_ptr(), recv.native());
          rank.transport->recv(t, a.peer, recv);
          Event* ready = nullptr;
          if (cuda) {
            rank.order[i].record(recv);
            ready = &rank.order[i];
          }
          handoffs.put(a.kind == ActionKind::kRecvAct ? Handoffs::kInAct : Handoffs::kInGrad,
                       a.stage, mb, t, ready);
          break;
        }
      }
    } catch (const std::exception& e) {
      throw PipelineError("rank " + std::to_string(r) + ", action " + std::to_string(i) + " (" +
                          action_label(a) + "): " + e.what());
    }
    if (cuda) {
      rank.ends[i].record(stream);
    } else {
      timing[i].start = std::chrono::duration<double, std::micro>(host_start - step_start).count();
      timing[i].end = std::chrono::duration<double, std::micro>(Clock::now() - step_start).count();
    }
    const size_t live = ctx.allocator().stats().allocated_bytes;
    const size_t held = live - std::min(live, baseline + handoffs.bytes() + loss_bytes);
    peak_activations = std::max(peak_activations, held);
  }

  // Bounded waits: a dead peer must not hang the end of the step.
  rank.transport->synchronize(send);
  rank.transport->synchronize(recv);
  rank.transport->synchronize(compute);
  if (cuda) {
    for (size_t i = 0; i < actions.size(); ++i) {
      timing[i].start = reference_us + 1000.0 * Event::elapsed_ms(*rank.reference, rank.starts[i]);
      timing[i].end = reference_us + 1000.0 * Event::elapsed_ms(*rank.reference, rank.ends[i]);
    }
  }

  // One all-reduce: per-micro-batch loss sums, then per-parameter squared norms, each rank
  // filling only its own slots so every sum below runs in the one-stage order.
  std::vector<double> reduced(static_cast<size_t>(m) + total_parameters_, 0.0);
  if (rank.stages.count(last_stage)) {
    const std::vector<double> loss_sums = ops::sum_each(ctx, losses);
    std::copy(loss_sums.begin(), loss_sums.end(), reduced.begin());
  }
  std::vector<Tensor> grads;
  for (Parameter* prm : parameters) grads.push_back(prm->grad);
  const std::vector<double> squares = ops::sum_squares_each(ctx, grads);
  for (size_t i = 0; i < parameters.size(); ++i) reduced[m + rank.global_index[i]] = squares[i];
  rank.transport->all_reduce_sum(reduced);
  double loss_sum = 0.0, squared_norm = 0.0;
  for (int mb = 0; mb < m; ++mb) loss_sum += reduced[mb];
  for (int i = 0; i < total_parameters_; ++i) squared_norm += reduced[m + i];
  const double norm = std::sqrt(squared_norm);
  const bool finite = std::isfinite(loss_sum) && std::isfinite(norm);
  if (update && finite) {
    rank.optimizer->step(step, lr, clip_scale(rank.optimizer->config(), norm));
    ctx.synchronize();
  }
  const auto stats = ctx.allocator().stats();
  if (r == 0) {
    result.loss_sum = loss_sum;
    result.grad_norm = norm;
    result.diverged = !finite;
  }
  result.peak_activation_bytes[r] = peak_activations;
  result.peak_allocated_bytes[r] = stats.peak_allocated_bytes;
}

schedule::CostModel measured_costs(const schedule::Schedule& sched,
                                   const std::vector<std::vector<schedule::ActionTiming>>& timing) {
  const int stages = sched.num_stages();
  std::vector<double> f(stages, 0), b(stages, 0), i(stages, 0), w(stages, 0);
  std::vector<int> nf(stages, 0), nb(stages, 0), ni(stages, 0), nw(stages, 0);
  double comm = 0;
  int ncomm = 0;
  for (int r = 0; r < sched.num_ranks(); ++r)
    for (size_t k = 0; k < sched.ranks[r].size(); ++k) {
      const Action& a = sched.ranks[r][k];
      const double d = timing[r][k].end - timing[r][k].start;
      switch (a.kind) {
        case ActionKind::kForward:
          f[a.stage] += d, ++nf[a.stage];
          break;
        case ActionKind::kBackward:
          b[a.stage] += d, ++nb[a.stage];
          break;
        case ActionKind::kBackwardInput:
          i[a.stage] += d, ++ni[a.stage];
          break;
        case ActionKind::kBackwardWeight:
          w[a.stage] += d, ++nw[a.stage];
          break;
        default:
          comm += d, ++ncomm;
          break;
      }
    }
  schedule::CostModel costs;
  costs.forward.assign(stages, 0);
  costs.backward_input.assign(stages, 0);
  costs.backward_weight.assign(stages, 0);
  const bool split = sched.splits_backward();
  if (!split) costs.backward.assign(stages, 0);
  for (int s = 0; s < stages; ++s) {
    costs.forward[s] = nf[s] ? f[s] / nf[s] : 0;
    if (split) {
      costs.backward_input[s] = ni[s] ? i[s] / ni[s] : 0;
      costs.backward_weight[s] = nw[s] ? w[s] / nw[s] : 0;
    } else {
      costs.backward[s] = nb[s] ? b[s] / nb[s] : 0;
    }
  }
  costs.latency = ncomm ? comm / ncomm : 0;
  return costs;
}

schedule::SimResult summarize_timing(const schedule::Schedule& sched,
                                     std::vector<std::vector<schedule::ActionTiming>> timing) {
  schedule::SimResult out;
  double first = INFINITY, last = 0;
  for (const auto& rank : timing)
    for (const auto& t : rank) first = std::min(first, t.start), last = std::max(last, t.end);
  if (!std::isfinite(first)) first = 0;
  for (auto& rank : timing)
    for (auto& t : rank) t.start -= first, t.end -= first;
  out.makespan = last - first;
  double idle = 0;
  for (int r = 0; r < sched.num_ranks(); ++r) {
    schedule::RankStats stats;
    for (size_t k = 0; k < sched.ranks[r].size(); ++k) {
      if (schedule::is_compute(sched.ranks[r][k].kind))
        stats.busy += timing[r][k].end - timing[r][k].start;
      stats.end = std::max(stats.end, timing[r][k].end);
    }
    stats.idle = out.makespan - stats.busy;
    idle += stats.idle;
    out.ranks.push_back(stats);
  }
  out.bubble_fraction = out.makespan > 0 ? idle / (sched.num_ranks() * out.makespan) : 0;
  out.timing = std::move(timing);
  return out;
}

}  // namespace conveyor
