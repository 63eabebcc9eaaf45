// Layout (layout.h): facts (dtypes and sizes), the linear modules with their adapters, the units
// of partitioning, the gradient buckets and the flat trainable layout's offsets, made once per
// LayoutKey (layout_of), and the views each build makes of them.
#include "builder.h"

#include <list>
#include <unordered_set>

namespace peftplan::planner::builder {

LayoutKey layout_key(const PlanInput& in) {
  LayoutKey k;
  k.inventory = in.inventory.get();
  k.layers = in.model.layers;
  k.experts = in.model.experts;
  k.experts_per_token = in.model.experts_per_token;
  k.full_finetune = in.peft.adapters.empty();
  k.profile = in.profile;
  k.precision = in.training.precision;
  k.base_storage = in.training.base_storage;
  k.quantization = in.peft.quantization;
  k.stage = in.strategy.stage;
  k.ranks = in.strategy.ranks;
  k.shard_group = in.strategy.shard_group;
  k.fsdp_version = in.strategy.fsdp.version;
  k.persistence_threshold = in.strategy.ds.stage3_param_persistence_threshold;
  k.reduce_bucket_size = in.strategy.ds.reduce_bucket_size;
  return k;
}

std::shared_ptr<const Layout> layout_of(const PlanInput& in) {
  if (!in.inventory) {
    Builder b(in, BuildOptions{.names = false});
    return std::make_shared<const Layout>(b.make_layout());
  }
  // The most recent keys first. A search plans a few dozen (profile x strategy x GPU count) at a
  // time; the explorer, one per column.
  constexpr std::size_t kKept = 64;
  static std::mutex mu;
  static std::list<std::pair<LayoutKey, std::shared_ptr<const Layout>>> kept;
  const LayoutKey key = layout_key(in);
  {
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = kept.begin(); it != kept.end(); ++it)
      if (it->first == key) {
        kept.splice(kept.begin(), kept, it);
        return kept.front().second;
      }
  }
  Builder b(in, BuildOptions{.names = false});
  auto made = std::make_shared<const Layout>(b.make_layout());  // outside the lock: layouts of other keys go on
  std::lock_guard<std::mutex> lock(mu);
  kept.emplace_front(key, made);  // (two threads making one key keep both; the older drops off)
  if (kept.size() > kKept) kept.pop_back();
  return made;
}

Layout Builder::make_layout() {
  layout_facts();
  plan_linears();
  plan_buckets();
  adapter_offsets();
  bucket_ranges();
  lay_.facts = f_;
  return std::move(lay_);
}

void Builder::use_layout(bool reuse) {
  if (reuse && in_.inventory) lay_ = *layout_of(in_);  // a copy: this build fills in its buffer ids
  else lay_ = make_layout();
  f_ = lay_.facts;
  inv_ = lay_.inventory.get();
  tensors_ = &inv_->tensors;
  sizes();
}

// What depends on the micro-batch, the sequence and checkpointing: tokens per micro-batch,
// attended positions, and FSDP1's hook passes.
void Builder::sizes() {
  M_ = t_.micro_batch * t_.seq_len;
  kv_len_ = t_.seq_len;
  for (const auto& a : in_.peft.adapters) {
    if (a.type == models::PeftType::prompt_tuning) M_ = t_.micro_batch * (t_.seq_len + a.prompt.num_virtual_tokens);
    if (a.type == models::PeftType::prefix_tuning) kv_len_ += a.prompt.num_virtual_tokens;
  }
  if (M_ / t_.micro_batch > t_.seq_len) kv_len_ = M_ / t_.micro_batch;
  // FSDP1's units as accelerate wraps a PEFT model: the root, each decoder layer, and (PEFT's
  // fsdp_auto_wrap_policy, peft/utils/other.py: a leaf module whose weight trains) each adapter
  // Linear; each runs its hooks in forward and backward, and again in a checkpointed layer's
  // recompute.
  f_.fsdp_unit_passes = 0;
  if (fsdp() && s_.fsdp.version == 1) {
    f_.fsdp_unit_passes = 2;  // the root
    for (std::int64_t l = 0; l < m_.layers; ++l) f_.fsdp_unit_passes += checkpointed(l) ? 3 : 2;
    for (const auto& t : inv_->trainables) f_.fsdp_unit_passes += t.layer >= 0 && checkpointed(t.layer) ? 3 : 2;
  }
}

void Builder::layout_facts() {
  const bool exec = in_.profile == RuntimeProfile::executor;
  switch (t_.precision) {
    case Precision::fp32: f_.compute_dtype = DType::fp32; break;
    case Precision::fp16_mixed: f_.compute_dtype = DType::fp16; break;
    case Precision::bf16_mixed:
    case Precision::bf16_pure: f_.compute_dtype = DType::bf16; break;
  }
  // The executor stores its activations in fp32, or in bf16 under bf16 mixed precision (fp32
  // masters; fp16's loss scaling and pure bf16's bf16 moments it does not run: executor_limitation).
  if (exec && t_.precision != Precision::bf16_mixed) f_.compute_dtype = DType::fp32;
  const bool mixed = t_.precision == Precision::fp16_mixed || t_.precision == Precision::bf16_mixed;
  const bool peft = !in_.peft.adapters.empty();
  f_.trainable_dtype = peft && rules_.adapter_dtype ? *rules_.adapter_dtype : f_.compute_dtype;
  f_.master_weights = rules_.fp32_master_for_mixed && mixed && f_.trainable_dtype != DType::fp32;
  const auto& q = in_.peft.quantization;
  // Under FSDP, TRL sees a sharded QLoRA model and skips prepare_model_for_kbit_training
  // (trl 0.13.0 sft_trainer.py is_sharded_qlora): the norms stay in the compute dtype.
  lay_.fp32_norms = rules_.fp32_norms_on_kbit && q && bits_of(q->dtype) <= 8 && !fsdp();
  // Under autocast the adapter's GEMMs run in the compute dtype; without it, in its own dtype.
  lay_.adapter_act_dtype = mixed ? f_.compute_dtype : f_.trainable_dtype;
  f_.base_dtype = t_.base_storage.value_or(in_.peft.quantization ? in_.peft.quantization->dtype : f_.compute_dtype);
}

void Builder::plan_linears() {
  lay_.inventory = in_.inventory ? in_.inventory : std::make_shared<const ModelInventory>(make_inventory(m_, in_.peft));
  const ModelInventory& inv = *lay_.inventory;
  inv_ = &inv;
  tensors_ = &inv.tensors;
  const auto& tensors = inv.tensors;
  const auto& linears = inv.linears;
  const bool full = in_.peft.adapters.empty();
  const auto& trainables = inv.trainables;
  // Keyed by the inventory's own path strings (the inventory outlives this function).
  std::unordered_map<std::string_view, Adapter> adapters;
  std::unordered_set<std::string_view> trained_modules;  // modules_to_save, bias=all: base tensors that train
  if (!full) {
    for (const auto& lm : inv.loras) {
      Adapter& a = adapters[lm.linear.path];
      a.r += lm.r;  // several adapters on one module: their ranks add up
      a.dropout = std::max(a.dropout, lm.dropout);
      if (a.scale == 0.0) a.scale = lm.scale;  // (the first adapter's; the executor runs one)
    }
    std::int32_t lora_modules = 0;
    for (const auto& t : trainables) {
      if (t.name.find(".lora_A") != std::string::npos || t.name.find(".lora_B") != std::string::npos) {
        Adapter& a = adapters[t.module];
        a.params += t.numel();
        if (a.index < 0 && t.name.find(".lora_A") != std::string::npos) a.index = lora_modules++;
      } else if (t.name.find(".ia3_l") != std::string::npos) {
        Adapter& a = adapters[t.module];
        a.params += t.numel();
      } else {
        lay_.extra_trainable_numel += t.numel();
        if (!t.is_base_param && t.module != "prompt_encoder") trained_modules.insert(t.module);
      }
      lay_.trainable_numel += t.numel();
    }
  }
  lay_.layer_linears.assign(static_cast<std::size_t>(m_.layers), {});
  for (const auto& lm : linears) {
    LinearPlan lp;
    lp.mod = &lm;
    lp.role = role_of(lm);
    lp.trainable_weight = full || trained_modules.count(lm.path) > 0;
    lp.input_dtype = lp.role == Role::attn_out || lm.layer < 0 ? f_.compute_dtype : stream_dtype();
    if (auto it = adapters.find(lm.path); it != adapters.end()) {
      lp.adapter = it->second;
      // PEFT's branch saves a tensor of its own when it casts the input to the adapter's dtype
      // or drops it out; otherwise its GEMM saves the module's input itself.
      const DType x_dtype = lp.input_dtype;
      lp.adapter_owns_input = rules_.adapter_owns_input && (lp.adapter->dropout > 0.0 || x_dtype != lay_.adapter_act_dtype);
    }
    if (lm.expert >= 0) lp.token_share = static_cast<double>(m_.experts_per_token) / static_cast<double>(m_.experts);
    if (lm.layer >= 0) lay_.layer_linears[static_cast<std::size_t>(lm.layer)].push_back(lp);
    else lay_.head_linears.push_back(lp);
  }
  auto by_path = std::make_shared<std::unordered_map<std::string_view, LinearRef>>();
  for (std::size_t l = 0; l < lay_.layer_linears.size(); ++l)
    for (std::size_t i = 0; i < lay_.layer_linears[l].size(); ++i)
      (*by_path)[lay_.layer_linears[l][i].mod->path] = {static_cast<std::int32_t>(l), static_cast<std::int32_t>(i)};
  for (std::size_t i = 0; i < lay_.head_linears.size(); ++i) (*by_path)[lay_.head_linears[i].mod->path] = {-1, static_cast<std::int32_t>(i)};
  lay_.by_path = std::move(by_path);
  // Units for ZeRO-3 (and for the sizes every strategy reports).
  lay_.units.assign(static_cast<std::size_t>(m_.layers) + 2, Unit{});
  lay_.units[0].name = "embedding";
  for (std::int64_t l = 0; l < m_.layers; ++l) lay_.units[static_cast<std::size_t>(l) + 1].name = name_cat("layers.", l);
  lay_.units.back().name = "head";
  const auto& q = in_.peft.quantization;
  for (const auto& t : tensors) {
    std::size_t u = t.layer >= 0 ? static_cast<std::size_t>(t.layer) + 1
                    : (t.role == models::ParamRole::embedding || t.role == models::ParamRole::position_embedding)
                        ? 0
                        : lay_.units.size() - 1;
    const bool trains = full || trained_modules.count(t.module) > 0;
    f_.base_params += trains && full ? 0 : t.numel();
    if (trains && full) {
      lay_.units[u].trainable_numel += t.numel();
      if (fsdp2()) lay_.units[u].fsdp2_trainable_shard_numel += dim0_rows_shard(t);
      continue;
    }
    std::uint64_t bytes = frozen(t);
    f_.base_bytes += bytes;
    const bool persistent = zero3() && !fsdp() && t.numel() < s_.ds.stage3_param_persistence_threshold;
    // FSDP flattens the packed 4-bit weight (bnb_4bit_quant_storage relabels its n/2 bytes) but
    // not its QuantState, which every rank keeps whole (bitsandbytes 0.43.3 nn/modules.py
    // Linear4bit.forward re-attaches it: "the quant state got lost when the parameter got
    // converted. This happens for example for fsdp").
    if (fsdp() && q && t.role == models::ParamRole::linear_weight && bits_of(q->dtype) < 8) {
      const std::uint64_t packed = storage_bytes(q->dtype, t.numel());
      lay_.units[u].persistent_bytes += bytes - packed;
      bytes = packed;
    }
    if (exec_z3())
      (persistent ? lay_.units[u].persistent_tensors : lay_.units[u].gathered_tensors)
          .push_back({&t, persistent ? lay_.units[u].persistent_bytes : lay_.units[u].frozen_bytes, bytes});
    if (persistent) {
      lay_.units[u].persistent_numel += t.numel();
      lay_.units[u].persistent_bytes += bytes;
    } else {
      lay_.units[u].frozen_numel += t.numel();
      lay_.units[u].frozen_bytes += bytes;
      if (fsdp2()) {  // a packed 4-bit weight is a [n / 4, 1] tensor of bf16 storage elements
        const bool packed = bytes != frozen(t) || (q && t.role == models::ParamRole::linear_weight && bits_of(q->dtype) < 8);
        const std::uint64_t rows = packed ? std::max<std::uint64_t>(1, bytes / 2) : static_cast<std::uint64_t>(t.shape.empty() ? 1 : t.shape[0]);
        lay_.units[u].fsdp2_frozen_shard_bytes += ceil_div(rows, static_cast<std::uint64_t>(group())) * (bytes / rows);
      }
    }
  }
  auto dim0_shard = [&](std::int64_t rows, std::int64_t numel) {  // FSDP2: ceil(d0 / N) rows
    if (rows <= 0) return shard(numel);
    return shard(rows) * (numel / rows);
  };
  if (full) {
    for (const auto& t : tensors) lay_.trainable_numel += t.numel();
  } else {
    for (const auto& [path, a] : adapters) {
      const LinearPlan* lp = linear_at(path);
      PEFTPLAN_CHECK_MSG(lp != nullptr, "adapter on {}, a module the inventory does not list", path);
      Unit& un = lay_.units[lp->mod->layer >= 0 ? static_cast<std::size_t>(lp->mod->layer) + 1 : lay_.units.size() - 1];
      un.trainable_numel += a.params;
      // lora_A [r, in] and lora_B [out, r]; IA3's vector [out] (or [in]) as one tensor.
      if (fsdp2())
        un.fsdp2_trainable_shard_numel += a.r > 0 && a.params == a.r * (lp->mod->in + lp->mod->out)
                                              ? dim0_shard(a.r, a.r * lp->mod->in) + dim0_shard(lp->mod->out, lp->mod->out * a.r)
                                              : shard(a.params);
    }
    lay_.units[0].trainable_numel += lay_.extra_trainable_numel;  // prompt embeddings, biases, copies
    if (fsdp2()) lay_.units[0].fsdp2_trainable_shard_numel += shard(lay_.extra_trainable_numel);
  }
  f_.trainable_params = lay_.trainable_numel;
  for (const auto& u : lay_.units) f_.largest_layer_params = std::max(f_.largest_layer_params, u.frozen_numel + u.trainable_numel);
}

// Adapter weights are views into trainable.flat, laid out in the order of the trainable
// inventory (models::trainable_tensors: per module lora_A then lora_B); their gradients are views
// at the same offsets in grad.flat. Under ZeRO-3 they live in the gathered unit instead (-1).
// Every strategy records each adapter tensor's flat offset and each unit's first element, which
// place gradient buckets (DDP views of grad.flat, ZeRO-2/3 bucket buffers).
void Builder::adapter_offsets() {
  if (in_.peft.adapters.empty()) return;
  std::int64_t offset = 0;
  std::vector<std::int64_t> unit_lo(lay_.units.size(), -1), unit_seen(lay_.units.size(), 0);
  bool contiguous = lay_.extra_trainable_numel == 0;
  std::int32_t index = -1;
  for (const auto& t : inv_->trainables) {
    ++index;
    const std::int64_t numel = t.numel();
    const bool is_a = t.name.find(".lora_A") != std::string::npos, is_b = t.name.find(".lora_B") != std::string::npos;
    LinearPlan* lp = is_a || is_b ? linear_at(t.module) : nullptr;
    if (lp && lp->adapter) {
      Adapter& a = *lp->adapter;
      const std::size_t u = lp->mod->layer >= 0 ? static_cast<std::size_t>(lp->mod->layer) + 1 : lay_.units.size() - 1;
      if (unit_lo[u] < 0) unit_lo[u] = offset;
      else if (unit_lo[u] + unit_seen[u] != offset) contiguous = false;
      unit_seen[u] += numel;
      std::int64_t& off = is_a ? a.a_off : a.b_off;
      if (off < 0) {  // several adapters on one module: the first one's tensors
        off = offset;
        (is_a ? a.a_numel : a.b_numel) = numel;
        (is_a ? a.a_tensor : a.b_tensor) = index;
      } else {
        contiguous = false;
      }
    } else {
      contiguous = false;
    }
    offset += numel;
  }
  for (std::size_t u = 0; u < lay_.units.size(); ++u)
    if (contiguous && unit_seen[u] == lay_.units[u].trainable_numel) lay_.units[u].flat_offset = unit_lo[u];
}

// The views of each adapter tensor (the first adapter's, on a module with several) in
// trainable.flat and grad.flat, in the trainable inventory's order, at the layout's offsets.
void Builder::adapter_views() {
  if (in_.peft.adapters.empty() || zero3() || trainable_flat_ < 0) return;
  const std::uint64_t tw = bytes_of(f_.trainable_dtype);
  std::int32_t index = -1;
  for (const auto& t : inv_->trainables) {
    ++index;
    const bool is_a = t.name.find(".lora_A") != std::string::npos, is_b = t.name.find(".lora_B") != std::string::npos;
    LinearPlan* lp = is_a || is_b ? linear_at(t.module) : nullptr;
    if (!lp || !lp->adapter || (is_a ? lp->adapter->a_tensor : lp->adapter->b_tensor) != index) continue;
    Adapter& a = *lp->adapter;
    const std::int64_t offset = is_a ? a.a_off : a.b_off;
    const std::uint64_t bytes = tw * static_cast<std::uint64_t>(t.numel());
    (is_a ? a.a_buf : a.b_buf) = role(p_.add_view(names_ ? t.name : std::string(), trainable_flat_, tw * static_cast<std::uint64_t>(flat_position(offset)), bytes),
                                      sim::BufferRole::adapter_tensor, index);
    if (grad_flat_ >= 0)
      (is_a ? a.ga_buf : a.gb_buf) = role(p_.add_view(names_ ? "grad." + t.name : std::string(), grad_flat_, tw * static_cast<std::uint64_t>(offset), bytes),
                                          sim::BufferRole::adapter_grad, index);
  }
}

// ZeRO-2/3 buckets, in the order backward completes units (head, layers L-1 … 0, embedding): a
// bucket closes when it reaches reduce_bucket_size elements, and at the embedding.
void Builder::plan_buckets() {
  lay_.bucket_of.assign(lay_.units.size(), -1);
  lay_.flush_of.assign(lay_.units.size(), -1);
  if (!sharded_grads() || s_.ranks == 1) return;
  std::vector<std::size_t> order = {lay_.units.size() - 1};
  for (std::size_t u = lay_.units.size() - 2; u >= 1; --u) order.push_back(u);
  order.push_back(0);
  if (fsdp()) {
    // FSDP reduce-scatters each unit in its post-backward hook; the root unit (the head and the
    // embedding) after the embedding's backward (_runtime_utils.py _post_backward_hook).
    GradBucket root;
    for (std::size_t u : order) {
      if (lay_.units[u].trainable_numel == 0) continue;
      if (root_unit(u)) {
        root.units.push_back(u);
        root.numel += lay_.units[u].trainable_numel;
        continue;
      }
      GradBucket b;
      b.units = {u};
      b.numel = lay_.units[u].trainable_numel;
      b.flush_unit = u;
      lay_.buckets.push_back(std::move(b));
    }
    if (root.numel > 0) {
      root.flush_unit = 0;
      lay_.buckets.push_back(std::move(root));
    }
    order.clear();
  }
  GradBucket cur;
  for (std::size_t u : order) {
    if (lay_.units[u].trainable_numel > 0) {
      cur.units.push_back(u);
      cur.numel += lay_.units[u].trainable_numel;
    }
    // The executor's ZeRO-3 reduce-scatters each unit on its own: its partition is per unit
    // (setup), which a bucket of several units would not deliver as one contiguous block.
    if (cur.numel > 0 && (cur.numel >= s_.ds.reduce_bucket_size || u == 0 || exec_z3())) {
      cur.flush_unit = u;
      lay_.buckets.push_back(std::move(cur));
      cur = GradBucket{};
    }
  }
  for (std::size_t b = 0; b < lay_.buckets.size(); ++b) {
    GradBucket& bk = lay_.buckets[b];
    for (std::size_t u : bk.units) lay_.bucket_of[u] = static_cast<std::int32_t>(b);
    lay_.flush_of[bk.flush_unit] = static_cast<std::int32_t>(b);
  }
  if (!exec_z2()) return;
  // The executor's ZeRO-2 layout (DeepSpeed's stage 1/2 partitions each bucket the same way):
  // trainable.flat holds every bucket's flat range padded to a multiple of N, one region per
  // bucket in flat order (the units' adapters are consecutive ranges of the flat layout, unit
  // by unit: the embedding, the layers, the head); rank r's partition is block r of every
  // region, bucket after bucket in backward order. Bucket b's reduce_scatter then delivers a
  // contiguous block of the partition (its grad.shard view), the optimizer steps each bucket's
  // block, and one in-place all_gather per region rebuilds the whole adapter.
  std::vector<std::int64_t> unit_lo(lay_.units.size(), 0);
  for (std::size_t u = 1; u < lay_.units.size(); ++u) unit_lo[u] = unit_lo[u - 1] + lay_.units[u - 1].trainable_numel;
  for (GradBucket& bk : lay_.buckets) {
    bk.part_offset = lay_.part_numel;
    lay_.part_numel += shard(bk.numel);
    bk.flat_lo = unit_lo[bk.units.back()];
  }
  std::int64_t region = 0;
  for (std::size_t b = lay_.buckets.size(); b-- > 0;) {
    lay_.buckets[b].region = region;
    region += shard(lay_.buckets[b].numel) * s_.ranks;
  }
}

// Where flat element x lives in trainable.flat: itself, or (executor ZeRO-2) in its bucket's
// region.
std::int64_t Builder::flat_position(std::int64_t x) const {
  if (!exec_z2()) return x;
  for (const GradBucket& bk : lay_.buckets)
    if (x >= bk.flat_lo && x < bk.flat_lo + bk.numel) return bk.region + (x - bk.flat_lo);
  PEFTPLAN_CHECK_MSG(false, "flat element {} is in no gradient bucket", x);
  return x;
}

// Each bucket's first flat element, once adapter_offsets knows the units' flat offsets.
void Builder::bucket_ranges() {
  for (std::size_t b = 0; b < lay_.buckets.size(); ++b) {
    GradBucket& bk = lay_.buckets[b];
    const std::int64_t lo = lay_.units[bk.units.back()].flat_offset;
    const std::size_t hi = bk.units.front();
    const std::int64_t want = bk.flat_lo;
    bk.flat_lo = -1;
    if (lo >= 0 && lay_.units[hi].flat_offset >= 0 && lay_.units[hi].flat_offset + lay_.units[hi].trainable_numel - lo == bk.numel) bk.flat_lo = lo;
    if (exec_z2()) PEFTPLAN_CHECK_MSG(bk.flat_lo == want, "the adapter's flat layout is not unit by unit (bucket {})", b);
  }
}

}  // namespace peftplan::planner::builder
