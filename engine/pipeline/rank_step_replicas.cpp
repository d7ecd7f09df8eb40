// The data-parallel side of a rank's step: its stages' gradients packed into buckets, summed
// over the replicas (or reduce-scattered, with a sharded optimizer) and copied back; the
// sharded weights gathered after the optimizer step; the pieces of the global norm.
#include <algorithm>
#include <string>

#include "engine/pipeline/rank_step.h"
#include "layers/ops.h"

namespace conveyor {

using Clock = std::chrono::steady_clock;

std::vector<size_t> packed_shard_bounds(const std::vector<Parameter*>& params, int replicas) {
  std::vector<size_t> bounds{0};
  for (int d = 0; d < replicas; ++d) {
    size_t at = bounds.back();
    for (const Parameter* p : params)
      at += static_cast<size_t>(replica_piece(p->value.numel(), d, replicas).count);
    bounds.push_back(at);
  }
  return bounds;
}

namespace {

// Calls visit(parameter, piece, position) for replica d's piece of each of `params` that is
// not empty, with the piece's position in the packing by replica whose bounds are `bounds`.
template <class Visit>
void for_each_piece(const std::vector<Parameter*>& params, const std::vector<size_t>& bounds, int d,
                    Visit visit) {
  const int replicas = static_cast<int>(bounds.size()) - 1;
  size_t at = bounds[d];
  for (Parameter* p : params) {
    const ParameterShard piece = replica_piece(p->value.numel(), d, replicas);
    if (piece.count == 0) continue;
    visit(*p, piece, at);
    at += static_cast<size_t>(piece.count);
  }
}

// Calls visit(part, position) for the part of each segment of `layout` (a stage's flattened
// gradients) within the flat positions [begin, end), `position` being where the part starts.
template <class Visit>
void for_each_segment(const std::vector<GradientSegment>& layout, size_t begin, size_t end,
                      Visit visit) {
  for (const GradientSegment& s : layout) {
    const size_t lo = std::max(begin, s.at),
                 hi = std::min(end, s.at + static_cast<size_t>(s.count));
    if (lo >= hi) continue;
    visit(s.parameter->grad.view(s.offset + static_cast<int64_t>(lo - s.at),
                                 {static_cast<int64_t>(hi - lo)}),
          lo);
  }
}

Tensor flat_piece(const Tensor& t, ParameterShard piece) {
  return t.view(piece.offset, {piece.count});
}

}  // namespace

bool RankStep::weight_grads_done(const Action& reduce, size_t compute_head) const {
  for (const auto& [stage, at] : last_weight_grad_)
    if (stage == reduce.stage) return compute_head > at;
  return true;
}

const std::vector<GradientSegment>& RankStep::gradient_layout(int stage) {
  if (const auto known = gradient_layouts_.find(stage); known != gradient_layouts_.end())
    return known->second;
  const auto params = rank_.stages.at(stage)->parameters();
  for (const Parameter* p : params)
    check_dtype(p->grad, DType::kF32, "a gradient summed over replicas");
  std::vector<GradientSegment>& out = gradient_layouts_[stage];
  if (rank_.optimizer->sharded()) {
    // Each replica's range, packed; only this replica's comes back summed.
    const std::vector<size_t>& bounds = shard_bounds_of(stage);
    for (int d = 0; d < in_.schedule.replicas; ++d)
      for_each_piece(params, bounds, d, [&](Parameter& p, ParameterShard piece, size_t at) {
        out.push_back({&p, piece.offset, piece.count, at});
      });
  } else {
    size_t at = 0;
    for (Parameter* p : params) {
      out.push_back({p, 0, p->grad.numel(), at});
      at += static_cast<size_t>(p->grad.numel());
    }
  }
  return out;
}

schedule::BucketRange RankStep::bucket_of(const Action& a,
                                          const std::vector<GradientSegment>& layout) const {
  const size_t total =
      layout.empty() ? 0 : layout.back().at + static_cast<size_t>(layout.back().count);
  const int buckets = buckets_.at(a.stage);
  if (static_cast<size_t>(buckets) > std::max<size_t>(total, 1))
    throw std::invalid_argument("stage " + std::to_string(a.stage) + " has " +
                                std::to_string(total) + " gradient elements, too few for " +
                                std::to_string(buckets) + " all-reduce buckets");
  return schedule::gradient_bucket(total, a.microbatch, buckets);
}

void RankStep::pack_bucket(const Action& a, std::vector<float>& values) {
  const auto& layout = gradient_layout(a.stage);
  const schedule::BucketRange range = bucket_of(a, layout);
  values.resize(range.end - range.begin);
  // On the compute stream, which made the gradients, and waiting for it alone: a wait for the
  // whole device would also wait for this rank's NCCL transfers, and a receive among them can
  // wait for a peer that waits for a send this rank has not issued yet. The compute stream
  // itself may wait for a receive: the transport's wait is bounded and hears of a lost peer,
  // where the copies' own wait for their stream would not.
  if (cuda_) rank_.transport->synchronize(compute_);
  for_each_segment(layout, range.begin, range.end, [&](const Tensor& part, size_t at) {
    copy_to_host(values.data() + (at - range.begin), part, part.nbytes(), compute_.native());
  });
}

bool RankStep::may_start_reduce(const Action& a) {
  if (buckets_in_flight_.size() < 2) return true;
  const schedule::BucketRange range = bucket_of(a, gradient_layout(a.stage));
  const size_t bytes = (range.end - range.begin) * sizeof(float);
  return bytes_in_flight_ + bytes <= rank_.bucket_bytes_in_flight;
}

void RankStep::start_reduce(size_t i, const Action& a) {
  rank_.progress.phase = RankProgress::Phase::kRunning;
  rank_.progress.action = i;
  try {
    BucketInFlight& bucket = buckets_in_flight_.emplace_back();
    bucket.action = i;
    bucket.start = Clock::now();
    if (!spare_values_.empty()) {
      bucket.values = std::move(spare_values_.back());
      spare_values_.pop_back();
    }
    // The bucket's part of the stage's gradients, flat on the host.
    pack_bucket(a, bucket.values);
    bytes_in_flight_ += bucket.values.size() * sizeof(float);
    if (cuda_) rank_.starts[i].record(compute_);
    if (rank_.optimizer->sharded()) {
      const schedule::BucketRange range = bucket_of(a, gradient_layout(a.stage));
      for (size_t b : shard_bounds_of(a.stage))
        bucket.bounds.push_back(std::clamp(b, range.begin, range.end) - range.begin);
      bucket.call = rank_.transport->start_group_reduce_scatter(bucket.values, rank_.replica_group,
                                                                bucket.bounds);
    } else {
      bucket.call = rank_.transport->start_group_sum(bucket.values, rank_.replica_group);
    }
  } catch (const std::exception& e) {
    std::throw_with_nested(PipelineError("rank " + std::to_string(rank_.index) + ", action " +
                                         std::to_string(i) + " (" + schedule::to_string(a) +
                                         "): " + error_sentence(e)));
  }
}

void RankStep::finish_oldest_reduce() {
  BucketInFlight& bucket = buckets_in_flight_.front();
  const size_t i = bucket.action;
  const Action& a = actions_[i];
  const auto& layout = gradient_layout(a.stage);
  const schedule::BucketRange range = bucket_of(a, layout);
  size_t begin = range.begin, end = range.end;
  if (rank_.optimizer->sharded()) {
    // The rest of the gradients stays this replica's own: nothing reads it (the optimizer and
    // the norm take this replica's pieces only).
    const std::vector<size_t>& bounds = shard_bounds_of(a.stage);
    begin = std::clamp(bounds[rank_.replica], range.begin, range.end);
    end = std::clamp(bounds[rank_.replica + 1], range.begin, range.end);
  }
  // On the compute stream, which reads the gradients next (see pack_bucket).
  if (cuda_) rank_.transport->synchronize(compute_);
  for_each_segment(layout, begin, end, [&](const Tensor& part, size_t at) {
    copy_from_host(part, bucket.values.data() + (at - range.begin), part.nbytes(),
                   compute_.native());
  });
  if (cuda_) {
    rank_.ends[i].record(compute_);
  } else {
    time_on_host(i, bucket.start);
  }
  bucket.call.reset();
  bytes_in_flight_ -= bucket.values.size() * sizeof(float);
  spare_values_.push_back(std::move(bucket.values));
  buckets_in_flight_.pop_front();
}

const std::vector<size_t>& RankStep::shard_bounds_of(int stage) const {
  const auto found = rank_.stages.find(stage);
  return rank_.shard_bounds.at(static_cast<size_t>(std::distance(rank_.stages.begin(), found)));
}

void RankStep::gather_weights() {
  // Stage by stage, in the same order on every replica, packed by replica as the gradients
  // were: this replica's pieces go out, the others' come in.
  for (auto& [id, stage] : rank_.stages) {
    const auto params = stage->parameters();
    const std::vector<size_t>& bounds = shard_bounds_of(id);
    std::vector<float> values(bounds.back());
    for_each_piece(params, bounds, rank_.replica,
                   [&](Parameter& p, ParameterShard piece, size_t at) {
                     const Tensor part = flat_piece(p.value, piece);
                     copy_to_host(values.data() + at, part, part.nbytes(), compute_.native());
                   });
    rank_.transport->start_group_gather(values, rank_.replica_group, bounds)->wait();
    for (int d = 0; d < in_.schedule.replicas; ++d) {
      if (d == rank_.replica) continue;
      for_each_piece(params, bounds, d, [&](Parameter& p, ParameterShard piece, size_t at) {
        const Tensor part = flat_piece(p.value, piece);
        copy_from_host(part, values.data() + at, part.nbytes(), compute_.native());
      });
    }
  }
}

void RankStep::piece_squares(std::vector<double>& reduced, size_t first_slot) {
  const int replicas = in_.schedule.replicas;
  const auto parameters = rank_.parameters();
  std::vector<Tensor> pieces;
  std::vector<size_t> slots;
  for (size_t i = 0; i < parameters.size(); ++i) {
    const ParameterShard piece =
        replica_piece(parameters[i]->grad.numel(), rank_.replica, replicas);
    if (piece.count == 0) continue;  // its slot stays 0
    pieces.push_back(flat_piece(parameters[i]->grad, piece));
    slots.push_back(first_slot + static_cast<size_t>(rank_.global_index[i]) * replicas +
                    rank_.replica);
  }
  const std::vector<double> squares = ops::sum_squares_each(ctx_, pieces);
  for (size_t j = 0; j < slots.size(); ++j) reduced[slots[j]] = squares[j];
}

}  // namespace conveyor
