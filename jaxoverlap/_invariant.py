"""Marking a value the same on every rank of a mesh axis, for ``check_vma=True``.

The ring all-reduce (``_ring.matmul_ar``) leaves every rank with the same blocks:
each block is summed once, by its owner, and copied round the ring, so every rank
holds it bitwise, as every rank holds ``psum``'s result. JAX's type system cannot
prove that of values built from ``ppermute``s, so this identity types the result
invariant over the axis, as ``psum`` types its own. It moves no data. It has no
autodiff rules: it is used only inside the primal of a ``custom_vjp``, whose
derivative comes from that rule.
"""

from __future__ import annotations

from jax._src import core
from jax._src.interpreters import mlir
from jax.interpreters import batching

from jaxoverlap._compat import varying_axes, with_varying
from jaxoverlap._transforms import differentiable_once

invariant_p = core.Primitive("jaxoverlap_invariant")


def mark_invariant(x, axis_name: str):
    """``x``, typed invariant over ``axis_name`` (unchanged if it does not vary over it)."""
    if axis_name not in varying_axes(x):
        return x
    return invariant_p.bind(x, axis_name=axis_name)


invariant_p.def_abstract_eval(
    lambda x, *, axis_name: with_varying(x, varying_axes(x) - {axis_name}))
mlir.register_lowering(invariant_p, lambda ctx, x, *, axis_name: [x])
batching.primitive_batchers[invariant_p] = lambda args, dims, *, axis_name: (
    invariant_p.bind(args[0], axis_name=axis_name), dims[0])
differentiable_once(invariant_p, lambda axis_name: ("matmul_ar with impl='ring'", "impl='xla'"))
