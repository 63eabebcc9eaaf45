// Reading and writing safetensors files (huggingface/safetensors README "Format";
// validation as in safetensors/src/tensor.rs): an 8-byte little-endian header length N, N bytes
// of JSON {"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [begin, end)}},
// then the byte buffer the offsets index, which the tensors must cover exactly.
// Every malformed file is an InputError naming the file and, where there is one, the tensor.
// Not here: model or adapter naming conventions (the model code maps HF/PEFT names), sharded
// checkpoints' index.json.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace peftplan::executor {

// The dtype strings safetensors defines (safetensors/src/tensor.rs Dtype).
enum class StDtype {
  BOOL, F4, F6_E2M3, F6_E3M2, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ,
  I16, U16, F16, BF16, I32, U32, F32, C64, F64, I64, U64,
};

std::string_view name_of(StDtype t);
std::optional<StDtype> parse_st_dtype(std::string_view s);
// Bits per element (F4: 4, F6_*: 6, C64: 64, ...).
int bits_of(StDtype t);

// One tensor's header entry; offsets are relative to the start of the byte buffer.
struct StTensorInfo {
  std::string name;                 // as written in the header
  StDtype dtype = StDtype::F32;     // element type
  std::vector<std::int64_t> shape;  // row-major; [] is a scalar
  std::uint64_t begin = 0;          // data_offsets[0], bytes
  std::uint64_t end = 0;            // data_offsets[1], bytes, exclusive
  std::int64_t numel() const;       // product of shape (1 for a scalar)
  std::uint64_t nbytes() const { return end - begin; }
};

// A validated, read-only safetensors file, memory-mapped for its lifetime.
class SafetensorsFile {
 public:
  // Opens, maps and validates the whole header; throws InputError on any defect.
  static SafetensorsFile open(const std::filesystem::path& path);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::filesystem::path& path() const { return path_; }
  // "__metadata__" (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // All tensors, sorted by name.
  const std::vector<StTensorInfo>& tensors() const { return tensors_; }
  // nullptr when there is no such tensor.
  const StTensorInfo* find(std::string_view name) const;
  // Throws InputError "<file>: tensor <name> not found" when absent.
  const StTensorInfo& at(std::string_view name) const;
  // The tensor's raw little-endian bytes inside the mapping (valid while *this lives).
  std::span<const std::byte> bytes(const StTensorInfo& t) const;

  // Copies the tensor into out as fp32. F32 is copied; F16 and BF16 are converted only when
  // allow_conversion is true (F64 likewise, rounding to nearest). Throws InputError naming the
  // file and tensor for any other dtype, or when out.size() != numel.
  void read_f32(std::string_view name, std::span<float> out, bool allow_conversion = true) const;
  // Copies the tensor as bf16 bit patterns: BF16 is copied, F32 rounded to nearest even when
  // allow_conversion is true.
  void read_bf16(std::string_view name, std::span<std::uint16_t> out,
                 bool allow_conversion = true) const;

 private:
  SafetensorsFile() = default;
  std::filesystem::path path_;
  std::map<std::string, std::string> metadata_;
  std::vector<StTensorInfo> tensors_;
  const std::byte* map_ = nullptr;  // whole file mapping (nullptr for an empty mapping)
  std::size_t map_bytes_ = 0;
  std::size_t data_start_ = 0;      // 8 + N
};

// A tensor to write: its name, dtype, shape and exactly numel·bits/8 bytes of data.
struct StTensorView {
  std::string name;
  StDtype dtype = StDtype::F32;
  std::vector<std::int64_t> shape;
  std::span<const std::byte> data;
};

// Writes a safetensors file: the header JSON ("__metadata__" first, then tensors in sorted name
// order, data laid out in the same order) padded with spaces to a multiple of 8 bytes. Written
// to "<path>.tmp.<pid>" and renamed over path, so readers never see a half-written file.
// Throws InputError on a duplicate name, a size mismatch or an I/O failure.
void write_safetensors(const std::filesystem::path& path, std::span<const StTensorView> tensors,
                       const std::map<std::string, std::string>& metadata = {});

// The largest header safetensors accepts (tensor.rs MAX_HEADER_SIZE).
inline constexpr std::uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

}  // namespace peftplan::executor
