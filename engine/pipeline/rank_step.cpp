#include "engine/pipeline/rank_step.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <string>

#include "layers/ops.h"

namespace conveyor {

using schedule::ActionKind;
using Clock = std::chrono::steady_clock;

std::vector<Parameter*> PipelineRank::parameters() {
  std::vector<Parameter*> out;
  for (auto& [id, stage] : stages)
    for (Parameter* p : stage->parameters()) out.push_back(p);
  return out;
}

namespace {

// Each process measured its own rank's peaks (the others' entries are 0): one more sum gathers
// every rank's, exactly (sizes below 2^53 are exact doubles, and x + 0 is x). Inside the step,
// so that a peer that stalls there is reported with every rank's position, as in the step's
// other waits.
void gather_peaks(comm::Transport& transport, int rank, PipelineStepResult& result) {
  const size_t world = result.peak_allocated_bytes.size();
  std::vector<double> peaks(2 * world, 0.0);
  peaks[rank] = static_cast<double>(result.peak_allocated_bytes[rank]);
  peaks[world + rank] = static_cast<double>(result.peak_activation_bytes[rank]);
  transport.all_reduce_sum(peaks);
  for (size_t r = 0; r < world; ++r) {
    result.peak_allocated_bytes[r] = static_cast<size_t>(peaks[r]);
    result.peak_activation_bytes[r] = static_cast<size_t>(peaks[world + r]);
  }
}

std::vector<int> held_stages(const PipelineRank& rank) {
  std::vector<int> held;
  for (const auto& [id, stage] : rank.stages) held.push_back(id);
  return held;
}

// [m, n] i32 ids of every micro-batch on the rank's device. A CUDA rank stages them in host
// memory and copies on its compute stream, so it never synchronises the whole GPU that other
// ranks may share.
Tensor upload_ids(DeviceContext& ctx, const std::shared_ptr<CachingAllocator>& host,
                  const MicroBatchData* microbatches, int64_t m,
                  std::vector<int32_t> MicroBatchData::*field) {
  const auto n = static_cast<int64_t>((microbatches[0].*field).size());
  Tensor staging =
      ctx.is_cuda() ? Tensor::empty({m, n}, DType::kI32, host) : ctx.empty({m, n}, DType::kI32);
  for (int64_t mb = 0; mb < m; ++mb)
    std::copy((microbatches[mb].*field).begin(), (microbatches[mb].*field).end(),
              staging.data<int32_t>() + mb * n);
  if (!ctx.is_cuda()) return staging;
  Tensor ids = ctx.empty({m, n}, DType::kI32);
  copy_tensor(ids, staging, ctx.compute_stream().native());
  return ids;
}

double microseconds_since(Clock::time_point start, Clock::time_point t) {
  return std::chrono::duration<double, std::micro>(t - start).count();
}

// The head of one of a rank's streams: the position in the rank's list of the next action of
// that stream's kind.
class StreamHead {
 public:
  StreamHead(const std::vector<schedule::Action>& list, bool (*of_stream)(ActionKind))
      : list_(list), of_stream_(of_stream) {
    skip();
  }
  bool done() const { return i_ == list_.size(); }
  size_t index() const { return i_; }
  const schedule::Action& action() const { return list_[i_]; }
  void advance() {
    ++i_;
    skip();
  }

 private:
  void skip() {
    while (i_ < list_.size() && !of_stream_(list_[i_].kind)) ++i_;
  }
  const std::vector<schedule::Action>& list_;
  bool (*of_stream_)(ActionKind);
  size_t i_ = 0;
};

}  // namespace

RankStep::RankStep(PipelineRank& rank, const StepInputs& in)
    : rank_(rank),
      in_(in),
      ctx_(*rank.ctx),
      cuda_(ctx_.is_cuda()),
      compute_(ctx_.compute_stream()),
      send_(*rank.send_stream),
      recv_(*rank.recv_stream),
      actions_(in.schedule.ranks[rank.pipeline_rank]),
      last_stage_(in.schedule.num_stages() - 1),
      m_(in.schedule.num_microbatches),
      first_mb_(rank.replica * m_),
      n_(static_cast<int64_t>(in.microbatches[0].tokens.size())),
      handoffs_(held_stages(rank), in.schedule.num_stages(), m_),
      // Only the last stage makes losses.
      losses_(rank.stages.count(last_stage_) ? static_cast<size_t>(m_) : 0) {
  for (const Action& a : actions_)
    if (schedule::is_reduce(a.kind)) ++buckets_[a.stage];
  for (size_t i = 0; i < actions_.size(); ++i) {
    if (!schedule::is_weight_grad(actions_[i].kind)) continue;
    auto it = std::find_if(last_weight_grad_.begin(), last_weight_grad_.end(),
                           [&](const auto& e) { return e.first == actions_[i].stage; });
    if (it == last_weight_grad_.end())
      last_weight_grad_.emplace_back(actions_[i].stage, i);
    else
      it->second = i;
  }
}

void RankStep::run(PipelineStepResult& result) {
  OnDevice on_device(ctx_.device());
  rank_.progress = {};
  begin();
  run_actions();
  rank_.progress.phase = RankProgress::Phase::kEndOfStep;
  finish_transfers();
  end_of_step(result);
  if (in_.gather_peaks) gather_peaks(*rank_.transport, rank_.index, result);
  rank_.progress.phase = RankProgress::Phase::kDone;
}

void RankStep::begin() {
  zero_grads(ctx_, rank_.parameters());
  // The step's token ids, uploaded once: tokens where the first stage lives, targets where
  // the last one does.
  const MicroBatchData* mine = in_.microbatches.data() + first_mb_;
  if (rank_.stages.count(0))
    tokens_ = upload_ids(ctx_, rank_.host_allocator, mine, m_, &MicroBatchData::tokens);
  if (rank_.stages.count(last_stage_))
    targets_ = upload_ids(ctx_, rank_.host_allocator, mine, m_, &MicroBatchData::targets);
  if (cuda_) rank_.reference->record(compute_);
  reference_us_ = microseconds_since(in_.start, Clock::now());
  baseline_bytes_ = ctx_.allocator().stats().allocated_bytes;
  timing_.assign(actions_.size(), {});
}

void RankStep::run_actions() {
  // The reduction stream has two heads: the next bucket to start, and the oldest in flight,
  // which finishes first.
  StreamHead compute(actions_, schedule::is_compute), send(actions_, schedule::is_send),
      recv(actions_, schedule::is_recv), reduce_start(actions_, schedule::is_reduce),
      reduce(actions_, schedule::is_reduce);
  RankProgress& progress = rank_.progress;
  while (!compute.done() || !send.done() || !recv.done() || !reduce.done()) {
    progress.compute = compute.index();
    progress.send = send.index();
    progress.recv = recv.index();
    progress.reduce = reduce.index();
    bool moved = false;
    // Sends first: one issued as soon as its tensor exists lets its receiver go on.
    for (; !send.done() && produced(send.action()); send.advance()) {
      run_action(send.index(), /*wait=*/false);
      moved = true;
    }
    for (; !recv.done() && may_receive(recv.index(), compute.index()) &&
           run_action(recv.index(), /*wait=*/false);
         recv.advance())
      moved = true;
    // One compute at a time, so that the sends it makes possible go out before the next.
    if (!compute.done() && inputs_ready(compute.action())) {
      run_action(compute.index(), /*wait=*/false);
      compute.advance();
      moved = true;
    }
    // The reduction stream: a bucket starts once its stage's gradients are final (and the
    // bound on the bytes in flight lets it) and ends when every replica's part is in. No other
    // stream waits for it, so it never blocks the pipeline; the step's end does.
    for (; !reduce_start.done() && weight_grads_done(reduce_start.action(), compute.index()) &&
           may_start_reduce(reduce_start.action());
         reduce_start.advance()) {
      start_reduce(reduce_start.index(), reduce_start.action());
      moved = true;
    }
    for (; !buckets_in_flight_.empty() && buckets_in_flight_.front().call->test();
         reduce.advance()) {
      finish_oldest_reduce();
      moved = true;
    }
    if (moved) continue;
    // Nothing can start: only the message of the receive head can change that, or, when every
    // receive is done, the other replicas' parts of the oldest all-reduce in flight.
    if (recv.done()) {
      if (buckets_in_flight_.empty())
        fail_stuck(!compute.done() ? compute.index()
                   : !send.done()  ? send.index()
                                   : reduce.index());
      progress.phase = RankProgress::Phase::kWaitingForSum;
      progress.action = reduce.index();
      try {
        buckets_in_flight_.front().call->wait();
      } catch (const std::exception& e) {
        std::throw_with_nested(PipelineError(
            "rank " + std::to_string(rank_.index) + ", action " + std::to_string(reduce.index()) +
            " (" + schedule::to_string(reduce.action()) + "): " + error_sentence(e)));
      }
      continue;
    }
    // A receive held back waits for a compute that can run: not reached for a valid list.
    if (!may_receive(recv.index(), compute.index())) fail_stuck(compute.index());
    progress.phase = RankProgress::Phase::kWaitingForReceive;
    progress.action = recv.index();
    run_action(recv.index(), /*wait=*/true);
    recv.advance();
  }
  progress.compute = compute.index();
  progress.send = send.index();
  progress.recv = recv.index();
  progress.reduce = reduce.index();
}

int RankStep::world_rank(int pipeline_peer) const {
  return rank_.replica * in_.schedule.num_ranks() + pipeline_peer;
}

bool RankStep::run_action(size_t i, bool wait) {
  const Action& a = actions_[i];
  if (!wait) {
    rank_.progress.phase = RankProgress::Phase::kRunning;
    rank_.progress.action = i;
  }
  const Stream& stream = stream_for(a);
  const auto host_start = Clock::now();
  // A send starts once its tensor is ready (recorded in send(), after the send stream waits
  // for the compute that made it); timed from here it would span that compute, since the
  // idle send stream passes the event as soon as the host enqueues it.
  if (cuda_ && !schedule::is_send(a.kind)) rank_.starts[i].record(stream);
  try {
    Stage& stage = stage_of(a);
    switch (a.kind) {
      case ActionKind::kForward:
        forward(i, a, stage);
        break;
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput:
        backward(i, a, stage);
        break;
      case ActionKind::kBackwardWeight:
        backward_weight(a, stage);
        break;
      case ActionKind::kSendAct:
      case ActionKind::kSendGrad:
        send(i, a);
        break;
      case ActionKind::kRecvAct:
      case ActionKind::kRecvGrad:
        if (!recv(i, a, wait)) return false;
        break;
      case ActionKind::kAllReduceGrad:
        throw std::logic_error("an all-reduce runs on the reduction stream, not as a compute");
    }
  } catch (const std::exception& e) {
    // The cause stays nested: the executor tells a rank stopped by another's failure (the
    // transport aborted) from the failure that started it.
    std::throw_with_nested(PipelineError("rank " + std::to_string(rank_.index) + ", action " +
                                         std::to_string(i) + " (" + schedule::to_string(a) +
                                         "): " + error_sentence(e)));
  }
  if (cuda_) {
    rank_.ends[i].record(stream);
  } else {
    time_on_host(i, host_start);
  }
  sample_memory();
  return true;
}

bool RankStep::on_this_rank(int stage) const {
  return in_.schedule.placement.rank_of(stage) == rank_.pipeline_rank;
}

bool RankStep::inputs_ready(const Action& c) const {
  // Inputs made on this rank are there: the computes run in list order and the validator
  // puts every local producer first. Received ones are there once their receive completed.
  if (c.kind == ActionKind::kForward)
    return c.stage == 0 || on_this_rank(c.stage - 1) ||
           handoffs_.has(Handoffs::kInAct, c.stage, c.microbatch);
  if (c.kind == ActionKind::kBackwardWeight) return true;
  return c.stage == last_stage_ || on_this_rank(c.stage + 1) ||
         handoffs_.has(Handoffs::kInGrad, c.stage, c.microbatch);
}

bool RankStep::may_receive(size_t i, size_t compute_head) const {
  if (i < compute_head) return true;
  const auto last = last_received_.find({actions_[i].stage, actions_[i].kind});
  return last == last_received_.end() || last->second < compute_head;
}

bool RankStep::produced(const Action& s) const {
  const auto kind = s.kind == ActionKind::kSendAct ? Handoffs::kOutAct : Handoffs::kOutGrad;
  return handoffs_.has(kind, s.stage, s.microbatch);
}

void RankStep::fail_stuck(size_t i) const {
  // A validated schedule never gets here: every input it waits for has a receive.
  throw PipelineError("rank " + std::to_string(rank_.index) + ", action " + std::to_string(i) +
                      " (" + schedule::to_string(actions_[i]) +
                      "): waits for a tensor that no action left on this rank produces or "
                      "receives; run schedule::validate on the schedule to find the cause");
}

const Stream& RankStep::stream_for(const Action& a) const {
  if (schedule::is_send(a.kind)) return send_;
  if (schedule::is_recv(a.kind)) return recv_;
  return compute_;
}

Stage& RankStep::stage_of(const Action& a) {
  // Every action, transfers too, belongs to a stage of this rank.
  const auto found = rank_.stages.find(a.stage);
  if (found == rank_.stages.end())
    throw std::logic_error("rank does not hold stage " + std::to_string(a.stage));
  return *found->second;
}

Tensor RankStep::take_for_compute(Handoffs::Kind kind, int stage, int mb, const Action& a) {
  Handoff h = handoffs_.take(kind, stage, mb, a);
  // Received on another stream: the compute stream waits for it, and the allocator keeps the
  // block until the compute stream is done with it.
  if (cuda_ && h.ready) {
    h.ready->wait(compute_);
    record_stream(h.tensor, compute_.native());
  }
  return h.tensor;
}

Event* RankStep::ready_for_send(size_t i) {
  if (!cuda_) return nullptr;
  rank_.order[i].record(compute_);
  return &rank_.order[i];
}

void RankStep::forward(size_t i, const Action& a, Stage& stage) {
  const int mb = a.microbatch;
  Tensor input;
  if (a.stage == 0)
    input = tokens_.slice_rows(mb, 1).reshape({n_});
  else if (on_this_rank(a.stage - 1))
    input = take_for_compute(Handoffs::kOutAct, a.stage - 1, mb, a);
  else
    input = take_for_compute(Handoffs::kInAct, a.stage, mb, a);
  MicroBatchInputs inputs;
  inputs.tokens = n_;
  inputs.loss_scale = in_.loss_scale;
  if (a.stage == last_stage_) inputs.targets = targets_.slice_rows(mb, 1).reshape({n_});
  Tensor out = stage.forward(mb, input, inputs);
  if (a.stage == last_stage_) {
    loss_bytes_ += CachingAllocator::round_size(out.nbytes());
    losses_[mb] = out;
  } else {
    handoffs_.put(Handoffs::kOutAct, a.stage, mb, out,
                  on_this_rank(a.stage + 1) ? nullptr : ready_for_send(i));
  }
}

void RankStep::backward(size_t i, const Action& a, Stage& stage) {
  const int mb = a.microbatch;
  Tensor dy;  // none on the last stage: the loss head makes its own
  if (a.stage != last_stage_) {
    if (on_this_rank(a.stage + 1))
      dy = take_for_compute(Handoffs::kOutGrad, a.stage + 1, mb, a);
    else
      dy = take_for_compute(Handoffs::kInGrad, a.stage, mb, a);
  }
  Tensor dx =
      a.kind == ActionKind::kBackward ? stage.backward(mb, dy) : stage.backward_input(mb, dy);
  if (a.stage > 0)
    handoffs_.put(Handoffs::kOutGrad, a.stage, mb, dx,
                  on_this_rank(a.stage - 1) ? nullptr : ready_for_send(i));
}

void RankStep::backward_weight(const Action& a, Stage& stage) {
  stage.backward_weight(a.microbatch);
}

void RankStep::send(size_t i, const Action& a) {
  const auto kind = a.kind == ActionKind::kSendAct ? Handoffs::kOutAct : Handoffs::kOutGrad;
  Handoff h = handoffs_.take(kind, a.stage, a.microbatch, a);
  if (cuda_) {
    // Outputs for another rank carry the event of the compute that made them.
    if (!h.ready)
      throw std::logic_error(schedule::to_string(a) + " sends a tensor kept for this rank");
    h.ready->wait(send_);
    rank_.starts[i].record(send_);
    record_stream(h.tensor, send_.native());
  }
  rank_.transport->send(h.tensor, world_rank(a.peer), send_);
}

bool RankStep::recv(size_t i, const Action& a, bool wait) {
  // An activation enters the stage's first unit; a gradient leaves its last one.
  const ActivationSpec spec = in_.model.activation_at(
      a.kind == ActionKind::kRecvAct ? in_.ranges[a.stage].begin : in_.ranges[a.stage].end, n_);
  Tensor t = Tensor::empty(spec.shape, spec.dtype, ctx_.allocator_ptr(), recv_.native());
  if (wait)
    rank_.transport->recv(t, world_rank(a.peer), recv_);
  else if (!rank_.transport->try_recv(t, world_rank(a.peer), recv_))
    return false;  // not there yet: the buffer goes back to the allocator unused
  Event* ready = nullptr;
  if (cuda_) {
    rank_.order[i].record(recv_);
    ready = &rank_.order[i];
  }
  const auto kind = a.kind == ActionKind::kRecvAct ? Handoffs::kInAct : Handoffs::kInGrad;
  handoffs_.put(kind, a.stage, a.microbatch, t, ready);
  last_received_[{a.stage, a.kind}] = i;
  return true;
}

void RankStep::time_on_host(size_t i, std::chrono::steady_clock::time_point start) {
  timing_[i].start = microseconds_since(in_.start, start);
  timing_[i].end = microseconds_since(in_.start, Clock::now());
}

void RankStep::sample_memory() {
  // What the stages hold: live bytes less the step's baseline, the tensors in transit and
  // the losses.
  const size_t live = ctx_.allocator().stats().allocated_bytes;
  const size_t held = live - std::min(live, baseline_bytes_ + handoffs_.bytes() + loss_bytes_);
  peak_activations_ = std::max(peak_activations_, held);
}

void RankStep::finish_transfers() {
  // Bounded waits: a dead peer must not hang the end of the step.
  rank_.transport->synchronize(send_);
  rank_.transport->synchronize(recv_);
  rank_.transport->synchronize(compute_);
  if (!cuda_) return;
  for (size_t i = 0; i < actions_.size(); ++i) {
    timing_[i].start =
        reference_us_ + 1000.0 * Event::elapsed_ms(*rank_.reference, rank_.starts[i]);
    timing_[i].end = reference_us_ + 1000.0 * Event::elapsed_ms(*rank_.reference, rank_.ends[i]);
  }
}

void RankStep::end_of_step(PipelineStepResult& result) {
  // One all-reduce over all ranks: per-micro-batch loss sums of every replica (replica d's at
  // d*m: the step's order), then the squared norms of each parameter's D pieces
  // (replica_piece), each rank filling only its own slots so every sum below runs in one
  // order whatever the stage count. Every replica holds the summed gradient of its pieces
  // (all of it too unless the optimizer is sharded), so the pieces' squares give the global
  // norm, the same bits sharded or not; with one replica a piece is the whole parameter.
  // Last, one slot per rank for its stop request.
  const int replicas = in_.schedule.replicas;
  const int all_mbs = m_ * replicas;
  const size_t square_slots = static_cast<size_t>(in_.total_parameters) * replicas;
  const size_t stop_slots = all_mbs + square_slots;
  const auto world = static_cast<size_t>(in_.schedule.num_ranks()) * replicas;
  std::vector<double> reduced(stop_slots + world, 0.0);
  if (rank_.stages.count(last_stage_)) {
    const std::vector<double> loss_sums = ops::sum_each(ctx_, losses_);
    std::copy(loss_sums.begin(), loss_sums.end(), reduced.begin() + first_mb_);
  }
  piece_squares(reduced, static_cast<size_t>(all_mbs));
  if (in_.stop_request) reduced[stop_slots + rank_.index] = (*in_.stop_request)();
  rank_.transport->all_reduce_sum(reduced);
  double loss_sum = 0.0, squared_norm = 0.0;
  for (int mb = 0; mb < all_mbs; ++mb) loss_sum += reduced[mb];
  for (size_t i = 0; i < square_slots; ++i) squared_norm += reduced[all_mbs + i];
  const double norm = std::sqrt(squared_norm);
  const bool finite = std::isfinite(loss_sum) && std::isfinite(norm);
  if (in_.update && finite) {
    rank_.optimizer->step(in_.step, in_.lr, clip_scale(rank_.optimizer->config(), norm));
    ctx_.synchronize();
    if (rank_.optimizer->sharded()) gather_weights();
  }
  const int r = rank_.index;
  if (r == in_.reporting_rank) {
    result.loss_sum = loss_sum;
    result.grad_norm = norm;
    result.diverged = !finite;
    const auto stop = std::find_if(reduced.begin() + stop_slots, reduced.end(),
                                   [](double v) { return v != 0.0; });
    result.stop_signal = stop == reduced.end() ? 0 : static_cast<int>(*stop);
  }
  result.timing[r] = std::move(timing_);
  result.peak_activation_bytes[r] = peak_activations_;
  result.peak_allocated_bytes[r] = ctx_.allocator().stats().peak_allocated_bytes;
}

}  // namespace conveyor
