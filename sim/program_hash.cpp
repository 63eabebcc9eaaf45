// program_hash (program_hash.h): FNV-1a (Fowler, Noll, Vo; the 64-bit offset basis and prime of
// draft-eastlake-fnv) over each interpreted field's bytes, field by field, so that padding
// inside the structs never enters it.
#include "peftplan/sim/program_hash.h"

#include "peftplan/sim/ops.h"

#include <bit>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

namespace peftplan::sim {
namespace {

class Fnv1a {
 public:
  template <typename T>
  void add(T v) {
    static_assert(std::is_integral_v<T> || std::is_enum_v<T> || std::is_floating_point_v<T>);
    std::uint64_t x;
    if constexpr (std::is_floating_point_v<T>) x = std::bit_cast<std::uint64_t>(static_cast<double>(v));
    else if constexpr (std::is_enum_v<T>) x = static_cast<std::uint64_t>(static_cast<std::underlying_type_t<T>>(v));
    else x = static_cast<std::uint64_t>(v);
    for (int i = 0; i < 8; ++i) {
      h_ ^= (x >> (8 * i)) & 0xffu;
      h_ *= 0x100000001b3ull;
    }
  }
  std::uint64_t value() const { return h_; }

 private:
  std::uint64_t h_ = 0xcbf29ce484222325ull;
};

// Every field an interpreter reads, in program order, each handed to h.add: the one list both
// the hash and the comparison below read.
template <class V>
void visit_interpreted(const Program& p, V& h) {
  h.add(kProgramContractVersion);
  h.add(p.ranks);
  h.add(p.micro_batches);
  h.add(p.tokens_per_step);
  h.add(p.model_flops_per_step);
  h.add(p.executable);
  // Only where it is not fp32, so that the hashes of the fp32 programs made before it existed
  // (every plan.json written then) stay what they were.
  if (p.compute_dtype != DType::fp32) h.add(static_cast<std::uint8_t>(p.compute_dtype));
  h.add(p.buffers.size());
  for (const Buffer& b : p.buffers) {
    h.add(b.category);
    h.add(b.bytes);
    h.add(b.view_of);
    h.add(b.offset);
    h.add(b.pieces.size());
    for (std::uint64_t piece : b.pieces) h.add(piece);
    h.add(b.reuse_after_next_recorded_free);
    h.add(b.role);
    h.add(b.tensor);
  }
  h.add(p.ops.size());
  for (const Op& op : p.ops) {
    h.add(op.kind);
    h.add(op.stream);
    h.add(op.phase);
    h.add(op.kernel);
    h.add(op.collective);
    h.add(op.copy_dir);
    h.add(op.layer);
    h.add(op.micro_batch);
    h.add(op.buffer);
    h.add(op.group_size);
    h.add(op.group_stride);
    h.add(op.bytes);
    h.add(op.buffer_out);
    h.add(op.buffer_in);
    h.add(op.work.flops);
    h.add(op.work.bytes_moved);
    h.add(op.work.gemm_m);
    h.add(op.work.gemm_n);
    h.add(op.work.gemm_k);
    h.add(op.work.gemm_count);
    h.add(op.work.params);
    h.add(op.work.fp32_math);
    h.add(op.accumulate);
    h.add(op.reduction);
    if (op.kind == OpKind::compute && ops::operands_in_range(p, op)) {  // its operands, shape and scalars
      const std::size_t n = ops::values_of(op.kernel);
      for (std::size_t k = 0; k < n; ++k) h.add(p.operands[static_cast<std::size_t>(op.operands) + k]);
    }
    h.add(op.deps_count);
    for (std::int32_t d : p.deps_of(op)) h.add(d);
  }
}


// Collects the fields as 64-bit words.
class Words {
 public:
  template <typename T>
  void add(T v) {
    if constexpr (std::is_floating_point_v<T>) words.push_back(std::bit_cast<std::uint64_t>(static_cast<double>(v)));
    else if constexpr (std::is_enum_v<T>) words.push_back(static_cast<std::uint64_t>(static_cast<std::underlying_type_t<T>>(v)));
    else words.push_back(static_cast<std::uint64_t>(v));
  }
  std::vector<std::uint64_t> words;
};

}  // namespace

std::uint64_t program_hash(const Program& p) {
  Fnv1a h;
  visit_interpreted(p, h);
  return h.value();
}

bool same_interpreted_fields(const Program& a, const Program& b) {
  if (a.ops.size() != b.ops.size() || a.buffers.size() != b.buffers.size()) return false;
  Words wa, wb;
  wa.words.reserve(a.ops.size() * 32);
  wb.words.reserve(b.ops.size() * 32);
  visit_interpreted(a, wa);
  visit_interpreted(b, wb);
  return wa.words == wb.words;
}

std::string program_hash_hex(const Program& program) { return fmt::format("{:016x}", program_hash(program)); }

}  // namespace peftplan::sim
