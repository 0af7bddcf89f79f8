"""The cost model: how long one op takes alone on a preset.

Kept apart from the event engine so the formulas are few, readable and
testable by hand. Contention (shared ports, SMs taken by communication
kernels) is the engine's job; here every cost assumes the op runs alone.
"""

from __future__ import annotations

from jaxoverlap.sim.presets import Preset, canonical_dtype, dtype_bytes

US = 1e-6


def shape_factor(x: float, half: float) -> float:
    """x / (x + half): 1 for large dims, 1/2 at x == half.

    Why this shape: time per unit of work of a GEMM with dimension x behaves like
    (x + half) / x — a fixed per-tile cost (prologue/epilogue, partial tiles, the
    pipeline fill of the K loop) amortised over x. So splitting a dimension into c
    chunks costs c * half extra "rows": chunking never helps the GEMM itself.
    """
    return x / (x + half)


def gemm_efficiency(p: Preset, m: int, n: int, k: int) -> float:
    """Fraction of the dense peak a GEMM of this shape reaches (model)."""
    return (p.gemm_efficiency * shape_factor(m, p.gemm_m_half) * shape_factor(n, p.gemm_n_half)
            * shape_factor(k, p.gemm_k_half))


def gemm_time(p: Preset, dtype: str, batch: int, m: int, n: int, k: int,
              accumulate: bool = False) -> float:
    """Seconds for d = a @ w (+ c) with every SM: roofline of FLOPs at the shape's
    efficiency and HBM bytes, plus a fixed per-kernel overhead."""
    if batch * m * n * k == 0:
        return 0.0
    dtype = canonical_dtype(dtype)
    e = dtype_bytes(dtype)
    flops = 2.0 * batch * m * n * k
    t_flops = flops / (p.peak_tflops[dtype] * 1e12 * gemm_efficiency(p, m, n, k))
    moved = e * (batch * m * k + k * n + batch * m * n * (2 if accumulate else 1))
    t_mem = moved / (p.hbm_gbps * 1e9)
    return max(t_flops, t_mem) + p.gemm_overhead_us * US


def elementwise_time(p: Preset, nbytes: int, passes: int) -> float:
    """A memory-bound kernel touching ``passes`` x ``nbytes`` of HBM (Add: 3, local copy: 2)."""
    return passes * nbytes / (p.hbm_gbps * 1e9) + p.gemm_overhead_us * US


def transport_latency(p: Preset, transport: str) -> float:
    return {"nccl": p.nccl_latency_us, "p2p": p.ce_latency_us,
            "multicast": p.mc_latency_us}[transport] * US


def collective_bytes(op: str, nranks: int, batch: int, rows: int, k: int, n: int,
                     dtype: str) -> int:
    """S of nccl-tests: the whole gathered (AG) or pre-reduction (RS) array in bytes."""
    cols = k if op == "ag_matmul" else n
    return nranks * batch * rows * cols * dtype_bytes(dtype)


def collective_time(p: Preset, transport: str, nranks: int, total_bytes: int) -> float:
    """Standalone all-gather / reduce-scatter of S = total_bytes (unfused, one call).

    Ring bound of nccl-tests (brief §5): t = latency + (S/B)(n-1)/n with B the
    transport's bus bandwidth. Every rank must receive (AG) or send (RS)
    (n-1)/n S through its own port at that rate, whatever the schedule, so no
    program on the same transport moves the data faster in the engine either —
    which is what keeps projected speedups under the ideal bound.
    """
    if nranks <= 1:
        return 0.0
    bw = p.transport_gbps(transport) * 1e9
    return transport_latency(p, transport) + total_bytes * (nranks - 1) / nranks / bw
