"""The mechanisms of a GEMM + reduce-scatter whose reduction overlaps the GEMM (a model of
programs not built yet), each a function a program's ops can be priced with.

Published designs that win at GEMM+RS keep the GEMM on most SMs and reduce each block of
partials as soon as every rank has released it (docs/performance.md §4's table of designs). Their
parts, each priced here from its own source:

* **a GEMM on fewer SMs** (``gemm_time_on_sms``): the persistent GEMM leaves ``s`` SMs to a
  reduction kernel (TransformerEngine's ``sm_count - num_comm_sm``, Triton-distributed's
  ``NUM_SMS - num_rs_sms``): the same kernel with S - s SMs' share of the peak and its waves of
  S - s tiles; HBM is shared, so a memory-bound GEMM loses less;
* **a reduction kernel** (``reduction_time``): it reads N partials of a block — its own from HBM,
  the peers' from HBM after a copy or straight over the links — and writes the block once (one
  pass of N reads and one write, not N - 1 pairwise adds: ``pairwise_adds_time`` prices those),
  at ``Preset.reduce_sm_gbps`` per SM up to ``Preset.reduce_efficiency`` of HBM (or the link
  rate for peers' partials);
* **interference**: the reduction's and the transfers' bytes slow the GEMM next to them
  (``model.compute_rate``, as for every compute op next to transfers);
* **the tail**: after the GEMM's last tile, one block's transfer and reduction
  (``tail_time``), not the whole output's;
* **the host's enqueue**: the published copy-engine designs issue every copy, the stream wait
  before it, and their fills, barriers, stream-to-stream waits and kernels from eager Python
  (``HOST_OPS``, counted per design from its code), so a call cannot run faster than the host
  enqueues them (``sim.launch.host_enqueue``, as for our own programs).

Two published designs are priced from these parts, as projections of *their* mechanisms (not
our programs; ``sim.published`` compares their rows with them): ``overlapped``, the copy-engine
GEMM+RS of Triton-distributed and kraken, and ``pulled``, Flux's Hopper GEMM+RS, whose GEMM
kernel's own warps pull the peers' tiles and whose sum runs after it in ATen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxoverlap.sim import fused, launch, model
from jaxoverlap.sim.presets import Preset, dtype_bytes, output_dtype

US = 1e-6


def gemm_time_on_sms(p: Preset, dtype: str, batch: int, m: int, n: int, k: int, sms: int,
                     accumulate: bool = False) -> float:
    """Seconds for d = a @ w on ``sms`` of the GPU's SMs (the rest busy with another kernel):
    the peak scaled by ``sms / p.sms`` and the tile waves on ``sms`` SMs (``model.gemm_plan``);
    the HBM bandwidth is shared, not scaled."""
    if batch * m * n * k == 0:
        return 0.0
    return model.gemm_plan(p, dtype, batch, m, n, k, accumulate, sms=sms)[0]


def reduction_rate(p: Preset, sms: int | None = None, remote: bool = False) -> float:
    """Bytes/s a reduction kernel on ``sms`` SMs (None or 0: as many as it needs) streams:
    ``sms x reduce_sm_gbps``, at most ``reduce_efficiency`` of HBM, or the link rate when it
    reads peers' memory."""
    sms = p.sms if not sms else sms
    if not 0 < sms <= p.sms:
        raise ValueError(f"sms: expected 1..{p.sms} (the preset's SMs), got {sms}")
    cap = (p.p2p_load_gbps or p.link_gbps) if remote else p.reduce_efficiency * p.hbm_gbps
    return min(sms * p.reduce_sm_gbps, cap) * 1e9


def reduction_sms(p: Preset, sms: int | None = None) -> int:
    """The SMs a reduction kernel holds: its budget, or (None or 0) the fewest that reach its
    HBM cap (more would only wait on memory)."""
    if sms:
        return min(int(sms), p.sms)
    return min(p.sms, math.ceil(p.reduce_efficiency * p.hbm_gbps / p.reduce_sm_gbps))


def reduction_time(p: Preset, sources: int, block_bytes: float, sms: int | None = None,
                   remote: bool = False) -> float:
    """One kernel summing ``sources`` partials of ``block_bytes`` into one block (a program's
    ``Reduce`` op: its ``sources`` and ``sms``, 0 = the whole GPU): ``sources`` reads and one
    write in one pass (``remote``: the sources but one read over the links from peers' memory,
    the own one and the write in HBM), plus a kernel's fixed cost (``gemm_overhead_us``)."""
    if sources < 1 or block_bytes < 0:
        raise ValueError(f"sources >= 1 and block_bytes >= 0 expected, got {sources}, "
                         f"{block_bytes}")
    overhead = p.ar_start_us * US
    if not remote:
        return (sources + 1) * block_bytes / reduction_rate(p, sms) + overhead
    over_links = (sources - 1) * block_bytes / reduction_rate(p, sms, remote=True)
    in_hbm = 2 * block_bytes / reduction_rate(p, sms)
    return max(over_links, in_hbm) + overhead


def pairwise_adds_time(p: Preset, nranks: int, block_bytes: float) -> float:
    """Today's reduction after the release-only fused GEMM+RS over p2p: a copy of the own
    partial and N - 1 adds of a received one, each its own kernel (2 + 3(N - 1) passes)."""
    return (model.elementwise_time(p, int(block_bytes), 2)
            + (nranks - 1) * model.elementwise_time(p, int(block_bytes), 3))


def tail_time(p: Preset, transport: str, nranks: int, block_bytes: float,
              sms: int | None = None) -> float:
    """What an overlapped GEMM+RS exposes after its GEMM's last tile: the last block's transfer
    (its fixed start and bytes, ``model.transfer_fill``) and its reduction."""
    x = block_bytes / (model.transfer_gbps(p, transport) * 1e9)
    return (model.transfer_fill(p, transport, block_bytes) + x
            + reduction_time(p, nranks, block_bytes, sms))


def sms_for(p: Preset, nranks: int, block_bytes: float, seconds: float) -> int:
    """The fewest SMs whose reduction of one block (N partials in HBM) fits in ``seconds``
    (the time the GEMM takes per block): the reduction keeps pace with the GEMM."""
    if seconds <= p.ar_start_us * US:
        return p.sms
    need = (nranks + 1) * block_bytes / (seconds - p.ar_start_us * US)
    return min(p.sms, max(1, math.ceil(need / (p.reduce_sm_gbps * 1e9))))


# The SM budgets and sub-chunk counts a projection tries: the executors cap a kernel's budget at
# 32 SMs (a program holds it on every GPU it runs on); 0: no reduction beside the GEMM, one
# reduction on every SM after it.
SM_BUDGETS = (0, 8, 16, 24, 32)
CHUNKS = (1, 2, 4, 8)


@dataclass(frozen=True)
class HostOps:
    """The GPU operations (kernels, fills, barriers, stream waits, copies, events) one call of a
    published copy-engine GEMM+RS enqueues from eager Python, counted from its source: two per
    destination (the own one included) and sub-chunk, a stream wait on the GEMM's flag and the
    copy, and ``per_call`` more."""

    per_call: int
    per_copy: int = 2

    def count(self, nranks: int, chunks: int = 1) -> int:
        """The ops of one call over ``nranks`` ranks, each destination's block in ``chunks``."""
        return self.per_copy * nranks * chunks + self.per_call


# Each design's host-issued ops per call, as its code runs one call (one node, the default
# persistent mode; a torch ``wait_stream`` is an event record and a stream wait on it, two ops;
# allocations from torch's caching allocator and Triton's descriptor scratch issue none):
#
# * Triton-distributed at PR #166's commit (019bd59f, ByteDance-Seed/Triton-distributed
#   python/triton_dist/kernels/nvidia/gemm_reduce_scatter.py ``gemm_rs_op``, reduce_scatter.py
#   ``reduce_scatter_2d_op``, ``reduce_scatter_multi_node``, ``reduce_scatter_for_each_node``,
#   ``intra_node_scatter``): per destination a ``cuStreamWaitValue64`` and a
#   ``cudaMemcpyAsync``; per call 16: ``rs_stream.wait_stream`` (2), the tile counters'
#   ``torch.zeros`` (a fill), the persistent GEMM, ``nvshmem_barrier_all_on_stream`` before the
#   scatter, ``reduction_stream.wait_stream`` in ``reduce_scatter_multi_node`` (2), a second
#   ``nvshmem_barrier_all_on_stream`` after the copies, ``reduction_stream.wait_stream`` again
#   (2), the reduction kernel (``ring_reduce_tma``), ``stream.wait_stream(reduction_stream)``
#   (2), ``reset_barriers`` (a fill of the flags), ``current_stream.wait_stream`` (2). The
#   release its H800 chart came with (9ce6c2f1, ``gemm_rs_multi_node_persistent_op``) issues
#   more (26 a call: a third barrier, a second reduction kernel, a flag write and a wait, a
#   third stream): for those rows the count is a lower bound;
# * kraken at PR #19's commit (4dda71d, meta-pytorch/kraken
#   kraken/reduce_scatter_fusion/gemm_reduce_scatter_ce_persistent.py
#   ``gemm_reduce_scatter_ce_persistent``, ``copy_engine_scatter``): per destination a
#   ``cuStreamWaitValue32`` and a ``copy_``; per call 9: ``backend_stream.wait_stream`` (2),
#   two ``torch.zeros`` (the progress counters and the signal pad: fills), the persistent GEMM
#   (its TMA descriptors cached on the host), ``current_stream().wait_stream`` (2), the
#   symmetric memory's ``barrier()`` (a kernel) and the reduction kernel.
HOST_OPS = {"triton-dist-rs": HostOps(per_call=16), "kraken-ce-rs": HostOps(per_call=9)}


@dataclass(frozen=True)
class Overlapped:
    """A projection of one GEMM+RS whose transfers (and reduction) overlap the GEMM."""

    seconds: float
    sms: int  # the reduction's SMs beside the GEMM (0: one reduction after it, every SM)
    chunks: int  # sub-chunks per destination block
    gemm: float  # the GEMM on the SMs it keeps, slowed by the bytes moved beside it
    copies: float  # the comm stream's copies of every peer's sub-chunks, back to back
    reductions: float  # the reduction stream's kernels, back to back (sms 0: the one after)
    tail: float  # exposed after the GEMM: the last sub-chunk's copy and reduction


def overlapped(p: Preset, dtype: str, batch: int, m: int, n: int, k: int, nranks: int,
               transport: str = "p2p", sms: int | None = None, chunks: int | None = None, *,
               design: str) -> Overlapped:
    """A projection (of a program not built yet: label it so) of d = a @ w over ``m`` rows
    whose N output blocks are reduce-scattered while the GEMM runs, from this module's
    mechanisms: the GEMM on ``p.sms - sms`` SMs (at ``fused_gemm_rate``) releasing each
    destination's sub-chunk, copies moving them (one comm stream: each copy its fixed start
    and bytes), and a one-pass reduction of the N partials of each sub-chunk on ``sms`` SMs
    beside the GEMM, the last sub-chunk's copy and reduction (on every SM: the GEMM is done,
    as TransformerEngine's pipelined reduce-scatter runs its last chunk) exposed after it.
    ``sms`` 0: no reduction beside the GEMM, the GEMM on every SM and one reduction of the
    whole block on every SM after it (the copies still overlap). The streams overlap, so the
    call takes the longest plus what is exposed; the GEMM is slowed by the copies' and the
    reductions' HBM bytes (``model.compute_rate``). ``sms`` / ``chunks`` None: the fastest
    of ``SM_BUDGETS`` / ``CHUNKS``. The call takes at least the host's enqueue of the ops
    ``design``'s Python issues (``HOST_OPS``: its waits and copies per destination and
    sub-chunk, the own one included, and its fills, barriers, stream waits and kernels per
    call) at the preset's host costs."""
    if design not in HOST_OPS:
        raise ValueError(f"design: one of {sorted(HOST_OPS)} (whose host ops are counted), got "
                         f"{design!r}")
    if transport != "p2p":
        raise ValueError(f"transport: the projection prices copy-engine copies ('p2p'), got "
                         f"{transport!r}")
    p.check_group(nranks)
    if m % nranks:
        raise ValueError(f"m={m}: the reduce-scatter splits the rows into {nranks} blocks")
    out = batch * m * n * dtype_bytes(output_dtype(dtype))
    block = out / nranks
    best: Overlapped | None = None
    for s in (sms,) if sms is not None else SM_BUDGETS:
        for c in (chunks,) if chunks else CHUNKS:
            sub = block / c
            alone = (gemm_time_on_sms(p, dtype, batch, m, n, k, p.sms - s)
                     - p.gemm_overhead_us * US) / p.fused_gemm_rate
            # through this GPU's HBM while the GEMM runs: the N-1 blocks copied out (read) and
            # in (written), and beside it the N partials of its own block read, the sum written
            beside = (nranks + 1) * block if s else 0.0
            moved = 2 * (nranks - 1) * block + beside
            gemm = alone / model.compute_rate(p, 0, moved / max(alone, 1e-12))
            copy = model.transfer_fill(p, transport, sub) + sub / (
                model.transfer_gbps(p, transport) * 1e9)
            copies = (nranks - 1) * c * copy
            if s:
                reductions = c * reduction_time(p, nranks, sub, s)
                tail = copy + reduction_time(p, nranks, sub)
                busy = max(gemm, copies, reductions)
            else:
                reductions = reduction_time(p, nranks, block)
                tail = copy + reductions
                busy = max(gemm, copies)
            device = p.gemm_overhead_us * US + busy + tail
            t = max(device, launch.host_enqueue(p, HOST_OPS[design].count(nranks, c)))
            if best is None or t < best.seconds:
                best = Overlapped(t, s, c, gemm, copies, reductions, tail)
    assert best is not None
    return best


# ATen's reduction of stacked partials (``torch.sum`` over [N, M/N, cols]) reaches 23-43% of
# HBM peak on these shapes, a dedicated Triton kernel 82-88% at the same traffic: ATen's
# reduce_kernel is instruction-bound for an extent of 2-8 (pytorch/pytorch PR #191803). The
# projection takes the middle of the published range; the ends bound it.
STACKED_SUM_HBM = (0.23, 0.43)


# What Flux's Hopper GEMM+RS does with the peers' tiles it pulls, by release of its code:
# "stacked" (bytedance/flux db4ffe0 and later, ``fuse_reduction=False``, the only mode its
# constructor takes for bf16): each tile copied into a reduce buffer of the whole output, [M,
# cols], then ATen's sum over the N stacked partials; "in_kernel" (239a13d, the commit of its
# README's H800 table): the own tile copied, then each peer's tile added in place
# (``red.global.add``) into a buffer of the own block only, [M/N, cols], then a copy of it
# (ATen's sum over a dim of one).
PULLED_REDUCES = ("stacked", "in_kernel")


@dataclass(frozen=True)
class Pulled:
    """A projection of Flux's Hopper GEMM+RS (``pulled``): its parts, in seconds."""

    seconds: float
    gemm: float  # the persistent GEMM on every SM, slowed by the bytes moved beside it
    pulls: float  # the N - 1 peers' tiles of the own block over the links
    last: float  # exposed after the GEMM: the last wave's pulls
    sum: float  # after the kernel: the stacked sum of the N partials, or a copy of the block


def pulled(p: Preset, dtype: str, batch: int, m: int, n: int, k: int, nranks: int,
           sum_efficiency: float | None = None, reduce: str = "stacked") -> Pulled:
    """A projection (of a published design, not of our programs: label it so) of Flux's
    Hopper GEMM+RS on one node (bytedance/flux @19831ca,
    ``src/gemm_rs/sm90_gemm_tma_warpspecialized_cooperative_reduce_scatter.hpp``,
    ``sm90_reduce_scatter_utils.hpp``, ``ths_op/gemm_reduce_scatter.cc``; @239a13d the same
    files under ``src/reduce_scatter/``):

    * a CUTLASS cooperative persistent GEMM on every SM (at ``fused_gemm_rate``) whose
      producer warp group carries a fetch warp and a reduce warp: for each tile a CTA computes,
      the fetch warp waits on the source rank's flag of the same tile of *this* rank's rows and
      TMA-loads it from that peer, the reduce warp writes it into a local reduce buffer
      (``reduce``: ``PULLED_REDUCES``). The M blocks are XOR-swizzled by rank
      (``tile_mappings.hpp``), so the peer computes that tile at the same time: each pull waits
      about one tile, the pulls (N - 1 blocks over the links) run beside the GEMM and only the
      last wave's are exposed;
    * the bytes through this GPU's HBM beside the GEMM slow it (``model.compute_rate``): the
      whole partial read by its owners' fetches, and the reduce buffer written: the whole
      output ("stacked"), or the own block once ("in_kernel": the in-place adds land in L2,
      which holds the block at the published shape, F2's 12 MiB; a block larger than L2
      would pay its read-modify-writes in HBM, not priced here);
    * after the kernel no barrier (the host skips it on Hopper with one node:
      ``GemmRS::forward_barrier``), then ATen's ``sum(0)``: over [N, M/N, cols] ("stacked"),
      N reads and one write of the block at ``sum_efficiency`` of HBM (``STACKED_SUM_HBM``;
      None: the middle of the published range), or over a dim of one ("in_kernel"), a copy of
      the block at ``reduce_efficiency`` of HBM; plus a kernel's start.

    Nothing here is fitted to Flux's published times."""
    if reduce not in PULLED_REDUCES:
        raise ValueError(f"reduce: one of {PULLED_REDUCES}, got {reduce!r}")
    if reduce == "in_kernel" and sum_efficiency is not None:
        raise ValueError("sum_efficiency: the in-kernel design has no stacked sum (None)")
    p.check_group(nranks)
    if m % nranks:
        raise ValueError(f"m={m}: the reduce-scatter splits the rows into {nranks} blocks")
    lo, hi = STACKED_SUM_HBM
    eff = (lo + hi) / 2 if sum_efficiency is None else sum_efficiency
    if not 0 < eff <= 1:
        raise ValueError(f"sum_efficiency: expected a fraction of HBM in (0, 1], got {eff}")
    out = batch * m * n * dtype_bytes(output_dtype(dtype))
    block = out / nranks
    alone = fused.kernel_busy(p, dtype, batch, m, n, k) / p.fused_gemm_rate
    if reduce == "stacked":  # the reduce buffer: the whole output; after: the stacked sum
        beside, after = 2 * out, (nranks + 1) * block / (eff * p.hbm_gbps * 1e9)
    else:  # the own block, written back once; after: a copy of it
        beside, after = out + block, 2 * block / (p.reduce_efficiency * p.hbm_gbps * 1e9)
    gemm = alone / model.compute_rate(p, 0, beside / max(alone, 1e-12))
    link = (p.p2p_load_gbps or p.link_gbps) * 1e9
    pulls = (nranks - 1) * block / link
    tm, tn = fused.kernel_tile(p, dtype)
    last = min(p.sms * tm * tn * dtype_bytes(output_dtype(dtype)), block) / link
    total_sum = after + p.ar_start_us * US
    t = p.gemm_overhead_us * US + max(gemm, pulls) + last + total_sum
    return Pulled(t, gemm, pulls, last, total_sum)
