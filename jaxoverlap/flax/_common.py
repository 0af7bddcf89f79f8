"""The computation shared by the linen and nnx layers: one place for both APIs.

A layer multiplies ``x [..., S, K]`` by a kernel ``[K, N]`` (the general
layers flatten their dims to this form first) in one of three modes, chosen
at trace time:

* **local** - ``axis_name`` is bound (the layer is called inside the user's
  ``jax.shard_map``): x, kernel and bias are local shards and the ops run on
  them directly.
* **global** - a mesh is known (``mesh=``, ``jax.set_mesh``, or the inputs'
  ``NamedSharding``): x, kernel and bias are global arrays; the ops lay them
  out (``jaxoverlap._global``: a primitive taking part in sharding propagation
  under Auto mesh axes, a ``shard_map`` under Explicit ones), and the layer
  lays out what it computes itself with the layout API (``jaxoverlap._layout``).
* **no mesh** at all: there is one device and nothing to split; the layer
  computes what ``nn.Dense`` computes. This is what lets
  ``jax.eval_shape(model.init, ...)`` run before any mesh exists.

Per kind and ``sequence_parallel`` the multiply is:

===========  ==========================  ==========================================
kind         sequence_parallel=True      sequence_parallel=False (Megatron f / g)
===========  ==========================  ==========================================
column       ``jaxoverlap.ag_matmul``    ``ops.copy_matmul``
row          ``jaxoverlap.matmul_rs``    ``jaxoverlap.matmul_ar``
===========  ==========================  ==========================================

Flax's FP8 recipe (``dot_general_cls=nn.Fp8DotGeneralOp`` or
``nn.Fp8DirectDotGeneralOp``, nnx's ``jaxoverlap.flax.nnx.Fp8DotGeneral``, or
current scaling with ``dot_general=jaxoverlap.fp8.dot_general``), and MXFP8
(``dot_general=jaxoverlap.fp8.MXFP8BlockScaling()``) run fused
(:class:`Fp8Recipe`, ``jaxoverlap.fp8``): the collectives move fp8, the
scale bookkeeping is Flax's. Any other ``dot_general`` (quantisation libraries)
cannot run inside the fused ops: the layer then runs the unfused computation
with it (``dot_general`` next to XLA's collectives) and says so once in the log.

Rows that do not split: on global arrays, a sequence-parallel call whose
sequence does not divide over ``axis_name`` (a decode step's single token, any
odd length) runs the ``sequence_parallel=False`` form for that call, said once
at debug level; its GEMM + all-reduce runs one-shot when the rows per device do
not split into N blocks (the plan decides, ``_plan``). A layer never refuses a
shape the Flax layer accepts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxoverlap import _layout, _megatron, fp8, ops
from jaxoverlap._compat import bound_axis_size, context_mesh, varying_axes
from jaxoverlap._config import check_impl, logger
from jaxoverlap._fp8_dtypes import any_fp8

COLUMN = "column"
ROW = "row"


# ---------------------------------------------------------------- argument checks


def check_features(layer: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TypeError(f"{layer}: {name}={value!r} must be a positive int.")
    return value


def check_feature_dims(layer: str, name: str, dims: tuple[Any, ...]) -> None:
    """A general layer's feature dims: at least one (the tensor axis splits the first output
    dim, or the first contracted one)."""
    if len(dims) == 0:
        raise ValueError(f"{layer}: {name}=() has no dim; give at least one, e.g. {name}=(64,) "
                         "(the tensor-parallel split needs a dim to split).")


def check_common(layer: str, *, axis_name: Any, sequence_parallel: Any, impl: Any,
                 use_bias: Any, kernel_init: Any, bias_init: Any, mesh: Any) -> None:
    """Checks the arguments every layer takes; raises naming the argument."""
    if not isinstance(axis_name, str) or not axis_name:
        raise TypeError(f"{layer}: axis_name={axis_name!r} must be the name (a str) of the "
                        "tensor-parallel mesh axis.")
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"{layer}: sequence_parallel={sequence_parallel!r} must be True or False.")
    if not isinstance(use_bias, bool):
        raise TypeError(f"{layer}: use_bias={use_bias!r} must be True or False.")
    check_impl(impl, where=f"{layer}: impl")
    for name, fn in (("kernel_init", kernel_init), ("bias_init", bias_init)):
        if not callable(fn):
            raise TypeError(f"{layer}: {name}={fn!r} must be an initializer "
                            "(key, shape, dtype) -> array.")
    if mesh is not None and not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise TypeError(f"{layer}: mesh={mesh!r} must be a jax.sharding.Mesh or None.")
    if mesh is not None and axis_name not in mesh.axis_names:
        raise ValueError(f"{layer}: axis_name={axis_name!r} is not an axis of mesh (its axes: "
                         f"{tuple(mesh.axis_names)}).")


def check_input(layer: str, x: Any, min_ndim: int = 2) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{layer}: inputs must be an array, got {type(x).__name__}.")
    if x.ndim < min_ndim:
        raise ValueError(f"{layer}: inputs must have rank >= {min_ndim} ([..., S, features], the "
                         f"sequence dim before the features); got shape {tuple(x.shape)}.")


def divide(layer: str, name: str, size: int, n: int, axis_name: str) -> int:
    """``size // n``, or a ValueError naming ``name`` when ``n`` does not divide it."""
    if size % n:
        raise ValueError(f"{layer}: {name}={size} is not divisible by the size {n} of mesh axis "
                         f"{axis_name!r}; use a multiple of {n}.")
    return size // n


def known_tp_size(axis_name: str, mesh: Any) -> int | None:
    """The size of ``axis_name`` in ``mesh`` or the ``jax.set_mesh`` mesh, if it is there."""
    target = mesh if mesh is not None else context_mesh()
    if target is None or axis_name not in target.axis_names:
        return None
    return target.shape[axis_name]


def tp_size_if_bound(axis_name: str) -> int | None:
    """The size of ``axis_name`` inside shard_map, else None (global mode)."""
    return bound_axis_size(axis_name)


# ---------------------------------------------------------------- partitioning metadata


def own_names(ndim: int, tp_dim: int | None, axis_name: str) -> tuple[Any, ...] | None:
    """The layout a layer annotates a parameter with when the user gave none.

    ``tp_dim`` is the dim split over ``axis_name`` (None: replicated, no metadata).
    """
    if tp_dim is None:
        return None
    return tuple(axis_name if d == tp_dim else None for d in range(ndim))


def entry_axes(entry: Any) -> tuple[Any, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def check_layout(layer: str, param: str, kind: str, axis_name: str, tp_dim: int | None,
                 mesh_axes: tuple[Any, ...], names: tuple[Any, ...] | None = None,
                 how: str = "") -> None:
    """Raises unless ``mesh_axes`` (a parameter's resolved layout) splits ``tp_dim`` over
    ``axis_name`` and no other dim over it.

    ``names`` are the user's logical names when ``mesh_axes`` came from rules:
    the error then names the rule to add. Other mesh axes on other dims (FSDP)
    are fine; the ops gather them.
    """
    for d, entry in enumerate(mesh_axes):
        axes = entry_axes(entry)
        if d == tp_dim:
            if axes == (axis_name,):
                continue
            want = f"dim {d} split over {axis_name!r}"
        elif axis_name in axes:
            want = f"only dim {tp_dim} split over {axis_name!r}" if tp_dim is not None else \
                f"no dim split over {axis_name!r}"
        else:
            continue
        where = f"{layer}: {param} has the partitioning {P(*mesh_axes)}{how}, but a " \
                f"{kind}-parallel layer over {axis_name!r} needs {want}."
        if names is not None and d == tp_dim:
            name = names[d] if d < len(names) else None
            if name is None:
                fix = (f" Give dim {d} a logical name and a rule mapping it to {axis_name!r} "
                       f"(e.g. nn.with_logical_partitioning(init, names) with names[{d}]='mlp' "
                       f"and the rule ('mlp', {axis_name!r})).")
            else:
                fix = (f" Add the rule ({name!r}, {axis_name!r}) to your logical axis rules "
                       "(the rules of nn.logical_axis_rules / nnx.logical_axis_rules and of "
                       "nn.logical_to_mesh_sharding).")
        elif names is not None:
            fix = (f" The rules map logical axis {names[d]!r} to {entry!r}; map it to another "
                   f"mesh axis (or none).")
        else:
            fix = " Annotate it accordingly, or leave the initializer unannotated and the layer " \
                  "annotates it."
        raise ValueError(where + fix)
    if tp_dim is not None and tp_dim >= len(mesh_axes):
        raise ValueError(
            f"{layer}: {param} has the partitioning {P(*mesh_axes)}{how}, but a {kind}-parallel "
            f"layer over {axis_name!r} needs dim {tp_dim} split over {axis_name!r}.")


# ---------------------------------------------------------------- how a layer multiplies


_said: set[tuple[str, str]] = set()


def say_once(layer: str, message: str, level: int = logging.WARNING) -> None:
    """A message in the ``jaxoverlap`` log (a warning unless ``level``), once per layer class
    and message."""
    if (layer, message) not in _said:
        _said.add((layer, message))
        logger.log(level, "%s: %s", layer, message)


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """Flax's FP8 recipe, run by the fused ops (``jaxoverlap.fp8``): delayed scaling with
    the layer's state (a ``jaxoverlap.fp8.DelayedScaling`` of its variables' values, whose
    gradient is the new state), current scaling (``scaling`` None), or MXFP8 (a
    ``jaxoverlap.fp8.MXFP8BlockScaling``)."""

    scaling: Any = None


@dataclasses.dataclass(frozen=True)
class Matmul:
    """How one layer multiplies: its kind, parallelism and the user's dot_general, if any.

    ``dot_general`` None means the fused ops; otherwise the unfused path calls
    it as Flax's layer would, with ``dot_general_kwargs`` (nnx passes
    ``out_sharding`` and ``preferred_element_type`` there). ``fp8``: Flax's FP8
    recipe, run fused on a mesh (``dot_general`` is then Flax's own FP8 op, what
    the layer computes without a mesh).
    """

    layer: str
    kind: str
    axis_name: str
    sequence_parallel: bool
    impl: str
    precision: Any
    mesh: Any
    dot_general: Callable | None = None
    dot_general_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    fp8: Fp8Recipe | None = None


def _dims(x) -> tuple:
    return (((x.ndim - 1,), (0,)), ((), ()))


def _add_bias(y, bias):
    if bias is None:
        return y
    return y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


def fused(m: Matmul, x, kernel, mesh: Any):
    """The fused multiply: the ops on local shards (mesh None) or on global arrays, under
    Flax's FP8 recipe (``jaxoverlap.fp8``) when the layer has one."""
    seq = x.ndim - 2
    if m.fp8 is None and any_fp8(x, kernel):
        raise TypeError(
            f"{m.layer}: the inputs or kernel are {jnp.dtype(x.dtype).name} / "
            f"{jnp.dtype(kernel.dtype).name} (dtype= or param_dtype= an fp8 type): an fp8 "
            "multiply needs scales, which a plain dtype does not carry. Train in FP8 with "
            "Flax's recipe (linen: dot_general_cls=nn.Fp8DotGeneralOp; nnx: "
            "dot_general=jaxoverlap.flax.nnx.Fp8DotGeneral()), "
            "which these layers run fused (jaxoverlap.fp8).")
    if m.fp8 is None:
        lib, kw = ops, dict(precision=m.precision, mesh=mesh)
    else:
        lib, kw = fp8, dict(scaling=m.fp8.scaling, mesh=mesh)
    if m.kind == COLUMN:
        if m.sequence_parallel:
            return lib.ag_matmul(x, kernel, m.axis_name, axis=seq, impl=m.impl, **kw)
        return lib.copy_matmul(x, kernel, m.axis_name, **kw)
    if m.sequence_parallel:
        return lib.matmul_rs(x, kernel, m.axis_name, axis=seq, impl=m.impl, **kw)
    # Megatron's g: rows that do not split into N blocks (a decode step's batch) run one-shot
    return lib.matmul_ar(x, kernel, m.axis_name, impl=m.impl, **kw)


def _multiply(m: Matmul, x, kernel, mesh: Any):
    """The layer's multiply on local shards (mesh None) or global arrays."""
    if m.fp8 is not None or m.dot_general is None:
        return fused(m, x, kernel, mesh)
    if mesh is None:
        return unfused_local(m, x, kernel)
    return unfused_global(m, x, kernel, mesh)


def _kind_of(m: Matmul) -> str:
    if m.kind == COLUMN:
        return _layout.AG if m.sequence_parallel else _layout.F
    return _layout.RS if m.sequence_parallel else _layout.AR


def _user_dot(m: Matmul, x, kernel):
    return m.dot_general(x, kernel, _dims(x), precision=m.precision, **m.dot_general_kwargs)


def unfused_local(m: Matmul, x, kernel):
    """The user's dot_general on local shards, next to XLA's collectives."""
    seq = x.ndim - 2
    if m.kind == COLUMN:
        if m.sequence_parallel:
            x = lax.all_gather(x, m.axis_name, axis=seq, tiled=True)
        else:
            x = _megatron.copy_to_tp(x, m.axis_name, m.axis_name in varying_axes(kernel))
        return _user_dot(m, x, kernel)
    y = _user_dot(m, x, kernel)
    if m.sequence_parallel:
        return lax.psum_scatter(y, m.axis_name, scatter_dimension=seq, tiled=True)
    return lax.psum(y, m.axis_name)


def unfused_global(m: Matmul, x, kernel, mesh):
    """The user's dot_general on global arrays; XLA partitions it onto the layer's layout."""
    call = _layout.Call(kind=_kind_of(m), axis_name=m.axis_name, ndim=x.ndim,
                        axis=x.ndim - 2 if m.sequence_parallel else None)
    _layout.check_shapes(call, x, kernel, mesh)
    if _layout.is_explicit(mesh) or not _layout.uses_propagation(mesh):
        x_spec, k_spec, (y_spec, *_) = _layout.layouts(call, _layout.spec_entries(x, mesh))
        x, kernel = _layout.place(x, mesh, x_spec), _layout.place(kernel, mesh, k_spec)
        if _layout.is_explicit(mesh):
            return jax.sharding.auto_axes(lambda a, b: _user_dot(m, a, b),
                                          out_sharding=NamedSharding(mesh, y_spec))(x, kernel)
        return _user_dot(m, x, kernel)
    x_open, (y_open, *_) = _layout.open_layouts(call)
    x = lax.with_sharding_constraint(x, NamedSharding(mesh, x_open))
    kernel = lax.with_sharding_constraint(kernel, NamedSharding(mesh, _layout.layouts(
        call, (None,) * x.ndim)[1]))
    return lax.with_sharding_constraint(_user_dot(m, x, kernel), NamedSharding(mesh, y_open))


def forward(m: Matmul, x, kernel, bias, *, out_sharding: Any = None):
    """``x @ kernel + bias`` for ``x [..., S, K]`` and ``kernel [K, N]``, in the layer's mode."""
    if tp_size_if_bound(m.axis_name) is not None:          # local shards
        return constrain_output(m, _add_bias(_multiply(m, x, kernel, None), bias), out_sharding,
                                x)
    mesh = _layout.find_mesh(m.layer, m.mesh, x, kernel)
    if mesh is None:                                         # one device: nn.Dense's math
        dot = m.dot_general or lax.dot_general
        y = dot(x, kernel, _dims(x), precision=m.precision, **m.dot_general_kwargs)
        return constrain_output(m, _add_bias(y, bias), out_sharding, x)
    if m.axis_name not in mesh.axis_names:
        raise ValueError(f"{m.layer}: axis_name={m.axis_name!r} is not an axis of the mesh "
                         f"(its axes: {tuple(mesh.axis_names)}).")
    n = mesh.shape[m.axis_name]
    if m.sequence_parallel and x.shape[-2] % n:
        m = without_sequence_parallel(m, f"the sequence length {x.shape[-2]} (inputs.shape["
                                         f"{x.ndim - 2}]) does not split over the {n} ranks of "
                                         f"{m.axis_name!r}")
    if m.kind == COLUMN:
        divide(m.layer, "features", kernel.shape[1], n, m.axis_name)
    else:
        divide(m.layer, "inputs.shape[-1] (the input features)", x.shape[-1], n, m.axis_name)
    return constrain_output(m, _add_bias(_multiply(m, x, kernel, mesh), bias), out_sharding, x)


def without_sequence_parallel(m: Matmul, why: str) -> Matmul:
    """``m`` for one call without sequence parallelism (replicated activations, Megatron's
    f / g), said once at debug level."""
    if not m.sequence_parallel:
        return m
    say_once(m.layer, f"{why}: this call runs without sequence parallelism (replicated "
             "activations, GEMM + all-reduce).", logging.DEBUG)
    return dataclasses.replace(m, sequence_parallel=False)


def constrain_output(m: Matmul, y, out_sharding: Any, x):
    """Lays ``y`` out as ``out_sharding`` (nnx's call argument; a PartitionSpec or Sharding)."""
    if out_sharding is None:
        return y
    if tp_size_if_bound(m.axis_name) is not None:
        raise ValueError(f"{m.layer}: out_sharding={out_sharding!r} applies to global arrays; "
                         "inside shard_map the output is this device's shard.")
    if isinstance(out_sharding, jax.sharding.Sharding):
        sharding = out_sharding
    else:
        mesh = _layout.find_mesh(m.layer, m.mesh, x)
        if mesh is None:
            raise ValueError(f"{m.layer}: out_sharding={out_sharding!r} needs a mesh: pass "
                             "mesh=, use jax.set_mesh(mesh), or give a NamedSharding.")
        spec = out_sharding if isinstance(out_sharding, P) else P(*out_sharding)
        sharding = NamedSharding(mesh, spec)
    if _layout.is_explicit(sharding.mesh):
        return jax.reshard(y, sharding)
    return lax.with_sharding_constraint(y, sharding)


def general_forward(m: Matmul, x, kernel, bias, n_contract: int, *, out_sharding: Any = None):
    """``DenseGeneral`` on the trailing ``n_contract`` dims of x: flattened to :func:`forward`.

    The kernel is ``[*contracted, *features]``; a column layer splits
    ``features[0]``, a row layer the first contracted dim, so flattening keeps
    the split dim major and the reshapes move no data.
    """
    # Sizes written out, not -1: an empty batch (a zero-size dim) leaves -1 undetermined.
    features = kernel.shape[n_contract:]
    x2 = x.reshape(x.shape[: x.ndim - n_contract] + (math.prod(x.shape[x.ndim - n_contract:]),))
    k2 = kernel.reshape((x2.shape[-1], math.prod(features)))
    b2 = None if bias is None else bias.reshape(math.prod(bias.shape))
    y = forward(m, x2, k2, b2)
    if m.kind == COLUMN:     # the first feature dim may be a local shard
        rest = math.prod(features[1:])
        first = y.shape[-1] // rest if rest else features[0]
        y = y.reshape(y.shape[:-1] + (first,) + tuple(features[1:]))
    else:
        y = y.reshape(y.shape[:-1] + tuple(features))
    return constrain_output(m, y, out_sharding, x)


def _interleave(blocks: list, sizes: list[int]):
    """``blocks [..., s_i]`` side by side on their last dim (``[..., sum(s_i)]`` once flattened).

    Blocks of one size (an attention's query, key and value) are stacked on a new
    axis, the same values in the same order: XLA:CPU fuses that concatenate with
    its operands' reshapes into a loop kernel, and alike fusions share one compiled
    kernel, where a concatenate on the last dim stays a kernel of its own, compiled
    at every call (docs/performance.md §9). Blocks of different sizes (fewer key and
    value heads than query heads) are concatenated.
    """
    if len(set(sizes)) == 1:
        return jnp.stack(blocks, axis=-2)
    return jnp.concatenate(blocks, axis=-1)


def fused_columns(m: Matmul, x, kernels: list, biases: list):
    """Several column-parallel projections of one input ``x [..., S, K]`` in one multiply.

    Each kernel is ``[K, H_i, *rest_i]``, split over ``axis_name`` on ``H_i``
    (an attention's query, key and value). They are interleaved so that every
    device's block of the joint kernel holds its own block of each: one
    all-gather of x feeds all of them (and, backward, one reduce-scatter sums
    their input gradients). Returns the outputs ``[..., S, H_i, *rest_i]``.
    """
    n = 1                                      # blocks to interleave (1 on local shards)
    if tp_size_if_bound(m.axis_name) is None:
        mesh = _layout.find_mesh(m.layer, m.mesh, x, *kernels)
        if mesh is not None and m.axis_name in mesh.axis_names:
            n = mesh.shape[m.axis_name]
            for k in kernels:
                divide(m.layer, "the number of heads", k.shape[1], n, m.axis_name)
    k_dim = kernels[0].shape[0]
    sizes = [int(np.prod(k.shape[1:])) // n for k in kernels]
    # [K, H, *rest] -> [K, n, H/n, *rest] -> [K, n, H/n * prod(rest)]: the split dim stays major.
    blocks = [k.reshape((k_dim, n, k.shape[1] // n) + k.shape[2:]).reshape((k_dim, n, s))
              for k, s in zip(kernels, sizes, strict=True)]
    kernel = _interleave(blocks, sizes).reshape((k_dim, n * sum(sizes)))
    bias = None
    if biases[0] is not None:
        bias = _interleave([b.reshape((n, b.shape[0] // n) + b.shape[1:]).reshape((n, s))
                            for b, s in zip(biases, sizes, strict=True)], sizes)
        bias = bias.reshape(-1)
    y = forward(m, x, kernel, bias)
    lead = y.shape[:-1]
    y = y.reshape(lead + (n, sum(sizes)))
    outs, start = [], 0
    for k, s in zip(kernels, sizes, strict=True):
        part = y[..., start:start + s]
        start += s
        part = part.reshape(lead + (n, k.shape[1] // n) + k.shape[2:])
        outs.append(part.reshape(lead + k.shape[1:]))
    return outs


def choose_dot_general(layer: str, dot_general: Callable | None, reason: str | None = None):
    """The user's dot_general when it is not ``lax.dot_general`` (then said once), else None."""
    if reason is None and (dot_general is None or dot_general is lax.dot_general):
        return None
    say_once(layer, (reason or "a custom dot_general was given")
             + ": the layer runs the unfused computation with it (dot_general next to XLA's "
             "collectives), without overlapping communication.")
    return dot_general or lax.dot_general


# ---------------------------------------------------------------- parameter placement


def place_value(value, names: tuple[Any, ...], axis_name: str, mesh: Any):
    """``value`` laid out as ``names`` on the mesh, when one is known.

    Under Explicit mesh axes Flax's partitioning metadata only asserts the
    layout, so the value is resharded here; under Auto axes a sharding
    constraint suffices. Inside shard_map (axis bound) values are local shards
    and stay as they are.
    """
    if bound_axis_size(axis_name) is not None:
        return value
    target = mesh if mesh is not None else context_mesh()
    if target is None or axis_name not in target.axis_names:
        return value
    sharding = NamedSharding(target, P(*names))
    if _layout.is_explicit(target):
        return jax.reshard(value, sharding)
    return lax.with_sharding_constraint(value, sharding)


# ---------------------------------------------------------------- the attention's decode cache


DECODE_STEP_SAYS = ("a decode step's one token does not split over the ranks: decode steps "
                    "run without sequence parallelism (replicated activations, GEMM + "
                    "all-reduce).")


def check_decode_step(layer: str, inputs_q) -> None:
    """A decode step (the cache exists) takes one token; raised before anything is computed."""
    check_input(layer, inputs_q)
    if inputs_q.shape[-2] != 1:
        raise ValueError(
            f"{layer}: with decode=True and the cache initialised, each call is one decode "
            f"step and takes one token: inputs_q must be [batch..., 1, features], got shape "
            f"{tuple(inputs_q.shape)}. Feed the sequence one position per call, or run whole "
            "sequences with decode=False.")


def cache_heads_spec(ndim: int, axis_name: str, batch: Any = P.UNCONSTRAINED) -> P:
    """A cache ``[batch..., length, heads, head_dim]`` split on its heads over ``axis_name``."""
    return P(*([batch] * (ndim - 3)), None, axis_name, None)


def new_cache(key, axis_name: str, mesh: Any):
    """Zeros of ``key``'s shape and dtype laid out as ``key`` (Flax's ``cached_key`` and
    ``cached_value`` at init): each device holds its heads; other axes on the batch stay."""
    zeros = jnp.zeros(key.shape, key.dtype)
    if tp_size_if_bound(axis_name) is not None:            # local shards
        return zeros
    mesh = _layout.find_mesh("cache", mesh, key)
    if mesh is None or axis_name not in mesh.axis_names:
        return zeros
    if _layout.is_explicit(mesh):
        return jax.reshard(zeros, key.aval.sharding)
    return lax.with_sharding_constraint(zeros, NamedSharding(mesh, cache_heads_spec(
        key.ndim, axis_name)))


def decode_step(layer: str, cached_key, cached_value, cache_index, query, key, value, mask,
                combine_masks: Callable, *, axis_name: str, mesh: Any, heads_of: str,
                where: str):
    """One step of Flax's autoregressive cache: writes this token's key and value at
    ``cache_index`` and masks the positions not yet written.

    Returns ``(query, key, value, cache_index + 1, mask)``, key and value the whole cache, as
    attention's keys and values. ``heads_of`` names the projection whose heads the cache
    holds (``query`` in linen, ``key`` in nnx, as their checks do); ``where`` says how to
    make a new cache. Under Explicit mesh axes this step's query, key and value are laid out
    as the cache (a token's worth of data), so the cache keeps its layout.
    """
    if cached_value.shape != cached_key.shape:
        raise ValueError(f"{layer}: the cache's cached_value has shape {cached_value.shape} "
                         f"but cached_key {cached_key.shape}; they must match. {where}")
    if jnp.ndim(cache_index) != 0 or not jnp.issubdtype(jnp.result_type(cache_index),
                                                         jnp.integer):
        raise ValueError(f"{layer}: the cache's cache_index must be an integer scalar, got "
                         f"shape {jnp.shape(cache_index)} dtype {jnp.result_type(cache_index)}. "
                         f"{where}")
    if cached_key.ndim != key.ndim:
        raise ValueError(f"{layer}: the cache's cached_key has shape {cached_key.shape} but "
                         f"this step's {heads_of} is {key.shape} ([batch..., 1, heads, "
                         f"head_dim]). {where}")
    *batch, max_length, heads, depth = cached_key.shape
    step = (query if heads_of == "query" else key).shape
    if tuple(batch) != step[:-3]:
        what = f"batch {tuple(batch)}, but this step's batch is {step[:-3]}"
    elif heads != step[-2]:
        what = (f"{heads} heads, but this step computes {step[-2]} (global arrays hold every "
                "head; inside shard_map a device holds its share)")
    elif depth != step[-1]:
        what = f"head_dim {depth}, but this step's {heads_of} has head_dim {step[-1]}"
    else:
        what = ""
    if what:
        raise ValueError(f"{layer}: autoregressive cache shape error: cached_key "
                         f"{cached_key.shape} was made for {what}. {where}")
    if not isinstance(cache_index, jax.core.Tracer) and int(cache_index) >= max_length:
        # Under jit the index is not known; there, as in Flax, the write is clamped to the end.
        raise ValueError(f"{layer}: the cache holds {max_length} positions and all are "
                         f"written (cache_index={int(cache_index)}). {where}")
    if tp_size_if_bound(axis_name) is None and (mesh := _layout.find_mesh(
            layer, mesh, cached_key)) is not None and _layout.is_explicit(mesh):
        spec = P(*_layout.spec_entries(cached_key, mesh))
        query, key, value = (_layout.place(a, mesh, spec) for a in (query, key, value))
    zero = jnp.zeros((), jnp.result_type(cache_index))
    indices = (zero,) * len(batch) + (cache_index, zero, zero)
    key = lax.dynamic_update_slice(cached_key, key, indices)
    value = lax.dynamic_update_slice(cached_value, value, indices)
    written = jnp.broadcast_to(jnp.arange(max_length) <= cache_index,
                               (*batch, 1, 1, max_length))
    return query, key, value, cache_index + 1, combine_masks(mask, written)
