// Checkpoints of a sharded optimizer state: pieces of a global tensor spread over shards are
// assembled on load (or only the range a rank needs is read), ranges that overlap, leave a
// gap or exceed their tensor are refused naming the file and tensor, and a training run saved
// at (P stages, D replicas) sharded resumes at (P', D') sharded or not.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <map>
#include <vector>

#include "engine/train/checkpoint_model.h"
#include "engine/train/trainer.h"
#include "engine/train/trainer_checkpoint.h"
#include "support/train_config.h"
#include "tests/engine/train/checkpoint_fixture.h"

namespace conveyor {
namespace {

using namespace conveyor::testing;

// ------------------------------------------------------------------------ the format

using PiecedCheckpoint = PiecedDemo;

TEST(PiecedCheckpoint, PiecesAreAssembledAndRangesReadAcrossThem) {
  TempDir dir;
  const PiecedCheckpoint saved;
  const fs::path folder = saved.save(dir.path());
  const Checkpoint ckpt = open_checkpoint(folder);
  EXPECT_EQ(ckpt.state().replicas, 3);
  const CheckpointTensor* m = ckpt.find("optimizer.m.w");
  ASSERT_NE(m, nullptr);
  EXPECT_TRUE(m->pieced);
  EXPECT_EQ(m->shape, (Shape{6, 4}));
  ASSERT_EQ(m->pieces.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(m->pieces[i].rank, i);
    EXPECT_EQ(m->pieces[i].begin, saved.cuts[i]);
    EXPECT_EQ(m->pieces[i].end, saved.cuts[i + 1]);
  }
  EXPECT_FALSE(ckpt.find("w")->pieced);

  Tensor whole = cpu_context().empty({6, 4}, DType::kF32);
  ckpt.read("optimizer.m.w", whole);
  EXPECT_EQ(tensor_bytes(whole), tensor_bytes(saved.moment));

  // [8, 20) spans the end of the first piece, all of the second and the start of the third.
  Tensor range = cpu_context().empty({12}, DType::kF32);
  ckpt.read_range("optimizer.m.w", 8, range);
  const auto all = to_vector_f32(saved.moment), got = to_vector_f32(range);
  EXPECT_EQ(std::memcmp(got.data(), all.data() + 8, 12 * sizeof(float)), 0);

  // A whole tensor's range, and a piece read as a NamedTensor with its own range.
  Tensor weight_part = cpu_context().empty({5}, DType::kF32);
  ckpt.read_range("w", 19, weight_part);
  const auto w = to_vector_f32(saved.weight), wp = to_vector_f32(weight_part);
  EXPECT_EQ(std::memcmp(wp.data(), w.data() + 19, 5 * sizeof(float)), 0);
  Tensor again = cpu_context().empty({7}, DType::kF32);
  ckpt.read({{"optimizer.m.w", again, TensorPiece{{6, 4}, 10}}});
  EXPECT_EQ(tensor_bytes(again), tensor_bytes(saved.piece(1)));

  Tensor too_far = cpu_context().empty({5}, DType::kF32);
  EXPECT_CHECKPOINT_ERROR(ckpt.read_range("optimizer.m.w", 20, too_far), "optimizer.m.w",
                          "elements [20, 25)");
  // An offset whose end is past INT64_MAX is refused too, not wrapped round to a small end.
  const int64_t huge = std::numeric_limits<int64_t>::max() - 2;
  EXPECT_CHECKPOINT_ERROR(ckpt.read_range("optimizer.m.w", huge, too_far), "optimizer.m.w",
                          "elements [9223372036854775805, 9223372036854775810)");
  EXPECT_CHECKPOINT_ERROR(ckpt.read_range("w", huge, too_far), "'w'", "elements [");
}

TEST(PiecedCheckpoint, EveryPieceHasItsChecksumAndRangeInTheHeader) {
  TempDir dir;
  const fs::path folder = PiecedCheckpoint{}.save(dir.path());
  const auto [header, data] = split_safetensors(read_file(folder / "rank_1.safetensors"));
  const nlohmann::json h = nlohmann::json::parse(header);
  EXPECT_EQ(h["optimizer.m.w"]["shape"], nlohmann::json::array({7}));
  EXPECT_EQ(nlohmann::json::parse(h["__metadata__"]["piece:optimizer.m.w"].get<std::string>()),
            (nlohmann::json{{"shape", {6, 4}}, {"elements", {10, 17}}}));
  EXPECT_TRUE(h["__metadata__"].contains("xxh3_64:optimizer.m.w"));
  const nlohmann::json manifest = nlohmann::json::parse(read_file(folder / "manifest.json"));
  EXPECT_EQ(manifest["replicas"], 3);
}

// Rewrites the piece range of rank `rank`'s "optimizer.m.w" and keeps the manifest in step.
void set_piece(const fs::path& folder, int rank, const std::string& piece) {
  edit_shard_header(folder / ("rank_" + std::to_string(rank) + ".safetensors"),
                    [&](auto& h) { h["__metadata__"]["piece:optimizer.m.w"] = piece; });
  match_manifest_to_shards(folder);
}

TEST(PiecedCheckpoint, OverlapsGapsAndRangesBeyondTheTensorAreRefused) {
  TempDir dir;
  const fs::path folder = PiecedCheckpoint{}.save(dir.path());
  const std::string rank1 = (folder / "rank_1.safetensors").string();
  const std::string rank2 = (folder / "rank_2.safetensors").string();
  auto fresh = [&] {
    fs::remove_all(folder);
    PiecedCheckpoint{}.save(dir.path());
  };
  // Rank 1's 7 elements moved to [9, 16): they overlap rank 0's [0, 10) and leave [16, 17).
  set_piece(folder, 1, R"({"shape":[6,4],"elements":[9,16]})");
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder), "pieces of tensor 'optimizer.m.w' overlap",
                          "rank_0.safetensors' (elements [0, 10))", rank1);
  fresh();
  set_piece(folder, 1, R"({"shape":[6,4],"elements":[11,18]})");
  set_piece(folder, 2, R"({"shape":[6,4],"elements":[18,25]})");
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder), rank2, "optimizer.m.w", "[18,25]", "end <= 24");
  fresh();
  set_piece(folder, 1, R"({"shape":[6,4],"elements":[11,18]})");
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder), "optimizer.m.w", "leave elements [10, 11)",
                          rank1);
  fresh();
  set_piece(folder, 2, R"({"shape":[6,4],"elements":[16,23]})");
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder), "optimizer.m.w", "overlap", rank2);
  fresh();
  // A piece too short for its stored tensor, a piece of another shape, a malformed entry.
  set_piece(folder, 2, R"({"shape":[6,4],"elements":[17,23]})");
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder), rank2, "optimizer.m.w", "stored with shape [7]");
  fresh();
  set_piece(folder, 2, R"({"shape":[4,6],"elements":[17,24]})");
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder), rank2, "optimizer.m.w", "[4, 6]", "[6, 4]");
  fresh();
  set_piece(folder, 2, R"({"shape":[6,4],"elements":[17]})");
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder), rank2, "piece metadata of tensor");
  fresh();
  // The last piece missing: its shard then holds nothing of the tensor.
  edit_shard_header(folder / "rank_2.safetensors",
                    [](auto& h) { h["__metadata__"].erase("piece:optimizer.m.w"); });
  match_manifest_to_shards(folder);
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder), "optimizer.m.w", rank2, "in part");
}

TEST(PiecedCheckpoint, ReplicasMustDivideTheShards) {
  TempDir dir;
  const fs::path folder = PiecedCheckpoint{}.save(dir.path());
  edit_manifest(folder, [](auto& m) { m["replicas"] = 2; });
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder), "manifest.replicas is 2", "3 shards");
  edit_manifest(folder, [](auto& m) { m["replicas"] = "3"; });
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder), "manifest.replicas");
  // The writer leaves one replica out; the format says so one way only.
  edit_manifest(folder, [](auto& m) { m["replicas"] = 1; });
  EXPECT_CHECKPOINT_ERROR(open_checkpoint(folder), "manifest.replicas is 1",
                          "expected a number of replicas from 2 to 1024",
                          "a checkpoint of one replica has no replicas field");
}

TEST(PiecedCheckpoint, AWriterRefusesAPieceOutsideItsTensor) {
  TempDir dir;
  CheckpointWriter writer(dir.path(), 1, 1);
  EXPECT_THROW(
      writer.write_shard(0, {{"m", random_tensor(DType::kF32, {8}, 3), TensorPiece{{6, 4}, 20}}}),
      std::invalid_argument);
}

// ------------------------------------------------------------------------ training runs

TrainConfig layout(int stages, int replicas, bool sharded) {
  return testing::small_train_config(stages, replicas, sharded);
}

// Calls visit(rank, parameter, state_names, states, offset) for every parameter of every
// rank: the names of its optimizer state, the rank's state tensors (whole, or its piece) and
// where they start in the flattened global tensor.
template <class Visit>
void for_each_parameter_state(PipelineExecutor& ex, Visit visit) {
  for (int r = 0; r < ex.num_world_ranks(); ++r) {
    Optimizer& opt = ex.optimizer(r);
    const auto& params = opt.parameters();
    const size_t per = opt.state().size() / params.size();
    for (size_t i = 0; i < params.size(); ++i) {
      const auto names = optimizer_state_names(opt.config().kind, params[i]->name);
      const std::vector<Tensor> states(opt.state().begin() + i * per,
                                       opt.state().begin() + (i + 1) * per);
      visit(r, *params[i], names, states, opt.sharded() ? opt.shards()[i].offset : 0);
    }
  }
}

// Every parameter's value and optimizer state over the whole tensor, by global name: the
// values from replica 0, the state put together from every rank's range.
std::map<std::string, std::vector<float>> global_state(Trainer& trainer) {
  std::map<std::string, std::vector<float>> out;
  PipelineExecutor& ex = trainer.executor();
  for_each_parameter_state(ex, [&](int r, Parameter& p, const std::vector<std::string>& names,
                                   const std::vector<Tensor>& states, int64_t offset) {
    if (r < ex.num_ranks()) out[p.name] = to_vector_f32(p.value);
    for (size_t k = 0; k < states.size(); ++k) {
      auto& full = out[names[k]];
      full.resize(static_cast<size_t>(p.value.numel()));
      const auto part = to_vector_f32(states[k]);
      std::copy(part.begin(), part.end(), full.begin() + offset);
    }
  });
  return out;
}

// Puts `state` (global_state of another run after `steps` steps) into every rank of
// `trainer` directly, without a checkpoint: the reference a resume is compared with.
void set_global_state(Trainer& trainer, const std::map<std::string, std::vector<float>>& state,
                      int64_t steps, uint64_t data_position) {
  PipelineExecutor& ex = trainer.executor();
  for_each_parameter_state(ex, [&](int, Parameter& p, const std::vector<std::string>& names,
                                   const std::vector<Tensor>& states, int64_t offset) {
    const auto& value = state.at(p.name);
    copy_from_host(p.value, value.data(), value.size() * sizeof(float));
    for (size_t k = 0; k < states.size(); ++k)
      copy_from_host(states[k], state.at(names[k]).data() + offset, states[k].nbytes());
  });
  for (int r = 0; r < ex.num_world_ranks(); ++r) ex.optimizer(r).set_steps_taken(steps);
  trainer.source().seek(data_position);
  trainer.resume_at(steps);
}

std::vector<double> run_steps(Trainer& trainer, int n) {
  std::vector<double> losses;
  for (int s = 0; s < n; ++s) losses.push_back(trainer.step().loss);
  return losses;
}

void expect_bitwise(const std::map<std::string, std::vector<float>>& got,
                    const std::map<std::string, std::vector<float>>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, values] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    ASSERT_EQ(got.at(name).size(), values.size()) << name;
    EXPECT_EQ(std::memcmp(got.at(name).data(), values.data(), values.size() * sizeof(float)), 0)
        << name;
  }
}

// A (2 stages, 2 replicas) sharded run saved after two steps.
struct SavedShardedRun {
  TempDir dir;
  std::map<std::string, std::vector<float>> state;  // at the save
  uint64_t data_position = 0;

  explicit SavedShardedRun(bool async) {
    Trainer trainer(layout(2, 2, true));
    TrainerCheckpointOptions options;
    options.directory = dir.path();
    options.async = async;
    TrainerCheckpointer checkpointer(trainer, options);
    run_steps(trainer, 2);
    checkpointer.finish();
    state = global_state(trainer);
    data_position = trainer.source().position();
  }
};

TEST(ShardedCheckpoint, EachReplicaSavesItsOwnPiecesAndReplicaZeroTheWeights) {
  const SavedShardedRun saved(/*async=*/false);
  const Checkpoint ckpt = open_checkpoint(saved.dir.path());
  EXPECT_EQ(ckpt.manifest().shards.size(), 4u);
  EXPECT_EQ(ckpt.state().replicas, 2);
  // Each replica owns a contiguous piece of every parameter (replica_piece), so a parameter
  // of two or more elements is split between both: replica 1's rank (pipeline rank + 2)
  // holds its second part.
  int split = 0;
  std::vector<bool> rank_holds_state(4, false);
  for (const CheckpointTensor& t : ckpt.tensors()) {
    if (t.name.starts_with("optimizer.")) {
      ASSERT_TRUE(t.pieced) << t.name;
      ASSERT_GE(t.pieces.size(), 1u) << t.name;
      ASSERT_LE(t.pieces.size(), 2u) << t.name;
      for (const CheckpointPiece& p : t.pieces) rank_holds_state[p.rank] = true;
      if (t.pieces.size() == 2) {
        ++split;
        EXPECT_EQ(t.pieces[1].rank, t.pieces[0].rank + 2) << t.name;
      }
    } else {
      EXPECT_FALSE(t.pieced) << t.name;
      EXPECT_LT(t.rank, 2) << t.name;
    }
    std::vector<float> values(static_cast<size_t>(shape_numel(t.shape)));
    const auto bytes = ckpt.read_bytes(t.name);
    ASSERT_EQ(bytes.size(), values.size() * sizeof(float)) << t.name;
    std::memcpy(values.data(), bytes.data(), bytes.size());
    EXPECT_EQ(values, saved.state.at(t.name)) << "saved exactly: " << t.name;
  }
  EXPECT_GT(split, 0);
  EXPECT_EQ(rank_holds_state, std::vector<bool>(4, true));
}

// (2, 2) sharded -> (2, 2) sharded: the same layout, so the same arithmetic: bitwise.
TEST(ShardedCheckpoint, ResumedRunContinuesBitwise) {
  Trainer straight(layout(2, 2, true));
  const auto want = run_steps(straight, 4);
  const auto want_state = global_state(straight);
  for (bool async : {false, true}) {
    const SavedShardedRun saved(async);
    Trainer trainer(layout(2, 2, true));
    resume_trainer(trainer, saved.dir.path());
    expect_bitwise(global_state(trainer), saved.state);
    const auto tail = run_steps(trainer, 2);
    EXPECT_EQ(tail, std::vector<double>(want.begin() + 2, want.end())) << "async " << async;
    expect_bitwise(global_state(trainer), want_state);
  }
}

// (2, 2) sharded -> (P', D'): the loaded state is the saved one exactly, and the next steps'
// losses are bitwise those of the target layout given that state directly (the same layout,
// so the same reduction order). Against the (2, 2) run itself: with D' = 2 the replicas sum
// the same two gradient halves, and a stage count never changes the arithmetic on the CPU,
// so (1, 2) and (2, 2) unsharded are bitwise too; with D' = 1 the micro-batches' gradients
// are summed in another order (((g0 + g1) + g2) + g3 instead of (g0 + g1) + (g2 + g3)), so
// (1, 1) and (4, 1) agree with it to rounding only, and bitwise with each other.
TEST(ShardedCheckpoint, ResumesAtAnotherLayoutShardedOrNot) {
  const SavedShardedRun saved(/*async=*/false);
  Trainer straight(layout(2, 2, true));
  const auto straight_losses = run_steps(straight, 4);
  const std::vector<double> straight_tail(straight_losses.begin() + 2, straight_losses.end());

  struct Case {
    int stages, replicas;
    bool sharded, same_reduction_as_saved;
  };
  std::vector<double> one_replica_tail;
  for (const Case& c : {Case{1, 1, false, false}, Case{4, 1, false, false}, Case{1, 2, true, true},
                        Case{2, 2, false, true}}) {
    SCOPED_TRACE("(" + std::to_string(c.stages) + ", " + std::to_string(c.replicas) + ")" +
                 (c.sharded ? " sharded" : ""));
    Trainer resumed(layout(c.stages, c.replicas, c.sharded));
    resume_trainer(resumed, saved.dir.path());
    expect_bitwise(global_state(resumed), saved.state);
    const auto tail = run_steps(resumed, 2);

    Trainer reference(layout(c.stages, c.replicas, c.sharded));
    set_global_state(reference, saved.state, 2, saved.data_position);
    EXPECT_EQ(tail, run_steps(reference, 2));
    expect_bitwise(global_state(resumed), global_state(reference));

    if (c.same_reduction_as_saved) {
      EXPECT_EQ(tail, straight_tail);
    } else {
      for (size_t i = 0; i < tail.size(); ++i)
        EXPECT_NEAR(tail[i], straight_tail[i], 1e-5 * std::abs(straight_tail[i]));
      if (one_replica_tail.empty()) one_replica_tail = tail;
      EXPECT_EQ(tail, one_replica_tail);
    }
  }
}

// An unsharded (2, 2) checkpoint, whole tensors only, resumes into a sharded run that reads
// only its ranges: bitwise the sharded run straight through.
TEST(ShardedCheckpoint, UnshardedCheckpointResumesSharded) {
  TempDir dir;
  {
    Trainer trainer(layout(2, 2, false));
    TrainerCheckpointOptions options;
    options.directory = dir.path();
    TrainerCheckpointer checkpointer(trainer, options);
    run_steps(trainer, 2);
    checkpointer.finish();
  }
  Trainer straight(layout(2, 2, true));
  const auto want = run_steps(straight, 4);
  Trainer resumed(layout(1, 2, true));
  resume_trainer(resumed, dir.path());
  EXPECT_EQ(run_steps(resumed, 2), std::vector<double>(want.begin() + 2, want.end()));
  expect_bitwise(global_state(resumed), global_state(straight));
}

}  // namespace
}  // namespace conveyor
