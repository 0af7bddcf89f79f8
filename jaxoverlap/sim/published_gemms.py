"""Published GEMM throughputs by operand class and machine, and the fits they give.

16-bit GEMMs on the H100 (the rows ``sim.published.fit_h100`` fits with the serial calls), FP8
GEMMs on the H100 die (``fit_fp8``: the FP8 class's own efficiency and K curve, instead of the
datasheet's FP8 peak times the 16-bit fit's efficiency), and Blackwell's 16-bit, FP8 and MXFP8
GEMMs (``fit_b200``). Rows marked ``held_out`` are shown against the model
(``sim.published.evaluate_inputs``) but fitted to nothing: they check the fits. Every number is
someone else's measurement of their own kernel, read from the public source named in the row.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxoverlap.sim import fit
from jaxoverlap.sim.presets import Preset, gemm_class

FLUX = "bytedance/flux README 'Performance' (commit 239a13d)"
MAMF = "stas00/ml-engineering compute/accelerator/README.md (MAMF table)"
TRITON2339 = "triton-lang/triton#2339"
DEEPGEMM = ("deepseek-ai/DeepGEMM README 'Normal GEMMs for dense models' (commit 989c9e3; H800 "
            "SXM5, the H100 die)")
VLLM49363 = "vllm-project/vllm PR #49363 (H100, benchmark_fp8_gemm.py)"
FBGEMM2546 = "pytorch/FBGEMM PR #2546 ('H100 500W')"
AO2427 = "pytorch/ao PR #2427 (B200, benchmarks/float8/bench_matmul.py)"
TE1747 = "NVIDIA/TransformerEngine#1747 (HGX B200, FP8 te.Linear)"
HELION2756 = "pytorch/helion PR #2756 (B200, torch._scaled_mm rowwise)"
VLLM19566 = "vllm-project/vllm PR #19566 (B200, FP8 CUTLASS)"
FLASHINFER2464 = "flashinfer-ai/flashinfer PR #2464 (B200, mm_mxfp8, CUTLASS)"


@dataclass(frozen=True)
class GemmRow:
    """A published GEMM alone: d = a @ w of [m, k] x [k, n] at ``tflops``."""

    id: str
    source: str
    machine: str
    m: int
    n: int
    k: int
    dtype: str
    tflops: float
    block_scaled: bool = False  # fp8 with 1x32 block scales (MXFP8)
    held_out: bool = False  # a check of the fits, not fitted
    note: str = ""

    @property
    def seconds(self) -> float:
        return 2.0 * self.m * self.n * self.k / (self.tflops * 1e12)

    @property
    def cls(self) -> str:
        return gemm_class(self.dtype, self.block_scaled)

    def point(self) -> fit.GemmPoint:
        return fit.GemmPoint(self.m, self.n, self.k, self.seconds, self.dtype,
                             block_scaled=self.block_scaled)


def _rate(m: int, n: int, k: int, us: float) -> float:
    return 2.0 * m * n * k / (us * 1e-6) / 1e12


# 16-bit GEMMs on the H100 (fitted by sim.published.fit_h100 with the serial calls).
GEMMS: tuple[GemmRow, ...] = (
    GemmRow("MAMF", MAMF, "h100", 2048, 2048, 13312, "bfloat16", 794.5),
    GemmRow("T2339a", TRITON2339, "h100", 2048, 8192, 8192, "float16", 721.6),
    GemmRow("T2339b", TRITON2339, "h100", 2048, 4096, 4096, "float16", 613.7),
    # F1/F2's GEMMs alone ran on H800, the H100 die (same SMs and clocks).
    GemmRow("F1-gemm", FLUX, "h100", 4096, 6144, 12288, "float16", _rate(4096, 6144, 12288, 846)),
    GemmRow("F2-gemm", FLUX, "h100", 4096, 12288, 6144, "float16", _rate(4096, 12288, 6144, 818)),
)

_DG_NOTE = ("⚠ DeepGEMM's kernel with 1x128 / 128x128 block scales and FP32 promotion on CUDA "
            "cores, timed by the profiler (no launch); H800 SXM5 has the H100's SMs, clocks and "
            "HBM")
# FP8 GEMMs at M 4096 on the H100 die (fitted by fit_fp8): the class's efficiency and K curve.
FP8_GEMMS: tuple[GemmRow, ...] = tuple(
    GemmRow(f"DG-{n}x{k}", DEEPGEMM, "h100", 4096, n, k, "float8_e4m3fn", tflops, note=_DG_NOTE)
    for n, k, tflops in ((2112, 7168, 1127.0), (24576, 1536, 1212.0), (32768, 512, 775.0),
                         (7168, 16384, 1520.0), (4096, 7168, 1410.0), (7168, 2048, 1168.0)))

_VLLM_NOTE = ("N 12288, K 5376 (google/gemma-4-31B-it); FP8 with per-tensor scales, "
              "activations not quantized in the timed call")
_FB_NOTE = ("the 500 W H100 of the symm-mem rows (h100-hbm2e); FP8 rowwise CUTLASS, the GEMM "
            "alone (quantization not timed); its FP8 fit is the h100's scaled like its 16-bit "
            "one (an assumption these rows check)")
# Held out: decode-size GEMMs on the H100 (the FP8 gain is halved weight bytes, not the peak),
# and the same GEMMs in BF16 and FP8 on one 500 W machine (the FP8 / BF16 ratio).
FP8_CHECKS: tuple[GemmRow, ...] = (
    *(GemmRow(f"VL49363-{d}-M{m}", VLLM49363, "h100", m, 12288, 5376,
              "float8_e4m3fn" if d == "fp8" else "bfloat16", t, held_out=True, note=_VLLM_NOTE)
      for d, rates in (("fp8", (5.16, 83.1, 318.4, 581.8)), ("bf16", (2.87, 46.5, 182.6, 352.6)))
      for m, t in zip((1, 16, 64, 128), rates, strict=True)),
    *(GemmRow(f"FB2546-{d}-{m}x{n}x{k}", FBGEMM2546, "h100-hbm2e", m, n, k,
              "float8_e4m3fn" if d == "fp8" else "bfloat16", t, held_out=True, note=_FB_NOTE)
      for (m, n, k), bf16, fp8 in (((8192, 8192, 8192), 585.23, 1125.51),
                                   ((65536, 8192, 7168), 575.12, 1082.75),
                                   ((65536, 3584, 8192), 546.31, 1141.38))
      for d, t in (("bf16", bf16), ("fp8", fp8))),
)

# Blackwell (fitted by fit_b200): 16-bit, FP8 and MXFP8 GEMMs on a B200.
_AO_NOTE = "square BF16 matmuls, torch.mm (cuBLAS)"
_B200_FP8_NOTE = "⚠ {}: FP8 with tensor or row scales; the harness may not time the launch"
B200_GEMMS: tuple[GemmRow, ...] = (
    GemmRow("MAMF-B200", MAMF, "b200", 1792, 16128, 3072, "bfloat16", 1745.0, held_out=True,
            note="the best of a search over shapes (short runs): held out, the typical shapes "
                 "run 10-20% slower"),
    *(GemmRow(f"AO2427-{s}", AO2427, "b200", s, s, s, "bfloat16", t, note=_AO_NOTE)
      for s, t in ((2048, 1130.0), (3072, 1510.0), (4096, 1410.0), (6144, 1450.0),
                   (8192, 1420.0))),
    GemmRow("TE1747-8192", TE1747, "b200", 8192, 8192, 8192, "float8_e4m3fn", 2377.1,
            note=_B200_FP8_NOTE.format("a te.Linear forward (its casts may be in the time)")),
    GemmRow("HL2756-4096", HELION2756, "b200", 4096, 4096, 4096, "float8_e4m3fn", 1860.0,
            note=_B200_FP8_NOTE.format("'~1860' read off the PR text")),
    *(GemmRow(f"VL19566-M{m}", VLLM19566, "b200", m, 6144, 4096, "float8_e4m3fn", t,
              note=_B200_FP8_NOTE.format("N 6144, K 4096 (Llama-3.1-8B); the middle of the "
                                         "PR's per-tensor / per-channel range"))
      for m, t in ((128, 1030.0), (256, 1375.0), (512, 1891.0))),
    *(GemmRow(f"FI2464-{m}x{n}x{k}", FLASHINFER2464, "b200", m, n, k, "float8_e4m3fn", t,
              block_scaled=True, note="MXFP8 (1x32 e8m0 block scales), autotuned CUTLASS")
      for (m, n, k), t in (((1024, 2048, 1024), 790.0), ((1024, 4096, 4096), 2015.0),
                           ((8192, 8192, 4096), 3201.0), ((16384, 16384, 16384), 3100.0))),
)


# Every row, in the order of docs/performance.md's inputs table.
ALL: tuple[GemmRow, ...] = (*GEMMS, *FP8_GEMMS, *FP8_CHECKS, *B200_GEMMS)


def fit_fp8(p: Preset) -> Preset:
    """The FP8 class's efficiency and K curve on the H100 die from ``FP8_GEMMS`` (the fused
    kernel's FP8 tile is the kernel's own: ``_fused_gemm.FUSED_KERNELS``)."""
    return fit.fit_gemm(p, [g.point() for g in FP8_GEMMS])


def fit_b200(p: Preset) -> Preset:
    """The b200's 16-bit fit (with its per-kernel cost), then its FP8 and MXFP8 classes."""
    return fit.fit_gemm(p, [g.point() for g in B200_GEMMS if not g.held_out])
