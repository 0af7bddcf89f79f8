"""The fused path (a model): one persistent GEMM whose tiles wait on per-block flags.

The chunked programs (``_host.build_program``) run one cuBLASLt GEMM per row block (a
shard, or a sub-chunk of one) on the compute stream, each after a stream wait for its
flag and each followed by the event or flag that releases it to a comm stream. The
fused path (docs/gpu.md §10) replaces that chain by ONE persistent GEMM over all the
rows: its CTAs take the tiles in the order the blocks arrive (all-gather + GEMM: the
local shard first) or leave (GEMM + reduce-scatter: the order the comm stream sends
them), a tile waits in the kernel for the flags of the blocks its rows read, and the
epilogue releases a block once all its tiles are stored. The transfers stay those of
today's programs (copy engine or switch: no SMs next to the kernel).

``fold`` turns a chunked program into that program: stream 0's chain of Wait / Gemm /
Record / Signal ops becomes one ``FusedGemm`` op carrying each block's waits and
releases (in the kernel: not host-enqueued), the rest stays. ``TilePlan`` is what the
event engine needs to run it tile by tile (``engine.py``):

* the kernel's own speed: the whole GEMM's cuBLAS time (one GEMM over every row: one
  wave quantisation, one launch) divided by ``Preset.fused_gemm_rate``, the published
  ratio of fused GEMMs alone to cuBLAS (``sim.published.FUSED_GEMMS_ALONE``);
* its tiles: ``Preset.fused_gemm_tile`` CTA tiles, one per CTA at a time, each CTA of
  the persistent grid taking slots c, c + grid, c + 2 grid, ... of the tile order (the
  static striding of CUTLASS's persistent scheduler), so a late block stalls exactly
  the CTAs whose next tile reads it, and the last block's tiles are a partial wave;
* its order and row blocks: those of ``cpp/core/fused_tiles.h`` (a tile touching
  several blocks waits for, or feeds, all of them).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jaxoverlap.sim import model
from jaxoverlap.sim.presets import Preset

Program = dict[str, Any]
OPS = ("ag_matmul", "matmul_rs")  # the ops with a fused path
TRANSPORTS = ("p2p", "multicast")  # never nccl: docs/gpu.md §10, rule 1
_WAITS = ("Wait", "StreamWait")
_RELEASES = ("Record", "Signal")


def why_not(p: Preset, op: str, transport: str | None, algorithm: str = "two_shot",
            rows: int | None = None, chunks: int = 1) -> str:
    """Why the fused path is not offered for this call ("" when it is); ``rows``: per shard.

    GEMM + reduce-scatter over the ``p2p`` ring keeps today's reduction in the GEMM (beta =
    1 onto the accumulator received from the previous rank), so its tiles wait for the
    accumulator's flag as well as release their block: a tile straddling two blocks would
    wait for a block that leaves later than the one it releases, and around the ring that
    deadlocks. Its blocks must be whole tiles (``rows / chunks`` a multiple of the tile's
    rows at every sub-chunk boundary).
    """
    if op not in OPS or algorithm != "two_shot":
        return f"the fused GEMM serves {OPS}, not {op!r} ({algorithm})"
    if transport not in TRANSPORTS:
        return (f"transport {transport!r}: the fused GEMM runs only with {TRANSPORTS}; a "
                "persistent kernel holding every SM while an NCCL kernel waits for SMs can "
                "deadlock (docs/gpu.md §10)")
    if not p.fused_gemm:
        return (f"preset {p.name!r} (compute capability {p.compute_capability}): the fused "
                "GEMM is sm_90a code and runs on compute capability 9.0 (Hopper) only")
    tile = p.fused_gemm_tile[0]
    if (op == "matmul_rs" and transport == "p2p" and rows is not None
            and any(rows * c // chunks % tile for c in range(chunks + 1))):
        return (f"GEMM + reduce-scatter over p2p: blocks of {rows} rows / {chunks} chunks are "
                f"not whole {tile}-row tiles; a tile straddling two blocks of the ring would "
                "wait for the later one's accumulator and deadlock")
    return ""


# ---- the program ----------------------------------------------------------------------------


def fold(program: Program, op: str, transport: str) -> Program:
    """``program`` with its compute stream's per-block GEMM chain folded into one FusedGemm.

    The Waits before a Gemm become its block's waits, the Records / Signals after it the
    block's releases (both done by the kernel, not enqueued by the host); other compute-
    stream ops inside the chain (a bidirectional RS's final Add, AG's copies into the
    gathered result) run after the kernel, in their order. With ``multicast`` all-gather
    the rank's own multimem stores (kernels that need SMs) are ordered before the kernel
    by a stream dependency (docs/gpu.md §10, rule 1).
    """
    ops = program["ops"]
    s0 = [i for i, o in enumerate(ops) if o["stream"] == 0]
    gemms = [i for i in s0 if ops[i]["kind"] == "Gemm"]
    first, last = gemms[0], gemms[-1]
    # the chain: from the waits right before the first Gemm to the releases right after the last
    start = s0.index(first)
    while start > 0 and ops[s0[start - 1]]["kind"] in _WAITS:
        start -= 1
    end = s0.index(last) + 1
    while end < len(s0) and ops[s0[end]]["kind"] in _RELEASES:
        end += 1
    chain = [ops[i] for i in s0[start:end]]
    blocks: list[dict[str, Any]] = []
    after: list[dict[str, Any]] = []
    waits: list[tuple[str, int]] = []
    releasing = False  # right after a Gemm (or its releases)
    for o in chain:
        kind = o["kind"]
        if kind in _WAITS:
            waits.append(("flag" if kind == "Wait" else "event", int(o["id"])))
        elif kind == "Gemm":
            blocks.append({"shard": o["shard"], "sub": o["sub"], "m": o["m"], "waits": waits,
                           "releases": [], "accumulate": bool(o.get("accumulate"))})
            waits = []
        elif kind in _RELEASES and releasing:
            blocks[-1]["releases"].append(o)
        else:
            after.append(o)
        releasing = kind == "Gemm" or (releasing and kind in _RELEASES)
    g, m = ops[first], sum(b["m"] for b in blocks)
    fused = {
        "kind": "FusedGemm", "stream": 0, "batch": g["batch"], "m": m, "n": g["n"], "k": g["k"],
        "accumulate": any(b["accumulate"] for b in blocks),
        "bytes": sum(o["bytes"] for o in chain if o["kind"] == "Gemm"),
        # the row blocks as the builders cut them: `chunks` sub-chunks of `rows` per shard
        "rows": sum(b["m"] for b in blocks if b["shard"] == blocks[0]["shard"]),
        "chunks": 1 + max(b["sub"] for b in blocks), "blocks": blocks,
        "order": "last_arrival" if op == "ag_matmul" else "first_departure",
        "text": f"FusedGemm({len(blocks)} blocks, {m} rows)"}
    chained = {id(o) for o in chain}
    # multicast AG: the own multimem stores (SM kernels) finish before the kernel starts
    stores = [i for i, o in enumerate(ops) if o["kind"] == "McStore"]
    stored = None
    if op == "ag_matmul" and transport == "multicast" and stores:
        stored = 1 + max((o["id"] for o in ops if o["kind"] in ("Record", "StreamWait")),
                         default=-1)
    out: list[dict[str, Any]] = []
    for i, o in enumerate(ops):
        if o is chain[0]:
            if stored is not None:
                out.append({"kind": "StreamWait", "stream": 0, "id": stored,
                            "text": f"StreamWait(ev{stored}: own multicast stores)"})
            out += [fused, *after]
        if id(o) in chained:
            continue
        out.append(o)
        if stored is not None and i == stores[-1]:
            out.append({"kind": "Record", "stream": o["stream"], "id": stored,
                        "text": f"Record(ev{stored})"})
    return {**program, "ops": out}


# ---- the tiles ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """Consecutive slots of the tile order whose tiles share their order key."""

    start: int  # first slot
    end: int  # one past the last slot
    waits: tuple[int, ...]  # the blocks (indices into FusedGemm["blocks"]) its tiles read
    row_tiles: tuple[tuple[int, tuple[int, ...]], ...]  # (slots, blocks touched) per row tile


@dataclass(frozen=True)
class TilePlan:
    """How the engine runs one FusedGemm: its tiles, order, grid and time per tile."""

    runs: tuple[Run, ...]
    tiles: int  # every tile of the GEMM (slots of the order)
    grid: int  # persistent CTAs
    tile_seconds: float  # one tile on one CTA at full speed
    overhead: float  # the kernel's launch, first-wave ramp and drain
    block_tiles: tuple[int, ...]  # tiles touching each block (RS releases a block at 0)

    @property
    def alone(self) -> float:
        """The kernel alone, every block ready: its GEMM at the fused rate."""
        return self.overhead + math.ceil(self.tiles / self.grid) * self.tile_seconds


def _row_blocks(blocks: Sequence[dict[str, Any]], rows: int, chunks: int
                ) -> list[tuple[int, int]]:
    """[begin, end) rows of each block in the GEMM's M (shard s at rows s * rows; sub-chunk c
    at rows * c / chunks: cpp/core/fused_tiles.h RowBlocks)."""
    return [(b["shard"] * rows + rows * b["sub"] // chunks,
             b["shard"] * rows + rows * (b["sub"] + 1) // chunks) for b in blocks]


@functools.lru_cache(maxsize=4096)
def _tiling(spans: tuple[tuple[int, int], ...], tile_rows: int, col_tiles: int, batch: int,
            last_arrival: bool) -> tuple[tuple[Run, ...], int, tuple[int, ...]]:
    """The tile order over blocks given in processing order (``spans``: their rows)."""
    total = max(e for _, e in spans)
    row_tiles = math.ceil(total / tile_rows)
    keyed = []
    for t in range(row_tiles):
        lo, hi = t * tile_rows, min((t + 1) * tile_rows, total)
        touched = tuple(i for i, (b, e) in enumerate(spans) if b < hi and lo < e)
        keyed.append((max(touched) if last_arrival else min(touched), t, touched))
    keyed.sort()
    per_row = col_tiles * batch
    runs: list[Run] = []
    slot = 0
    block_tiles = [0] * len(spans)
    i = 0
    while i < len(keyed):
        j = i
        while j < len(keyed) and keyed[j][0] == keyed[i][0]:
            j += 1
        group = keyed[i:j]
        waits = tuple(sorted({b for _, _, touched in group for b in touched}))
        runs.append(Run(slot, slot + per_row * len(group), waits,
                        tuple((per_row, touched) for _, _, touched in group)))
        for _, _, touched in group:
            for b in touched:
                block_tiles[b] += per_row
        slot += per_row * len(group)
        i = j
    return tuple(runs), slot, tuple(block_tiles)


def tile_plan(p: Preset, dtype: str, op: dict[str, Any]) -> TilePlan:
    """The FusedGemm ``op`` on preset ``p``: its tiles in order and the time per tile."""
    tm, tn = p.fused_gemm_tile
    spans = tuple(_row_blocks(op["blocks"], op["rows"], op["chunks"]))
    runs, tiles, block_tiles = _tiling(spans, tm, math.ceil(op["n"] / tn), op["batch"],
                                       op["order"] == "last_arrival")
    busy = kernel_busy(p, dtype, op["batch"], op["m"], op["n"], op["k"], op["accumulate"])
    grid = min(p.sms, tiles)
    return TilePlan(runs, tiles, grid, busy / p.fused_gemm_rate / math.ceil(tiles / grid),
                    p.gemm_overhead_us * model.US, block_tiles)


def kernel_busy(p: Preset, dtype: str, batch: int, m: int, n: int, k: int,
                accumulate: bool = False) -> float:
    """Seconds of tile work of the fused GEMM over all ``m`` rows at cuBLAS's speed for its
    tile shape: the model's GEMM with the kernel's one tile and no split-K (one wave
    quantisation for the whole GEMM), less the per-kernel cost. The kernel's own speed
    relative to that is ``Preset.fused_gemm_rate``."""
    t, _, _ = model.gemm_plan(p, dtype, batch, m, n, k, accumulate, (p.fused_gemm_tile,))
    return t - p.gemm_overhead_us * model.US
