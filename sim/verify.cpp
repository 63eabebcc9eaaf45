// sim::verify (verify.h): one pass over the ops in program order (the setup ops come first, one
// of the rules, so that setup buffers exist before the step starts for every interpreter).
#include "peftplan/sim/verify.h"

#include <array>

#include <fmt/format.h>

#include "peftplan/common/error.h"
#include "peftplan/sim/ops.h"

namespace peftplan::sim {

std::string_view name_of(Rule r) {
  constexpr std::array<std::string_view, kNumRules> names = {
      "buffer_id",     "view_bounds", "view_alloc",  "double_alloc",     "free_not_live",
      "use_not_live",  "dep_order",   "kernel_none", "collective_group", "copy_direction",
      "setup_order",   "pieces",      "scalar_reduction", "buffer_role",   "operand_missing",
      "operand_size"};
  return names[static_cast<std::size_t>(r)];
}
static_assert(static_cast<int>(Rule::operand_size) + 1 == kNumRules, "the verify rules' names list every Rule");

namespace {

class Checker {
 public:
  explicit Checker(const Program& p) : p_(p), live_(p.buffers.size(), 0), view_(p.buffers.size(), 0), root_(p.buffers.size()) {}

  std::vector<Violation> run() {
    check_buffers();
    bool in_step = false;
    for (std::size_t i = 0; i < p_.ops.size(); ++i) {
      const bool setup = p_.ops[i].phase == Phase::setup;
      if (setup && in_step) [[unlikely]]
        add(Rule::setup_order, static_cast<std::int32_t>(i), "a setup op after the step's first op");
      in_step = in_step || !setup;
      check_op(static_cast<std::int32_t>(i));
    }
    return std::move(out_);
  }

 private:
  void add(Rule r, std::int32_t op, std::string detail) { out_.push_back(Violation{r, op, std::move(detail)}); }

  bool exists(std::int32_t b) const { return b >= 0 && static_cast<std::size_t>(b) < p_.buffers.size(); }

  std::string label(std::int32_t b) const {
    const std::string& n = p_.buffers[static_cast<std::size_t>(b)].name;
    return n.empty() ? fmt::format("buffer #{}", b) : fmt::format("buffer #{} ({})", b, n);
  }

  // The buffer whose alloc and free make b live (b itself, or a view's outermost parent).
  std::int32_t root(std::int32_t b) const {
    for (int hops = 0; exists(b) && p_.buffers[static_cast<std::size_t>(b)].view_of >= 0 && hops < 64; ++hops)
      b = p_.buffers[static_cast<std::size_t>(b)].view_of;
    return b;
  }

  // One pass over the buffers (they are large structs; the op loop then reads only the compact
  // arrays filled here): views and their bounds, allocation pieces, roles.
  void check_buffers() {
    std::array<std::int32_t, kNumBufferRoles> holder;
    holder.fill(-1);
    for (std::size_t i = 0; i < p_.buffers.size(); ++i) {
      const Buffer& b = p_.buffers[i];
      if (b.role != BufferRole::none) check_role(static_cast<std::int32_t>(i), holder);
      view_[i] = b.view_of >= 0 ? 1 : 0;
      root_[i] = root(static_cast<std::int32_t>(i));
      if (!b.pieces.empty()) check_pieces(static_cast<std::int32_t>(i));
      if (!exists(root_[i])) root_[i] = static_cast<std::int32_t>(i);  // reported below
      if (b.view_of < 0) continue;
      const auto id = static_cast<std::int32_t>(i);
      if (!exists(b.view_of) || b.view_of == id) {
        add(Rule::view_bounds, -1, fmt::format("{} is a view of buffer #{}, which does not exist", label(id), b.view_of));
        continue;
      }
      const Buffer& parent = p_.buffers[static_cast<std::size_t>(b.view_of)];
      if (b.offset > parent.bytes || b.bytes > parent.bytes - b.offset)
        add(Rule::view_bounds, -1, fmt::format("{} covers bytes [{}, {}) of {}, which has {}", label(id), b.offset,
                                               b.offset + b.bytes, label(b.view_of), parent.bytes));
    }
  }

  void check_role(std::int32_t id, std::array<std::int32_t, kNumBufferRoles>& holder) {
    const Buffer& b = p_.buffers[static_cast<std::size_t>(id)];
    if (b.role == BufferRole::base_tensor || b.role == BufferRole::adapter_tensor || b.role == BufferRole::adapter_grad) {
      if (b.tensor < 0) add(Rule::buffer_role, -1, fmt::format("{} is a {} without its inventory index", label(id), name_of(b.role)));
      return;
    }
    std::int32_t& h = holder[static_cast<std::size_t>(b.role)];
    if (h >= 0) add(Rule::buffer_role, -1, fmt::format("{} and {} both hold the role {}", label(h), label(id), name_of(b.role)));
    h = id;
  }

  // An executable program's compute op: required slots filled, sizes as the shape says.
  [[gnu::noinline]] void check_operands(std::int32_t i, const Op& op) {
    ops::for_each_slot(p_, op, [&](std::size_t slot, std::int32_t b, const ops::SlotSpec& spec) {
      if (b < 0) {
        if (spec.required)
          add(Rule::operand_missing, i, fmt::format("{} leaves its required slot {} ({}) empty", name_of(op.kernel), slot, spec.name));
        return;
      }
      if (!exists(b) || spec.elems < 0) return;
      const std::uint64_t e = ops::elem_bytes(p_, op, spec.elem);
      if (e == 0) return;
      const std::uint64_t want = e * static_cast<std::uint64_t>(spec.elems);
      const std::uint64_t have = p_.buffers[static_cast<std::size_t>(b)].bytes;
      if (have != want)
        add(Rule::operand_size, i, fmt::format("{} slot {} ({}) is {} with {} B; the op's shape says {} elements, {} B", name_of(op.kernel), slot,
                                               spec.name, label(b), have, spec.elems, want));
    });
  }

  [[gnu::noinline]] void check_pieces(std::int32_t id) {
    const Buffer& b = p_.buffers[static_cast<std::size_t>(id)];
    if (b.view_of >= 0) {
      add(Rule::pieces, -1, fmt::format("{} is a view with {} allocation pieces; a view allocates nothing", label(id), b.pieces.size()));
      return;
    }
    std::uint64_t sum = 0;
    for (std::uint64_t piece : b.pieces) sum += piece;
    if (sum != b.bytes)
      add(Rule::pieces, -1, fmt::format("{} has {} B but its {} allocation pieces sum to {} B", label(id), b.bytes, b.pieces.size(), sum));
  }

  // An operand or payload: it exists, and it (a view: its parent) is live. The check is inline;
  // only a violation goes out of line to say which ("operand" with its slot when slot >= 0).
  void use(std::int32_t i, std::int32_t b, std::string_view role, int slot = -1) {
    if (b < 0) return;
    if (static_cast<std::size_t>(b) >= live_.size() || !live_[static_cast<std::size_t>(root_[static_cast<std::size_t>(b)])]) [[unlikely]]
      report_use(i, b, role, slot);
  }
  [[gnu::noinline]] void report_use(std::int32_t i, std::int32_t b, std::string_view role, int slot) {
    const std::string what = slot >= 0 ? fmt::format("{} {}", role, slot) : std::string(role);
    if (!exists(b)) {
      add(Rule::buffer_id, i, fmt::format("{} names buffer #{}; the program has {}", what, b, p_.buffers.size()));
      return;
    }
    const std::int32_t r = root_[static_cast<std::size_t>(b)];
    add(Rule::use_not_live, i, fmt::format("{} {} is not live{}", what, label(b), r == b ? "" : fmt::format(" (its parent {} is not)", label(r))));
  }

  void check_op(std::int32_t i) {
    const Op& op = p_.ops[static_cast<std::size_t>(i)];
    for (std::int32_t d : p_.deps_of(op))
      if (d < 0 || d >= i) add(Rule::dep_order, i, fmt::format("depends on op {}, not an earlier op", d));
    switch (op.kind) {
      case OpKind::alloc:
      case OpKind::free: {
        const bool alloc = op.kind == OpKind::alloc;
        const auto b = static_cast<std::size_t>(op.buffer);
        // The common case inline; any violation goes out of line to say which.
        if (!exists(op.buffer) || view_[b] || live_[b] == alloc) [[unlikely]] {
          report_alloc(i, op, alloc);
          if (!exists(op.buffer) || view_[b]) return;
        }
        live_[b] = alloc ? 1 : 0;
        return;
      }
      case OpKind::compute:
        if (op.kernel == Kernel::none) add(Rule::kernel_none, i, "a compute op without a kernel");
        if (const auto ids = ops::checked_slot_ids(p_, op)) [[likely]] {
          for (std::size_t a = 0; a < ids->size(); ++a) use(i, static_cast<std::int32_t>((*ids)[a]), "operand", static_cast<int>(a));
        } else {
          add(Rule::buffer_id, i, fmt::format("{}'s {} operand values from #{} lie outside the program's {}", name_of(op.kernel),
                                              ops::values_of(op.kernel), op.operands, p_.operands.size()));
          return;
        }
        if (p_.executable && op.kernel != Kernel::none) check_operands(i, op);
        return;
      case OpKind::collective:
        check_collective(i, op);
        return;
      case OpKind::copy:
        check_copy(i, op);
        return;
    }
  }

  [[gnu::noinline]] void report_alloc(std::int32_t i, const Op& op, bool alloc) {
    if (!exists(op.buffer)) {
      add(Rule::buffer_id, i, fmt::format("{} of buffer #{}; the program has {}", alloc ? "alloc" : "free", op.buffer, p_.buffers.size()));
      return;
    }
    const auto b = static_cast<std::size_t>(op.buffer);
    if (view_[b]) {
      add(Rule::view_alloc, i, fmt::format("{} of {}, a view (views live and die with their parent)", alloc ? "alloc" : "free", label(op.buffer)));
      return;
    }
    if (alloc && live_[b]) add(Rule::double_alloc, i, fmt::format("alloc of {}, which is already live", label(op.buffer)));
    if (!alloc && !live_[b]) add(Rule::free_not_live, i, fmt::format("free of {}, which is not live", label(op.buffer)));
  }

  // Collectives and copies are a few per layer; kept out of check_op so that its frame stays small.
  [[gnu::noinline]] void check_collective(std::int32_t i, const Op& op) {
    use(i, op.buffer, "payload");
    use(i, op.buffer_out, "receive buffer");
    use(i, op.buffer_in, "contributed shard");
    if (op.reduction != ScalarReduction::none && (op.buffer >= 0 || op.bytes != 8 || op.collective != Collective::all_reduce))
      add(Rule::scalar_reduction, i, fmt::format("{} of {} B{} reducing a scalar: a scalar reduction is an 8-byte all_reduce of no buffer",
                                                 name_of(op.collective), op.bytes, op.buffer >= 0 ? " of " + label(op.buffer) : std::string()));
    else if (p_.executable && op.buffer < 0 && op.reduction == ScalarReduction::none)
      add(Rule::scalar_reduction, i, fmt::format("{} of {} B names neither its buffer nor a scalar reduction", name_of(op.collective), op.bytes));
    if (op.group_size < 1 || op.group_stride < 1)
      add(Rule::collective_group, i, fmt::format("{} over a group of {} (stride {})", name_of(op.collective), op.group_size, op.group_stride));
    else if ((op.collective == Collective::all_gather || op.collective == Collective::reduce_scatter) &&
             op.bytes % static_cast<std::uint64_t>(op.group_size) != 0)
      add(Rule::collective_group, i, fmt::format("{} of {} B in total over {} ranks: not a whole shard each",
                                                 name_of(op.collective), op.bytes, op.group_size));
  }

  [[gnu::noinline]] void check_copy(std::int32_t i, const Op& op) {
    use(i, op.buffer, "source");
    use(i, op.buffer_out, "destination");
    // With both ends named, the source lies where the direction starts, and a device-to-host
    // copy lands on the host. (A host-to-device copy may land in a host buffer: under ZeRO-3
    // parameter offload the partition it refreshes lives on the host.)
    if (exists(op.buffer) && exists(op.buffer_out)) {
      const bool to_host = op.copy_dir == CopyDir::device_to_host;
      const bool src_host = on_host(p_.buffers[static_cast<std::size_t>(op.buffer)].category);
      const bool dst_host = on_host(p_.buffers[static_cast<std::size_t>(op.buffer_out)].category);
      if (src_host == to_host || (to_host && !dst_host))
        add(Rule::copy_direction, i, fmt::format("{} copy from {} ({}) to {} ({})", to_host ? "device-to-host" : "host-to-device",
                                                 label(op.buffer), src_host ? "host" : "device", label(op.buffer_out), dst_host ? "host" : "device"));
    }
  }

  const Program& p_;
  std::vector<std::uint8_t> live_;
  std::vector<std::uint8_t> view_;  // each buffer: a view (Buffer::view_of >= 0)
  std::vector<std::int32_t> root_;  // each buffer's outermost parent (itself when not a view)
  std::vector<Violation> out_;
};

}  // namespace

std::vector<Violation> verify(const Program& program) { return Checker(program).run(); }

void verify_or_throw(const Program& program) {
  const std::vector<Violation> v = verify(program);
  if (v.empty()) return;
  std::string msg = fmt::format("the step program breaks its contract in {} place(s):", v.size());
  for (std::size_t i = 0; i < v.size() && i < 5; ++i)
    msg += fmt::format("\n  {} at op {}: {}", name_of(v[i].rule), v[i].op, v[i].detail);
  throw InternalError(msg);
}

}  // namespace peftplan::sim
