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
from jaxoverlap._fused_gemm import FUSED_KERNELS, FusedKernel

DTYPES = _kinds.names(_kinds.DTYPES)
_GBPS_FIELDS = {t.name: t.preset.gbps for t in _kinds.TRANSPORTS}  # transport -> its rate field
FP8_DTYPES = _kinds.names(_kinds.DTYPES, fp8=True)


# The dtype helpers below are pure and called for every op the model prices: cached.
def canonical_dtype(dtype: str) -> str:
    """'bf16' -> 'bfloat16' etc. (a dtype's short name, the executors' in a program's "dtype",
    or an alias: ``_kinds``); raises on anything the executors do not support."""
    try:
        return _kinds.dtype(str(dtype)).name
    except ValueError:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}") from None


def dtype_bytes(dtype: str) -> int:
    return _kinds.dtype(canonical_dtype(dtype)).bytes


# The operand classes whose GEMMs a preset prices with a fit of their own (``Preset.gemm_fit``):
# "16bit" (bfloat16, float16, and float32 through TF32: the preset's gemm_* fields), "fp8" (e4m3 /
# e5m2 with tensor- or row-wise scales, accumulation promoted to FP32), "mxfp8" (e4m3 with 1x32
# e8m0 block scales, Blackwell's block-scaled MMA).
GEMM_CLASSES = ("16bit", "fp8", "mxfp8")


# The output tiles of the FP8 GEMMs a library chooses among on Hopper: K tiles of 128 (twice the
# 16-bit kernels' 64), M x N of 64 x 128 ... 128 x 256 (pytorch/FBGEMM fbgemm_gpu/experimental/
# gen_ai/src/quantize/cutlass_extensions/f8f8bf16_rowwise.cu, its sm90 shape heuristic).
FP8_TILES = ((128, 256), (128, 128), (64, 256), (64, 128))


def gemm_class(dtype: str, block_scaled: bool = False) -> str:
    """The operand class of a GEMM of ``dtype`` operands (``GEMM_CLASSES``)."""
    if canonical_dtype(dtype) in FP8_DTYPES:
        return "mxfp8" if block_scaled else "fp8"
    if block_scaled:
        raise ValueError(f"block_scaled: only fp8 operands have block scales, got {dtype!r}")
    return "16bit"


@dataclass(frozen=True)
class GemmFit:
    """How fast one operand class's GEMMs run on a machine (``model.gemm_plan``): the fraction of
    the dense peak reached at ``best_shape`` (m, n, k), the K curve's half point, the output tiles
    the library chooses among, and whether any of it was fitted to measurements of that class
    (``measured``; else it is the 16-bit fit carried over to the class's peak)."""

    efficiency: float
    best_shape: tuple[int, int, int]
    k_half: float
    tiles: tuple[tuple[int, int], ...]
    measured: bool
    # a fused GEMM's CTA tile for this class where the GPU runs no kernel of ours for it
    # (sim.fused.kernel_tile: ours have their own, _fused_gemm.FUSED_KERNELS)
    fused_tile: tuple[int, int] | None = None


def output_dtype(dtype: str) -> str:
    """What a GEMM of ``dtype`` operands writes: bfloat16 for fp8 (the ops' default
    ``preferred_element_type``, what FP8 training recipes use), else the operands' dtype."""
    name = canonical_dtype(dtype)
    return "bfloat16" if name in FP8_DTYPES else name


# ---- what the fits of sim.published give (tests/sim/test_published.py re-fits them) ---------
# The h100 fit (its interference uses the copy engine's start) and the host-enqueue fit (on a
# machine derived from the h100) depend on each other: these are their fixed point, each fit
# re-run on the other's result gives back its own numbers.

# The h100's GEMM, NCCL and interference numbers (sim.published.fit_h100).
H100_FIT = dict(gemm_efficiency=0.7878, gemm_k_half=984.8, gemm_overhead_us=9.05,
                nccl_gbps=385.0, nccl_ramp_us=0.275, nccl_latency_us=0.0, nccl_step_us=1.121,
                interference=1.488, nccl_sms=36)
# A one-launch all-reduce kernel's start and one flag round across the clique (sim.allreduce,
# fitted by sim.published.fit_one_launch to the lean published one-shot kernels on H100, each
# priced by its own mechanism: vLLM's two-barrier one-stage kernel, sglang's one-barrier one).
ONE_LAUNCH_FIT = dict(ar_start_us=2.51, ar_flag_us=1.88)
# A copy-engine copy on the GPU (docs/performance.md §2.2): its start, the per-copy time of
# NVIDIA/cuda-samples p2pBandwidthLatencyTest's latency matrix (1.8-2.3 us a 16-byte peer write,
# NVIDIA/cuda-samples#230), and no size ramp: the same test's five back-to-back 160 MB copies
# reach 371-377 GB/s on HGX H100 (NVIDIA/nccl#1264), the rate itself (a DMA copy is pipelined
# in hardware, not in software chunks). A flag or an event a stream waits on: one device-side
# flag round (the one-launch fit's), not fitted to any call of ours.
DEVICE_COSTS = dict(ce_latency_us=2.0, ce_ramp_us=0.0,
                    signal_latency_us=ONE_LAUNCH_FIT["ar_flag_us"],
                    event_latency_us=ONE_LAUNCH_FIT["ar_flag_us"])
# The host's enqueue of a call's ops (sim.published.fit_fixed_costs): the decomposed AG+GEMM of
# PyTorch's eager Python lies on the host bound, so it measures this and nothing of the device.
HOST_FIT = dict(host_op_us=9.08, host_call_us=45.3)
# A multicast kernel's start (sim.published.fit_one_shot): published one-shot all-reduces of
# small messages on 8xH100, less one flag round.
ONE_SHOT_FIT = dict(mc_latency_us=6.88)
# FP8 GEMMs on the H100 die (sim.published_gemms.fit_fp8): their own efficiency and K curve.
H100_FP8_FIT = dict(efficiency=0.7457, best_shape=(4096, 7168, 16384), k_half=432.6,
                    tiles=FP8_TILES)
# The B200's 16-bit, FP8 and MXFP8 GEMMs (sim.published_gemms.fit_b200).
B200_FIT = dict(gemm_efficiency=0.6471, gemm_best_shape=(3072, 3072, 3072), gemm_k_half=1257.8,
                gemm_overhead_us=0.0)
B200_CLASSES = {
    "fp8": dict(efficiency=0.5282, best_shape=(8192, 8192, 8192), k_half=3136.4, tiles=FP8_TILES),
    "mxfp8": dict(efficiency=0.61, best_shape=(8192, 8192, 4096), k_half=8710.8,
                  tiles=FP8_TILES),
}
# The fused GEMM (docs/gpu-internals.md §5): CUTLASS's stock sm90 kernel with 128x256 CTA tiles;
# its speed alone relative to cuBLAS's at the same shape is an assumption from the published fused
# GEMMs alone (sim.published.FUSED_GEMMS_ALONE; the source below says which).
FUSED_GEMM = dict(fused_gemm_rate=0.975, fused_gemm_tile=(128, 256))
# The sm_100a fused kernel's speed alone relative to cuBLAS's, by mechanism: the published
# Blackwell GEMM of the same structure (2-SM MMA on 256-row tiles, a persistent grid of clusters
# striding statically over the tiles without swizzle, the epilogue in its own warps over two
# tensor-memory accumulators) at its published utilization over cuBLAS's; its waits and releases
# hide behind the pipelines that structure overlaps (docs/performance.md §2.6).
SM100_PERSISTENT_UTILIZATION, SM100_CUBLAS_UTILIZATION = 63.38, 63.38
SM100_FUSED_GEMM_RATE = SM100_PERSISTENT_UTILIZATION / SM100_CUBLAS_UTILIZATION
# The chooser's margins per program family (sim.published.fallback_margins, sim.families): the
# model's worst serial error (8.1%), and its worst optimism on the published designs that check
# each family on that machine (a published loss counted as no gain), rounded up. On the h100:
# release-only fused GEMM+RS against Flux's losses, by Flux's design priced by its own mechanism
# (sim.reduction.pulled) and by our plan of the family, the more optimistic (19.8%: F8/4096,
# ours), the overlapped GEMM+RS against
# Triton-distributed's and kraken's copy-engine GEMM+RS, whose parts it is built from (14.0%:
# TDH-s4, ours); the one-launch all-reduces against the published kernels of their mechanism, each
# priced by its own: one-shot over p2p against vLLM's one-stage and sglang's one-shot (25.1%),
# two-shot over multicast against PyTorch's multimem_all_reduce_ (16.0%); families with no
# comparison, and each op's key, the largest derived (66.2%: vLLM's two-stage kernel on 8 GPUs
# runs 2.95x what its mechanism prices, the two-shot p2p family's). On the h800 Triton-
# distributed's GEMM+RS chart against our release-only fused plan (26.8%: TD-RS3) and the
# overlapped GEMM+RS built from it (21.9%), and so every family without a comparison.
_H100_MARGINS = {"ag_matmul:chunked": 0.081, "ag_matmul:fused": 0.081,
                 "matmul_rs:chunked": 0.081, "matmul_rs:fused": 0.198,
                 "matmul_rs:overlapped": 0.14, "matmul_ar:one_launch:one_shot:p2p": 0.251,
                 "matmul_ar:one_launch:two_shot:multicast": 0.16}
_H100_LARGEST = 0.662
_FAMILY_KEYS = ("ag_matmul:chunked", "ag_matmul:fused", "matmul_rs:chunked", "matmul_rs:fused",
                "matmul_rs:overlapped", "matmul_ar:chunked", "matmul_ar:one_shot",
                "matmul_ar:one_launch:one_shot:p2p", "matmul_ar:one_launch:one_shot:multicast",
                "matmul_ar:one_launch:two_shot:p2p", "matmul_ar:one_launch:two_shot:multicast",
                "ag_matmul", "matmul_rs", "matmul_ar")
_H800_MARGINS = {"ag_matmul:fused": 0.081, "matmul_rs:overlapped": 0.219}
MARGINS = {
    "h100": {k: _H100_MARGINS.get(k, _H100_LARGEST) for k in _FAMILY_KEYS},
    "h800": {k: _H800_MARGINS.get(k, 0.268) for k in _FAMILY_KEYS},
    "other": dict.fromkeys(_FAMILY_KEYS, 0.081),
}
# GB200: the h100's, but the multicast one-shot against the one published on GB200 (tokenspeed).
MARGINS["gb200-nvl72"] = {**MARGINS["h100"], "matmul_ar:one_launch:one_shot:multicast": 0.583}


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
    nccl_latency_us: float = H100_FIT["nccl_latency_us"]  # per NCCL call / send-recv group
    nccl_ramp_us: float = H100_FIT["nccl_ramp_us"]  # per hop
    nccl_step_us: float = H100_FIT["nccl_step_us"]  # per ring step, unhidden (model.transport_step)
    ce_latency_us: float = DEVICE_COSTS["ce_latency_us"]  # per copy: its DMA start on the GPU
    ce_ramp_us: float = DEVICE_COSTS["ce_ramp_us"]  # per hop (0: a copy is pipelined in hardware)
    mc_latency_us: float = ONE_SHOT_FIT["mc_latency_us"]  # per multicast kernel
    mc_ramp_us: float = H100_FIT["nccl_ramp_us"]
    signal_latency_us: float = DEVICE_COSTS["signal_latency_us"]  # Signal -> peer's Wait
    event_latency_us: float = DEVICE_COSTS["event_latency_us"]  # Record -> StreamWait; fork, join
    # Ops running together (model.compute_rate).
    nccl_sms: int = H100_FIT["nccl_sms"]  # SMs a running NCCL kernel takes from the GEMM
    mc_sms: int = 16  # SMs a running multicast kernel takes (assumption)
    interference: float = H100_FIT["interference"]  # slowdown per unit of HBM bandwidth moved
    # The host enqueues every op of a call (model.host_time); a call captured in a command
    # buffer (CUDA graph) enqueues none at replay, its nodes cost graph_node_us each on the GPU
    # (sim.launch).
    host_op_us: float = HOST_FIT["host_op_us"]
    host_call_us: float = HOST_FIT["host_call_us"]
    graph_node_us: float = 0.58
    # One-launch all-reduce kernels (sim.allreduce): the kernel's start, one flag round across
    # the clique, and SMs' loads from peers' memory over the links (None: the line rate).
    ar_start_us: float = ONE_LAUNCH_FIT["ar_start_us"]
    ar_flag_us: float = ONE_LAUNCH_FIT["ar_flag_us"]
    p2p_load_gbps: float | None = None
    # A reduction kernel summing N partials (sim.reduction): what one SM streams, and the
    # fraction of HBM a whole-grid reduction reaches.
    reduce_sm_gbps: float = 28.0
    reduce_efficiency: float = 0.85
    # Where the group's GPUs sit: GPUs per node (one OS instance) and per NVLink domain (the
    # model prices one domain, full bisection). A group spanning nodes inside the domain (GB200
    # NVL72's trays) reaches peers' memory only through fabric handles with IMEX
    # (docs/multiprocess.md), which p2p and multicast then need.
    gpus_per_node: int = 8
    nvlink_domain: int = 8
    # The fused GEMM (sim.fused): one persistent GEMM waiting on per-block flags. Its code is
    # sm_90a for compute capability 9.0 and sm_100a (bfloat16, 2-SM MMA) for 10.0, each running
    # on its architecture alone (docs/gpu-internals.md §5, _fused_gemm.FUSED_KERNELS); None:
    # unknown, the fused path is not offered.
    compute_capability: tuple[int, int] | None = None
    fused_gemm_rate: float = FUSED_GEMM["fused_gemm_rate"]  # its speed alone / cuBLAS's
    # its CTA tile (M, N) where the GPU runs no kernel of ours (sim.fused.kernel_tile: ours
    # have their own, _fused_gemm.FUSED_KERNELS; the Flux projection, sim.reduction.pulled)
    fused_gemm_tile: tuple[int, int] = FUSED_GEMM["fused_gemm_tile"]
    # GEMMs of the other operand classes (GEMM_CLASSES), each fitted to its own published
    # throughputs: {"fp8": {"efficiency", "best_shape", "k_half", "tiles", "fused_tile"}, ...}.
    # A class absent here is priced with the 16-bit fit at its own peak (extrapolated: the
    # confidence check says so). Read through ``gemm_fit``.
    gemm_classes: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The chooser's fallback margins: a plan must be predicted this much faster than the unfused
    # path, per program family (sim.families) and per op for a family not listed (derived from
    # the model's measured error against the published designs closest to each family,
    # sim.published.fallback_margins).
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
        classes = {}
        for name, fit in self.gemm_classes.items():
            if name not in GEMM_CLASSES[1:]:
                raise ValueError(f"gemm_classes: unknown class {name!r}; known: "
                                 f"{GEMM_CLASSES[1:]}")
            fit = dict(fit)
            fit["best_shape"] = tuple(int(v) for v in fit["best_shape"])
            fit["tiles"] = tuple((int(a), int(b)) for a, b in fit["tiles"])
            if fit.get("fused_tile") is not None:
                fit["fused_tile"] = tuple(int(v) for v in fit["fused_tile"])
            classes[name] = fit
        object.__setattr__(self, "gemm_classes", classes)

    def peak(self, dtype: str) -> float:
        """The dense peak (TFLOP/s) of a GEMM of ``dtype`` operands."""
        row = _kinds.dtype(canonical_dtype(dtype))
        if row.fp8:  # a machine without FP8 tensor cores: the BF16 rate
            return self.peak_tflops.get(row.peak, self.peak_tflops["bfloat16"])
        return self.peak_tflops[row.peak]

    def gemm_fit(self, cls: str) -> GemmFit:
        """The GEMM fit of operand class ``cls`` (``GEMM_CLASSES``): its own where the preset has
        one, else the 16-bit fit (``measured`` False for a non-16-bit class then)."""
        if cls not in GEMM_CLASSES:
            raise ValueError(f"gemm class: expected one of {GEMM_CLASSES}, got {cls!r}")
        own = self.gemm_classes.get(cls)
        if own is None:
            return GemmFit(self.gemm_efficiency, self.gemm_best_shape, self.gemm_k_half,
                           self.gemm_tiles, cls == "16bit", self.fused_gemm_tile)
        return GemmFit(float(own["efficiency"]), own["best_shape"], float(own["k_half"]),
                       own["tiles"], True, own.get("fused_tile"))

    def with_gemm_fit(self, cls: str, **params: Any) -> Preset:
        """A copy whose class ``cls`` has ``params`` (efficiency, best_shape, k_half, tiles,
        fused_tile) replaced; "16bit" maps to the gemm_* fields."""
        if cls == "16bit":
            names = {"efficiency": "gemm_efficiency", "best_shape": "gemm_best_shape",
                     "k_half": "gemm_k_half", "tiles": "gemm_tiles",
                     "fused_tile": "fused_gemm_tile"}
            return self.replace(**{names[k]: v for k, v in params.items()})
        now = self.gemm_fit(cls)
        fit = {"efficiency": now.efficiency, "best_shape": now.best_shape, "k_half": now.k_half,
               "tiles": now.tiles, "fused_tile": now.fused_tile, **params}
        return self.replace(gemm_classes={**self.gemm_classes, cls: fit})

    def margin(self, op: str, family: str | None = None) -> float:
        """The fallback margin for plans of ``family`` (``sim.families.FAMILIES``), else for
        ``op``; neither listed: the largest the preset has (none at all: the largest derived
        for a built-in)."""
        largest = max(self.min_gain.values(), default=max(MARGINS["h100"].values()))
        if family and family in self.min_gain:
            return self.min_gain[family]
        return self.min_gain.get(op, largest)

    @property
    def fused_gemm(self) -> bool:
        """Whether the fused GEMM runs on this machine: compute capability 9.0 (Hopper, sm_90a)
        or 10.0 (B200/GB200, sm_100a); other GPUs keep the chunked path."""
        return self.fused_kernel is not None

    @property
    def fused_kernel(self) -> FusedKernel | None:
        """The fused GEMM build this machine runs (None: none)."""
        return FUSED_KERNELS.get(self.compute_capability) if self.compute_capability else None

    def spans_nodes(self, nranks: int) -> bool:
        """Whether a tensor-parallel group of ``nranks`` spans several nodes of the domain."""
        return nranks > self.gpus_per_node

    def transport_needs(self, nranks: int) -> dict[str, str]:
        """What each transport needs beyond the preset's hardware for a group of ``nranks``
        (empty: nothing): across nodes, p2p and multicast reach peers' buffers through CUDA
        fabric handles, which need the IMEX service and a channel (docs/multiprocess.md)."""
        if not self.spans_nodes(nranks):
            return {}
        need = ("CUDA fabric handles across nodes: the IMEX service and an IMEX channel the job "
                "may open (docs/multiprocess.md)")
        return {t: need for t in self.transports if t != "nccl"}

    def check_group(self, nranks: int) -> None:
        """Raises when ``nranks`` GPUs do not fit the preset's NVLink domain (the model prices
        one domain: its links, not a network between domains)."""
        if nranks > self.nvlink_domain:
            raise ValueError(
                f"nranks={nranks}: preset {self.name!r} models one NVLink domain of "
                f"{self.nvlink_domain} GPUs; a tensor-parallel group across domains crosses the "
                "network, which the model does not price (use a group of at most "
                f"{self.nvlink_domain}, or a preset of a larger domain such as gb200-nvl72)")

    @property
    def transports(self) -> tuple[str, ...]:
        """Transports this machine supports: those with a rate (``_kinds``, each transport's
        preset keys; nccl always has one)."""
        return tuple(t.name for t in _kinds.TRANSPORTS if getattr(self, t.preset.gbps))

    def transport_gbps(self, transport: str) -> float:
        key = _GBPS_FIELDS.get(transport) if isinstance(transport, str) else None
        bw = getattr(self, key) if key else None
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
_FIXED_FIT = ("device: a copy-engine copy's start 2 us and no size ramp (NVIDIA/cuda-samples "
              "p2pBandwidthLatencyTest: 1.8-2.3 us a peer copy, NVIDIA/cuda-samples#230; five "
              "160 MB copies at 371-377 GB/s on HGX H100, NVIDIA/nccl#1264), a flag or event "
              "wait one device-side flag round (ar_flag_us, sim.published.fit_one_launch); "
              "host: host_op_us and host_call_us " + _FITTED.format(
                  "fit_fixed_costs", "the decomposed (chunked, copy-engine) AG+GEMM of "
                  "pytorch/pytorch PR #143160, 354 us, whose eager Python lies on the host bound "
                  "(one common scale on the two, their ratio an assumption); PyTorch's eager "
                  "dispatch is in that number, so they may overstate a C++ executor's: refit "
                  "with bench --calibrate"))
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
_NCCL_FRACTION = H100_FIT["nccl_gbps"] / 450.0
_NCCL_P2P_FRACTION = 180.0 / 450.0
_CE_FRACTION = 380.0 / 450.0


def _flop(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k


_GIB, _MIB, _KIB = 1 << 30, 1 << 20, 1 << 10
# The ranges covered by each machine's published rows (sim.published.calibrated_ranges).
_ONE_FLUX_SHAPE = {"gemm_flop": (_flop(4096, 6144, 12288),) * 2,
                   "collective_bytes": (96.0 * _MIB,) * 2,
                   "ag_matmul": (_flop(4096, 6144, 12288),) * 2,
                   "matmul_rs": (_flop(4096, 6144, 12288),) * 2}
_CALIBRATED = {
    "h100": {"gemm_flop": (_flop(1, 12288, 5376), _flop(32768, 7168, 8192)),
             "collective_bytes": (16.0 * _KIB, 8.0 * _GIB),
             "ag_matmul": (_flop(1024, 7168, 8192), _flop(32768, 7168, 8192)),
             "matmul_rs": (_flop(4096, 4096, 1024), _flop(8192, 8192, 14784))},
    "h800": {"gemm_flop": (_flop(8192, 1376, 4096), _flop(8192, 6656, 16384)),
             "collective_bytes": (96.0 * _MIB,) * 2,
             "ag_matmul": (_flop(8192, 1376, 4096), _flop(8192, 6656, 16384)),
             "matmul_rs": (_flop(8192, 4096, 1376), _flop(4096, 6144, 12288))},
    "a800": _ONE_FLUX_SHAPE,
    "pcie8": _ONE_FLUX_SHAPE,
    "b200": {"gemm_flop": (_flop(1024, 2048, 1024), _flop(16384, 16384, 16384))},
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
    gemm_classes={"fp8": H100_FP8_FIT},
    **{k: v for k, v in H100_FIT.items() if k != "nccl_gbps"},  # rates: _per_link
)
_SHARED_SOURCES = {
    "mc_latency_us": "fitted (sim.published.fit_one_shot) to vLLM's custom all-reduce of 2 KiB "
                     "and 16 KiB on H100, tp 2/4/8 (the table of sgl-project/sglang PR #2904, "
                     "whose 'data size' counts float32 elements), less signal_latency_us",
    "nccl_step_us": _NCCL_FIT + "; with the all-reduces of 16 KiB-1 MiB on 8xH100 of "
                    "ByteDance-Seed/Triton-distributed#57 and vllm-project/vllm PR #24111 "
                    "(21-32 us); the form, a per-call latency plus a latency per ring step, is "
                    "NCCL's own cost model (NVIDIA/nccl src/graph/tuning.cc)",
    "graph_node_us": "ahrefs/ocannl#488: a replayed CUDA graph costs ~0.58 us per kernel node "
                     "(RTX 5070 Ti, CUDA 13; no datacenter-GPU number published: an assumption)",
    "ar_start_us": "fitted (sim.published.fit_one_launch) with ar_flag_us to the lean one-launch "
                   "one-shot all-reduces on H100, each priced by its own mechanism: vLLM's "
                   "two-barrier ca_1stage in CUDA graphs (vllm-project/vllm PR #24111, tp 4/6/8, "
                   "0.5-1 MiB) and sglang's one-barrier kernel (sgl-project/sglang PR #2904, "
                   "tp 2/4/8, 2-128 KiB)",
    "ar_flag_us": "fitted with ar_start_us (see there)",
    "p2p_load_gbps": "None: SM loads from peers reach the line rate (vllm-project/vllm PR #24111: "
                     "a one-shot of 1 MiB on 8xH100 reads 7 MiB from peers in ~16 us, "
                     "~450 GB/s)",
    "reduce_sm_gbps": "ByteDance-Seed/Triton-distributed python/triton_dist/kernels/nvidia/"
                      "reduce_scatter.py: 16 SMs suffice for a reduction at H800's 450 GB/s "
                      "(>= 28 GB/s per SM); an assumption for other GPUs",
    "reduce_efficiency": "pytorch/pytorch PR #191803: a Triton reduction of stacked partials "
                         "reaches 82-88% of HBM peak (torch.sum 23-43% at the same traffic)",
    "gpus_per_node": "an HGX board: 8 GPUs per node and per NVLink domain",
    "nvlink_domain": "an HGX board: 8 GPUs per node and per NVLink domain",
}
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
    "gemm_classes": "fp8: fitted (sim.published_gemms.fit_fp8) to DeepGEMM's FP8 GEMMs at M 4096 "
                    "on H800 (deepseek-ai/DeepGEMM README, the H100 die), with the FP8 tiles of "
                    "pytorch/FBGEMM's sm90 rowwise kernels (K tile 128); the fused FP8 kernel's "
                    "tile 128x128x128 (CUTLASS's sm90 FP8 mainloop with promotion); checked "
                    "against vllm-project/vllm PR #49363 (H100, M 1-128) and pytorch/FBGEMM PR "
                    "#2546 (H100 500 W)",
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
    "min_gain": _MARGIN,
}

_NCCL_SM100_OVER_SM90 = 40.1 / 20.6  # NCCL's per-link NVLink bandwidths (src/graph/topo.h)
_BLACKWELL = dict(
    sms=148,
    compute_capability=(10, 0),
    fused_gemm_rate=SM100_FUSED_GEMM_RATE,
    hbm_gbps=8000.0,
    **B200_FIT,
    gemm_classes=B200_CLASSES,
    link_gbps=900.0,
    nccl_gbps=round(H100_FIT["nccl_gbps"] * _NCCL_SM100_OVER_SM90, 1),
    nccl_p2p_gbps=round(180.0 * _NCCL_SM100_OVER_SM90, 1),
    p2p_gbps=770.0,
    multicast_gbps=round(H100_FIT["nccl_gbps"] * _NCCL_SM100_OVER_SM90, 1),
    nccl_ramp_us=H100_FIT["nccl_ramp_us"],
    nccl_latency_us=H100_FIT["nccl_latency_us"],
    nccl_step_us=H100_FIT["nccl_step_us"],
    mc_ramp_us=H100_FIT["nccl_ramp_us"],
    interference=H100_FIT["interference"],
    nccl_sms=H100_FIT["nccl_sms"],
)
_B200_GEMM_FIT = _FITTED.format("fit_b200", "pytorch/ao PR #2427's square BF16 matmuls on a B200 "
                                "(2048^3-8192^3: 63-67% of peak; MAMF's best-of-search 1745 "
                                "TFLOP/s is held out as a check)")
_BLACKWELL_SOURCES = {
    "sms": "B200: 148 SMs (datasheet)",
    "compute_capability": _CC.format("B200 10.0 (the fused GEMM's sm_100a build, bfloat16: "
                                     "2-SM MMA on 256x256 tiles of two 128x256 CTA tiles, the "
                                     "static persistent scheduler on every SM; "
                                     "docs/gpu-internals.md §5)"),
    "fused_gemm_rate": "derived by mechanism from jax-ml/jax docs/pallas/gpu/blackwell_matmul.md "
                       "(Mosaic GPU matmuls on Blackwell, 4096x8192x4096 f16): its step 5, "
                       "2-SM MMA, persistent clusters striding statically, the epilogue in its "
                       "own warpgroup over two TMEM accumulators, no grid tiling, reaches "
                       "63.38% tensor-core utilization = 100.0% of cuBLAS's; the swizzled "
                       "step 6 109.6%, CUTLASS's best 109.3%. The sm_100a kernel is that "
                       "structure (CUTLASS's stock sm100 kernel, static scheduler along N "
                       "without swizzle: docs/gpu-internals.md §5), its per-tile wait and "
                       "release hidden by the same overlap; it has never run",
    "fused_gemm_tile": "docs/gpu-internals.md §5: the sm_100a kernel's CTA tile, 128 x 256 "
                       "(each CTA of a 2-SM pair: 256 x 256 MMA tiles)",
    "hbm_gbps": "NVIDIA B200 datasheet, 8 TB/s",
    "gemm_efficiency": _B200_GEMM_FIT,
    "gemm_best_shape": _B200_GEMM_FIT,
    "gemm_k_half": _B200_GEMM_FIT,
    "gemm_overhead_us": _B200_GEMM_FIT + " (0: that harness times kernels back to back; the "
                        "h100's 9 us would put 2048^3 above the peak)",
    "gemm_classes": _FITTED.format("fit_b200", "FP8: NVIDIA/TransformerEngine#1747 (8192^3, "
                                   "2377 TFLOP/s), pytorch/helion PR #2756 (torch._scaled_mm "
                                   "4096^3 ~1860), vllm-project/vllm PR #19566 (M 128-512, N "
                                   "6144, K 4096); MXFP8: flashinfer-ai/flashinfer PR #2464 "
                                   "(CUTLASS mm_mxfp8, 790-3201 TFLOP/s); the FP8 tiles assumed "
                                   "as Hopper's"),
    "link_gbps": "NVLink5: 1.8 TB/s bidirectional -> 900 per direction (datasheet)",
    "nccl_gbps": "derived: the fitted h100's rate x NCCL's own SM100 / SM90 NVLink bandwidth per "
                 "link (NVIDIA/nccl src/graph/topo.h: 40.1 / 20.6 GB/s); no AG/RS-by-size "
                 "table published for 8xB200 (an 8xB200 node's NVLS all-reduce reaches 830+ "
                 "GB/s busbw, NVIDIA/nccl#1807)",
    "nccl_p2p_gbps": "derived as nccl_gbps from the h100's send/recv cap (NVIDIA/nccl-tests#268)",
    "p2p_gbps": "Azure/AI-benchmarking-guide#7: nvbandwidth's p2p on a GB200 node ~770 GB/s per "
                "direction (the same NVLink5 and GPU)",
    "multicast_gbps": "assumption: NVLS at the NCCL rate",
    "nccl_ramp_us": _AS_H100, "nccl_latency_us": _AS_H100,
    "interference": _AS_H100, "nccl_sms": _AS_H100,
    "latencies": _FIXED_FIT,
    "min_gain": "as h100 (no published call on this machine)",
}

_B200 = Preset(
    name="b200",
    gpu="B200, HGX 8-GPU, NVLink5 via NVSwitch",
    **_BLACKWELL,
    peak_tflops={"bfloat16": 2250.0, "float16": 2250.0, "float32": 1125.0, "float8": 4500.0},
    min_gain=MARGINS["h100"],
    calibrated=_CALIBRATED["b200"],
    description="Blackwell: twice H100's NVLink, ~2.3x its dense BF16.",
    sources={**_SHARED_SOURCES, **_BLACKWELL_SOURCES,
             "peak_tflops": "NVIDIA HGX B200 datasheet: 2.25 PFLOP/s dense BF16 per GPU; FP8 72 "
                            "PFLOP/s per 8 GPUs with sparsity -> 4.5 dense per GPU (MXFP8 at the "
                            "FP8 rate)"},
)

# ---- GB200 NVL72: the b200 where a public source says otherwise -------------------------------
# The same Blackwell GPU (compute capability 10.0, 148 SMs, NVLink5 at 1.8 TB/s, 8 TB/s HBM3e) at
# a higher power limit, 4 to a compute tray, 72 in one NVLink domain. Every field that differs
# from the b200's is here with the public source that says so (tests/sim/test_published.py
# checks these are the only differences); every other number is the b200's, and its source says
# whether GB200 itself measured or specified it (_GB200_CITED) or it is extrapolated from the
# b200 (_EXTRAPOLATED).
_GB200_DATASHEET = ("NVIDIA GB200 NVL72 datasheet (nvidia.com/en-us/data-center/gb200-nvl72, "
                    "specifications: the rack's and one Blackwell GPU's, beside the HGX B200's)")
GB200_DIFFERENCES: dict[str, tuple[Any, str]] = {
    "peak_tflops": (
        {"bfloat16": 2500.0, "float16": 2500.0, "float32": 1250.0, "float8": 5000.0},
        f"{_GB200_DATASHEET}: 360 PFLOP/s FP16/BF16, 720 FP8, 180 TF32 per 72 GPUs with "
        "sparsity; one GPU 5 / 10 / 2.5 PFLOP/s sparse -> 2.5 / 5.0 / 1.25 dense, at a TDP "
        "configurable up to 1,200 W (the HGX B200's GPU: 4.5 / 9 PFLOP/s sparse at up to 1,000 "
        "W); MXFP8 at the FP8 rate"),
    "gpus_per_node": (
        4, f"{_GB200_DATASHEET}: 72 GPUs and 36 Grace CPUs in 18 compute trays, each tray 2 GB200 "
           "superchips (2 Grace, 4 GPUs) under one OS; mlcommons/inference_results_v6.1 closed/"
           "Crusoe/systems/GB200-NVL72_GB200-186GB_aarch64x16_Dynamo.json: 4 accelerators per "
           "node"),
    "nvlink_domain": (
        72, f"{_GB200_DATASHEET}: 72 GPUs on one NVLink switch system, 1.8 TB/s per GPU to every "
            "other, 130 TB/s in all (nine NVLink switch trays: NVIDIA Mission Control docs, "
            "'NVLink Switch Integration')"),
    "min_gain": (
        MARGINS["gb200-nvl72"],
        "derived: sim.published.fallback_margins with GB200's own published calls, the one-shot "
        "multicast all-reduces of lightseekorg/tokenspeed PR #860 (8 GPUs on 2 trays): 58.3% for "
        "that family; every other family as the h100's (nothing else published on GB200)"),
    "calibrated": (
        {}, "nothing measured on GB200 itself that the model is fitted to: the b200's GEMM range "
            "is a B200's (sim.published.calibrated_ranges('gb200-nvl72') is empty; tokenspeed's "
            "GB200 rows set a margin)"),
}
_GB200_TRAYS = ("a tensor-parallel group of 8 spans two compute trays; the NVLink path is the one "
                "inside a tray: every NVLink port of every GPU, those of one tray included, ends "
                "on the rack's NVLink switches (inside a 4-GPU tray nvidia-smi shows 'NV18 via "
                "NVSwitch': mlcommons/inference_results_v6.1 closed/Crusoe/systems/"
                "GB200-NVL72_GB200-186GB_aarch64x16_Dynamo.json), so the model prices the same "
                "rates and latencies. What differs across trays is software: p2p and multicast "
                "reach peers' buffers only through CUDA fabric handles with IMEX "
                "(docs/multiprocess.md; Preset.transport_needs says so per group)")
# Numbers equal to the b200's that GB200 itself specifies or measured.
_GB200_CITED = {
    "link_gbps": f"{_GB200_DATASHEET}: NVLink5, 1.8 TB/s bidirectional per GPU -> 900 per "
                 "direction",
    "hbm_gbps": f"{_GB200_DATASHEET}: 576 TB/s HBM3e for 72 GPUs -> 8 TB/s per GPU",
    "compute_capability": _CC.format("GB200 10.0 (the sm_100a fused GEMM, as the b200)"),
    "p2p_gbps": "measured on GB200: Azure/AI-benchmarking-guide#7, nvbandwidth's p2p on a GB200 "
                "node ~770 GB/s per direction (inside a tray; across trays: transports)",
    "nccl_gbps": "extrapolated from b200 (" + _BLACKWELL_SOURCES["nccl_gbps"].split(";")[0]
                 + "): no all-gather or reduce-scatter by size published on GB200; what is "
                 "measured there reaches the 8xB200's NVLS all-reduce, 830+ GB/s bus bandwidth "
                 "(NVIDIA/nccl#1807), across trays too: an all-reduce over all 72, 835-847 GB/s "
                 "at 4-8 GiB (coreweave/nccl-tests PR #43); an NCCL test on 8 GPUs on 2 trays "
                 "over multi-node NVLink, 811 GB/s (lixueduan.com/posts/ai/"
                 "13-gb200-mnnvl-nccl-test)",
    "transports": _GB200_TRAYS,
}
_EXTRAPOLATED = "extrapolated from b200 (not measured on GB200): {}"
_GB200 = _B200.replace(
    name="gb200-nvl72",
    gpu="GB200 NVL72: B200 at 1200 W, 4 per compute tray, 72 in one NVLink5 domain",
    description="Tensor-parallel groups across compute trays over multi-node NVLink: p2p and "
                "multicast through fabric handles (IMEX).",
    sources={**{k: _EXTRAPOLATED.format(v) for k, v in _B200.sources.items()},
             **_GB200_CITED, **{k: why for k, (_, why) in GB200_DIFFERENCES.items()}},
    **{k: value for k, (value, _) in GB200_DIFFERENCES.items()},
)
# Other names a preset is known by (get_preset, load_preset, bench --model).
ALIASES = {"gb200": "gb200-nvl72"}

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
            sources={**_SHARED_SOURCES, **_HOPPER_SOURCES,
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
            min_gain=MARGINS["h800"],
            calibrated=_CALIBRATED["h800"],
            description="H100 compute with the export NVLink: 400 GB/s bidirectional.",
            sources={**_SHARED_SOURCES, **_HOPPER_SOURCES,
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
            sources={**_SHARED_SOURCES, **_HOPPER_SOURCES,
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
            sources={**_SHARED_SOURCES,
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
            sources={**_SHARED_SOURCES,
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
                "min_gain": _MARGIN,
                "calibrated": "the a800 rows of sim.published",
            },
        ),
        _B200,
        _GB200,
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
            sources={**_SHARED_SOURCES,
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
                "min_gain": _MARGIN,
                "calibrated": "the pcie8 rows of sim.published",
            },
        ),
    ]
}


def get_preset(name: str) -> Preset:
    """A built-in preset by name or alias (``ALIASES``; case-insensitive)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; built-in: {sorted(PRESETS)} (aliases: "
                         f"{ALIASES})")
    return PRESETS[key]


def load_preset(spec: str | os.PathLike[str] | Preset) -> Preset:
    """A preset from a built-in name, a JSON file path, or a Preset (returned as is)."""
    if isinstance(spec, Preset):
        return spec
    s = os.fspath(spec)
    if s.lower() in PRESETS or s.lower() in ALIASES:
        return get_preset(s)
    if os.path.exists(s):
        with open(s) as f:
            return Preset.from_dict(json.load(f))
    raise ValueError(f"preset {s!r}: not a built-in ({sorted(PRESETS)}, aliases {sorted(ALIASES)}) "
                     "nor an existing file")
