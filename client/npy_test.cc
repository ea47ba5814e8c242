// SPDX-License-Identifier: Apache-2.0
// Tests .npy encoding against NumPy's own byte layout, round trips through memory and files,
// and rejection of malformed files.
#include "client/npy.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lossd {
namespace client {
namespace {

using ::testing::HasSubstr;

std::string Message(const absl::Status& s) { return std::string(s.message()); }

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
}

HostTensor RandomTensor(DType dtype, std::vector<int64_t> shape, uint32_t seed) {
  HostTensor t = HostTensor::Owned(dtype, std::move(shape));
  std::mt19937 gen(seed);
  for (size_t i = 0; i < t.num_bytes(); ++i) t.mutable_data()[i] = static_cast<uint8_t>(gen());
  return t;
}

void ExpectSameTensor(const HostTensor& got, const HostTensor& want) {
  EXPECT_EQ(got.dtype(), want.dtype());
  EXPECT_EQ(got.shape(), want.shape());
  ASSERT_EQ(got.num_bytes(), want.num_bytes());
  // memcmp with a null pointer is undefined even for 0 bytes (empty tensors have no data).
  if (want.num_bytes() > 0) {
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.num_bytes()), 0);
  }
}

// What np.save writes for these arrays (NumPy 2.4), byte for byte.
std::string NumpyHeader(const std::string& dict) {
  std::string h("\x93NUMPY\x01\x00v\x00", 10);
  h += dict;
  h.append(128 - 1 - h.size(), ' ');
  return h + "\n";
}

TEST(NpyTest, HeaderMatchesNumpyByteForByte) {
  EXPECT_EQ(EncodeNpyHeader(DType::kF32, {2, 3}),
            NumpyHeader("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"));
  EXPECT_EQ(EncodeNpyHeader(DType::kI64, {}),
            NumpyHeader("{'descr': '<i8', 'fortran_order': False, 'shape': (), }"));
  EXPECT_EQ(EncodeNpyHeader(DType::kF16, {0, 3}),
            NumpyHeader("{'descr': '<f2', 'fortran_order': False, 'shape': (0, 3), }"));
  EXPECT_EQ(EncodeNpyHeader(DType::kBF16, {3}),
            NumpyHeader("{'descr': '<u2', 'fortran_order': False, 'shape': (3,), }"));
  EXPECT_EQ(EncodeNpyHeader(DType::kI32, {7}).substr(10, 16), "{'descr': '<i4',");
}

TEST(NpyTest, DecodesNumpysBytes) {
  // np.save of np.arange(6, dtype='<f4').reshape(2, 3).
  std::string file = NumpyHeader("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }");
  for (int i = 0; i < 6; ++i) {
    const float f = static_cast<float>(i);
    file.append(reinterpret_cast<const char*>(&f), 4);
  }
  absl::StatusOr<HostTensor> t = DecodeNpy(file);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->dtype(), DType::kF32);
  EXPECT_EQ(t->shape(), (std::vector<int64_t>{2, 3}));
  for (int i = 0; i < 6; ++i) EXPECT_EQ(t->data_as<float>()[i], static_cast<float>(i));
}

TEST(NpyTest, AcceptsEquivalentHeaderSpellings) {
  // Key order, double quotes, Python 2 longs, no trailing comma, version 2.0 preamble, and
  // ml_dtypes' bfloat16 ('|V2') all read the same.
  const std::string dict = "{\"shape\": (2L, 1), \"fortran_order\": False, \"descr\": '|V2'}";
  std::string file("\x93NUMPY\x02\x00", 8);
  const uint32_t len = static_cast<uint32_t>(dict.size() + 1);
  file.append(reinterpret_cast<const char*>(&len), 4);
  file += dict + "\n" + std::string("abcd");
  absl::StatusOr<HostTensor> t = DecodeNpy(file);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->dtype(), DType::kBF16);
  EXPECT_EQ(t->shape(), (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(t->data()), 4), "abcd");
}

class NpyRoundTripTest : public ::testing::TestWithParam<std::tuple<DType, std::vector<int64_t>>> {
};

TEST_P(NpyRoundTripTest, ThroughMemoryAndFile) {
  const auto& [dtype, shape] = GetParam();
  HostTensor t = RandomTensor(dtype, shape, 7);
  const std::string bytes = EncodeNpy(t);
  const std::string header = EncodeNpyHeader(dtype, shape);
  EXPECT_EQ(header.size() % 64, 0u);
  EXPECT_EQ(header.back(), '\n');
  EXPECT_EQ(bytes.size(), header.size() + t.num_bytes());

  absl::StatusOr<HostTensor> back = DecodeNpy(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSameTensor(*back, t);

  const std::string path = TempPath("round_trip.npy");
  ASSERT_TRUE(WriteNpy(path, t).ok());
  absl::StatusOr<HostTensor> read = ReadNpy(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ExpectSameTensor(*read, t);
  std::remove(path.c_str());
}

INSTANTIATE_TEST_SUITE_P(
    DTypesAndShapes, NpyRoundTripTest,
    ::testing::Combine(
        ::testing::Values(DType::kBF16, DType::kF16, DType::kF32, DType::kI32, DType::kI64),
        ::testing::Values(std::vector<int64_t>{}, std::vector<int64_t>{1},
                          std::vector<int64_t>{47, 31}, std::vector<int64_t>{0, 5},
                          std::vector<int64_t>{3, 1, 123}, std::vector<int64_t>{100000})));

TEST(NpyTest, ViewsAreWrittenWithoutCopying) {
  std::vector<int32_t> v = {1, -2, 3, -4, 5, -6};
  const std::string path = TempPath("view.npy");
  ASSERT_TRUE(WriteNpy(path, HostTensor::View(DType::kI32, {3, 2}, v.data())).ok());
  absl::StatusOr<HostTensor> t = ReadNpy(path);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->shape(), (std::vector<int64_t>{3, 2}));
  for (int i = 0; i < 6; ++i) EXPECT_EQ(t->data_as<int32_t>()[i], v[i]);
}

struct Malformed {
  const char* name;
  std::string bytes;
  const char* message;
};

std::string WithDict(const std::string& dict, const std::string& data = "") {
  std::string h("\x93NUMPY\x01\x00", 8);
  const size_t len = dict.size() + 1;
  h.push_back(static_cast<char>(len & 0xff));
  h.push_back(static_cast<char>(len >> 8));
  return h + dict + "\n" + data;
}

const std::string kF32x2 = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }";
const std::string kF64x2 = "{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }";

std::string F64Bytes(const std::vector<double>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(double));
}

class NpyMalformedTest : public ::testing::TestWithParam<Malformed> {};

TEST_P(NpyMalformedTest, IsRejectedFromMemoryAndFile) {
  absl::StatusOr<HostTensor> t = DecodeNpy(GetParam().bytes);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << GetParam().name;
  EXPECT_THAT(Message(t.status()), HasSubstr(GetParam().message));

  const std::string path = TempPath("malformed.npy");
  std::FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  std::fwrite(GetParam().bytes.data(), 1, GetParam().bytes.size(), f);
  std::fclose(f);
  t = ReadNpy(path);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << GetParam().name;
  EXPECT_THAT(Message(t.status()), HasSubstr(GetParam().message));
  EXPECT_THAT(Message(t.status()), HasSubstr(path));
  std::remove(path.c_str());
}

INSTANTIATE_TEST_SUITE_P(
    Cases, NpyMalformedTest,
    ::testing::Values(
        Malformed{"empty", "", "magic"},
        Malformed{"bad_magic", "\x93NUMPX\x01\x00\x10\x00{}", "magic"},
        Malformed{"version", std::string("\x93NUMPY\x04\x00\x10\x00", 10) + "{}", "version 4.0"},
        Malformed{"truncated_header", std::string("\x93NUMPY\x01\x00\x40\x00", 10) + "{'d",
                  "truncated header"},
        Malformed{"not_a_dict", WithDict("['descr']"), "not a dict"},
        Malformed{"missing_shape", WithDict("{'descr': '<f4', 'fortran_order': False}"),
                  "lacks one of"},
        Malformed{"unknown_key",
                  WithDict("{'descr': '<f4', 'fortran_order': False, 'shape': (), 'x': 1}"),
                  "unexpected key 'x'"},
        Malformed{"duplicate", WithDict("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False}"),
                  "duplicate 'descr'"},
        Malformed{"fortran",
                  WithDict("{'descr': '<f4', 'fortran_order': True, 'shape': (2,), }", "12345678"),
                  "Fortran-order"},
        Malformed{"big_endian",
                  WithDict("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", "12345678"),
                  "unsupported .npy descr '>f4'"},
        Malformed{"float64_short", WithDict(kF64x2, std::string(15, '\0')),
                  "shape float64[2] needs 16 data bytes, the file holds 15"},
        Malformed{"float64_long", WithDict(kF64x2, std::string(17, '\0')),
                  "needs 16 data bytes, the file holds 17"},
        Malformed{"float64_beyond_fp32", WithDict(kF64x2, F64Bytes({1.5, 1e39})),
                  "float64 element 1 (1e+39) is outside fp32's range"},
        Malformed{"complex", WithDict("{'descr': '<c16', 'fortran_order': False, 'shape': (1,), }",
                                      std::string(16, '\0')),
                  "unsupported .npy descr '<c16'"},
        Malformed{"negative_dim",
                  WithDict("{'descr': '<f4', 'fortran_order': False, 'shape': (-2,), }"),
                  "non-negative integers"},
        Malformed{"bad_tuple", WithDict("{'descr': '<f4', 'fortran_order': False, 'shape': (2 3)}"),
                  "expected ',' or ')'"},
        Malformed{"overflow",
                  WithDict("{'descr': '<f4', 'fortran_order': False, "
                           "'shape': (4294967296, 4294967296), }"),
                  "overflows"},
        Malformed{"short_data", WithDict(kF32x2, "1234567"),
                  "needs 8 data bytes, the file holds 7"},
        Malformed{"long_data", WithDict(kF32x2, "123456789"),
                  "needs 8 data bytes, the file holds 9"},
        Malformed{"text_after_dict", WithDict(kF32x2 + " x", "12345678"),
                  "text after the header dict"}),
    [](const ::testing::TestParamInfo<Malformed>& info) { return std::string(info.param.name); });

// NumPy's default float: read as fp32, each value rounded to nearest, through memory and file.
TEST(NpyTest, Float64IsReadAsFp32) {
  std::mt19937_64 gen(11);
  std::normal_distribution<double> normal(0.0, 30.0);
  std::vector<double> values(47 * 31);
  for (double& v : values) v = normal(gen);
  values[3] = -std::numeric_limits<double>::infinity();  // kept: the server judges it
  values[5] = 3.4028234663852886e38;                     // FLT_MAX itself still fits
  const std::string file =
      WithDict("{'descr': '<f8', 'fortran_order': False, 'shape': (47, 31), }", F64Bytes(values));
  const std::string path = TempPath("float64.npy");
  std::FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(std::fwrite(file.data(), 1, file.size(), f), file.size());
  std::fclose(f);
  for (absl::StatusOr<HostTensor> t : {DecodeNpy(file), ReadNpy(path)}) {
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->dtype(), DType::kF32);
    EXPECT_EQ(t->shape(), (std::vector<int64_t>{47, 31}));
    int mismatches = 0;
    for (size_t i = 0; i < values.size(); ++i) {
      mismatches += t->data_as<float>()[i] != static_cast<float>(values[i]);
    }
    EXPECT_EQ(mismatches, 0);
  }
  std::remove(path.c_str());
}

// A header that claims more data than the file holds is refused from the file's size, before
// the tensor is allocated (a (100000, 100000) fp32 header is 37 GiB; allocating first ended in
// std::bad_alloc). The message names the file, the shape and both sizes.
TEST(NpyTest, HugeShapeInASmallFileIsRefusedBeforeAllocating) {
  struct Case {
    const char* dict;
    const char* message;
  };
  const Case cases[] = {
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (100000, 100000), }",
       "shape fp32[100000, 100000] needs 40000000000 data bytes, the file holds 8"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1000000, 1000000), }",
       "shape fp32[1000000, 1000000] needs 4000000000000 data bytes, the file holds 8"},
      {"{'descr': '<f8', 'fortran_order': False, 'shape': (1000000, 1000000), }",
       "shape float64[1000000, 1000000] needs 8000000000000 data bytes, the file holds 8"},
  };
  const std::string path = TempPath("huge.npy");
  for (const Case& c : cases) {
    const std::string file = WithDict(c.dict, "12345678");
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fwrite(file.data(), 1, file.size(), f), file.size());
    std::fclose(f);
    absl::StatusOr<HostTensor> t = ReadNpy(path);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << c.dict;
    EXPECT_THAT(Message(t.status()), HasSubstr(c.message));
    EXPECT_THAT(Message(t.status()), HasSubstr(path + " (" + std::to_string(file.size()) +
                                               " bytes): malformed .npy: shape "));
  }
  std::remove(path.c_str());
}

TEST(NpyTest, MissingFileIsNotFound) {
  absl::StatusOr<HostTensor> t = ReadNpy(TempPath("does_not_exist.npy"));
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(t.status()), HasSubstr("does_not_exist.npy"));
}

TEST(NpyTest, WritingAnInconsistentTensorFails) {
  const std::string path = TempPath("bad.npy");
  absl::Status s = WriteNpy(path, HostTensor::FromBytes(DType::kF32, {3}, ByteVector(11)));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(s), HasSubstr("holds 11 bytes"));
  EXPECT_EQ(WriteNpy("/nonexistent-dir/x.npy", HostTensor::Owned(DType::kF32, {1})).code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace client
}  // namespace lossd
