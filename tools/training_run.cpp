#include "tools/training_run.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <utility>
#include <vector>

#include "comm/transport_factory.h"
#include "engine/core/allocator.h"
#include "engine/core/number_text.h"
#include "engine/core/test_pause.h"
#include "engine/pipeline/memory_estimate.h"
#include "engine/pipeline/optimizer.h"
#include "engine/schedule/input_file.h"
#include "engine/train/checkpoint.h"
#include "engine/train/data.h"
#include "engine/train/train_config.h"
#include "tools/checkpoint_flags.h"
#include "tools/cli_common.h"
#include "tools/cli_flags.h"
#include "tools/error_line.h"
#include "tools/interrupt.h"
#include "tools/resume_settings.h"
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

// `detail`: the allocator's words on the request that failed, or empty.
UsageError out_of_memory_building(const std::string& detail) {
  return UsageError(
      "out of memory while building the model, its optimizer state and the "
      "pipeline" +
      detail + "; use a smaller model or --memory-cap to see the estimate");
}

}  // namespace

TrainingRun::TrainingRun(const TrainFlags& f, const CLI::App& cmd, const MpiSession& mpi,
                         const TrainConfig& config, Device device)
    : f_(f),
      cmd_(cmd),
      mpi_(mpi),
      config_(config),
      device_(device),
      eval_tokens_(f.eval_batches * config.batch_tokens) {
  // Every output file is opened (and the log locked) before any work, not after the last step.
  // The log is written line by line as the run goes, so it is the file itself, locked against
  // a second run; the trace is written whole at the end, in place of the file only then (a
  // run that fails leaves the file as it was).
  if (!f.log_json.empty()) json_log_.emplace(f.log_json, "--log-json", /*lock=*/true);
  if (!f.trace.empty()) trace_.emplace(f.trace, "--trace");
}

void TrainingRun::build() {
  pause_if_asked_at("setup");
  std::shared_ptr<TokenSource> data = read_data();
  try {
    trainer_ = std::make_unique<Trainer>(config_, data);
  } catch (const comm::ProcessCountMismatch& e) {
    refuse_on_every_rank(mpi_, e.what());
  } catch (const std::invalid_argument& e) {  // schedule, partition, placement, memory too
    throw UsageError(with_inherited_origin(e.what(), f_.checkpoint.inherited));
  } catch (const std::bad_alloc&) {
    throw out_of_memory_building("");
  } catch (const OutOfMemoryError& e) {  // the allocator's, its request and stats said
    throw out_of_memory_building(" (" + std::string(e.what()) + ")");
  }
  // The ranks are connected: an error from here on may be one process's alone.
  usage_errors_are_this_process_own();
  std::printf("model  %s\n", trainer_->model().name.c_str());
  std::printf("data   %s\n", trainer_->source().describe().c_str());
  std::printf("device %s | %s x %s in %s | %s lr %s\n", device_.to_string().c_str(),
              counted(config_.steps, "step").c_str(),
              counted(config_.batch_tokens, "token").c_str(),
              counted(config_.microbatches, "micro-batch", "micro-batches").c_str(),
              config_.optimizer.kind.c_str(), format_number(config_.optimizer.lr).c_str());
  print_pipeline(*trainer_);
  if (config_.recompute.any())
    std::printf("recompute %s (forward re-run in the backward)\n",
                to_string(config_.recompute).c_str());
  print_data_parallel(*trainer_);
}

// The --data file is read before the model is built, so that held-out batches it cannot
// hold are refused at once, not after the seconds a large model takes to build.
std::shared_ptr<TokenSource> TrainingRun::read_data() const {
  std::shared_ptr<TokenSource> data;
  try {
    if (!config_.data_path.empty()) data = make_token_source(config_, config_.model.vocab);
  } catch (const std::invalid_argument& e) {
    throw UsageError(with_inherited_origin(e.what(), f_.checkpoint.inherited));
  }
  if (data) {
    const uint64_t bytes = dynamic_cast<const FileSource&>(*data).bytes();
    try {
      check_eval_fits(config_, f_.eval_batches, bytes);
    } catch (const UsageError& e) {  // from the agreed flags and --data contents: alike everywhere
      refuse_on_every_rank(mpi_, with_inherited_origin(e.what(), f_.checkpoint.inherited));
    }
  }
  return data;
}

void TrainingRun::resume_and_check_limits() {
  const int64_t stop_after = f_.checkpoint.stop_after;
  stops_early_ = stop_after > 0 && stop_after < config_.steps;
  last_step_to_run_ = stops_early_ ? stop_after : config_.steps;
  if (f_.eval_batches > 0) held_out_.emplace(*trainer_);
  // A count the plan chose is the plan's to say, not a --microbatches never typed.
  std::string microbatches_origin;
  if (!cmd_.count("--microbatches") && !f_.plan_file.empty())
    microbatches_origin = "from --plan " + quoted_file_name(f_.plan_file);
  else if (!cmd_.count("--microbatches") && f_.partition == "auto")
    microbatches_origin = "chosen by --partition auto";
  checkpointer_ = setup_checkpoints(f_.checkpoint, *trainer_, f_.eval_batches, microbatches_origin);
  first_step_ = trainer_->steps_done() + 1;
  // A resumed run at or past its end: only the limit that ends it can be raised, and the
  // refusal is the one line printed.
  const char* const limit = limit_flag();
  if (last_step_to_run_ < first_step_)
    refuse_on_every_rank(mpi_, "nothing to train: the run is at step " +
                                   std::to_string(first_step_ - 1) + " and stops at step " +
                                   std::to_string(last_step_to_run_) + " (" + limit + "); raise " +
                                   limit);
  print_limit_notes();
  if (checkpointer_) refuse_saves_the_folder_would_refuse();
}

void TrainingRun::print_limit_notes() const {
  const int64_t stop_after = f_.checkpoint.stop_after;
  // A --stop-after past the run's length stops nothing; whoever gave it most likely meant a
  // longer run, which only --steps makes (it also spans the learning-rate schedule).
  if (stop_after > config_.steps)
    std::printf(
        "note   --stop-after %lld is past --steps %lld: the run ends at step %lld (--steps sets "
        "the run's length and its learning-rate schedule; --stop-after only ends it early)\n",
        static_cast<long long>(stop_after), static_cast<long long>(config_.steps),
        static_cast<long long>(config_.steps));
  // Evaluations past the run's end, or the step --stop-after ends it at, never come: only the
  // closing one runs, as without the flag. A resumed run starts past the multiples before it.
  if (f_.eval_every > 0 &&
      (first_step_ + f_.eval_every - 1) / f_.eval_every * f_.eval_every > last_step_to_run_) {
    const std::string where = f_.eval_every > last_step_to_run_
                                  ? "is past"
                                  : "has no multiple from step " + std::to_string(first_step_) +
                                        ", where the resumed run starts, to";
    std::printf(
        "note   --eval-every %lld %s %s %lld: no evaluation runs before the closing one after "
        "step %lld\n",
        static_cast<long long>(f_.eval_every), where.c_str(), limit_flag(),
        static_cast<long long>(last_step_to_run_), static_cast<long long>(last_step_to_run_));
  }
  // The default warm-up outlasts a short run: its learning rate never reaches --lr nor decays,
  // which reads as a too-small --lr unless it is said.
  if (config_.optimizer.warmup_steps >= config_.steps)
    std::printf(
        "note   --warmup %lld spans the whole run (--steps %lld): the learning rate climbs to %s "
        "at the last step and never decays to --min-lr; a shorter --warmup lets it\n",
        static_cast<long long>(config_.optimizer.warmup_steps),
        static_cast<long long>(config_.steps),
        format_number(learning_rate(config_.optimizer, config_.steps, config_.steps)).c_str());
}

// A save the folder would refuse (the same command run again, into a folder whose `latest` is
// at or past its first save; a step folder already there that a save would meet) is refused
// now, not once training has reached it: a final save refused lost the whole run. Rank 0
// looks, as it prepares the saves.
void TrainingRun::refuse_saves_the_folder_would_refuse() const {
  std::string why;
  if (!mpi_.active() || mpi_.rank() == 0)
    if (const auto refusal =
            run_save_refusal(f_.checkpoint.save_dir, first_step_, last_step_to_run_,
                             f_.checkpoint.save_every, checkpointer_->continues_folder()))
      why = "--save-dir " + quoted_file_name(f_.checkpoint.save_dir) +
            " would refuse a save of this run: " + *refusal;
  why = rank_zero_text(mpi_, why, "the check of --save-dir");
  if (!why.empty()) refuse_on_every_rank(mpi_, why);
}

void TrainingRun::watch_signals_and_outputs() {
  install_interrupt_handlers();
  // The lines said so far, before the first step: a stdout that fails them stops the run after
  // it.
  check_stdout();
  // Asked by every rank in each step's all-reduce, so all processes stop after the same step.
  trainer_->executor().set_stop_request([&output_failed = output_failed_] {
    return output_failed.load() ? kStopForFailedOutput : interrupt_signal();
  });
  one_process_ = trainer_->executor().holds_all_ranks();
}

void TrainingRun::write_log(const std::string& text) {
  if (!json_log_ || output_failed_.load()) return;
  try {
    json_log_->write(text);
  } catch (const std::runtime_error& e) {
    output_error_ = e.what();
    output_failed_.store(true);
  }
}

// Stdout that takes no more of the run's lines (a full disk; a reader gone while SIGPIPE is
// ignored, as the process may start with it) fails the run as a failed --log-json write
// does: its lines are its record, and a run going on unseen to its end would hide their
// loss. Rank 0's stdout only: the others' is /dev/null.
void TrainingRun::check_stdout() {
  std::optional<std::string> error = stdout_write_error();
  // After the flush, whose write to a closed pipe raises SIGPIPE. A run stopping for a signal
  // stops for it alone: SIGPIPE or a closed terminal's SIGHUP comes with the failed writes.
  if (!error || output_failed_.load() || interrupt_signal() != 0) return;
  output_error_ = std::move(*error);
  output_failed_.store(true);
}

// `request`: what the executor's stop request gave; returns the signal it stands for, or 0.
int TrainingRun::stop_for_output(int request) {
  if (request == kStopForFailedOutput) output_stop_ = true;
  if (one_process_ && output_failed_.load()) output_stop_ = true;
  return request == kStopForFailedOutput ? 0 : request;
}

// An evaluation with the weights trained so far, drawn in the trace and written to
// --log-json; EvaluationStopped when a signal ends it.
double TrainingRun::evaluate_and_record(bool announce) {
  const auto begin = RunTrace::Clock::now();
  TokenSource& batches = held_out_->rewound();
  pause_if_asked_at("evaluation");
  const double loss =
      evaluate_held_out(*trainer_, batches, f_.eval_batches, announce, mpi_.active());
  run_trace_.add_evaluation(trainer_->steps_done(), begin, RunTrace::Clock::now());
  write_log(eval_record(loss, trainer_->steps_done(), f_.eval_batches, eval_tokens_));
  return loss;
}

void TrainingRun::train_steps() {
  // The run's clock starts as the steps do, not as the model was built.
  run_trace_ = RunTrace();
  // The estimate of the time left counts the loop's wall time: saves and evaluations too.
  const auto loop_begin = RunTrace::Clock::now();
  for (int64_t s = first_step_; s <= last_step_to_run_; ++s) {
    StepStats st = run_step(s);
    // A signal ends the run after the step it came in (or the next one, when it came after
    // the step's all-reduce): the step in progress finishes on every rank.
    signal_ = stop_for_output(st.pipeline.stop_signal);
    // The first and the last step this process trains are always shown: a resumed run or one
    // that --stop-after or a signal ends early starts or stops between the steps --log-every
    // divides, and the loss of the last is that of the step an interrupted run saves.
    // So is one an evaluation follows, which a signal may end the run in.
    const bool evaluates = f_.eval_every > 0 && s % f_.eval_every == 0 && s != last_step_to_run_;
    if (!f_.quiet && (s % f_.log_every == 0 || s == first_step_ || s == last_step_to_run_ ||
                      signal_ != 0 || output_stop_ || evaluates))
      print_step_line(s, st, loop_begin);
    // After the step's line, which a save's line or failure follows. An async save is only
    // started here; its failure, if any, is reported when a later save or the end waits for
    // it.
    if (checkpointer_) save_after_step(s);
    check_stdout();
    if (one_process_ && output_failed_.load()) output_stop_ = true;
    last_step_ = std::move(st.pipeline);
    if (signal_ != 0 || output_stop_) break;
    // After every --eval-every steps, on the run's held-out batches; the last step's is the
    // run's closing one (close). A signal during it ends the run as one during a step does,
    // after the step it follows (and its save).
    if (evaluates && !evaluate_between_steps(s)) break;
  }
}

// Step `s`, drawn in the trace, counted in the totals and written to --log-json.
StepStats TrainingRun::run_step(int64_t s) {
  StepStats st;
  const auto step_begin = RunTrace::Clock::now();
  try {
    st = trainer_->step();
  } catch (const std::bad_alloc&) {
    throw std::runtime_error("out of memory in training step " + std::to_string(s) +
                             "; use a smaller model or fewer tokens per micro-batch");
  } catch (const TrainingDiverged& e) {
    // Decided from the step's all-reduced loss and norm: every process stops alike.
    if (mpi_.active()) throw ErrorOfEveryProcess(e.what(), kExitFailure);
    throw;
  }
  run_trace_.add_step(s, step_begin, RunTrace::Clock::now(), st.seconds);
  ++totals_.steps;
  totals_.last_step = s;
  totals_.seconds += st.seconds;
  totals_.peak = std::max(totals_.peak, st.peak_bytes);
  totals_.last_loss = st.loss;
  totals_.losses.push_back(st.loss);
  if (json_log_) {
    nlohmann::json row = {{"step", st.step},
                          {"loss", st.loss},
                          {"tokens", st.tokens},
                          {"seconds", st.seconds},
                          {"lr", st.lr},
                          {"grad_norm", st.grad_norm},
                          {"peak_bytes", st.peak_bytes}};
    write_log(row.dump() + "\n");
  }
  return st;
}

void TrainingRun::print_step_line(int64_t s, const StepStats& st,
                                  RunTrace::Clock::time_point loop_begin) {
  const double rate = st.tokens / st.seconds;
  const double looped = std::chrono::duration<double>(RunTrace::Clock::now() - loop_begin).count();
  const double eta =
      looped / static_cast<double>(totals_.steps) * static_cast<double>(last_step_to_run_ - s);
  std::printf("step %5lld/%lld | loss %.4f | %s tok/s | lr %.2e | alloc peak %s | eta %.0fs\n",
              static_cast<long long>(s), static_cast<long long>(config_.steps), st.loss,
              human_rate(rate).c_str(), st.lr,
              bytes_text(static_cast<double>(st.peak_bytes)).c_str(), eta);
  check_stdout();
}

void TrainingRun::save_after_step(int64_t s) {
  checkpointer_->after_step();
  if (f_.quiet || checkpointer_->last_started_step() != s) return;
  if (f_.checkpoint.async_save) {
    // Not for a save that failed before its write began: its warning said so.
    if (checkpointer_->background_step() == s)
      std::printf("saving step %lld in the background (training held %.3f s)\n",
                  static_cast<long long>(s), checkpointer_->last_stall_seconds());
  } else if (checkpointer_->last_saved_step() == s && s == last_step_to_run_)
    last_step_save_held_ = checkpointer_->last_stall_seconds();
  else if (checkpointer_->last_saved_step() == s) {
    std::printf("saved  step %lld (training held %.3f s)\n", static_cast<long long>(s),
                checkpointer_->last_stall_seconds());
    announced_save_ = s;
  }
}

bool TrainingRun::evaluate_between_steps(int64_t s) {
  double loss;
  try {
    loss = evaluate_and_record(false);
  } catch (const EvaluationStopped& e) {
    signal_ = stop_for_output(e.signal());
    return false;
  }
  // Its record was the write that failed.
  if (one_process_ && output_failed_.load()) {
    output_stop_ = true;
    return false;
  }
  if (!f_.quiet) {
    std::printf("eval   step %lld: loss %.6f over %lld held-out batch(es), exactly %a\n",
                static_cast<long long>(s), loss, static_cast<long long>(f_.eval_batches), loss);
    check_stdout();
    if (one_process_ && output_failed_.load()) {
      output_stop_ = true;
      return false;
    }
  }
  return true;
}

void TrainingRun::close() {
  // An interrupted run saves the last finished step too, when it saves at all.
  if (checkpointer_) finish_saves();
  // After the closing save, which an evaluation that fails or is interrupted must not cost.
  // An interrupted run stops at once: no evaluation; a signal during it ends it too (between
  // groups of batches, as the steps end after the one in progress).
  if (f_.eval_batches > 0 && signal_ == 0 && !output_stop_) {
    try {
      eval_loss_ = evaluate_and_record(true);
    } catch (const EvaluationStopped& e) {
      signal_ = stop_for_output(e.signal());
    }
  }
  if (json_log_ && !output_failed_.load()) {
    try {
      json_log_->close();
    } catch (const std::runtime_error& e) {
      output_error_ = e.what();
    }
  }
  // Only rank 0 knows whether its file was written: every process learns it here, so that
  // all of them end alike, with status 1 (the others silently).
  if (mpi_.active())
    output_error_ = rank_zero_text(mpi_, output_error_, "the check of stdout and --log-json");
  if (!output_error_.empty())
    throw ErrorOfEveryProcess(output_error_ + (output_stop_ ? "; the run stopped after step " +
                                                                  std::to_string(totals_.last_step)
                                                            : std::string()),
                              kExitFailure);
}

// A last step whose save failed (under --on-save-error continue) leaves the run's result
// unsaved: said here, and the exit status says it too.
void TrainingRun::finish_saves() {
  try {
    checkpointer_->finish();
  } catch (const std::exception& e) {
    // The save of a run stopped by a failed write: both failures are said, the first
    // first. The checkpoints committed before stay as they were.
    if (output_error_.empty()) throw;
    throw std::runtime_error(
        output_error_ + "; the run stopped after step " + std::to_string(trainer_->steps_done()) +
        ", whose save failed too (" + e.what() + "); --save-dir " +
        quoted_file_name(f_.checkpoint.save_dir) + " keeps the checkpoints it held");
  }
  const long long saved = checkpointer_->last_saved_step();
  const long long last = trainer_->steps_done();
  const std::string dir = escaped_for_message(f_.checkpoint.save_dir);
  last_step_unsaved_ = saved != last;
  if (!last_step_unsaved_ && saved == last && last_step_save_held_)
    std::printf("saved  step %lld into %s (training held %.3f s)\n", saved, dir.c_str(),
                *last_step_save_held_);
  else if (!last_step_unsaved_ && saved != announced_save_)
    std::printf("saved  step %lld into %s\n", saved, dir.c_str());
  else if (last_step_unsaved_)
    std::printf("not saved: step %lld, the run's last (see the warning); %s\n", last,
                (saved >= 0 ? "the newest checkpoint this run saved into " + dir + " is step " +
                                  std::to_string(saved)
                            : "this run saved no checkpoint into " + dir)
                    .c_str());
}

void TrainingRun::report() {
  if (signal_ == 0 && totals_.steps > 0 && totals_.last_step < config_.steps)
    std::printf(
        "stopped at step %lld of %lld (--stop-after)%s\n",
        static_cast<long long>(totals_.last_step), static_cast<long long>(config_.steps),
        checkpointer_ ? "" : "; nothing was saved to resume from: the run has no --save-dir");
  print_summary(*trainer_, config_, totals_, signal_, !f_.log_json.empty());
  if (eval_loss_)
    std::printf("eval   loss %.6f over %lld batch(es) (%lld tokens), exactly %a\n", *eval_loss_,
                static_cast<long long>(f_.eval_batches), static_cast<long long>(eval_tokens_),
                *eval_loss_);
  if (totals_.steps > 0)
    report_bubble(*trainer_, last_step_, trace_ ? &*trace_ : nullptr, run_trace_,
                  checkpointer_ ? checkpointer_->save_timings() : std::vector<SaveTiming>{});
  if (f_.weights_checksum) print_weights_checksum();
  std::fflush(stdout);
}

void TrainingRun::print_weights_checksum() {
  pause_if_asked_at("checksum");
  // The checksum is replica 0's: the other replicas must hold the same bits.
  if (trainer_->executor().num_replicas() > 1) {
    trainer_->executor().check_replicas_agree();
    std::printf("replicas agree: all %d hold replica 0's weights, bit for bit\n",
                trainer_->executor().num_replicas());
  }
  const uint64_t checksum = weights_checksum(trainer_->executor(), mpi_);
  std::printf("weights xxh3 %016llx\n", static_cast<unsigned long long>(checksum));
}

void TrainingRun::end() {
  // The summary went to the closed pipe: where the run stopped is said where it can be read.
  if (signal_ == SIGPIPE && (!mpi_.active() || mpi_.rank() == 0))
    std::fprintf(stderr,
                 "conveyor: stdout was closed (SIGPIPE); the run stopped after step %lld%s\n",
                 static_cast<long long>(totals_.last_step),
                 checkpointer_ && !last_step_unsaved_
                     ? (", saved into " + quoted_file_name(f_.checkpoint.save_dir)).c_str()
                     : "");
  // 128 + the signal tells a script that the run stopped with its last step saved, for
  // --resume latest to go on from; a run whose last step is not saved ends with 1 instead,
  // interrupted or not, so that its lost result is not taken for a clean stop.
  if (signal_ != 0)
    throw ExitRequest(last_step_unsaved_ ? kExitFailure : kExitInterrupted + signal_);
  pause_if_asked_at("end");
  mpi_.meet_at_the_end();
  if (last_step_unsaved_) throw ExitRequest(kExitFailure);
}

}  // namespace conveyor::cli
