"""The cost model: the formulas that price one op, and how concurrent ops slow each other.

Kept apart from the event engine so the formulas are few, readable and testable by
hand. Each formula names the mechanism it stands for and where its form comes from;
the numbers live in the presets (``presets.py``), which cite theirs.

The problem one call solves on each rank is described once, in ``Shape``, and the ops a
call can have once, in ``OPS``: which collective the unfused path runs and which array it
moves. A new op (say GEMM + all-reduce) is one more entry there and its programs in
``_host.build_program``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jaxoverlap import _kinds
from jaxoverlap.sim.presets import Preset, canonical_dtype, dtype_bytes, gemm_class, output_dtype

US = 1e-6


# ---- the problem and the ops ----------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """The canonical problem of docs/native.md §1, per rank.

    AG: x [batch, rows, k] -> y [batch, nranks*rows, n];
    RS: x [batch, nranks*rows, k] -> y [batch, rows, n];
    AR: x [batch, rows, k] -> y [batch, rows, n] (all rows: the two-shot algorithm splits
    them into N blocks, the one-shot one does not).
    """

    batch: int
    rows: int
    k: int
    n: int

    @classmethod
    def from_global(cls, m: int, k: int, n: int, nranks: int, batch: int = 1) -> Shape:
        """M = the gathered / full sequence rows (must divide by nranks)."""
        if m % nranks:
            raise ValueError(f"M={m} is not divisible by nranks={nranks}")
        return cls(batch, m // nranks, k, n)


@dataclass(frozen=True)
class OpSpec:
    """What the unfused path of an op does, per rank, for the canonical shape.

    collective: the NCCL collective of the unfused path; bus_factor: its nccl-tests
    bus-bandwidth factor (bytes each rank moves = bus_factor * S, S the whole array,
    nvidia/nccl-tests doc/PERFORMANCE.md); comm_cols: which per-rank dimension the
    moved array has as columns ("k": the gathered input, "n": the output).
    """

    collective: str
    comm_cols: str

    def bus_factor(self, nranks: int) -> float:
        if self.collective == "all_reduce":
            return 2.0 * (nranks - 1) / nranks
        return (nranks - 1) / nranks


OPS: dict[str, OpSpec] = {o.name: OpSpec(o.collective, o.communicates) for o in _kinds.OPS}


def op_spec(op: str) -> OpSpec:
    if op not in OPS:
        raise ValueError(f"op: expected one of {tuple(OPS)}, got {op!r}")
    return OPS[op]


# ---- GEMM -----------------------------------------------------------------------------------


def shape_factor(x: float, half: float) -> float:
    """x / (x + half): a fixed cost per tile amortised over a dimension of length x.

    Per output tile a GEMM pays a prologue (filling the operand pipeline) and an
    epilogue (writing the tile) whatever its K, so the time per unit of K behaves like
    (k + k_half) / k. (``gemm_m_half`` / ``gemm_n_half`` do the same along M and N;
    0 by default: tile and wave quantisation stand for M and N, below.)
    """
    return x / (x + half) if half > 0 else 1.0


@functools.lru_cache(maxsize=1 << 16)
def _configs(tiles: tuple[tuple[int, int], ...], sms: int, min_split_k: int, batch: int,
             m: int, n: int, k: int) -> tuple[tuple[float, int], ...]:
    """(useful fraction of the SM-time, K splits) of every tile shape x split-K choice,
    the best fraction per split count. No tiles: an idealised GEMM without quantisation."""
    if not tiles:
        return ((1.0, 1),)
    best: dict[int, float] = {}
    for tm, tn in tiles:
        count = batch * math.ceil(m / tm) * math.ceil(n / tn)
        padding = (m * n) / (math.ceil(m / tm) * tm * math.ceil(n / tn) * tn)
        max_splits = max(1, min(2 * math.ceil(sms / count), k // max(1, min_split_k)))
        for splits in range(1, max_splits + 1):
            if splits > 1 and count >= sms:
                break
            units = count * splits
            useful = padding * units / (math.ceil(units / sms) * sms)
            best[splits] = max(best.get(splits, 0.0), useful)
    return tuple((useful, splits) for splits, useful in sorted(best.items()))


def quantisation(p: Preset, batch: int, m: int, n: int, k: int, cls: str = "16bit"
                 ) -> tuple[tuple[float, int], ...]:
    """Tile and wave quantisation: (useful fraction of the SM-time, K splits) per choice.

    A GEMM runs as output tiles, one per SM at a time, in waves: a partial tile costs
    a whole one and the last partial wave leaves SMs idle. With fewer tiles than SMs
    the library can split K (split-K: fp32 partial tiles written and reduced). It
    picks the tile shape (``p.gemm_tiles``) and split that run fastest (``gemm_time``;
    Osama et al., "Stream-K", PPoPP 2023, arXiv:2301.03598, §2 describes this
    quantisation). Small GEMMs — the chunks of a chunked program — lose most: one
    persistent fused kernel schedules every chunk's tiles in one grid and does not pay
    it per chunk.
    """
    return _configs(p.gemm_fit(cls).tiles, p.sms, p.gemm_min_split_k, batch, m, n, k)


def _shape(halves: tuple[float, float, float], useful: float, splits: int, m: int, n: int,
           k: int) -> float:
    return (useful * shape_factor(m, halves[0]) * shape_factor(n, halves[1])
            * shape_factor(k / splits, halves[2]))


@functools.lru_cache(maxsize=1 << 16)
def _plan(key: tuple, batch: int, m: int, n: int, k: int, elem: tuple[int, int],
          accumulate: bool, kernel_tiles: tuple[tuple[int, int], ...] | None = None,
          used: int | None = None) -> tuple[float, float, int]:
    peak, efficiency, best_shape, halves, tiles, sms, min_split_k, hbm = key
    ref = max(_shape(halves, u, s, *best_shape)
              for u, s in _configs(tiles, sms, min_split_k, 1, *best_shape))
    if used is not None:  # the GEMM on `used` of the SMs: their share of the peak, their waves
        peak, sms = peak * used / sms, used
    flops = 2.0 * batch * m * n * k
    elem_in, elem_out = elem     # bytes per element of a and w, of d (and c)
    base_bytes = (elem_in * (batch * m * k + k * n)
                  + elem_out * batch * m * n * (2 if accumulate else 1))
    best = (math.inf, 0.0, 1)
    # one kernel of its own tiles, no split-K; else the library's choice
    configs = (_configs(kernel_tiles, sms, 1 << 62, batch, m, n, k) if kernel_tiles
               else _configs(tiles, sms, min_split_k, batch, m, n, k))
    for useful, splits in configs:
        eff = efficiency * min(1.0, _shape(halves, useful, splits, m, n, k) / ref)
        moved = base_bytes + (2 * 4 * batch * m * n * splits if splits > 1 else 0)
        t = max(flops / (peak * eff), moved / hbm)
        if t < best[0]:
            best = (t, eff, splits)
    return best


def gemm_plan(p: Preset, dtype: str, batch: int, m: int, n: int, k: int,
              accumulate: bool = False, kernel_tiles: tuple[tuple[int, int], ...] | None = None,
              block_scaled: bool = False, sms: int | None = None) -> tuple[float, float, int]:
    """(seconds, efficiency, K splits) of the fastest way to run d = a @ w (+ c) alone.

    Per tile/split choice: the roofline of FLOPs at ``gemm_efficiency`` scaled by the
    shape (quantisation, and the K curve over each split's K) relative to the best
    shape — ``p.gemm_efficiency`` is a measurement *at* ``p.gemm_best_shape`` (the
    MAMF search's best shape, stas00/ml-engineering), so no shape gets more and the
    shape effects are never applied on top of it — against the HBM bytes (A, W
    once, D, C when accumulating, split-K partials); plus a fixed cost per kernel
    (``gemm_overhead_us``: launch, first-wave ramp, drain). ``kernel_tiles``: a kernel
    that has only these tiles and no split-K (the fused GEMM), priced against the same
    best-shape figure. The efficiency, best shape, K curve and tiles are those of the operands'
    class (``Preset.gemm_fit``: FP8 GEMMs have their own fit, and their CUTLASS kernels K tiles
    of 128, twice the 16-bit ones); ``block_scaled``: fp8 operands with 1x32 block scales
    (MXFP8). ``sms``: the GEMM runs on that many of the GPU's SMs (another kernel holds the
    rest): their share of the peak, waves of that many tiles, the best shape's figure and the
    HBM still the whole GPU's.
    """
    dtype = canonical_dtype(dtype)
    fit = p.gemm_fit(gemm_class(dtype, block_scaled))
    key = (p.peak(dtype) * 1e12, fit.efficiency, fit.best_shape,
           (p.gemm_m_half, p.gemm_n_half, fit.k_half), fit.tiles, p.sms,
           p.gemm_min_split_k, p.hbm_gbps * 1e9)
    elem = (dtype_bytes(dtype), dtype_bytes(output_dtype(dtype)))
    if sms is not None and not 0 < sms <= p.sms:
        raise ValueError(f"sms: expected 1..{p.sms} (the preset's SMs), got {sms}")
    used = None if sms is None or sms == p.sms else int(sms)
    t, eff, splits = _plan(key, batch, m, n, k, elem, bool(accumulate), kernel_tiles, used)
    return t + p.gemm_overhead_us * US, eff, splits


def gemm_efficiency(p: Preset, m: int, n: int, k: int, batch: int = 1) -> float:
    """Fraction of the dense peak the fastest way to run this GEMM reaches (model)."""
    return gemm_plan(p, "bfloat16", batch, m, n, k)[1]


def gemm_time(p: Preset, dtype: str, batch: int, m: int, n: int, k: int,
              accumulate: bool = False, block_scaled: bool = False) -> float:
    """Seconds for d = a @ w (+ c) alone on the GPU (``gemm_plan``)."""
    if batch * m * n * k == 0:
        return 0.0
    return gemm_plan(p, dtype, batch, m, n, k, accumulate, block_scaled=block_scaled)[0]


def dequantized_gemm_time(p: Preset, batch: int, m: int, n: int, k: int,
                          accumulate: bool = False, dequantize_w: bool = True) -> float:
    """Seconds for d = a @ w of block-scaled fp8 operands (MXFP8: 1x32 e8m0 scales) as the
    ``xla`` and ``ring`` impls compute it: not a block-scaled GEMM but their reference
    (``_xla.block_product``), each operand dequantized to float32 (its fp8 elements and scales
    read, float32 written), a float32 dot (TF32 at JAX's default matmul precision: the preset's
    float32 peak with the 16-bit fit, A and W read at four bytes), its float32 product rounded
    to the output dtype (bfloat16: four bytes read, two written). The dequantization and the
    rounding are priced as one memory-bound pass, as written; XLA may fuse them into the dot's
    operand loads and epilogue, which saves that pass (about a tenth of the dot's time at the
    standard shapes). ``dequantize_w`` False: w's float32 copy is already made (the ring's
    steps dequantize the same w with the same scales; XLA's common-subexpression elimination,
    openxla/xla ``xla/service/hlo_cse.cc``, computes it once per call)."""
    if batch * m * n * k == 0:
        return 0.0
    elements = batch * m * k + (k * n if dequantize_w else 0)
    nbytes = (elements * (1 + 4) + elements // 32  # fp8 and e8m0 scales read, float32 written
              + batch * m * n * (4 + 2))           # the float32 product read, bfloat16 written
    return (gemm_time(p, "float32", batch, m, n, k, accumulate)
            + elementwise_time(p, nbytes, 1))


def elementwise_time(p: Preset, nbytes: int, passes: int) -> float:
    """A memory-bound kernel touching ``passes`` x ``nbytes`` of HBM (Add: 3, local copy: 2)."""
    return passes * nbytes / (p.hbm_gbps * 1e9) + p.gemm_overhead_us * US


# ---- moving bytes ---------------------------------------------------------------------------


def pipelined_time(ramp: float, x: float) -> float:
    """(sqrt(ramp) + sqrt(x))^2 seconds to move ``x`` seconds' worth of bytes in chunks.

    A transfer is cut into c chunks that flow through a pipeline of d stages (the hops
    of a ring, each forwarding a chunk once it has it), each chunk paying a fixed overhead
    alpha per stage: T(c) = (c + d - 1) (alpha + x / c). The best c gives T = (sqrt(ramp)
    + sqrt(x))^2 with ramp = (d - 1) alpha — the classic pipelined-broadcast result (e.g.
    Sanders, Speck, Traeff, "Two-tree algorithms for full bandwidth broadcast, reduction and
    scan", Parallel Computing 35, 2009). The effective bandwidth ramps with size: x / T =
    1 / (1 + sqrt(ramp / x))^2. It is the form of software that forwards in chunks (NCCL's
    ring); one copy-engine copy is pipelined in hardware at packet granularity, not in
    chunks a program pays for: its ramp is 0 (``Preset.ce_ramp_us``) and it takes its
    start plus bytes / rate.
    """
    if x <= 0:
        return ramp
    return (math.sqrt(ramp) + math.sqrt(x)) ** 2


def transport_latency(p: Preset, transport: str) -> float:
    """Fixed start of one transfer op (launch, and for NCCL the send/recv rendezvous)."""
    return getattr(p, _kinds.transport(transport).preset.latency_us) * US


def transport_step(p: Preset, transport: str) -> float:
    """Latency of one ring step (hop) that no chunking hides: a step cannot start before the
    previous rank's first data of it has arrived (a flag handoff over the link). NCCL's own
    cost model has this form, a base latency plus steps x a per-hop latency
    (NVIDIA/nccl src/graph/tuning.cc, ``baseLat`` + ``nsteps * hwLat``); it is what makes a
    small all-reduce (2(N-1) steps) cost ~20 us on 8xH100 where an all-gather of 2 MiB
    (N-1 steps) costs about as much. NCCL transfers only: the copy engine and multicast
    kernels have no ring."""
    return p.nccl_step_us * US if transport == "nccl" else 0.0


def transport_ramp(p: Preset, transport: str) -> float:
    """Per-hop pipeline overhead of a transport (the ``ramp`` of ``pipelined_time``)."""
    return getattr(p, _kinds.transport(transport).preset.ramp_us) * US


def transfer_gbps(p: Preset, transport: str, collective: bool = False) -> float:
    """Top rate of one transfer: a point-to-point NCCL send/recv runs on fewer channels
    (SMs) than a ring collective and plateaus far below it (~180 vs ~360 GB/s on
    H100 NVLink: NVIDIA/nccl-tests#268, #326); a copy-engine copy or a multicast kernel
    reaches the transport's rate."""
    rate = p.transport_gbps(transport)
    if transport == "nccl" and not collective and p.nccl_p2p_gbps:
        return min(rate, p.nccl_p2p_gbps)
    return rate


def transfer_fill(p: Preset, transport: str, nbytes: float, hops: int = 1) -> float:
    """Seconds a transfer of ``nbytes`` alone spends beyond bytes / its top rate.

    ``latency + hops * step + pipelined_time(hops * ramp, x) - x``, x = nbytes /
    ``transfer_gbps``: the engine charges it before the bytes flow (it uses no link
    capacity), so that a transfer alone takes exactly latency + hops * step +
    (sqrt(hops * ramp) + sqrt(x))^2. ``hops`` > 1 only where a program forwards (NCCL's
    ring collective); a copy-engine copy, ramp 0, takes latency + x.
    """
    x = nbytes / (transfer_gbps(p, transport, collective=hops > 1) * 1e9)
    ramp = hops * transport_ramp(p, transport)
    return (transport_latency(p, transport) + hops * transport_step(p, transport)
            + pipelined_time(ramp, x) - x)


def one_shot_all_reduce_time(p: Preset, nbytes: int) -> float:
    """A one-shot all-reduce of ``nbytes`` alone, as the engine charges our multicast
    one-shot program's communication: one flag round (each rank raises its peers' flags
    after its partial is written, ``signal_latency_us``), then one load-reduce of the
    ``nbytes`` through the switch (a multicast transfer: its start, ramp and bytes). What
    ``mc_latency_us`` is fitted to (``sim.published.fit_one_shot``): published single-kernel
    one-shot all-reduces of small messages, whose cost is the same two things."""
    x = nbytes / (transfer_gbps(p, "multicast") * 1e9)
    return p.signal_latency_us * US + transfer_fill(p, "multicast", nbytes) + x


def collective_bytes(op: str, nranks: int, batch: int, rows: int, k: int, n: int,
                     dtype: str) -> int:
    """S of nccl-tests: the whole gathered (AG), pre-reduction (RS) or reduced (AR) array in
    bytes (the canonical shape: AR's rows are all of them). AG moves x (fp8: one byte per
    element), the reductions the GEMM's output (fp8 operands: bfloat16)."""
    moves_x = op_spec(op).comm_cols == "k"
    cols = k if moves_x else n
    whole = rows if _kinds.op(op).rows == "all" else nranks * rows
    return batch * whole * cols * dtype_bytes(dtype if moves_x else output_dtype(dtype))


def collective_time(p: Preset, transport: str, nranks: int, total_bytes: int,
                    op: str = "ag_matmul") -> float:
    """The standalone collective of ``op``'s unfused path moving S = total_bytes.

    A ring over N ranks is a pipeline of ``ring_steps`` hops (NCCL's ring algorithm), so
    t = latency + steps * step + pipelined_time(steps * ramp, bus_factor * S / B), B the
    transport's asymptotic bus bandwidth (nccl-tests busbw), ``step`` the latency of a
    hop that no chunking hides (``transport_step``). The ramp is what makes NCCL's
    bandwidth ramp with message size: on 8xH100 the bus bandwidth is 91 GB/s at 2 MiB
    and 305 GB/s at 128 MiB (NVIDIA/Megatron-LM PR #5596), ~360 GB/s at several GB
    (NVIDIA/nccl-tests #212, #326); the steps are what make a small all-reduce cost
    21-28 us (pytorch/helion#245, vllm-project/vllm#24111). Every rank must move
    bus_factor * S through its own port whatever the schedule, so no program moves the
    data faster in the engine.
    """
    if nranks <= 1:
        return 0.0
    x = op_spec(op).bus_factor(nranks) * total_bytes / (p.transport_gbps(transport) * 1e9)
    steps = ring_steps(op, nranks)
    return (transport_latency(p, transport) + steps * transport_step(p, transport)
            + pipelined_time(steps * transport_ramp(p, transport), x))


def ring_steps(op: str, nranks: int) -> int:
    """Hops of the ring collective of ``op``'s unfused path: N-1 for an all-gather or a
    reduce-scatter, 2(N-1) for an all-reduce (a reduce-scatter, then an all-gather: NCCL's
    ring algorithm, nvidia/nccl-tests doc/PERFORMANCE.md). What makes a small all-reduce
    latency-bound: each step pays the per-hop start whatever the size."""
    steps = nranks - 1
    return 2 * steps if op_spec(op).collective == "all_reduce" else steps


def collective_floor(p: Preset, transport: str, nranks: int, total_bytes: int,
                     op: str = "ag_matmul") -> float:
    """Bytes alone: bus_factor * S / B. Every rank must move that through its own port
    at the transport's rate, whatever the schedule — no program beats it."""
    if nranks <= 1:
        return 0.0
    return (op_spec(op).bus_factor(nranks) * total_bytes
            / (p.transport_gbps(transport) * 1e9))


# ---- ops running together ------------------------------------------------------------------


def compute_rate(p: Preset, sms_taken: float, hbm_bytes_per_s: float) -> float:
    """Speed of a compute kernel (1 = alone) next to running transfers.

    Two mechanisms: SM-based transports (NCCL kernels, multicast kernels) take SMs
    from it, ``1 - taken / sms``; and bytes moved through this GPU's memory by
    transfers (read at the sender, written at the receiver, copy engine or not) slow
    it by ``1 + interference * traffic / hbm_bandwidth`` (memory, cache and power
    contention). ``interference`` is fitted to a GEMM running next to an independent
    copy-engine all-gather on 8xH100 (pytorch/pytorch PR #172714); compute-bound fused
    AG+GEMM kernels then take 1.12-1.14x their GEMM alone, as published.
    """
    free = max(0.0, 1.0 - sms_taken / p.sms)
    return free / (1.0 + p.interference * hbm_bytes_per_s / (p.hbm_gbps * 1e9))


def host_time(p: Preset, programs: Sequence[dict[str, Any]]) -> float:
    """Seconds the host needs to enqueue one call (the slowest rank's program).

    The executor issues every op of the program from the host (a kernel, a copy, a
    stream memory op, an event) after a fixed per-call cost (the FFI handler, the
    clique and program look-up). In a loop of calls the GPU cannot run faster than
    the host enqueues, so a call takes at least this long: the cost of many small
    chunks that a single fused kernel does not pay. Counted with ``host_ops``.
    """
    from jaxoverlap.sim.launch import host_enqueue

    return host_enqueue(p, max((host_ops(pr) for pr in programs), default=0))


def host_ops(program: dict[str, Any]) -> int:
    """The operations the host enqueues for one rank's program (a captured call replays as many
    nodes, ``launch.replay``): one per op, and one more per
    fused GEMM that waits or releases, whose launch first zero-fills its per-call state with a
    ``cudaMemsetAsync`` on its stream (the fault record it waits with, or the tile counters it
    releases with: ``cpp/cuda/executor.cc`` ``Exec``, ``cpp/cuda/fused/fused_gemm_enqueue.cuh``
    ``Enqueue``); a ResetFlags op of a replayable program is one ``cuStreamWriteValue32`` per
    flag it lowers (``cpp/cuda/executor.cc``)."""
    return sum(op_nodes(op) for op in program["ops"])


def op_nodes(op: dict[str, Any]) -> int:
    """The operations the host enqueues for one op (``host_ops``), or the nodes it is in a
    captured call."""
    if op.get("kind") == "ResetFlags":
        return max(int(op["n"]), 1)
    return 2 if fused_state_fill(op) else 1


def fused_state_fill(op: dict[str, Any]) -> bool:
    """Whether the fused GEMM ``op`` zero-fills its per-call state before its kernel: a wait
    needs a fresh fault record, a release zeroed tile counters."""
    if op.get("kind") != "FusedGemm":
        return False
    f = op["fused"]
    return f["wait_flags"] >= 0 or f["release_flags"] >= 0
