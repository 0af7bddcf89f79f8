"""Hardware presets: plain data the cost model reads (no per-GPU code paths).

Every number is either cited (``sources``: the research brief
``shared/research/peers.md`` section and its primary source) or marked as an
assumption. A user with GPUs replaces the assumptions with measurements and
saves the result as JSON (``Preset.to_json`` / ``load_preset(path)``).

Units: bandwidths in GB/s (1e9 bytes/s) per GPU per direction, compute in
TFLOP/s (dense), latencies in microseconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


def canonical_dtype(dtype: str) -> str:
    """'bf16' -> 'bfloat16' etc.; raises on anything the executors do not support."""
    name = _DTYPE_ALIASES.get(str(dtype), str(dtype))
    if name not in DTYPES:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
    return name


def dtype_bytes(dtype: str) -> int:
    return 4 if canonical_dtype(dtype) == "float32" else 2


@dataclass(frozen=True)
class Preset:
    """One machine: a TP group of GPUs behind one switch (or PCIe fabric).

    The link model: each GPU has one egress and one ingress port of ``link_gbps``
    (NVSwitch: full bisection, so only the GPU's own ports contend). A transport
    reaches a fraction of the line rate (protocol overhead): a byte sent by NCCL
    costs ``link_gbps / nccl_gbps`` wire bytes, by the copy engine
    ``link_gbps / p2p_gbps``, by multicast ``link_gbps / multicast_gbps``.
    """

    name: str
    gpu: str
    sms: int  # streaming multiprocessors (for the SMs NCCL / multicast kernels take)
    peak_tflops: dict[str, float]  # dense tensor-core peak per dtype (float32 = TF32)
    gemm_efficiency: float  # best achieved / peak on a large GEMM (MAMF)
    hbm_gbps: float  # memory bandwidth (memory-bound GEMMs, Add)
    link_gbps: float  # NVLink / PCIe line rate per direction per GPU
    nccl_gbps: float  # NCCL ring all-gather / reduce-scatter bus bandwidth
    p2p_gbps: float | None  # copy-engine peer copies (None: no peer access)
    multicast_gbps: float | None  # multimem.st / ld_reduce throughput (None: no multicast)
    # Shape-dependent GEMM efficiency: eff = gemm_efficiency * f(m) f(n) f(k),
    # f(x) = x / (x + x_half); plus a fixed cost per GEMM kernel.
    gemm_m_half: float = 32.0
    gemm_n_half: float = 32.0
    gemm_k_half: float = 64.0
    gemm_overhead_us: float = 2.0
    nccl_latency_us: float = 8.0  # per send/recv (group launch + handshake)
    ce_latency_us: float = 10.0  # per copy-engine copy (launch + CE ramp-up)
    mc_latency_us: float = 3.0  # per multicast kernel
    signal_latency_us: float = 2.0  # Signal -> visible to the peer's Wait
    event_latency_us: float = 0.0  # Record -> StreamWait
    nccl_sms: int = 16  # SMs a running NCCL send/recv takes from the GEMM
    mc_sms: int = 16  # SMs a running multicast kernel takes
    description: str = ""
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def transports(self) -> tuple[str, ...]:
        """Transports this machine supports, in DESIGN §3.2's auto order reversed."""
        out = ["nccl"]
        if self.p2p_gbps:
            out.append("p2p")
        if self.multicast_gbps:
            out.append("multicast")
        return tuple(out)

    def transport_gbps(self, transport: str) -> float:
        bw = {"nccl": self.nccl_gbps, "p2p": self.p2p_gbps,
              "multicast": self.multicast_gbps}.get(transport)
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


_BRIEF = "shared/research/peers.md"
_ASSUMED_LAT = ("assumption (not measured): latencies and SM counts are typical orders of "
                "magnitude; calibrate with a bench run (docs/performance.md)")

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            name="h100",
            gpu="H100 SXM 80GB, HGX 8-GPU, NVLink4 via NVSwitch",
            sms=132,
            peak_tflops={"bfloat16": 989.0, "float16": 989.0, "float32": 494.7},
            gemm_efficiency=794.5 / 989.0,
            hbm_gbps=3350.0,
            link_gbps=450.0,
            nccl_gbps=365.0,
            p2p_gbps=391.5,
            multicast_gbps=365.0,
            description="The reference machine of the research brief.",
            sources={
                "peak_tflops": f"{_BRIEF} §5: 989 TFLOP/s dense BF16 (stas00/ml-engineering#100); "
                               "TF32 494.7 dense: NVIDIA H100 datasheet (not in the brief)",
                "gemm_efficiency": f"{_BRIEF} §5/§8: best measured BF16 matmul 794.5 TFLOP/s "
                                   "= 80.3% (stas00/ml-engineering MAMF)",
                "hbm_gbps": "NVIDIA H100 SXM datasheet, 3.35 TB/s (not in the brief)",
                "link_gbps": f"{_BRIEF} §5: NVLink4 450 GB/s per direction (nccl-tests#212)",
                "nccl_gbps": f"{_BRIEF} §5: AG/RS busbw 360-370 GB/s on 8xH100 "
                             "(nccl-tests#326, NCCL#1455)",
                "p2p_gbps": f"{_BRIEF} §5: raw P2P ~783 GB/s bidirectional of 900 "
                            "(NVIDIA/nccl#1264) -> 391.5 per direction",
                "multicast_gbps": "assumption: NVLS stores/load-reduces at the NCCL rate "
                                  f"(NVLS AR busbw ~480 GB/s, {_BRIEF} §5, is consistent)",
                "sms": "H100 SXM5 has 132 SMs (datasheet)",
                "latencies": _ASSUMED_LAT,
            },
        ),
        Preset(
            name="h200",
            gpu="H200 SXM 141GB, HGX 8-GPU, NVLink4 via NVSwitch",
            sms=132,
            peak_tflops={"bfloat16": 989.0, "float16": 989.0, "float32": 494.7},
            gemm_efficiency=794.5 / 989.0,
            hbm_gbps=4800.0,
            link_gbps=450.0,
            nccl_gbps=365.0,
            p2p_gbps=391.5,
            multicast_gbps=365.0,
            description="H100 compute and NVLink with faster HBM3e.",
            sources={
                "peak_tflops": "same Hopper die as H100 (NVIDIA H200 datasheet)",
                "gemm_efficiency": "assumed equal to H100 (same SMs/clocks)",
                "hbm_gbps": "NVIDIA H200 datasheet, 4.8 TB/s (not in the brief)",
                "link_gbps": "NVLink4, 450 GB/s per direction (as H100)",
                "nccl_gbps": f"assumed as H100; {_BRIEF} §5 gives H200 all-reduce 475 GB/s "
                             "(nccl-tests#272, NVLS), consistent with the same NVLink4",
                "p2p_gbps": "assumed as H100",
                "multicast_gbps": "NVSwitch + sm_90 (multicast supported); rate assumed as H100",
                "latencies": _ASSUMED_LAT,
            },
        ),
        Preset(
            name="a100",
            gpu="A100 SXM 80GB, HGX 8-GPU, NVLink3 via NVSwitch",
            sms=108,
            peak_tflops={"bfloat16": 312.0, "float16": 312.0, "float32": 156.0},
            gemm_efficiency=0.85,
            hbm_gbps=2039.0,
            link_gbps=300.0,
            nccl_gbps=230.0,
            p2p_gbps=260.0,
            multicast_gbps=None,
            description="No multicast: multimem needs sm_90 (brief §4).",
            sources={
                "peak_tflops": "NVIDIA A100 datasheet: 312 TFLOP/s BF16 dense, TF32 156 "
                               "(not in the brief)",
                "gemm_efficiency": "assumption: ~85% of peak, as commonly measured for large "
                                   "BF16 GEMMs on A100 (not in the brief; calibrate)",
                "link_gbps": "NVLink3: 600 GB/s bidirectional -> 300 per direction (datasheet)",
                "nccl_gbps": "assumption: ~77% of line rate, the same protocol overhead as H100 "
                             f"(365/450 scaled; {_BRIEF} §5 sjeaugey: ~20% overhead)",
                "p2p_gbps": "assumption: 87% of line rate, as H100's 783/900",
                "multicast_gbps": f"{_BRIEF} §4: multimem PTX needs sm_90+ -> unsupported",
                "latencies": _ASSUMED_LAT,
            },
        ),
        Preset(
            name="b200",
            gpu="B200, HGX 8-GPU, NVLink5 via NVSwitch",
            sms=148,
            peak_tflops={"bfloat16": 2250.0, "float16": 2250.0, "float32": 1125.0},
            gemm_efficiency=0.75,
            hbm_gbps=8000.0,
            link_gbps=900.0,
            nccl_gbps=695.0,
            p2p_gbps=783.0,
            multicast_gbps=695.0,
            description="Blackwell: twice H100's NVLink, ~2.3x its dense BF16.",
            sources={
                "peak_tflops": "NVIDIA HGX B200 datasheet: 2.25 PFLOP/s dense BF16 per GPU "
                               "(not in the brief)",
                "gemm_efficiency": "assumption: 75% (no MAMF number in the brief; calibrate)",
                "link_gbps": "NVLink5: 1.8 TB/s bidirectional -> 900 per direction (datasheet)",
                "nccl_gbps": f"{_BRIEF} §5: B300 ring all-reduce busbw 695 GB/s (NCCL#2140); "
                             "AG/RS assumed equal",
                "p2p_gbps": "assumption: 87% of line rate, as H100's 783/900",
                "multicast_gbps": f"assumption: NCCL ring rate ({_BRIEF} §5: B300 NVLS AR "
                                  "busbw 845 GB/s)",
                "sms": f"148 SMs ({_BRIEF} §5, TMA remark)",
                "latencies": _ASSUMED_LAT,
            },
        ),
        Preset(
            name="pcie8",
            gpu="8x L20 48GB, PCIe Gen4 x16, no NVLink",
            sms=92,
            peak_tflops={"bfloat16": 119.5, "float16": 119.5, "float32": 59.8},
            gemm_efficiency=0.70,
            hbm_gbps=864.0,
            link_gbps=32.0,
            nccl_gbps=20.0,
            p2p_gbps=25.0,
            multicast_gbps=None,
            nccl_latency_us=15.0,
            ce_latency_us=12.0,
            description="A PCIe-only box, the machine of Flux's PCIe numbers (brief §8).",
            sources={
                "gpu": f"{_BRIEF} §8: Flux reports 8xL20 PCIe TP8 results",
                "peak_tflops": "NVIDIA L20 datasheet: 119.5 TFLOP/s FP16/BF16 dense "
                               "(not in the brief)",
                "gemm_efficiency": "assumption: 70% (calibrate)",
                "link_gbps": "PCIe Gen4 x16: 32 GB/s per direction line rate",
                "nccl_gbps": "assumption: ~20 GB/s AG busbw over PCIe switches (calibrate)",
                "p2p_gbps": "assumption: ~25 GB/s peer copies over PCIe (calibrate)",
                "multicast_gbps": "no NVSwitch -> unsupported",
                "latencies": _ASSUMED_LAT,
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
