// `conveyor train`: builds a TrainConfig from a preset and flags (train_flags.h), checks what
// must hold before the first step (train_setup.h), trains, prints one line per logged step and
// a summary (train_report.h), and optionally writes one JSON object per step.

#include <atomic>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "comm/launch_environment.h"
#include "comm/mpi_transport.h"
#include "engine/core/number_text.h"
#include "engine/core/test_pause.h"
#include "engine/pipeline/memory_estimate.h"
#include "engine/pipeline/optimizer.h"
#include "engine/schedule/chrome_trace.h"
#include "engine/schedule/measured_timing.h"
#include "engine/train/checkpoint_shard.h"
#include "engine/train/data.h"
#include "engine/train/trainer.h"
#include "tools/checkpoint_flags.h"
#include "tools/cli_common.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"
#include "tools/cuda_module_loading.h"
#include "tools/error_line.h"
#include "tools/held_out_evaluation.h"
#include "tools/interrupt.h"
#include "tools/mpi_launch.h"
#include "tools/output_file.h"
#include "tools/resume_settings.h"
#include "tools/run_flags.h"
#include "tools/train_flags.h"
#include "tools/train_report.h"
#include "tools/train_setup.h"

namespace conveyor::cli {
namespace {

// A process started with CONVEYOR_TEST_PAUSE_AT=<point> in its environment stops for good at
// that point: "setup" (before the model, the data and the transport are made), "evaluation"
// (as the held-out evaluation starts), "checksum" (before the weights' checksum over every
// rank) or "end" (before the processes meet at the end of the run), while the other
// processes go on into what waits for it: what the failure tests stop or kill, to see every
// other rank end by itself instead of waiting forever.
void pause_if_asked_at(const char* point) { pause_if_asked("CONVEYOR_TEST_PAUSE_AT", point, "at"); }

// What the stop request gives, in place of a signal, once rank 0 could not write its
// --log-json file: every process then stops after the same step and saves it, as on a signal.
constexpr int kStopForFailedOutput = -1;

// The device this process trains on (said, and checked against the other processes' under
// MPI), then the plan that cuts the pipeline on it (--plan, --partition auto) and the threads
// its ranks take. Sets config.device.
Device place_and_plan(const TrainFlags& f, const CLI::App& cmd, const MpiSession& mpi,
                      TrainConfig& config) {
  std::string note;
  Device device;
  try {
    device = resolve_device(config.device, &note);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  if (!note.empty()) std::printf("conveyor: %s\n", note.c_str());
  device = process_device(mpi, f.run.device, device);
  std::vector<std::string> ignored = f.run.ignored_on(cmd, device);
  // As --tf32 on the CPU: said from the placement the run got, so that a run does not look
  // as if its ranks were placed. A process of a launch holds one rank, on the device its
  // node-local rank picks (process_device) or the CPU: that reason holds on either.
  if (config.placement == RankPlacement::kShared && mpi.active())
    ignored.push_back(
        "--placement shared puts the ranks of a process on one GPU and does nothing when each "
        "process holds one rank (under mpirun or srun)");
  else if (config.placement == RankPlacement::kShared && device.is_cpu())
    ignored.push_back("--placement shared puts the ranks on one GPU and does nothing on the CPU");
  for (const std::string& note : ignored) std::printf("note   %s\n", note.c_str());
  // A collective: every rank asks or none, which the agreed --device flag decides; CPU runs
  // have no GPU to share and skip its round trip.
  if (f.run.device != "cpu") check_gpus_not_shared(mpi, device);
  config.device = device;
  try {
    apply_planning(f, cmd, mpi, device, config);
  } catch (const UsageError& e) {  // a plan for another batch than the checkpoint's, say
    throw UsageError(with_inherited_origin(e.what(), f.checkpoint.inherited));
  }
  // Under a launcher of several processes each process holds one rank.
  check_threads_in_process(
      config.cpu_threads,
      comm::launched_process_count() > 1 ? 1 : int64_t{config.stages} * config.data_parallel,
      device,
      "--stages " + std::to_string(config.stages) + " x --dp " +
          std::to_string(config.data_parallel));
  return device;
}

void run_train(TrainFlags& f, const CLI::App& cmd) {
  load_cuda_kernels_eagerly_if_nccl(f);  // before CUDA starts: MPI_Init or the device's count
  check_checkpoint_flags(f.checkpoint, cmd);
  refuse_outputs_over_inputs(f);
  TrainConfig config = resolve_config(f, cmd);
  // Before the trainer, which builds this rank's MPI transport; after it, MPI_Finalize.
  MpiSession mpi(wants_mpi(config), config.transport_timeout);
  // Only under MPI: the fields read every file the run names.
  if (mpi.active()) check_same_configuration(mpi, configuration_fields(f, config));
  quiet_unless_rank_zero(mpi, f);
  const Device device = place_and_plan(f, cmd, mpi, config);

  // Every output file is opened (and the log locked) before any work, not after the last step.
  // The log is written line by line as the run goes, so it is the file itself, locked against
  // a second run; the trace is written whole at the end, in place of the file only then (a
  // run that fails leaves the file as it was).
  std::optional<OutputFile> json_log;
  std::optional<ReplacedFile> trace;
  if (!f.log_json.empty()) json_log.emplace(f.log_json, "--log-json", /*lock=*/true);
  if (!f.trace.empty()) trace.emplace(f.trace, "--trace");

  std::unique_ptr<Trainer> trainer;
  pause_if_asked_at("setup");
  const auto out_of_memory_building = [](const std::string& detail) {
    return UsageError(
        "out of memory while building the model, its optimizer state and the "
        "pipeline" +
        detail + "; use a smaller model or --memory-cap to see the estimate");
  };
  // The --data file is read before the model is built, so that held-out batches it cannot
  // hold are refused at once, not after the seconds a large model takes to build.
  std::shared_ptr<TokenSource> data;
  try {
    if (!config.data_path.empty()) data = make_token_source(config, config.model.vocab);
  } catch (const std::invalid_argument& e) {
    throw UsageError(with_inherited_origin(e.what(), f.checkpoint.inherited));
  }
  if (data) {
    const uint64_t bytes = dynamic_cast<const FileSource&>(*data).bytes();
    try {
      check_eval_fits(config, f.eval_batches, bytes);
    } catch (const UsageError& e) {  // from the agreed flags and --data contents: alike everywhere
      refuse_on_every_rank(mpi, with_inherited_origin(e.what(), f.checkpoint.inherited));
    }
  }
  try {
    trainer = std::make_unique<Trainer>(config, data);
  } catch (const comm::ProcessCountMismatch& e) {
    refuse_on_every_rank(mpi, e.what());
  } catch (const std::invalid_argument& e) {  // schedule, partition, placement, memory too
    throw UsageError(with_inherited_origin(e.what(), f.checkpoint.inherited));
  } catch (const std::bad_alloc&) {
    throw out_of_memory_building("");
  } catch (const OutOfMemoryError& e) {  // the allocator's, its request and stats said
    throw out_of_memory_building(" (" + std::string(e.what()) + ")");
  }
  // The ranks are connected: an error from here on may be one process's alone.
  usage_errors_are_this_process_own();
  std::printf("model  %s\n", trainer->model().name.c_str());
  std::printf("data   %s\n", trainer->source().describe().c_str());
  std::printf("device %s | %s x %s in %s | %s lr %s\n", device.to_string().c_str(),
              counted(config.steps, "step").c_str(), counted(config.batch_tokens, "token").c_str(),
              counted(config.microbatches, "micro-batch", "micro-batches").c_str(),
              config.optimizer.kind.c_str(), format_number(config.optimizer.lr).c_str());
  print_pipeline(*trainer);
  if (config.recompute.any())
    std::printf("recompute %s (forward re-run in the backward)\n",
                to_string(config.recompute).c_str());
  print_data_parallel(*trainer);
  const int64_t stop_after = f.checkpoint.stop_after;
  const bool stops_early = stop_after > 0 && stop_after < config.steps;
  const int64_t last_step_to_run = stops_early ? stop_after : config.steps;
  std::optional<HeldOutData> held_out;
  if (f.eval_batches > 0) held_out.emplace(*trainer);
  // A count the plan chose is the plan's to say, not a --microbatches never typed.
  std::string microbatches_origin;
  if (!cmd.count("--microbatches") && !f.plan_file.empty())
    microbatches_origin = "from --plan " + quoted_file_name(f.plan_file);
  else if (!cmd.count("--microbatches") && f.partition == "auto")
    microbatches_origin = "chosen by --partition auto";
  std::unique_ptr<TrainerCheckpointer> checkpointer =
      setup_checkpoints(f.checkpoint, *trainer, f.eval_batches, microbatches_origin);
  const int64_t first_step = trainer->steps_done() + 1;
  // A resumed run at or past its end: only the limit that ends it can be raised, and the
  // refusal is the one line printed.
  const char* const limit = stops_early ? "--stop-after" : "--steps";
  if (last_step_to_run < first_step)
    refuse_on_every_rank(mpi, "nothing to train: the run is at step " +
                                  std::to_string(first_step - 1) + " and stops at step " +
                                  std::to_string(last_step_to_run) + " (" + limit + "); raise " +
                                  limit);
  // A --stop-after past the run's length stops nothing; whoever gave it most likely meant a
  // longer run, which only --steps makes (it also spans the learning-rate schedule).
  if (stop_after > config.steps)
    std::printf(
        "note   --stop-after %lld is past --steps %lld: the run ends at step %lld (--steps sets "
        "the run's length and its learning-rate schedule; --stop-after only ends it early)\n",
        static_cast<long long>(stop_after), static_cast<long long>(config.steps),
        static_cast<long long>(config.steps));
  // Evaluations past the run's end, or the step --stop-after ends it at, never come: only the
  // closing one runs, as without the flag. A resumed run starts past the multiples before it.
  if (f.eval_every > 0 &&
      (first_step + f.eval_every - 1) / f.eval_every * f.eval_every > last_step_to_run) {
    const std::string where = f.eval_every > last_step_to_run
                                  ? "is past"
                                  : "has no multiple from step " + std::to_string(first_step) +
                                        ", where the resumed run starts, to";
    std::printf(
        "note   --eval-every %lld %s %s %lld: no evaluation runs before the closing one after "
        "step %lld\n",
        static_cast<long long>(f.eval_every), where.c_str(), limit,
        static_cast<long long>(last_step_to_run), static_cast<long long>(last_step_to_run));
  }
  // The default warm-up outlasts a short run: its learning rate never reaches --lr nor decays,
  // which reads as a too-small --lr unless it is said.
  if (config.optimizer.warmup_steps >= config.steps)
    std::printf(
        "note   --warmup %lld spans the whole run (--steps %lld): the learning rate climbs to %s "
        "at the last step and never decays to --min-lr; a shorter --warmup lets it\n",
        static_cast<long long>(config.optimizer.warmup_steps), static_cast<long long>(config.steps),
        format_number(learning_rate(config.optimizer, config.steps, config.steps)).c_str());
  if (checkpointer) {
    // A save the folder would refuse (the same command run again, into a folder whose
    // `latest` is at or past its first save; a step folder already there that a save would
    // meet) is refused now, not once training has reached it: a final save refused lost the
    // whole run. Rank 0 looks, as it prepares the saves.
    std::string why;
    if (!mpi.active() || mpi.rank() == 0)
      if (const auto refusal =
              run_save_refusal(f.checkpoint.save_dir, first_step, last_step_to_run,
                               f.checkpoint.save_every, checkpointer->continues_folder()))
        why = "--save-dir " + quoted_file_name(f.checkpoint.save_dir) +
              " would refuse a save of this run: " + *refusal;
    why = rank_zero_text(mpi, why, "the check of --save-dir");
    if (!why.empty()) refuse_on_every_rank(mpi, why);
  }

  install_interrupt_handlers();
  // The first failed write of the --log-json file (rank 0's: the only one that writes it). The
  // run stops as on a signal, with the last finished step saved, and fails with this error.
  std::string output_error;
  std::atomic<bool> output_failed{false};
  auto write_log = [&](const std::string& text) {
    if (!json_log || output_failed.load()) return;
    try {
      json_log->write(text);
    } catch (const std::runtime_error& e) {
      output_error = e.what();
      output_failed.store(true);
    }
  };
  // Stdout that takes no more of the run's lines (a full disk; a reader gone while SIGPIPE is
  // ignored, as the process may start with it) fails the run as a failed --log-json write
  // does: its lines are its record, and a run going on unseen to its end would hide their
  // loss. Rank 0's stdout only: the others' is /dev/null.
  auto check_stdout = [&] {
    errno = 0;
    const bool written = std::fflush(stdout) == 0 && std::ferror(stdout) == 0;
    // After the flush, whose write to a closed pipe raises SIGPIPE. A run stopping for a signal
    // stops for it alone: SIGPIPE or a closed terminal's SIGHUP comes with the failed writes.
    if (written || output_failed.load() || interrupt_signal() != 0) return;
    output_error = std::string("cannot write stdout: ") +
                   (errno != 0 ? std::strerror(errno) : "an earlier write failed");
    output_failed.store(true);
  };
  // The lines said so far, before the first step: a stdout that fails them stops the run after
  // it.
  check_stdout();
  // Asked by every rank in each step's all-reduce, so all processes stop after the same step.
  trainer->executor().set_stop_request([&output_failed] {
    return output_failed.load() ? kStopForFailedOutput : interrupt_signal();
  });
  // Stopping for a failed output: at once in one process; under MPI after the step whose
  // all-reduce carried rank 0's request, the others knowing of the failure only from it.
  bool output_stop = false;
  const bool one_process = trainer->executor().holds_all_ranks();
  auto stop_for_output = [&](int request) {
    if (request == kStopForFailedOutput) output_stop = true;
    if (one_process && output_failed.load()) output_stop = true;
    return request == kStopForFailedOutput ? 0 : request;
  };
  RunTrace run_trace;
  PipelineStepResult last_step;
  RunTotals t;
  int signal = 0;
  // Each save is said once: a periodic one as it happens (announced_save), except one of the
  // run's last step, said at the end with the folder and how long it held training.
  int64_t announced_save = -1;
  std::optional<double> last_step_save_held;
  const int64_t eval_tokens = f.eval_batches * config.batch_tokens;
  // An evaluation with the weights trained so far, drawn in the trace and written to
  // --log-json; EvaluationStopped when a signal ends it.
  auto evaluate_and_record = [&](bool announce) {
    const auto begin = RunTrace::Clock::now();
    TokenSource& batches = held_out->rewound();
    pause_if_asked_at("evaluation");
    const double loss =
        evaluate_held_out(*trainer, batches, f.eval_batches, announce, mpi.active());
    run_trace.add_evaluation(trainer->steps_done(), begin, RunTrace::Clock::now());
    write_log(eval_record(loss, trainer->steps_done(), f.eval_batches, eval_tokens));
    return loss;
  };
  // The estimate of the time left counts the loop's wall time: saves and evaluations too.
  const auto loop_begin = RunTrace::Clock::now();
  for (int64_t s = first_step; s <= last_step_to_run; ++s) {
    StepStats st;
    const auto step_begin = RunTrace::Clock::now();
    try {
      st = trainer->step();
    } catch (const std::bad_alloc&) {
      throw std::runtime_error("out of memory in training step " + std::to_string(s) +
                               "; use a smaller model or fewer tokens per micro-batch");
    } catch (const TrainingDiverged& e) {
      // Decided from the step's all-reduced loss and norm: every process stops alike.
      if (mpi.active()) throw ErrorOfEveryProcess(e.what(), kExitFailure);
      throw;
    }
    run_trace.add_step(s, step_begin, RunTrace::Clock::now(), st.seconds);
    ++t.steps;
    t.last_step = s;
    t.seconds += st.seconds;
    t.peak = std::max(t.peak, st.peak_bytes);
    t.last_loss = st.loss;
    t.losses.push_back(st.loss);
    if (json_log) {
      nlohmann::json row = {{"step", st.step},
                            {"loss", st.loss},
                            {"tokens", st.tokens},
                            {"seconds", st.seconds},
                            {"lr", st.lr},
                            {"grad_norm", st.grad_norm},
                            {"peak_bytes", st.peak_bytes}};
      write_log(row.dump() + "\n");
    }
    // A signal ends the run after the step it came in (or the next one, when it came after
    // the step's all-reduce): the step in progress finishes on every rank.
    signal = stop_for_output(st.pipeline.stop_signal);
    // The first and the last step this process trains are always shown: a resumed run or one
    // that --stop-after or a signal ends early starts or stops between the steps --log-every
    // divides, and the loss of the last is that of the step an interrupted run saves.
    // So is one an evaluation follows, which a signal may end the run in.
    const bool evaluates = f.eval_every > 0 && s % f.eval_every == 0 && s != last_step_to_run;
    if (!f.quiet && (s % f.log_every == 0 || s == first_step || s == last_step_to_run ||
                     signal != 0 || output_stop || evaluates)) {
      const double rate = st.tokens / st.seconds;
      const double looped =
          std::chrono::duration<double>(RunTrace::Clock::now() - loop_begin).count();
      const double eta =
          looped / static_cast<double>(t.steps) * static_cast<double>(last_step_to_run - s);
      std::printf("step %5lld/%lld | loss %.4f | %s tok/s | lr %.2e | alloc peak %s | eta %.0fs\n",
                  static_cast<long long>(s), static_cast<long long>(config.steps), st.loss,
                  human_rate(rate).c_str(), st.lr,
                  bytes_text(static_cast<double>(st.peak_bytes)).c_str(), eta);
      check_stdout();
    }
    // After the step's line, which a save's line or failure follows. An async save is only
    // started here; its failure, if any, is reported when a later save or the end waits for
    // it.
    if (checkpointer) {
      checkpointer->after_step();
      if (!f.quiet && checkpointer->last_started_step() == s) {
        if (f.checkpoint.async_save) {
          // Not for a save that failed before its write began: its warning said so.
          if (checkpointer->background_step() == s)
            std::printf("saving step %lld in the background (training held %.3f s)\n",
                        static_cast<long long>(s), checkpointer->last_stall_seconds());
        } else if (checkpointer->last_saved_step() == s && s == last_step_to_run)
          last_step_save_held = checkpointer->last_stall_seconds();
        else if (checkpointer->last_saved_step() == s) {
          std::printf("saved  step %lld (training held %.3f s)\n", static_cast<long long>(s),
                      checkpointer->last_stall_seconds());
          announced_save = s;
        }
      }
    }
    check_stdout();
    if (one_process && output_failed.load()) output_stop = true;
    last_step = std::move(st.pipeline);
    if (signal != 0 || output_stop) break;
    // After every --eval-every steps, on the run's held-out batches; the last step's is the
    // run's closing one below. A signal during it ends the run as one during a step does,
    // after the step it follows (and its save).
    if (evaluates) {
      double loss;
      try {
        loss = evaluate_and_record(false);
      } catch (const EvaluationStopped& e) {
        signal = stop_for_output(e.signal());
        break;
      }
      // Its record was the write that failed.
      if (one_process && output_failed.load()) {
        output_stop = true;
        break;
      }
      if (!f.quiet) {
        std::printf("eval   step %lld: loss %.6f over %lld held-out batch(es), exactly %a\n",
                    static_cast<long long>(s), loss, static_cast<long long>(f.eval_batches), loss);
        check_stdout();
        if (one_process && output_failed.load()) {
          output_stop = true;
          break;
        }
      }
    }
  }
  // An interrupted run saves the last finished step too, when it saves at all.
  // A last step whose save failed (under --on-save-error continue) leaves the run's result
  // unsaved: said here, and the exit status says it too.
  bool last_step_unsaved = false;
  if (checkpointer) {
    try {
      checkpointer->finish();
    } catch (const std::exception& e) {
      // The save of a run stopped by a failed write: both failures are said, the first
      // first. The checkpoints committed before stay as they were.
      if (output_error.empty()) throw;
      throw std::runtime_error(
          output_error + "; the run stopped after step " + std::to_string(trainer->steps_done()) +
          ", whose save failed too (" + e.what() + "); --save-dir " +
          quoted_file_name(f.checkpoint.save_dir) + " keeps the checkpoints it held");
    }
    const long long saved = checkpointer->last_saved_step();
    const long long last = trainer->steps_done();
    const std::string dir = escaped_for_message(f.checkpoint.save_dir);
    last_step_unsaved = saved != last;
    if (!last_step_unsaved && saved == last && last_step_save_held)
      std::printf("saved  step %lld into %s (training held %.3f s)\n", saved, dir.c_str(),
                  *last_step_save_held);
    else if (!last_step_unsaved && saved != announced_save)
      std::printf("saved  step %lld into %s\n", saved, dir.c_str());
    else if (last_step_unsaved)
      std::printf("not saved: step %lld, the run's last (see the warning); %s\n", last,
                  (saved >= 0 ? "the newest checkpoint this run saved into " + dir + " is step " +
                                    std::to_string(saved)
                              : "this run saved no checkpoint into " + dir)
                      .c_str());
  }
  // After the closing save, which an evaluation that fails or is interrupted must not cost.
  // An interrupted run stops at once: no evaluation; a signal during it ends it too (between
  // groups of batches, as the steps end after the one in progress).
  std::optional<double> eval_loss;
  if (f.eval_batches > 0 && signal == 0 && !output_stop) {
    try {
      eval_loss = evaluate_and_record(true);
    } catch (const EvaluationStopped& e) {
      signal = stop_for_output(e.signal());
    }
  }
  if (json_log && !output_failed.load()) {
    try {
      json_log->close();
    } catch (const std::runtime_error& e) {
      output_error = e.what();
    }
  }
  // Only rank 0 knows whether its file was written: every process learns it here, so that
  // all of them end alike, with status 1 (the others silently).
  if (mpi.active())
    output_error = rank_zero_text(mpi, output_error, "the check of stdout and --log-json");
  if (!output_error.empty())
    throw ErrorOfEveryProcess(
        output_error + (output_stop ? "; the run stopped after step " + std::to_string(t.last_step)
                                    : std::string()),
        kExitFailure);
  if (signal == 0 && t.steps > 0 && t.last_step < config.steps)
    std::printf(
        "stopped at step %lld of %lld (--stop-after)%s\n", static_cast<long long>(t.last_step),
        static_cast<long long>(config.steps),
        checkpointer ? "" : "; nothing was saved to resume from: the run has no --save-dir");
  print_summary(*trainer, config, t, signal, !f.log_json.empty());
  if (eval_loss)
    std::printf("eval   loss %.6f over %lld batch(es) (%lld tokens), exactly %a\n", *eval_loss,
                static_cast<long long>(f.eval_batches), static_cast<long long>(eval_tokens),
                *eval_loss);
  if (t.steps > 0)
    report_bubble(*trainer, last_step, trace ? &*trace : nullptr, run_trace,
                  checkpointer ? checkpointer->save_timings() : std::vector<SaveTiming>{});
  if (f.weights_checksum) {
    pause_if_asked_at("checksum");
    // The checksum is replica 0's: the other replicas must hold the same bits.
    if (trainer->executor().num_replicas() > 1) {
      trainer->executor().check_replicas_agree();
      std::printf("replicas agree: all %d hold replica 0's weights, bit for bit\n",
                  trainer->executor().num_replicas());
    }
    const uint64_t checksum = weights_checksum(trainer->executor(), mpi);
    std::printf("weights xxh3 %016llx\n", static_cast<unsigned long long>(checksum));
  }
  std::fflush(stdout);
  // The summary went to the closed pipe: where the run stopped is said where it can be read.
  if (signal == SIGPIPE && (!mpi.active() || mpi.rank() == 0))
    std::fprintf(stderr,
                 "conveyor: stdout was closed (SIGPIPE); the run stopped after step %lld%s\n",
                 static_cast<long long>(t.last_step),
                 checkpointer && !last_step_unsaved
                     ? (", saved into " + quoted_file_name(f.checkpoint.save_dir)).c_str()
                     : "");
  // 128 + the signal tells a script that the run stopped with its last step saved, for
  // --resume latest to go on from; a run whose last step is not saved ends with 1 instead,
  // interrupted or not, so that its lost result is not taken for a clean stop.
  if (signal != 0) throw ExitRequest(last_step_unsaved ? kExitFailure : kExitInterrupted + signal);
  pause_if_asked_at("end");
  mpi.meet_at_the_end();
  if (last_step_unsaved) throw ExitRequest(kExitFailure);
}

}  // namespace

void register_train_command(CLI::App& app) {
  auto flags = std::make_shared<TrainFlags>();
  TrainConfig& c = flags->config;
  CLI::App* cmd = app.add_subcommand("train", "Train the reference model");
  add_run_flags(cmd, flags->run, RunFlagsFor::kTrain);
  add_int_flag(cmd, "--steps", c.steps, 1, 1000000000, "Optimizer steps");
  add_int_flag(cmd, "--microbatches", c.microbatches, 1, kMaxMicrobatches,
               "Micro-batches per step");
  cmd->add_option("--optimizer", c.optimizer.kind, "adamw or sgd")->capture_default_str();
  constexpr double kMax = std::numeric_limits<double>::max();
  add_float_flag(cmd, "--lr", c.optimizer.lr, 0.0, kMax, true, "Peak learning rate");
  add_float_flag(cmd, "--min-lr", c.optimizer.min_lr, 0.0, kMax, false,
                 "Final learning rate of the cosine decay (left out: 0.0003, or --lr when "
                 "that is smaller)");
  add_int_flag(cmd, "--warmup", c.optimizer.warmup_steps, 0, 1000000000, "Linear warm-up steps");
  add_float_flag(cmd, "--weight-decay", c.optimizer.weight_decay, 0.0, kMax, false,
                 "Decoupled weight decay");
  add_float_flag(cmd, "--clip", c.optimizer.clip_norm, 0.0, kMax, false,
                 "Clip the global gradient norm to this (0 disables clipping)");
  add_int_flag(cmd, "--seed", c.seed, 0, std::numeric_limits<int64_t>::max(),
               "Seed of the weights and of the Markov source");
  add_path_flag(cmd, "--data", c.data_path,
                "Train on the bytes of FILE (a regular file of at most 1024 MiB) instead of "
                "the Markov source")
      ->type_name("FILE");
  add_path_flag(cmd, "--log-json", flags->log_json,
                "Write one JSON object per step to FILE (locked; flushed every line)")
      ->type_name("FILE");
  add_int_flag(cmd, "--log-every", flags->log_every, 1, 1000000000, "Print every N steps");
  add_switch(cmd, "--quiet", flags->quiet,
             "Leave out the per-step lines, the periodic saves' lines and --partition auto's "
             "report; the run's header, notes and closing lines stay (default off)");
  add_int_flag(cmd, "--stages", c.stages, 1, kMaxStages, "Pipeline ranks (p)");
  add_int_flag(cmd, "--chunks", flags->chunks, 1, kMaxChunks,
               "Virtual stages per rank (interleaved; zbv always has 2)")
      ->default_str("2 for interleaved, else 1");
  cmd->add_option("--schedule", flags->schedule, "Schedule: " + schedule_choices_text())
      ->capture_default_str();
  add_path_flag(cmd, "--schedule-file", c.schedule_file,
                "Run the schedule in FILE (text or CSV, see `conveyor schedule --dump`); it "
                "fixes the ranks, chunks and kind, and --stages, --chunks or --schedule given "
                "with it must agree")
      ->type_name("FILE");
  cmd->add_option(
         "--partition", flags->partition,
         "Blocks per stage: uniform, params, auto (profile and plan), or counts such as 3,5,5,3")
      ->capture_default_str();
  cmd->add_option("--placement", flags->placement,
                  "auto (one rank per GPU when there are enough) or shared (all on one GPU)")
      ->capture_default_str();
  cmd->add_option("--transport", flags->transport,
                  "auto (under mpirun or srun with several processes: NCCL bootstrapped over "
                  "MPI for CUDA ranks, MPI for CPU ranks; else NCCL when every rank has its own "
                  "GPU), inproc (one process only), nccl or mpi")
      ->capture_default_str();
  add_float_flag(cmd, "--timeout", flags->timeout_s, 0.0, 1000000.0, true,
                 "Seconds a rank waits for a peer before failing");
  add_path_flag(
      cmd, "--trace", flags->trace,
      "Write a Chrome trace to FILE: the run's steps, held-out evaluations and "
      "checkpoint saves (a background save on its own thread), and the last step's "
      "measured timeline per rank, with a pipeline's simulated timeline under it (the printed "
      "simulated bubble's)")
      ->type_name("FILE");
  add_checkpoint_flags(cmd, flags->checkpoint);
  add_path_flag(cmd, "--plan", flags->plan_file,
                "Run the plan in FILE (written by `conveyor plan --out`)")
      ->type_name("FILE");
  add_int_flag(cmd, "--eval-batches", flags->eval_batches, 0, 1000000,
               "After the last step, print the mean loss on N held-out batches: with --data "
               "those after the --steps training batches (they must fit in the file), else the "
               "Markov chain on a walk of its own");
  add_int_flag(cmd, "--eval-every", flags->eval_every, 0, 1000000000,
               "With --eval-batches: evaluate after every N steps too, on the same held-out "
               "batches (0: after the last step only)");
  add_switch(cmd, "--weights-checksum", flags->weights_checksum,
             "Print an XXH3 checksum of the final weights (to compare runs bit for bit)");
  // Data parallelism.
  add_int_flag(cmd, "--dp", c.data_parallel, 1, kMaxReplicas,
               "Data-parallel replicas D: --stages x D ranks (rank r is pipeline rank r mod "
               "--stages of replica r div --stages; under mpirun -np stages x D), each on "
               "--microbatches / D of the step's micro-batches (a multiple of D)");
  add_switch(cmd, "--shard-optimizer", c.shard_optimizer,
             "With --dp: each replica keeps the AdamW/SGD state of 1/D of every "
             "parameter, receives only the sum of that part of the gradients (a "
             "reduce-scatter), and the replicas gather the updated weights (ZeRO-1; "
             "default off)");
  cmd->footer(std::string("Example: conveyor train --stages 4 --schedule zbh1 --microbatches 8 "
                          "--log-json steps.jsonl\n") +
              kExitStatusText);
  cmd->callback([flags, cmd] { run_train(*flags, *cmd); });
}

}  // namespace conveyor::cli
