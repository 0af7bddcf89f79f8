"""Which native calls are built replayable: the program builder says, nobody else.

A program built replayable (``Problem::replayable``, docs/gpu-internals.md §8) enqueues the same
work at every call, so XLA may capture its call into a command buffer and replay it (docs/gpu.md
§6). Which problems the builder builds so is its own acceptance (``BuildProgram``,
``cpp/core/build.cc``), asked through ``_host.replay_refusal``: never a list kept here, so a
program the builder learns to build replayable is routed to the command-buffer compatible
target (``_native.primitive``) and priced captured (``sim.plan``) with no change here. Both ask
:func:`builds_replayable`.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=4096)
def refusal(op: str, transport: str, nranks: int, batch: int, rows: int, k: int, n: int,
            dtype: str, w_dtype: str = "", out_dtype: str = "", chunks: int = 1,
            bidirectional: bool = False, return_gathered: bool = False,
            algorithm: str = "two_shot", fused: bool = False, block_scaled: bool = False) -> str:
    """Why the builder does not build the problem (its canonical form, docs/native.md §1; ``n``
    the output columns, dtypes by the kinds' names) replayable; ``""`` when it does."""
    from jaxoverlap._executors.runtime import load_host

    problem = dict(op=op, transport=transport, nranks=nranks, batch=batch, rows=rows, k=k, n=n,
                   dtype=dtype, w_dtype=w_dtype, out_dtype=out_dtype, chunks=chunks,
                   bidirectional=bidirectional, return_gathered=return_gathered,
                   algorithm=algorithm, fused=fused, block_scaled=block_scaled)
    return str(load_host().replay_refusal(problem))


def builds_replayable(op: str, transport: str, nranks: int, batch: int, rows: int, k: int,
                      n: int, dtype: str, **fields) -> bool:
    """Whether the call's program is built replayable: the builder builds it so and it has
    peers (a call of one rank takes the ordinary path, ``CudaSite::Enqueue``); ``fields``: the
    other keys of :func:`refusal`."""
    return nranks > 1 and not refusal(op, transport, nranks, batch, rows, k, n, dtype, **fields)
