"""vmap of the ops' primitives: one call per batch element, in order.

A call is a collective over its mesh axis, so the calls of a batch cannot be fused into one
without changing what each rank sends (a batched w is a different GEMM per element); the batch
runs as a ``lax.map`` of the primitive, each element a whole call.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.interpreters import batching


def map_over_batch(primitive) -> None:
    """Registers ``primitive``'s vmap rule: each element's call in turn. An operand vmap does not
    map comes with dim None (JAX's batching-rule protocol) and is broadcast to the batch."""

    def rule(args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
        front = tuple(jnp.broadcast_to(a, (size, *a.shape)) if d is None else
                      jnp.moveaxis(a, d, 0) for a, d in zip(args, dims, strict=True))
        outs = lax.map(lambda elem: tuple(primitive.bind(*elem, **params)), front)
        return list(outs), [0] * len(outs)

    batching.primitive_batchers[primitive] = rule
