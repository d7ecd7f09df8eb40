// The shard format: what is written is the safetensors layout with checksums, it reads back
// bit for bit, and every kind of bad file ends in one CheckpointError naming the file and
// the problem.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cctype>
#include <csignal>
#include <cstring>

#include "engine/train/checkpoint_shard.h"
#include "engine/train/safetensors.h"
#include "tests/engine/train/checkpoint_fixture.h"

namespace conveyor {
namespace {

using namespace conveyor::testing;

// One F32 tensor "a" of shape [2, 3] and data of 24 bytes, written by hand.
constexpr const char* kMeta =
    R"("__metadata__":{"format":"conveyor","format_version":"1","step":"3","rank":"0"})";

std::string data_of(size_t bytes) {
  std::string data(bytes, '\0');
  for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<char>(i * 37 + 11);
  return data;
}

// A shard whose header is {kMeta, tensors} and whose checksums are right for `data`: the
// rules of the layout are then the only thing a test breaks.
std::string shard_with(
    const std::string& tensors, const std::string& data,
    const std::vector<std::pair<std::string, std::pair<size_t, size_t>>>& checksums = {}) {
  std::string meta = kMeta;
  meta.pop_back();
  for (const auto& [name, range] : checksums)
    meta += ",\"xxh3_64:" + name + "\":\"" +
            checkpoint_io::hex64(
                checkpoint_io::xxh3_64(data.data() + range.first, range.second - range.first)) +
            "\"";
  meta += "}";
  return raw_safetensors("{" + meta + (tensors.empty() ? "" : "," + tensors) + "}", data);
}

class ShardFormat : public ::testing::Test {
 protected:
  fs::path write(const std::string& bytes) {
    const fs::path path = dir_ / "rank_0.safetensors";
    write_file(path, bytes);
    return path;
  }
  fs::path written_demo() {
    const fs::path path = dir_ / "rank_0.safetensors";
    write_shard_file(path, 3, 0, demo_tensors(0));
    return path;
  }
  TempDir dir_;
};

TEST_F(ShardFormat, RoundTripsEveryDtypeBitForBit) {
  const auto tensors = demo_tensors(1, 7);
  const fs::path path = dir_ / "rank_1.safetensors";
  const ShardFileInfo info = write_shard_file(path, 42, 1, tensors);
  const std::string file = read_file(path);
  EXPECT_EQ(info.bytes, file.size());
  EXPECT_EQ(info.checksum, checkpoint_io::xxh3_64(file.data(), file.size()));

  const ShardReader reader(path);
  EXPECT_EQ(reader.step(), 42);
  EXPECT_EQ(reader.rank(), 1);
  EXPECT_EQ(reader.file_checksum(), info.checksum);
  ASSERT_EQ(reader.tensors().size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const ShardTensor& t = reader.tensors()[i];  // data order is the order given
    EXPECT_EQ(t.name, tensors[i].name);
    EXPECT_EQ(t.dtype, tensors[i].tensor.dtype());
    EXPECT_EQ(t.shape, tensors[i].tensor.shape());
    std::vector<unsigned char> bytes(t.bytes());
    reader.read(t, bytes.data());
    EXPECT_EQ(bytes, tensor_bytes(tensors[i].tensor)) << t.name;
    EXPECT_EQ(t.checksum, checkpoint_io::xxh3_64(bytes.data(), bytes.size())) << t.name;
  }
}

TEST_F(ShardFormat, LayoutIsSafetensors) {
  const std::string file = read_file(written_demo());
  const auto [header, data] = split_safetensors(file);
  EXPECT_EQ((8 + header.size()) % 8, 0u) << "the data section starts 8-byte aligned";
  const auto json = nlohmann::json::parse(header);
  EXPECT_EQ(json["__metadata__"]["format_version"], "1");
  EXPECT_EQ(json["__metadata__"]["step"], "3");
  const auto& w = json["blocks.0.fc1.weight"];
  EXPECT_EQ(w["dtype"], "F32");
  EXPECT_EQ(w["shape"], nlohmann::json({6, 4}));
  EXPECT_EQ(w["data_offsets"], nlohmann::json({0, 96}));
  EXPECT_EQ(json["blocks.0.gain.bf16"]["dtype"], "BF16");
  EXPECT_EQ(json["blocks.0.counts"]["dtype"], "I32");
  EXPECT_EQ(json["blocks.0.scale"]["shape"], nlohmann::json::array());
  const uint64_t sum = checkpoint_io::xxh3_64(data.data(), 96);
  EXPECT_EQ(json["__metadata__"]["xxh3_64:blocks.0.fc1.weight"], checkpoint_io::hex64(sum));
}

TEST_F(ShardFormat, AcceptsAHandWrittenFileWithoutPadding) {
  const std::string data = data_of(24);
  const fs::path path = write(shard_with(
      R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]})", data, {{"a", {0, 24}}}));
  const ShardReader reader(path);
  ASSERT_EQ(reader.tensors().size(), 1u);
  EXPECT_EQ(reader.tensors()[0].shape, (Shape{2, 3}));
}

TEST_F(ShardFormat, TruncatedFile) {
  const fs::path path = written_demo();
  const std::string file = read_file(path);
  write_file(path, file.substr(0, file.size() - 1));
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "truncated", "blocks.0");
}

TEST_F(ShardFormat, TruncatedInsideTheHeader) {
  const fs::path path = written_demo();
  write_file(path, read_file(path).substr(0, 40));
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "runs past the end of the file");
}

TEST_F(ShardFormat, TooShortForTheHeaderLength) {
  const fs::path path = write("\x10\x00\x00");
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "fewer than the 8");
}

TEST_F(ShardFormat, AbsurdHeaderLength) {
  std::string file = read_file(written_demo());
  const uint64_t absurd = uint64_t{1} << 40;
  std::memcpy(file.data(), &absurd, 8);
  const fs::path path = write(file);
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "header length 1099511627776",
                          "exceeds the limit");
}

TEST_F(ShardFormat, MalformedHeaderJson) {
  const fs::path path = write(raw_safetensors(R"({"a":{"dtype":"F32","shape":[2,)", ""));
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "malformed JSON");
}

// JSON text never holds a NUL byte, and the parser would take one for the end of the input:
// the bytes after it, which the safetensors package refuses, would pass unread.
TEST_F(ShardFormat, NulByteInTheHeader) {
  const std::string data = data_of(24);
  const std::string good = shard_with(R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]})",
                                      data, {{"a", {0, 24}}});
  const auto [header, _] = split_safetensors(good);
  const fs::path path = write(raw_safetensors(header + std::string("\0junk", 5), data));
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(),
                          "a NUL byte at byte " + std::to_string(header.size()) + " of its JSON");
}

TEST_F(ShardFormat, HeaderThatIsNotAnObject) {
  const fs::path path = write(raw_safetensors("[1, 2, 3]", ""));
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "does not begin with '{'");
}

TEST_F(ShardFormat, AbsurdNesting) {
  const fs::path path =
      write(raw_safetensors("{\"a\":" + std::string(5000, '[') + std::string(5000, ']') + "}", ""));
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "nested deeper");
}

TEST_F(ShardFormat, UnknownFormatVersion) {
  const fs::path path = written_demo();
  edit_shard_header(path, [](auto& h) { h["__metadata__"]["format_version"] = "2"; });
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "unknown format version '2'",
                          "reads version 1");
}

TEST_F(ShardFormat, NotAConveyorShard) {
  const std::string data = data_of(24);
  const fs::path path =
      write(raw_safetensors(R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}})", data));
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "not a Conveyor checkpoint shard");
}

TEST_F(ShardFormat, OverlappingRanges) {
  const std::string data = data_of(24);
  const fs::path path = write(shard_with(R"("a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                                         R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]})",
                                         data, {{"a", {0, 16}}, {"b", {8, 24}}}));
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "'b'", "overlaps tensor 'a'");
}

TEST_F(ShardFormat, GapBetweenTensors) {
  const std::string data = data_of(24);
  const fs::path path =
      write(shard_with(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[16,24]})",
                       data, {{"a", {0, 8}}, {"b", {16, 24}}}));
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "bytes [8, 16)", "no gap");
}

TEST_F(ShardFormat, RangePastTheEnd) {
  const std::string data = data_of(24);
  const fs::path path =
      write(shard_with(R"("a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]})", data));
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "'a'", "runs past the end",
                          "truncated");
}

TEST_F(ShardFormat, BytesAfterTheLastTensor) {
  const std::string data = data_of(24);
  const fs::path path = write(shard_with(R"("a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]})",
                                         data, {{"a", {0, 16}}}));
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "last 8 bytes", "belong to no tensor");
}

TEST_F(ShardFormat, ByteLengthDiffersFromShapeTimesDtype) {
  const std::string data = data_of(20);
  const fs::path path =
      write(shard_with(R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]})", data));
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "F32[2, 3] (24 bytes)",
                          "hold 20 bytes");
}

TEST_F(ShardFormat, ShapeOverflow) {
  const fs::path path = write(shard_with(
      R"("a":{"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,0]})", ""));
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "'a'", "overflows 64 bits");
}

TEST_F(ShardFormat, ByteSizeOverflow) {
  // 2^62 elements fit in 64 bits, their 2^64 bytes do not.
  const fs::path path = write(
      shard_with(R"("a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]})", ""));
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "size in bytes overflows 64 bits");
}

TEST_F(ShardFormat, OffsetsBeyondSixtyFourBits) {
  const fs::path path = write(shard_with(
      R"("a":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551616,18446744073709551620]})",
      ""));
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "data_offsets",
                          "non-negative integers");
}

TEST_F(ShardFormat, OffsetsNearTheTopOfSixtyFourBits) {
  const fs::path path = write(shard_with(
      R"("a":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551612,18446744073709551615]})",
      ""));
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "hold 3 bytes");
}

TEST_F(ShardFormat, EndBeforeBegin) {
  const fs::path path =
      write(shard_with(R"("a":{"dtype":"F32","shape":[1],"data_offsets":[8,4]})", data_of(8)));
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "end before they begin");
}

TEST_F(ShardFormat, NegativeOrFractionalDimension) {
  for (const char* shape : {"[-2,3]", "[2.5]", "\"2\"", "[[2]]"}) {
    const fs::path path = write(shard_with(
        std::string(R"("a":{"dtype":"F32","shape":)") + shape + R"(,"data_offsets":[0,24]})",
        data_of(24)));
    EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "'a' has shape",
                            "non-negative integers");
  }
}

TEST_F(ShardFormat, DuplicateTensorName) {
  const std::string data = data_of(16);
  const fs::path path = write(shard_with(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                         R"("a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]})",
                                         data, {{"a", {8, 16}}}));
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "key 'a' appears twice");
}

TEST_F(ShardFormat, DuplicateMetadataEntry) {
  const std::string data = data_of(8);
  std::string header =
      std::string("{") + kMeta + R"(,"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  header.insert(header.find("\"rank\""), R"("step":"4",)");
  const fs::path path = write(raw_safetensors(header, data));
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "key 'step' appears twice");
}

TEST_F(ShardFormat, UnknownDtype) {
  for (const char* dtype : {"Q7", "F64", "f32"}) {
    const fs::path path = write(shard_with(
        std::string(R"("a":{"dtype":")") + dtype + R"(","shape":[2],"data_offsets":[0,8]})",
        data_of(8)));
    EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), std::string("\"") + dtype + "\"",
                            "only F32, BF16 and I32");
  }
}

TEST_F(ShardFormat, UnknownTensorField) {
  const fs::path path = write(shard_with(
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"stride":[1]})", data_of(8)));
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "unknown field 'stride'");
}

TEST_F(ShardFormat, ChecksumMismatchNamesTheTensor) {
  const fs::path path = written_demo();
  std::string file = read_file(path);
  const auto [header, data] = split_safetensors(file);
  const auto offsets = nlohmann::json::parse(header)["blocks.0.counts"]["data_offsets"];
  file[8 + header.size() + offsets[0].get<size_t>() + 5] ^= 0x10;
  write_file(path, file);
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(),
                          "checksum mismatch in tensor 'blocks.0.counts'");
}

TEST_F(ShardFormat, MissingChecksum) {
  const fs::path path = written_demo();
  edit_shard_header(path, [](auto& h) { h["__metadata__"].erase("xxh3_64:blocks.0.fc1.bias"); });
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "'blocks.0.fc1.bias' has no checksum");
  // The entry a name with a line break needs is shown escaped, on the error's one line.
  edit_shard_header(path, [](auto& h) {
    h["a\nb"] = h["blocks.0.fc1.bias"];
    h.erase("blocks.0.fc1.bias");
  });
  EXPECT_CHECKPOINT_ERROR(ShardReader{path},
                          "has no checksum in the metadata (no entry 'xxh3_64:a\\x0ab')");
}

TEST_F(ShardFormat, ChecksumOfATensorThatIsNotThere) {
  const fs::path path = written_demo();
  edit_shard_header(path, [](auto& h) { h["__metadata__"]["xxh3_64:ghost"] = "0123456789abcdef"; });
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "checksum for tensor 'ghost'");
}

TEST_F(ShardFormat, ChecksumThatIsNotHex) {
  const fs::path path = written_demo();
  edit_shard_header(path, [](auto& h) { h["__metadata__"]["xxh3_64:blocks.0.scale"] = "xyz"; });
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "'blocks.0.scale'", "16 hex digits");
}

TEST_F(ShardFormat, UnknownMetadataEntry) {
  const fs::path path = written_demo();
  edit_shard_header(path, [](auto& h) { h["__metadata__"]["compression"] = "zstd"; });
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "unknown metadata entry 'compression'");
}

TEST_F(ShardFormat, MetadataThatIsNotStrings) {
  const fs::path path = written_demo();
  edit_shard_header(path, [](auto& h) { h["__metadata__"]["step"] = 3; });
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "'step' is 3, expected a string");
}

TEST_F(ShardFormat, StepThatIsNotANumber) {
  const fs::path path = written_demo();
  edit_shard_header(path, [](auto& h) { h["__metadata__"]["step"] = "-3"; });
  EXPECT_CHECKPOINT_ERROR(ShardReader{path}, path.string(), "step '-3'",
                          "not a non-negative integer");
}

// The step, the rank and the checksums are read for their values, as docs/checkpoint-format.md
// says: a leading zero and upper-case hex digits are taken, the data still checked against them.
TEST_F(ShardFormat, StepRankAndChecksumsAreReadForTheirValues) {
  const fs::path path = written_demo();
  edit_shard_header(path, [](auto& h) {
    auto& m = h["__metadata__"];
    m["step"] = "03";
    m["rank"] = "00";
    for (auto& [key, value] : m.items()) {
      if (!key.starts_with("xxh3_64:")) continue;
      std::string sum = value;
      for (char& c : sum) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      value = sum;
    }
  });
  const ShardReader reader(path);
  EXPECT_EQ(reader.step(), 3);
  EXPECT_EQ(reader.rank(), 0);
}

TEST_F(ShardFormat, WriteToAFullDiskNamesTheFile) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full on this system";
  EXPECT_CHECKPOINT_ERROR(write_shard_file("/dev/full", 1, 0, demo_tensors(0)), "/dev/full",
                          "No space left on device");
}

// A write that fails part way through the file counts what is written and what is left of the
// whole file, not of the write() call that failed. The file-size limit stops the write at a
// byte of our choosing, as a disk that fills up would.
TEST_F(ShardFormat, FailedWriteCountsTheWholeFile) {
  const auto tensors = demo_tensors(0, 5);
  const uint64_t total = write_shard_file(dir_ / "whole.safetensors", 1, 0, tensors).bytes;
  // 50 bytes before the end: inside the data of the third tensor from the end, after the
  // header and several tensors were written whole.
  ASSERT_GT(total, 100u);
  const uint64_t limit = total - 50;
  struct rlimit old_limit {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  if (old_limit.rlim_cur != RLIM_INFINITY && old_limit.rlim_cur < limit)
    GTEST_SKIP() << "the file-size limit is below " << limit << " bytes already";
  struct rlimit new_limit = old_limit;
  new_limit.rlim_cur = limit;
  // Past the limit write() fails with EFBIG instead of the process receiving SIGXFSZ.
  void (*old_handler)(int) = std::signal(SIGXFSZ, SIG_IGN);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &new_limit), 0);
  std::string message;
  try {
    write_shard_file(dir_ / "cut.safetensors", 1, 0, tensors);
  } catch (const CheckpointError& e) {
    message = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  std::signal(SIGXFSZ, old_handler);
  const std::string counts = "(" + std::to_string(limit) + " of " + std::to_string(total) +
                             " bytes written, " + std::to_string(total - limit) + " more to go)";
  EXPECT_NE(message.find(counts), std::string::npos) << message;
  EXPECT_NE(message.find("cut.safetensors"), std::string::npos) << message;
}

TEST_F(ShardFormat, WriteRejectsBadNames) {
  auto tensors = demo_tensors(0);
  tensors[1].name = tensors[0].name;
  EXPECT_THROW(write_shard_file(dir_ / "x.safetensors", 1, 0, tensors), std::invalid_argument);
  tensors[1].name = "";
  EXPECT_THROW(write_shard_file(dir_ / "x.safetensors", 1, 0, tensors), std::invalid_argument);
  tensors[1].name = "__metadata__";
  EXPECT_THROW(write_shard_file(dir_ / "x.safetensors", 1, 0, tensors), std::invalid_argument);
  tensors[1].name = "\xff\xfe";
  EXPECT_THROW(write_shard_file(dir_ / "x.safetensors", 1, 0, tensors), std::invalid_argument);
}

TEST(SafetensorsDtype, NamesRoundTrip) {
  for (DType d : {DType::kF32, DType::kBF16, DType::kI32})
    EXPECT_EQ(parse_safetensors_dtype(safetensors_dtype_name(d)), d);
  EXPECT_FALSE(parse_safetensors_dtype("F16").has_value());
}

TEST(CheckpointJson, RejectsDuplicateKeysAtAnyDepth) {
  EXPECT_CHECKPOINT_ERROR(checkpoint_io::parse_json_strictly(R"({"a":{"b":1,"b":2}})", "f.json"),
                          "f.json", "key 'b' appears twice");
  EXPECT_CHECKPOINT_ERROR(
      checkpoint_io::parse_json_strictly(R"([{"x":1},{"y":1,"y":1}])", "f.json"),
      "key 'y' appears twice");
  // The same key in sibling objects is fine.
  EXPECT_EQ(checkpoint_io::parse_json_strictly(R"([{"x":1},{"x":2}])", "f.json")[1]["x"], 2);
}

TEST(CheckpointHex, RoundTripsAndRejectsOtherText) {
  for (uint64_t v : {uint64_t{0}, uint64_t{0x0123456789abcdef}, ~uint64_t{0}})
    EXPECT_EQ(checkpoint_io::parse_hex64(checkpoint_io::hex64(v)), v);
  EXPECT_EQ(checkpoint_io::hex64(0xabc), "0000000000000abc");
  for (const char* bad : {"", "abc", "0123456789abcdefg", "0123456789abcdeg", " 123456789abcdef"})
    EXPECT_FALSE(checkpoint_io::parse_hex64(bad).has_value()) << bad;
}

TEST(CheckpointHash, StreamEqualsOneShotXxh3) {
  const auto data = random_ints(1000, 5, -100, 100);
  const auto* bytes = reinterpret_cast<const unsigned char*>(data.data());
  checkpoint_io::Xxh3Stream stream;
  stream.update(bytes, 1);
  stream.update(bytes + 1, 2000);
  stream.update(bytes + 2001, 4000 - 2001);
  EXPECT_EQ(stream.digest(), checkpoint_io::xxh3_64(bytes, 4000));
  // XXH3-64 of the empty input, as published by xxHash.
  EXPECT_EQ(checkpoint_io::xxh3_64(nullptr, 0), 0x2d06800538d394c2ull);
}

}  // namespace
}  // namespace conveyor
