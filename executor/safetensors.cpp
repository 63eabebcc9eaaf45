// safetensors reader (mmap + full header validation) and atomic writer. The checks follow
// safetensors/src/tensor.rs (read_metadata, Metadata::validate): header size bounds, a JSON
// object header, known dtypes, no duplicate names, offsets that tile the buffer exactly, and
// byte sizes equal to numel × dtype size. Each failure names the file and the tensor.
#include "peftplan/executor/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "peftplan/common/atomic_file.h"
#include "peftplan/common/error.h"
#include "peftplan/executor/kernels.h"

namespace peftplan::executor {

namespace {

struct DtypeRow {
  StDtype type;
  std::string_view name;
  int bits;
};
// safetensors/src/tensor.rs Dtype and Dtype::bitsize.
constexpr std::array<DtypeRow, 22> kDtypes{{
    {StDtype::BOOL, "BOOL", 8},         {StDtype::F4, "F4", 4},
    {StDtype::F6_E2M3, "F6_E2M3", 6},   {StDtype::F6_E3M2, "F6_E3M2", 6},
    {StDtype::U8, "U8", 8},             {StDtype::I8, "I8", 8},
    {StDtype::F8_E5M2, "F8_E5M2", 8},   {StDtype::F8_E4M3, "F8_E4M3", 8},
    {StDtype::F8_E8M0, "F8_E8M0", 8},   {StDtype::F8_E4M3FNUZ, "F8_E4M3FNUZ", 8},
    {StDtype::F8_E5M2FNUZ, "F8_E5M2FNUZ", 8},
    {StDtype::I16, "I16", 16},          {StDtype::U16, "U16", 16},
    {StDtype::F16, "F16", 16},          {StDtype::BF16, "BF16", 16},
    {StDtype::I32, "I32", 32},          {StDtype::U32, "U32", 32},
    {StDtype::F32, "F32", 32},          {StDtype::C64, "C64", 64},
    {StDtype::F64, "F64", 64},          {StDtype::I64, "I64", 64},
    {StDtype::U64, "U64", 64},
}};

std::string shape_str(const std::vector<std::int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ","));
}

// numel · bits / 8, or nullopt on overflow or a size that is not a whole number of bytes.
std::optional<std::uint64_t> byte_size(const std::vector<std::int64_t>& shape, int bits) {
  std::uint64_t nbits = static_cast<std::uint64_t>(bits);
  for (std::int64_t d : shape)
    if (__builtin_mul_overflow(nbits, static_cast<std::uint64_t>(d), &nbits)) return std::nullopt;
  if (nbits % 8 != 0) return std::nullopt;
  return nbits / 8;
}

void unmap(const std::byte* data, std::size_t bytes) {
  if (data != nullptr) ::munmap(const_cast<std::byte*>(data), bytes);
}

}  // namespace

std::string_view name_of(StDtype t) {
  for (const auto& row : kDtypes)
    if (row.type == t) return row.name;
  return "?";
}

std::optional<StDtype> parse_st_dtype(std::string_view s) {
  for (const auto& row : kDtypes)
    if (row.name == s) return row.type;
  return std::nullopt;
}

int bits_of(StDtype t) {
  for (const auto& row : kDtypes)
    if (row.type == t) return row.bits;
  return 0;
}

std::int64_t StTensorInfo::numel() const {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

// ------------------------------------------------------------------------------------ reader

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept
    : path_(std::move(o.path_)),
      metadata_(std::move(o.metadata_)),
      tensors_(std::move(o.tensors_)),
      map_(std::exchange(o.map_, nullptr)),
      map_bytes_(std::exchange(o.map_bytes_, 0)),
      data_start_(o.data_start_) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    unmap(map_, map_bytes_);
    path_ = std::move(o.path_);
    metadata_ = std::move(o.metadata_);
    tensors_ = std::move(o.tensors_);
    map_ = std::exchange(o.map_, nullptr);
    map_bytes_ = std::exchange(o.map_bytes_, 0);
    data_start_ = o.data_start_;
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { unmap(map_, map_bytes_); }

SafetensorsFile SafetensorsFile::open(const std::filesystem::path& path) {
  const std::string file = path.string();
  SafetensorsFile f;
  f.path_ = path;

  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw InputError(fmt::format("{}: cannot open: {}", file, std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw InputError(fmt::format("{}: cannot stat: {}", file, std::strerror(err)));
  }
  const auto file_bytes = static_cast<std::uint64_t>(st.st_size);
  if (file_bytes < 8) {
    ::close(fd);
    throw InputError(fmt::format(
        "{}: file is {} bytes, shorter than the 8-byte safetensors header length", file,
        file_bytes));
  }
  void* m = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);
  if (m == MAP_FAILED)
    throw InputError(fmt::format("{}: cannot map: {}", file, std::strerror(map_err)));
  f.map_ = static_cast<const std::byte*>(m);
  f.map_bytes_ = file_bytes;

  // Header length: u64 little-endian.
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | std::to_integer<std::uint64_t>(f.map_[i]);
  if (n > kSafetensorsMaxHeaderBytes)
    throw InputError(fmt::format("{}: header length {} exceeds the safetensors limit of {} bytes",
                                 file, n, kSafetensorsMaxHeaderBytes));
  if (n > file_bytes - 8)
    throw InputError(fmt::format(
        "{}: header length {} runs past the end of the file ({} bytes after the length field)",
        file, n, file_bytes - 8));
  f.data_start_ = 8 + n;
  const std::uint64_t buffer_bytes = file_bytes - 8 - n;

  const std::string_view header(reinterpret_cast<const char*>(f.map_ + 8), n);
  if (header.empty() || header.front() != '{')
    throw InputError(fmt::format("{}: header is not a JSON object (must start with '{{')", file));

  // Parse, rejecting duplicate top-level names (serde rejects them; nlohmann would keep the last).
  std::set<std::string> seen;
  std::string duplicate;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(
        header,
        [&](int depth, nlohmann::json::parse_event_t ev, nlohmann::json& parsed) {
          if (ev == nlohmann::json::parse_event_t::key && depth == 1) {
            auto key = parsed.get<std::string>();
            if (!seen.insert(key).second && duplicate.empty()) duplicate = key;
          }
          return true;
        });
  } catch (const nlohmann::json::exception& e) {
    throw InputError(fmt::format("{}: header is not valid JSON: {}", file, e.what()));
  }
  if (!duplicate.empty())
    throw InputError(fmt::format("{}: tensor {} appears twice in the header", file, duplicate));
  if (!j.is_object()) throw InputError(fmt::format("{}: header is not a JSON object", file));

  for (const auto& [key, val] : j.items()) {
    if (key == "__metadata__") {
      if (!val.is_object())
        throw InputError(fmt::format("{}: __metadata__ must map strings to strings", file));
      for (const auto& [mk, mv] : val.items()) {
        if (!mv.is_string())
          throw InputError(fmt::format(
              "{}: __metadata__ value of {} must be a string, got {}", file, mk, mv.dump()));
        f.metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    const std::string where = fmt::format("{}: tensor {}", file, key);
    if (!val.is_object())
      throw InputError(fmt::format("{}: entry must be an object with dtype, shape and "
                                   "data_offsets, got {}", where, val.dump()));
    StTensorInfo t;
    t.name = key;

    const auto dt = val.find("dtype");
    if (dt == val.end() || !dt->is_string())
      throw InputError(fmt::format("{}: dtype missing or not a string", where));
    const auto parsed = parse_st_dtype(dt->get<std::string>());
    if (!parsed)
      throw InputError(fmt::format("{}: unknown dtype \"{}\" (valid: BOOL, U8, I8, I16, U16, F16, "
                                   "BF16, I32, U32, F32, F64, I64, U64, C64, F8_*, F6_*, F4)",
                                   where, dt->get<std::string>()));
    t.dtype = *parsed;

    const auto sh = val.find("shape");
    if (sh == val.end() || !sh->is_array())
      throw InputError(fmt::format("{}: shape missing or not an array", where));
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned() ||
          d.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        throw InputError(fmt::format("{}: shape entries must be non-negative integers, got {}",
                                     where, sh->dump()));
      t.shape.push_back(d.get<std::int64_t>());
    }

    const auto off = val.find("data_offsets");
    if (off == val.end() || !off->is_array() || off->size() != 2 ||
        !(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned())
      throw InputError(fmt::format("{}: data_offsets must be [begin, end] with non-negative "
                                   "integers", where));
    t.begin = (*off)[0].get<std::uint64_t>();
    t.end = (*off)[1].get<std::uint64_t>();
    if (t.end < t.begin)
      throw InputError(fmt::format("{}: data_offsets [{}, {}] have end < begin", where, t.begin,
                                   t.end));
    if (t.end > buffer_bytes)
      throw InputError(fmt::format("{}: data_offsets [{}, {}] lie outside the {}-byte data buffer",
                                   where, t.begin, t.end, buffer_bytes));
    const auto need = byte_size(t.shape, bits_of(t.dtype));
    if (!need)
      throw InputError(fmt::format("{}: shape {} × {} is not a whole number of bytes or overflows",
                                   where, shape_str(t.shape), name_of(t.dtype)));
    if (*need != t.end - t.begin)
      throw InputError(fmt::format("{}: shape {} × {} needs {} bytes, data_offsets give {}", where,
                                   shape_str(t.shape), name_of(t.dtype), *need,
                                   t.end - t.begin));
    f.tensors_.push_back(std::move(t));
  }

  // The tensors must tile [0, buffer_bytes) with no hole and no overlap (Metadata::validate).
  std::vector<const StTensorInfo*> by_offset;
  by_offset.reserve(f.tensors_.size());
  for (const auto& t : f.tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) {
    return std::pair(a->begin, a->end) < std::pair(b->begin, b->end);
  });
  std::uint64_t cursor = 0;
  for (const auto* t : by_offset) {
    if (t->begin != cursor)
      throw InputError(fmt::format(
          "{}: tensor {}: data_offsets [{}, {}] {} (the previous tensor ends at {}; tensors must "
          "cover the data buffer contiguously)",
          file, t->name, t->begin, t->end,
          t->begin < cursor ? "overlap another tensor" : "leave a gap", cursor));
    cursor = t->end;
  }
  if (cursor != buffer_bytes)
    throw InputError(fmt::format("{}: tensors cover {} of the {} data-buffer bytes; safetensors "
                                 "requires the tensors to cover the buffer exactly",
                                 file, cursor, buffer_bytes));

  std::sort(f.tensors_.begin(), f.tensors_.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  return f;
}

const StTensorInfo* SafetensorsFile::find(std::string_view name) const {
  const auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                                   [](const StTensorInfo& t, std::string_view n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

const StTensorInfo& SafetensorsFile::at(std::string_view name) const {
  const StTensorInfo* t = find(name);
  if (t == nullptr)
    throw InputError(fmt::format("{}: tensor {} not found", path_.string(), name));
  return *t;
}

std::span<const std::byte> SafetensorsFile::bytes(const StTensorInfo& t) const {
  return {map_ + data_start_ + t.begin, static_cast<std::size_t>(t.nbytes())};
}

void SafetensorsFile::read_f32(std::string_view name, std::span<float> out,
                               bool allow_conversion) const {
  const StTensorInfo& t = at(name);
  const auto where = fmt::format("{}: tensor {}", path_.string(), name);
  if (static_cast<std::int64_t>(out.size()) != t.numel())
    throw InputError(fmt::format("{}: shape {} has {} elements, the destination holds {}", where,
                                 shape_str(t.shape), t.numel(), out.size()));
  const auto src = bytes(t);
  const auto n = static_cast<cpu::Index>(out.size());
  const bool convertible =
      t.dtype == StDtype::F16 || t.dtype == StDtype::BF16 || t.dtype == StDtype::F64;
  // A tensor of no elements copies nothing: its span's data() may be null, which memcpy does not
  // take even for 0 bytes (found by fuzz/fuzz_safetensors.cpp under UBSan).
  if (t.dtype == StDtype::F32) {
    if (!src.empty()) std::memcpy(out.data(), src.data(), src.size());
  } else if (convertible && allow_conversion) {
    if (t.dtype == StDtype::F64) {
      for (cpu::Index i = 0; i < n; ++i) {
        double v;
        std::memcpy(&v, src.data() + i * 8, 8);
        out[i] = static_cast<float>(v);
      }
    } else {
      // Copy the 16-bit patterns into the destination's upper half, then widen in place from
      // the front: out[i] only overwrites patterns at indices <= i, already consumed (no
      // temporary buffer; the mapping may be unaligned for uint16 access).
      auto* bits = reinterpret_cast<std::uint16_t*>(out.data()) + n;
      if (!src.empty()) std::memcpy(bits, src.data(), src.size());
      for (cpu::Index i = 0; i < n; ++i)
        out[i] = t.dtype == StDtype::BF16 ? cpu::bf16_to_fp32(bits[i]) : cpu::fp16_to_fp32(bits[i]);
    }
  } else {
    throw InputError(fmt::format("{}: dtype {} cannot be read as F32{}", where, name_of(t.dtype),
                                 convertible ? " without conversion" : ""));
  }
}

void SafetensorsFile::read_bf16(std::string_view name, std::span<std::uint16_t> out,
                                bool allow_conversion) const {
  const StTensorInfo& t = at(name);
  const auto where = fmt::format("{}: tensor {}", path_.string(), name);
  if (static_cast<std::int64_t>(out.size()) != t.numel())
    throw InputError(fmt::format("{}: shape {} has {} elements, the destination holds {}", where,
                                 shape_str(t.shape), t.numel(), out.size()));
  const auto src = bytes(t);
  if (t.dtype == StDtype::BF16) {
    if (!src.empty()) std::memcpy(out.data(), src.data(), src.size());  // as read_f32
  } else if (t.dtype == StDtype::F32 && allow_conversion) {
    for (std::size_t i = 0; i < out.size(); ++i) {
      float v;
      std::memcpy(&v, src.data() + i * 4, 4);
      out[i] = cpu::fp32_to_bf16(v);
    }
  } else {
    throw InputError(fmt::format("{}: dtype {} cannot be read as BF16", where, name_of(t.dtype)));
  }
}

// ------------------------------------------------------------------------------------ writer

void write_safetensors(const std::filesystem::path& path, std::span<const StTensorView> tensors,
                       const std::map<std::string, std::string>& metadata) {
  const std::string file = path.string();
  std::vector<const StTensorView*> order;
  order.reserve(tensors.size());
  for (const auto& t : tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const auto* a, const auto* b) { return a->name < b->name; });

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (std::size_t i = 0; i < order.size(); ++i) {
    const StTensorView& t = *order[i];
    if (t.name == "__metadata__" || (i > 0 && order[i - 1]->name == t.name))
      throw InputError(fmt::format("{}: tensor name {} is reserved or repeated", file, t.name));
    const auto need = byte_size(t.shape, bits_of(t.dtype));
    if (!need || *need != t.data.size())
      throw InputError(fmt::format("{}: tensor {}: shape {} × {} needs {} bytes, got {}", file,
                                   t.name, shape_str(t.shape), name_of(t.dtype),
                                   need ? fmt::format("{}", *need) : "an invalid size",
                                   t.data.size()));
    header[t.name] = {{"dtype", name_of(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + *need}}};
    offset += *need;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // pad to 8 bytes, as the serializer does

  std::array<char, 8> len_le{};
  for (int i = 0; i < 8; ++i) len_le[i] = static_cast<char>(text.size() >> (8 * i));
  std::vector<std::string_view> pieces = {std::string_view(len_le.data(), 8), text};
  for (const auto* t : order) pieces.emplace_back(reinterpret_cast<const char*>(t->data.data()), t->data.size());
  write_file_atomic(path, pieces);
}

}  // namespace peftplan::executor
