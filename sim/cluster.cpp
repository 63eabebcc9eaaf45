// Cluster catalogs, the compact-spelling parser and JSON cluster files (see cluster.h).
// Catalog values are datasheet figures; each row cites where it comes from. Dense tensor-core
// figures are used throughout: NVIDIA datasheets print the 2:4-sparse figure (2x dense).
#include "peftplan/sim/cluster.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <fstream>
#include <map>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "peftplan/common/atomic_file.h"
#include "peftplan/common/error.h"
#include "peftplan/common/json_fields.h"
#include "peftplan/common/json_file.h"
#include "peftplan/common/units.h"
#include "peftplan/sim/compute.h"
#include "peftplan/sim/program.h"

#ifndef PEFTPLAN_CLUSTERS_DIR
#define PEFTPLAN_CLUSTERS_DIR "sim/clusters"
#endif

namespace peftplan::sim {

static_assert(kCollectiveSlots == static_cast<std::size_t>(kNumCollectives), "HostCalibration has one slot per collective kind");

std::string_view name_of(CollectivePlace p) { return p == CollectivePlace::compute ? "compute" : "optimizer"; }
namespace {

constexpr double kTera = 1e12;
constexpr double kGiga = 1e9;
constexpr double kMicro = 1e-6;
constexpr std::uint64_t GiB(std::uint64_t n) { return n << 30; }

// Per-hop latencies of NCCL's ring algorithm with the Simple protocol (the one large
// messages use), NVIDIA/nccl src/graph/tuning.cc `hwLat` (NCCL 2.30): NVLink 3.4 us,
// PCI 5.7 us, NET 14.0 us.
constexpr double kNvlinkHopS = 3.4 * kMicro;
constexpr double kPciHopS = 5.7 * kMicro;
constexpr double kNetHopS = 14.0 * kMicro;

// Link catalog. Bandwidth per GPU (intra-node) or per port (network), one direction.
// Source: stas00/ml-engineering network/README.md ("Intra-node networking": NVLink 2/3/4/5 =
// 150/300/450/900 GB/s unidirectional per GPU; "Inter-node networking": InfiniBand
// EDR/HDR/NDR/XDR = 100/200/400/800 Gb/s per 4x port). PCIe x16: 8/16/32 GT/s per lane with
// 128b/130b encoding = 15.75/31.5/63 GB/s per direction (PCI-SIG base specifications 3.0/4.0/5.0).
// AMD MI300X: 7 XGMI peers x 64 GB/s = 448 GB/s per GPU (AMD Instinct MI300X data sheet).
// Ethernet and RoCE: line rate / 8.
const std::array<LinkSpec, 19> kLinks = {{
    {"NVLink2", LinkFamily::nvlink, 150 * kGiga, kNvlinkHopS},
    {"NVLink3", LinkFamily::nvlink, 300 * kGiga, kNvlinkHopS},
    {"NVLink4", LinkFamily::nvlink, 450 * kGiga, kNvlinkHopS},
    {"NVLink5", LinkFamily::nvlink, 900 * kGiga, kNvlinkHopS},
    {"PCIe3", LinkFamily::pcie, 15.75 * kGiga, kPciHopS},
    {"PCIe4", LinkFamily::pcie, 31.5 * kGiga, kPciHopS},
    {"PCIe5", LinkFamily::pcie, 63.0 * kGiga, kPciHopS},
    // RCCL inherits NCCL's tuning model; we use the NVLink hop latency for XGMI.
    {"XGMI", LinkFamily::xgmi, 448 * kGiga, kNvlinkHopS},
    {"IB-EDR", LinkFamily::infiniband, 12.5 * kGiga, kNetHopS},
    {"IB-HDR", LinkFamily::infiniband, 25.0 * kGiga, kNetHopS},
    {"IB-NDR", LinkFamily::infiniband, 50.0 * kGiga, kNetHopS},
    {"IB-XDR", LinkFamily::infiniband, 100.0 * kGiga, kNetHopS},
    {"RoCE-100", LinkFamily::roce, 12.5 * kGiga, kNetHopS},
    {"RoCE-200", LinkFamily::roce, 25.0 * kGiga, kNetHopS},
    {"RoCE-400", LinkFamily::roce, 50.0 * kGiga, kNetHopS},
    {"10GbE", LinkFamily::ethernet, 1.25 * kGiga, kNetHopS},
    {"25GbE", LinkFamily::ethernet, 3.125 * kGiga, kNetHopS},
    {"100GbE", LinkFamily::ethernet, 12.5 * kGiga, kNetHopS},
    {"400GbE", LinkFamily::ethernet, 50.0 * kGiga, kNetHopS},
}};

// GPU catalog. Memory: the vendor's "GB" label read as GiB (HBM stacks are binary-sized; the
// runtime reports a little less, which the planner's runtime_overhead category carries).
// matmul_efficiency: measured max achievable matmul FLOPs / dense peak, stas00/ml-engineering
// compute/accelerator/README.md "Maximum Achievable Matmul FLOPS comparison table"
// (A100 SXM 267.9/312 = 85.9%, H100 SXM 792.1/989 = 80.1%, MI300X 781.9/1300 = 60.1%).
// Price per GPU-hour (the recommender's --objective cost; a cluster file's gpu.cost_per_hour_USD
// overrides it): RunPod's on-demand list prices, March 2026, as tabulated by deploybase.ai
// ("RunPod GPU Pricing: 2026 Comprehensive Pricing Guide", 2026-03-10): A100 SXM 80GB $2.45,
// H100 SXM $4.76, H100 PCIe $3.51, H200 $6.35, B200 $10.57, L40S $1.40, L4 $0.78, RTX 4090
// $0.60. One provider's list for every row, so that rows compare; A100-40GB, A10G, V100 and
// MI300X are not in it and have no price.
// Compute capability: NVIDIA's CUDA GPUs list (developer.nvidia.com/cuda-gpus): A100 8.0, A10G
// (A10) 8.6, L4 / L40S / RTX 4090 8.9, H100 / H200 9.0, B200 10.0, V100 7.0.
const std::array<GpuSpec, 12> kGpus = {{
    // NVIDIA A100 Tensor Core GPU datasheet (2021): 40 GB HBM2 1,555 GB/s; BF16/FP16 312
    // TFLOPS dense (624 sparse), TF32 156, FP32 19.5; NVLink 600 GB/s bidirectional; PCIe Gen4.
    {"A100-40GB", GiB(40), 1555 * kGiga, 312 * kTera, 312 * kTera, 156 * kTera, 19.5 * kTera,
     "NVLink3", "PCIe4", 0.859, std::nullopt, 80},
    // Same datasheet, 80 GB SXM: HBM2e 2,039 GB/s.
    {"A100-80GB", GiB(80), 2039 * kGiga, 312 * kTera, 312 * kTera, 156 * kTera, 19.5 * kTera,
     "NVLink3", "PCIe4", 0.859, 2.45, 80},
    // NVIDIA H100 Tensor Core GPU datasheet, SXM5: 80 GB HBM3 3.35 TB/s; BF16/FP16 1,979
    // TFLOPS sparse = 989 dense; TF32 494.5 dense; FP32 67 (66.9); NVLink 900 GB/s; PCIe Gen5.
    {"H100-SXM", GiB(80), 3350 * kGiga, 989 * kTera, 989 * kTera, 494.5 * kTera, 66.9 * kTera,
     "NVLink4", "PCIe5", 0.801, 4.76, 90},
    // Same datasheet, PCIe: 80 GB 2.0 TB/s; BF16/FP16 1,513 sparse = 756 dense; TF32 378; FP32
    // 51. Its NVLink bridge pairs only two GPUs, so the natural link in a node is PCIe Gen5.
    {"H100-PCIe", GiB(80), 2000 * kGiga, 756 * kTera, 756 * kTera, 378 * kTera, 51 * kTera,
     "PCIe5", "PCIe5", std::nullopt, 3.51, 90},
    // NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e 4.8 TB/s; compute as H100 SXM.
    {"H200", GiB(141), 4800 * kGiga, 989 * kTera, 989 * kTera, 494.5 * kTera, 67 * kTera,
     "NVLink4", "PCIe5", std::nullopt, 6.35, 90},
    // NVIDIA DGX B200 datasheet (8 GPUs: 1,440 GB, 64 TB/s HBM3e, 72 PFLOPS FP8 sparse) per GPU:
    // 180 GB, 8 TB/s, BF16 4.5 PFLOPS sparse = 2,250 dense, TF32 1,125 dense, FP32 80; NVLink 5.
    {"B200", GiB(180), 8000 * kGiga, 2250 * kTera, 2250 * kTera, 1125 * kTera, 80 * kTera,
     "NVLink5", "PCIe5", std::nullopt, 10.57, 100},
    // NVIDIA L40S datasheet: 48 GB GDDR6 864 GB/s; BF16/FP16 733 sparse = 362 dense (362.05);
    // TF32 183 dense; FP32 91.6; no NVLink; PCIe Gen4 x16.
    {"L40S", GiB(48), 864 * kGiga, 362 * kTera, 362 * kTera, 183 * kTera, 91.6 * kTera, "PCIe4",
     "PCIe4", std::nullopt, 1.40, 89},
    // NVIDIA L4 datasheet: 24 GB GDDR6 300 GB/s; BF16/FP16 242 sparse = 121 dense; TF32 60
    // dense; FP32 30.3; PCIe Gen4 x16.
    {"L4", GiB(24), 300 * kGiga, 121 * kTera, 121 * kTera, 60 * kTera, 30.3 * kTera, "PCIe4",
     "PCIe4", std::nullopt, 0.78, 89},
    // A10G (AWS g5): NVIDIA publishes no datasheet. Memory 24 GB GDDR6 600 GB/s (AWS EC2 G5
    // instance page). Compute: NVIDIA A10 datasheet figures (BF16 250 sparse = 125 dense, TF32
    // 62.5, FP32 31.2), an upper bound: the A10G's tensor throughput is reported below the A10's.
    {"A10G", GiB(24), 600 * kGiga, 125 * kTera, 125 * kTera, 62.5 * kTera, 31.2 * kTera, "PCIe4",
     "PCIe4", std::nullopt, std::nullopt, 86},
    // NVIDIA Ada Lovelace architecture whitepaper (v2.1), GeForce RTX 4090: 24 GB GDDR6X
    // 1,008 GB/s; FP16/BF16 tensor with FP32 accumulate 165.2 dense (330.3 with FP16
    // accumulate; frameworks accumulate in FP32); TF32 82.6; FP32 82.6; PCIe Gen4; no NVLink.
    {"RTX4090", GiB(24), 1008 * kGiga, 165.2 * kTera, 165.2 * kTera, 82.6 * kTera, 82.6 * kTera,
     "PCIe4", "PCIe4", std::nullopt, 0.60, 89},
    // NVIDIA V100 Tensor Core GPU datasheet, SXM2 32 GB: HBM2 900 GB/s; FP16 tensor 125; FP32
    // 15.7; no BF16 or TF32 tensor cores; NVLink 300 GB/s bidirectional (NVLink 2); PCIe Gen3.
    {"V100", GiB(32), 900 * kGiga, std::nullopt, 125 * kTera, 0.0, 15.7 * kTera, "NVLink2",
     "PCIe3", std::nullopt, std::nullopt, 70},
    // AMD Instinct MI300X data sheet: 192 GB HBM3 5.3 TB/s; BF16/FP16 1,307.4 dense (2,614.9
    // sparse); TF32 653.7; FP32 163.4; Infinity Fabric 7 x 64 GB/s; PCIe Gen5 x16.
    {"MI300X", GiB(192), 5300 * kGiga, 1307.4 * kTera, 1307.4 * kTera, 653.7 * kTera,
     163.4 * kTera, "XGMI", "PCIe5", 0.601, std::nullopt, 0},
}};

// Extra spellings (normalised: lower case, '-', '_', ' ' removed) for each catalog name.
struct Alias {
  std::string_view alias;
  std::string_view name;
};
constexpr std::array<Alias, 27> kGpuAliases = {{
    {"a100sxm40gb", "A100-40GB"}, {"a10040gbsxm", "A100-40GB"}, {"a100sxm440gb", "A100-40GB"},
    {"a100", "A100-80GB"},        {"a100sxm", "A100-80GB"},     {"a100sxm80gb", "A100-80GB"},
    {"a10080gbsxm", "A100-80GB"}, {"a100sxm480gb", "A100-80GB"}, {"h100", "H100-SXM"},
    {"h100sxm5", "H100-SXM"},     {"h10080gb", "H100-SXM"},     {"h100sxm80gb", "H100-SXM"},
    {"h200sxm", "H200"},          {"h200141gb", "H200"},        {"b200sxm", "B200"},
    {"4090", "RTX4090"},          {"geforcertx4090", "RTX4090"}, {"v100sxm2", "V100"},
    {"v10032gb", "V100"},         {"v100sxm232gb", "V100"},     {"instinctmi300x", "MI300X"},
    {"l40s48gb", "L40S"},         {"l424gb", "L4"},             {"a10g24gb", "A10G"},
    {"rtx409024gb", "RTX4090"},   {"h100pcie80gb", "H100-PCIe"}, {"b200180gb", "B200"},
}};
constexpr std::array<Alias, 26> kLinkAliases = {{
    {"pciegen3", "PCIe3"},       {"pciegen4", "PCIe4"},       {"pciegen5", "PCIe5"},
    {"infinityfabric", "XGMI"},  {"edr", "IB-EDR"},           {"infinibandedr", "IB-EDR"},
    {"hdr", "IB-HDR"},           {"infinibandhdr", "IB-HDR"}, {"hdr200", "IB-HDR"},
    {"ndr", "IB-NDR"},           {"infinibandndr", "IB-NDR"}, {"ndr400", "IB-NDR"},
    {"xdr", "IB-XDR"},           {"infinibandxdr", "IB-XDR"}, {"xdr800", "IB-XDR"},
    {"roce100g", "RoCE-100"},    {"roce200g", "RoCE-200"},    {"roce400g", "RoCE-400"},
    {"100groce", "RoCE-100"},    {"200groce", "RoCE-200"},    {"400groce", "RoCE-400"},
    {"10gethernet", "10GbE"},    {"25gethernet", "25GbE"},    {"100gethernet", "100GbE"},
    {"400gethernet", "400GbE"},  {"edr100", "IB-EDR"},
}};

std::string normalise(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char ch : s) {
    if (ch == '-' || ch == '_' || ch == ' ' || ch == '\t') continue;
    out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(ch))));
  }
  return out;
}

const LinkSpec* link_by_normalised(std::string_view n) {
  for (const LinkSpec& l : kLinks)
    if (normalise(l.name) == n) return &l;
  for (const Alias& a : kLinkAliases)
    if (a.alias == n)
      for (const LinkSpec& l : kLinks)
        if (l.name == a.name) return &l;
  return nullptr;
}

const GpuSpec* gpu_by_normalised(std::string_view n) {
  for (const GpuSpec& g : kGpus)
    if (normalise(g.name) == n) return &g;
  for (const Alias& a : kGpuAliases)
    if (a.alias == n)
      for (const GpuSpec& g : kGpus)
        if (g.name == a.name) return &g;
  return nullptr;
}

std::string gpu_names() {
  std::string out;
  for (const GpuSpec& g : kGpus) out += (out.empty() ? "" : ", ") + g.name;
  return out;
}
std::string link_names() {
  std::string out;
  for (const LinkSpec& l : kLinks) out += (out.empty() ? "" : ", ") + l.name;
  return out;
}

LinkSpec link_or_throw(std::string_view name, std::string_view where, std::string_view field) {
  if (auto l = find_link(name)) return *l;
  throw input_error(where, field, fmt::format("must name a known link ({})", link_names()),
                    fmt::format("\"{}\"", name));
}

// Default host figures for a node of `gpus_per_node` GPUs. These are assumptions, not
// measurements; `peftplan calibrate` replaces them with measured values.
//  - host RAM: twice the node's GPU memory, about what DGX systems ship (DGX A100 640GB and
//    DGX H100 datasheets: 2 TB system memory for 640 GB of GPU memory);
//  - host memory bandwidth: 200 GB/s per node, i.e. two sockets of 8 DDR4-3200 channels
//    (25.6 GB/s each, JEDEC) at about half of peak, shared by the node's ranks;
//  - CPU Adam: 2e9 parameters/s per node shared by its ranks. ZeRO-Offload (Ren et al.,
//    arXiv 2101.06840, Sec. 4.3 and 6) reports its vectorised CPU-Adam several times faster
//    than PyTorch's CPU Adam, updating billions of parameters per second on a DGX-2 host.
constexpr double kHostMemoryBytesPerSPerNode = 200 * kGiga;
constexpr double kCpuAdamParamsPerSPerNode = 2e9;

void check_counts(std::int64_t nodes, std::int64_t gpus_per_node, std::string_view where) {
  if (nodes < 1 || nodes > 100000)
    throw input_error(where, "nodes", "must be an integer in [1, 100,000]", std::to_string(nodes));
  if (gpus_per_node < 1)
    throw input_error(where, "gpus_per_node", "must be a positive integer",
                      std::to_string(gpus_per_node));
  if (gpus_per_node > 1024)
    throw input_error(where, "gpus_per_node", "must be at most 1024",
                      std::to_string(gpus_per_node));
}

}  // namespace

std::string_view name_of(LinkFamily f) {
  constexpr std::array<std::string_view, 6> names = {"nvlink", "pcie",     "xgmi",
                                                     "infiniband", "roce", "ethernet"};
  static_assert(static_cast<std::size_t>(LinkFamily::ethernet) + 1 == names.size() && names[static_cast<std::size_t>(LinkFamily::roce)] == "roce",
                "one name per LinkFamily, in its order");
  return names[static_cast<std::size_t>(f)];
}

double peak_flops_per_s(const GpuSpec& gpu, DType compute, bool allow_tf32) {
  switch (compute) {
    case DType::bf16: return gpu.bf16_flops_per_s.value_or(gpu.fp32_flops_per_s);
    case DType::fp16: return gpu.fp16_flops_per_s;
    case DType::fp32:
      return allow_tf32 && gpu.tf32_flops_per_s > 0 ? gpu.tf32_flops_per_s : gpu.fp32_flops_per_s;
    default: return gpu.fp32_flops_per_s;  // quantised storage computes in a float type
  }
}

double inter_node_bytes_per_s_per_gpu(const Cluster& c) {
  if (!c.inter_node_link || c.nodes <= 1) return 0.0;
  return c.inter_node_link->bandwidth_bytes_per_s * c.nics_per_node / c.gpus_per_node;
}

std::span<const GpuSpec> gpu_catalog() { return kGpus; }
std::span<const LinkSpec> link_catalog() { return kLinks; }

std::optional<GpuSpec> find_gpu(std::string_view name) {
  if (const GpuSpec* g = gpu_by_normalised(normalise(name))) return *g;
  return std::nullopt;
}
std::optional<LinkSpec> find_link(std::string_view name) {
  if (const LinkSpec* l = link_by_normalised(normalise(name))) return *l;
  return std::nullopt;
}

Cluster make_cluster(const GpuSpec& gpu, std::int32_t nodes, std::int32_t gpus_per_node,
                     std::optional<LinkSpec> network) {
  PEFTPLAN_CHECK(nodes >= 1 && gpus_per_node >= 1);
  Cluster c;
  c.gpu = gpu;
  c.nodes = nodes;
  c.gpus_per_node = gpus_per_node;
  auto intra = find_link(gpu.intra_node_link);
  PEFTPLAN_CHECK_MSG(intra.has_value(), "GPU {} names unknown link {}", gpu.name,
                     gpu.intra_node_link);
  c.intra_node_link = *intra;
  c.inter_node_link = network;
  c.nics_per_node = network && network->family == LinkFamily::ethernet ? 1 : gpus_per_node;
  c.host_ram_bytes_per_node = 2 * gpu.memory_bytes * static_cast<std::uint64_t>(gpus_per_node);
  auto host = find_link(gpu.host_link);
  c.host_device_bytes_per_s = host ? host->bandwidth_bytes_per_s : 31.5 * kGiga;
  c.host_memory_bytes_per_s = kHostMemoryBytesPerSPerNode / gpus_per_node;
  c.cpu_adam_params_per_s = kCpuAdamParamsPerSPerNode / gpus_per_node;
  c.efficiency.gemm_max = gpu.matmul_efficiency.value_or(Efficiency{}.gemm_max);
  c.name = fmt::format("{}{}x{}{}", nodes > 1 ? fmt::format("{}x", nodes) : std::string{},
                       gpus_per_node, gpu.name, network ? "-" + network->name : std::string{});
  return c;
}

Cluster parse_cluster_spelling(std::string_view spelling) {
  const std::string where = fmt::format("cluster \"{}\"", spelling);
  const std::string valid =
      fmt::format("spell it [nodes x] gpus x GPU [-link]; GPUs: {}; links: {}", gpu_names(),
                  link_names());
  // normalise drops dashes, so "-1xA100-80GB" would read as one GPU: a sign is refused first.
  if (const auto first = spelling.find_first_not_of(" \t"); first != std::string_view::npos && (spelling[first] == '-' || spelling[first] == '+'))
    throw input_error(where, "", fmt::format("starts with a sign: counts are positive integers ({})", valid));
  std::string s = normalise(spelling);
  // Leading counts: "8x", "2x8x".
  std::vector<std::int64_t> counts;
  std::size_t pos = 0;
  while (pos < s.size() && std::isdigit(static_cast<unsigned char>(s[pos]))) {
    std::size_t end = pos;
    while (end < s.size() && std::isdigit(static_cast<unsigned char>(s[end]))) ++end;
    if (end >= s.size() || s[end] != 'x') break;  // digits of a GPU name
    // A count of more digits than any bound below holds (nodes 100,000, GPUs per node 1024): out
    // of range, not a GPU name (it read "names no known GPU").
    if (end - pos > 6)
      throw input_error(where, "", fmt::format("has a count of {} digits: at most 100,000 nodes of at most 1024 GPUs ({})", end - pos, valid));
    counts.push_back(std::stoll(s.substr(pos, end - pos)));
    pos = end + 1;
  }
  if (counts.size() > 2)
    throw input_error(where, "", fmt::format("has more than two counts ({})", valid));
  std::int64_t nodes = counts.size() == 2 ? counts[0] : 1;
  std::int64_t per_node = counts.empty() ? 1 : counts.back();
  check_counts(nodes, per_node, where);
  std::string rest = s.substr(pos);
  if (rest.empty()) throw input_error(where, "", fmt::format("names no GPU ({})", valid));

  // The longest GPU name that is a prefix and leaves either nothing or a link name.
  struct Candidate {
    std::string key;
    const GpuSpec* gpu;
  };
  std::vector<Candidate> candidates;
  for (const GpuSpec& g : kGpus) candidates.push_back({normalise(g.name), &g});
  for (const Alias& a : kGpuAliases) candidates.push_back({std::string(a.alias), gpu_by_normalised(a.alias)});
  std::sort(candidates.begin(), candidates.end(),
            [](const Candidate& a, const Candidate& b) { return a.key.size() > b.key.size(); });
  const GpuSpec* gpu = nullptr;
  std::string suffix;
  bool prefix_matched = false;
  for (const Candidate& c : candidates) {
    if (!rest.starts_with(c.key)) continue;
    prefix_matched = true;
    std::string tail = rest.substr(c.key.size());
    if (tail.empty() || tail == "nvlink" || tail == "pcie" || link_by_normalised(tail)) {
      gpu = c.gpu;
      suffix = tail;
      break;
    }
  }
  if (!gpu) {
    // The spelling as typed, without its leading counts ("2 x 8 x Foo-NDR" -> "Foo-NDR").
    std::size_t orig = 0;
    for (std::size_t n = 0; n < counts.size(); ++n) {
      while (orig < spelling.size() && !std::isdigit(static_cast<unsigned char>(spelling[orig]))) ++orig;
      while (orig < spelling.size() && std::isdigit(static_cast<unsigned char>(spelling[orig]))) ++orig;
      while (orig < spelling.size() && (spelling[orig] == ' ' || spelling[orig] == 'x' || spelling[orig] == 'X')) ++orig;
    }
    while (orig < spelling.size() && (spelling[orig] == ' ' || spelling[orig] == '-')) ++orig;
    std::string got = std::string(spelling.substr(orig));
    throw input_error(where, "",
                      fmt::format("{} ({})", prefix_matched ? "ends in an unknown link"
                                                            : "names no known GPU",
                                  valid),
                      fmt::format("\"{}\"", got));
  }

  std::optional<LinkSpec> link;
  if (suffix == "nvlink") {
    auto natural = find_link(gpu->intra_node_link);
    if (!natural || natural->family != LinkFamily::nvlink)
      throw input_error(where, "", fmt::format("asks for NVLink but {} has none", gpu->name));
    link = natural;
  } else if (suffix == "pcie") {
    link = find_link(gpu->host_link);
  } else if (!suffix.empty()) {
    link = *link_by_normalised(suffix);
  }

  Cluster c;
  if (link && is_network(link->family)) {
    c = make_cluster(*gpu, static_cast<std::int32_t>(nodes), static_cast<std::int32_t>(per_node),
                     link);
  } else {
    if (nodes > 1)
      throw input_error(where, "",
                        fmt::format("spans {} nodes but names no network between them (add one "
                                    "of the network links, e.g. \"{}x{}x{}-IB-NDR\"; {})",
                                    nodes, nodes, per_node, gpu->name, valid));
    c = make_cluster(*gpu, 1, static_cast<std::int32_t>(per_node));
    if (link) c.intra_node_link = *link;
  }
  c.name = std::string(spelling);
  return c;
}

// --- JSON ------------------------------------------------------------------------------------
namespace {

void check_keys(const nlohmann::json& j, std::string_view where, std::string_view object,
                std::initializer_list<std::string_view> allowed) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    if (k.starts_with("$") || k == "comment") continue;
    if (std::find(allowed.begin(), allowed.end(), k) != allowed.end()) continue;
    std::string list;
    for (auto a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
    throw input_error(where, fmt::format("{}{}", object, k),
                      fmt::format("is not a known key (valid: {})", list));
  }
}

// Cluster numbers are sizes and speeds: positive, or (allow_zero) non-negative; counts are
// positive integers (common/json_fields.h reads them).
double number(const nlohmann::json& j, std::string_view key, std::string_view where, std::string_view object,
              bool allow_zero = false) {
  return json_fields::required_number(j, key, where, object, allow_zero ? json_fields::Sign::non_negative : json_fields::Sign::positive);
}

// A size in GiB as bytes: positive and at most 2^20 GiB (1 PiB, far above any GPU's or node's
// memory), so that the bytes fit in 64 bits (a larger double would not convert).
std::uint64_t gib_bytes(const nlohmann::json& j, std::string_view key, std::string_view where, std::string_view object) {
  constexpr double kMaxGiB = 1 << 20;
  const double x = number(j, key, where, object);
  if (x > kMaxGiB)
    throw input_error(where, fmt::format("{}{}", object, key), fmt::format("must be a positive number of GiB up to {}", with_commas(1 << 20)),
                      j.at(std::string(key)).dump());
  return static_cast<std::uint64_t>(x * kGiB);
}

std::int64_t integer(const nlohmann::json& j, std::string_view key, std::string_view where, std::string_view object = {}) {
  return json_fields::required_integer(j, key, where, object, 1);
}

LinkSpec link_from_json(const nlohmann::json& v, std::string_view where, std::string_view field) {
  if (v.is_string()) return link_or_throw(v.get<std::string>(), where, field);
  if (!v.is_object())
    throw input_error(where, field, "must be a link name or an object", v.dump());
  std::string obj = fmt::format("{}.", field);
  check_keys(v, where, obj, {"name", "family", "GBps", "latency_us"});
  LinkSpec l;
  if (v.contains("name") && v["name"].is_string()) {
    l.name = v["name"].get<std::string>();
    if (auto known = find_link(l.name)) l = *known;
  } else {
    throw input_error(where, obj + "name", "must be a string");
  }
  if (v.contains("family")) {
    std::string f = v["family"].is_string() ? v["family"].get<std::string>() : v["family"].dump();
    bool ok = false;
    for (int i = 0; i < 6; ++i)
      if (name_of(static_cast<LinkFamily>(i)) == f) {
        l.family = static_cast<LinkFamily>(i);
        ok = true;
      }
    if (!ok)
      throw input_error(where, obj + "family",
                        "must be one of nvlink, pcie, xgmi, infiniband, roce, ethernet", f);
  }
  bool known = find_link(l.name).has_value();
  if (v.contains("GBps")) l.bandwidth_bytes_per_s = number(v, "GBps", where, obj) * kGiga;
  else if (!known) throw input_error(where, obj + "GBps", "is required for a link not in the catalog");
  if (v.contains("latency_us")) l.latency_s = number(v, "latency_us", where, obj, true) * kMicro;
  else if (!known) throw input_error(where, obj + "latency_us", "is required for a link not in the catalog");
  return l;
}

nlohmann::json link_to_json(const LinkSpec& l) {
  return {{"name", l.name},
          {"family", name_of(l.family)},
          {"GBps", l.bandwidth_bytes_per_s / kGiga},
          {"latency_us", l.latency_s / kMicro}};
}

GpuSpec gpu_from_json(const nlohmann::json& v, std::string_view where) {
  if (v.is_string()) {
    if (auto g = find_gpu(v.get<std::string>())) return *g;
    throw input_error(where, "gpu", fmt::format("must name a known GPU ({}) or be an object",
                                                gpu_names()),
                      v.dump());
  }
  if (!v.is_object()) throw input_error(where, "gpu", "must be a GPU name or an object", v.dump());
  check_keys(v, where, "gpu.",
             {"name", "memory_GiB", "hbm_GBps", "bf16_TFLOPs", "fp16_TFLOPs", "tf32_TFLOPs",
              "fp32_TFLOPs", "intra_node_link", "host_link", "matmul_efficiency",
              "cost_per_hour_USD"});
  if (!v.contains("name") || !v["name"].is_string())
    throw input_error(where, "gpu.name", "must be a string");
  GpuSpec g;
  g.name = v["name"].get<std::string>();
  auto base = find_gpu(g.name);
  if (base) g = *base, g.name = v["name"].get<std::string>();
  auto need = [&](std::string_view key) {
    if (!v.contains(std::string(key)) && !base)
      throw input_error(where, fmt::format("gpu.{}", key),
                        fmt::format("is required for a GPU not in the catalog ({})", gpu_names()));
    return v.contains(std::string(key));
  };
  if (need("memory_GiB"))
    g.memory_bytes = gib_bytes(v, "memory_GiB", where, "gpu.");
  if (need("hbm_GBps")) g.hbm_bytes_per_s = number(v, "hbm_GBps", where, "gpu.") * kGiga;
  if (need("fp32_TFLOPs")) g.fp32_flops_per_s = number(v, "fp32_TFLOPs", where, "gpu.") * kTera;
  if (v.contains("bf16_TFLOPs")) {
    if (v["bf16_TFLOPs"].is_null()) g.bf16_flops_per_s.reset();
    else g.bf16_flops_per_s = number(v, "bf16_TFLOPs", where, "gpu.") * kTera;
  }
  if (v.contains("fp16_TFLOPs")) g.fp16_flops_per_s = number(v, "fp16_TFLOPs", where, "gpu.") * kTera;
  else if (!base) g.fp16_flops_per_s = g.bf16_flops_per_s.value_or(g.fp32_flops_per_s);
  if (v.contains("tf32_TFLOPs")) g.tf32_flops_per_s = number(v, "tf32_TFLOPs", where, "gpu.", true) * kTera;
  if (need("intra_node_link")) {
    if (!v["intra_node_link"].is_string())
      throw input_error(where, "gpu.intra_node_link", "must be a link name", v["intra_node_link"].dump());
    g.intra_node_link = link_or_throw(v["intra_node_link"].get<std::string>(), where, "gpu.intra_node_link").name;
  }
  if (v.contains("host_link")) {
    if (!v["host_link"].is_string())
      throw input_error(where, "gpu.host_link", "must be a link name", v["host_link"].dump());
    g.host_link = link_or_throw(v["host_link"].get<std::string>(), where, "gpu.host_link").name;
  } else if (!base) {
    g.host_link = "PCIe4";
  }
  if (v.contains("matmul_efficiency")) {
    double e = number(v, "matmul_efficiency", where, "gpu.");
    if (e > 1.0) throw input_error(where, "gpu.matmul_efficiency", "must be in (0, 1]", v["matmul_efficiency"].dump());
    g.matmul_efficiency = e;
  }
  if (v.contains("cost_per_hour_USD") && !v["cost_per_hour_USD"].is_null())
    g.cost_per_hour_usd = number(v, "cost_per_hour_USD", where, "gpu.", true);
  return g;
}

}  // namespace

Cluster cluster_from_json(const nlohmann::json& j, std::string_view where) {
  if (!j.is_object()) throw input_error(where, "", "must hold a JSON object", j.type_name());
  check_keys(j, where, "",
             {"version", "name", "gpu", "nodes", "gpus_per_node", "intra_node_link",
              "inter_node_link", "nics_per_node", "host_ram_GiB", "host_device_GBps",
              "host_memory_GBps", "cpu_adam_Mparams_per_s", "efficiency",
              "shared_gemm_GFLOPs_per_rank", "host_calibration"});
  if (j.contains("version") && j["version"] != 1)
    throw input_error(where, "version", "must be 1", j["version"].dump());
  if (!j.contains("gpu")) throw input_error(where, "gpu", "is required (a GPU name or object)");
  if (!j.contains("gpus_per_node")) throw input_error(where, "gpus_per_node", "is required");
  GpuSpec gpu = gpu_from_json(j["gpu"], where);
  std::int64_t nodes = j.contains("nodes") ? integer(j, "nodes", where) : 1;
  std::int64_t per_node = integer(j, "gpus_per_node", where);
  check_counts(nodes, per_node, where);
  std::optional<LinkSpec> network;
  if (j.contains("inter_node_link") && !j["inter_node_link"].is_null()) {
    network = link_from_json(j["inter_node_link"], where, "inter_node_link");
    if (!is_network(network->family))
      throw input_error(where, "inter_node_link",
                        "must be a network link (InfiniBand, RoCE or Ethernet)", network->name);
  } else if (nodes > 1) {
    throw input_error(where, "inter_node_link", fmt::format("is required when nodes > 1 ({})", link_names()));
  }
  Cluster c = make_cluster(gpu, static_cast<std::int32_t>(nodes),
                           static_cast<std::int32_t>(per_node), network);
  if (j.contains("name")) {
    if (!j["name"].is_string()) throw input_error(where, "name", "must be a string", j["name"].dump());
    c.name = j["name"].get<std::string>();
    // Shown in every header: one line of text (an escape sequence or a newline would rewrite the terminal's).
    if (first_unprintable(c.name) != std::string::npos || c.name.find_first_of("\n\t") != std::string::npos)
      throw input_error(where, "name", "must be printable text on one line", j["name"].dump());
  }
  if (j.contains("intra_node_link"))
    c.intra_node_link = link_from_json(j["intra_node_link"], where, "intra_node_link");
  if (j.contains("nics_per_node")) {
    c.nics_per_node = static_cast<std::int32_t>(integer(j, "nics_per_node", where));
  }
  if (j.contains("host_ram_GiB"))
    c.host_ram_bytes_per_node = gib_bytes(j, "host_ram_GiB", where, "");
  if (j.contains("host_device_GBps"))
    c.host_device_bytes_per_s = number(j, "host_device_GBps", where, "") * kGiga;
  if (j.contains("host_memory_GBps"))
    c.host_memory_bytes_per_s = number(j, "host_memory_GBps", where, "") * kGiga;
  if (j.contains("cpu_adam_Mparams_per_s"))
    c.cpu_adam_params_per_s = number(j, "cpu_adam_Mparams_per_s", where, "") * 1e6;
  if (j.contains("shared_gemm_GFLOPs_per_rank")) {
    const auto& a = j["shared_gemm_GFLOPs_per_rank"];
    if (!a.is_array())
      throw input_error(where, "shared_gemm_GFLOPs_per_rank",
                        "must be an array of {\"ranks\": n, \"GFLOPs\": x}", a.dump());
    for (std::size_t i = 0; i < a.size(); ++i) {
      const std::string obj = fmt::format("shared_gemm_GFLOPs_per_rank[{}].", i);
      if (!a[i].is_object() || !a[i].contains("ranks") || !a[i].contains("GFLOPs"))
        throw input_error(where, obj, "must be an object with ranks and GFLOPs", a[i].dump());
      check_keys(a[i], where, obj, {"ranks", "GFLOPs"});
      const std::int64_t ranks = integer(a[i], "ranks", where, obj);
      c.shared_compute.push_back(
          {static_cast<std::int32_t>(ranks), number(a[i], "GFLOPs", where, obj) * kGiga});
    }
  }
  if (j.contains("host_calibration")) {
    // {"kernel_scale": {"<kernel>": x, ...}, "copy_scale": x, "collectives": [{"kind": "all_reduce",
    //  "ranks": n, "bytes": [...], "seconds": [...]}]}, all optional (see HostCalibration).
    const auto& h = j["host_calibration"];
    if (!h.is_object()) throw input_error(where, "host_calibration", "must be an object", h.dump());
    check_keys(h, where, "host_calibration.",
               {"kernel_scale", "kernel_overhead_us", "bf16_kernel_scale", "bf16_kernel_overhead_us", "copy_scale", "collectives", "collective_load_us", "collective_skew_us",
                "collective_load_per_compute", "collective_skew_per_compute", "reference_step_GFLOPs", "speed_probe_GFLOPs",
                "others_cpu_share"});
    // {"<kernel>": x, ...} into a per-kernel array; positive (scale) or non-negative (overhead).
    auto per_kernel = [&](const char* field, std::array<double, kKernelSlots>& out, double unit, bool zero_ok) {
      if (!h.contains(field)) return;
      const std::string f = std::string("host_calibration.") + field;
      const auto& ks = h[field];
      if (!ks.is_object()) throw input_error(where, f, "must be an object", ks.dump());
      for (const auto& [key, val] : ks.items()) {
        std::size_t k = 0;
        while (k < kKernelSlots && name_of(static_cast<Kernel>(k)) != key) ++k;
        if (k >= kKernelSlots || key == "unknown") throw input_error(where, f + "." + key, "is no kernel name", val.dump());
        const double x = number(ks, key, where, f + ".", zero_ok);
        out[k] = x * unit;
      }
    };
    per_kernel("kernel_scale", c.host_calibration.kernel_scale, 1.0, false);
    per_kernel("kernel_overhead_us", c.host_calibration.kernel_overhead_s, kMicro, true);
    per_kernel("bf16_kernel_scale", c.host_calibration.bf16_kernel_scale, 1.0, false);
    per_kernel("bf16_kernel_overhead_us", c.host_calibration.bf16_kernel_overhead_s, kMicro, true);
    if (h.contains("copy_scale")) c.host_calibration.copy_scale = number(h, "copy_scale", where, "host_calibration.");
    // The machine-speed probe (executor/calibrate.h speed_probe): the reference step program's rate.
    // Profiles before 2026-12-03 kept a GEMM mix's rate as speed_probe_GFLOPs, which no run's probe
    // compares with: it is read (checked) and dropped, so such a profile has no probe.
    if (h.contains("reference_step_GFLOPs"))
      c.host_calibration.speed_probe_flops_per_s = number(h, "reference_step_GFLOPs", where, "host_calibration.") * kGiga;
    if (h.contains("speed_probe_GFLOPs")) number(h, "speed_probe_GFLOPs", where, "host_calibration.");
    if (h.contains("others_cpu_share")) {  // a fraction of the host's CPU time: [0, 1]
      const double x = number(h, "others_cpu_share", where, "host_calibration.", true);
      if (x > 1.0) throw input_error(where, "host_calibration.others_cpu_share", "must be a fraction in [0, 1]", h["others_cpu_share"].dump());
      c.host_calibration.others_cpu_share = x;
    }
    // {"<collective>.<place>": microseconds, ...} into collective_slot order, non-negative.
    auto per_collective = [&](const char* field, HostCalibration::CollectiveArray& out, double unit) {
      if (!h.contains(field)) return;
      const std::string f = std::string("host_calibration.") + field;
      const auto& ks = h[field];
      if (!ks.is_object()) throw input_error(where, f, "must be an object", ks.dump());
      for (const auto& [key, val] : ks.items()) {
        std::optional<std::size_t> slot;
        for (std::size_t k = 0; k < kCollectiveSlots; ++k)
          for (const CollectivePlace p : {CollectivePlace::compute, CollectivePlace::optimizer})
            if (key == fmt::format("{}.{}", name_of(static_cast<Collective>(k)), name_of(p))) slot = collective_slot(k, p);
        if (!slot)
          throw input_error(where, f + "." + key, "is no <collective>.<place> (all_reduce, reduce_scatter, all_gather or broadcast; compute or optimizer)",
                            val.dump());
        out[*slot] = number(ks, key, where, f + ".", true) * unit;
      }
    };
    per_collective("collective_load_us", c.host_calibration.collective_load_s, kMicro);
    per_collective("collective_skew_us", c.host_calibration.collective_skew_s, kMicro);
    per_collective("collective_load_per_compute", c.host_calibration.collective_load_per_compute, 1.0);
    per_collective("collective_skew_per_compute", c.host_calibration.collective_skew_per_compute, 1.0);
    if (h.contains("collectives")) {
      const auto& a = h["collectives"];
      if (!a.is_array()) throw input_error(where, "host_calibration.collectives", "must be an array", a.dump());
      for (std::size_t i = 0; i < a.size(); ++i) {
        const std::string obj = fmt::format("host_calibration.collectives[{}].", i);
        if (!a[i].is_object()) throw input_error(where, obj, "must be an object", a[i].dump());
        check_keys(a[i], where, obj, {"kind", "ranks", "bytes", "seconds"});
        CollectiveTable t;
        const std::string kind = a[i].value("kind", "");
        int k = 0;
        while (k < kNumCollectives && name_of(static_cast<Collective>(k)) != kind) ++k;
        if (k >= kNumCollectives) throw input_error(where, obj + "kind", "must be all_reduce, reduce_scatter, all_gather or broadcast", a[i].dump());
        t.kind = k;
        t.ranks = static_cast<std::int32_t>(integer(a[i], "ranks", where, obj));
        if (!a[i].contains("bytes") || !a[i].contains("seconds") || !a[i]["bytes"].is_array() || !a[i]["seconds"].is_array() ||
            a[i]["bytes"].size() != a[i]["seconds"].size())
          throw input_error(where, obj + "bytes", "bytes and seconds must be arrays of one length", a[i].dump());
        t.bytes = a[i]["bytes"].get<std::vector<double>>();
        t.seconds = a[i]["seconds"].get<std::vector<double>>();
        if (!std::is_sorted(t.bytes.begin(), t.bytes.end()))
          throw input_error(where, obj + "bytes", "must be ascending", a[i]["bytes"].dump());
        c.host_calibration.collectives.push_back(std::move(t));
      }
    }
  }
  if (j.contains("efficiency")) {
    const auto& e = j["efficiency"];
    if (!e.is_object()) throw input_error(where, "efficiency", "must be an object", e.dump());
    check_keys(e, where, "efficiency.",
               {"gemm_max", "gemm_half_dim", "hbm", "collective_intra", "collective_inter", "collective_base_latency_us",
                "host_device", "kernel_launch_us", "sustained"});
    auto fraction = [&](std::string_view key, double& out) {
      if (!e.contains(std::string(key))) return;
      double x = number(e, key, where, "efficiency.");
      if (x > 1.0)
        throw input_error(where, fmt::format("efficiency.{}", key), "must be in (0, 1]",
                          e[std::string(key)].dump());
      out = x;
    };
    fraction("gemm_max", c.efficiency.gemm_max);
    fraction("hbm", c.efficiency.hbm);
    fraction("collective_intra", c.efficiency.collective_intra);
    fraction("collective_inter", c.efficiency.collective_inter);
    fraction("host_device", c.efficiency.host_device);
    if (e.contains("sustained")) {
      double x = 0.0;
      fraction("sustained", x);
      c.efficiency.sustained = x;
    }
    if (e.contains("gemm_half_dim"))
      c.efficiency.gemm_half_dim = number(e, "gemm_half_dim", where, "efficiency.", true);
    if (e.contains("kernel_launch_us"))
      c.efficiency.kernel_launch_s = number(e, "kernel_launch_us", where, "efficiency.", true) * kMicro;
    if (e.contains("collective_base_latency_us"))
      c.efficiency.collective_base_latency_s =
          number(e, "collective_base_latency_us", where, "efficiency.", true) * kMicro;
  }
  return c;
}

nlohmann::json cluster_to_json(const Cluster& c) {
  nlohmann::json gpu = {
      {"name", c.gpu.name},
      {"memory_GiB", static_cast<double>(c.gpu.memory_bytes) / kGiB},
      {"hbm_GBps", c.gpu.hbm_bytes_per_s / kGiga},
      {"bf16_TFLOPs", c.gpu.bf16_flops_per_s ? nlohmann::json(*c.gpu.bf16_flops_per_s / kTera)
                                             : nlohmann::json(nullptr)},
      {"fp16_TFLOPs", c.gpu.fp16_flops_per_s / kTera},
      {"tf32_TFLOPs", c.gpu.tf32_flops_per_s / kTera},
      {"fp32_TFLOPs", c.gpu.fp32_flops_per_s / kTera},
      {"intra_node_link", c.gpu.intra_node_link},
      {"host_link", c.gpu.host_link},
  };
  if (c.gpu.matmul_efficiency) gpu["matmul_efficiency"] = *c.gpu.matmul_efficiency;
  if (c.gpu.cost_per_hour_usd) gpu["cost_per_hour_USD"] = *c.gpu.cost_per_hour_usd;
  nlohmann::json j = {
      {"version", 1},
      {"name", c.name},
      {"gpu", gpu},
      {"nodes", c.nodes},
      {"gpus_per_node", c.gpus_per_node},
      {"intra_node_link", link_to_json(c.intra_node_link)},
      {"inter_node_link", c.inter_node_link ? link_to_json(*c.inter_node_link) : nlohmann::json(nullptr)},
      {"nics_per_node", c.nics_per_node},
      {"host_ram_GiB", static_cast<double>(c.host_ram_bytes_per_node) / kGiB},
      {"host_device_GBps", c.host_device_bytes_per_s / kGiga},
      {"host_memory_GBps", c.host_memory_bytes_per_s / kGiga},
      {"cpu_adam_Mparams_per_s", c.cpu_adam_params_per_s / 1e6},
      {"efficiency",
       {{"gemm_max", c.efficiency.gemm_max},
        {"gemm_half_dim", c.efficiency.gemm_half_dim},
        {"hbm", c.efficiency.hbm},
        {"collective_intra", c.efficiency.collective_intra},
        {"collective_inter", c.efficiency.collective_inter},
        {"host_device", c.efficiency.host_device},
        {"kernel_launch_us", c.efficiency.kernel_launch_s / kMicro},
        {"collective_base_latency_us", c.efficiency.collective_base_latency_s / kMicro}}},
  };
  if (c.efficiency.sustained) j["efficiency"]["sustained"] = *c.efficiency.sustained;
  if (!c.shared_compute.empty()) {
    nlohmann::json rates = nlohmann::json::array();
    for (const SharedComputeRate& r : c.shared_compute)
      rates.push_back({{"ranks", r.ranks}, {"GFLOPs", r.flops_per_s / kGiga}});
    j["shared_gemm_GFLOPs_per_rank"] = rates;
  }
  if (!c.host_calibration.empty()) {
    const HostCalibration& h = c.host_calibration;
    nlohmann::json ks = nlohmann::json::object(), ko = nlohmann::json::object(), bks = nlohmann::json::object(),
                   bko = nlohmann::json::object(), colls = nlohmann::json::array();
    for (std::size_t k = 0; k < kKernelSlots; ++k) {
      const std::string name(name_of(static_cast<Kernel>(k)));
      if (h.kernel_scale[k] > 0.0) ks[name] = h.kernel_scale[k];
      if (h.kernel_overhead_s[k] > 0.0) ko[name] = h.kernel_overhead_s[k] / kMicro;
      if (h.bf16_kernel_scale[k] > 0.0) bks[name] = h.bf16_kernel_scale[k];
      if (h.bf16_kernel_overhead_s[k] > 0.0) bko[name] = h.bf16_kernel_overhead_s[k] / kMicro;
    }
    for (const CollectiveTable& t : h.collectives)
      colls.push_back({{"kind", name_of(static_cast<Collective>(t.kind))}, {"ranks", t.ranks}, {"bytes", t.bytes}, {"seconds", t.seconds}});
    nlohmann::json hj = {{"kernel_scale", ks}, {"collectives", colls}};
    if (!ko.empty()) hj["kernel_overhead_us"] = ko;
    if (!bks.empty()) hj["bf16_kernel_scale"] = bks;
    if (!bko.empty()) hj["bf16_kernel_overhead_us"] = bko;
    if (h.copy_scale > 0.0) hj["copy_scale"] = h.copy_scale;
    if (h.speed_probe_flops_per_s > 0.0) hj["reference_step_GFLOPs"] = h.speed_probe_flops_per_s / kGiga;
    if (h.others_cpu_share) hj["others_cpu_share"] = *h.others_cpu_share;
    auto per_collective = [&](const char* field, const HostCalibration::CollectiveArray& a, double unit) {
      nlohmann::json o = nlohmann::json::object();
      for (std::size_t k = 0; k < kCollectiveSlots; ++k)
        for (const CollectivePlace p : {CollectivePlace::compute, CollectivePlace::optimizer}) {
          const std::size_t i = collective_slot(k, p);
          if (a[i] > 0.0) o[fmt::format("{}.{}", name_of(static_cast<Collective>(k)), name_of(p))] = a[i] / unit;
        }
      if (!o.empty()) hj[field] = o;
    };
    per_collective("collective_load_us", h.collective_load_s, kMicro);
    per_collective("collective_skew_us", h.collective_skew_s, kMicro);
    per_collective("collective_load_per_compute", h.collective_load_per_compute, 1.0);
    per_collective("collective_skew_per_compute", h.collective_skew_per_compute, 1.0);
    j["host_calibration"] = hj;
  }
  return j;
}

Cluster read_cluster_file(const std::filesystem::path& path) {
  const std::string where = path.string();
  const nlohmann::json j = read_json_file(where);
  Cluster c = cluster_from_json(j, where);
  if (!j.contains("name")) c.name = path.stem().string();
  return c;
}

void write_cluster_file(const Cluster& c, const std::filesystem::path& path) {
  write_text_atomic(path, cluster_to_json(c).dump(2) + "\n");
}

std::filesystem::path default_presets_dir() { return PEFTPLAN_CLUSTERS_DIR; }

std::vector<std::string> preset_names(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    if (e.is_regular_file() && e.path().extension() == ".json")
      names.push_back(e.path().stem().string());
  std::sort(names.begin(), names.end());
  return names;
}

Cluster resolve_cluster(std::string_view text, const std::filesystem::path& presets_dir) {
  std::filesystem::path as_path(text);
  std::error_code ec;
  if (text.ends_with(".json") || std::filesystem::is_regular_file(as_path, ec))
    return read_cluster_file(as_path);
  const std::string wanted = normalise(text);
  for (const std::string& name : preset_names(presets_dir))
    if (normalise(name) == wanted) return read_cluster_file(presets_dir / (name + ".json"));
  try {
    return parse_cluster_spelling(text);
  } catch (const InputError& e) {
    std::string presets;
    for (const std::string& n : preset_names(presets_dir)) presets += (presets.empty() ? "" : ", ") + n;
    throw InputError(fmt::format("{}; presets: {}; or a path to a cluster .json file", e.what(),
                                 presets.empty() ? "(none found)" : presets));
  }
}

Cluster default_cluster(std::int32_t gpus) {
  if (gpus < 1) throw input_error("the default cluster", "gpus", "must be a positive integer", std::to_string(gpus));
  Cluster c = make_cluster(*find_gpu("A100-80GB"), 1, gpus);
  return c;
}

nlohmann::json catalogs_to_json(const std::filesystem::path& presets_dir) {
  nlohmann::json gpus = nlohmann::json::array();
  for (const GpuSpec& g : kGpus) {
    Cluster one = make_cluster(g, 1, 1);
    gpus.push_back(cluster_to_json(one)["gpu"]);
  }
  nlohmann::json links = nlohmann::json::array();
  for (const LinkSpec& l : link_catalog()) links.push_back(link_to_json(l));
  return {{"gpus", gpus}, {"links", links}, {"presets", preset_names(presets_dir)}};
}

std::string describe_catalogs(const std::filesystem::path& presets_dir) {
  std::string out = "GPUs (dense peaks):\n";
  out += fmt::format("  {:<10} {:>8} {:>9} {:>10} {:>10} {:>10}  {:<8} {}\n", "name", "memory",
                     "HBM GB/s", "bf16 TF/s", "fp16 TF/s", "fp32 TF/s", "link", "host link");
  for (const GpuSpec& g : kGpus)
    out += fmt::format("  {:<10} {:>8} {:>9.0f} {:>10} {:>10.1f} {:>10.1f}  {:<8} {}\n", g.name,
                       human_bytes(g.memory_bytes), g.hbm_bytes_per_s / kGiga,
                       g.bf16_flops_per_s ? fmt::format("{:.1f}", *g.bf16_flops_per_s / kTera)
                                          : std::string("-"),
                       g.fp16_flops_per_s / kTera, g.fp32_flops_per_s / kTera,
                       g.intra_node_link, g.host_link);
  out += "Links (one direction; per GPU inside a node, per port between nodes):\n";
  for (const LinkSpec& l : link_catalog())
    out += fmt::format("  {:<10} {:<10} {:>8.2f} GB/s  {:>5.1f} us/hop\n", l.name,
                       name_of(l.family), l.bandwidth_bytes_per_s / kGiga, l.latency_s / kMicro);
  out += "Presets:\n";
  for (const std::string& n : preset_names(presets_dir)) out += fmt::format("  {}\n", n);
  out += "Or spell one: [nodes x] gpus x GPU [-link], e.g. 8xA100-80GB, 2x8xH100-SXM-NDR\n";
  return out;
}

}  // namespace peftplan::sim
