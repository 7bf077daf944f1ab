"""The GPU catalogue: what the roofline needs to know about each accelerator, with the source of each number.

Peak FLOP/s are the *dense* BF16/FP16 tensor-core figures (the datasheets print the 2:4-sparsity figure
first; dense is half of it). Memory sizes are the datasheet GB taken as GiB, because HBM and GDDR come
in binary capacities; the driver keeps a few hundred MiB of that, which the KV-capacity reserve covers.
Interconnect is the per-GPU *bidirectional* bandwidth the datasheet quotes (NVLink where the board has it
on every GPU, otherwise the PCIe slot); one direction carries half of it.

Sources (NVIDIA datasheets unless noted):
  [A100]  NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf):
          BF16 312 TFLOPS dense (624 sparse); 40GB HBM2 1,555 GB/s (SXM and PCIe); 80GB HBM2e 2,039 GB/s
          (SXM) / 1,935 GB/s (PCIe); NVLink 600 GB/s (SXM); PCIe Gen4 64 GB/s (PCIe cards).
  [H100]  NVIDIA H100 Tensor Core GPU datasheet: SXM BF16 1,979 TFLOPS sparse (989 dense), 80GB HBM3
          3.35 TB/s, NVLink 900 GB/s; PCIe BF16 1,513 sparse (756 dense), 80GB HBM2e 2.0 TB/s, PCIe Gen5 128 GB/s.
  [H200]  NVIDIA H200 Tensor Core GPU datasheet: SXM BF16 1,979 TFLOPS sparse (989 dense), 141GB HBM3e
          4.8 TB/s, NVLink 900 GB/s.
  [L40S]  NVIDIA L40S datasheet (l40s-datasheet; its table as resellers reproduce it, e.g. mullet.se product
          355414, beside the L40's): BF16/FP16 "362.05 | 733*" TFLOPS, FP8 "733 | 1,466*", "* With Sparsity", so
          362.05 is the dense figure (the L40's is 181.05 | 362.1*); 48GB GDDR6 864 GB/s, PCIe Gen4 x16 64 GB/s
          bidirectional, no NVLink.
  [L4]    NVIDIA L4 Tensor Core GPU datasheet: BF16 242 TFLOPS sparse (121 dense), 24GB GDDR6 300 GB/s,
          PCIe Gen4 x16 64 GB/s.
  [A10G]  AWS publishes no datasheet for its A10G (EC2 G5); Baseten, "NVIDIA A10 vs A10G for ML model
          inference" (baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference): BF16/FP16 tensor
          70 TFLOPS dense, 24GB GDDR6 600 GB/s; PCIe Gen4 x16 64 GB/s.
  [A40]   NVIDIA A40 datasheet: BF16 149.7 TFLOPS dense (299.4 sparse), 48GB GDDR6 696 GB/s, PCIe Gen4
          64 GB/s (NVLink bridge 112.5 GB/s joins only pairs, so PCIe is the general case).
  [B200]  NVIDIA DGX B200 datasheet and HGX B200 specifications, per GPU (the system figures over its 8 GPUs):
          FP16/BF16 4.5 PFLOPS sparse (2.25 dense), FP8 9 PFLOPS sparse (4.5 dense), INT8 9 POPS sparse (4.5
          dense); 180GB HBM3e (1,440GB per DGX) at 8 TB/s (64 TB/s per DGX); NVLink 5 1.8 TB/s (14.4 TB/s per
          HGX). MLPerf Inference v6.0 system descriptions name the part "NVIDIA B200-SXM-180GB". Measured on a
          part (pytorch/ao pull request 4002): CUDA reports 178.35 GiB and a 7,680-bit bus at 3,996 MHz, 7.67 TB/s,
          so the datasheet's 180 and 8 TB/s run 1-4% above what vLLM sees.
  [H20]   NVIDIA H20 product specification (China-market Hopper; no public datasheet link, the figures as NVIDIA's
          partners publish them): BF16 148 TFLOPS, FP8 296 TFLOPS, INT8 296 TOPS (dense), 96GB HBM3 4.0 TB/s,
          NVLink 900 GB/s.
  [MI300X] AMD Instinct MI300X data sheet (AMD prints the dense figure first, then "with structured sparsity"):
          BF16/FP16 1,307.4 TFLOPS (2,614.9 sparse), FP8 2,614.9 TFLOPS (5,229.8 sparse), INT8 2,614.9 TOPS
          (5,229.8 sparse); 192GB HBM3 5.3 TB/s; 7 Infinity Fabric links of 128 GB/s each, 896 GB/s in all. The
          links join each GPU to each of 7 peers, so a TP group of 2 or 4 uses 1 or 3 of them: the roofline's
          all-reduce, which takes the 896 GB/s, is optimistic below TP 8 on this GPU.
  FP8 and INT8 (same datasheets, dense = half the sparse figure): A100 INT8 624 TOPS; H100 SXM FP8 and INT8
  1,979; H100 PCIe 1,513; H200 1,979; L40S 733; L4 242.5; A40 INT8 299.3. AWS gives no INT8 figure for A10G.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GIB = 2**30
TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True)
class GpuSpec:
    name: str
    description: str
    peak_flops_per_s: float          # dense BF16/FP16 tensor-core FLOP/s
    memory_bytes_per_s: float        # HBM/GDDR bandwidth
    memory_bytes: float              # device memory
    interconnect_bytes_per_s: float  # per-GPU bidirectional link bandwidth used by tensor parallelism
    interconnect: str
    source: str
    # Dense FP8 and INT8 tensor-core rates (FLOP/s, op/s); None where the GPU has no such tensor cores (FP8
    # before Hopper/Ada), so FP8 matmuls there fall back to weight-only kernels at the BF16 rate.
    peak_fp8_flops_per_s: Optional[float] = None
    peak_int8_ops_per_s: Optional[float] = None


GPUS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in [
        GpuSpec("a100-40gb", "A100 SXM4 40GB", 312 * TERA, 1555 * GIGA, 40 * GIB, 600 * GIGA, "NVLink 3", "[A100]",
                peak_int8_ops_per_s=624 * TERA),
        GpuSpec("a100-80gb", "A100 SXM4 80GB", 312 * TERA, 2039 * GIGA, 80 * GIB, 600 * GIGA, "NVLink 3", "[A100]",
                peak_int8_ops_per_s=624 * TERA),
        GpuSpec("a100-40gb-pcie", "A100 PCIe 40GB", 312 * TERA, 1555 * GIGA, 40 * GIB, 64 * GIGA, "PCIe Gen4 x16",
                "[A100]", peak_int8_ops_per_s=624 * TERA),
        GpuSpec("a100-80gb-pcie", "A100 PCIe 80GB", 312 * TERA, 1935 * GIGA, 80 * GIB, 64 * GIGA, "PCIe Gen4 x16",
                "[A100]", peak_int8_ops_per_s=624 * TERA),
        GpuSpec("h100-80gb", "H100 SXM5 80GB", 989 * TERA, 3350 * GIGA, 80 * GIB, 900 * GIGA, "NVLink 4", "[H100]",
                peak_fp8_flops_per_s=1979 * TERA, peak_int8_ops_per_s=1979 * TERA),
        GpuSpec("h100-80gb-pcie", "H100 PCIe 80GB", 756 * TERA, 2000 * GIGA, 80 * GIB, 128 * GIGA, "PCIe Gen5 x16",
                "[H100]", peak_fp8_flops_per_s=1513 * TERA, peak_int8_ops_per_s=1513 * TERA),
        GpuSpec("h200", "H200 SXM 141GB", 989 * TERA, 4800 * GIGA, 141 * GIB, 900 * GIGA, "NVLink 4", "[H200]",
                peak_fp8_flops_per_s=1979 * TERA, peak_int8_ops_per_s=1979 * TERA),
        GpuSpec("l40s", "L40S 48GB", 362.05 * TERA, 864 * GIGA, 48 * GIB, 64 * GIGA, "PCIe Gen4 x16", "[L40S]",
                peak_fp8_flops_per_s=733 * TERA, peak_int8_ops_per_s=733 * TERA),
        GpuSpec("l4", "L4 24GB", 121 * TERA, 300 * GIGA, 24 * GIB, 64 * GIGA, "PCIe Gen4 x16", "[L4]",
                peak_fp8_flops_per_s=242.5 * TERA, peak_int8_ops_per_s=242.5 * TERA),
        GpuSpec("a10g", "A10G 24GB (AWS G5)", 70 * TERA, 600 * GIGA, 24 * GIB, 64 * GIGA, "PCIe Gen4 x16", "[A10G]"),
        GpuSpec("a40", "A40 48GB", 149.7 * TERA, 696 * GIGA, 48 * GIB, 64 * GIGA, "PCIe Gen4 x16", "[A40]",
                peak_int8_ops_per_s=299.3 * TERA),
        GpuSpec("b200", "B200 SXM 180GB", 2250 * TERA, 8000 * GIGA, 180 * GIB, 1800 * GIGA, "NVLink 5", "[B200]",
                peak_fp8_flops_per_s=4500 * TERA, peak_int8_ops_per_s=4500 * TERA),
        GpuSpec("h20", "H20 96GB", 148 * TERA, 4000 * GIGA, 96 * GIB, 900 * GIGA, "NVLink 4", "[H20]",
                peak_fp8_flops_per_s=296 * TERA, peak_int8_ops_per_s=296 * TERA),
        GpuSpec("mi300x", "AMD Instinct MI300X 192GB", 1307.4 * TERA, 5300 * GIGA, 192 * GIB, 896 * GIGA,
                "Infinity Fabric, 7 links", "[MI300X]", peak_fp8_flops_per_s=2614.9 * TERA,
                peak_int8_ops_per_s=2614.9 * TERA),
    ]
}

# Other spellings people use for the same boards.
GPU_ALIASES: dict[str, str] = {
    "a100": "a100-80gb",
    "a100-sxm": "a100-80gb",
    "a100-80gb-sxm": "a100-80gb",
    "a100-sxm4-80gb": "a100-80gb",
    "a100-40gb-sxm": "a100-40gb",
    "a100-sxm4-40gb": "a100-40gb",
    "a100-pcie": "a100-80gb-pcie",
    "h100": "h100-80gb",
    "h100-sxm": "h100-80gb",
    "h100-80gb-sxm": "h100-80gb",
    "h100-sxm5-80gb": "h100-80gb",
    "h100-pcie": "h100-80gb-pcie",
    "h200-141gb": "h200",
    "h200-sxm": "h200",
    "b200-180gb": "b200",
    "b200-sxm": "b200",
    "b200-sxm-180gb": "b200",
    "nvidia-b200": "b200",
    "h20-96gb": "h20",
    "nvidia-h20": "h20",
    "mi300x-192gb": "mi300x",
    "instinct-mi300x": "mi300x",
    "amd-instinct-mi300x": "mi300x",
    "amd-mi300x": "mi300x",
}
