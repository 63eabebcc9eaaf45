// Base weights and adapters: initialisation, loading, saving (see model.h).
#include "peftplan/executor/model.h"

#include <cmath>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "peftplan/common/atomic_file.h"
#include "peftplan/common/error.h"
#include "peftplan/executor/kernels.h"

namespace peftplan::executor {
namespace {

inline std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
// Uniform in (0, 1]: never 0, so that log() below is finite.
inline double uniform01(std::uint64_t key, std::uint64_t i) {
  return (static_cast<double>(splitmix64(key ^ splitmix64(i)) >> 11) + 1.0) * 0x1p-53;
}

// The checkpoint tensor must exist and have exactly the inventory's shape.
const StTensorInfo& checked(const SafetensorsFile& f, const std::string& name, const std::vector<std::int64_t>& shape) {
  const StTensorInfo& t = f.at(name);
  if (t.shape != shape)
    throw InputError(fmt::format("{}: tensor {} has shape [{}], the model config needs [{}]", f.path().string(), name,
                                 fmt::join(t.shape, ","), fmt::join(shape, ",")));
  return t;
}

}  // namespace

std::uint64_t tensor_key(std::uint64_t seed, std::string_view name) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a over the name, then mixed with the seed
  for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return splitmix64(h ^ splitmix64(seed));
}

void fill_normal(std::span<float> out, double mean, double stddev, std::uint64_t key) {
  const auto n = static_cast<std::int64_t>(out.size());
#pragma omp parallel for schedule(static) if (n >= (1 << 16))
  for (std::int64_t i = 0; i < n; ++i) {
    // Box-Muller on two independent uniforms of element i.
    const double u1 = uniform01(key, 2 * static_cast<std::uint64_t>(i));
    const double u2 = uniform01(key, 2 * static_cast<std::uint64_t>(i) + 1);
    out[static_cast<std::size_t>(i)] =
        static_cast<float>(mean + stddev * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
  }
}

void fill_uniform(std::span<float> out, double lo, double hi, std::uint64_t key) {
  const auto n = static_cast<std::int64_t>(out.size());
#pragma omp parallel for schedule(static) if (n >= (1 << 16))
  for (std::int64_t i = 0; i < n; ++i)
    out[static_cast<std::size_t>(i)] = static_cast<float>(lo + (hi - lo) * (1.0 - uniform01(key, static_cast<std::uint64_t>(i))));
}

void init_base_tensor(const models::TensorInfo& t, DType storage, std::span<std::byte> dst, std::uint64_t seed,
                      const SafetensorsFile* checkpoint) {
  const auto n = static_cast<std::size_t>(t.numel());
  PEFTPLAN_CHECK_MSG(storage == DType::fp32 || storage == DType::bf16, "base storage {} for {}", name_of(storage), t.name);
  PEFTPLAN_CHECK_MSG(dst.size() == n * bytes_of(storage), "buffer of {} is {} bytes, {} elements of {} need {}", t.name,
                     dst.size(), n, name_of(storage), n * bytes_of(storage));
  if (checkpoint != nullptr) {
    checked(*checkpoint, t.name, t.shape);
    if (storage == DType::fp32)
      checkpoint->read_f32(t.name, {reinterpret_cast<float*>(dst.data()), n});
    else
      checkpoint->read_bf16(t.name, {reinterpret_cast<std::uint16_t*>(dst.data()), n});
    return;
  }
  std::vector<float> tmp;
  std::span<float> out;
  if (storage == DType::fp32) {
    out = {reinterpret_cast<float*>(dst.data()), n};
  } else {
    tmp.resize(n);
    out = tmp;
  }
  // transformers LlamaPreTrainedModel._init_weights: Linear and Embedding ~ normal(0,
  // initializer_range), biases zero; LlamaRMSNorm weights start at one.
  switch (t.role) {
    case models::ParamRole::norm_weight: std::fill(out.begin(), out.end(), 1.0f); break;
    case models::ParamRole::linear_bias:
    case models::ParamRole::norm_bias: std::fill(out.begin(), out.end(), 0.0f); break;
    default: fill_normal(out, 0.0, 0.02, tensor_key(seed, t.name)); break;
  }
  if (storage == DType::bf16)
    cpu::fp32_to_bf16(tmp.data(), reinterpret_cast<std::uint16_t*>(dst.data()), static_cast<cpu::Index>(n));
}

void init_adapter_tensor(const models::TrainableTensor& t, std::span<float> dst, std::uint64_t seed,
                         const SafetensorsFile* adapter) {
  PEFTPLAN_CHECK(static_cast<std::int64_t>(dst.size()) == t.numel());
  if (adapter != nullptr) {
    checked(*adapter, t.name, t.shape);
    adapter->read_f32(t.name, dst);
    return;
  }
  if (t.name.find(".lora_A") != std::string::npos) {
    // kaiming_uniform_(a=√5): gain √(2/(1+a²)) = √(1/3), bound = gain·√(3/fan_in) = 1/√fan_in.
    const double bound = 1.0 / std::sqrt(static_cast<double>(t.shape.at(1)));
    fill_uniform(dst, -bound, bound, tensor_key(seed, t.name));
  } else {
    std::fill(dst.begin(), dst.end(), 0.0f);
  }
}

void save_adapter(const std::filesystem::path& dir, const models::AdapterSpec& adapter, const std::string& base_model,
                  std::span<const AdapterTensor> tensors) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw InputError(fmt::format("{}: cannot create the adapter directory: {}", dir.string(), ec.message()));
  std::vector<StTensorView> views;
  for (const AdapterTensor& t : tensors)
    views.push_back({t.info->name, StDtype::F32, t.info->shape, std::as_bytes(t.values)});
  write_safetensors(dir / "adapter_model.safetensors", views, {{"format", "pt"}});
  const std::filesystem::path cfg = dir / "adapter_config.json";
  write_text_atomic(cfg, models::lora_adapter_config(adapter, base_model).dump(2) + "\n");  // nlohmann sorts keys
}

}  // namespace peftplan::executor
