// Tests of safetensors reading and writing (executor/include/peftplan/executor/safetensors.h).
// Fixtures in tests/data/safetensors come from make_files.py there: a PEFT-style adapter with
// __metadata__ {"format": "pt"}, a file of mixed dtypes, and one bad file per rule of
// safetensors/src/tensor.rs, each of which must be an InputError naming the file and tensor.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "peftplan/common/error.h"
#include "peftplan/executor/safetensors.h"

namespace {

using namespace peftplan::executor;
using ::testing::HasSubstr;

const std::filesystem::path kDir = std::filesystem::path(PEFTPLAN_TEST_DATA) / "safetensors";
const std::string kLoraA = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
const std::string kLoraB = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight";

std::string read_all(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

template <typename T>
std::span<const std::byte> as_bytes(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}

// A scratch directory per test, removed afterwards.
class SafetensorsTmp : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("peftplan_st_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

TEST(Safetensors, ReadsPeftAdapterWithFormatMetadata) {
  const auto f = SafetensorsFile::open(kDir / "adapter_model.safetensors");
  EXPECT_EQ(f.metadata().at("format"), "pt");  // peft_model.py save_pretrained
  ASSERT_EQ(f.tensors().size(), 2u);
  const auto& a = f.at(kLoraA);
  EXPECT_EQ(a.dtype, StDtype::F32);
  EXPECT_EQ(a.shape, (std::vector<std::int64_t>{2, 4}));
  EXPECT_EQ(a.begin, 0u);
  EXPECT_EQ(a.end, 32u);
  std::vector<float> av(8), bv(8);
  f.read_f32(kLoraA, av);
  f.read_f32(kLoraB, bv);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(av[i], 0.5f * i);
    EXPECT_EQ(bv[i], -1.0f * i);
  }
  EXPECT_EQ(f.find("missing"), nullptr);
  EXPECT_THAT([&] { f.at("missing"); },
              ::testing::ThrowsMessage<peftplan::InputError>(HasSubstr("tensor missing not found")));
  std::vector<float> wrong(7);
  EXPECT_THROW(f.read_f32(kLoraA, wrong), peftplan::InputError);
}

TEST(Safetensors, ReadsMixedDtypesScalarsAndEmptyTensors) {
  const auto f = SafetensorsFile::open(kDir / "mixed_dtypes.safetensors");
  EXPECT_TRUE(f.metadata().empty());
  std::vector<float> half(4), brain(3), scalar(1), empty;
  f.read_f32("half", half);
  EXPECT_EQ(half, (std::vector<float>{1.0f, -2.0f, 0.5f, 65504.0f}));
  f.read_f32("brain", brain);
  EXPECT_EQ(brain, (std::vector<float>{1.0f, -2.0f, 3.140625f}));
  std::vector<std::uint16_t> bbits(3);
  f.read_bf16("brain", bbits);
  EXPECT_EQ(bbits, (std::vector<std::uint16_t>{0x3F80, 0xC000, 0x4049}));
  f.read_f32("scalar", scalar);
  EXPECT_EQ(scalar[0], 2.5f);
  EXPECT_TRUE(f.at("scalar").shape.empty());
  EXPECT_EQ(f.at("scalar").numel(), 1);
  f.read_f32("empty", empty);
  EXPECT_EQ(f.at("empty").numel(), 0);
  const auto ids = f.bytes(f.at("ids"));
  ASSERT_EQ(ids.size(), 16u);
  std::int64_t id[2];
  std::memcpy(id, ids.data(), 16);
  EXPECT_EQ(id[0], 7);
  EXPECT_EQ(id[1], -1);
  // Conversion only on request; integers never convert.
  EXPECT_THAT([&] { f.read_f32("half", half, false); },
              ::testing::ThrowsMessage<peftplan::InputError>(HasSubstr("tensor half: dtype F16")));
  std::vector<float> two(2);
  EXPECT_THAT([&] { f.read_f32("ids", two); },
              ::testing::ThrowsMessage<peftplan::InputError>(HasSubstr("dtype I64 cannot be read")));
}

struct BadFile {
  const char* file;
  const char* message;  // a substring the InputError must contain (besides the file name)
};

class SafetensorsBad : public ::testing::TestWithParam<BadFile> {};

TEST_P(SafetensorsBad, IsRejectedWithFileAndTensor) {
  const auto& c = GetParam();
  try {
    SafetensorsFile::open(kDir / c.file);
    FAIL() << c.file << " was accepted";
  } catch (const peftplan::InputError& e) {
    EXPECT_THAT(e.what(), HasSubstr(c.file));
    EXPECT_THAT(e.what(), HasSubstr(c.message));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Files, SafetensorsBad,
    ::testing::Values(
        BadFile{"bad_short.safetensors", "shorter than the 8-byte"},
        BadFile{"bad_header_length.safetensors", "header length 4096 runs past the end"},
        BadFile{"bad_not_json.safetensors", "header is not valid JSON"},
        BadFile{"bad_not_object.safetensors", "not a JSON object"},
        BadFile{"bad_dtype.safetensors", "tensor t: unknown dtype \"F99\""},
        BadFile{"bad_offsets_outside.safetensors",
                "tensor t: data_offsets [0, 16] lie outside the 8-byte data buffer"},
        BadFile{"bad_end_before_begin.safetensors", "tensor t: data_offsets [8, 0] have end < begin"},
        BadFile{"bad_overlap.safetensors", "tensor b: data_offsets [4, 12] overlap another tensor"},
        BadFile{"bad_gap.safetensors", "tensor b: data_offsets [8, 12] leave a gap"},
        BadFile{"bad_trailing_bytes.safetensors", "tensors cover 8 of the 12 data-buffer bytes"},
        BadFile{"bad_size_mismatch.safetensors",
                "tensor base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight: shape "
                "[8,64] × F32 needs 2048 bytes, data_offsets give 1024"},
        BadFile{"bad_duplicate.safetensors", "tensor t appears twice"},
        BadFile{"bad_metadata.safetensors", "__metadata__ value of format must be a string"},
        BadFile{"bad_negative_shape.safetensors", "tensor t: shape entries must be non-negative"},
        BadFile{"does_not_exist.safetensors", "cannot open"}),
    [](const auto& p) {
      std::string n = p.param.file;
      n = n.substr(0, n.find('.'));
      return n;
    });

TEST_F(SafetensorsTmp, WriterReproducesTheReferenceLayoutByteForByte) {
  // make_files.py writes the adapter the way the safetensors serializer does (compact JSON,
  // __metadata__ first, space padding to 8): our writer must produce the same bytes.
  std::vector<float> a(8), b(8);
  for (int i = 0; i < 8; ++i) {
    a[i] = 0.5f * i;
    b[i] = -1.0f * i;
  }
  const std::vector<StTensorView> tensors{
      {kLoraB, StDtype::F32, {4, 2}, as_bytes(b)},  // unsorted on purpose
      {kLoraA, StDtype::F32, {2, 4}, as_bytes(a)},
  };
  const auto out = dir_ / "adapter_model.safetensors";
  write_safetensors(out, tensors, {{"format", "pt"}});
  EXPECT_EQ(read_all(out), read_all(kDir / "adapter_model.safetensors"));
  // No temporary file is left behind.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir_),
                          std::filesystem::directory_iterator{}),
            1);
}

TEST_F(SafetensorsTmp, RoundTripsEveryKindOfTensor) {
  const std::vector<float> f32{1.5f, -2.25f, 3.0f, 0.0f, 1e-30f, 7.0f};
  const std::vector<std::uint16_t> bf16{0x3F80, 0xC049};
  const std::vector<std::int64_t> i64{1, -2, 3};
  const std::vector<std::uint8_t> u8{1, 2, 3, 4, 5};
  const std::vector<float> none;
  const std::vector<StTensorView> tensors{
      {"w", StDtype::F32, {2, 3}, as_bytes(f32)},
      {"b", StDtype::BF16, {2}, as_bytes(bf16)},
      {"ids", StDtype::I64, {3}, as_bytes(i64)},
      {"mask", StDtype::U8, {5}, as_bytes(u8)},
      {"empty", StDtype::F32, {0}, as_bytes(none)},
  };
  const auto path = dir_ / "model.safetensors";
  write_safetensors(path, tensors);
  const std::string raw = read_all(path);
  std::uint64_t n = 0;
  std::memcpy(&n, raw.data(), 8);
  EXPECT_EQ(n % 8, 0u);  // header padded to a multiple of 8
  EXPECT_EQ(raw.find("__metadata__"), std::string::npos);

  const auto f = SafetensorsFile::open(path);
  ASSERT_EQ(f.tensors().size(), 5u);
  EXPECT_EQ(f.tensors().front().name, "b");  // sorted by name
  std::vector<float> w(6);
  f.read_f32("w", w);
  EXPECT_EQ(w, f32);
  EXPECT_EQ(f.at("w").shape, (std::vector<std::int64_t>{2, 3}));
  std::vector<float> bw(2);
  f.read_f32("b", bw);
  EXPECT_EQ(bw, (std::vector<float>{1.0f, -3.140625f}));
  const auto ib = f.bytes(f.at("ids"));
  EXPECT_EQ(0, std::memcmp(ib.data(), i64.data(), ib.size()));
  const auto mb = f.bytes(f.at("mask"));
  EXPECT_EQ(0, std::memcmp(mb.data(), u8.data(), mb.size()));
  EXPECT_EQ(f.at("empty").nbytes(), 0u);
  // Data are laid out in name order: b, empty, ids, mask, w.
  EXPECT_EQ(f.at("b").begin, 0u);
  EXPECT_EQ(f.at("ids").begin, 4u);
  EXPECT_EQ(f.at("w").end, 4u + 24u + 5u + 24u);

  // F32 read as bf16 rounds to nearest even.
  std::vector<std::uint16_t> wb(6);
  f.read_bf16("w", wb);
  EXPECT_EQ(wb[0], 0x3FC0);  // 1.5
}

TEST_F(SafetensorsTmp, OverwritesAtomicallyAndRejectsBadInput) {
  const auto path = dir_ / "x.safetensors";
  const std::vector<float> one{1.0f}, two{2.0f, 3.0f};
  write_safetensors(path, std::vector<StTensorView>{{"t", StDtype::F32, {1}, as_bytes(one)}});
  write_safetensors(path, std::vector<StTensorView>{{"t", StDtype::F32, {2}, as_bytes(two)}});
  const auto f = SafetensorsFile::open(path);
  std::vector<float> t(2);
  f.read_f32("t", t);
  EXPECT_EQ(t, two);
  EXPECT_THAT(
      [&] {
        write_safetensors(path, std::vector<StTensorView>{{"t", StDtype::F32, {3}, as_bytes(two)}});
      },
      ::testing::ThrowsMessage<peftplan::InputError>(
          HasSubstr("tensor t: shape [3] × F32 needs 12 bytes, got 8")));
  EXPECT_THROW(write_safetensors(path, std::vector<StTensorView>{
                                           {"t", StDtype::F32, {1}, as_bytes(one)},
                                           {"t", StDtype::F32, {1}, as_bytes(one)}}),
               peftplan::InputError);
  EXPECT_THROW(write_safetensors(dir_ / "no_such_dir" / "y.safetensors",
                                 std::vector<StTensorView>{{"t", StDtype::F32, {1}, as_bytes(one)}}),
               peftplan::InputError);
  // The failed writes left the previous file intact.
  const auto g = SafetensorsFile::open(path);
  g.read_f32("t", t);
  EXPECT_EQ(t, two);
}

TEST(Safetensors, DtypeNamesAndSizes) {
  EXPECT_EQ(parse_st_dtype("BF16"), StDtype::BF16);
  EXPECT_EQ(parse_st_dtype("bf16"), std::nullopt);  // case-sensitive like the format
  EXPECT_EQ(bits_of(StDtype::F4), 4);
  EXPECT_EQ(bits_of(StDtype::F6_E2M3), 6);
  EXPECT_EQ(bits_of(StDtype::C64), 64);
  EXPECT_EQ(name_of(StDtype::F8_E4M3), "F8_E4M3");
}

}  // namespace
