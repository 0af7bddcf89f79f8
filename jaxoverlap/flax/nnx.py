"""Tensor-parallel Flax NNX layers: drop-in replacements for ``nnx.Linear``,
``nnx.LinearGeneral`` and ``nnx.MultiHeadAttention``.

The layers take every argument of the nnx layer they replace (and the call's
``out_sharding``), then ``axis_name``, ``sequence_parallel``, ``impl`` and
``mesh``; they hold ``kernel`` and ``bias`` ``nnx.Param``s of the *global*
shapes and initial values of the nnx layer, so the state of an unparallel model
loads unchanged.

Sharding metadata: ``kernel_metadata`` / ``bias_metadata`` (or an initialiser
from ``nnx.with_partitioning``) with an ``out_sharding`` are kept as written, so
``nnx.get_partition_spec`` reports the user's names and the user's logical
rules apply; when they can be resolved (logical rules in force, or mesh axis
names) the layer checks that they split the right dim over ``axis_name`` and
raises naming the rule to add otherwise. Without them the params are plain
``nnx.Param``s, as the nnx layer's (the state's tree is the stock layer's), and
built under a mesh (``mesh=`` or ``jax.set_mesh``) their values are placed at
once in the layer's own layout: column kernel ``(None, axis_name)``
(``axis_name`` on the first output feature dim), column bias ``(axis_name,
...)``, row kernel ``(axis_name, ...)``, row bias replicated;
:func:`partition_specs` reports it as specs.

Semantics are those of ``jaxoverlap.flax.linen`` (see there): batch-first
``[..., S, features]`` inputs; ``sequence_parallel=True`` gives all-gather +
GEMM / GEMM + reduce-scatter, ``False`` Megatron's f/g pair. Global arrays under
``jit`` with a mesh, local shards inside the user's ``jax.shard_map`` (then the
state holds local shards, e.g. ``nnx.split`` the model and give the state to
``shard_map`` with ``in_specs=partition_specs(model)``), or no mesh at
all, where the layers compute what the nnx layers compute.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd as core_spmd
from flax.core.frozen_dict import FrozenDict
from flax.linen import fp8_ops
from flax.nnx import variablelib
from flax.nnx.module import first_from
from flax.nnx.nn import dtypes as nnx_dtypes
from flax.typing import Dtype, Initializer, PrecisionLike
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxoverlap import fp8
from jaxoverlap.flax import _common
from jaxoverlap.flax._common import COLUMN, ROW

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()

__all__ = [
    "ColumnParallelLinear",
    "ColumnParallelLinearGeneral",
    "Fp8DotGeneral",
    "OverwriteWithGradient",
    "ParallelMLP",
    "ParallelMultiHeadAttention",
    "RowParallelLinear",
    "RowParallelLinearGeneral",
    "partition_specs",
]

_SHARDING_KEYS = ("out_sharding", "sharding_names", "sharding")


def _tuple(x: int | Sequence[int]) -> tuple[int, ...]:
    return tuple(x) if isinstance(x, Sequence) else (x,)


# ---------------------------------------------------------------- parameters


def _param(layer: str, kind: str, name: str, init: Callable, key, shape: tuple[int, ...],
           n_in: int, tp_dim: int | None, dtype, user: Mapping[str, Any], axis_name: str,
           mesh: Any, tp_known: bool) -> nnx.Param:
    """An ``nnx.Param`` made as ``nnx.LinearGeneral`` makes it; the user's sharding kept.

    The initialiser sees the flat shape (``nnx.LinearGeneral``'s), so the
    values equal Flax's for the same key. Without the user's sharding the param
    carries the user's other metadata only, as the stock layer's does, and its
    value is placed with ``tp_dim`` split over ``axis_name`` where the mesh is
    known (outside shard_map).
    """
    flat = (int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:]))) if n_in else \
        (int(np.prod(shape)),)
    value = init(key, flat, dtype)
    if isinstance(value, variablelib.VariableMetadata):
        value.raw_value = jnp.reshape(value.raw_value, shape)
        given = {**value.metadata, **user}
    else:
        value = jnp.reshape(value, shape)
        given = dict(user)
    sharding_key = next((k for k in _SHARDING_KEYS if given.get(k)), None)
    if sharding_key is not None:
        source = f"{name}_metadata[{sharding_key!r}]" if user.get(sharding_key) else \
            f"{name}_init's {sharding_key}"
        names = tuple(given[sharding_key])
        if len(names) != len(shape) and len(names) == 2 and n_in and tp_dim is not None:
            # Names for the flat 2-d kernel, as nnx.LinearGeneral's initialiser sees it.
            tp_dim = 0 if tp_dim < n_in else 1
        _check(layer, kind, source, names, given.get("sharding_rules"), tp_dim, axis_name, mesh)
        return nnx.Param(value, **user)
    names = _common.own_names(len(shape), tp_dim, axis_name)
    if names is not None and tp_known:
        value = _common.place_value(value, names, axis_name, mesh)
    return nnx.Param(value, **{k: v for k, v in user.items() if k not in _SHARDING_KEYS})


def _has_sharding(variable: nnx.Variable) -> bool:
    metadata = variable.get_metadata()
    return any(metadata.get(k) for k in _SHARDING_KEYS)


def partition_specs(node: Any) -> nnx.State:
    """``nnx.get_partition_spec(nnx.state(node))`` with these layers' own layout where the
    user gave no sharding metadata: column kernel ``(None, axis_name)``, column bias
    ``(axis_name,)``, row kernel ``(axis_name, None)`` (the general layers: ``axis_name``
    on the split dim), row bias replicated.

    The params themselves carry no such metadata (the stock tree); this is their layout as
    specs, e.g. the ``in_specs`` of a ``jax.shard_map`` taking ``nnx.state(node)``. The
    user's own sharding names are reported as written (logical names stay logical)::

      >>> from flax import nnx
      >>> from jax.sharding import PartitionSpec as P
      >>> specs = partition_specs(ParallelMLP(4, 16, rngs=nnx.Rngs(0)))
      >>> specs["up"]["kernel"].get_value() == P(None, "tp")
      True
    """
    specs = nnx.get_partition_spec(nnx.state(node))
    for path, module in nnx.iter_modules(node):
        if not isinstance(module, _ParallelLinear):
            continue
        at = specs
        for key in path:
            at = at[key]
        for name, names in module.own_layout().items():
            variable = getattr(module, name)
            if variable is not None and not _has_sharding(variable):
                at[name] = at[name].replace(P(*names) if names is not None else P())
    return specs


def _check(layer: str, kind: str, source: str, names: tuple[Any, ...], local_rules: Any,
           tp_dim: int | None, axis_name: str, mesh: Any) -> None:
    """Checks the user's sharding names when they can be resolved to mesh axes.

    They resolve through the logical rules in force (``nnx.logical_axis_rules``)
    and the param's own ``sharding_rules``, as ``nnx.get_partition_spec`` does;
    without rules they are mesh axes if they name ``axis_name`` or the known
    mesh's axes, else logical names whose rules are not known yet.
    """
    rules = core_spmd.composite_rules(core_spmd.get_logical_axis_rules(), local_rules or ())
    target = mesh if mesh is not None else _common.context_mesh()
    mesh_names = set(target.axis_names) if target is not None else set()
    flat = {a for e in names for a in _common.entry_axes(e)}
    if not rules and axis_name not in flat and not (flat and flat <= mesh_names):
        return
    axes = tuple(core_spmd.from_sharding_rules(names, rules)) if rules else names
    _common.check_layout(layer, source, kind, axis_name, tp_dim, axes,
                         names=names if rules else None,
                         how=f" (from {names} under the rules in force)" if rules else "")


# ---------------------------------------------------------------- Flax's FP8 recipe

# The nnx type of Flax's ``_overwrite_with_gradient`` collection, as nnx.bridge maps it.
OverwriteWithGradient = variablelib.variable_type_from_name(
    fp8_ops.OVERWRITE_WITH_GRADIENT, allow_register=True)


class Fp8DotGeneral(nnx.Module):
    """Flax's FP8 recipe with delayed scaling as an nnx module: a ``dot_general``.

    It holds the variables of Flax's ``nn.Fp8DirectDotGeneralOp`` under their names
    (``input_scale``, ``input_amax_history``, ``kernel_scale``, ``kernel_amax_history``,
    ``output_grad_scale``, ``output_grad_amax_history``) as :data:`OverwriteWithGradient`
    variables (the nnx type of linen's ``_overwrite_with_gradient`` collection) and computes
    that op's ``fp8_scaled_dot_general``. Give it as ``dot_general=Fp8DotGeneral()`` to
    ``nnx.Linear`` / ``nnx.LinearGeneral`` or to these layers (which then run it fused, the
    collectives moving fp8), or as ``dot_general_cls=Fp8DotGeneral`` (``qkv_dot_general_cls``
    of the attention: one per projection); the state then lives at ``<layer>.dot_general``.

    As with linen, the gradient of each variable is its new value: take it with the params
    (``nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Any(nnx.Param, OverwriteWithGradient)))``),
    update the params with the optimizer and write the new values over the old ones
    (``nnx.update(model, nnx.filter_state(grads, OverwriteWithGradient))``).
    """

    def __init__(self, amax_history_length: int = 1024):
        init = fp8.DelayedScaling.init(amax_history_length)
        for name, value in zip(fp8.DelayedScaling._fields, init, strict=True):
            setattr(self, name, OverwriteWithGradient(value))

    def scaling(self) -> fp8.DelayedScaling:
        """The state's values (whose gradients are the new state)."""
        return fp8.DelayedScaling(*(getattr(self, name)[...]
                                    for name in fp8.DelayedScaling._fields))

    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, out_sharding=None):
        """``Fp8DirectDotGeneralOp``'s computation (``precision`` ignored, as there)."""
        del precision
        if out_sharding is not None:
            raise ValueError("Fp8DotGeneral: out_sharding is not supported; lay the result "
                             "out afterwards.")
        lhs = jnp.asarray(lhs, rhs.dtype)
        s = self.scaling()
        return fp8_ops.fp8_scaled_dot_general(
            lhs, rhs, dimension_numbers, preferred_element_type=preferred_element_type or
            lhs.dtype, lhs_scale=s.input_scale, rhs_scale=s.kernel_scale,
            grad_scale=s.output_grad_scale, lhs_amax_history=s.input_amax_history,
            rhs_amax_history=s.kernel_amax_history,
            grad_amax_history=s.output_grad_amax_history, quantize_compute_type=rhs.dtype)


# ---------------------------------------------------------------- the layers


class _ParallelLinear(nnx.Module):
    """Shared constructor and call of the nnx layers (general form)."""

    _kind = COLUMN

    def _build(
        self,
        layer: str,
        in_features: tuple[int, ...],
        out_features: tuple[int, ...],
        *,
        axis: Any,
        use_bias: bool,
        dtype: Dtype | None,
        param_dtype: Dtype,
        precision: PrecisionLike,
        kernel_init: Initializer,
        bias_init: Initializer,
        dot_general: Callable[..., Any] | None,
        dot_general_cls: Any,
        promote_dtype: Callable[..., Any],
        preferred_element_type: Dtype | None,
        axis_name: str,
        sequence_parallel: bool,
        impl: str,
        mesh: jax.sharding.Mesh | None,
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any],
        bias_metadata: Mapping[str, Any],
    ) -> None:
        for name, sizes in (("in_features", in_features), ("out_features", out_features)):
            _common.check_feature_dims(layer, name, sizes)
            for size in sizes:
                _common.check_features(layer, name, size)
        _common.check_common(layer, axis_name=axis_name, sequence_parallel=sequence_parallel,
                             impl=impl, use_bias=use_bias, kernel_init=kernel_init,
                             bias_init=bias_init, mesh=mesh)
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"{layer}: rngs={rngs!r} must be an nnx.Rngs.")
        n = _common.known_tp_size(axis_name, mesh)
        if n is not None:  # fail at construction when the mesh is already known
            if self._kind == COLUMN:
                _common.divide(layer, "out_features", out_features[0], n, axis_name)
            else:
                _common.divide(layer, "in_features", in_features[0], n, axis_name)
        if isinstance(dot_general_cls, type) and issubclass(dot_general_cls, Fp8DotGeneral):
            # One instance kept by the layer (nnx.LinearGeneral would make one per call,
            # which forgets its amax history): its state is the layer's ``dot_general``.
            dot_general, dot_general_cls = dot_general_cls(), None
        n_in = len(in_features)
        tp_kernel = n_in if self._kind == COLUMN else 0
        self.kernel = _param(layer, self._kind, "kernel", kernel_init, rngs.params(),
                             in_features + out_features, n_in, tp_kernel, param_dtype,
                             kernel_metadata, axis_name, mesh, n is not None)
        self.bias: nnx.Param | None
        if use_bias:
            self.bias = _param(layer, self._kind, "bias", bias_init, rngs.params(), out_features,
                               0, 0 if self._kind == COLUMN else None, param_dtype,
                               bias_metadata, axis_name, mesh, n is not None)
        else:
            self.bias = nnx.data(None)
        self.axis = axis
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.dot_general = dot_general
        self.dot_general_cls = dot_general_cls
        self.promote_dtype = promote_dtype
        self.preferred_element_type = preferred_element_type
        self.axis_name = axis_name
        self.sequence_parallel = sequence_parallel
        self.impl = impl
        self.mesh = mesh

    def own_layout(self) -> dict[str, tuple[Any, ...] | None]:
        """The layout of each param without the user's sharding: names per dim (None:
        replicated)."""
        n_in, n_out = len(_tuple(self.in_features)), len(_tuple(self.out_features))
        column = self._kind == COLUMN
        layout = {"kernel": _common.own_names(n_in + n_out, n_in if column else 0,
                                              self.axis_name)}
        if self.bias is not None:
            layout["bias"] = _common.own_names(n_out, 0 if column else None, self.axis_name)
        return layout

    def _local_shapes(self, layer: str, in_f: tuple[int, ...], out_f: tuple[int, ...]):
        """(in, out) feature shapes of the kernel this call sees: local shards inside shard_map."""
        n = _common.tp_size_if_bound(self.axis_name)
        if n is None:
            return in_f, out_f, None
        if self._kind == COLUMN:
            out_f = (_common.divide(layer, "out_features", out_f[0], n, self.axis_name),
                     *out_f[1:])
        else:
            in_f = (_common.divide(layer, "in_features", in_f[0], n, self.axis_name), *in_f[1:])
        return in_f, out_f, n

    def _apply(self, inputs: jax.Array, in_f: tuple[int, ...], out_f: tuple[int, ...],
               out_sharding: Any, sequence_parallel: bool | None = None) -> jax.Array:
        """The layer's call; ``sequence_parallel`` False runs this call without it (the
        attention's decode steps)."""
        layer = type(self).__name__
        n_contract = len(in_f)
        _common.check_input(layer, inputs, n_contract + 1)
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        local_in, local_out, n = self._local_shapes(layer, in_f, out_f)
        if n is not None and tuple(kernel.shape) != local_in + local_out:
            raise ValueError(
                f"{layer}: inside shard_map over {self.axis_name!r} the kernel must be the "
                f"local shard of shape {local_in + local_out}, got {tuple(kernel.shape)}. Pass "
                "the state with in_specs=jaxoverlap.flax.nnx.partition_specs(model).")
        got = tuple(inputs.shape[inputs.ndim - n_contract:])
        if got != local_in:
            what = f"inputs.shape[-1]={got[-1]}" if n_contract == 1 else \
                f"inputs.shape[-{n_contract}:]={got}"
            raise ValueError(
                f"{layer}: {what} but the layer expects {local_in if n_contract > 1 else in_f[0]}"
                f" input features (in_features={in_f if n_contract > 1 else in_f[0]}"
                + (f", split over {n} ranks" if n is not None and local_in != in_f else "")
                + ").")
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        return _common.general_forward(self._matmul(layer, inputs.dtype, sequence_parallel),
                                       inputs, kernel, bias, n_contract,
                                       out_sharding=out_sharding)

    def _matmul(self, layer: str, compute_dtype,
                sequence_parallel: bool | None = None) -> _common.Matmul:
        """How this call multiplies; ``sequence_parallel=False`` turns it off for the call."""
        kwargs: dict[str, Any] = {"out_sharding": None}
        reason = None
        if self.preferred_element_type is not None:
            kwargs["preferred_element_type"] = self.preferred_element_type
            if jnp.dtype(self.preferred_element_type) != jnp.dtype(compute_dtype):
                reason = f"preferred_element_type={jnp.dtype(self.preferred_element_type).name}"
        recipe = None
        if isinstance(self.dot_general, Fp8DotGeneral):
            recipe = _common.Fp8Recipe(self.dot_general.scaling())
        elif self.dot_general is fp8.dot_general:
            recipe = _common.Fp8Recipe()
        elif isinstance(self.dot_general, fp8.MXFP8BlockScaling):
            recipe = _common.Fp8Recipe(self.dot_general)
        if recipe is not None and reason is None:
            dot = self.dot_general         # Flax's FP8 recipe, fused (without a mesh: as is)
        elif self.dot_general_cls is not None:
            recipe = None
            dot = _common.choose_dot_general(layer, self.dot_general_cls(),
                                             "dot_general_cls was given")
        else:
            recipe = None
            dot = _common.choose_dot_general(layer, self.dot_general, reason)
        return _common.Matmul(layer=layer, kind=self._kind, axis_name=self.axis_name,
                              sequence_parallel=(self.sequence_parallel
                                                 and sequence_parallel is not False),
                              impl=self.impl, precision=self.precision, mesh=self.mesh,
                              dot_general=dot,
                              dot_general_kwargs=kwargs if dot is not None else {},
                              fp8=recipe)


class _Linear(_ParallelLinear):
    """``nnx.Linear``'s signature over the general form."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        precision: PrecisionLike = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        dot_general: Callable[..., Any] = lax.dot_general,
        promote_dtype: Callable[..., Any] = nnx_dtypes.promote_dtype,
        preferred_element_type: Dtype | None = None,
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        axis_name: str = "tp",
        sequence_parallel: bool = True,
        impl: str = "auto",
        mesh: jax.sharding.Mesh | None = None,
    ):
        layer = type(self).__name__
        _common.check_features(layer, "in_features", in_features)
        _common.check_features(layer, "out_features", out_features)
        self._build(layer, (in_features,), (out_features,), axis=-1, use_bias=use_bias,
                    dtype=dtype, param_dtype=param_dtype, precision=precision,
                    kernel_init=kernel_init, bias_init=bias_init, dot_general=dot_general,
                    dot_general_cls=None, promote_dtype=promote_dtype,
                    preferred_element_type=preferred_element_type, axis_name=axis_name,
                    sequence_parallel=sequence_parallel, impl=impl, mesh=mesh, rngs=rngs,
                    kernel_metadata=kernel_metadata, bias_metadata=bias_metadata)
        self.in_features = in_features
        self.out_features = out_features

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        """Applies the layer to ``inputs``.

        Args:
          inputs: ``[..., S, in_features]`` (global, or the local shard inside
            ``shard_map``; the sequence dim is the second to last).
          out_sharding: the output's sharding (a ``PartitionSpec`` on the mesh,
            or a ``Sharding``), as ``nnx.Linear`` takes it; None keeps the
            layer's layout.

        Returns:
          ``[..., S, out_features]``, laid out as the class docstring says.
        """
        return self._apply(inputs, (self.in_features,), (self.out_features,), out_sharding)


class _LinearGeneral(_ParallelLinear):
    """``nnx.LinearGeneral``'s signature over the general form."""

    def __init__(
        self,
        in_features: int | Sequence[int],
        out_features: int | Sequence[int],
        *,
        axis: int | Sequence[int] = -1,
        batch_axis: Mapping[int, int] = FrozenDict({}),
        use_bias: bool = True,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        precision: PrecisionLike = None,
        promote_dtype: Callable[..., Any] = nnx_dtypes.promote_dtype,
        dot_general: Callable[..., Any] | None = None,
        dot_general_cls: Any = None,
        preferred_element_type: Dtype | None = None,
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        axis_name: str = "tp",
        sequence_parallel: bool = True,
        impl: str = "auto",
        mesh: jax.sharding.Mesh | None = None,
    ):
        layer = type(self).__name__
        in_f, out_f, axes = _tuple(in_features), _tuple(out_features), _tuple(axis)
        if batch_axis:
            raise ValueError(f"{layer}: batch_axis={dict(batch_axis)!r} is not supported (the "
                             "tensor-parallel layers contract the trailing dims of a "
                             "batch-first input); leave it empty.")
        if len(axes) != len(in_f):
            raise ValueError(f"{layer}: in_features={in_f} and axis={axes} must have the same "
                             "length.")
        if any(a >= 0 for a in axes) or sorted(axes) != list(range(-len(axes), 0)):
            raise ValueError(f"{layer}: axis={axis!r} must name the trailing dims of the "
                             "inputs as negative indices (e.g. -1 or (-2, -1)); the dim before "
                             "them is the sequence dim.")
        self._build(layer, in_f, out_f, axis=axes, use_bias=use_bias, dtype=dtype,
                    param_dtype=param_dtype, precision=precision, kernel_init=kernel_init,
                    bias_init=bias_init, dot_general=dot_general,
                    dot_general_cls=dot_general_cls, promote_dtype=promote_dtype,
                    preferred_element_type=preferred_element_type, axis_name=axis_name,
                    sequence_parallel=sequence_parallel, impl=impl, mesh=mesh, rngs=rngs,
                    kernel_metadata=kernel_metadata, bias_metadata=bias_metadata)
        self.in_features = in_f
        self.out_features = out_f
        self.batch_axis = FrozenDict(batch_axis)

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        """Applies the layer: ``[..., S, *in_features]`` -> ``[..., S, *out_features]``.

        ``out_sharding`` as in :class:`ColumnParallelLinear`.
        """
        return self._apply(inputs, self.in_features, self.out_features, out_sharding)


class ColumnParallelLinear(_Linear):
    """An ``nnx.Linear`` whose output features are split over ``axis_name``.

    With ``sequence_parallel=True``: ``[..., S, H]`` sharded on S -> all-gather
    overlapped with the GEMM -> ``[..., S, out_features]`` sharded on features.
    With ``False``: a replicated input (Megatron f) -> sharded features.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxoverlap.flax.nnx import ColumnParallelLinear
      >>> mesh = jax.make_mesh((4,), ("tp",))
      >>> with jax.set_mesh(mesh):
      ...   layer = ColumnParallelLinear(4, 16, rngs=nnx.Rngs(0))
      ...   y = nnx.jit(lambda m, x: m(x))(layer, jnp.ones((2, 8, 4)))
      >>> layer.kernel.shape, y.shape
      ((4, 16), (2, 8, 16))
      >>> from jax.sharding import PartitionSpec as P
      >>> layer.kernel.sharding.spec == P(None, "tp")   # placed; a plain nnx.Param
      True

    Args:
      in_features: the number of input features.
      out_features: the number of output features (global; divisible by the
        size of ``axis_name``).
      use_bias: whether to add a bias to the output (default: True).
      dtype: the dtype of the computation (default: infer from input and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      precision: numerical precision of the computation, see ``jax.lax.Precision``
        (for the fused ops it is applied as ``jax.default_matmul_precision``).
      kernel_init: initializer function for the weight matrix (one from
        ``nnx.with_partitioning`` keeps its sharding names).
      bias_init: initializer function for the bias.
      dot_general: a custom ``dot_general`` (quantisation); the layer then runs the
        unfused computation with it, and says so once. Flax's FP8 recipe runs fused:
        :class:`Fp8DotGeneral` (delayed scaling), ``jaxoverlap.fp8.dot_general``
        (current scaling) or a ``jaxoverlap.fp8.MXFP8BlockScaling()`` (MXFP8).
      promote_dtype: function to promote the dtype of the arrays to the desired
        dtype; takes a tuple ``(inputs, kernel, bias)`` and a ``dtype`` keyword.
      preferred_element_type: the dot's accumulation and output dtype; one other
        than the computation's dtype runs unfused (the fused ops accumulate in
        float32 and return the inputs' dtype).
      axis_name: the tensor-parallel mesh axis (default: "tp").
      sequence_parallel: inputs sharded on the sequence dim (all-gather + GEMM)
        if True, replicated (Megatron f) if False (default: True).
      impl: "auto", "xla", "ring" or "native", passed to the op (default: "auto").
      mesh: the mesh for global arrays and for placing the params; None takes
        the ``jax.set_mesh`` mesh or the inputs' sharding (default: None).
      rngs: rng key.
      kernel_metadata: extra metadata for the kernel ``nnx.Param``; an
        ``out_sharding`` there is kept as written (see the module docstring).
      bias_metadata: extra metadata for the bias ``nnx.Param``.
    """

    _kind = COLUMN


class RowParallelLinear(_Linear):
    """An ``nnx.Linear`` whose input features are split over ``axis_name``.

    With ``sequence_parallel=True``: ``[..., S, F]`` sharded on F -> GEMM
    overlapped with a reduce-scatter -> ``[..., S, out_features]`` sharded on S.
    With ``False``: the partial products are all-reduced (Megatron g) and the
    output is replicated. The bias is replicated and added after the reduction.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxoverlap.flax.nnx import RowParallelLinear, partition_specs
      >>> layer = RowParallelLinear(16, 4, rngs=nnx.Rngs(0))   # no mesh yet: unplaced
      >>> from jax.sharding import PartitionSpec as P
      >>> partition_specs(layer)["kernel"].get_value() == P("tp", None)
      True
      >>> mesh = jax.make_mesh((4,), ("tp",))
      >>> nnx.jit(lambda m, h: m(h))(
      ...     RowParallelLinear(16, 4, mesh=mesh, rngs=nnx.Rngs(0)), jnp.ones((2, 8, 16))).shape
      (2, 8, 4)

    Args:
      in_features: the number of input features (global; divisible by the size
        of ``axis_name``).
      out_features: the number of output features.
      use_bias, dtype, param_dtype, precision, kernel_init, bias_init,
      dot_general, promote_dtype, preferred_element_type, axis_name, impl, mesh,
      rngs, kernel_metadata, bias_metadata: as in ``ColumnParallelLinear``.
      sequence_parallel: output sharded on the sequence dim (GEMM +
        reduce-scatter) if True, replicated (Megatron g) if False (default: True).
    """

    _kind = ROW


class ColumnParallelLinearGeneral(_LinearGeneral):
    """An ``nnx.LinearGeneral`` whose first output feature dim is split over ``axis_name``.

    ``out_features=(heads, head_dim)`` gives the attention projections: kernel
    ``[*in_features, heads, head_dim]`` split on ``heads``. ``axis`` names the
    trailing input dims contracted (negative indices; default -1); the dim
    before them is the sequence dim. ``batch_axis`` must be empty. Otherwise as
    :class:`ColumnParallelLinear` (``dot_general_cls`` as in ``nnx.LinearGeneral``).

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxoverlap.flax.nnx import ColumnParallelLinearGeneral
      >>> mesh = jax.make_mesh((4,), ("tp",))
      >>> q = ColumnParallelLinearGeneral(16, (8, 2), mesh=mesh, rngs=nnx.Rngs(0))
      >>> q.kernel.shape, nnx.jit(lambda m, x: m(x))(q, jnp.ones((2, 8, 16))).shape
      ((16, 8, 2), (2, 8, 8, 2))
    """

    _kind = COLUMN


class RowParallelLinearGeneral(_LinearGeneral):
    """An ``nnx.LinearGeneral`` whose first contracted input dim is split over ``axis_name``.

    ``in_features=(heads, head_dim), axis=(-2, -1)`` on ``[..., S, heads,
    head_dim]`` inputs split on ``heads`` gives the attention output projection.
    Otherwise as :class:`RowParallelLinear`.
    """

    _kind = ROW


class ParallelMLP(nnx.Module):
    """The Megatron MLP: column-parallel ``up``, activation, row-parallel ``down``.

    Maps ``[..., S, in_features]`` to ``[..., S, out_features or in_features]``
    through ``hidden_features`` units split over ``axis_name``. The sub-layers
    are the attributes ``up`` and ``down``, the names the linen ``ParallelMLP``
    uses, so parameters copy between the two APIs.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxoverlap.flax.nnx import ParallelMLP
      >>> mesh = jax.make_mesh((4,), ("tp",))
      >>> mlp = ParallelMLP(4, 32, mesh=mesh, rngs=nnx.Rngs(0))
      >>> mlp.up.kernel.shape, mlp.down.kernel.shape
      ((4, 32), (32, 4))
      >>> nnx.jit(lambda m, x: m(x))(mlp, jnp.ones((2, 8, 4))).shape
      (2, 8, 4)

    Args:
      in_features: the input (model) width.
      hidden_features: the hidden (feed-forward) width, divisible by the size
        of ``axis_name``.
      out_features: the output width (default: None, ``in_features``).
      activation: applied between the two layers (default: ``nnx.gelu``).
      use_bias, dtype, param_dtype, precision, kernel_init, bias_init,
      promote_dtype, dot_general, preferred_element_type, axis_name,
      sequence_parallel, impl, mesh, rngs: as in ``ColumnParallelLinear``, for
        both layers.
      dot_general_cls: a class whose instance each layer makes and keeps as its
        ``dot_general`` (``Fp8DotGeneral``: Flax's FP8 recipe, one state per layer).
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        *,
        out_features: int | None = None,
        activation: Callable[[jax.Array], jax.Array] = nnx.gelu,
        use_bias: bool = True,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        precision: PrecisionLike = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        promote_dtype: Callable[..., Any] = nnx_dtypes.promote_dtype,
        dot_general: Callable[..., Any] = lax.dot_general,
        preferred_element_type: Dtype | None = None,
        axis_name: str = "tp",
        sequence_parallel: bool = True,
        impl: str = "auto",
        mesh: jax.sharding.Mesh | None = None,
        rngs: nnx.Rngs,
        dot_general_cls: Any = None,
    ):
        if not callable(activation):
            raise TypeError(f"ParallelMLP: activation={activation!r} must be callable.")
        if isinstance(dot_general, nnx.Module):
            raise ValueError(
                f"ParallelMLP: dot_general={type(dot_general).__name__}(...) would be one module "
                "(one FP8 state) shared by up and down; pass dot_general_cls="
                f"{type(dot_general).__name__} and each layer makes its own.")
        out_features = in_features if out_features is None else out_features
        shared: dict[str, Any] = dict(
            use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, precision=precision,
            kernel_init=kernel_init, bias_init=bias_init, promote_dtype=promote_dtype,
            preferred_element_type=preferred_element_type,
            axis_name=axis_name, sequence_parallel=sequence_parallel, impl=impl, mesh=mesh,
            rngs=rngs,
        )

        def dot():
            return dot_general if dot_general_cls is None else dot_general_cls()

        self.up = ColumnParallelLinear(in_features, hidden_features, dot_general=dot(), **shared)
        self.down = RowParallelLinear(hidden_features, out_features, dot_general=dot(),
                                      **shared)
        self.activation = activation

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Applies the MLP.

        Args:
          inputs: ``[..., S, in_features]``, laid out as for ``ColumnParallelLinear``.

        Returns:
          ``[..., S, out_features]``, laid out as for ``RowParallelLinear``.
        """
        return self.down(self.activation(self.up(inputs)))


class ParallelMultiHeadAttention(nnx.Module):
    """An ``nnx.MultiHeadAttention`` whose heads are split over ``axis_name``.

    Same arguments (then ``axis_name``, ``sequence_parallel``, ``impl``,
    ``mesh``), same call, same attributes and parameters (``query``, ``key``,
    ``value``: ``ColumnParallelLinearGeneral`` with kernels ``[in, heads,
    head_dim]``; ``out``: ``RowParallelLinearGeneral``; ``query_ln``,
    ``key_ln``) with their global shapes and initial values. Each device holds
    ``num_heads / N`` query heads and ``num_kv_heads / N`` key/value heads.

    The projections of one input are one column-parallel multiply
    (self-attention: one ``ag_matmul`` for query, key and value), the output
    projection is row-parallel (``matmul_rs``); with ``sequence_parallel=False``
    Megatron's f/g. ``attention_fn`` runs per head; masks and dropout as in
    ``nnx.MultiHeadAttention``. A ``qkv_dot_general`` (or ``_cls``) runs the
    projections unfused. ``decode=True`` uses nnx's autoregressive cache
    (``init_cache`` or ``nnx.view``; ``cached_key``, ``cached_value`` ``[batch...,
    length, num_kv_heads, head_dim]`` global, split on the heads, and
    ``cache_index``): one token per call, computed without sequence parallelism
    (replicated token, GEMM + all-reduce); ``is_causal`` is ignored there, as in
    Flax 0.12.12.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxoverlap.flax.nnx import ParallelMultiHeadAttention
      >>> mesh = jax.make_mesh((4,), ("tp",))
      >>> attn = ParallelMultiHeadAttention(8, 16, decode=False, mesh=mesh, rngs=nnx.Rngs(0))
      >>> attn.query.kernel.shape
      (16, 8, 2)
      >>> nnx.jit(lambda m, x: m(x))(attn, jnp.ones((2, 8, 16))).shape
      (2, 8, 16)
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        num_kv_heads: int | None = None,
        in_kv_features: int | None = None,
        *,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        broadcast_dropout: bool = True,
        dropout_rate: float = 0.0,
        deterministic: bool | None = None,
        precision: PrecisionLike = None,
        kernel_init: Initializer = default_kernel_init,
        out_kernel_init: Initializer | None = None,
        bias_init: Initializer = default_bias_init,
        out_bias_init: Initializer | None = None,
        use_bias: bool = True,
        attention_fn: Callable[..., jax.Array] = nnx.dot_product_attention,
        decode: bool | None = None,
        normalize_qk: bool = False,
        qkv_promote_dtype: Callable[..., Any] = nnx_dtypes.promote_dtype,
        out_promote_dtype: Callable[..., Any] = nnx_dtypes.promote_dtype,
        ln_promote_dtype: Callable[..., Any] = nnx_dtypes.promote_dtype,
        qkv_dot_general: Callable[..., Any] | None = None,
        out_dot_general: Callable[..., Any] | None = None,
        qkv_dot_general_cls: Any = None,
        out_dot_general_cls: Any = None,
        rngs: nnx.Rngs,
        keep_rngs: bool = True,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        out_kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        out_bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        query_ln_scale_metadata: Mapping[str, Any] = MappingProxyType({}),
        key_ln_scale_metadata: Mapping[str, Any] = MappingProxyType({}),
        axis_name: str = "tp",
        sequence_parallel: bool = True,
        impl: str = "auto",
        mesh: jax.sharding.Mesh | None = None,
    ):
        layer = type(self).__name__
        _common.check_features(layer, "num_heads", num_heads)
        if isinstance(qkv_dot_general, nnx.Module):
            raise ValueError(
                f"{layer}: qkv_dot_general={type(qkv_dot_general).__name__}(...) would be one "
                "module (one FP8 state) shared by the query, key and value projections; pass "
                f"qkv_dot_general_cls={type(qkv_dot_general).__name__} and each makes its own.")
        self.num_heads = num_heads
        self.in_features = in_features
        self.qkv_features = qkv_features if qkv_features is not None else in_features
        self.out_features = out_features if out_features is not None else in_features
        self.in_kv_features = in_kv_features if in_kv_features is not None else in_features
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{layer}: num_heads={num_heads} must be divisible by "
                             f"num_kv_heads={self.num_kv_heads}.")
        if self.qkv_features % self.num_heads:
            raise ValueError(f"{layer}: qkv_features={self.qkv_features} must be divisible by "
                             f"num_heads={num_heads}.")
        self.head_dim = self.qkv_features // self.num_heads
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.broadcast_dropout = broadcast_dropout
        self.dropout_rate = dropout_rate
        self.deterministic = deterministic
        self.precision = precision
        self.use_bias = use_bias
        self.attention_fn = attention_fn
        self.decode = decode
        self.normalize_qk = normalize_qk
        self.qkv_promote_dtype = qkv_promote_dtype
        self.out_promote_dtype = out_promote_dtype
        self.ln_promote_dtype = ln_promote_dtype
        self.qkv_dot_general = qkv_dot_general
        self.out_dot_general = out_dot_general
        self.qkv_dot_general_cls = qkv_dot_general_cls
        self.out_dot_general_cls = out_dot_general_cls
        self.axis_name = axis_name
        self.sequence_parallel = sequence_parallel
        self.impl = impl
        self.mesh = mesh
        parallel = dict(axis_name=axis_name, sequence_parallel=sequence_parallel, impl=impl,
                        mesh=mesh)
        n = _common.known_tp_size(axis_name, mesh)
        if n is not None:
            for name, heads in (("num_heads", num_heads), ("num_kv_heads", self.num_kv_heads)):
                _common.divide(layer, name, heads, n, axis_name)

        def projection(in_f: int, heads: int) -> ColumnParallelLinearGeneral:
            return ColumnParallelLinearGeneral(
                in_f, (heads, self.head_dim), dtype=dtype, param_dtype=param_dtype,
                kernel_init=kernel_init, bias_init=bias_init, use_bias=use_bias,
                precision=precision, promote_dtype=qkv_promote_dtype,
                dot_general=qkv_dot_general, dot_general_cls=qkv_dot_general_cls,
                kernel_metadata=kernel_metadata, bias_metadata=bias_metadata, rngs=rngs,
                **parallel)

        self.query = projection(in_features, num_heads)
        self.key = projection(self.in_kv_features, self.num_kv_heads)
        self.value = projection(self.in_kv_features, self.num_kv_heads)
        self.query_ln: nnx.LayerNorm | None
        self.key_ln: nnx.LayerNorm | None
        if normalize_qk:
            self.query_ln = nnx.LayerNorm(self.head_dim, use_bias=False, dtype=dtype,
                                          param_dtype=param_dtype, promote_dtype=ln_promote_dtype,
                                          rngs=rngs, scale_metadata=query_ln_scale_metadata)
            self.key_ln = nnx.LayerNorm(self.head_dim, use_bias=False, dtype=dtype,
                                        param_dtype=param_dtype, promote_dtype=ln_promote_dtype,
                                        rngs=rngs, scale_metadata=key_ln_scale_metadata)
        else:
            self.query_ln = nnx.data(None)
            self.key_ln = nnx.data(None)
        self.out = RowParallelLinearGeneral(
            (num_heads, self.head_dim), self.out_features, axis=(-2, -1),
            kernel_init=out_kernel_init or kernel_init, bias_init=out_bias_init or bias_init,
            use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, precision=precision,
            promote_dtype=out_promote_dtype, dot_general=out_dot_general,
            dot_general_cls=out_dot_general_cls, rngs=rngs,
            kernel_metadata=out_kernel_metadata or kernel_metadata,
            bias_metadata=out_bias_metadata or bias_metadata, **parallel)
        self.rngs = rngs.dropout.fork() if keep_rngs and dropout_rate > 0 else None
        self.cached_key: nnx.Cache | None = nnx.data(None)
        self.cached_value: nnx.Cache | None = nnx.data(None)
        self.cache_index: nnx.Cache | None = nnx.data(None)

    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | None = None,
        sow_weights: bool = False,
        decode: bool | None = None,
        is_causal: bool = False,
        out_sharding: Any = None,
        qkv_sharding: Any = None,
        input_positions: jax.Array | None = None,
    ) -> jax.Array:
        """Applies multi-head dot-product attention, as ``nnx.MultiHeadAttention``.

        Args:
          inputs_q: ``[batch..., length, in_features]`` queries (global, or the
            local shard inside ``shard_map``; sharded on length with sequence
            parallelism).
          inputs_k, inputs_v: keys and values (default: ``inputs_q``).
          mask: ``[batch..., num_heads or 1, q_length, kv_length]``; False masks out.
          deterministic, rngs, sow_weights, is_causal, input_positions: as in
            ``nnx.MultiHeadAttention`` (``input_positions`` goes to ``attention_fn``).
          decode: one decode step through the cache (``init_cache`` first); None
            takes the module's ``decode``, and neither given is an error, as in nnx.
          out_sharding, qkv_sharding: the output's and the projections' sharding.

        Returns:
          ``[batch..., length, out_features]``, laid out as ``RowParallelLinear``'s output.
        """
        layer = type(self).__name__
        decode = first_from(decode, self.decode, error_msg=(
            f"{layer}: no `decode` argument was given as a call argument, constructor "
            "argument or attribute (nnx.MultiHeadAttention's rule); give decode=False or True."))
        sequence_parallel = None
        if decode:
            if self.cached_key is None or self.cached_value is None or self.cache_index is None:
                raise ValueError(f"{layer}: autoregressive cache not initialized, call "
                                 "``init_cache`` first (decode=True needs it).")
            _common.check_decode_step(layer, inputs_q)
            if self.sequence_parallel:    # one token cannot be split over the ranks
                _common.say_once(layer, _common.DECODE_STEP_SAYS, logging.DEBUG)
            sequence_parallel = False
        if rngs is None:
            rngs = self.rngs
        elif isinstance(rngs, nnx.Rngs):
            rngs = rngs.dropout
        if inputs_k is None:
            if inputs_v is not None:
                raise ValueError(f"{layer}: inputs_k cannot be None if inputs_v is not None.")
            inputs_k = inputs_q
        if inputs_v is None:
            inputs_v = inputs_k
        if inputs_q.shape[-1] != self.in_features:
            raise ValueError(f"{layer}: inputs_q.shape[-1]={inputs_q.shape[-1]} but the module "
                             f"expects in_features={self.in_features}.")
        projections = (self.query, self.key, self.value)
        inputs = (inputs_q, inputs_k, inputs_v)
        if self.qkv_dot_general is not None or self.qkv_dot_general_cls is not None:
            query, key, value = (p._apply(x, p.in_features, p.out_features, qkv_sharding,
                                          sequence_parallel)
                                 for p, x in zip(projections, inputs, strict=True))
        else:
            query, key, value = self._fused_qkv(layer, projections, inputs, qkv_sharding,
                                                sequence_parallel)
        if self.normalize_qk:
            query = self.query_ln(query)
            key = self.key_ln(key)
        if decode:
            query, key, value, index, mask = _common.decode_step(
                layer, self.cached_key[...], self.cached_value[...], self.cache_index[...],
                query, key, value, mask, nnx.combine_masks, axis_name=self.axis_name,
                mesh=self.mesh, heads_of="key", where="Make the cache with init_cache(input_"
                "shape) for the batch and length you decode ([batch..., length, in_features]).")
            self.cached_key[...], self.cached_value[...] = key, value
            self.cache_index[...] = index
        if self.dropout_rate > 0.0:
            deterministic = deterministic if deterministic is not None else self.deterministic
            if deterministic is None:
                raise ValueError(f"{layer}: no `deterministic` argument was given as a call "
                                 "argument or at construction.")
            if not deterministic:
                if rngs is None:
                    raise ValueError(f"{layer}: 'rngs' must be given to __call__ when the "
                                     "module is built with keep_rngs=False.")
                dropout_rng = rngs()
                if _common.tp_size_if_bound(self.axis_name) is not None:
                    # On local shards each device holds other heads: give them other bits.
                    dropout_rng = jax.random.fold_in(dropout_rng,
                                                     lax.axis_index(self.axis_name))
            else:
                dropout_rng = None
        else:
            deterministic, dropout_rng = True, None
        attn_kwargs: dict[str, Any] = {}
        if input_positions is not None:
            attn_kwargs["input_positions"] = input_positions
        x = self.attention_fn(
            query, key, value, mask=mask, dropout_rng=dropout_rng,
            dropout_rate=self.dropout_rate, broadcast_dropout=self.broadcast_dropout,
            deterministic=deterministic, dtype=self.dtype, precision=self.precision,
            module=self if sow_weights else None, is_causal=is_causal and not decode,
            **attn_kwargs)
        return self.out._apply(x, self.out.in_features, self.out.out_features, out_sharding,
                               sequence_parallel)

    def init_cache(self, input_shape: Sequence[int], dtype: Dtype = jnp.float32) -> None:
        """Makes the autoregressive cache for ``decode=True``, as ``nnx.MultiHeadAttention``'s.

        ``input_shape`` is ``[batch..., length, in_features]`` (the longest sequence to
        decode); ``cached_key`` and ``cached_value`` are ``nnx.Cache`` zeros of shape
        ``[batch..., length, num_kv_heads, head_dim]`` (global, split on the heads over
        ``axis_name`` where a mesh is known: ``mesh=`` or ``jax.set_mesh``; inside
        shard_map this device's heads), ``cache_index`` an int32 0.
        """
        heads = self.num_kv_heads
        n = _common.tp_size_if_bound(self.axis_name)
        if n is not None:
            heads = _common.divide(type(self).__name__, "num_kv_heads", heads, n,
                                   self.axis_name)
        shape = (*tuple(input_shape)[:-1], heads, self.head_dim)
        spec = tuple(_common.cache_heads_spec(len(shape), self.axis_name, batch=None))

        def zeros():   # placed on the mesh, if one is known, outside shard_map
            return _common.place_value(jnp.zeros(shape, dtype), spec, self.axis_name, self.mesh)

        self.cached_key = nnx.Cache(zeros())
        self.cached_value = nnx.Cache(zeros())
        self.cache_index = nnx.Cache(jnp.array(0, dtype=jnp.int32))

    def set_view(self, deterministic: bool | None = None, decode: bool | None = None,
                 batch_size: int | Sequence[int] | None = None,
                 max_length: int | None = None) -> None:
        """What ``nnx.view`` sets, as ``nnx.MultiHeadAttention.set_view``: the modes, and with
        ``decode=True``, ``batch_size`` and ``max_length`` a cache if there is none yet."""
        if deterministic is not None:
            self.deterministic = deterministic
        if decode is not None:
            self.decode = decode
            if decode and self.cached_key is None and batch_size is not None \
                    and max_length is not None:
                batch = (batch_size,) if isinstance(batch_size, int) else tuple(batch_size)
                self.init_cache((*batch, max_length, self.in_features), self.dtype or
                                jnp.float32)

    def _fused_qkv(self, layer: str, projections: tuple, inputs: tuple, qkv_sharding: Any,
                   sequence_parallel: bool | None):
        """The three projections, one multiply per distinct input (self-attention: one)."""
        groups: list[tuple[Any, list[int]]] = []
        for i, x in enumerate(inputs):
            for group_x, members in groups:
                if group_x is x:
                    members.append(i)
                    break
            else:
                groups.append((x, [i]))
        out: dict[int, jax.Array] = {}
        for x, members in groups:
            kernels, biases = [], []
            for i in members:
                p = projections[i]
                _common.check_input(layer, x)
                kernel = p.kernel[...]
                if x.shape[-1] != kernel.shape[0]:
                    raise ValueError(
                        f"{layer}: {('inputs_q', 'inputs_k', 'inputs_v')[i]}.shape[-1]="
                        f"{x.shape[-1]} but the {('query', 'key', 'value')[i]} projection "
                        f"expects {kernel.shape[0]} features.")
                bias = p.bias[...] if p.bias is not None else None
                x, kernel, bias = self.qkv_promote_dtype((x, kernel, bias), dtype=self.dtype)
                kernels.append(kernel)
                biases.append(bias)
            m = projections[members[0]]._matmul(layer, x.dtype, sequence_parallel)
            ys = _common.fused_columns(m, x, kernels, biases)
            for i, y in zip(members, ys, strict=True):
                out[i] = _common.constrain_output(m, y, qkv_sharding, x)
        return out[0], out[1], out[2]
