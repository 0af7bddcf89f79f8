"""The portable fused path: each collective decomposed into a ring of ``ppermute`` steps.

Step t multiplies the shard that has arrived while the next one travels, so
XLA's scheduler can overlap the collective-permute of step t+1 with the dot of
step t. Works on every backend; the native path runs the same schedule with
its own transports.

Ring arithmetic (N ranks, rank r):

* AG+GEMM: the local shard first; going forward (r -> r+1), step t holds shard
  (r - t) mod N. Bidirectional: the forward ring carries each shard to the
  next F = ceil((N-1)/2) ranks and the backward ring (r -> r-1) to the
  previous B = floor((N-1)/2), so each rank still receives every shard once,
  in F steps instead of N-1, both link directions busy.
* GEMM+RS: going forward, step t computes the partial of chunk
  (r + F - t) mod N, adds the accumulator received from r-1 and passes it on;
  after F hops rank r holds chunk r summed over r-F..r. Bidirectional: the
  backward ring brings the sum over r+1..r+B the other way.
* GEMM+AR: the GEMM+RS ring over the rows of x (every dim but the last), then
  the reduced blocks travel round the ring as AG+GEMM's shards do; each
  sub-chunk's gather depends only on its own reduction, so it can overlap the
  GEMMs of the later sub-chunks.

Rows are addressed on ``axis`` directly (dims before it act as a batch), so no
transposes are needed for any ``axis``. ``chunks`` splits each shard into
sub-chunks that travel and multiply independently, so the pipeline fills
sooner.

FP8 operands (``scales`` = this rank's ``(x_scale, w_scale)``): AG+GEMM's pieces travel
as fp8 bytes with their shard's scale alongside (one float32 in the same ``ppermute``),
and each piece's GEMM applies its own; the reductions apply this rank's scales to its
partials, which travel and add in the output dtype (float32 adds), never in fp8. Block scales
(MXFP8): each piece of x travels with its rows of x's e8m0 scales in the same ``ppermute``; the
reductions slice x's scales with its rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxoverlap._fp8_dtypes import block_scaled, out_dtype
from jaxoverlap._invariant import mark_invariant
from jaxoverlap._one_launch import splits_rows
from jaxoverlap._plan import OpPlan
from jaxoverlap._xla import block_product, scale_product, scaled_matmul


def _shift(x: jax.Array, plan: OpPlan, by: int) -> jax.Array:
    """Sends ``x`` to rank r+by (mod N) and receives rank r-by's."""
    n = plan.axis_size
    return lax.ppermute(x, plan.axis_name, perm=[(i, (i + by) % n) for i in range(n)])


def _ring_lengths(plan: OpPlan) -> tuple[int, int]:
    """Hops on the forward and the backward ring."""
    if not plan.bidirectional:
        return plan.axis_size - 1, 0
    return plan.axis_size // 2, (plan.axis_size - 1) // 2


def _split(x: jax.Array, plan: OpPlan) -> list[jax.Array]:
    size = x.shape[plan.axis] // plan.chunks
    return [
        lax.slice_in_dim(x, k * size, (k + 1) * size, axis=plan.axis) for k in range(plan.chunks)
    ]


def _ring_gather(local: list, plan: OpPlan, state, consume):
    """Sends the pieces ``local`` (arrays, or pytrees of arrays travelling together) round
    the ring; ``state = consume(state, pieces, shard)`` for the own shard, then for every
    shard as it arrives. Returns the final state."""
    n = plan.axis_size
    rank = lax.axis_index(plan.axis_name)
    state = consume(state, local, rank)
    forward_hops, backward_hops = _ring_lengths(plan)
    forward = backward = local
    for t in range(1, max(forward_hops, backward_hops) + 1):
        if t <= forward_hops:
            forward = [_shift(p, plan, +1) for p in forward]
            state = consume(state, forward, (rank - t) % n)
        if t <= backward_hops:
            backward = [_shift(p, plan, -1) for p in backward]
            state = consume(state, backward, (rank + t) % n)
    return state


def ag_matmul(x: jax.Array, w: jax.Array, plan: OpPlan, want_gathered: bool,
              scales: tuple = ()):
    """y = all_gather(x) @ w as a ring; also returns the gathered x if asked."""
    n, axis = plan.axis_size, plan.axis
    rows = x.shape[axis]
    piece_rows = rows // plan.chunks
    out = out_dtype(x, plan.out_dtype)
    y_shape = x.shape[:axis] + (n * rows,) + x.shape[axis + 1 : -1] + (w.shape[1],)
    y = jnp.zeros(y_shape, out)
    gathered_shape = x.shape[:axis] + (n * rows,) + x.shape[axis + 1 :]
    gathered = jnp.zeros(gathered_shape, x.dtype) if want_gathered else None
    pieces = _split(x, plan)
    blocks = block_scaled(scales)
    if blocks:  # each piece travels with its rows of x's block scales
        pieces = list(zip(pieces, _split(scales[0], plan), strict=True))
    elif scales:  # each piece travels with its shard's x_scale
        pieces = [(piece, scales[0]) for piece in pieces]

    def consume(state, pieces, shard):
        y, gathered = state
        for k, piece in enumerate(pieces):
            piece_scales = ()
            if scales:  # the piece's own x scale (block or per-tensor) with w's
                piece, x_scale = piece
                piece_scales = (x_scale, scales[1])
            product = scaled_matmul(piece, w, piece_scales, out)
            start = shard * rows + k * piece_rows
            y = lax.dynamic_update_slice_in_dim(y, product, start, axis)
            if gathered is not None:
                gathered = lax.dynamic_update_slice_in_dim(gathered, piece, start, axis)
        return y, gathered

    return _ring_gather(pieces, plan, (y, gathered), consume)


def matmul_rs(x: jax.Array, w: jax.Array, plan: OpPlan, scales: tuple = ()) -> jax.Array:
    """y = psum_scatter(x @ w) as a ring of partial sums."""
    pieces = _reduce_scatter(x, w, plan, scales)
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=plan.axis)


def matmul_ar(x: jax.Array, w: jax.Array, plan: OpPlan, scales: tuple = ()) -> jax.Array:
    """y = psum(x @ w): the reduce-scatter ring over x's rows, then a ring all-gather of the
    reduced blocks (one-shot, and the kernel algorithms, which are native only: every partial
    to every rank); typed invariant over the axis, as psum's result."""
    if not splits_rows(plan.algorithm):
        return _one_shot(x, w, plan, scales)
    n = plan.axis_size
    rows = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])          # every dim but the last is a row
    if block_scaled(scales):                   # x's block scales, row for row
        scales = (scales[0].reshape(-1, scales[0].shape[-1]), scales[1])
    block = flat.shape[0] // n
    piece_rows = block // plan.chunks
    rows_plan = dataclasses.replace(plan, axis=0)
    y = jnp.zeros((flat.shape[0], w.shape[1]), out_dtype(x, plan.out_dtype))
    for k, piece in enumerate(_reduce_scatter(flat, w, rows_plan, scales)):
        # Sub-chunk k goes round on its own, as soon as it is reduced.
        def place(y, pieces, owner, k=k):
            return lax.dynamic_update_slice_in_dim(y, pieces[0], owner * block + k * piece_rows,
                                                   0)
        y = _ring_gather([piece], rows_plan, y, place)
    return mark_invariant(y.reshape(*rows, w.shape[1]), plan.axis_name)


def _one_shot(x: jax.Array, w: jax.Array, plan: OpPlan, scales: tuple = ()) -> jax.Array:
    """The one-shot all-reduce of the native path: every rank's whole partial goes to every
    rank (N-1 permutes, one hop each); each rank sums the N partials in rank order 0..N-1,
    rounding to the output dtype after each add as the native executors do, so every rank
    gets the same bits."""
    n = plan.axis_size
    out = out_dtype(x, plan.out_dtype)
    partial = scaled_matmul(x, w, scales, out)
    # by_shift[i] came from rank (rank - i) mod N
    by_shift = [partial] + [lax.ppermute(partial, plan.axis_name,
                                         [(j, (j + i) % n) for j in range(n)])
                            for i in range(1, n)]
    rank = lax.axis_index(plan.axis_name)
    stacked = jnp.stack(by_shift)
    y = stacked[rank]  # rank 0's partial came r hops
    for j in range(1, n):
        y = (y.astype(jnp.float32) + stacked[(rank - j) % n].astype(jnp.float32)).astype(out)
    return mark_invariant(y, plan.axis_name)


def _reduce_scatter(x: jax.Array, w: jax.Array, plan: OpPlan,
                    scales: tuple = ()) -> list[jax.Array]:
    """The rank's row block of psum(x @ w) along ``plan.axis``, as ``plan.chunks`` pieces."""
    n, axis = plan.axis_size, plan.axis
    rows = x.shape[axis] // n
    piece_rows = rows // plan.chunks
    rank = lax.axis_index(plan.axis_name)
    forward_hops, backward_hops = _ring_lengths(plan)
    out = out_dtype(x, plan.out_dtype)
    blocks = block_scaled(scales)
    scale = None if blocks else scale_product(scales)

    def partial(chunk, k):
        start = chunk * rows + k * piece_rows
        block = lax.dynamic_slice_in_dim(x, start, piece_rows, axis)
        if blocks:  # its rows of x's block scales
            return block_product(block, w, lax.dynamic_slice_in_dim(scales[0], start,
                                                                     piece_rows, axis), scales[1])
        y = lax.dot_general(
            block, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        return y if scale is None else y * scale

    def add(received, chunk, k):
        # Travels in the output dtype (what the wire carries), adds in float32.
        return (received.astype(jnp.float32) + partial(chunk, k)).astype(out)

    pieces = []
    for k in range(plan.chunks):
        acc = partial((rank + forward_hops) % n, k).astype(out)
        for t in range(1, forward_hops + 1):
            acc = add(_shift(acc, plan, +1), (rank + forward_hops - t) % n, k)
        if backward_hops:
            back = partial((rank - backward_hops) % n, k).astype(out)
            for t in range(1, backward_hops):
                back = add(_shift(back, plan, -1), (rank - backward_hops + t) % n, k)
            back = _shift(back, plan, -1)
            acc = (acc.astype(jnp.float32) + back.astype(jnp.float32)).astype(out)
        pieces.append(acc)
    return pieces
