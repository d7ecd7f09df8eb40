// Tensors on the CPU: shapes, views and their bounds, dtype and shape checks, copies, bf16.
#include "engine/core/tensor.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "support/test_util.h"

namespace conveyor {
namespace {

using conveyor::testing::random_floats;

Tensor cpu_tensor(const Shape& shape, DType dtype = DType::kF32) {
  static auto alloc = make_cpu_allocator();
  return Tensor::empty(shape, dtype, alloc);
}

Tensor from_floats(const Shape& shape, const std::vector<float>& values) {
  Tensor t = cpu_tensor(shape);
  copy_from_host(t, values.data(), values.size() * sizeof(float));
  return t;
}

// Runs `f`, expects exception E, and returns its message.
template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return {};
}

TEST(Shape, ToStringAndNumel) {
  EXPECT_EQ(shape_to_string({4, 8}), "[4, 8]");
  EXPECT_EQ(shape_to_string({}), "[]");
  EXPECT_EQ(shape_numel({4, 8, 3}), 96);
  EXPECT_EQ(shape_numel({}), 1);
  EXPECT_EQ(shape_numel({5, 0}), 0);
  EXPECT_THROW(shape_numel({4, -1}), std::invalid_argument);
  EXPECT_THROW(shape_numel({int64_t{1} << 40, int64_t{1} << 40}), std::invalid_argument);
}

// 2^62 floats are 2^64 bytes, which a size_t counts as 0: such a tensor had no storage and
// its first write ran past it. Every element count whose bytes fit an int64_t is allowed.
TEST(Shape, AnElementCountWhoseBytesCannotBeCountedIsRefused) {
  const int64_t most = std::numeric_limits<int64_t>::max() / 4;
  EXPECT_EQ(shape_numel({most}), most);
  EXPECT_EQ(shape_numel({int64_t{1} << 30, int64_t{1} << 30}), int64_t{1} << 60);
  for (const Shape& shape : {Shape{most + 1}, Shape{int64_t{1} << 31, int64_t{1} << 31}}) {
    try {
      shape_numel(shape);
      ADD_FAILURE() << shape_to_string(shape) << " was taken";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()), "shape " + shape_to_string(shape) +
                                           " has too many elements for a tensor (at most " +
                                           std::to_string(most) + ")");
    }
  }
  EXPECT_THROW(cpu_tensor({int64_t{1} << 31, int64_t{1} << 31}, DType::kF32),
               std::invalid_argument);
}

TEST(DTypes, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kI32), 4u);
  EXPECT_STREQ(dtype_name(DType::kBF16), "bf16");
}

TEST(Tensor, EmptyHasShapeBytesAndDescription) {
  Tensor t = cpu_tensor({4, 8}, DType::kBF16);
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.rank(), 2);
  EXPECT_EQ(t.numel(), 32);
  EXPECT_EQ(t.nbytes(), 64u);
  EXPECT_EQ(t.dim(0), 4);
  EXPECT_EQ(t.dim(-1), 8);
  EXPECT_EQ(t.device(), Device::cpu());
  EXPECT_EQ(t.describe(), "bf16[4, 8] on cpu");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % 64, 0u);
  EXPECT_THROW(t.dim(2), std::out_of_range);
  EXPECT_THROW(t.dim(-3), std::out_of_range);
  EXPECT_FALSE(Tensor().defined());
  EXPECT_EQ(Tensor().describe(), "undefined tensor");
  EXPECT_THROW(Tensor().raw(), std::invalid_argument);
}

// "of rank 2" read as a pipeline's rank 2.
TEST(Tensor, ADimensionOutOfRangeSaysHowManyTheTensorHas) {
  const Tensor square = cpu_tensor({4, 4}, DType::kF32);
  EXPECT_EQ(message_of<std::out_of_range>([&] { square.dim(5); }),
            "Tensor::dim(5) is out of range for f32[4, 4] on cpu with 2 dimensions (give 0 to 1, "
            "or -2 to -1 from the last)");
  const Tensor row = cpu_tensor({3}, DType::kF32);
  EXPECT_EQ(message_of<std::out_of_range>([&] { row.dim(-2); }),
            "Tensor::dim(-2) is out of range for f32[3] on cpu with 1 dimension (give 0 or -1)");
}

TEST(Tensor, TypedAccessChecksTheDType) {
  Tensor t = cpu_tensor({3}, DType::kBF16);
  EXPECT_NO_THROW(t.data<uint16_t>());
  const std::string msg = message_of<std::invalid_argument>([&] { t.data<float>(); });
  EXPECT_NE(msg.find("f32"), std::string::npos) << msg;
  EXPECT_NE(msg.find("bf16[3] on cpu"), std::string::npos) << msg;
  EXPECT_THROW(t.data<int32_t>(), std::invalid_argument);
}

TEST(Tensor, ViewsShareStorageAndCheckBounds) {
  const auto values = random_floats(24, 1);
  Tensor t = from_floats({4, 6}, values);
  Tensor v = t.view(5, {2, 3});
  EXPECT_EQ(v.storage(), t.storage());
  EXPECT_EQ(v.offset(), 5);
  EXPECT_EQ(v.data<float>()[0], values[5]);
  v.data<float>()[1] = 42.0f;
  EXPECT_EQ(t.data<float>()[6], 42.0f);
  // A view of a view: offsets add up.
  Tensor w = v.view(2, {3});
  EXPECT_EQ(w.offset(), 7);
  EXPECT_EQ(w.data<float>()[0], values[7]);

  EXPECT_NO_THROW(t.view(18, {6}));  // ends exactly at the end
  const std::string msg = message_of<std::out_of_range>([&] { t.view(19, {6}); });
  EXPECT_NE(msg.find("does not fit"), std::string::npos) << msg;
  EXPECT_THROW(t.view(-1, {2}), std::out_of_range);
  EXPECT_THROW(v.view(1, {6}), std::out_of_range);  // fits the storage, not the view
  EXPECT_THROW(Tensor().view(0, {1}), std::invalid_argument);
}

TEST(Tensor, SliceRowsSelectsRowsAndChecksBounds) {
  const auto values = random_floats(3 * 4 * 2, 2);
  Tensor t = from_floats({3, 4, 2}, values);
  Tensor s = t.slice_rows(1, 2);
  EXPECT_EQ(s.shape(), (Shape{2, 4, 2}));
  EXPECT_EQ(s.offset(), 8);
  const auto got = to_vector_f32(s);
  EXPECT_EQ(got, std::vector<float>(values.begin() + 8, values.end()));
  EXPECT_EQ(t.slice_rows(3, 0).numel(), 0);
  const std::string msg = message_of<std::out_of_range>([&] { t.slice_rows(2, 2); });
  EXPECT_NE(msg.find("rows [2, 4)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("3 rows"), std::string::npos) << msg;
  EXPECT_THROW(t.slice_rows(-1, 1), std::out_of_range);
  EXPECT_THROW(t.slice_rows(0, -1), std::out_of_range);
  // The end of a range past int64_t is said as it is, not wrapped.
  const int64_t most = std::numeric_limits<int64_t>::max();
  EXPECT_NE(message_of<std::out_of_range>([&] {
              t.slice_rows(3, most);
            }).find("rows [3, 9223372036854775810)"),
            std::string::npos);
  EXPECT_NE(message_of<std::out_of_range>([&] {
              t.slice_rows(std::numeric_limits<int64_t>::min(), -2);
            }).find("rows [-9223372036854775808, -9223372036854775810)"),
            std::string::npos);
  EXPECT_THROW(cpu_tensor({}).slice_rows(0, 1), std::invalid_argument);
}

TEST(Tensor, ReshapeKeepsElementsAndInfersOneDimension) {
  const auto values = random_floats(24, 3);
  Tensor t = from_floats({4, 6}, values);
  Tensor r = t.reshape({2, 3, 4});
  EXPECT_EQ(r.shape(), (Shape{2, 3, 4}));
  EXPECT_EQ(to_vector_f32(r), values);
  EXPECT_EQ(t.reshape({-1, 8}).shape(), (Shape{3, 8}));
  EXPECT_EQ(t.slice_rows(1, 2).reshape({-1}).shape(), (Shape{12}));
  const std::string msg = message_of<std::invalid_argument>([&] { t.reshape({5, 5}); });
  EXPECT_NE(msg.find("24 vs 25"), std::string::npos) << msg;
  EXPECT_THROW(t.reshape({-1, 5}), std::invalid_argument);
  EXPECT_THROW(t.reshape({-1, -1}), std::invalid_argument);
  EXPECT_THROW(t.reshape({-2, -12}), std::invalid_argument);
}

TEST(Checks, MessagesNameWhatExpectedAndSeen) {
  Tensor t = cpu_tensor({8, 15});
  EXPECT_EQ(message_of<std::invalid_argument>([&] {
              check_shape(t, {8, 16}, "linear input");
            }),
            "linear input: expected shape [8, 16], got [8, 15]");
  EXPECT_NO_THROW(check_shape(t, {8, 15}, "linear input"));
  EXPECT_EQ(message_of<std::invalid_argument>([&] { check_dtype(t, DType::kBF16, "weight"); }),
            "weight: expected dtype bf16, got f32 (f32[8, 15] on cpu)");
  EXPECT_NO_THROW(check_dtype(t, DType::kF32, "weight"));
  EXPECT_EQ(message_of<std::invalid_argument>([&] { check_device(t, Device::cuda(1), "grad"); }),
            "grad: expected a tensor on cuda:1, got one on cpu (f32[8, 15] on cpu)");
  EXPECT_NO_THROW(check_device(t, Device::cpu(), "grad"));
  EXPECT_EQ(message_of<std::invalid_argument>([&] { check_defined(Tensor(), "bias"); }),
            "bias: expected a defined tensor, got an undefined one");
  EXPECT_THROW(check_shape(Tensor(), {1}, "bias"), std::invalid_argument);
}

TEST(Copies, CpuRoundTripsAndMismatchErrors) {
  const auto values = random_floats(12, 4);
  Tensor a = from_floats({3, 4}, values);
  Tensor b = cpu_tensor({4, 3});  // same numel, another shape: allowed
  copy_tensor(b, a);
  EXPECT_EQ(to_vector_f32(b), values);

  // Overlapping views of one storage.
  Tensor wide = from_floats({12}, values);
  copy_tensor(wide.view(2, {8}), wide.view(0, {8}));
  const auto shifted = to_vector_f32(wide);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(shifted[2 + i], values[i]);

  EXPECT_THROW(copy_tensor(cpu_tensor({3, 4}, DType::kI32), a), std::invalid_argument);
  EXPECT_THROW(copy_tensor(cpu_tensor({13}), a), std::invalid_argument);
  EXPECT_THROW(copy_tensor(Tensor(), a), std::invalid_argument);
  EXPECT_THROW(copy_from_host(a, values.data(), 4), std::invalid_argument);
  float out[3];
  EXPECT_THROW(copy_to_host(out, a, sizeof(out)), std::invalid_argument);
  EXPECT_THROW(to_vector_i32(a), std::invalid_argument);
  // A null host pointer is refused, not written through.
  EXPECT_EQ(message_of<std::invalid_argument>([&] { copy_from_host(a, nullptr, a.nbytes()); }),
            "copy_from_host: the host source pointer is null for 48 bytes into f32[3, 4] on cpu; "
            "give host memory holding them");
  EXPECT_EQ(message_of<std::invalid_argument>([&] { copy_to_host(nullptr, a, a.nbytes()); }),
            "copy_to_host: the host destination pointer is null for 48 bytes of f32[3, 4] on cpu; "
            "give host memory with room for them");

  const auto ints = conveyor::testing::random_ints(6, 5, -1000, 1000);
  Tensor i = cpu_tensor({6}, DType::kI32);
  copy_from_host(i, ints.data(), ints.size() * sizeof(int32_t));
  EXPECT_EQ(to_vector_i32(i), ints);
}

TEST(Storage, ReturnsMemoryWhenTheLastViewIsGone) {
  auto alloc = make_cpu_allocator();
  Tensor view;
  {
    Tensor t = Tensor::empty({1000}, DType::kF32, alloc);  // 4000 B -> 4096
    EXPECT_EQ(alloc->stats().allocated_bytes, 4096u);
    view = t.slice_rows(10, 5);
  }
  EXPECT_EQ(alloc->stats().allocated_bytes, 4096u);  // the view keeps the storage
  view = Tensor();
  EXPECT_EQ(alloc->stats().allocated_bytes, 0u);
  EXPECT_EQ(alloc->stats().reserved_bytes, 4096u);  // cached for reuse
  EXPECT_THROW(Storage(nullptr, 16, nullptr), std::invalid_argument);
}

TEST(Storage, RecordStreamOnAViewMarksTheWholeBlock) {
  auto alloc = make_cpu_allocator();
  Tensor t = Tensor::empty({64}, DType::kF32, alloc);
  EXPECT_NO_THROW(record_stream(t.slice_rows(8, 8), nullptr));  // CPU: its own stream
  EXPECT_THROW(record_stream(Tensor(), nullptr), std::invalid_argument);
}

uint32_t bits_of(float f) { return std::bit_cast<uint32_t>(f); }
float float_of(uint32_t bits) { return std::bit_cast<float>(bits); }

TEST(BFloat16, ExactValuesAndTiesToEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(float_to_bf16(-2.0f), 0xC000);
  EXPECT_EQ(float_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
  // 1 + 2^-8 lies halfway between 1 (even mantissa) and 1 + 2^-7: goes to 1.
  EXPECT_EQ(float_to_bf16(float_of(0x3F808000)), 0x3F80);
  // 1 + 3 * 2^-8 lies halfway between 0x3F81 (odd) and 0x3F82 (even): goes up.
  EXPECT_EQ(float_to_bf16(float_of(0x3F818000)), 0x3F82);
  // Just above and below a tie.
  EXPECT_EQ(float_to_bf16(float_of(0x3F808001)), 0x3F81);
  EXPECT_EQ(float_to_bf16(float_of(0x3F817FFF)), 0x3F81);
  // 3.14159274 = 0x40490FDB -> 0x4049 (0x0FDB < 0x8000).
  EXPECT_EQ(float_to_bf16(3.14159274f), 0x4049);
  // The largest float rounds up into infinity; infinities stay.
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(float_to_bf16(-std::numeric_limits<float>::infinity()), 0xFF80);
  // The largest float below the rounding boundary stays finite: 0x7F7F7FFF -> 0x7F7F.
  EXPECT_EQ(float_to_bf16(float_of(0x7F7F7FFF)), 0x7F7F);
  // Subnormals round like any other value.
  EXPECT_EQ(float_to_bf16(float_of(0x00008000)), 0x0000);
  EXPECT_EQ(float_to_bf16(float_of(0x00018000)), 0x0002);
  EXPECT_EQ(bf16_to_float(0x3F80), 1.0f);
  EXPECT_EQ(bf16_to_float(0xC049), -3.140625f);
}

TEST(BFloat16, NaNStaysNaNWithItsSign) {
  // A NaN whose payload lies only in the dropped bits must not become infinity.
  const uint16_t low_payload = float_to_bf16(float_of(0x7F800001));
  EXPECT_TRUE(std::isnan(bf16_to_float(low_payload)));
  const uint16_t negative = float_to_bf16(float_of(0xFFFFFFFF));
  EXPECT_TRUE(std::isnan(bf16_to_float(negative)));
  EXPECT_TRUE(std::signbit(bf16_to_float(negative)));
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
}

TEST(BFloat16, EveryFiniteBf16RoundTripsExactly) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = bf16_to_float(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_bf16(f), b) << "bf16 bits " << b;
  }
}

TEST(BFloat16, RandomFloatsRoundToTheNearestWithTiesToEven) {
  // Reference in double: of the two bf16 neighbours, the nearer; on a tie, the even one.
  const auto values = random_floats(100000, 6, -1e4f, 1e4f);
  for (float x : values) {
    const uint32_t down = bits_of(x) >> 16;  // truncation: toward zero
    const uint32_t up = down + 1;            // away from zero
    const double d_down =
        std::abs(static_cast<double>(x) - bf16_to_float(static_cast<uint16_t>(down)));
    const double d_up = std::abs(static_cast<double>(x) - bf16_to_float(static_cast<uint16_t>(up)));
    const uint32_t expected = d_down < d_up   ? down
                              : d_up < d_down ? up
                                              : (down % 2 == 0 ? down : up);
    ASSERT_EQ(float_to_bf16(x), expected) << "x = " << x;
  }
}

}  // namespace
}  // namespace conveyor
