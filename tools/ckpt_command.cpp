// `conveyor ckpt`: look into checkpoints.
//   inspect PATH   the manifest in brief and a table of the tensors (--json: all of it)
//   verify PATH    checks every file and recomputes every checksum, and a training run's
//                  manifest as a resume would before it compares it with the run: exit 0
//                  when all pass, 1 naming the first bad tensor, file or field, 2 for usage
//                  errors
//   demo DIR       (hidden) writes a checkpoint of random tensors, for tests and trials
// PATH is a checkpoint folder DIR (its `latest`), DIR/latest or DIR/step_<N>.
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/core/device_context.h"
#include "engine/core/number_text.h"
#include "engine/train/checkpoint.h"
#include "engine/train/checkpoint_io.h"
#include "engine/train/checkpoint_model.h"
#include "engine/train/safetensors.h"
#include "tools/cli_common.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"
#include "tools/output_file.h"

namespace conveyor::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct CkptFlags {
  std::string path;
  bool json = false;
  int64_t values = 0;  // leading elements of each tensor to print
  // demo
  int64_t step = 1;
  int ranks = 2;
  uint64_t seed = 1;
  int keep = 0;
};

// A path that names no checkpoint is bad input (exit 2); a checkpoint that fails a check is
// what verify and inspect are there to find (exit 1).
Checkpoint open_for_command(const std::string& path) {
  try {
    return open_checkpoint(path);
  } catch (const NotACheckpointError& e) {
    throw UsageError(e.what());
  }
}

// A float element for JSON: a number, or for NaN and the infinities, which JSON has no number
// for (nlohmann::json writes all three as null), the string the text output prints.
json float_value(float v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

// The first `count` elements of tensor `t`, as numbers (bf16 widened to float exactly) or, for
// NaN and the infinities, float_value's strings.
json leading_values(const Checkpoint& ckpt, const CheckpointTensor& t, int64_t count) {
  json out = json::array();
  if (count <= 0) return out;
  const std::vector<unsigned char> bytes = ckpt.read_bytes(t.name);
  const size_t n = std::min<size_t>(static_cast<size_t>(count), bytes.size() / dtype_size(t.dtype));
  for (size_t i = 0; i < n; ++i) {
    if (t.dtype == DType::kF32) {
      float v;
      std::memcpy(&v, bytes.data() + 4 * i, 4);
      out.push_back(float_value(v));
    } else if (t.dtype == DType::kBF16) {
      uint16_t v;
      std::memcpy(&v, bytes.data() + 2 * i, 2);
      out.push_back(float_value(bf16_to_float(v)));
    } else {
      int32_t v;
      std::memcpy(&v, bytes.data() + 4 * i, 4);
      out.push_back(v);
    }
  }
  return out;
}

// Left-aligned columns.
void print_table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows)
    for (size_t c = 0; c < row.size(); ++c) {
      if (width.size() <= c) width.push_back(0);
      width[c] = std::max(width[c], row[c].size());
    }
  for (const auto& row : rows) {
    std::string line = " ";
    for (size_t c = 0; c < row.size(); ++c) {
      line += " " + row[c];
      if (c + 1 < row.size()) line.append(width[c] - row[c].size(), ' ');
    }
    std::printf("%s\n", line.c_str());
  }
}

std::string number_list(const json& values) {
  std::string text;
  for (const json& v : values) {
    char buf[32];
    if (v.is_string())
      std::snprintf(buf, sizeof buf, "%s", v.get<std::string>().c_str());
    else if (v.is_number_float())
      std::snprintf(buf, sizeof buf, "%.9g", v.get<double>());
    else
      std::snprintf(buf, sizeof buf, "%" PRId64, v.get<int64_t>());
    text += (text.empty() ? "" : " ") + std::string(buf);
  }
  return text;
}

void run_inspect(const CkptFlags& flags) {
  const Checkpoint ckpt = open_for_command(flags.path);
  const CheckpointManifest& m = ckpt.manifest();
  const TrainingState& s = m.state;

  if (flags.json) {
    json out = manifest_to_json(m);
    out["directory"] = ckpt.directory().string();
    json tensors = json::array();
    for (const CheckpointTensor& t : ckpt.tensors()) {
      json entry = {{"name", t.name},
                    {"dtype", safetensors_dtype_name(t.dtype)},
                    {"shape", t.shape},
                    {"bytes", t.bytes}};
      if (t.pieced) {
        json pieces = json::array();
        for (const CheckpointPiece& p : t.pieces)
          pieces.push_back({{"elements", {p.begin, p.end}},
                            {"shard", m.shards[p.rank].file},
                            {"rank", p.rank},
                            {"xxh3_64", checkpoint_io::hex64(p.checksum)}});
        entry["pieces"] = pieces;
      } else {
        entry["shard"] = m.shards[t.rank].file;
        entry["rank"] = t.rank;
        entry["xxh3_64"] = checkpoint_io::hex64(t.checksum);
      }
      if (flags.values > 0) entry["values"] = leading_values(ckpt, t, flags.values);
      tensors.push_back(entry);
    }
    out["tensors"] = tensors;
    // JSON holds only UTF-8: a folder name of other bytes is written with U+FFFD in their
    // place rather than refused (the manifest's own strings were checked when it was read).
    std::printf("%s\n", out.dump(2, ' ', false, json::error_handler_t::replace).c_str());
    return;
  }

  std::printf("checkpoint %s (format version %d), step %" PRId64 "\n",
              escaped_for_message(ckpt.directory().native()).c_str(), m.format_version, s.step);
  std::printf("  model        %s %s\n", s.model_fingerprint.c_str(), s.model.dump().c_str());
  std::string stages;
  for (const StagePlacement& p : s.stages)
    stages += (stages.empty() ? "" : ", ") + std::to_string(p.stage) + " on rank " +
              std::to_string(p.rank) + " (units [" + std::to_string(p.unit_begin) + ", " +
              std::to_string(p.unit_end) + "))";
  std::printf("  stages       %s\n", stages.c_str());
  // The manifest's and the headers' strings may hold any character a hand or a corruption put
  // there: control characters are shown escaped, as in errors, so none reaches the terminal.
  // The replica count, when recorded: a resume under another sums the gradients in another
  // order.
  const std::string replicas =
      s.data_parallel ? " over " + counted(*s.data_parallel, "data-parallel replica") : "";
  std::printf("  schedule     %s, %s%s\n", escaped_keeping_backslashes(s.schedule).c_str(),
              counted(s.microbatches, "micro-batch", "micro-batches").c_str(), replicas.c_str());
  std::printf("  optimizer    %s, lr %g (min %g, warm-up %" PRId64 "), %s taken\n",
              escaped_keeping_backslashes(s.optimizer.kind).c_str(), s.optimizer.lr,
              s.optimizer.min_lr, s.optimizer.warmup_steps,
              counted(s.optimizer_steps, "step").c_str());
  std::printf("  lr schedule  step %" PRId64 " of %" PRId64 "\n", s.lr_schedule.step,
              s.lr_schedule.total_steps);
  std::printf("  data         %s, position %" PRIu64,
              escaped_keeping_backslashes(s.data.source).c_str(), s.data.position);
  if (s.data.token) std::printf(", token %" PRId32, *s.data.token);
  // The digest a --data resume is matched by, whatever name the file had.
  if (s.data.contents) std::printf(", contents %s", s.data.contents->c_str());
  std::printf("\n");
  std::printf("  rng          %s\n", s.rng.dump().c_str());
  if (s.replicas > 1)
    std::printf("  replicas     %d, each saving its pieces of the optimizer state\n", s.replicas);

  std::printf("shards:\n");
  std::vector<std::vector<std::string>> rows = {{"rank", "file", "bytes", "xxh3_64"}};
  uint64_t file_bytes = 0;
  for (const ShardEntry& e : m.shards) {
    rows.push_back({std::to_string(e.rank), e.file, std::to_string(e.bytes),
                    checkpoint_io::hex64(e.checksum)});
    file_bytes += e.bytes;
  }
  print_table(rows);

  std::printf("tensors:\n");
  rows = {{"name", "dtype", "shape", "bytes", "shard", "xxh3_64"}};
  uint64_t data_bytes = 0;
  std::vector<std::string> values;
  std::vector<std::vector<std::string>> piece_rows = {{"name", "elements", "shard", "xxh3_64"}};
  for (const CheckpointTensor& t : ckpt.tensors()) {
    const size_t n = t.pieces.size();
    rows.push_back({escaped_keeping_backslashes(t.name), safetensors_dtype_name(t.dtype),
                    shape_to_string(t.shape), std::to_string(t.bytes),
                    t.pieced ? counted(n, "piece") : m.shards[t.rank].file,
                    t.pieced ? "(per piece)" : checkpoint_io::hex64(t.checksum)});
    if (t.pieced)
      for (const CheckpointPiece& p : t.pieces)
        piece_rows.push_back({escaped_keeping_backslashes(t.name),
                              "[" + std::to_string(p.begin) + ", " + std::to_string(p.end) + ")",
                              m.shards[p.rank].file, checkpoint_io::hex64(p.checksum)});
    data_bytes += t.bytes;
    if (flags.values > 0) values.push_back(number_list(leading_values(ckpt, t, flags.values)));
  }
  if (flags.values > 0) {
    rows[0].push_back("values");
    for (size_t i = 0; i < values.size(); ++i) rows[i + 1].push_back(values[i]);
  }
  print_table(rows);
  if (piece_rows.size() > 1) {
    std::printf("pieces (elements of the flattened tensor):\n");
    print_table(piece_rows);
  }
  std::printf("total: %s, %s of data, %s of %s\n", counted(ckpt.tensors().size(), "tensor").c_str(),
              counted(data_bytes, "byte").c_str(), counted(m.shards.size(), "shard").c_str(),
              counted(file_bytes, "byte").c_str());
}

void run_verify(const CkptFlags& flags) {
  // Opening checks every file and recomputes every checksum; any mismatch throws, naming the
  // tensor and the file, and ends the command with status 1.
  const Checkpoint ckpt = open_for_command(flags.path);
  const CheckpointManifest& m = ckpt.manifest();
  // A training run's checkpoint is also held to what resuming it needs of the manifest alone,
  // so that verify passes no manifest that train --resume refuses before it looks at the run.
  const bool trainer = is_trainer_manifest(m);
  if (trainer)
    check_trainer_manifest(m, checkpoint_io::shown_path(ckpt.directory() / "manifest.json"));
  uint64_t bytes = 0;
  for (const ShardEntry& e : m.shards) bytes += e.bytes;
  // The shards' checksums are always there; the manifest's own two were added later, and a
  // manifest without them was checked by its rules alone.
  std::vector<std::string> absent;
  if (!m.state_checksum) absent.push_back("state_xxh3_64");
  if (!m.manifest_checksum) absent.push_back("manifest_xxh3_64");
  std::string checked;
  if (absent.empty()) {
    checked = "every checksum matches (tensors, shard files, training state, manifest)";
  } else {
    checked = "every tensor's and shard file's checksum matches; the manifest has no ";
    for (size_t i = 0; i < absent.size(); ++i) checked += (i ? " or " : "") + absent[i];
    checked +=
        " (written before they were recorded), so its fields were checked against the "
        "format's rules and the shards only";
  }
  if (trainer) checked += "; a training run's checkpoint, with the rng.batch_tokens a resume needs";
  std::printf("ok: %s, step %" PRId64 ": %s in %s (%s), %s\n",
              escaped_for_message(ckpt.directory().native()).c_str(), ckpt.step(),
              counted(ckpt.tensors().size(), "tensor").c_str(),
              counted(m.shards.size(), "shard").c_str(), counted(bytes, "byte").c_str(),
              checked.c_str());
}

// A tensor of random values on the CPU.
Tensor random_tensor(DeviceContext& ctx, DType dtype, const Shape& shape, std::mt19937_64& rng) {
  Tensor t = ctx.empty(shape, dtype);
  std::uniform_real_distribution<float> real(-1.0f, 1.0f);
  std::uniform_int_distribution<int32_t> integer(-1000, 1000);
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (dtype == DType::kF32) t.data<float>()[i] = real(rng);
    if (dtype == DType::kBF16) t.data<uint16_t>()[i] = float_to_bf16(real(rng));
    if (dtype == DType::kI32) t.data<int32_t>()[i] = integer(rng);
  }
  return t;
}

void run_demo(const CkptFlags& flags) {
  DeviceContext ctx(Device::cpu());
  // Rank r holds block r: a weight and bias with their AdamW moments, and a bf16 and an i32
  // tensor so that every dtype appears.
  std::vector<std::vector<NamedTensor>> shards(flags.ranks);
  for (int r = 0; r < flags.ranks; ++r) {
    std::mt19937_64 rng(flags.seed * 1000003 + static_cast<uint64_t>(r));
    const std::string b = "blocks." + std::to_string(r);
    auto& t = shards[r];
    t.push_back({b + ".fc1.weight", random_tensor(ctx, DType::kF32, {8, 4}, rng)});
    t.push_back({b + ".fc1.bias", random_tensor(ctx, DType::kF32, {8}, rng)});
    for (const char* kind : {"m", "v"}) {
      t.push_back({std::string("optimizer.") + kind + "." + b + ".fc1.weight",
                   random_tensor(ctx, DType::kF32, {8, 4}, rng)});
      t.push_back({std::string("optimizer.") + kind + "." + b + ".fc1.bias",
                   random_tensor(ctx, DType::kF32, {8}, rng)});
    }
    t.push_back({b + ".gain", random_tensor(ctx, DType::kBF16, {3, 5}, rng)});
    t.push_back({b + ".token_counts", random_tensor(ctx, DType::kI32, {6}, rng)});
  }
  // A folder that cannot take the checkpoint (a file in the way, a step there already) is
  // refused before anything is written, as train refuses its --save-dir.
  refuse_kernel_file_system(flags.path, "folder '" + escaped_for_message(flags.path) + "'");
  std::optional<CheckpointWriter> prepared;
  try {
    prepared.emplace(flags.path, flags.step, flags.ranks, CheckpointWriterOptions{flags.keep});
  } catch (const CheckpointError& e) {
    throw UsageError(e.what());
  }
  CheckpointWriter& writer = *prepared;
  std::vector<std::thread> threads;
  for (int r = 0; r < flags.ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        writer.write_shard(r, shards[r]);
      } catch (const std::exception& e) {
        // commit() then fails naming the rank; the cause is printed here.
        std::fprintf(stderr, "conveyor: error: rank %d: %s\n", r, e.what());
      }
    });
  for (auto& th : threads) th.join();

  TrainingState state;
  state.step = flags.step;
  state.model = {{"preset", "demo"}, {"blocks", flags.ranks}, {"d_model", 4}, {"hidden", 8}};
  state.model_fingerprint = model_fingerprint(state.model);
  for (int r = 0; r < flags.ranks; ++r) state.stages.push_back({r, r, r, r + 1});
  state.schedule = "1f1b";
  state.microbatches = 4;
  state.optimizer_steps = flags.step;
  state.lr_schedule = {flags.step, std::max<int64_t>(flags.step, 100)};
  state.data = {"demo tokens", static_cast<uint64_t>(flags.step) * 1024};
  state.rng = {{"seed", flags.seed}};
  const CommitResult result = writer.commit(state);
  std::printf("wrote %s (%s)\n", escaped_for_message(result.directory.native()).c_str(),
              counted(flags.ranks, "shard").c_str());
  for (const std::string& w : result.warnings)
    std::fprintf(stderr, "conveyor: warning: %s\n", w.c_str());
}

}  // namespace

// The help of inspect's and verify's PATH, which their refusal without one repeats
// (parse_errors.h).
constexpr const char* kCheckpointPathText =
    "A checkpoint folder DIR (its latest step), DIR/latest or DIR/step_<N>";

void register_ckpt_command(CLI::App& app) {
  auto flags = std::make_shared<CkptFlags>();
  CLI::App* ckpt = app.add_subcommand("ckpt", "Inspect and verify checkpoints");
  ckpt->require_subcommand(1);
  // CLI11 gives a subcommand its parent's footer: each sets its own, so that its example
  // names it.
  const std::string exit_status =
      "Exit status: 0 every check passed, 1 a file or checksum of the checkpoint is bad (the "
      "message names it) or stdout could not be written, 2 bad input (PATH names no checkpoint: "
      "nothing there, a file that is "
      "neither the checkpoint's folder nor its 'latest', a folder holding none; a bad flag), " +
      std::string(kInterruptedStatusText) + ".";
  ckpt->footer("Example: conveyor ckpt verify runs/ckpt/latest\n" + exit_status);

  CLI::App* inspect = ckpt->add_subcommand(
      "inspect", "Print a checkpoint's manifest and tensors (after checking all of it)");
  add_path_flag(inspect, "PATH", flags->path, kCheckpointPathText,
                "a checkpoint path (DIR, DIR/latest or DIR/step_<N>)")
      ->required()
      ->type_name("");
  add_switch(inspect, "--json", flags->json, "Print everything as one JSON document");
  add_int_flag(inspect, "--values", flags->values, 0, int64_t{1} << 31,
               "Also print the first N elements of each tensor (with --json, NaN and "
               "infinities as \"nan\", \"inf\", \"-inf\")");
  inspect->footer("Example: conveyor ckpt inspect runs/ckpt/latest\n" + exit_status);
  inspect->callback([flags] { run_inspect(*flags); });

  CLI::App* verify = ckpt->add_subcommand(
      "verify",
      "Check every file and checksum, and a training run's manifest as a resume does: exit 0 if "
      "all pass, 1 naming the first bad one");
  add_path_flag(verify, "PATH", flags->path, kCheckpointPathText,
                "a checkpoint path (DIR, DIR/latest or DIR/step_<N>)")
      ->required()
      ->type_name("");
  verify->footer("Example: conveyor ckpt verify runs/ckpt/latest\n" + exit_status);
  verify->callback([flags] { run_verify(*flags); });

  CLI::App* demo = ckpt->add_subcommand("demo", "Write a checkpoint of random tensors into DIR");
  demo->group("");  // for tests and trials, not in the help
  add_path_flag(demo, "DIR", flags->path, "The checkpoint folder to write", "a folder name")
      ->required();
  add_int_flag(demo, "--step", flags->step, 0, 1000000000, "Step of the checkpoint");
  add_int_flag(demo, "--ranks", flags->ranks, 1, 1024, "Number of shards");
  add_int_flag(demo, "--seed", flags->seed, 0, std::numeric_limits<int64_t>::max(),
               "Seed of the random values");
  add_int_flag(demo, "--keep", flags->keep, 0, 1000000, "Keep the newest K checkpoints (0: all)");
  demo->callback([flags] { run_demo(*flags); });
}

}  // namespace conveyor::cli
