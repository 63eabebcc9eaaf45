// The machine a plan runs on: which GPU, how many per node and how many nodes, the links between
// them, the host, and the efficiency factors that turn datasheet peaks into achievable rates.
// Built-in catalogs of GPUs and links (datasheet values, sources cited in cluster.cpp), a parser
// for compact spellings ("2x8xH100-SXM-NDR"), and JSON cluster files (read and write).
// This file holds data and parsing only; the cost models live in compute.h and collectives.h.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "peftplan/common/dtype.h"
#include "peftplan/sim/program.h"

namespace peftplan::sim {

// What a link is made of; decides whether it can join nodes and how many a node has by default.
enum class LinkFamily : std::uint8_t { nvlink, pcie, xgmi, infiniband, roce, ethernet };
constexpr bool is_network(LinkFamily f) {
  return f == LinkFamily::infiniband || f == LinkFamily::roce || f == LinkFamily::ethernet;
}
std::string_view name_of(LinkFamily f);

struct LinkSpec {
  std::string name;                    // catalog name, e.g. "NVLink4", "IB-NDR", "100GbE"
  LinkFamily family = LinkFamily::nvlink;
  double bandwidth_bytes_per_s = 0.0;  // one direction, per GPU (intra-node links) or per
                                       //   port/NIC (network links)
  double latency_s = 0.0;              // per hop, NCCL's ring/Simple hardware latency
};

struct GpuSpec {
  std::string name;                    // catalog name, e.g. "H100-SXM"
  std::uint64_t memory_bytes = 0;      // device memory; vendor "GB" label read as GiB
  double hbm_bytes_per_s = 0.0;        // peak device-memory bandwidth
  std::optional<double> bf16_flops_per_s;  // dense tensor-core peak; nullopt: no bf16 tensor
                                           //   cores (V100), bf16 then runs at the fp32 rate
  double fp16_flops_per_s = 0.0;       // dense tensor-core peak
  double tf32_flops_per_s = 0.0;       // dense tensor-core peak, 0 when the GPU has no TF32
  double fp32_flops_per_s = 0.0;       // non-tensor (CUDA-core / vector) peak
  std::string intra_node_link;         // natural GPU-GPU link in a node (LinkSpec name)
  std::string host_link;               // GPU-host link (LinkSpec name, a PCIe generation)
  std::optional<double> matmul_efficiency;  // measured max achievable matmul FLOPs / peak
  std::optional<double> cost_per_hour_usd;  // rental price per GPU-hour, when the user knows it
  int compute_capability = 0;          // CUDA compute capability, major x 10 + minor (80 for
                                       //   A100); 0 when unknown or not CUDA
};

// Fractions of datasheet rates that real kernels reach, and the shape of the GEMM curve.
// Defaults and their sources; `peftplan calibrate` replaces them with measurements.
struct Efficiency {
  double gemm_max = 0.8;          // plateau of achieved/peak for large GEMMs; measured MAMF is
                                  //   80.1% (H100 SXM) to 85.9% (A100 SXM), stas00/ml-engineering
                                  //   compute/accelerator/README.md; catalog GPUs with a MAMF
                                  //   figure use their own
  double gemm_half_dim = 32.0;    // GEMM dimension (elements) at which that dimension's factor
                                  //   is 1/2: factor(x) = x / (x + gemm_half_dim); a modelling
                                  //   choice (see gemm_efficiency in compute.h)
  double hbm = 0.85;              // achieved/peak device-memory bandwidth for streaming kernels;
                                  //   an assumption (copy benchmarks reach 80-90%)
  double collective_intra = 0.8;  // achieved busbw / link bandwidth inside a node: 230 of 300
                                  //   GB/s on A100 NVLink3 (NVIDIA/nccl-tests#149), ~370 of 450
                                  //   on H100 ring (NVIDIA/nccl-tests#212)
  double collective_inter = 0.9;  // achieved per-NIC rate / line rate between nodes: 46-48 of 50
                                  //   GB/s per ConnectX-7 NDR port (NVIDIA/nccl-tests#290)
  double host_device = 0.88;      // achieved/peak pinned copy bandwidth: 55.43 of 63 GB/s H2D
                                  //   on PCIe Gen5 (stas00/ml-engineering network/README.md)
  double kernel_launch_s = 5e-6;  // fixed cost per device kernel or copy; an assumption (CUDA
                                  //   launch overhead is a few microseconds)
  double collective_base_latency_s = 8.4e-6;  // fixed cost per collective: NCCL's baseLat for
                                              //   ring/tree with the Simple protocol
                                              //   (src/graph/tuning.cc); MPI on shared memory
                                              //   has its own, measured by calibrate
  std::optional<double> sustained{};  // fraction of the rates above (GEMM curve, streaming
                                      //   bandwidth) that device kernels sustain over a whole
                                      //   training step; nullopt: the runtime profile's figure
                                      //   (planner RuntimeRules::sustained). Set it in a
                                      //   cluster file to use your own stack's measured figure
};

// The GEMM rate one rank reaches while `ranks` ranks compute at once on a node whose ranks share
// CPU cores (a CPU host running the executor, measured by `peftplan calibrate`).
struct SharedComputeRate {
  std::int32_t ranks = 1;    // ranks computing at once on one node
  double flops_per_s = 0.0;  // fp32 GEMM rate of one rank over the executor's shape mix
};

// Calibrated CPU-host model (`peftplan calibrate`), optional: absent, sim's GPU roofline is used
// unchanged. Both parts are measurements of the executor on this host with all N ranks busy.
//
// kernel_scale: per compute kernel (indexed by sim::Kernel), measured seconds / the roofline's
//   seconds for the same ops, summed over a calibration step of the executor's own program run
//   by N ranks at once (so it holds what the roofline misses on a CPU: Eigen's efficiency on
//   that kernel's shapes, cache-resident elementwise kernels running faster than the triad
//   bandwidth, ranks sharing cores). 0 = not calibrated (factor 1).
// kernel_overhead_s: per compute kernel, seconds added to every call whatever its size: OpenMP
//   fork and join, Eigen's packing set-up, the loops around small GEMMs. Fitted together with
//   kernel_scale (time = overhead + scale × roofline, weighted least squares on relative error)
//   over calibration programs of two sizes; a kernel's shape dependence beyond the roofline and
//   this constant is not modelled.
// bf16_kernel_scale, bf16_kernel_overhead_s: the same, fitted on calibration programs whose
//   compute dtype (Program::compute_dtype) is bf16 and used for the ops of such programs: the
//   same kernel costs a bf16 program differently (the CPU backend widens every bf16 operand
//   into an fp32 copy and rounds its outputs back, work the roofline of the bf16 bytes does not
//   see; a GPU runs bf16 GEMMs on tensor cores). A kernel without a bf16 calibration (0) uses
//   its fp32 one.
inline constexpr std::size_t kKernelSlots = 32;  // >= the number of sim::Kernel values
static_assert(kKernelSlots >= static_cast<std::size_t>(kNumKernels));
//
// CollectiveTable: one collective kind over `ranks` ranks as measured (nccl-tests sizes S and
//   the slowest rank's mean seconds), ascending in bytes. sim interpolates linearly in bytes
//   between measured sizes, i.e. a piecewise latency + bandwidth model whose bandwidth changes
//   size by size — it follows MPI's shared-memory protocol switches and the drop in bandwidth
//   once messages leave the cache, which one alpha-beta pair cannot (a factor ~2 off). Below the
//   smallest size: the smallest size's time (latency-bound). Above the largest: the last
//   segment's slope (the out-of-cache bandwidth).
struct CollectiveTable {
  std::int32_t kind = 0;             // sim::Collective as an integer (all_reduce 0, ...)
  std::int32_t ranks = 2;            // group size measured
  std::vector<double> bytes;         // ascending nccl-tests sizes
  std::vector<double> seconds;       // time per operation at each size
};

//
// Collectives inside a step, per kind and where the step issues them — among the layers'
// compute (forward, backward, recompute, loss: the communication thread competes with its rank's
// compute for a core) or in the optimizer phase (after backward, with the compute thread mostly
// waiting) — measured on the calibration step programs with every rank running at once
// (`peftplan calibrate`):
//   load: seconds each call takes beyond its table time inside the step (the communication
//     thread waiting for a core its rank's compute holds, MPI's progress loop yielding);
//   skew: seconds a rank waits inside each call for the last rank to arrive (ranks drift apart
//     between synchronisations: one is descheduled, its kernels run slower), the mean over the
//     ranks of (a rank's call - the shortest rank's call).
// Each grows with compute: the load with the compute the call overlaps (the longer the rank
// computes while the call is pending, the longer the communication threads wait for a core), the
// skew with the compute since the previous collective (the longer the ranks run apart, the
// further they drift). So each is
//   load = load_s + load_per_compute × overlapped, skew = skew_s + skew_per_compute × since_previous
// (collective_compute_s in timeline.h), all terms non-negative, fitted by least squares over the
// calls of the calibration programs at two sizes: a constant per kind and place, one slope for the
// host (calibrate.h).
// The timeline puts both in the collective's interval (wait first, then the transfer), reports
// the waits as sync_wait_s and keeps comm_s the transfers, as the executor measures them.
inline constexpr std::size_t kCollectiveSlots = 4;  // == kNumCollectives (program.h; static_assert in cluster.cpp)
enum class CollectivePlace : std::uint8_t { compute, optimizer };
inline constexpr std::size_t kCollectivePlaces = 2;
std::string_view name_of(CollectivePlace p);
// Index into collective_load_s / collective_skew_s.
constexpr std::size_t collective_slot(std::size_t kind, CollectivePlace place) {
  return kind * kCollectivePlaces + static_cast<std::size_t>(place);
}
struct HostCalibration {
  std::array<double, kKernelSlots> kernel_scale{};  // see above; 0 = 1
  std::array<double, kKernelSlots> kernel_overhead_s{};  // see above; 0 = none
  std::array<double, kKernelSlots> bf16_kernel_scale{};       // see above; 0 = kernel_scale's
  std::array<double, kKernelSlots> bf16_kernel_overhead_s{};  //   (with kernel_overhead_s)
  bool has_bf16_kernels() const {
    for (double x : bf16_kernel_scale)
      if (x > 0.0) return true;
    return false;
  }
  double copy_scale = 0.0;           // measured / modelled seconds of copies (0 = 1)
  std::vector<CollectiveTable> collectives;
  using CollectiveArray = std::array<double, kCollectiveSlots * kCollectivePlaces>;  // by collective_slot
  CollectiveArray collective_load_s{};            // see above; 0 = none
  CollectiveArray collective_load_per_compute{};  //   seconds per compute second
  CollectiveArray collective_skew_s{};
  CollectiveArray collective_skew_per_compute{};
  // The machine-speed probe's rate while calibrating (executor::speed_probe: GEMM FLOP/s per rank,
  // every rank at once); 0 = not measured. Not used to predict: validation compares a run's probe
  // with it to tell how far the machine's speed moved since calibration.
  double speed_probe_flops_per_s = 0.0;
  // Other work's share of the host's CPUs while calibration's step programs ran
  // (executor/host_load.h); nullopt = not measured. Not used to predict: the collectives' load and
  // skew were measured beside that much other work, so validation compares a run's share with it
  // (planner::Validation::load_change) and `peftplan run` recalibrates a profile made beside more
  // other work than the machine has now.
  std::optional<double> others_cpu_share;
  bool has_collective_step_costs() const {
    for (std::size_t k = 0; k < collective_load_s.size(); ++k)
      if (collective_load_s[k] > 0.0 || collective_skew_s[k] > 0.0 || collective_load_per_compute[k] > 0.0 ||
          collective_skew_per_compute[k] > 0.0)
        return true;
    return false;
  }
  bool empty() const {
    for (double x : kernel_scale)
      if (x > 0.0) return false;
    for (double x : kernel_overhead_s)
      if (x > 0.0) return false;
    if (has_bf16_kernels()) return false;
    if (has_collective_step_costs()) return false;
    return copy_scale <= 0.0 && collectives.empty() && speed_probe_flops_per_s <= 0.0 && !others_cpu_share;
  }
};

struct Cluster {
  std::string name;                    // preset or spelling it came from, e.g. "8xA100-80GB"
  GpuSpec gpu;                         // every GPU in the cluster is this one
  std::int32_t nodes = 1;              // machines
  std::int32_t gpus_per_node = 8;      // GPUs (= ranks) per machine
  LinkSpec intra_node_link;            // GPU-GPU inside a node
  std::optional<LinkSpec> inter_node_link;  // between nodes; nullopt for a single node
  std::int32_t nics_per_node = 8;      // inter-node ports per node (rails); per-GPU share of
                                       //   the network is nics_per_node / gpus_per_node ports
  std::uint64_t host_ram_bytes_per_node = 0;  // CPU memory per machine
  double host_device_bytes_per_s = 0.0;  // peak pinned copy bandwidth per GPU, one direction
  double host_memory_bytes_per_s = 0.0;  // CPU memory bandwidth available to one rank
  double cpu_adam_params_per_s = 0.0;    // CPU AdamW updates per second available to one rank
  Efficiency efficiency;
  std::vector<SharedComputeRate> shared_compute;  // by rank count; empty unless calibrated on a
                                                  //   host whose ranks share cores
  HostCalibration host_calibration;  // calibrated CPU-host model; empty for GPU clusters
};

constexpr std::int32_t total_gpus(const Cluster& c) { return c.nodes * c.gpus_per_node; }

// Peak FLOP/s of the GPU for GEMMs in this compute dtype (tensor cores for bf16/fp16; the
// non-tensor rate for fp32, unless tf32 is asked for with allow_tf32).
double peak_flops_per_s(const GpuSpec& gpu, DType compute, bool allow_tf32 = false);

// Network bandwidth per GPU, one direction: ports × line rate / GPUs per node (0 on one node).
double inter_node_bytes_per_s_per_gpu(const Cluster& c);

// --- catalogs --------------------------------------------------------------------------------

std::span<const GpuSpec> gpu_catalog();
std::span<const LinkSpec> link_catalog();
// Case-insensitive, '-', '_' and ' ' ignored; accepts the aliases listed in cluster.cpp.
std::optional<GpuSpec> find_gpu(std::string_view name);
std::optional<LinkSpec> find_link(std::string_view name);

// A cluster of `nodes` × `gpus_per_node` catalog GPUs with the GPU's natural intra-node link,
// the given network (required when nodes > 1) and default host figures.
Cluster make_cluster(const GpuSpec& gpu, std::int32_t nodes, std::int32_t gpus_per_node,
                     std::optional<LinkSpec> network = std::nullopt);

// `[M x] N x GPU [- link]`, case-insensitive: "8xA100-80GB", "4xRTX4090-PCIe",
// "2x8xH100-SXM-NDR", "2x4xA100-80GB-10GbE". A network link names the inter-node link; an
// NVLink/PCIe/XGMI suffix replaces the intra-node link. Throws InputError naming the spelling
// and listing valid GPU and link names.
Cluster parse_cluster_spelling(std::string_view spelling);

// JSON with units in keys (see sim/clusters/*.json). `where` names the file in errors.
Cluster cluster_from_json(const nlohmann::json& j, std::string_view where);
nlohmann::json cluster_to_json(const Cluster& c);
Cluster read_cluster_file(const std::filesystem::path& path);
void write_cluster_file(const Cluster& c, const std::filesystem::path& path);

// Directory of the bundled presets (sim/clusters in the source tree).
std::filesystem::path default_presets_dir();
// Preset names (file stems), sorted.
std::vector<std::string> preset_names(const std::filesystem::path& dir = default_presets_dir());

// A preset name, a compact spelling or a path to a JSON file, tried in that order (a text that
// ends in ".json" or names an existing file is always a path).
Cluster resolve_cluster(std::string_view text,
                        const std::filesystem::path& presets_dir = default_presets_dir());

// `gpus` A100-80GB on one node with NVLink3.
Cluster default_cluster(std::int32_t gpus);

// Human-readable listing of GPUs, links and presets for `peftplan clusters`.
std::string describe_catalogs(const std::filesystem::path& presets_dir = default_presets_dir());
// The same as JSON (`peftplan clusters --json`).
nlohmann::json catalogs_to_json(const std::filesystem::path& presets_dir = default_presets_dir());

}  // namespace peftplan::sim
