// Tests of the simulator module: catalogs and cluster parsing, collective and compute cost
// models, the timeline interpreter, Chrome trace export and the memory walk.
// Expected numbers come from documentation, datasheets or hand calculation, cited beside them.
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "input_error_of.h"
#include "peftplan/common/error.h"
#include "peftplan/sim/cluster.h"
#include "peftplan/sim/collectives.h"
#include "peftplan/sim/compute.h"
#include "peftplan/sim/memory.h"
#include "peftplan/sim/program.h"
#include "peftplan/sim/timeline.h"
#include "peftplan/sim/trace.h"
#include "peftplan/sim/verify.h"

namespace peftplan::sim {
namespace {

using ::testing::HasSubstr;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

using peftplan::testing::input_error_of;

// --- catalogs --------------------------------------------------------------------------------

TEST(Catalog, GpuSpotValues) {
  auto h100 = find_gpu("H100-SXM");
  ASSERT_TRUE(h100);
  // NVIDIA H100 datasheet (SXM5): BF16 1,979 TFLOPS with sparsity = 989 dense; 3.35 TB/s; 80 GB.
  EXPECT_DOUBLE_EQ(*h100->bf16_flops_per_s, 989e12);
  EXPECT_DOUBLE_EQ(h100->hbm_bytes_per_s, 3.35e12);
  EXPECT_EQ(h100->memory_bytes, 80ULL << 30);
  EXPECT_EQ(h100->intra_node_link, "NVLink4");
  // NVIDIA A100 datasheet: 80GB SXM 2,039 GB/s, 40GB 1,555 GB/s; BF16 312 dense; FP32 19.5.
  EXPECT_DOUBLE_EQ(find_gpu("A100-80GB")->hbm_bytes_per_s, 2039e9);
  EXPECT_DOUBLE_EQ(find_gpu("a100 40gb")->hbm_bytes_per_s, 1555e9);
  EXPECT_DOUBLE_EQ(*find_gpu("A100-80GB")->bf16_flops_per_s, 312e12);
  EXPECT_DOUBLE_EQ(find_gpu("A100-80GB")->fp32_flops_per_s, 19.5e12);
  // NVIDIA V100 datasheet: 125 TFLOPS FP16 tensor, no BF16 tensor cores, 15.7 FP32.
  auto v100 = find_gpu("V100");
  EXPECT_FALSE(v100->bf16_flops_per_s.has_value());
  EXPECT_DOUBLE_EQ(peak_flops_per_s(*v100, DType::fp16), 125e12);
  EXPECT_DOUBLE_EQ(peak_flops_per_s(*v100, DType::bf16), 15.7e12);
  // AMD Instinct MI300X data sheet: 1,307.4 TFLOPS BF16 dense, 192 GB, 5.3 TB/s.
  EXPECT_DOUBLE_EQ(*find_gpu("MI300X")->bf16_flops_per_s, 1307.4e12);
  EXPECT_EQ(find_gpu("MI300X")->memory_bytes, 192ULL << 30);
  // NVIDIA Ada whitepaper: RTX 4090 82.6 TFLOPS FP32, 1,008 GB/s.
  EXPECT_DOUBLE_EQ(find_gpu("RTX4090")->fp32_flops_per_s, 82.6e12);
  EXPECT_DOUBLE_EQ(find_gpu("rtx-4090")->hbm_bytes_per_s, 1008e9);
  // NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s.
  EXPECT_DOUBLE_EQ(find_gpu("H200")->hbm_bytes_per_s, 4.8e12);
  // fp32 GEMMs: non-tensor 19.5, or TF32 156 dense when allowed (A100 datasheet).
  EXPECT_DOUBLE_EQ(peak_flops_per_s(*find_gpu("A100-80GB"), DType::fp32, false), 19.5e12);
  EXPECT_DOUBLE_EQ(peak_flops_per_s(*find_gpu("A100-80GB"), DType::fp32, true), 156e12);
  EXPECT_EQ(gpu_catalog().size(), 12u);
  EXPECT_FALSE(find_gpu("A200"));
}

TEST(Catalog, LinkSpotValues) {
  // stas00/ml-engineering network/README.md: NVLink 4 = 450 GB/s per GPU per direction,
  // NDR = 400 Gb/s = 50 GB/s per port, 100 GbE = 12.5 GB/s.
  EXPECT_DOUBLE_EQ(find_link("NVLink4")->bandwidth_bytes_per_s, 450e9);
  EXPECT_DOUBLE_EQ(find_link("nvlink3")->bandwidth_bytes_per_s, 300e9);
  EXPECT_DOUBLE_EQ(find_link("NDR")->bandwidth_bytes_per_s, 50e9);
  EXPECT_DOUBLE_EQ(find_link("IB-HDR")->bandwidth_bytes_per_s, 25e9);
  EXPECT_DOUBLE_EQ(find_link("100GbE")->bandwidth_bytes_per_s, 12.5e9);
  EXPECT_DOUBLE_EQ(find_link("25GbE")->bandwidth_bytes_per_s, 3.125e9);
  // PCIe 4.0 x16: 16 GT/s × 16 lanes × 128/130 / 8 = 31.5 GB/s.
  EXPECT_DOUBLE_EQ(find_link("PCIe4")->bandwidth_bytes_per_s, 31.5e9);
  // NCCL src/graph/tuning.cc hwLat, ring/Simple: NVLink 3.4 us, NET 14 us.
  EXPECT_DOUBLE_EQ(find_link("NVLink4")->latency_s, 3.4e-6);
  EXPECT_DOUBLE_EQ(find_link("RoCE-400")->latency_s, 14e-6);
  EXPECT_TRUE(is_network(find_link("10GbE")->family));
  EXPECT_FALSE(is_network(find_link("PCIe5")->family));
}

// --- parsing ---------------------------------------------------------------------------------

TEST(ClusterSpelling, OneNode) {
  Cluster c = parse_cluster_spelling("8xA100-80GB");
  EXPECT_EQ(c.gpu.name, "A100-80GB");
  EXPECT_EQ(c.nodes, 1);
  EXPECT_EQ(c.gpus_per_node, 8);
  EXPECT_EQ(c.intra_node_link.name, "NVLink3");
  EXPECT_FALSE(c.inter_node_link.has_value());
  EXPECT_EQ(total_gpus(c), 8);
  EXPECT_DOUBLE_EQ(c.efficiency.gemm_max, 0.859);  // ml-engineering MAMF table, A100 SXM

  Cluster r = parse_cluster_spelling("4xRTX4090-PCIe");
  EXPECT_EQ(r.gpu.name, "RTX4090");
  EXPECT_EQ(r.gpus_per_node, 4);
  EXPECT_EQ(r.intra_node_link.name, "PCIe4");

  EXPECT_EQ(parse_cluster_spelling("8xH100-PCIe").gpu.name, "H100-PCIe");
  EXPECT_EQ(parse_cluster_spelling("8xH100-SXM").gpu.name, "H100-SXM");
  EXPECT_EQ(parse_cluster_spelling("8xL4").gpu.name, "L4");
  EXPECT_EQ(parse_cluster_spelling("8xL40S").gpu.name, "L40S");
  EXPECT_EQ(parse_cluster_spelling("8 x a100-80gb").gpu.name, "A100-80GB");
  EXPECT_EQ(parse_cluster_spelling("2x4090").gpu.name, "RTX4090");
  EXPECT_EQ(parse_cluster_spelling("H200").gpus_per_node, 1);
  EXPECT_EQ(parse_cluster_spelling("8xMI300X").intra_node_link.name, "XGMI");
  EXPECT_EQ(parse_cluster_spelling("4xA100-80GB-PCIe4").intra_node_link.name, "PCIe4");
}

TEST(ClusterSpelling, SeveralNodes) {
  Cluster c = parse_cluster_spelling("2x8xH100-SXM-NDR");
  EXPECT_EQ(c.nodes, 2);
  EXPECT_EQ(c.gpus_per_node, 8);
  EXPECT_EQ(c.gpu.name, "H100-SXM");
  EXPECT_EQ(c.intra_node_link.name, "NVLink4");
  ASSERT_TRUE(c.inter_node_link);
  EXPECT_EQ(c.inter_node_link->name, "IB-NDR");
  EXPECT_EQ(c.nics_per_node, 8);  // one NDR port per GPU, as DGX H100
  EXPECT_DOUBLE_EQ(inter_node_bytes_per_s_per_gpu(c), 50e9);

  Cluster e = parse_cluster_spelling("2x4xA100-80GB-10GbE");
  EXPECT_EQ(e.nodes, 2);
  EXPECT_EQ(e.gpus_per_node, 4);
  EXPECT_EQ(e.inter_node_link->name, "10GbE");
  EXPECT_EQ(e.nics_per_node, 1);  // plain Ethernet: one port per node, shared by its GPUs
  EXPECT_DOUBLE_EQ(inter_node_bytes_per_s_per_gpu(e), 1.25e9 / 4);

  Cluster upper = parse_cluster_spelling("2X8XH100-sxm-ndr");
  EXPECT_EQ(upper.inter_node_link->name, "IB-NDR");
  EXPECT_EQ(parse_cluster_spelling("4x8xH200-RoCE-400").inter_node_link->name, "RoCE-400");
  EXPECT_EQ(parse_cluster_spelling("2x8xB200-IB-XDR").inter_node_link->name, "IB-XDR");
}

TEST(ClusterSpelling, BadSpellingsNameTheSpellingAndTheValidNames) {
  std::string m = input_error_of([] { parse_cluster_spelling("8xFoo"); });
  EXPECT_THAT(m, HasSubstr("cluster \"8xFoo\""));
  EXPECT_THAT(m, HasSubstr("names no known GPU"));
  EXPECT_THAT(m, HasSubstr("A100-80GB"));
  EXPECT_THAT(m, HasSubstr("MI300X"));
  EXPECT_THAT(m, HasSubstr("IB-NDR"));
  EXPECT_THAT(m, HasSubstr("got \"Foo\""));

  m = input_error_of([] { parse_cluster_spelling("2 x 8 x Foo-NDR"); });
  EXPECT_THAT(m, HasSubstr("got \"Foo-NDR\""));

  m = input_error_of([] { parse_cluster_spelling("8xA100-80GB-Foo"); });
  EXPECT_THAT(m, HasSubstr("ends in an unknown link"));
  EXPECT_THAT(m, HasSubstr("100GbE"));

  m = input_error_of([] { parse_cluster_spelling("2x8xH100-SXM"); });
  EXPECT_THAT(m, HasSubstr("spans 2 nodes but names no network"));

  m = input_error_of([] { parse_cluster_spelling("2x8xH100-SXM-NVLink4"); });
  EXPECT_THAT(m, HasSubstr("names no network"));

  m = input_error_of([] { parse_cluster_spelling("0xA100-80GB"); });
  EXPECT_THAT(m, HasSubstr("gpus_per_node must be a positive integer, got 0"));

  m = input_error_of([] { parse_cluster_spelling("8x"); });
  EXPECT_THAT(m, HasSubstr("names no GPU"));

  // A count too long for any bound is out of range, not part of a GPU's name.
  m = input_error_of([] { parse_cluster_spelling("99999999999x8xH100-SXM"); });
  EXPECT_THAT(m, HasSubstr("has a count of 11 digits: at most 100,000 nodes of at most 1024 GPUs"));

  m = input_error_of([] { parse_cluster_spelling("2x2x2xA100"); });
  EXPECT_THAT(m, HasSubstr("more than two counts"));

  m = input_error_of([] { parse_cluster_spelling("8xRTX4090-NVLink"); });
  EXPECT_THAT(m, HasSubstr("has none"));
}

TEST(ClusterResolve, PresetsSpellingsAndFiles) {
  auto presets = preset_names();
  EXPECT_THAT(presets, ::testing::IsSupersetOf({"8xA100-80GB", "8xH100-SXM", "2x8xH100-SXM-NDR",
                                                "2x8xA100-80GB-100GbE", "4xRTX4090-PCIe",
                                                "8xL40S"}));
  Cluster p = resolve_cluster("8xH100-SXM");  // the preset: DGX H100's 2 TB host memory
  EXPECT_EQ(p.host_ram_bytes_per_node, 2048ULL << 30);
  EXPECT_EQ(p.name, "8xH100-SXM");
  Cluster eth = resolve_cluster("2x8xa100-80gb-100gbe");  // preset, case-insensitive
  EXPECT_EQ(eth.nics_per_node, 1);
  EXPECT_EQ(eth.inter_node_link->name, "100GbE");
  EXPECT_EQ(resolve_cluster("16xH100-SXM").gpus_per_node, 16);  // a spelling, not a preset
  EXPECT_EQ(resolve_cluster("2x8xH100-SXM-NDR").nodes, 2);

  std::string m = input_error_of([] { resolve_cluster("8xZ9000"); });
  EXPECT_THAT(m, HasSubstr("presets:"));
  EXPECT_THAT(m, HasSubstr("8xL40S"));
  m = input_error_of([] { resolve_cluster("/nonexistent/cluster.json"); });
  EXPECT_THAT(m, HasSubstr("cannot be opened"));

  Cluster d = default_cluster(4);
  EXPECT_EQ(d.gpu.name, "A100-80GB");
  EXPECT_EQ(d.nodes, 1);
  EXPECT_EQ(d.gpus_per_node, 4);

  std::string text = describe_catalogs();
  EXPECT_THAT(text, HasSubstr("H100-SXM"));
  EXPECT_THAT(text, HasSubstr("IB-NDR"));
  EXPECT_THAT(text, HasSubstr("2x8xH100-SXM-NDR"));
  EXPECT_EQ(catalogs_to_json()["gpus"].size(), 12u);
}

TEST(ClusterJson, RoundTripThroughAFile) {
  Cluster c = parse_cluster_spelling("2x8xH100-SXM-NDR");
  c.gpu.cost_per_hour_usd = 2.5;
  c.efficiency.collective_intra = 0.77;
  c.cpu_adam_params_per_s = 3e8;
  c.efficiency.sustained = 0.9;
  auto path = std::filesystem::temp_directory_path() / "peftplan_test_cluster.json";
  write_cluster_file(c, path);
  Cluster back = resolve_cluster(path.string());
  EXPECT_EQ(back.name, c.name);
  EXPECT_EQ(back.gpu.name, "H100-SXM");
  EXPECT_EQ(back.gpu.memory_bytes, c.gpu.memory_bytes);
  EXPECT_DOUBLE_EQ(*back.gpu.bf16_flops_per_s, *c.gpu.bf16_flops_per_s);
  EXPECT_DOUBLE_EQ(*back.gpu.cost_per_hour_usd, 2.5);
  EXPECT_EQ(back.nodes, 2);
  EXPECT_EQ(back.inter_node_link->name, "IB-NDR");
  EXPECT_DOUBLE_EQ(back.inter_node_link->bandwidth_bytes_per_s, 50e9);
  EXPECT_DOUBLE_EQ(back.efficiency.collective_intra, 0.77);
  ASSERT_TRUE(back.efficiency.sustained.has_value());
  EXPECT_DOUBLE_EQ(*back.efficiency.sustained, 0.9);
  EXPECT_FALSE(parse_cluster_spelling("8xA100-80GB").efficiency.sustained.has_value());  // the profile's
  EXPECT_DOUBLE_EQ(back.cpu_adam_params_per_s, 3e8);
  EXPECT_EQ(back.host_ram_bytes_per_node, c.host_ram_bytes_per_node);
  std::filesystem::remove(path);
}

TEST(ClusterJson, InlineGpuAndErrors) {
  auto j = nlohmann::json::parse(R"({
    "gpu": {"name": "MyGPU", "memory_GiB": 32, "hbm_GBps": 1000, "bf16_TFLOPs": 200,
            "fp32_TFLOPs": 20, "intra_node_link": "PCIe4"},
    "gpus_per_node": 2, "host_ram_GiB": 64, "host_device_GBps": 20
  })");
  Cluster c = cluster_from_json(j, "my.json");
  EXPECT_EQ(c.gpu.name, "MyGPU");
  EXPECT_EQ(c.gpu.memory_bytes, 32ULL << 30);
  EXPECT_DOUBLE_EQ(*c.gpu.bf16_flops_per_s, 200e12);
  EXPECT_DOUBLE_EQ(c.host_device_bytes_per_s, 20e9);
  EXPECT_EQ(c.intra_node_link.name, "PCIe4");

  // A catalog name with one field overridden (what calibrate writes after measuring).
  auto k = nlohmann::json::parse(R"({"gpu": {"name": "H100-SXM", "hbm_GBps": 3000},
                                     "gpus_per_node": 8})");
  Cluster h = cluster_from_json(k, "cal.json");
  EXPECT_DOUBLE_EQ(h.gpu.hbm_bytes_per_s, 3000e9);
  EXPECT_DOUBLE_EQ(*h.gpu.bf16_flops_per_s, 989e12);

  std::string m = input_error_of([] {
    cluster_from_json(nlohmann::json::parse(R"({"gpu":"A100","gpus_per_node":8,"host_ram_GB":9})"),
                      "c.json");
  });
  EXPECT_THAT(m, HasSubstr("c.json: host_ram_GB is not a known key"));
  EXPECT_THAT(m, HasSubstr("host_ram_GiB"));
  m = input_error_of([] {
    cluster_from_json(nlohmann::json::parse(R"({"gpu":{"name":"X1"},"gpus_per_node":8})"),
                      "c.json");
  });
  EXPECT_THAT(m, HasSubstr("gpu.memory_GiB is required"));
  m = input_error_of([] {
    cluster_from_json(nlohmann::json::parse(R"({"gpu":"A100","gpus_per_node":8,"nodes":2})"),
                      "c.json");
  });
  EXPECT_THAT(m, HasSubstr("inter_node_link is required when nodes > 1"));
  m = input_error_of([] {
    cluster_from_json(nlohmann::json::parse(R"({"gpu":"A100","gpus_per_node":-8})"), "c.json");
  });
  EXPECT_THAT(m, HasSubstr("gpus_per_node must be a positive integer, got -8"));
  m = input_error_of([] {
    cluster_from_json(
        nlohmann::json::parse(R"({"gpu":"A100","gpus_per_node":8,"efficiency":{"hbm":1.5}})"),
        "c.json");
  });
  EXPECT_THAT(m, HasSubstr("efficiency.hbm must be in (0, 1], got 1.5"));
  m = input_error_of([] {
    cluster_from_json(
        nlohmann::json::parse(R"({"gpu":"A100","gpus_per_node":8,"efficiency":{"sustained":0}})"),
        "c.json");
  });
  EXPECT_THAT(m, HasSubstr("efficiency.sustained must be a positive number, got 0"));
  m = input_error_of([] {
    cluster_from_json(nlohmann::json::parse(R"({"gpu":"TPU","gpus_per_node":8})"), "c.json");
  });
  EXPECT_THAT(m, HasSubstr("gpu must name a known GPU"));
}

// --- collectives -----------------------------------------------------------------------------

TEST(Collectives, BusBandwidthFactors) {
  // NVIDIA/nccl-tests doc/PERFORMANCE.md: busbw = algbw × 2(n-1)/n for AllReduce,
  // (n-1)/n for ReduceScatter and AllGather, 1 for Broadcast.
  EXPECT_DOUBLE_EQ(busbw_factor(Collective::all_reduce, 8), 1.75);   // 2·7/8
  EXPECT_DOUBLE_EQ(busbw_factor(Collective::reduce_scatter, 8), 0.875);  // 7/8
  EXPECT_DOUBLE_EQ(busbw_factor(Collective::all_gather, 4), 0.75);   // 3/4
  EXPECT_DOUBLE_EQ(busbw_factor(Collective::broadcast, 16), 1.0);
  EXPECT_DOUBLE_EQ(busbw_factor(Collective::all_reduce, 1), 0.0);
}

TEST(Collectives, RingAllReduceMatchesTheFormula) {
  Cluster c = parse_cluster_spelling("8xA100-80GB");
  const std::uint64_t S = 1ULL << 30;
  CollectiveCost r = collective_cost(Collective::all_reduce, S, 8, c, CollectiveAlgorithm::ring);
  // nccl-tests PERFORMANCE.md: t = (S/B)·2(n-1)/n with B = 0.8 × 300 GB/s achieved, plus
  // NCCL's ring latency (tuning.cc): 8.4 us + 2(n-1) hops × 3.4 us.
  const double B = 0.8 * 300e9;
  const double latency = 8.4e-6 + 14 * 3.4e-6;
  EXPECT_NEAR(r.time_s, latency + S / B * 2.0 * 7.0 / 8.0, 1e-12);
  EXPECT_NEAR(r.latency_s, latency, 1e-15);
  EXPECT_NEAR(r.algbw_bytes_per_s, S / r.time_s, 1e-3);
  EXPECT_NEAR(r.busbw_bytes_per_s, r.algbw_bytes_per_s * 1.75, 1e-3);
  EXPECT_EQ(r.intra_node_bytes, S / 8 * 14);  // 2(n-1)/n·S sent per rank
  EXPECT_EQ(r.inter_node_bytes, 0u);
  // 16 GiB all_reduce on 8xA100 NVLink3 measured 234.89 GB/s busbw (stas00/ml-engineering
  // network/README.md, "Real network throughput"): predicted within 3%.
  CollectiveCost big = collective_cost(Collective::all_reduce, 16ULL << 30, 8, c);
  EXPECT_NEAR(big.busbw_bytes_per_s / 234.89e9, 1.0, 0.03);

  // all_gather: S is the total (gathered) size; t = (S/B)·(n-1)/n.
  CollectiveCost ag = collective_cost(Collective::all_gather, S, 8, c);
  EXPECT_NEAR(ag.time_s, 8.4e-6 + 7 * 3.4e-6 + S / B * 7.0 / 8.0, 1e-12);
  EXPECT_NEAR(ag.busbw_bytes_per_s, ag.algbw_bytes_per_s * 0.875, 1e-3);
  CollectiveCost rs = collective_cost(Collective::reduce_scatter, S, 8, c);
  EXPECT_DOUBLE_EQ(rs.time_s, ag.time_s);
  // broadcast: busbw = algbw, t = S/B.
  CollectiveCost bc = collective_cost(Collective::broadcast, S, 8, c);
  EXPECT_NEAR(bc.time_s, 8.4e-6 + 8 * 3.4e-6 + S / B, 1e-12);

  // Group of one, or nothing to send: free.
  EXPECT_EQ(collective_cost(Collective::all_reduce, S, 1, c).time_s, 0.0);
  EXPECT_EQ(collective_cost(Collective::all_reduce, 0, 8, c).time_s, 0.0);
  EXPECT_THROW(collective_cost(Collective::all_reduce, S, 9, c), InternalError);
}

TEST(Collectives, HierarchicalAcrossNodes) {
  // 2 nodes × 8 A100 joined by one 100 GbE port each: per-GPU network share 12.5/8 GB/s.
  Cluster c = parse_cluster_spelling("2x8xA100-80GB-100GbE");
  const double S = 1ULL << 30;
  CollectiveCost r = collective_cost(Collective::all_reduce, 1ULL << 30, 16, c,
                                     CollectiveAlgorithm::ring);
  // Per rank: intra 2(g-1)/g·S = 1.75 S; inter 2(k-1)/k·S/g = S/8.
  EXPECT_EQ(r.intra_node_bytes, static_cast<std::uint64_t>(1.75 * S));
  EXPECT_EQ(r.inter_node_bytes, static_cast<std::uint64_t>(S / 8));
  const double wire = 0.9 * 12.5e9 / 8;  // achieved per-GPU network rate
  const double t_inter = S / 8 / wire;
  const double t_intra = 1.75 * S / (0.8 * 300e9);
  ASSERT_GT(t_inter, t_intra);  // network-bound
  // Latency: 8.4 us + (2(n-1) - 2(k-1)) × 3.4 us + 2(k-1) × 14 us (tuning.cc).
  EXPECT_NEAR(r.time_s, 8.4e-6 + 28 * 3.4e-6 + 2 * 14e-6 + t_inter, 1e-12);
  // ml-engineering network/README.md: per-accelerator wire rate = busbw·(k-1)/(n-1).
  EXPECT_NEAR(r.busbw_bytes_per_s * (2 - 1) / (16 - 1) / wire, 1.0, 0.01);

  // A DGX H100 pair over NDR: NVLink is the bottleneck for a large all_reduce.
  Cluster h = parse_cluster_spelling("2x8xH100-SXM-NDR");
  CollectiveCost hr = collective_cost(Collective::all_reduce, 1ULL << 34, 16, h,
                                      CollectiveAlgorithm::ring);
  const double S34 = static_cast<double>(1ULL << 34);
  EXPECT_NEAR(hr.time_s - hr.latency_s, 1.75 * S34 / (0.8 * 450e9), 1e-9);

  // A group that fits in one node stays on NVLink.
  CollectiveCost in_node = collective_cost(Collective::all_gather, 1ULL << 30, 8, h);
  EXPECT_EQ(in_node.inter_node_bytes, 0u);

  // Small messages over many nodes: the tree's log2 latency wins (NCCL picks by time).
  Cluster many = parse_cluster_spelling("32x8xH100-SXM-NDR");
  CollectiveCost small = collective_cost(Collective::all_reduce, 4096, 256, many);
  EXPECT_EQ(small.algorithm, CollectiveAlgorithm::tree);
  CollectiveCost large = collective_cost(Collective::all_reduce, 1ULL << 32, 256, many);
  EXPECT_EQ(large.algorithm, CollectiveAlgorithm::ring);
}

// --- compute ---------------------------------------------------------------------------------

TEST(Compute, GemmEfficiencyCurve) {
  Efficiency e;  // gemm_max 0.8, half_dim 32
  const double f4096 = 4096.0 / (4096.0 + 32.0);
  EXPECT_NEAR(gemm_efficiency(4096, 4096, 4096, 1, e), 0.8 * f4096 * f4096 * f4096, 1e-12);
  EXPECT_NEAR(gemm_efficiency(4096, 16, 4096, 1, e), 0.8 * f4096 * f4096 * (16.0 / 48.0), 1e-12);
  EXPECT_DOUBLE_EQ(gemm_efficiency(0, 0, 0, 1, e), 0.8);
  // A batch of 32 GEMMs of m = 128 fills the GPU like m = 4096.
  EXPECT_DOUBLE_EQ(gemm_efficiency(128, 4096, 4096, 32, e), gemm_efficiency(4096, 4096, 4096, 1, e));
  EXPECT_LT(gemm_efficiency(64, 64, 64, 1, e), gemm_efficiency(1024, 1024, 1024, 1, e));
}

TEST(Compute, RooflineCases) {
  Cluster c = parse_cluster_spelling("1xA100-80GB");
  const Efficiency& e = c.efficiency;
  // A large projection, [4096 tokens, 4096] · [4096, 4096] in bf16: compute-bound.
  ComputeWork big;
  big.flops = 2.0 * 4096 * 4096 * 4096;
  big.bytes_moved = 3ULL * 4096 * 4096 * 2;
  big.gemm_m = big.gemm_n = big.gemm_k = 4096;
  ComputeCost cb = device_compute_cost(big, Kernel::linear_fwd, c, DType::bf16);
  EXPECT_FALSE(cb.memory_bound);
  EXPECT_NEAR(cb.time_s,
              big.flops / (312e12 * gemm_efficiency(4096, 4096, 4096, 1, e)) + e.kernel_launch_s,
              1e-12);
  // fp32 without TF32 runs on CUDA cores: 19.5 TFLOP/s peak, 16x slower math.
  ComputeCost c32 = device_compute_cost(big, Kernel::linear_fwd, c, DType::fp32);
  EXPECT_NEAR(c32.math_s / cb.math_s, 312.0 / 19.5, 1e-9);

  // LoRA A projection, [4096, 4096] · [4096, r = 16]: reads the activations, memory-bound.
  ComputeWork lora;
  lora.flops = 2.0 * 4096 * 4096 * 16;
  lora.bytes_moved = (4096ULL * 4096 + 4096 * 16 + 4096 * 16) * 2;
  lora.gemm_m = 4096;
  lora.gemm_n = 16;
  lora.gemm_k = 4096;
  ComputeCost cl = device_compute_cost(lora, Kernel::lora_fwd, c, DType::bf16);
  EXPECT_TRUE(cl.memory_bound);
  EXPECT_NEAR(cl.time_s, lora.bytes_moved / (2039e9 * e.hbm) + e.kernel_launch_s, 1e-12);

  // Elementwise: no GEMM shape, memory-bound.
  ComputeWork add;
  add.flops = 4096.0 * 4096;
  add.bytes_moved = 3ULL * 4096 * 4096 * 2;
  ComputeCost ca = device_compute_cost(add, Kernel::residual_add, c, DType::bf16);
  EXPECT_TRUE(ca.memory_bound);
  EXPECT_DOUBLE_EQ(ca.efficiency, 1.0);

  // Host optimizer: params at the CPU-Adam rate.
  ComputeWork opt;
  opt.params = 40'000'000;
  ComputeCost co = host_compute_cost(opt, Kernel::optimizer_step, c);
  EXPECT_DOUBLE_EQ(co.time_s, 40e6 / c.cpu_adam_params_per_s);

  // PCIe copy: bytes / (31.5 GB/s × 0.88) + launch.
  EXPECT_NEAR(copy_time_s(1ULL << 30, c), kGiB / (31.5e9 * 0.88) + e.kernel_launch_s, 1e-12);
  EXPECT_EQ(copy_time_s(0, c), 0.0);
}

// --- timeline --------------------------------------------------------------------------------

// A 2-GPU cluster with round numbers: 1 TB/s memory at 100%, no launch cost, 100 GB/s link.
Cluster round_cluster() {
  GpuSpec g;
  g.name = "Round";
  g.memory_bytes = 16ULL << 30;
  g.hbm_bytes_per_s = 1e12;
  g.bf16_flops_per_s = 100e12;
  g.fp16_flops_per_s = 100e12;
  g.fp32_flops_per_s = 10e12;
  g.intra_node_link = "PCIe4";
  g.host_link = "PCIe4";
  Cluster c = make_cluster(g, 1, 2);
  c.intra_node_link.bandwidth_bytes_per_s = 100e9;
  c.intra_node_link.latency_s = 0.0;
  c.efficiency.hbm = 1.0;
  c.efficiency.kernel_launch_s = 0.0;
  c.efficiency.collective_intra = 0.8;
  c.host_device_bytes_per_s = 10e9;
  c.efficiency.host_device = 1.0;
  return c;
}

Op compute_op(std::uint64_t bytes_moved, Phase phase = Phase::forward) {
  Op op;
  op.kind = OpKind::compute;
  op.stream = Stream::compute;
  op.phase = phase;
  op.kernel = Kernel::residual_add;
  op.work.bytes_moved = bytes_moved;
  return op;
}

TEST(Timeline, CommOverlapsComputeAndDepsAreRespected) {
  const Cluster c = round_cluster();
  Program p;
  p.ranks = 2;
  p.tokens_per_step = 1000;
  p.model_flops_per_step = 1e9;
  const int w = p.add_buffer("weights", MemCategory::base_weights, 1000);
  Op setup;
  setup.kind = OpKind::alloc;
  setup.phase = Phase::setup;
  setup.buffer = w;
  p.add_op(setup);                                     // 0: setup, no time
  const int a = p.add_op(compute_op(1'000'000'000));   // 1: 1 ms (1e9 B at 1 TB/s)
  Op ar;
  ar.kind = OpKind::collective;
  ar.stream = Stream::comm;
  ar.phase = Phase::backward;
  ar.collective = Collective::all_reduce;
  ar.group_size = 2;
  ar.bytes = 80'000'000;  // t = 8.4 us + 2·(1/2)·8e7 / (0.8 × 100 GB/s) = 1 ms + 8.4 us
  const int comm = p.add_op(ar, {a});                  // 2: waits for op 1
  p.add_op(compute_op(1'000'000'000));                 // 3: overlaps the all_reduce
  p.add_op(compute_op(1'000'000'000, Phase::optimizer), {comm});  // 4
  Op cp;
  cp.kind = OpKind::copy;
  cp.stream = Stream::copy;
  cp.copy_dir = CopyDir::device_to_host;
  cp.bytes = 10'000'000;  // 1 ms at 10 GB/s
  p.add_op(cp, {a});                                   // 5: after op 1 on the copy stream

  Timeline t = simulate(p, c);
  const double comm_s = 8.4e-6 + 1e-3;
  ASSERT_EQ(t.ops.size(), 6u);
  EXPECT_DOUBLE_EQ(t.ops[0].end_s, 0.0);
  EXPECT_DOUBLE_EQ(t.ops[1].start_s, 0.0);
  EXPECT_DOUBLE_EQ(t.ops[1].end_s, 1e-3);
  EXPECT_DOUBLE_EQ(t.ops[2].start_s, 1e-3);            // dependency on op 1
  EXPECT_NEAR(t.ops[2].end_s, 1e-3 + comm_s, 1e-15);
  EXPECT_DOUBLE_EQ(t.ops[3].start_s, 1e-3);            // compute stream free, no deps
  EXPECT_NEAR(t.ops[4].start_s, 1e-3 + comm_s, 1e-15);  // waits for the all_reduce
  EXPECT_NEAR(t.ops[5].start_s, 1e-3, 1e-15);
  EXPECT_NEAR(t.ops[5].end_s, 2e-3, 1e-15);
  EXPECT_NEAR(t.step_s, 2e-3 + comm_s, 1e-15);
  EXPECT_NEAR(t.compute_s, 3e-3, 1e-15);
  EXPECT_NEAR(t.comm_s, comm_s, 1e-15);
  // By hand: the all_reduce runs over [1, 2.0084] ms; compute covers [0, 2] and [2.0084, ...]:
  // only the 8.4 us tail is exposed.
  EXPECT_NEAR(t.exposed_comm_s, 8.4e-6, 1e-12);
  EXPECT_NEAR(t.optimizer_s, 1e-3, 1e-15);
  EXPECT_NEAR(t.offload_s, 1e-3, 1e-15);
  EXPECT_EQ(t.collective_bytes[static_cast<int>(Collective::all_reduce)], 80'000'000u);
  EXPECT_EQ(t.collective_count[static_cast<int>(Collective::all_reduce)], 1);
  EXPECT_EQ(t.intra_node_bytes, 80'000'000u);  // 2(n-1)/n·S with n = 2
  EXPECT_EQ(t.inter_node_bytes, 0u);
  EXPECT_EQ(t.device_to_host_bytes, 10'000'000u);
  EXPECT_NEAR(t.tokens_per_s, 1000.0 * 2 / t.step_s, 1e-6);
  EXPECT_NEAR(t.mfu, 1e9 / (t.step_s * 100e12), 1e-15);
  EXPECT_DOUBLE_EQ(op_duration_s(p.ops[2], c), t.ops[2].end_s - t.ops[2].start_s);
}

TEST(Timeline, BlockingCommIsFullyExposed) {
  const Cluster c = round_cluster();
  Program p;
  p.ranks = 2;
  const int a = p.add_op(compute_op(1'000'000'000));
  Op ar;
  ar.kind = OpKind::collective;
  ar.stream = Stream::comm;
  ar.collective = Collective::all_reduce;
  ar.group_size = 2;
  ar.bytes = 80'000'000;
  const int comm = p.add_op(ar, {a});
  p.add_op(compute_op(1'000'000'000), {comm});
  Timeline t = simulate(p, c);
  EXPECT_NEAR(t.exposed_comm_s, t.comm_s, 1e-15);
  EXPECT_NEAR(t.step_s, 2e-3 + t.comm_s, 1e-15);
}

// SimOptions::sustained stretches each device compute op's roofline time (not its launch) and
// nothing else: by hand, compute 1 ms at sustained 0.5 takes 2 ms plus the 5 us launch; the
// all_reduce (1 ms + 8.4 us) and the 1 ms device-to-host copy keep their times.
TEST(Timeline, SustainedFractionStretchesDeviceComputeOnly) {
  Cluster c = round_cluster();
  c.efficiency.kernel_launch_s = 5e-6;
  Program p;
  p.ranks = 2;
  const int a = p.add_op(compute_op(1'000'000'000));  // 1 ms at 1 TB/s
  Op ar;
  ar.kind = OpKind::collective;
  ar.stream = Stream::comm;
  ar.collective = Collective::all_reduce;
  ar.group_size = 2;
  ar.bytes = 80'000'000;
  const int comm = p.add_op(ar, {a});
  Op cp;
  cp.kind = OpKind::copy;
  cp.stream = Stream::copy;
  cp.copy_dir = CopyDir::device_to_host;
  cp.bytes = 10'000'000;
  const int copy = p.add_op(cp, {a});
  SimOptions half;
  half.sustained = 0.5;
  const Timeline full = simulate(p, c), slow = simulate(p, c, half);
  auto dur = [](const Timeline& t, int i) { return t.ops[static_cast<std::size_t>(i)].end_s - t.ops[static_cast<std::size_t>(i)].start_s; };
  EXPECT_NEAR(dur(full, a), 1e-3 + 5e-6, 1e-15);
  EXPECT_NEAR(dur(slow, a), 2e-3 + 5e-6, 1e-15);
  EXPECT_GT(dur(full, comm), 1e-3);
  EXPECT_NEAR(dur(slow, comm), dur(full, comm), 1e-15);
  EXPECT_GT(dur(full, copy), 0.0);
  EXPECT_NEAR(dur(slow, copy), dur(full, copy), 1e-15);
  EXPECT_NEAR(slow.compute_s, 2 * full.compute_s - 5e-6, 1e-15);
}

// SimOptions::host_floor_s: host time the device waits for (FSDP1's hooks) is a floor under the
// step; below the device's critical path it changes nothing.
TEST(Timeline, HostFloorIsTheStepWhenItIsLonger) {
  const Cluster c = round_cluster();
  Program p;
  p.ranks = 1;
  p.tokens_per_step = 1000;
  p.add_op(compute_op(1'000'000'000));  // 1 ms at 1 TB/s
  const Timeline dev = simulate(p, c);
  SimOptions slow_host;
  slow_host.host_floor_s = 5e-3;
  const Timeline host = simulate(p, c, slow_host);
  EXPECT_TRUE(host.host_bound);
  EXPECT_DOUBLE_EQ(host.step_s, 5e-3);
  EXPECT_DOUBLE_EQ(host.device_step_s, dev.step_s);
  EXPECT_DOUBLE_EQ(host.tokens_per_s, 1000 / 5e-3);
  EXPECT_DOUBLE_EQ(host.compute_s, dev.compute_s);  // the device's work is the same
  SimOptions fast_host;
  fast_host.host_floor_s = 1e-4;
  const Timeline fast = simulate(p, c, fast_host);
  EXPECT_FALSE(fast.host_bound);
  EXPECT_DOUBLE_EQ(fast.step_s, dev.step_s);
}

// A calibrated arrival skew and load (HostCalibration::collective_skew_* / collective_load_*) in
// the timeline: the wait sits at the start of the collective's interval, the transfer after it;
// comm_s counts the transfers, sync_wait_s the waits, and an op that needs the collective starts
// that much later. Hand program: compute 1 ms, an all_reduce after it that the next compute op
// (1 ms) overlaps, then an op that needs it.
TEST(Timeline, CalibratedSkewAndLoadDelayWhatWaitsForTheCollective) {
  Cluster c = round_cluster();
  Program p;
  p.ranks = 2;
  const int a = p.add_op(compute_op(1'000'000'000));   // 1 ms
  Op ar;
  ar.kind = OpKind::collective;
  ar.stream = Stream::comm;
  ar.phase = Phase::backward;
  ar.collective = Collective::all_reduce;
  ar.group_size = 2;
  ar.bytes = 80'000'000;                               // 1 ms + 8.4 us on this cluster
  const int comm = p.add_op(ar, {a});
  p.add_op(compute_op(1'000'000'000));                 // overlaps the all_reduce: 1 ms
  p.add_op(compute_op(1'000'000'000), {comm});         // needs it
  const Timeline before = simulate(p, c);
  const double transfer = 8.4e-6 + 1e-3;
  const CollectiveCompute around = collective_compute_s(p, {{1e-3, 0.0, 1e-3, 1e-3}});
  EXPECT_EQ(around.overlapped, (std::vector<double>{0.0, 1e-3, 0.0, 0.0}));
  EXPECT_EQ(around.since_previous, (std::vector<double>{0.0, 3e-3, 0.0, 0.0}));  // the only collective: the whole step
  const std::size_t slot = collective_slot(static_cast<std::size_t>(Collective::all_reduce), CollectivePlace::compute);
  // wait = 100 us + 0.2 × 3 ms since the previous collective; load = 50 us + 0.1 × 1 ms overlapped
  c.host_calibration.collective_skew_s[slot] = 100e-6;
  c.host_calibration.collective_skew_per_compute[slot] = 0.2;
  c.host_calibration.collective_load_s[slot] = 50e-6;
  c.host_calibration.collective_load_per_compute[slot] = 0.1;
  const Timeline t = simulate(p, c);
  const double wait = 100e-6 + 0.2 * 3e-3, load = 50e-6 + 0.1e-3;
  EXPECT_NEAR(t.ops[1].wait_s, wait, 1e-15);
  EXPECT_NEAR(t.ops[1].end_s - t.ops[1].start_s, wait + transfer + load, 1e-15);
  EXPECT_NEAR(t.comm_s, transfer + load, 1e-15);
  EXPECT_NEAR(t.sync_wait_s, wait, 1e-15);
  EXPECT_NEAR(before.sync_wait_s, 0.0, 0.0);
  EXPECT_NEAR(t.step_s - before.step_s, wait + load, 1e-15);  // the last op waited for all of it
  EXPECT_NEAR(t.exposed_comm_s - before.exposed_comm_s, wait + load, 1e-15);
  // The optimizer place has its own slot: the compute one does not apply there.
  Program q = p;
  q.ops[1].phase = Phase::optimizer;
  EXPECT_NEAR(simulate(q, c).sync_wait_s, 0.0, 0.0);
  // One rank waits for nobody.
  Program one = p;
  one.ops[1].group_size = 1;
  EXPECT_NEAR(simulate(one, c).sync_wait_s, 0.0, 0.0);
  // JSON round trip under <collective>.<place> keys; a wrong key names the field.
  const Cluster back = cluster_from_json(cluster_to_json(c), "c.json");
  EXPECT_DOUBLE_EQ(back.host_calibration.collective_skew_s[slot], 100e-6);
  EXPECT_DOUBLE_EQ(back.host_calibration.collective_skew_per_compute[slot], 0.2);
  EXPECT_DOUBLE_EQ(back.host_calibration.collective_load_s[slot], 50e-6);
  EXPECT_DOUBLE_EQ(back.host_calibration.collective_load_per_compute[slot], 0.1);
  nlohmann::json bad = cluster_to_json(c);
  bad["host_calibration"]["collective_skew_us"]["all_reduce.sometimes"] = 1.0;
  try {
    cluster_from_json(bad, "c.json");
    ADD_FAILURE() << "accepted a bad key";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("host_calibration.collective_skew_us.all_reduce.sometimes"), std::string::npos) << e.what();
  }
  bad = cluster_to_json(c);
  bad["host_calibration"]["collective_load_per_compute"]["all_reduce.compute"] = -1.0;
  EXPECT_THROW(cluster_from_json(bad, "c.json"), InputError);
  // The machine-speed probe rides along (GFLOP/s), predicts nothing, and must be positive.
  Cluster probed = c;
  probed.host_calibration.speed_probe_flops_per_s = 91.5e9;
  const nlohmann::json pj = cluster_to_json(probed);
  EXPECT_DOUBLE_EQ(pj.at("host_calibration").at("reference_step_GFLOPs").get<double>(), 91.5);
  EXPECT_DOUBLE_EQ(cluster_from_json(pj, "c.json").host_calibration.speed_probe_flops_per_s, 91.5e9);
  EXPECT_NEAR(simulate(p, probed).step_s, t.step_s, 0.0);
  bad = pj;
  bad["host_calibration"]["reference_step_GFLOPs"] = 0.0;
  try {
    cluster_from_json(bad, "c.json");
    ADD_FAILURE() << "accepted a zero probe";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("host_calibration.reference_step_GFLOPs"), std::string::npos) << e.what();
  }
  // A profile from before the reference step program kept a GEMM mix's rate, which no run's probe
  // compares with: read, checked, and dropped (such a profile has no probe; `run` recalibrates it).
  nlohmann::json old = cluster_to_json(c);
  old["host_calibration"]["speed_probe_GFLOPs"] = 96.8;
  EXPECT_DOUBLE_EQ(cluster_from_json(old, "c.json").host_calibration.speed_probe_flops_per_s, 0.0);
  old["host_calibration"]["speed_probe_GFLOPs"] = -1.0;
  EXPECT_THROW(cluster_from_json(old, "c.json"), InputError);
}

TEST(Timeline, ZeroTimeOpsKeepStreamOrderAndTooFewGpusIsAnError) {
  const Cluster c = round_cluster();
  Program p;
  p.ranks = 2;
  const int buf = p.add_buffer("act", MemCategory::activations, 10);
  Op slow = compute_op(2'000'000'000);
  slow.stream = Stream::copy;
  const int s = p.add_op(slow);                       // copy stream, 2 ms
  Op alloc;
  alloc.kind = OpKind::alloc;
  alloc.buffer = buf;
  p.add_op(alloc, {s});                               // compute stream, waits for op 0
  p.add_op(compute_op(1'000'000'000));                // queued behind the alloc
  Timeline t = simulate(p, c);
  EXPECT_DOUBLE_EQ(t.ops[1].start_s, 2e-3);
  EXPECT_DOUBLE_EQ(t.ops[1].end_s, 2e-3);
  EXPECT_DOUBLE_EQ(t.ops[2].start_s, 2e-3);

  p.ranks = 3;
  std::string m = input_error_of([&] { simulate(p, c); });
  EXPECT_THAT(m, HasSubstr("has 2 GPUs but the plan needs 3 ranks"));
}

TEST(Timeline, TenThousandOpsIsFast) {
  const Cluster c = parse_cluster_spelling("8xA100-80GB");
  Program p;
  p.ranks = 8;
  p.ops.reserve(10000);
  std::int32_t prev_compute = -1;
  for (int i = 0; i < 10000; ++i) {
    if (i % 4 == 3) {
      Op ar;
      ar.kind = OpKind::collective;
      ar.stream = Stream::comm;
      ar.collective = Collective::all_reduce;
      ar.group_size = 8;
      ar.bytes = 25'000'000;
      p.add_op(ar, {prev_compute});
    } else {
      Op op = compute_op(50'000'000);
      op.kernel = Kernel::linear_fwd;
      op.work.flops = 1e11;
      op.work.gemm_m = op.work.gemm_n = op.work.gemm_k = 4096;
      prev_compute = p.add_op(op);
    }
  }
  double best = 1e9;
  Timeline t;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    t = simulate(p, c);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  EXPECT_GT(t.step_s, 0.0);
  // Target: well under a millisecond in a release build; the bound leaves room for a shared
  // machine and unoptimised builds.
  EXPECT_LT(best, 20e-3);
  RecordProperty("simulate_10k_ops_us", static_cast<int>(best * 1e6));
  std::printf("simulate(10k ops): %.1f us\n", best * 1e6);
}

// --- trace -----------------------------------------------------------------------------------

Program small_program() {
  Program p;
  p.ranks = 2;
  p.tokens_per_step = 100;
  const int w = p.add_buffer("weights", MemCategory::base_weights, 1ULL << 30);
  const int act = p.add_buffer("act", MemCategory::activations, 1ULL << 29);
  const int st = p.add_buffer("adam", MemCategory::host_optimizer_states, 1ULL << 31);
  Op a;
  a.kind = OpKind::alloc;
  a.phase = Phase::setup;
  a.buffer = w;
  p.add_op(a);
  a.buffer = st;
  p.add_op(a);
  a.phase = Phase::forward;
  a.buffer = act;
  p.add_op(a);
  Op f = compute_op(1'000'000'000);
  f.label = "q_proj";
  f.layer = 0;
  const int fwd = p.add_op(f);
  Op ar;
  ar.kind = OpKind::collective;
  ar.stream = Stream::comm;
  ar.phase = Phase::backward;
  ar.collective = Collective::all_reduce;
  ar.group_size = 2;
  ar.bytes = 80'000'000;
  p.add_op(ar, {fwd});
  Op fr;
  fr.kind = OpKind::free;
  fr.phase = Phase::backward;
  fr.buffer = act;
  p.add_op(fr, {fwd});
  return p;
}

TEST(Trace, ChromeTraceHasTheRequiredFields) {
  const Cluster c = round_cluster();
  Program p = small_program();
  Timeline t = simulate(p, c);
  TraceOptions o;
  o.ranks = 2;
  nlohmann::json j = nlohmann::json::parse(chrome_trace(p, t, o).dump());
  ASSERT_TRUE(j["traceEvents"].is_array());
  EXPECT_EQ(j["displayTimeUnit"], "ms");
  EXPECT_EQ(j["distributedInfo"]["world_size"], 2);
  int complete = 0, counters = 0, process_names = 0, thread_names = 0;
  for (const auto& e : j["traceEvents"]) {
    for (const char* key : {"name", "ph", "ts", "pid", "tid"}) EXPECT_TRUE(e.contains(key)) << e;
    const std::string ph = e["ph"];
    if (ph == "X") {
      ++complete;
      EXPECT_TRUE(e.contains("dur"));
      EXPECT_TRUE(e["args"].contains("phase"));
      EXPECT_TRUE(e["args"].contains("layer"));
      EXPECT_TRUE(e["args"].contains("kind"));
      if (e["name"] == "q_proj") {
        EXPECT_DOUBLE_EQ(e["ts"].get<double>(), 0.0);
        EXPECT_NEAR(e["dur"].get<double>(), 1000.0, 1e-9);  // 1 ms in microseconds
        EXPECT_EQ(e["args"]["kernel"], "residual_add");
        EXPECT_EQ(e["tid"], 1);
      }
      if (e["name"] == "all_reduce") {
        EXPECT_NEAR(e["ts"].get<double>(), 1000.0, 1e-9);
        EXPECT_EQ(e["args"]["bytes"], 80'000'000);
        EXPECT_EQ(e["cat"], "nccl");
      }
    } else if (ph == "C") {
      ++counters;
      EXPECT_TRUE(e["args"].is_object());
    } else if (ph == "M") {
      if (e["name"] == "process_name") ++process_names;
      if (e["name"] == "thread_name") ++thread_names;
      EXPECT_TRUE(e["args"].is_object());
    }
  }
  EXPECT_EQ(complete, 2 * 2);       // q_proj and all_reduce, for each of 2 ranks
  EXPECT_EQ(process_names, 2);
  EXPECT_EQ(thread_names, 2 * kNumStreams);
  EXPECT_EQ(counters, 2 * 4 * 4);   // 4 alloc/free samples × 4 counters × 2 ranks
  // The device total after the activations' alloc: 1 GiB + 0.5 GiB.
  bool saw_peak = false;
  for (const auto& e : j["traceEvents"])
    if (e["ph"] == "C" && e["name"] == "device memory (GiB)" &&
        std::abs(e["args"]["total"].get<double>() - 1.5) < 1e-12)
      saw_peak = true;
  EXPECT_TRUE(saw_peak);
}

TEST(Trace, MemoryOnlyVariantHasOnlyCountersAndMetadata) {
  Program p = small_program();
  nlohmann::json j = chrome_memory_trace(p);
  int counters = 0;
  for (const auto& e : j["traceEvents"]) {
    EXPECT_TRUE(e["ph"] == "C" || e["ph"] == "M") << e;
    counters += e["ph"] == "C";
  }
  EXPECT_EQ(counters, 4 * 4);
  Timeline t = simulate(p, round_cluster());
  EXPECT_EQ(chrome_memory_trace(p, t)["otherData"]["step_s"], t.step_s);
}

// --- memory walk -----------------------------------------------------------------------------

TEST(Memory, WalkOfAHandBuiltProgram) {
  Program p;
  const int w = p.add_buffer("weights", MemCategory::base_weights, 100);
  const int a1 = p.add_buffer("act1", MemCategory::activations, 50);
  const int ws = p.add_buffer("scores", MemCategory::workspace, 20);
  const int a2 = p.add_buffer("act2", MemCategory::activations, 30);
  const int h = p.add_buffer("adam", MemCategory::host_optimizer_states, 1000);
  auto mem = [&](OpKind k, int b) {
    Op op;
    op.kind = k;
    op.buffer = b;
    return p.add_op(op);
  };
  mem(OpKind::alloc, w);    // 0: 100
  mem(OpKind::alloc, h);    // 1: host 1000
  mem(OpKind::alloc, a1);   // 2: 150
  mem(OpKind::alloc, ws);   // 3: 170
  mem(OpKind::free, ws);    // 4: 150
  const int peak = mem(OpKind::alloc, a2);  // 5: 180, the device peak
  mem(OpKind::free, a1);    // 6: 130
  mem(OpKind::free, a2);    // 7: 100
  MemoryProfile m = walk_memory(p);
  EXPECT_EQ(m.device_peak_bytes, 180u);
  EXPECT_EQ(m.device_peak_op, peak);
  EXPECT_EQ(m.host_peak_bytes, 1000u);
  EXPECT_EQ(m.host_peak_op, 1);
  EXPECT_EQ(m.category_peak_bytes[static_cast<int>(MemCategory::activations)], 80u);
  EXPECT_EQ(m.category_peak_bytes[static_cast<int>(MemCategory::workspace)], 20u);
  // The simultaneous peak has no workspace: 100 + 80 = 180, not the sum of peaks (200).
  EXPECT_EQ(m.at_peak_bytes[static_cast<int>(MemCategory::workspace)], 0u);
  EXPECT_EQ(m.at_peak_bytes[static_cast<int>(MemCategory::activations)], 80u);
  EXPECT_EQ(m.end_bytes[static_cast<int>(MemCategory::base_weights)], 100u);
  EXPECT_EQ(m.end_bytes[static_cast<int>(MemCategory::activations)], 0u);
  EXPECT_EQ(memory_timeline(p).size(), 8u);
  EXPECT_TRUE(verify(p).empty());
  mem(OpKind::free, a2);  // freed twice: a bug in the program, not bad input, which the contract
  EXPECT_THROW(verify_or_throw(p), InternalError);  // check (make_plan's, before the walk) rejects
}

}  // namespace
}  // namespace peftplan::sim

namespace peftplan::sim {
namespace {

// A calibrated host: kernel factors multiply the roofline, copies their own factor, and a
// collective table replaces the ring model for its kind and group size (piecewise linear in
// bytes, flat below the first size, the last slope above the last).
TEST(HostCalibration, KernelScalesCopyScaleAndCollectiveTables) {
  Cluster c = default_cluster(2);
  ComputeWork w;
  w.flops = 1e9;
  w.bytes_moved = 1 << 20;
  const double base = device_compute_cost(w, Kernel::norm_fwd, c, DType::fp32).time_s;
  const double copy = copy_time_s(1 << 20, c);
  const double ring = collective_cost(Collective::all_gather, 1 << 20, 2, c, CollectiveAlgorithm::ring).time_s;
  c.host_calibration.kernel_scale[static_cast<std::size_t>(Kernel::norm_fwd)] = 3.0;
  c.host_calibration.copy_scale = 2.0;
  const double launch = c.efficiency.kernel_launch_s;
  EXPECT_NEAR(device_compute_cost(w, Kernel::norm_fwd, c, DType::fp32).time_s - launch, 3.0 * (base - launch), 1e-12);
  EXPECT_NEAR(copy_time_s(1 << 20, c) - launch, 2.0 * (copy - launch), 1e-12);
  CollectiveTable t{static_cast<std::int32_t>(Collective::all_gather), 2, {1000.0, 2000.0, 4000.0}, {1e-5, 2e-5, 6e-5}};
  c.host_calibration.collectives = {t};
  EXPECT_DOUBLE_EQ(table_time_s(t, 10.0), 1e-5);
  EXPECT_NEAR(table_time_s(t, 1500.0), 1.5e-5, 1e-15);
  EXPECT_NEAR(table_time_s(t, 3000.0), 4e-5, 1e-15);
  EXPECT_NEAR(table_time_s(t, 8000.0), 14e-5, 1e-15);  // last slope: 2e-8 s/B
  EXPECT_NEAR(collective_cost(Collective::all_gather, 3000, 2, c, CollectiveAlgorithm::ring).time_s, 4e-5, 1e-15);
  // Other kinds keep the ring model.
  EXPECT_DOUBLE_EQ(collective_cost(Collective::all_gather, 1 << 20, 2, default_cluster(2), CollectiveAlgorithm::ring).time_s, ring);
  EXPECT_NE(collective_cost(Collective::all_reduce, 3000, 2, c, CollectiveAlgorithm::ring).time_s, 4e-5);
  // JSON round trip, and defaults stay empty (GPU clusters unchanged).
  const Cluster back = cluster_from_json(cluster_to_json(c), "c.json");
  EXPECT_DOUBLE_EQ(back.host_calibration.kernel_scale[static_cast<std::size_t>(Kernel::norm_fwd)], 3.0);
  EXPECT_DOUBLE_EQ(back.host_calibration.copy_scale, 2.0);
  ASSERT_EQ(back.host_calibration.collectives.size(), 1u);
  EXPECT_EQ(back.host_calibration.collectives[0].seconds, t.seconds);
  EXPECT_FALSE(cluster_to_json(default_cluster(2)).contains("host_calibration"));
  nlohmann::json bad = cluster_to_json(c);
  bad["host_calibration"]["kernel_scale"]["no_such_kernel"] = 1.0;
  EXPECT_THROW(cluster_from_json(bad, "c.json"), InputError);
}

}  // namespace
}  // namespace peftplan::sim

// A calibrated profile that lacks a kernel's scale (made before calibrate measured it) names that
// kernel, once, for the program that runs it; host-stream ops (timed per parameter) and an
// uncalibrated catalog cluster name none.
TEST(Calibration, UncalibratedKernelsAreTheProgramsKernelsTheProfileLacks) {
  using namespace peftplan::sim;
  Program p;
  for (const Kernel k : {Kernel::linear_fwd, Kernel::flash_attention_fwd, Kernel::flash_attention_fwd, Kernel::flash_attention_bwd}) {
    Op op;
    op.kind = OpKind::compute;
    op.kernel = k;
    p.ops.push_back(op);
  }
  Op host;
  host.kind = OpKind::compute;
  host.stream = Stream::host;
  host.kernel = Kernel::optimizer_step;
  p.ops.push_back(host);
  Cluster c = parse_cluster_spelling("1xA100-80GB");
  EXPECT_TRUE(uncalibrated_kernels(p, c).empty());  // a catalog GPU: nothing is calibrated
  c.host_calibration.kernel_scale[static_cast<std::size_t>(Kernel::linear_fwd)] = 1.2;
  EXPECT_EQ(uncalibrated_kernels(p, c), (std::vector<Kernel>{Kernel::flash_attention_fwd, Kernel::flash_attention_bwd}));
  c.host_calibration.kernel_scale[static_cast<std::size_t>(Kernel::flash_attention_fwd)] = 5.1;
  c.host_calibration.kernel_scale[static_cast<std::size_t>(Kernel::flash_attention_bwd)] = 2.9;
  EXPECT_TRUE(uncalibrated_kernels(p, c).empty());
}
