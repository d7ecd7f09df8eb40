// The manifest as written: manifest_to_json, the checksums and the model fingerprint computed
// of what it writes, and the checks that a manifest read back still matches them. Reading a
// manifest is in checkpoint_manifest.cpp.
#include <cstdint>
#include <string>

#include "engine/schedule/input_file.h"
#include "engine/train/checkpoint_error.h"
#include "engine/train/checkpoint_io.h"
#include "engine/train/checkpoint_manifest.h"

namespace conveyor {
namespace {

using nlohmann::json;

json optimizer_to_json(const OptimizerConfig& o, int64_t steps_taken) {
  return {{"kind", o.kind},
          {"lr", o.lr},
          {"min_lr", o.min_lr},
          {"warmup_steps", o.warmup_steps},
          {"beta1", o.beta1},
          {"beta2", o.beta2},
          {"eps", o.eps},
          {"weight_decay", o.weight_decay},
          {"momentum", o.momentum},
          {"clip_norm", o.clip_norm},
          {"steps_taken", steps_taken}};
}

// The fields a resume takes from the manifest alone, which state_xxh3_64 covers.
json training_state_sections(const TrainingState& s) {
  json data = {{"source", s.data.source}, {"position", s.data.position}};
  if (s.data.token) data["token"] = *s.data.token;
  if (s.data.contents) data["contents"] = *s.data.contents;
  return {
      {"step", s.step},
      {"optimizer", optimizer_to_json(s.optimizer, s.optimizer_steps)},
      {"lr_schedule", {{"step", s.lr_schedule.step}, {"total_steps", s.lr_schedule.total_steps}}},
      {"data", data},
      {"rng", s.rng}};
}

}  // namespace

uint64_t training_state_checksum(const CheckpointManifest& m) {
  // dump() without indent writes no spaces and, an object being a sorted map, sorted keys.
  const std::string text = training_state_sections(m.state).dump();
  return checkpoint_io::xxh3_64(text.data(), text.size());
}

std::string model_fingerprint(const nlohmann::json& description) {
  const std::string canonical = description.dump();  // object keys are sorted
  return checkpoint_io::xxh3_64_text(canonical.data(), canonical.size());
}

namespace {

// A value the manifest records of some of its own fields that those fields no longer give.
[[noreturn]] void refuse_edited(const std::string& file, const std::string& what,
                                const std::string& field, const std::string& recorded,
                                const std::string& computed) {
  throw CheckpointError(file + ": " + what + " does not match its " + field + " (" + recorded +
                        " recorded, " + computed + " computed): the file was edited or corrupted");
}

}  // namespace

void check_manifest_model_fingerprint(const CheckpointManifest& m, const std::string& file) {
  const std::string& stored = m.state.model_fingerprint;
  const std::string computed = model_fingerprint(m.state.model);
  if (computed != stored)
    throw CheckpointError(file + ": the model description does not match its fingerprint " +
                          "manifest.model_fingerprint (" + escaped_keeping_backslashes(stored) +
                          "; the description's is " + computed +
                          "): the file was edited or corrupted");
}

void check_manifest_state_checksum(const CheckpointManifest& m, const std::string& file) {
  if (!m.state_checksum) return;
  const uint64_t computed = training_state_checksum(m);
  if (computed != *m.state_checksum)
    refuse_edited(file, "the training state (step, optimizer, lr_schedule, data, rng)",
                  "checksum manifest.state_xxh3_64", checkpoint_io::hex64(*m.state_checksum),
                  checkpoint_io::hex64(computed));
}

uint64_t manifest_checksum(const CheckpointManifest& m) {
  json without = manifest_to_json(m);
  without.erase("manifest_xxh3_64");
  const std::string text = without.dump();  // compact, keys sorted
  return checkpoint_io::xxh3_64(text.data(), text.size());
}

void check_manifest_checksum(const CheckpointManifest& m, const std::string& file) {
  if (!m.manifest_checksum) return;
  const uint64_t computed = manifest_checksum(m);
  if (computed != *m.manifest_checksum)
    refuse_edited(file, "the manifest", "checksum manifest.manifest_xxh3_64",
                  checkpoint_io::hex64(*m.manifest_checksum), checkpoint_io::hex64(computed));
}

json manifest_to_json(const CheckpointManifest& m) {
  const TrainingState& s = m.state;
  json stages = json::array();
  for (const StagePlacement& p : s.stages)
    stages.push_back({{"stage", p.stage}, {"rank", p.rank}, {"units", {p.unit_begin, p.unit_end}}});
  json shards = json::array();
  for (const ShardEntry& e : m.shards)
    shards.push_back({{"rank", e.rank},
                      {"file", e.file},
                      {"bytes", e.bytes},
                      {"xxh3_64", checkpoint_io::hex64(e.checksum)}});
  json out = training_state_sections(s);
  out["format"] = "conveyor";
  out["format_version"] = m.format_version;
  out["model"] = s.model;
  out["model_fingerprint"] = s.model_fingerprint;
  out["stages"] = stages;
  out["schedule"] = {{"name", s.schedule}, {"microbatches", s.microbatches}};
  if (s.data_parallel) out["schedule"]["data_parallel"] = *s.data_parallel;
  out["shards"] = shards;
  if (m.state_checksum) out["state_xxh3_64"] = checkpoint_io::hex64(*m.state_checksum);
  if (m.manifest_checksum) out["manifest_xxh3_64"] = checkpoint_io::hex64(*m.manifest_checksum);
  // Written only when there is more than one, so a checkpoint of one replica stays as before.
  if (s.replicas != 1) out["replicas"] = s.replicas;
  return out;
}

}  // namespace conveyor
