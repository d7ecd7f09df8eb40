// Plan files: what `conveyor plan --out FILE` writes for one layout (stages, schedule, chunks,
// micro-batches, partition, recomputation, predictions, and the run it was planned for), and
// how `conveyor train --plan FILE` reads one back, refusing a file planned for another run.
#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "engine/schedule/generators.h"
#include "engine/schedule/input_file.h"
#include "tools/cli_common.h"
#include "tools/plan_command.h"
#include "tools/run_flags.h"

namespace conveyor::cli {

namespace {

// What a plan is planned for, as the flags that set it name each field.
nlohmann::json planned_for(const TrainConfig& config) {
  const ModelConfig& m = config.model;
  return {{"d_model", m.d_model},
          {"layers", m.n_layers},
          {"hidden", m.hidden},
          {"vocab", m.vocab},
          {"activation", ops::activation_name(m.activation)},
          {"batch_tokens", config.batch_tokens},
          {"device", config.device && config.device->is_cuda() ? "cuda" : "cpu"}};
}

// A JSON value for a message: its start, escaped.
std::string shown_json(const nlohmann::json& v) {
  return escaped_for_message(message_excerpt(v.dump()));
}

// A plan's costs hold for the model, batch and device kind it was profiled with; another
// run's would be mis-planned, or not fit. Plans written before these were recorded (no
// planned_for at all) are not checked; a planned_for that is there must be whole.
void check_planned_for(const nlohmann::json& plan, const std::string& source,
                       const TrainConfig& config, int64_t replicas) {
  if (!plan.is_object() || !plan.contains("planned_for")) return;
  const nlohmann::json& was = plan.at("planned_for");
  const nlohmann::json now = planned_for(config);
  if (!was.is_object())
    throw UsageError(source +
                     ": planned_for must be an object (d_model, layers, hidden, vocab, "
                     "activation, batch_tokens, device), got " +
                     shown_json(was) + "; plan again (conveyor plan ... --out FILE)");
  for (const auto& [key, flag] :
       std::vector<std::pair<std::string, std::string>>{{"d_model", "--d-model"},
                                                        {"layers", "--layers"},
                                                        {"hidden", "--hidden"},
                                                        {"vocab", "--vocab"},
                                                        {"activation", "--activation"},
                                                        {"batch_tokens", "--batch-tokens"},
                                                        {"device", "--device"}}) {
    const bool text_field = now.at(key).is_string();
    const std::string expected = text_field ? "a string" : "an integer";
    if (!was.contains(key))
      throw UsageError(source + ": planned_for." + key + " is missing (" + expected +
                       " is expected); plan again (conveyor plan ... --out FILE)");
    const nlohmann::json& v = was.at(key);
    if (text_field ? !v.is_string() : !v.is_number_integer())
      throw UsageError(source + ": planned_for." + key + " must be " + expected + ", got " +
                       shown_json(v) + "; plan again (conveyor plan ... --out FILE)");
    if (v == now.at(key)) continue;
    auto text = [](const nlohmann::json& j) {
      return escaped_for_message(j.is_string() ? j.get<std::string>() : j.dump());
    };
    if (key == "batch_tokens" && replicas > 1) {
      const std::string d = std::to_string(replicas);
      throw UsageError(source + " plans one pipeline over " + text(v) + " tokens, and each of " +
                       "this run's --dp " + d + " replicas runs its pipeline over " +
                       text(now.at(key)) + " of the " +
                       std::to_string(now.at(key).get<int64_t>() * replicas) +
                       " tokens of --batch-tokens; plan one replica's share (conveyor plan " +
                       "--batch-tokens " + text(now.at(key)) + " ... --out FILE) or give " +
                       "--batch-tokens " + std::to_string(v.get<int64_t>() * replicas));
    }
    throw UsageError(source + " was planned for " + flag + " " + text(v) + " and this run has " +
                     text(now.at(key)) + "; plan again for this run " +
                     "(conveyor plan ... --out FILE) or give " + flag + " " + text(v));
  }
}

}  // namespace

std::string plan_text(const PlanCandidate& candidate, const TrainConfig& config) {
  nlohmann::json plan = {{"stages", config.stages},
                         {"schedule", schedule::schedule_kind_name(candidate.kind)},
                         {"chunks", candidate.chunks},
                         {"microbatches", candidate.microbatches},
                         {"partition", blocks_of(candidate.ranges)},
                         {"recompute", to_string(candidate.recompute)},
                         {"predicted_step_seconds", candidate.step_seconds},
                         {"predicted_rank_compute_seconds", candidate.busy_seconds},
                         {"planned_for", planned_for(config)}};
  return plan.dump(2) + "\n";
}

namespace {

// nlohmann's messages start with their id ("[json.exception.parse_error.101] "): the rest
// is the sentence.
std::string json_error_text(const nlohmann::json::exception& e) {
  const std::string what = e.what();
  const size_t end = what.find("] ");
  return what.starts_with("[json.exception.") && end != std::string::npos ? what.substr(end + 2)
                                                                          : what;
}

constexpr const char* kPlanAgain = "; plan again (conveyor plan ... --out FILE)";

// A whole number of the plan within what the flag that sets it accepts: a value the run's
// int fields would narrow (2^40 stages read as 0, 2.5 as 2) is refused as it is written.
int64_t plan_integer(const nlohmann::json& v, const std::string& source, const std::string& key,
                     int64_t lo, int64_t hi) {
  bool ok = false;
  int64_t value = 0;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    ok = u <= static_cast<uint64_t>(hi);
    value = ok ? static_cast<int64_t>(u) : 0;
    ok = ok && value >= lo;
  } else if (v.is_number_integer()) {
    value = v.get<int64_t>();
    ok = value >= lo && value <= hi;
  }
  if (!ok)
    throw UsageError(source + ": " + key + " must be a whole number in [" + std::to_string(lo) +
                     ", " + std::to_string(hi) + "], got " + shown_json(v) + kPlanAgain);
  return value;
}

// A predicted time of the plan, which the run only shows: a damaged one is a damaged file,
// refused as its other fields are.
void check_plan_seconds(const nlohmann::json& v, const std::string& source,
                        const std::string& key) {
  if (!v.is_number() || v.get<double>() < 0)
    throw UsageError(source + ": " + key + " must be a number of seconds, at least 0, got " +
                     shown_json(v) + kPlanAgain);
}

const nlohmann::json& plan_field(const nlohmann::json& plan, const std::string& source,
                                 const std::string& key) {
  if (!plan.contains(key))
    throw UsageError(source + " has no " + key + " (a plan file holds stages, schedule, chunks, " +
                     "microbatches and partition)" + kPlanAgain);
  return plan.at(key);
}

std::string plan_string(const nlohmann::json& v, const std::string& source,
                        const std::string& key) {
  if (!v.is_string())
    throw UsageError(source + ": " + key + " must be a string, got " + shown_json(v) + kPlanAgain);
  return v.get<std::string>();
}

// Refuses a field of `object` (the plan, or its planned_for when `prefix` says so) that is not
// one of `known`, naming it and the fields there are.
void refuse_unknown_fields(const nlohmann::json& object, const std::string& source,
                           const std::string& prefix, const std::vector<std::string>& known) {
  for (const auto& [key, value] : object.items()) {
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    const std::string name = prefix + message_excerpt(key);
    throw UsageError(
        source + " has a field '" + escaped_for_message(name) + "' that plan files do not have (" +
        (prefix.empty() ? "a plan" : "its " + prefix.substr(0, prefix.size() - 1)) + " holds " +
        listed(known) + "); correct its name or plan again (conveyor plan ... --out FILE)");
  }
}

// A plan's layout as a whole, said in the plan's own words: the run would otherwise refuse it
// later in those of flags the user never typed (--chunks, --stages, --microbatches).
// `batch_tokens`: what one pipeline runs, each replica's share with `replicas` above 1.
void check_plan_layout(const std::string& source, schedule::ScheduleKind kind, int64_t stages,
                       int64_t chunks, int64_t microbatches, const std::vector<int64_t>& blocks,
                       int64_t batch_tokens, int64_t replicas) {
  const std::string name = schedule::schedule_kind_name(kind);
  const bool zbv = kind == schedule::ScheduleKind::kZBV;
  if (!schedule::takes_chunks(kind, chunks))
    throw UsageError(source + ": its schedule " + name +
                     (zbv ? " has 2 chunks per rank in a V, and its chunks is " +
                                std::to_string(chunks) + "; expected 2"
                          : " has one chunk per rank, and its chunks is " + std::to_string(chunks) +
                                "; more chunks are for 'interleaved', so chunks must be 1 here") +
                     kPlanAgain);
  const int64_t pipeline_stages =
      stages * schedule::chunks_per_rank(kind, static_cast<int>(chunks));
  if (static_cast<int64_t>(blocks.size()) != pipeline_stages) {
    std::string counts;
    for (const int64_t b : blocks) counts += (counts.empty() ? "" : ",") + std::to_string(b);
    throw UsageError(source + ": its partition " + counts + " has " +
                     std::to_string(blocks.size()) + " block counts, and its stages " +
                     std::to_string(stages) +
                     (pipeline_stages != stages
                          ? " x " + std::to_string(pipeline_stages / stages) + " chunks of " + name
                          : std::string()) +
                     " need " + std::to_string(pipeline_stages) + ", one per stage" + kPlanAgain);
  }
  if (batch_tokens % microbatches != 0)
    throw UsageError(
        source + ": its microbatches " + std::to_string(microbatches) + " cannot split " +
        (replicas > 1
             ? "each replica's " + std::to_string(batch_tokens) +
                   " tokens (--batch-tokens over --dp " + std::to_string(replicas) + ")"
             : "the batch of " + std::to_string(batch_tokens) + " tokens (--batch-tokens)") +
        " into equal micro-batches; plan again for this batch (conveyor plan ... "
        "--out FILE)");
}

}  // namespace

void apply_plan_text(const std::string& text, const std::string& source, TrainConfig& config,
                     int64_t replicas) {
  // A plan nests three levels deep. Printing or copying a value recurses once per level, so a
  // file of a million '[' would overflow the stack when an error message shows it.
  constexpr int kMaxPlanDepth = 16;
  // A field given twice would keep its last value without a word ("stages": 2 edited into
  // "stages": 3 below the first): the keys of each open object are kept to refuse it.
  std::vector<std::set<std::string>> keys_of_open_objects;
  const auto check_while_parsing = [&](int depth, nlohmann::json::parse_event_t event,
                                       nlohmann::json& parsed) {
    if (depth > kMaxPlanDepth)
      throw UsageError(source + " nests JSON deeper than " + std::to_string(kMaxPlanDepth) +
                       " levels; expected the file `conveyor plan --out` writes");
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start) {
      keys_of_open_objects.emplace_back();
    } else if (event == Event::object_end) {
      keys_of_open_objects.pop_back();
    } else if (event == Event::key &&
               !keys_of_open_objects.back().insert(parsed.get<std::string>()).second) {
      const std::string key = parsed.get<std::string>();
      throw UsageError(source + " gives the field '" + escaped_for_message(message_excerpt(key)) +
                       "' twice; give each field once");
    }
    return true;
  };
  nlohmann::json plan;
  try {
    plan = nlohmann::json::parse(text, check_while_parsing);
  } catch (const nlohmann::json::exception& e) {
    throw UsageError(source + " is not JSON (" + json_error_text(e) +
                     "); expected the file `conveyor plan --out` writes");
  }
  if (!plan.is_object())
    throw UsageError(source + " holds " + shown_json(plan) +
                     ", not the JSON object `conveyor plan --out` writes (stages, schedule, "
                     "chunks, microbatches, partition)");
  // A misspelled field would be passed by unseen: "recomputation" would run without it, and
  // "planned-for" without the check that the plan is this run's.
  refuse_unknown_fields(
      plan, source, "",
      {"stages", "schedule", "chunks", "microbatches", "partition", "recompute",
       "predicted_step_seconds", "predicted_rank_compute_seconds", "planned_for"});
  if (plan.contains("planned_for") && plan.at("planned_for").is_object())
    refuse_unknown_fields(
        plan.at("planned_for"), source, "planned_for.",
        {"d_model", "layers", "hidden", "vocab", "activation", "batch_tokens", "device"});
  try {
    check_planned_for(plan, source, config, replicas);
    const std::string kind = plan_string(plan_field(plan, source, "schedule"), source, "schedule");
    const auto parsed = schedule::parse_schedule_kind(kind);
    if (!parsed)
      throw UsageError(source + " names schedule '" + escaped_for_message(kind) + "', expected " +
                       schedule::schedule_kind_choices());
    // The ranges of --stages, --chunks, --microbatches and --layers.
    const auto stages = plan_integer(plan_field(plan, source, "stages"), source, "stages", 1, 1024);
    const auto chunks = plan_integer(plan_field(plan, source, "chunks"), source, "chunks", 1, 64);
    const auto microbatches =
        plan_integer(plan_field(plan, source, "microbatches"), source, "microbatches", 1, 65536);
    const nlohmann::json& partition = plan_field(plan, source, "partition");
    if (!partition.is_array() || partition.empty())
      throw UsageError(source + ": partition must be a list of block counts, got " +
                       shown_json(partition) + kPlanAgain);
    std::vector<int64_t> blocks;
    for (const nlohmann::json& b : partition)
      blocks.push_back(plan_integer(b, source, "partition", 0, 4096));
    check_plan_layout(source, *parsed, stages, chunks, microbatches, blocks, config.batch_tokens,
                      replicas);
    if (plan.contains("predicted_step_seconds"))
      check_plan_seconds(plan.at("predicted_step_seconds"), source, "predicted_step_seconds");
    if (plan.contains("predicted_rank_compute_seconds")) {
      const nlohmann::json& ranks = plan.at("predicted_rank_compute_seconds");
      if (!ranks.is_array())
        throw UsageError(source + ": predicted_rank_compute_seconds must be a list of seconds, " +
                         "one per rank, got " + shown_json(ranks) + kPlanAgain);
      for (const nlohmann::json& r : ranks)
        check_plan_seconds(r, source, "predicted_rank_compute_seconds");
    }
    config.stages = static_cast<int>(stages);
    config.schedule = *parsed;
    config.chunks = static_cast<int>(chunks);
    config.microbatches = microbatches;
    config.partition = PartitionSpec::explicit_blocks(std::move(blocks));
    // Plans written before recomputation existed keep every activation.
    config.recompute = plan.contains("recompute")
                           ? parse_recompute(plan_string(plan.at("recompute"), source, "recompute"),
                                             config.model.num_units(), source + ": recompute")
                           : RecomputeSpec::none();
  } catch (const nlohmann::json::exception& e) {
    throw UsageError(source +
                     " is not a plan written by `conveyor plan --out` (stages, schedule, "
                     "chunks, microbatches, partition): " +
                     json_error_text(e));
  }
}

void apply_plan_file(const std::string& path, TrainConfig& config, int64_t replicas) {
  // Plans are small; a device or a pipe would be read without end (/dev/zero) or wait for a
  // writer, so only a regular file is read.
  constexpr uintmax_t kMaxPlanFileBytes = uintmax_t{1} << 20;
  const std::string shown = "plan file '" + escaped_for_message(path) + "'";
  std::string text;
  try {
    text = read_input_file(path, {shown, "the JSON file `conveyor plan --out` writes",
                                  kMaxPlanFileBytes, "are accepted as a plan"});
  } catch (const InputFileError& e) {
    throw UsageError(e.what());
  }
  apply_plan_text(text, shown, config, replicas);
}

}  // namespace conveyor::cli
