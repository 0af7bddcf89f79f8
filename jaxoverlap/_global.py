"""Global arrays: a call made outside ``shard_map`` runs its per-device function on every device.

The caller hands down a :class:`~jaxoverlap._layout.Call`: the layout of its arrays
(``_layout``) and the function each device runs on its shards (``call.local``, the op on local
shards that the public ops run inside ``shard_map`` too). This module never calls back up into
the public ops. Here, once per call, the global shapes are checked against the layouts and the
per-device function's plan is made for the shards the devices get (``call.local.planned``: on
a concrete mesh, with the native call's transport decided), at trace time, so that every
misuse is reported before XLA partitions the program. Two mechanisms, picked by the mesh's
axis types:

* **Auto axes** (no Explicit or Manual axis; Shardy, JAX's default partitioner): the op is a
  ``custom_partitioning`` primitive (``_partition``) that takes part in sharding propagation,
  so a data or FSDP axis that only XLA knows about passes through.
* **Otherwise** (Explicit axes, whose types carry every layout): one ``shard_map`` whose specs
  come from x's type; the inputs are resharded to them first (``shard_map`` checks rather than
  reshards there). ``ring`` calls alike in all that (the same layer's calls in every block of a
  model) share one trace and one lowering (a ``jit`` of the call, cached by JAX): unrolled
  rings cost the most to trace. Native calls must not: each lowers on its own, where its site
  key is taken (``_native/site_key.py``).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from jaxoverlap import _partition
from jaxoverlap._fp8_dtypes import block_scaled
from jaxoverlap._layout import (
    Call,
    check_shapes,
    layouts,
    local_shapes,
    place,
    spec_entries,
    uses_propagation,
)


def run(call: Call, mesh, x, w, *, want_gathered: bool = False, scales: tuple = ()):
    """``call`` on global ``x``, ``w`` over ``mesh``; ``scales``: the fp8 operands'
    per-tensor ``(x_scale, w_scale)`` (float32 scalars, the same on every device), their block
    scales (e8m0 arrays laid out as x and w, K/32 for K: split as x and w are), or ``()``.

    Returns y, or (y, gathered x) for ``ag_matmul`` with ``want_gathered``.
    """
    assert call.local is not None, call
    check_shapes(call, x, w, mesh, block_scaled(scales))
    # Under Auto axes propagation places the other mesh axes later, when XLA partitions the
    # program; a device whose shards then differ from these makes its own plan for them.
    entries = None if uses_propagation(mesh) else spec_entries(x, mesh)
    local = call.local.planned(mesh, *local_shapes(call, x, w, mesh, entries))
    call = dataclasses.replace(call, local=local)
    if uses_propagation(mesh):
        return _partition.call(call, mesh, x, w, want_gathered=want_gathered, scales=scales)
    if local.plan is not None and local.plan.impl == "ring":
        return _shared(call, mesh, want_gathered, x, w, tuple(scales))
    return _shard_mapped(call, mesh, want_gathered, x, w, tuple(scales))


def _shard_mapped(call: Call, mesh, want_gathered: bool, x, w, scales: tuple):
    x_spec, w_spec, out_specs = layouts(call, spec_entries(x, mesh))
    out = out_specs if want_gathered else out_specs[0]
    # The gathered x is the same on every rank of `axis_name`, but the type
    # system cannot prove it for a gather built from ppermutes or a custom call,
    # so that output is declared replicated with the check off.
    # Block scales are split as their operands; per-tensor ones are replicated.
    scale_specs = (x_spec, w_spec) if block_scaled(scales) else tuple(P() for _ in scales)
    fn = jax.shard_map(lambda x, w, scales: call.local(x, w, want_gathered, scales), mesh=mesh,
                       in_specs=(x_spec, w_spec, scale_specs), out_specs=out,
                       check_vma=not want_gathered)
    return fn(place(x, mesh, x_spec), place(w, mesh, w_spec),
              tuple(place(s, mesh, spec) for s, spec in zip(scales, scale_specs, strict=True)))


# One trace and one lowering per distinct ring call (JAX caches a jit's by its static arguments
# and the operands' types): in a model, every block's call of one layer is that call.
_shared = jax.jit(_shard_mapped, static_argnums=(0, 1, 2))
