// Reading a checkpoint's manifest: parse_manifest checks every field as it reads it (types,
// ranges, the stage map against the shards and the model), and the checks run on a manifest
// once read: its counters against its step, and what resuming a Trainer needs of it. The
// manifest as written, and its checksums, are in checkpoint_manifest_write.cpp.
#include "engine/train/checkpoint_manifest.h"

#include <cmath>
#include <initializer_list>
#include <limits>
#include <set>
#include <stdexcept>

#include "engine/core/number_text.h"
#include "engine/train/checkpoint_error.h"
#include "engine/train/run_limits.h"

namespace conveyor {
namespace {

using checkpoint_io::in_quotes;
using nlohmann::json;

std::string excerpt(const json& value) {
  std::string text = value.dump();
  return text.size() <= 80 ? text : text.substr(0, 80) + "...";
}

// The fields of one JSON object of the manifest: every one of `names`, any of `optional`
// (fields that checkpoints written before them lack) and no other, each read with its type
// checked. `where` names the object in messages ("manifest", "shards[1]").
class Fields {
 public:
  Fields(const json& value, std::string where, const std::string& file,
         std::initializer_list<const char*> names, std::initializer_list<const char*> optional = {})
      : value_(value), where_(std::move(where)), file_(file) {
    if (!value.is_object()) fail("", "is " + excerpt(value) + ", expected an object");
    for (const auto& [key, _] : value.items()) {
      bool known = false;
      for (const char* n : names) known = known || key == n;
      for (const char* n : optional) known = known || key == n;
      if (!known) fail("", "has an unknown field " + in_quotes(key));
    }
    for (const char* n : names)
      if (!value.contains(n)) fail("", "has no field '" + std::string(n) + "'");
  }

  bool has(const char* key) const { return value_.contains(key); }
  const json& any(const char* key) const { return value_.at(key); }

  int64_t integer(const char* key, int64_t min) const {
    const json& v = any(key);
    if (!v.is_number_integer() || v.get<int64_t>() < min ||
        (v.is_number_unsigned() &&
         v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())))
      fail(key, "is " + excerpt(v) + ", expected an integer >= " + std::to_string(min));
    return v.get<int64_t>();
  }
  // An integer in [min, max], a count a run records: `setting` names the TrainConfig field that
  // gives it, whose range it has.
  int64_t count(const char* key, int64_t min, int64_t max, const char* setting) const {
    const json& v = any(key);
    if (!v.is_number_integer() || v.get<int64_t>() < min || v.get<int64_t>() > max ||
        (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(max)))
      fail(key, "is " + excerpt(v) + ", expected an integer in [" + std::to_string(min) + ", " +
                    std::to_string(max) + "] (the range of " + setting + ")");
    return v.get<int64_t>();
  }
  int small_integer(const char* key, int min) const {
    const int64_t v = integer(key, min);
    if (v > std::numeric_limits<int>::max())
      fail(key, "is " + std::to_string(v) + ", which is too large");
    return static_cast<int>(v);
  }
  uint64_t unsigned_integer(const char* key) const {
    const json& v = any(key);
    if (!v.is_number_unsigned())
      fail(key, "is " + excerpt(v) + ", expected a non-negative integer");
    return v.get<uint64_t>();
  }
  double number(const char* key) const {
    const json& v = any(key);
    if (!v.is_number() || !std::isfinite(v.get<double>()))
      fail(key, "is " + excerpt(v) + ", expected a finite number");
    return v.get<double>();
  }
  std::string string(const char* key) const {
    const json& v = any(key);
    if (!v.is_string()) fail(key, "is " + excerpt(v) + ", expected a string");
    return v.get<std::string>();
  }
  const json& array(const char* key) const {
    const json& v = any(key);
    if (!v.is_array()) fail(key, "is " + excerpt(v) + ", expected a list");
    return v;
  }
  const json& object(const char* key) const {
    const json& v = any(key);
    if (!v.is_object()) fail(key, "is " + excerpt(v) + ", expected an object");
    return v;
  }

  [[noreturn]] void fail(const std::string& key, const std::string& problem) const {
    throw CheckpointError(file_ + ": " + (key.empty() ? where_ : where_ + "." + key) + " " +
                          problem);
  }

 private:
  const json& value_;
  std::string where_;
  const std::string& file_;
};

void parse_optimizer(const json& value, const std::string& file, TrainingState& state) {
  const Fields f(value, "manifest.optimizer", file,
                 {"kind", "lr", "min_lr", "warmup_steps", "beta1", "beta2", "eps", "weight_decay",
                  "momentum", "clip_norm", "steps_taken"});
  OptimizerConfig& o = state.optimizer;
  o.kind = f.string("kind");
  o.lr = f.number("lr");
  o.min_lr = f.number("min_lr");
  o.warmup_steps = f.integer("warmup_steps", 0);
  o.beta1 = f.number("beta1");
  o.beta2 = f.number("beta2");
  o.eps = f.number("eps");
  o.weight_decay = f.number("weight_decay");
  o.momentum = f.number("momentum");
  o.clip_norm = f.number("clip_norm");
  state.optimizer_steps = f.integer("steps_taken", 0);
  try {
    o.validate();
  } catch (const std::invalid_argument& e) {
    throw CheckpointError(file + ": manifest.optimizer is not a valid configuration (" + e.what() +
                          ")");
  }
}

// Stages 0..S-1 in order, cutting units [0, U) into consecutive ranges, each on one of the
// `num_ranks` pipeline ranks (`num_shards` over the replicas); every rank holds at least one
// stage.
void check_stages(const std::vector<StagePlacement>& stages, size_t num_ranks, size_t num_shards,
                  const std::string& file) {
  if (stages.empty()) throw CheckpointError(file + ": manifest.stages is empty");
  std::vector<bool> rank_used(num_ranks, false);
  int64_t next_unit = 0;
  for (size_t s = 0; s < stages.size(); ++s) {
    const StagePlacement& p = stages[s];
    const std::string where = file + ": manifest.stages[" + std::to_string(s) + "]";
    if (p.stage != static_cast<int>(s))
      throw CheckpointError(where + " is stage " + std::to_string(p.stage) + ", expected stage " +
                            std::to_string(s) + " (stages are listed in order)");
    if (static_cast<size_t>(p.rank) >= num_ranks)
      throw CheckpointError(
          where + " runs on rank " + std::to_string(p.rank) + ", expected a rank below " +
          std::to_string(num_ranks) + ": the " + counted(num_shards, "shard") + " make " +
          counted(num_ranks, "pipeline rank") +
          (num_shards == num_ranks
               ? std::string()
               : " in each of " + std::to_string(num_shards / num_ranks) + " replicas"));
    if (p.unit_begin != next_unit || p.unit_end <= p.unit_begin)
      throw CheckpointError(where + " holds units [" + std::to_string(p.unit_begin) + ", " +
                            std::to_string(p.unit_end) +
                            "), expected a non-empty range from unit " + std::to_string(next_unit) +
                            " (stages cut the units in order)");
    rank_used[p.rank] = true;
    next_unit = p.unit_end;
  }
  for (size_t r = 0; r < num_ranks; ++r)
    if (!rank_used[r])
      throw CheckpointError(file + ": manifest.stages place no stage on rank " + std::to_string(r) +
                            ", which has a shard");
}

// A count in one of the free-form sections (model, rng), which Fields does not check.
int64_t positive_count(const json& value, const std::string& field, const std::string& file) {
  if (!value.is_number_unsigned() || value.get<uint64_t>() < 1 ||
      value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    throw CheckpointError(file + ": manifest." + field + " is " + excerpt(value) +
                          ", expected an integer >= 1");
  return value.get<int64_t>();
}

// The stages cut all of the model's units when its description says how many there are.
void check_stage_units(const TrainingState& s, const std::string& file) {
  if (!s.model.contains("num_units")) return;
  const int64_t units = positive_count(s.model["num_units"], "model.num_units", file);
  const int64_t end = s.stages.back().unit_end;
  if (end != units)
    throw CheckpointError(file + ": manifest.stages end at unit " + std::to_string(end) +
                          " but manifest.model.num_units is " + std::to_string(units) +
                          " (the stages cut all of the model's units)");
}

// The recorded token is one of the model's when its description gives a vocab (a model that
// does not say has none, or 0).
void check_token_vocab(const TrainingState& s, const std::string& file) {
  if (!s.data.token || !s.model.contains("vocab")) return;
  const json& vocab = s.model["vocab"];
  if (!vocab.is_number_unsigned() || vocab.get<uint64_t>() < 1) return;
  if (static_cast<uint64_t>(*s.data.token) >= vocab.get<uint64_t>())
    throw CheckpointError(file + ": manifest.data.token is " + std::to_string(*s.data.token) +
                          ", expected a token id below manifest.model.vocab " + vocab.dump() +
                          " (the next input of the model the checkpoint holds)");
}

}  // namespace

void check_shard_file_name(const std::string& name, const std::string& file) {
  const std::string suffix = ".safetensors";
  bool ok = name.size() > suffix.size() && name.ends_with(suffix) && name.front() != '.' &&
            name.size() <= 255;
  for (char c : name)
    ok = ok && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                c == '.' || c == '_' || c == '-');
  if (!ok)
    throw CheckpointError(file + ": shard file name " + in_quotes(name) +
                          " is not a plain file name ending in .safetensors (letters, digits, "
                          "'.', '_', '-')");
}

bool is_trainer_manifest(const CheckpointManifest& m) {
  const json& model = m.state.model;
  return model.is_object() && model.contains("name") && model.contains("num_units") &&
         model.contains("vocab") && model.contains("unit_parameters");
}

void check_trainer_manifest(const CheckpointManifest& m, const std::string& file) {
  // The library lets a caller keep any rng; a trainer always writes its batch size there,
  // and a resume without it could not tell that another batch size starts elsewhere.
  const json& rng = m.state.rng;
  if (!rng.is_object() || !rng.contains("batch_tokens"))
    throw CheckpointError(file + ": manifest.rng is " + excerpt(rng) +
                          ", expected the {\"seed\", \"batch_tokens\"} a training run saves: "
                          "without batch_tokens a resume cannot check that this run draws as "
                          "many tokens per step as the saved one");
}

// A resume seeks the data source to data.position, so a position the step does not explain
// is refused here rather than replayed token by token.
void check_manifest_counters(const CheckpointManifest& m, const std::string& file) {
  const TrainingState& s = m.state;
  auto fail = [&](const std::string& field, int64_t value, const std::string& expected) {
    throw CheckpointError(file + ": manifest." + field + " is " + std::to_string(value) +
                          ", expected " + expected);
  };
  const std::string step = std::to_string(s.step);
  if (s.optimizer_steps > s.step)
    fail("optimizer.steps_taken", s.optimizer_steps,
         "at most the checkpoint's step " + step + " (an optimizer step per step)");
  if (s.lr_schedule.step > s.step)
    fail("lr_schedule.step", s.lr_schedule.step, "at most the checkpoint's step " + step);
  if (s.lr_schedule.step > s.lr_schedule.total_steps)
    fail("lr_schedule.step", s.lr_schedule.step,
         "at most lr_schedule.total_steps " + std::to_string(s.lr_schedule.total_steps));
  if (!s.rng.is_object() || !s.rng.contains("batch_tokens")) return;
  const auto tokens =
      static_cast<uint64_t>(positive_count(s.rng["batch_tokens"], "rng.batch_tokens", file));
  if (s.optimizer_steps != s.step)
    fail("optimizer.steps_taken", s.optimizer_steps, "the checkpoint's step " + step);
  if (s.lr_schedule.step != s.step)
    fail("lr_schedule.step", s.lr_schedule.step, "the checkpoint's step " + step);
  const auto steps = static_cast<uint64_t>(s.step);
  const bool overflows = steps != 0 && tokens > std::numeric_limits<uint64_t>::max() / steps;
  if (overflows || s.data.position != steps * tokens)
    throw CheckpointError(
        file + ": manifest.data.position is " + std::to_string(s.data.position) +
        ", expected step x rng.batch_tokens = " + step + " x " + std::to_string(tokens) +
        (overflows ? " (which overflows)" : " = " + std::to_string(steps * tokens)) +
        " (every step draws batch_tokens tokens)");
}

CheckpointManifest parse_manifest(std::string_view text, const std::string& file) {
  const json root = checkpoint_io::parse_json_strictly(text, file);
  if (!root.is_object()) throw CheckpointError(file + ": the manifest is not a JSON object");
  // The format and its version first: the other fields are those of that version.
  if (!root.contains("format") || root["format"] != "conveyor")
    throw CheckpointError(file +
                          ": no \"format\": \"conveyor\": not a Conveyor checkpoint manifest");
  if (!root.contains("format_version"))
    throw CheckpointError(file + ": manifest has no field 'format_version'");
  const json& version = root["format_version"];
  if (!version.is_number_integer())
    throw CheckpointError(file + ": manifest.format_version is " + excerpt(version) +
                          ", expected the integer " + std::to_string(kCheckpointFormatVersion));
  if (version.get<int64_t>() != kCheckpointFormatVersion)
    throw CheckpointError(file + ": unknown format version " + excerpt(version) +
                          " (this build reads version " + std::to_string(kCheckpointFormatVersion) +
                          ")");

  // "replicas", "state_xxh3_64" and "manifest_xxh3_64" are the optional fields at this level
  // (schedule.data_parallel, data.token and data.contents the others, below).
  const Fields f(root, "manifest", file,
                 {"format", "format_version", "step", "model", "model_fingerprint", "stages",
                  "schedule", "optimizer", "lr_schedule", "data", "rng", "shards"},
                 {"replicas", "state_xxh3_64", "manifest_xxh3_64"});
  CheckpointManifest m;
  m.format_version = kCheckpointFormatVersion;
  TrainingState& s = m.state;
  s.step = f.integer("step", 0);
  s.model = f.object("model");
  s.model_fingerprint = f.string("model_fingerprint");
  if (s.model_fingerprint.empty()) f.fail("model_fingerprint", "is empty");
  s.rng = f.any("rng");

  // "data_parallel" is optional: checkpoints written before it was recorded have none.
  const Fields schedule(f.object("schedule"), "manifest.schedule", file, {"name", "microbatches"},
                        {"data_parallel"});
  s.schedule = schedule.string("name");
  s.microbatches = schedule.count("microbatches", 1, kMaxMicrobatches, "TrainConfig::microbatches");
  if (schedule.has("data_parallel"))
    s.data_parallel = static_cast<int>(
        schedule.count("data_parallel", 1, kMaxReplicas, "TrainConfig::data_parallel"));

  parse_optimizer(f.object("optimizer"), file, s);

  const Fields lr(f.object("lr_schedule"), "manifest.lr_schedule", file, {"step", "total_steps"});
  s.lr_schedule.step = lr.integer("step", 0);
  s.lr_schedule.total_steps = lr.integer("total_steps", 0);

  // "token" and "contents" are optional: checkpoints written before they were recorded have
  // neither (and resume by replay, and by comparing `source`), sources without them too.
  const Fields data(f.object("data"), "manifest.data", file, {"source", "position"},
                    {"token", "contents"});
  s.data.source = data.string("source");
  s.data.position = data.unsigned_integer("position");
  if (data.has("token")) s.data.token = data.small_integer("token", 0);
  if (data.has("contents")) {
    const json& contents = data.any("contents");
    if (!contents.is_string() || !checkpoint_io::is_xxh3_64_text(contents.get<std::string>()))
      throw CheckpointError(file + ": manifest.data.contents is " + excerpt(contents) +
                            ", expected \"xxh3_64:\" and 16 lowercase hex digits (the digest of "
                            "the data's bytes)");
    s.data.contents = contents.get<std::string>();
  }

  const json& shards = f.array("shards");
  if (shards.empty()) f.fail("shards", "is empty: a checkpoint has at least one shard");
  std::set<std::string> names;
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string where = "manifest.shards[" + std::to_string(i) + "]";
    const Fields e(shards[i], where, file, {"rank", "file", "bytes", "xxh3_64"});
    ShardEntry entry;
    entry.rank = e.small_integer("rank", 0);
    if (entry.rank != static_cast<int>(i))
      e.fail("rank", "is " + std::to_string(entry.rank) + ", expected " + std::to_string(i) +
                         " (shards are listed by rank, one per rank)");
    entry.file = e.string("file");
    check_shard_file_name(entry.file, file);
    if (!names.insert(entry.file).second)
      e.fail("file", "is " + in_quotes(entry.file) + ", which another shard also names");
    entry.bytes = e.unsigned_integer("bytes");
    const auto checksum = checkpoint_io::parse_hex64(e.string("xxh3_64"));
    if (!checksum)
      e.fail("xxh3_64", "is " + excerpt(e.any("xxh3_64")) + ", expected 16 hex digits");
    entry.checksum = *checksum;
    m.shards.push_back(entry);
  }

  const json& stages = f.array("stages");
  for (size_t i = 0; i < stages.size(); ++i) {
    const Fields p(stages[i], "manifest.stages[" + std::to_string(i) + "]", file,
                   {"stage", "rank", "units"});
    StagePlacement placement;
    placement.stage = p.small_integer("stage", 0);
    placement.rank = p.small_integer("rank", 0);
    const json& units = p.array("units");
    if (units.size() != 2 || !units[0].is_number_unsigned() || !units[1].is_number_unsigned() ||
        units[1].get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      p.fail("units", "is " + excerpt(units) + ", expected [first unit, one past the last]");
    placement.unit_begin = units[0].get<int64_t>();
    placement.unit_end = units[1].get<int64_t>();
    s.stages.push_back(placement);
  }
  for (const auto& [key, target] : {std::pair{"state_xxh3_64", &m.state_checksum},
                                    {"manifest_xxh3_64", &m.manifest_checksum}}) {
    if (!root.contains(key)) continue;
    const json& checksum = root[key];
    const auto value = checksum.is_string()
                           ? checkpoint_io::parse_hex64(checksum.get<std::string>())
                           : std::nullopt;
    if (!value)
      throw CheckpointError(file + ": manifest." + key + " is " + excerpt(checksum) +
                            ", expected 16 hex digits");
    *target = *value;
  }
  if (root.contains("replicas")) {
    const json& replicas = root["replicas"];
    // One replica is written as no field: a manifest has one way to say it.
    if (!replicas.is_number_unsigned() || replicas.get<uint64_t>() < 2 ||
        replicas.get<uint64_t>() > static_cast<uint64_t>(kMaxReplicas) ||
        replicas.get<uint64_t>() > m.shards.size() || m.shards.size() % replicas.get<uint64_t>())
      throw CheckpointError(
          file + ": manifest.replicas is " + excerpt(replicas) +
          ", expected a number of replicas from 2 to " + std::to_string(kMaxReplicas) +
          " (TrainConfig::data_parallel) that divides the " + std::to_string(m.shards.size()) +
          " shards (a checkpoint of one replica has no replicas field)");
    s.replicas = replicas.get<int>();
  }
  // Each replica has a shard per pipeline rank, and each rank at most kMaxChunks stages.
  const size_t ranks = m.shards.size() / static_cast<size_t>(s.replicas);
  if (ranks > static_cast<size_t>(kMaxStages))
    throw CheckpointError(file + ": manifest.shards lists " + std::to_string(m.shards.size()) +
                          " shards, " + std::to_string(ranks) + " pipeline ranks per replica, " +
                          "expected at most " + std::to_string(kMaxStages) +
                          " (the range of TrainConfig::stages)");
  if (s.stages.size() > ranks * static_cast<size_t>(kMaxChunks))
    throw CheckpointError(file + ": manifest.stages has " + std::to_string(s.stages.size()) +
                          " stages on " + std::to_string(ranks) +
                          " pipeline rank(s), expected at most " + std::to_string(kMaxChunks) +
                          " per rank (the range of TrainConfig::chunks)");
  check_stages(s.stages, ranks, m.shards.size(), file);
  check_stage_units(s, file);
  check_token_vocab(s, file);
  return m;
}

}  // namespace conveyor