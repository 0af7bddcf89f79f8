"""The fused path (a model): one persistent GEMM whose tiles wait on per-block flags.

The fused programs are the executors' own (``_host.build_program(..., fused=True)``,
docs/native.md §3 and docs/gpu-internals.md §5): the compute stream runs ONE ``FusedGemm`` op over
every row block instead of a GEMM per block. All-gather + GEMM: the kernel waits for each
block's flag before loading its rows (the transfers are today's: copy engine or switch).
GEMM + reduce-scatter: the kernel only releases, each destination's partial once its tiles
are stored; over ``p2p`` the comm stream copies it into its owner's workspace and the owner
sums the partials after the kernel, over ``multicast`` the owner load-reduces them. This
module says where the fused path is offered (``why_not``) and what the event engine needs to
play a ``FusedGemm`` tile by tile (``tile_plan``, ``engine.py``):

* the kernel's own speed: the whole GEMM's cuBLAS time (one GEMM over every row: one wave
  quantisation, one launch) divided by ``Preset.fused_gemm_rate``, the published ratio of
  fused GEMMs alone to cuBLAS (``sim.published.FUSED_GEMMS_ALONE``);
* its tiles, where the kernel's persistent CTAs take them: CUTLASS's stock sm90 scheduler
  (static striding; clusters of two CTAs along M, raster along N, batches outermost), the
  M slots mapped through the tile order of ``cpp/core/fused_tiles.h`` (``PersistentGrid``
  there; ``grid`` below mirrors it and ``tests/native/test_fused_tiles.py`` holds the two to
  each other). The two CTAs of a cluster always take the two M slots of a pair, so the grid is
  two *lanes* (even and odd M slots) of static striding each. The sm100 build (2-SM MMA,
  ``FusedKernel.mma_pair`` 2) strides the same grid, but a cluster's two CTAs are the two
  halves of one 256-row MMA tile, ordered over MMA tiles (``CtaTileAt``): one lane of
  ``ctas / 2`` clusters whose units are 256-row tiles, each waiting for both halves' rows;
* its row blocks and their flags: those of the op (a tile touching several blocks waits
  for, or feeds, all of them).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from jaxoverlap import _kinds
from jaxoverlap._fused_gemm import (
    FUSED_ALIGN,
    FUSED_DTYPES,
    FUSED_OPS,
    FUSED_TRANSPORTS,
    fused_align,
)
from jaxoverlap.sim import model
from jaxoverlap.sim.presets import Preset, canonical_dtype, gemm_class, output_dtype

OPS, TRANSPORTS, DTYPES, ALIGN = FUSED_OPS, FUSED_TRANSPORTS, FUSED_DTYPES, FUSED_ALIGN


def why_not(p: Preset, op: str, transport: str | None, algorithm: str = "two_shot", *,
            dtype: str | None = None, k: int | None = None, n: int | None = None) -> str:
    """Why the fused path is not offered for this call ("" when it is): the executors' own
    refusals (``cpp/core/build.cc``, the CUDA executor's prepare) and the preset's GPU.

    ``dtype``, ``k`` and ``n`` (the per-rank K and output columns) are checked when given.
    An fp8 ``dtype`` is priced as the model's FP8 programs run it (x and w of it, y bfloat16:
    ``sim.plan.programs``), so it is offered where that triple is an instantiation
    (``_kinds.FUSED_FP8``: e4m3); the planning rule (``_plan.fused_reason``)
    checks the call's own w and y before it asks.
    """
    if op not in OPS or algorithm != "two_shot":
        return f"the fused GEMM serves {OPS}, not {op!r} ({algorithm})"
    if transport not in TRANSPORTS:
        return (f"transport {transport!r}: the fused GEMM runs only with {TRANSPORTS}; a "
                "persistent kernel holding every SM while an NCCL kernel waits for SMs can "
                "deadlock (docs/gpu-internals.md §5)")
    kernel = p.fused_kernel
    if kernel is None:
        return (f"preset {p.name!r} (compute capability {p.compute_capability}): the fused "
                "GEMM is sm_90a code for compute capability 9.0 (Hopper) and sm_100a code for "
                "10.0 (B200, GB200), each running on its architecture only")
    k_unit = n_unit = ALIGN
    if dtype is not None and canonical_dtype(dtype) not in DTYPES:
        name = canonical_dtype(dtype)
        if _kinds.FusedFp8(name, name, output_dtype(name)) not in _kinds.FUSED_FP8:
            return f"dtype {dtype}: the fused GEMM is compiled for {_kinds.fused_listing()}"
        k_unit, n_unit = fused_align(name), fused_align(output_dtype(name))
    if dtype is not None and canonical_dtype(dtype) not in kernel.dtypes:
        return (f"dtype {dtype}: the fused GEMM is compiled for {kernel.dtypes} (its "
                f"{kernel.image} build)")
    if (k is not None and k % k_unit) or (n is not None and n % n_unit):
        return (f"k={k}, n={n}: the fused GEMM loads and stores rows of whole 16-byte units "
                f"(multiples of {k_unit} and {n_unit} elements)")
    return ""


# ---- the persistent grid --------------------------------------------------------------------


def grid(m_tiles: int, n_tiles: int, batch: int, sms: int) -> tuple[int, int]:
    """(M slots, CTAs) of the stock scheduler's persistent grid: ``PersistentGrid::Make``."""
    m_slots = (m_tiles + 1) // 2 * 2
    gpcs, residual = (1, 0) if sms < 18 else divmod(sms, 18)
    per_device = min(gpcs * 18 + residual - residual % 2, sms)
    return m_slots, 2 * min(per_device // 2, m_slots * n_tiles * batch // 2)


def unit(i: int, m_slots: int, n_tiles: int) -> tuple[int, int, int]:
    """(batch, M slot, N tile) of unit of work ``i``: ``PersistentGrid::At``."""
    batch, r = divmod(i, m_slots * n_tiles)
    pair, odd = divmod(r, 2)
    return batch, 2 * (pair // n_tiles) + odd, pair % n_tiles


# ---- the tiles ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """Consecutive units of one lane whose tiles touch the same blocks."""

    start: int  # first unit of the lane
    end: int  # one past the last
    touched: tuple[int, ...]  # the blocks its tiles' rows touch (none: a padding tile)
    waits: tuple[int, ...]  # those the kernel waits for


@dataclass(frozen=True)
class Lane:
    """The M slots of one parity: CTA j of the lane takes units j, j + ctas, ...; unit u of
    batch l is M slot 2 (u // n_tiles) + parity, N tile u % n_tiles."""

    runs: tuple[Run, ...]
    units: int
    ctas: int


@dataclass(frozen=True)
class TilePlan:
    """How the engine runs one FusedGemm: its lanes, time per tile, flags."""

    lanes: tuple[Lane, ...]
    tile_seconds: float  # one tile on one CTA at full speed
    overhead: float  # the state's zero-fill (fill_seconds), the launch, first-wave ramp, drain
    block_units: tuple[int, ...]  # units touching each block (a block is released at 0)
    wait_flags: int  # block b waits for own flag wait_flags + b (-1: no waits)
    release_flags: int  # block b's tiles stored: own flag release_flags + b (-1: none)

    @property
    def alone(self) -> float:
        """The kernel alone, every block ready: its GEMM at the fused rate."""
        return self.overhead + max(math.ceil(lane.units / lane.ctas) for lane in self.lanes
                                   if lane.units) * self.tile_seconds


@functools.lru_cache(maxsize=4096)
def _lanes(shards: int, chunks: int, shard_rows: int, sequence: tuple[int, ...],
           last_arrival: bool, waited: tuple[bool, ...], tile_rows: int, n_tiles: int,
           batch: int, sms: int, pair: int = 1) -> tuple[tuple[Lane, ...], tuple[int, ...]]:
    """The lanes of one fused GEMM: the tile order of ``cpp/core/fused_tiles.h``
    (``MakeTileOrder``: tiles by the position, in ``sequence``, of the last block they read or
    the first they feed, then by index) through the persistent grid. ``pair`` 2 (2-SM MMA):
    the order is over MMA tiles of two CTA tiles, which one cluster computes as one unit."""
    if pair not in (1, 2):
        raise ValueError(f"pair: expected 1 or 2 CTA tiles per MMA tile, got {pair}")

    def begin(b: int) -> int:
        shard, sub = divmod(b, chunks)
        return shard * shard_rows + shard_rows * sub // chunks

    blocks = shards * chunks
    rows = shards * shard_rows
    unit_rows = pair * tile_rows  # the order's tiles: MMA tiles
    m_units = math.ceil(rows / unit_rows)
    spans = [(begin(b), begin(b + 1) if b + 1 < blocks else rows) for b in range(blocks)]
    position = {b: i for i, b in enumerate(sequence)}
    order = []
    for t in range(m_units):
        lo, hi = t * unit_rows, min((t + 1) * unit_rows, rows)
        touched = tuple(b for b, (s, e) in enumerate(spans) if s < hi and lo < e)
        keys = [position[b] for b in touched]
        order.append((max(keys) if last_arrival else min(keys), t, touched))
    order.sort()
    m_slots, ctas = grid(math.ceil(rows / tile_rows), n_tiles, batch, sms)
    block_units = [0] * blocks
    lanes = []
    # 1-SM MMA: two lanes, the even and odd M slots; 2-SM MMA: one lane of clusters, each unit
    # both M slots of a pair (one MMA tile).
    for slots in ((range(0, m_slots, 2), range(1, m_slots, 2)) if pair == 1
                  else (range(m_slots // 2),)):
        runs: list[Run] = []
        for batch_index in range(batch):
            for q, slot in enumerate(slots):
                touched = order[slot][2] if slot < m_units else ()
                start = (batch_index * len(slots) + q) * n_tiles
                if runs and runs[-1].touched == touched and runs[-1].end == start:
                    runs[-1] = Run(runs[-1].start, start + n_tiles, touched, runs[-1].waits)
                else:
                    runs.append(Run(start, start + n_tiles, touched,
                                    tuple(b for b in touched if waited[b])))
                for b in touched:
                    block_units[b] += n_tiles
        lanes.append(Lane(tuple(runs), batch * len(slots) * n_tiles, ctas // 2))
    return tuple(lanes), tuple(block_units)


def tile_plan(p: Preset, dtype: str, op: dict[str, Any]) -> TilePlan:
    """The FusedGemm ``op`` (a program op of ``_host.build_program``) on preset ``p``."""
    f = op["fused"]
    tm, tn = kernel_tile(p, dtype)
    chunks, shard_rows = f["chunks"], f["shard_rows"]
    waited = tuple(f["wait_flags"] >= 0 and b // chunks != f["ready_shard"]
                   for b in range(f["shards"] * chunks))
    sms = kernel_sms(p, dtype, op)
    pair = p.fused_kernel.mma_pair if p.fused_kernel else 1
    lanes, block_units = _lanes(f["shards"], chunks, shard_rows, tuple(f["sequence"]),
                                f["order"] == "last_arrival", waited, tm,
                                math.ceil(op["n"] / tn), op["batch"], sms, pair)
    busy = kernel_busy(p, dtype, op["batch"], op["m"], op["n"], op["k"], sms=sms)
    tiles = math.ceil(op["m"] / tm) * math.ceil(op["n"] / tn) * op["batch"]
    ctas = sum(lane.ctas for lane in lanes) * pair  # a 2-SM unit: one CTA tile's time per CTA
    return TilePlan(lanes, busy / p.fused_gemm_rate / math.ceil(tiles / ctas),
                    fill_seconds(p, op) + p.gemm_overhead_us * model.US, block_units,
                    f["wait_flags"], f["release_flags"])


def fill_seconds(p: Preset, op: dict[str, Any]) -> float:
    """GPU seconds before the kernel of ``op`` starts on its stream: a fused GEMM that waits or
    releases first zero-fills its per-call state (``model.fused_state_fill``: a few bytes by
    ``cudaMemsetAsync``), a kernel of no bytes on a running stream, priced at a kernel's start
    there (``ar_start_us``, the one-launch fit's, as every reduction kernel's; an nsys trace of
    4-byte memsets on an H100 shows them at 1.1-1.8 us of GPU time, NVIDIA/Fuser PR #5742)."""
    return p.ar_start_us * model.US if model.fused_state_fill(op) else 0.0


def spare(m_tiles: int, n_tiles: int, batch: int, sms: int, most: int) -> int:
    """The SMs a fused GEMM that waits for nothing leaves to the reduction beside it:
    ``fused_tiles.h`` ``SpareSms`` (the most, up to ``most``, that cost its persistent grid no
    wave; two when even two do; even: clusters of two)."""
    if most < 2:
        return 0

    def waves(on: int) -> int | None:
        _, ctas = grid(m_tiles, n_tiles, batch, on)
        return -(-(m_tiles + m_tiles % 2) * n_tiles * batch // ctas) if ctas >= 2 else None

    full = waves(sms)
    for s in range(most - most % 2, 2, -2):
        if waves(sms - s) == full:
            return s
    return 2


def spare_sms(p: Preset, dtype: str, op: dict[str, Any]) -> int:
    """The SMs the FusedGemm ``op`` of ``dtype`` operands leaves on preset ``p``, as the CUDA
    executor picks them: ``spare`` up to ``FusedBlocks::spare_sms`` and a quarter of the
    device's, at least one, over the grid of the kernel's own CTA tiles (``kernel_tile``: an
    FP8 kernel's are half as wide, twice the N tiles)."""
    most = int(op["fused"].get("spare_sms", 0))
    if most <= 0:
        return 0
    tm, tn = kernel_tile(p, dtype)
    return max(1, spare(math.ceil(op["m"] / tm), math.ceil(op["n"] / tn), op["batch"], p.sms,
                        min(most, p.sms // 4)))


def kernel_sms(p: Preset, dtype: str, op: dict[str, Any]) -> int:
    """The SMs the FusedGemm ``op`` of ``dtype`` operands runs on: the GPU's, less those it
    leaves to the rank's other streams (a reduction beside a release-only kernel:
    ``spare_sms``, as many of ``fused["spare_sms"]`` as the CUDA executor leaves)."""
    spare = int(op["fused"].get("spare_sms", 0) or 0)
    if not 0 <= spare < p.sms:
        raise ValueError(f"spare_sms: expected 0..{p.sms - 1} on preset {p.name!r}, got {spare}")
    return p.sms - spare_sms(p, dtype, op)


def kernel_busy(p: Preset, dtype: str, batch: int, m: int, n: int, k: int,
                accumulate: bool = False, sms: int | None = None) -> float:
    """Seconds of tile work of the fused GEMM over all ``m`` rows at cuBLAS's speed for its
    tile shape: the model's GEMM with the kernel's one tile and no split-K (one wave
    quantisation for the whole GEMM), less the per-kernel cost; on ``sms`` of the SMs when
    it leaves the others to another kernel (their share of the peak, their waves). The
    kernel's own speed relative to that is ``Preset.fused_gemm_rate``."""
    t, _, _ = model.gemm_plan(p, dtype, batch, m, n, k, accumulate, (kernel_tile(p, dtype),),
                              sms=sms)
    return t - p.gemm_overhead_us * model.US


def kernel_tile(p: Preset, dtype: str) -> tuple[int, int]:
    """The fused kernel's CTA tile (M, N) for ``dtype`` operands: that of the kernel the
    preset's GPU runs (``FusedKernel.tile_for``, the executors' ``CtaTileOf``: sm_90a's FP8
    kernel runs 128 x 128, its 16-bit one and sm_100a's 128 x 256); where none runs for
    ``dtype``, the preset's (the class's ``GemmFit.fused_tile``, else ``fused_gemm_tile``)."""
    kernel = p.fused_kernel
    own = kernel.tile_for(canonical_dtype(dtype)) if kernel is not None else None
    return own or p.gemm_fit(gemm_class(dtype)).fused_tile or p.fused_gemm_tile
