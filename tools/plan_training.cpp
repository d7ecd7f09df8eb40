// Planning a training run: plan_training profiles the reference model on its device (each
// micro-batch count at its own size, within the memory there is, and the gradient all-reduce
// on the run's transport) and ranks the layouts. `conveyor plan` prints what it finds, and
// `conveyor train --partition auto` runs the fastest pipeline.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <new>
#include <string>
#include <vector>

#include "comm/transport_factory.h"
#include "engine/core/allocator.h"
#include "engine/core/number_text.h"
#include "engine/pipeline/identical_units.h"
#include "engine/pipeline/memory_estimate.h"
#include "engine/pipeline/profile.h"
#include "engine/schedule/generators.h"
#include "engine/train/train_config.h"
#include "tools/cli_common.h"
#include "tools/flag_terms.h"
#include "tools/plan_command.h"
#include "tools/run_flags.h"

namespace conveyor::cli {

namespace {

// The transport the ranks of a run on `devices` would use, made in this process for timing:
// what `requested` resolves to when it runs in one process, else the in-process one. `what`
// names it, and says when it is not the run's.
comm::Transports transports_to_time(comm::TransportKind requested,
                                    const std::vector<Device>& devices, std::string* what) {
  comm::TransportKind kind = comm::TransportKind::kInProcess;
  std::string why_not;
  try {
    kind = comm::choose_transport(requested, devices);
  } catch (const std::invalid_argument& e) {
    why_not = e.what();
  }
  if (comm::spans_processes(kind)) {
    why_not = std::string("the run's ") + comm::transport_name(kind) +
              " transport spans processes and cannot be timed in one";
    kind = comm::TransportKind::kInProcess;
  }
  std::vector<int> all(devices.size());
  for (size_t r = 0; r < all.size(); ++r) all[r] = static_cast<int>(r);
  *what = comm::transport_name(kind) == std::string("inproc") ? "in-process"
                                                              : comm::transport_name(kind);
  if (!why_not.empty()) *what += " (" + why_not + ")";
  return comm::make_transports(kind, devices, std::chrono::milliseconds(60000), {all});
}

// Before anything is built: every unit must fit one device with the least any layout keeps
// of it (its parameters and gradients, its share of an optimizer state sharded over every
// rank, what it keeps of one token; the trainer's up-front estimate), or no layout can hold
// it, and profiling it would fail for want of memory after a long wait.
// `available`: the host memory available now on the CPU, 0 on a GPU (the cap is the limit).
void check_units_fit(const ModelDescription& model, const TrainConfig& config, double cap,
                     const std::string& cap_source, int sharing, double available) {
  std::string source = cap_source;
  double limit = cap;
  if (available > 0 && (limit <= 0 || available / sharing < limit)) {
    limit = available / sharing;
    source = "the memory available now" +
             (sharing > 1 ? " shared by " + std::to_string(sharing) + " ranks" : std::string());
  }
  if (limit <= 0) return;
  const schedule::Schedule one = schedule::generate(schedule::ScheduleKind::k1F1B, 1, 1, 1);
  const double ranks = static_cast<double>(config.stages);
  for (int64_t u = 0; u < model.num_units; ++u) {
    const RankMemoryEstimate e =
        estimate_rank_memory(model, {{u, u + 1}}, one, config.optimizer.kind, 1).front();
    const double least =
        e.parameter_bytes + e.gradient_bytes + e.optimizer_bytes / ranks + e.activation_bytes;
    if (least <= limit) continue;
    throw UsageError(
        "unit " + std::to_string(u) + " of the model needs at least " + bytes_text(least) +
        " on one device in any layout (parameters " + bytes_text(e.parameter_bytes) +
        ", gradients " + bytes_text(e.gradient_bytes) + ", " +
        (config.stages > 1 ? "1/" + std::to_string(config.stages) + " of " : std::string()) +
        "the optimizer state " + bytes_text(e.optimizer_bytes / ranks) +
        ") but the cap per rank is " + bytes_text(limit) + " (" + source + "); " +
        (config.memory_limit_bytes > 0 ? "raise --memory-cap, or use" : "use") +
        " a smaller model (--d-model, --hidden, --vocab)");
  }
}

// Profiling builds the first unit of each group of identical units once (profile_units) and
// runs them one at a time on micro-batches of batch / m tokens for every count m, on the CPU
// with the other ranks' copies alongside (`copies` in all), each within its share of the
// memory `available` now. While the profile of the counts of `options` does not fit that
// share (by the trainer's estimate, from the model description: the built units' parameters
// and gradients, their inputs at every size, and the largest run: what a unit keeps, its
// workspace and the step's ids), the count of the largest micro-batch is dropped and named in
// `dropped`; UsageError when no count is left.
void keep_profilable_counts(const ModelDescription& model, const TrainConfig& config,
                            double available, int copies, PlanOptions& options,
                            std::string& dropped, std::string& why) {
  if (available <= 0) return;
  const schedule::Schedule one = schedule::generate(schedule::ScheduleKind::k1F1B, 1, 1, 1);
  // Per count: the inputs of the units built, the largest run and its unit, the groups.
  struct AtCount {
    int m;
    double state = 0, inputs = 0, run = 0;
    int64_t unit = 0, groups = 0;
  };
  std::vector<AtCount> counts;
  for (const int m : options.microbatch_counts) {
    const int64_t tokens = config.batch_tokens / m;
    const std::vector<int64_t> leaders = identical_unit_leaders(model, tokens);
    AtCount& at = counts.emplace_back(AtCount{m});
    for (int64_t u = 0; u < model.num_units; ++u) {
      if (leaders[u] != u) continue;
      ++at.groups;
      // A profile counts the optimizer state without allocating it.
      const RankMemoryEstimate e =
          estimate_rank_memory(model, {{u, u + 1}}, one, config.optimizer.kind, tokens).front();
      const ActivationSpec in = model.boundary_spec(u, tokens),
                           out = model.boundary_spec(u + 1, tokens);
      at.state += e.parameter_bytes + e.gradient_bytes;
      at.inputs += allocated_bytes(in.shape, in.dtype) + allocated_bytes(out.shape, out.dtype);
      const double own = e.total() - e.optimizer_bytes - e.parameter_bytes - e.gradient_bytes;
      if (own > at.run) at.run = own, at.unit = u;
    }
  }
  while (!counts.empty()) {
    double state = 0, inputs = 0;
    const AtCount* largest = &counts.front();  // the largest micro-batch: the fewest of them
    const AtCount* widest = &counts.front();   // the largest run
    for (const AtCount& at : counts) {
      state = std::max(state, at.state), inputs += at.inputs;
      if (at.m < largest->m) largest = &at;
      if (at.run > widest->run) widest = &at;
    }
    const double need = state + inputs + widest->run;
    if (need * copies <= available) break;
    dropped += (dropped.empty() ? "" : ", ") + std::to_string(largest->m);
    why = "a micro-batch of " + std::to_string(config.batch_tokens / largest->m) +
          " tokens needs about " + bytes_text(need) + " for unit " + std::to_string(widest->unit) +
          "'s run with the " + std::to_string(widest->groups) + " distinct units built" +
          (copies > 1 ? " on each of the " + std::to_string(copies) + " ranks sharing the CPU"
                      : std::string()) +
          ", and the memory available now is " + bytes_text(available);
    counts.erase(counts.begin() + (largest - counts.data()));
  }
  if (counts.empty())
    throw UsageError("cannot profile the model: " + why +
                     "; give fewer --batch-tokens, or more --microbatches (smaller micro-batches)");
  options.microbatch_counts.clear();
  for (const AtCount& at : counts) options.microbatch_counts.push_back(at.m);
}

}  // namespace

PlannedRun plan_training(const TrainConfig& config, Device device, int repetitions, bool print,
                         const PlanConstraints& constraints) {
  if (repetitions < 1)
    throw UsageError("--repetitions must be at least 1, got " + std::to_string(repetitions));
  const ModelDescription model = reference_model(config.model);
  const int p = config.stages;
  if (config.batch_tokens < p)
    throw UsageError("a batch of " + std::to_string(config.batch_tokens) + " tokens cannot feed " +
                     std::to_string(p) + " devices; use at least " + std::to_string(p) + " tokens");
  // Where the ranks of the run would be, every replica's as the trainer places them: a GPU
  // each when there are enough, else all on one device, which then shares its memory between
  // them (the P x D ranks of --dp D, not the P of the pipeline planned).
  const int ranks = p * constraints.replicas;
  const std::string stages_by_replicas =
      counted(p, "stage") + " x --dp " + std::to_string(constraints.replicas);
  // Every rank's profile runs in this process, under a launcher too.
  check_threads_in_process(
      config.cpu_threads, ranks, device,
      constraints.replicas > 1 ? stages_by_replicas : "--stages " + std::to_string(p));
  const bool spread = device.is_cuda() && cuda_device_count() >= ranks;
  std::vector<Device> devices(static_cast<size_t>(p), device);
  if (spread)
    for (int r = 0; r < p; ++r) devices[static_cast<size_t>(r)] = Device::cuda(r);
  // GPU ranks as processes each run on the GPU their process was given, however many this
  // process sees, and hold the cap alone (the check before the run counts them so).
  const int sharing = ranks_sharing_device_memory(device, ranks, cuda_device_count(),
                                                  constraints.one_rank_per_process);
  // The ranks that share a device share its memory, the cap given as much as the device's
  // own: the check before the run, and its allocators, hold their sum to it. On CUDA each
  // rank's context takes its cuBLASLt workspace from that memory too, which the check counts,
  // so the stages are planned in what is left.
  // Planned against the figure the run's check holds it to: the memory the device can give
  // now, or the limit given when smaller; a plan against the device's whole memory could be
  // one the check then refuses.
  // CPU ranks as processes: each process's allocators hold the cap for its own rank, and the
  // memory available now is shared by every rank, as the processes may share one machine.
  const bool cap_per_process = constraints.one_rank_per_process && device.is_cpu();
  const DeviceMemoryLimit limit =
      device_memory_limit(device, cap_per_process ? 0 : config.memory_limit_bytes);
  const double memory = limit.bytes;
  // The cap given, as the run holds it; with CPU ranks as processes only when each rank's
  // share of the memory available now is not smaller.
  const double given = static_cast<double>(config.memory_limit_bytes);
  const bool given_limit = given > 0 && (cap_per_process ? memory <= 0 || given <= memory / sharing
                                                         : limit.note.empty());
  std::string cap_source = given_limit ? "the memory limit given" : limit.source;
  double cap = 0;
  // Whether the cap is an equal share of one device that more stages would divide further
  // (all ranks on the CPU, or on one GPU): the stages a layout would fit on are counted so.
  bool cap_shared = false;
  if (cap_per_process && given_limit) {
    cap = given;
    cap_source += ", which each process holds for its own rank";
  } else if (memory > 0) {
    if (sharing > 1 || !given_limit) cap_source += " (" + bytes_text(memory) + ")" + limit.note;
    if (sharing > 1)
      cap_source += " shared by " + std::to_string(sharing) + " ranks" +
                    (constraints.replicas > 1 ? " (" + stages_by_replicas + ")" : std::string());
    if (cap_per_process && given > 0)
      cap_source += ", less than the memory limit (" + bytes_text(given) +
                    ") each process holds for its own rank";
    try {
      const RankMemoryShare share = rank_memory_share(memory, sharing, device, cap_source);
      cap = share.bytes;
      cap_source = share.source;
      cap_shared = device.is_cpu() || sharing > 1;
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());
    }
  } else {
    cap_source = "none: the device's memory is unknown";
  }
  // Profiled as the run will be: with each rank's share of the CPU threads, and on the CPU
  // with the other ranks' work running alongside on the same cores.
  DeviceContextOptions context_options;
  context_options.allow_tf32 = config.allow_tf32;
  context_options.cpu_threads = cpu_threads_per_rank(config.cpu_threads, ranks);
  // On the CPU each copy of the profile takes at most its share of the memory available now:
  // past it the allocator fails with a sentence, where the system would end the process (the
  // kernel's out-of-memory killer) with none.
  const int copies = device.is_cuda() ? 1 : ranks;
  const double available = device.is_cpu() ? cpu_available_bytes() : 0.0;
  if (available > 0) context_options.memory_limit_bytes = static_cast<size_t>(available / copies);
  DeviceContext ctx(device, context_options);
  ProfileOptions profile_options;
  profile_options.repetitions = repetitions;
  profile_options.seed = config.seed;
  profile_options.optimizer_slots = config.optimizer.kind == "sgd" ? 1 : 2;
  if (!device.is_cuda()) {
    profile_options.neighbours = ranks - 1;
    profile_options.neighbour_context = context_options;
  }
  // Each candidate micro-batch count is measured at its own size, all in one profile: times do
  // not scale linearly once a unit's working set leaves the caches.
  PlanOptions options;
  options.num_ranks = p;
  options.batch_tokens = config.batch_tokens;
  options.memory_cap = cap;
  options.cap_shared_by_ranks = cap_shared;
  options.cap_reserve = rank_context_bytes(device);
  options.recompute = config.recompute;
  PlannedRun out;
  out.units = model.num_units;
  out.stages = p;
  out.replicas = constraints.replicas;
  if (constraints.microbatches) {
    options.microbatch_counts.push_back(static_cast<int>(*constraints.microbatches));
    out.constraints +=
        " --microbatches " + std::to_string(*constraints.microbatches * constraints.replicas);
    if (constraints.replicas > 1)
      out.constraints += " over --dp " + std::to_string(constraints.replicas);
  } else {
    options.microbatch_counts = default_microbatch_counts(p, config.batch_tokens);
  }
  // What the caller fixed: only those pipelined layouts are planned, so that the fastest of
  // them is the one proven fastest; the replicas stay (the verdict still says when they
  // would be faster).
  options.schedule = constraints.schedule;
  options.chunks = constraints.chunks;
  // zbv takes --chunks 1 as its own V of 2, as a run without auto does.
  if (constraints.schedule && constraints.chunks)
    options.chunks = schedule::chunks_per_rank(*constraints.schedule, *constraints.chunks);
  if (constraints.schedule)
    out.constraints +=
        std::string(" --schedule ") + schedule::schedule_kind_name(*constraints.schedule);
  if (constraints.chunks) {
    out.constraints += " --chunks " + std::to_string(*constraints.chunks);
    if (*constraints.chunks >= 2) options.interleaved_chunks = {*constraints.chunks};
  }
  if (!out.constraints.empty()) out.constraints.erase(0, 1);
  check_units_fit(model, config, cap, cap_source, sharing, available);
  std::string dropped, why;
  keep_profilable_counts(model, config, available, copies, options, dropped, why);
  // Every count's size in one profile, which interleaves them; the largest dropped while it
  // does not fit: the estimate counts live bytes, and the allocator's share is of bytes held
  // from the system, which its cache of freed blocks can take past the live ones.
  std::vector<int> profiled = options.microbatch_counts;
  std::vector<UnitCosts> measured;
  while (!profiled.empty()) {
    std::vector<int64_t> sizes;
    for (const int m : profiled) sizes.push_back(config.batch_tokens / m);
    const auto fewest = std::min_element(profiled.begin(), profiled.end());
    const std::string largest = std::to_string(config.batch_tokens / *fewest);
    try {
      measured = profile_units(model, ctx, sizes, profile_options);
      break;
    } catch (const OutOfMemoryError& e) {
      why = "at micro-batches of " + largest + " tokens, " + e.what();
    } catch (const std::bad_alloc&) {
      why = "at micro-batches of " + largest + " tokens the host ran out of memory";
    }
    dropped += (dropped.empty() ? "" : ", ") + std::to_string(*fewest);
    profiled.erase(fewest);
  }
  if (profiled.empty())
    throw UsageError("cannot profile the model: " + why +
                     "; give fewer --batch-tokens, or more --microbatches (smaller micro-batches)");
  options.microbatch_counts = profiled;
  // The gradient sum of data-parallel replicas, at the model's size, on the run's transport.
  std::string transport;
  AllReduceCost reduce;
  double parameter_bytes = 0;
  for (const UnitCost& u : measured.front().units) parameter_bytes += u.parameter_bytes;
  if (p > 1) {
    comm::Transports made = transports_to_time(config.transport, devices, &transport);
    reduce = measure_allreduce(made.per_rank, static_cast<size_t>(parameter_bytes), 2, repetitions);
    options.allreduce_latency = reduce.latency;
    options.allreduce_bandwidth = reduce.bandwidth;
    options.gradient_bucket_bytes =
        config.gradient_bucket_mib.value_or(kDefaultGradientBucketMiB) * 1024.0 * 1024.0;
  }
  out.costs = measured.front();
  try {
    out.plan = plan(measured, options);
  } catch (const PlanError& e) {
    throw UsageError(e.what());
  }
  const int64_t tokens = out.costs.microbatch_tokens;
  if (print) {
    std::printf(
        "profile %s on %s, %lld tokens per micro-batch (lower quartile of %d runs a unit, "
        "identical units timed as one, +- its standard error; the plan also used sizes measured "
        "for each micro-batch count)\n",
        model.name.c_str(), device.to_string().c_str(), static_cast<long long>(tokens),
        repetitions);
    std::printf("%6s %10s %10s %10s %7s %12s %12s\n", "unit", "F (ms)", "I (ms)", "W (ms)",
                "+- (%)", "act (KiB)", "state (KiB)");
    for (size_t u = 0; u < out.costs.units.size(); ++u) {
      const UnitCost& c = out.costs.units[u];
      std::printf("%6zu %10.3f %10.3f %10.3f %7.1f %12.1f %12.1f\n", u, c.forward * 1e3,
                  c.backward_input * 1e3, c.backward_weight * 1e3, c.time_error * 100,
                  c.activation_bytes / 1024, c.state_bytes / 1024);
    }
    std::printf("transfer of one boundary activation: %.3f ms (in-process transport)\n",
                out.costs.transfer_seconds * 1e3);
    if (p > 1)
      std::printf(
          "gradient all-reduce over %d ranks (%s transport): %.3f ms for %s, %.3f ms for %s "
          "(latency %.1f us a step, %.2f GB/s)\n",
          p, transport.c_str(), reduce.small_seconds * 1e3,
          bytes_text(static_cast<double>(reduce.small_bytes)).c_str(), reduce.large_seconds * 1e3,
          bytes_text(static_cast<double>(reduce.large_bytes)).c_str(), reduce.latency * 1e6,
          reduce.bandwidth / 1e9);
    std::printf("memory cap per rank: %s (%s)\n", cap > 0 ? bytes_text(cap).c_str() : "none",
                cap_source.c_str());
    if (!dropped.empty())
      std::printf("note   micro-batch count(s) %s not planned: %s\n", dropped.c_str(), why.c_str());
    if (!out.constraints.empty())
      std::printf("only layouts with %s (as given)\n", out.constraints.c_str());
    std::printf("\n%s", in_flag_terms(format_plan(out.plan)).c_str());
  }
  return out;
}

}  // namespace conveyor::cli
