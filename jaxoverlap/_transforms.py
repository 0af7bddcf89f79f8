"""The ops' primitives under JAX's transformations.

* vmap: one call per batch element, in order. A call is a collective over its mesh axis, so the
  calls of a batch cannot be fused into one without changing what each rank sends (a batched w
  is a different GEMM per element); the batch runs as a ``lax.map`` of the primitive.
* A second derivative: the ops are differentiable once in reverse mode (their ``custom_vjp``);
  the primitives their derivatives call have no derivative of their own, and say so by name
  instead of JAX's "Differentiation rule ... not implemented".
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad, batching


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


def differentiable_once(primitive, what: Callable[..., tuple[str, str]]) -> None:
    """Registers ``primitive``'s derivative as a clear error: ``what(**params)`` gives the call
    (e.g. "matmul_ar with impl='native'") and the impl that takes a second derivative."""

    def rule(primals, tangents, **params):
        del primals, tangents
        call, instead = what(**params)
        raise NotImplementedError(
            f"{call} is differentiable once in reverse mode (jax.grad, jax.vjp); a derivative "
            f"of that derivative (jax.hessian, a grad of a grad) is not supported: use "
            f"{instead} for that computation.")

    ad.primitive_jvps[primitive] = rule
