"""Hardware presets: plain data the cost model reads (no per-GPU code paths).

Every number is either cited (``sources``: a public measurement or datasheet),
fitted with ``sim.calibrate`` to the published measurements of ``sim.published``
(the source says which, and ``tests/sim/test_published.py`` re-fits them), or
marked as an assumption. A user with GPUs fits a preset to their own machine with
``python -m jaxoverlap bench --calibrate`` and saves it as JSON
(``Preset.to_json`` / ``load_preset(path)``).

Units: bandwidths in GB/s (1e9 bytes/s) per GPU per direction, compute in
TFLOP/s (dense), latencies in microseconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from jaxoverlap import _kinds

DTYPES = _kinds.names(_kinds.DTYPES)
FP8_DTYPES = _kinds.names(_kinds.DTYPES, fp8=True)


def canonical_dtype(dtype: str) -> str:
    """'bf16' -> 'bfloat16' etc. (a dtype's short name, the executors' in a program's "dtype",
    or an alias: ``_kinds``); raises on anything the executors do not support."""
    try:
        return _kinds.dtype(str(dtype)).name
    except ValueError:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}") from None


def dtype_bytes(dtype: str) -> int:
    return _kinds.dtype(canonical_dtype(dtype)).bytes


def output_dtype(dtype: str) -> str:
    """What a GEMM of ``dtype`` operands writes: bfloat16 for fp8 (the ops' default
    ``preferred_element_type``, what FP8 training recipes use), else the operands' dtype."""
    name = canonical_dtype(dtype)
    return "bfloat16" if name in FP8_DTYPES else name


# ---- what the fits of sim.published give (tests/sim/test_published.py re-fits them) ---------
# The h100 fit (its interference uses the copy engine's start and ramp) and the fused-path
# fit (on a machine derived from the h100) depend on each other: these are their fixed point,
# each fit re-run on the other's result gives back its own numbers.

# The h100's GEMM, NCCL and interference numbers (sim.published.fit_h100).
H100_FIT = dict(gemm_efficiency=0.7884, gemm_k_half=807.9, gemm_overhead_us=8.72,
                nccl_gbps=375.5, nccl_ramp_us=0.451, interference=1.343, nccl_sms=39)
# The fused path's per-step costs, shared by every preset (sim.published.fit_fixed_costs).
FUSED_PATH_FIT = dict(ce_latency_us=16.92, ce_ramp_us=6.78, signal_latency_us=6.78,
                      event_latency_us=6.78, host_op_us=6.78, host_call_us=33.8)
# A multicast kernel's start (sim.published.fit_one_shot): published one-shot all-reduces of
# small messages on 8xH100, less the fused path's flag round.
ONE_SHOT_FIT = dict(mc_latency_us=1.87)
# The fused GEMM (docs/gpu-internals.md §5): CUTLASS's stock sm90 kernel with 128x256 CTA tiles; its
# speed alone relative to cuBLAS's at the same shape is an assumption from the published fused GEMMs
# alone (sim.published.FUSED_GEMMS_ALONE; the source below says which).
FUSED_GEMM = dict(fused_gemm_rate=0.975, fused_gemm_tile=(128, 256))
# The chooser's margins per op (sim.published.fallback_margin): the model's worst serial
# error, and for GEMM+RS on the h100 its optimism against Flux's published losses (F8);
# GEMM+AR (no published row) the larger of the two.
MARGINS = {"h100": {"ag_matmul": 0.076, "matmul_rs": 0.372, "matmul_ar": 0.372},
           "other": {"ag_matmul": 0.076, "matmul_rs": 0.076, "matmul_ar": 0.076}}


@dataclass(frozen=True)
class Preset:
    """One machine: a TP group of GPUs behind one switch (or PCIe fabric).

    The link model: each GPU has one egress and one ingress port of ``link_gbps``
    (NVSwitch: full bisection, so only the GPU's own ports contend). A transport
    reaches a fraction of the line rate (protocol overhead): a byte sent by NCCL
    costs ``link_gbps / nccl_gbps`` wire bytes, by the copy engine
    ``link_gbps / p2p_gbps``, by multicast ``link_gbps / multicast_gbps``. Each
    transfer also pays a fixed start (``*_latency_us``) and a size-dependent ramp
    (``*_ramp_us`` per hop, ``model.pipelined_time``).
    """

    name: str
    gpu: str
    sms: int  # streaming multiprocessors
    # Dense tensor-core peak per dtype (float32 = TF32; "float8": both FP8 formats, absent on
    # GPUs without FP8 tensor cores, whose FP8 GEMMs XLA computes dequantized: the BF16 rate).
    peak_tflops: dict[str, float]
    gemm_efficiency: float  # achieved / peak, measured at gemm_best_shape
    hbm_gbps: float  # memory bandwidth (memory-bound GEMMs, Add, interference)
    link_gbps: float  # NVLink / PCIe line rate per direction per GPU
    nccl_gbps: float  # NCCL ring all-gather / reduce-scatter bus bandwidth, large messages
    p2p_gbps: float | None  # copy-engine peer copies (None: no peer access)
    multicast_gbps: float | None  # multimem.st / ld_reduce throughput (None: no multicast)
    # Defaults below: the fitted h100's (a preset built from scratch starts there).
    # GEMM shape: eff = gemm_efficiency * min(1, s(m,n,k) / s(best shape)), s = tile and
    # wave quantisation (model.quantisation) x f(k), f(x) = x / (x + x_half).
    gemm_best_shape: tuple[int, int, int] = (2048, 2048, 13312)  # m, n, k
    gemm_m_half: float = 0.0
    gemm_n_half: float = 0.0
    gemm_k_half: float = H100_FIT["gemm_k_half"]
    gemm_tiles: tuple[tuple[int, int], ...] = ((128, 256), (256, 128), (128, 128), (64, 256),
                                               (64, 128))
    gemm_min_split_k: int = 256
    gemm_overhead_us: float = H100_FIT["gemm_overhead_us"]  # per kernel: launch, ramp, drain
    # Transfers: t = latency + (sqrt(hops * ramp) + sqrt(bytes / bandwidth))^2.
    nccl_p2p_gbps: float | None = None  # one NCCL send/recv's top rate (None: nccl_gbps)
    nccl_latency_us: float = 4.0  # per NCCL call / send-recv group (launch, rendezvous)
    nccl_ramp_us: float = H100_FIT["nccl_ramp_us"]  # per hop
    ce_latency_us: float = FUSED_PATH_FIT["ce_latency_us"]  # per copy: launch, DMA start
    ce_ramp_us: float = FUSED_PATH_FIT["ce_ramp_us"]
    mc_latency_us: float = ONE_SHOT_FIT["mc_latency_us"]  # per multicast kernel
    mc_ramp_us: float = H100_FIT["nccl_ramp_us"]
    signal_latency_us: float = FUSED_PATH_FIT["signal_latency_us"]  # Signal -> peer's Wait
    event_latency_us: float = FUSED_PATH_FIT["event_latency_us"]  # Record -> StreamWait; fork, join
    # Ops running together (model.compute_rate).
    nccl_sms: int = H100_FIT["nccl_sms"]  # SMs a running NCCL kernel takes from the GEMM
    mc_sms: int = 16  # SMs a running multicast kernel takes (assumption)
    # HBM bandwidth one SM of a memory-bound kernel moves (a reduction sized to the SMs a fused
    # GEMM leaves it: model.reduction_gbps).
    reduce_sm_gbps: float = 28.0
    interference: float = H100_FIT["interference"]  # slowdown per unit of HBM bandwidth moved
    # The host enqueues every op of a call (model.host_time).
    host_op_us: float = FUSED_PATH_FIT["host_op_us"]
    host_call_us: float = FUSED_PATH_FIT["host_call_us"]
    # The fused GEMM (sim.fused): one persistent GEMM waiting on per-block flags. Its code is
    # sm_90a, which runs on compute capability 9.0 alone (docs/gpu-internals.md §5); None: unknown,
    # the fused path is not offered.
    compute_capability: tuple[int, int] | None = None
    fused_gemm_rate: float = FUSED_GEMM["fused_gemm_rate"]  # its speed alone / cuBLAS's
    fused_gemm_tile: tuple[int, int] = FUSED_GEMM["fused_gemm_tile"]  # its CTA tile (M, N)
    # The chooser's fallback margin per op: a plan must be predicted this much faster
    # than the unfused path (derived from the model's measured error, sim.published).
    min_gain: dict[str, float] = field(default_factory=lambda: dict(MARGINS["h100"]))
    # Where the model was checked against measurements on this machine: ranges of
    # "gemm_flop" (one call's GEMM), "collective_bytes" (S) and, per op, the GEMM
    # FLOPs of the fused calls checked. Empty: nothing measured on this machine.
    calibrated: dict[str, tuple[float, float]] = field(default_factory=dict)
    description: str = ""
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:  # JSON gives lists; keep presets hashable-equal
        object.__setattr__(self, "gemm_best_shape", tuple(int(v) for v in self.gemm_best_shape))
        object.__setattr__(self, "fused_gemm_tile", tuple(int(v) for v in self.fused_gemm_tile))
        if self.compute_capability is not None:
            object.__setattr__(self, "compute_capability",
                               tuple(int(v) for v in self.compute_capability))
        object.__setattr__(self, "gemm_tiles", tuple((int(a), int(b)) for a, b in self.gemm_tiles))
        object.__setattr__(self, "calibrated", {k: (float(v[0]), float(v[1]))
                                                for k, v in self.calibrated.items()})
        object.__setattr__(self, "min_gain", {k: float(v) for k, v in self.min_gain.items()})

    def peak(self, dtype: str) -> float:
        """The dense peak (TFLOP/s) of a GEMM of ``dtype`` operands."""
        row = _kinds.dtype(canonical_dtype(dtype))
        if row.fp8:  # a machine without FP8 tensor cores: the BF16 rate
            return self.peak_tflops.get(row.peak, self.peak_tflops["bfloat16"])
        return self.peak_tflops[row.peak]

    def margin(self, op: str) -> float:
        """The fallback margin for ``op``; an op without one gets the largest the preset has
        (none at all: the largest derived for a built-in)."""
        largest = max(self.min_gain.values(), default=max(MARGINS["h100"].values()))
        return self.min_gain.get(op, largest)

    @property
    def fused_gemm(self) -> bool:
        """Whether the fused GEMM runs on this machine: compute capability 9.0 (Hopper) only;
        Blackwell and Ampere keep the chunked path."""
        return self.compute_capability == (9, 0)

    @property
    def transports(self) -> tuple[str, ...]:
        """Transports this machine supports: those with a rate (``_kinds``, each transport's
        preset keys; nccl always has one)."""
        return tuple(t.name for t in _kinds.TRANSPORTS if getattr(self, t.preset.gbps))

    def transport_gbps(self, transport: str) -> float:
        known = transport in _kinds.names(_kinds.TRANSPORTS)
        bw = getattr(self, _kinds.transport(transport).preset.gbps) if known else None
        if not bw:
            raise ValueError(f"preset {self.name!r} does not support transport {transport!r} "
                             f"(supports {self.transports})")
        return float(bw)

    def replace(self, **changes: Any) -> Preset:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Preset:
        """Builds a preset; a key ``"base"`` names a built-in preset to start from."""
        data = dict(data)
        base = data.pop("base", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"preset: unknown keys {unknown}; known: {sorted(known)}")
        if base is not None:
            return get_preset(base).replace(**data)
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING and f.name not in data)
        if missing:
            raise ValueError(f"preset: missing keys {missing} (or give \"base\": <preset name>)")
        return cls(**data)


# ---- numbers and sources shared by several presets -----------------------------------------

_MAMF = ("stas00/ml-engineering compute/accelerator/README.md, 'Maximum Achievable Matmul "
         "FLOPS comparison table' (BF16, mean of 100 iterations)")
_FITTED = "fitted with sim.calibrate by sim.published.{} to {}"
_GEMM_FIT = _FITTED.format("fit_h100", "the MAMF best shape, triton-lang/triton#2339, the "
                           "GEMM-alone times of the bytedance/flux README (H800: the same die) "
                           "and the serial times of bytedance/flux#90 (8xH100)")
_NCCL_FIT = _FITTED.format("fit_h100", "NVIDIA/Megatron-LM PR #5596 (AG/RS at 2-128 MiB) and "
                           "the 360-370 GB/s plateau of NVIDIA/nccl-tests #212/#326")
_INTERFERENCE_FIT = _FITTED.format("fit_h100", "pytorch/pytorch PR #172714 (an 8192^3 GEMM next "
                                   "to an all-gather: sequential, copy-engine, NCCL kernels)")
_FIXED_FIT = _FITTED.format("fit_fixed_costs", "the decomposed (chunked, copy-engine) AG+GEMM "
                            "of pytorch/pytorch PR #143160, 354 us, the published program "
                            "closest to ours; one common scale on these costs (their ratios are "
                            "assumptions). PyTorch eager dispatch is in that number, so they "
                            "may overstate a C++ executor's: refit with bench --calibrate")
_NCCL_P2P = ("NVIDIA/nccl-tests#268: sendrecv_perf between NVLink H100s plateaus ~180 GB/s "
             "(nvbandwidth 260), far below the ring collectives' ~360 (#326)")
_LINE = "assumption: the fitted h100's fraction of the line rate ({:.0f}/450 GB/s)"
_MARGIN = "derived: sim.published.fallback_margin (the model's measured error)"
_AS_H100 = "assumed as the fitted h100"

_CC = "NVIDIA CUDA GPUs, compute capability table (developer.nvidia.com/cuda-gpus): {}"
_FUSED_RATE = ("assumption from published fused GEMMs alone against cuBLAS at the same shape "
               "(sim.published.FUSED_GEMMS_ALONE): Flux's CUTLASS kernels 0.995-1.04 "
               "(bytedance/flux README, H800 and A800), symm-mem's Triton persistent GEMM "
               "0.975-1.01 with 128x256 / 256x128 tiles at K >= 8192, 0.82-0.90 with 128x128 "
               "tiles or K = 4096 (yifuwang/symm-mem-recipes README); ours is CUTLASS's stock "
               "sm90 kernel with 128x256 tiles (docs/gpu-internals.md §5), taken at the low end "
               "of the large-tile ratios. Never measured: refit on a GPU")
_FUSED_TILE = "docs/gpu-internals.md §5: the fused GEMM's CTA tile, 128 x 256 x 64"
_REDUCE_SM = ("assumption: Triton-distributed reduces on 15-16 SMs of an H800, "
              "'16 are enough ... The reduction kernel bandwidth is not a bottleneck if it "
              "exceeds 450GB' (ByteDance-Seed/Triton-distributed, python/triton_dist/kernels/"
              "nvidia/reduce_scatter.py): at least 450/16 = 28 GB/s per SM, taken as the rate. "
              "Never measured here: refit on a GPU")
_NCCL_FRACTION = H100_FIT["nccl_gbps"] / 450.0
_NCCL_P2P_FRACTION = 180.0 / 450.0
_CE_FRACTION = 380.0 / 450.0


def _flop(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k


_GIB, _MIB = 1 << 30, 1 << 20
# The ranges covered by each machine's published rows (sim.published.calibrated_ranges).
_ONE_FLUX_SHAPE = {"gemm_flop": (_flop(4096, 6144, 12288),) * 2,
                   "collective_bytes": (96.0 * _MIB,) * 2,
                   "ag_matmul": (_flop(4096, 6144, 12288),) * 2,
                   "matmul_rs": (_flop(4096, 6144, 12288),) * 2}
_CALIBRATED = {
    "h100": {"gemm_flop": (_flop(1024, 8192, 3584), _flop(32768, 7168, 8192)),
             "collective_bytes": (2.0 * _MIB, 8.0 * _GIB),
             "ag_matmul": (_flop(1024, 7168, 8192), _flop(32768, 7168, 8192)),
             "matmul_rs": (_flop(1024, 8192, 3584), _flop(32768, 8192, 3584))},
    "h800": {"gemm_flop": (_flop(8192, 1376, 4096), _flop(8192, 6656, 16384)),
             "collective_bytes": (96.0 * _MIB,) * 2,
             "ag_matmul": (_flop(8192, 1376, 4096), _flop(8192, 6656, 16384)),
             "matmul_rs": (_flop(8192, 4096, 1376), _flop(4096, 6144, 12288))},
    "a800": _ONE_FLUX_SHAPE,
    "pcie8": _ONE_FLUX_SHAPE,
}


def _per_link(line: float) -> dict[str, float]:
    """Transport rates of an NVLink/NVSwitch machine with the h100's protocol fractions."""
    return dict(link_gbps=line, nccl_gbps=round(line * _NCCL_FRACTION, 1),
                nccl_p2p_gbps=round(line * _NCCL_P2P_FRACTION, 1),
                p2p_gbps=round(line * _CE_FRACTION, 1))


_HOPPER = dict(
    sms=132,
    compute_capability=(9, 0),
    peak_tflops={"bfloat16": 989.0, "float16": 989.0, "float32": 494.7, "float8": 1979.0},
    gemm_best_shape=(2048, 2048, 13312),
    hbm_gbps=3350.0,
    mc_ramp_us=H100_FIT["nccl_ramp_us"],
    **{k: v for k, v in H100_FIT.items() if k != "nccl_gbps"},  # rates: _per_link
)
_HOPPER_SOURCES = {
    "compute_capability": _CC.format("H100, H800, H200: 9.0"),
    "fused_gemm_rate": _FUSED_RATE,
    "fused_gemm_tile": _FUSED_TILE,
    "peak_tflops": "NVIDIA H100 SXM datasheet: 989 TFLOP/s dense BF16/FP16, 494.7 TF32; FP8 "
                   "3,958 with sparsity, 1,979 dense",
    "sms": "H100 SXM5: 132 SMs (datasheet)",
    "hbm_gbps": "NVIDIA H100 SXM datasheet, 3.35 TB/s",
    "gemm_best_shape": f"{_MAMF}: H100 SXM 794.5 TFLOP/s = 80.3% at 2048x2048x13312 ('H200 "
                       "is the same')",
    "gemm_efficiency": _GEMM_FIT + "; below MAMF's 0.803: MAMF is the best of a search, the "
                       "GEMMs of the other rows run a few % slower",
    "gemm_k_half": _GEMM_FIT,
    "gemm_overhead_us": _GEMM_FIT,
    "gemm_tiles": "128x256 is the top Hopper GEMM config in bytedance/flux#100's tuning logs "
                  "(tile_shape=(128,256,64)); 256x128, 128x128 and 64-row tiles are the "
                  "CUTLASS sm90 alternatives (assumed equally efficient)",
    "nccl_gbps": _NCCL_FIT,
    "nccl_ramp_us": _NCCL_FIT,
    "nccl_p2p_gbps": _NCCL_P2P,
    "p2p_gbps": "p2pBandwidthLatencyTest on HGX H100 SXM: 380 GB/s unidirectional of 450 "
                "(NVIDIA/nccl#1264: '~783GByte/s out of theoretical 900GB/s' bidirectional)",
    "multicast_gbps": "assumption: NVLS stores / load-reduces at the NCCL rate",
    "interference": _INTERFERENCE_FIT,
    "nccl_sms": _INTERFERENCE_FIT,
    "latencies": _FIXED_FIT,
    "mc_latency_us": "fitted (sim.published.fit_one_shot) to vLLM's one-shot custom all-reduce "
                     "of 512 B and 4 KiB on H100, tp 2/4/8 (the table of sgl-project/sglang "
                     "PR #2904), less signal_latency_us",
    "min_gain": _MARGIN,
    "reduce_sm_gbps": _REDUCE_SM,
}

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            name="h100",
            gpu="H100 SXM 80GB, HGX 8-GPU, NVLink4 via NVSwitch",
            **_HOPPER,
            **_per_link(450.0),
            multicast_gbps=H100_FIT["nccl_gbps"],
            min_gain=MARGINS["h100"],
            calibrated=_CALIBRATED["h100"],
            description="The reference machine: HGX H100, where most published rows ran.",
            sources={**_HOPPER_SOURCES,
                     "link_gbps": "NVLink4 450 GB/s per direction (NVIDIA/nccl-tests#212, "
                                  "maintainer: '450GB/s is the line rate')",
                     "calibrated": "the h100 rows of sim.published"},
        ),
        Preset(
            name="h800",
            gpu="H800 SXM 80GB, HGX 8-GPU, NVLink4 (8 links) via NVSwitch",
            **_HOPPER,
            **_per_link(200.0),
            multicast_gbps=round(200.0 * _NCCL_FRACTION, 1),
            min_gain=MARGINS["other"],
            calibrated=_CALIBRATED["h800"],
            description="H100 compute with the export NVLink: 400 GB/s bidirectional.",
            sources={**_HOPPER_SOURCES,
                     "peak_tflops": "the H100 die: same SMs and tensor cores",
                     "link_gbps": "NVLink 400 GB/s bidirectional -> 200 per direction "
                                  "(bytedance/flux README 'Performance', 8xH800)",
                     "nccl_gbps": _LINE.format(H100_FIT["nccl_gbps"]),
                     "nccl_p2p_gbps": _LINE.format(180.0),
                     "p2p_gbps": _LINE.format(380.0),
                     "calibrated": "the h800 rows of sim.published"},
        ),
        Preset(
            name="h200",
            gpu="H200 SXM 141GB, HGX 8-GPU, NVLink4 via NVSwitch",
            **{**_HOPPER, "hbm_gbps": 4800.0},
            **_per_link(450.0),
            multicast_gbps=H100_FIT["nccl_gbps"],
            min_gain=MARGINS["h100"],
            description="H100 compute and NVLink with faster HBM3e.",
            sources={**_HOPPER_SOURCES,
                     "peak_tflops": "same Hopper die as H100 (NVIDIA H200 datasheet)",
                     "hbm_gbps": "NVIDIA H200 datasheet, 4.8 TB/s",
                     "link_gbps": "NVLink4, 450 GB/s per direction (as H100)",
                     "interference": _AS_H100 + " (faster HBM would lower it)",
                     "min_gain": "as h100 (no published row on this machine)"},
        ),
        Preset(
            name="a100",
            gpu="A100 SXM 80GB, HGX 8-GPU, NVLink3 via NVSwitch",
            sms=108,
            compute_capability=(8, 0),
            peak_tflops={"bfloat16": 312.0, "float16": 312.0, "float32": 156.0},  # no FP8
            gemm_efficiency=0.869,
            gemm_best_shape=(1024, 10240, 5120),
            gemm_k_half=H100_FIT["gemm_k_half"],
            gemm_overhead_us=H100_FIT["gemm_overhead_us"],
            hbm_gbps=2039.0,
            **_per_link(300.0),
            multicast_gbps=None,
            nccl_ramp_us=H100_FIT["nccl_ramp_us"],
            interference=H100_FIT["interference"],
            nccl_sms=24,
            min_gain=MARGINS["h100"],
            description="No multicast: multimem needs sm_90.",
            sources={
                "peak_tflops": "NVIDIA A100 datasheet: 312 TFLOP/s BF16 dense, TF32 156; no FP8 "
                               "tensor cores (sm_80): FP8 GEMMs run dequantized, at the BF16 "
                               "rate",
                "gemm_efficiency": f"{_MAMF}: A100 SXM 271.2 TFLOP/s = 86.9% at "
                                   "1024x10240x5120",
                "gemm_k_half": _AS_H100, "gemm_overhead_us": _AS_H100,
                "sms": "A100: 108 SMs (datasheet)",
                "compute_capability": _CC.format("A100 8.0 (no fused GEMM: sm_90a only)"),
                "hbm_gbps": "NVIDIA A100 80GB SXM datasheet, 2.04 TB/s",
                "link_gbps": "NVLink3: 600 GB/s bidirectional -> 300 per direction (datasheet); "
                             "NCCL reaches ~230 GB/s busbw (NVIDIA/nccl-tests#149, maintainer)",
                "nccl_gbps": _LINE.format(H100_FIT["nccl_gbps"]),
                "nccl_p2p_gbps": _LINE.format(180.0), "p2p_gbps": _LINE.format(380.0),
                "multicast_gbps": "multimem PTX needs sm_90+ -> unsupported",
                "interference": _AS_H100,
                "nccl_sms": "assumption: fewer NCCL channels than on H100",
                "latencies": _FIXED_FIT,
    "mc_latency_us": "fitted (sim.published.fit_one_shot) to vLLM's one-shot custom all-reduce "
                     "of 512 B and 4 KiB on H100, tp 2/4/8 (the table of sgl-project/sglang "
                     "PR #2904), less signal_latency_us",
                "min_gain": "as h100 (no published row on this machine)",
            },
        ),
        Preset(
            name="a800",
            gpu="A800 SXM 80GB, HGX 8-GPU, NVLink3 (8 links) via NVSwitch",
            sms=108,
            compute_capability=(8, 0),
            peak_tflops={"bfloat16": 312.0, "float16": 312.0, "float32": 156.0},  # no FP8
            gemm_efficiency=0.869,
            gemm_best_shape=(1024, 10240, 5120),
            gemm_k_half=H100_FIT["gemm_k_half"],
            gemm_overhead_us=H100_FIT["gemm_overhead_us"],
            hbm_gbps=2039.0,
            **_per_link(200.0),
            multicast_gbps=None,
            nccl_ramp_us=H100_FIT["nccl_ramp_us"],
            interference=H100_FIT["interference"],
            nccl_sms=24,
            min_gain=MARGINS["other"],
            calibrated=_CALIBRATED["a800"],
            description="A100 compute with the export NVLink: 400 GB/s bidirectional.",
            sources={
                "peak_tflops": "the A100 die (NVIDIA A800 datasheet); no FP8 tensor cores",
                "compute_capability": "the A100 die: 8.0 (no fused GEMM: sm_90a only)",
                "gemm_efficiency": f"{_MAMF}: A100 SXM 271.2 TFLOP/s (the same die)",
                "gemm_k_half": _AS_H100, "gemm_overhead_us": _AS_H100,
                "hbm_gbps": "as A100 80GB SXM, 2.04 TB/s",
                "link_gbps": "NVLink3 400 GB/s bidirectional -> 200 per direction "
                             "(bytedance/flux README 'Performance', 8xA800)",
                "nccl_gbps": _LINE.format(H100_FIT["nccl_gbps"]),
                "nccl_p2p_gbps": _LINE.format(180.0), "p2p_gbps": _LINE.format(380.0),
                "multicast_gbps": "multimem PTX needs sm_90+ -> unsupported",
                "interference": _AS_H100,
                "latencies": _FIXED_FIT,
    "mc_latency_us": "fitted (sim.published.fit_one_shot) to vLLM's one-shot custom all-reduce "
                     "of 512 B and 4 KiB on H100, tp 2/4/8 (the table of sgl-project/sglang "
                     "PR #2904), less signal_latency_us",
                "min_gain": _MARGIN,
                "calibrated": "the a800 rows of sim.published",
            },
        ),
        Preset(
            name="b200",
            gpu="B200, HGX 8-GPU, NVLink5 via NVSwitch",
            sms=148,
            compute_capability=(10, 0),
            peak_tflops={"bfloat16": 2250.0, "float16": 2250.0, "float32": 1125.0,
                         "float8": 4500.0},
            gemm_efficiency=0.776,
            gemm_best_shape=(1792, 16128, 3072),
            gemm_k_half=H100_FIT["gemm_k_half"],
            gemm_overhead_us=H100_FIT["gemm_overhead_us"],
            hbm_gbps=8000.0,
            **_per_link(900.0),
            multicast_gbps=round(900.0 * _NCCL_FRACTION, 1),
            nccl_ramp_us=H100_FIT["nccl_ramp_us"],
            mc_ramp_us=H100_FIT["nccl_ramp_us"],
            interference=H100_FIT["interference"],
            nccl_sms=H100_FIT["nccl_sms"],
            min_gain=MARGINS["h100"],
            description="Blackwell: twice H100's NVLink, ~2.3x its dense BF16.",
            sources={
                "peak_tflops": "NVIDIA HGX B200 datasheet: 2.25 PFLOP/s dense BF16 per GPU; "
                               "FP8 72 PFLOP/s per 8 GPUs with sparsity -> 4.5 dense per GPU",
                "gemm_efficiency": f"{_MAMF}: B200 SXM 1745 TFLOP/s = 77.6% at "
                                   "1792x16128x3072",
                "gemm_k_half": _AS_H100, "gemm_overhead_us": _AS_H100,
                "sms": "B200: 148 SMs (datasheet)",
                "compute_capability": _CC.format("B200 10.0 (no fused GEMM: sm_90a code does "
                                                 "not run on it, docs/gpu-internals.md §5)"),
                "hbm_gbps": "NVIDIA B200 datasheet, 8 TB/s",
                "link_gbps": "NVLink5: 1.8 TB/s bidirectional -> 900 per direction (datasheet)",
                "nccl_gbps": _LINE.format(H100_FIT["nccl_gbps"]) + "; an 8xB200 node reaches "
                             "830+ GB/s all-reduce busbw with NVLS (NVIDIA/nccl#1807)",
                "nccl_p2p_gbps": _LINE.format(180.0), "p2p_gbps": _LINE.format(380.0),
                "multicast_gbps": "assumption: NVLS at the NCCL rate",
                "interference": _AS_H100, "nccl_sms": _AS_H100,
                "latencies": _FIXED_FIT,
    "mc_latency_us": "fitted (sim.published.fit_one_shot) to vLLM's one-shot custom all-reduce "
                     "of 512 B and 4 KiB on H100, tp 2/4/8 (the table of sgl-project/sglang "
                     "PR #2904), less signal_latency_us",
                "min_gain": "as h100 (no published row on this machine)",
            },
        ),
        Preset(
            name="pcie8",
            gpu="8x L20 48GB, PCIe Gen4 x16, no NVLink",
            sms=92,
            compute_capability=(8, 9),
            peak_tflops={"bfloat16": 119.5, "float16": 119.5, "float32": 59.8, "float8": 239.0},
            gemm_efficiency=0.9313,
            gemm_best_shape=(4096, 12288, 6144),
            gemm_k_half=H100_FIT["gemm_k_half"],
            gemm_overhead_us=H100_FIT["gemm_overhead_us"],
            hbm_gbps=864.0,
            link_gbps=32.0,
            nccl_gbps=8.1,
            p2p_gbps=22.0,
            multicast_gbps=None,
            nccl_latency_us=15.0,
            nccl_ramp_us=2.0,
            interference=H100_FIT["interference"],
            nccl_sms=16,
            min_gain=MARGINS["other"],
            calibrated=_CALIBRATED["pcie8"],
            description="A PCIe-only box: the 8xL20 of bytedance/flux docs/performance.md.",
            sources={
                "peak_tflops": "NVIDIA L20 datasheet: 119.5 TFLOP/s FP16/BF16 dense; FP8: "
                               "assumption, twice that (Ada's FP8 tensor-core rate is twice "
                               "its FP16 rate, NVIDIA Ada Lovelace architecture whitepaper)",
                "compute_capability": _CC.format("L20 8.9 (no fused GEMM: sm_90a only)"),
                "gemm_efficiency": _FITTED.format("fit_pcie8", "the torch GEMM times of "
                                                  "bytedance/flux docs/performance.md (8xL20)"),
                "gemm_k_half": _AS_H100, "gemm_overhead_us": _AS_H100,
                "link_gbps": "PCIe Gen4 x16: 32 GB/s per direction line rate",
                "nccl_gbps": _FITTED.format("fit_pcie8", "the torch all-gather / reduce-scatter "
                                            "times of bytedance/flux docs/performance.md "
                                            "(~8 GB/s busbw: NCCL over PCIe is slow there)"),
                "p2p_gbps": "assumption: ~70% of the PCIe line rate; Flux's fused calls on the "
                            "same box hide most of an all-gather that takes NCCL 11.2 ms "
                            "behind a 5.7 ms GEMM, so peer copies run at >= 15 GB/s",
                "multicast_gbps": "no NVSwitch -> unsupported",
                "nccl_latency_us": "assumption: PCIe hops are slower (15 us)",
                "nccl_ramp_us": "assumption",
                "interference": _AS_H100,
                "latencies": _FIXED_FIT,
    "mc_latency_us": "fitted (sim.published.fit_one_shot) to vLLM's one-shot custom all-reduce "
                     "of 512 B and 4 KiB on H100, tp 2/4/8 (the table of sgl-project/sglang "
                     "PR #2904), less signal_latency_us",
                "min_gain": _MARGIN,
                "calibrated": "the pcie8 rows of sim.published",
            },
        ),
    ]
}


def get_preset(name: str) -> Preset:
    """A built-in preset by name (case-insensitive)."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; built-in: {sorted(PRESETS)}")
    return PRESETS[key]


def load_preset(spec: str | os.PathLike[str] | Preset) -> Preset:
    """A preset from a built-in name, a JSON file path, or a Preset (returned as is)."""
    if isinstance(spec, Preset):
        return spec
    s = os.fspath(spec)
    if s.lower() in PRESETS:
        return PRESETS[s.lower()]
    if os.path.exists(s):
        with open(s) as f:
            return Preset.from_dict(json.load(f))
    raise ValueError(f"preset {s!r}: not a built-in ({sorted(PRESETS)}) nor an existing file")
