"""Tensor-parallel Flax linen layers: drop-in replacements for ``nn.Dense``, ``nn.DenseGeneral``
and ``nn.MultiHeadDotProductAttention``.

The layers take every field of the Flax layer they replace (in the same
order, then ``axis_name``, ``sequence_parallel``, ``impl`` and ``mesh``), have
its parameter names and *global* parameter shapes, and initialise them the
same way, so a checkpoint of the unparallel model loads unchanged.

Partitioning metadata: an initialiser wrapped in ``nn.with_logical_partitioning``
or ``nn.with_partitioning`` keeps the user's names (``nn.get_partition_spec``
reports them; the user's logical rules place the parameter). When rules are in
force (``nn.logical_axis_rules`` or the box's own) or the names are mesh axes,
the layer checks that they split the right dim over ``axis_name`` and raises
naming the rule to add otherwise. An unannotated initialiser gives a plain
array, as Flax's layer does (the variables' tree is the stock layer's, so
path-keyed checkpoints load either way), laid out on the mesh when one is known
as it is made (the layer's own layout, which :func:`partition_specs` reports):

==========================  ===========================  ====================
layer                       kernel                       bias
==========================  ===========================  ====================
column-parallel             ``(None, axis_name)``        ``(axis_name,)``
column-parallel general     ``axis_name`` on features[0]  ``axis_name`` on dim 0
row-parallel (general)      ``axis_name`` on dim 0        replicated
==========================  ===========================  ====================

Inputs are batch-first, ``[..., S, features]``: the sequence dim is the one
before the contracted dims. With ``sequence_parallel=True`` the column layer is
an all-gather + GEMM (``jaxoverlap.ag_matmul``: ``[B, S, H]`` sharded on S to
``[B, S, F]`` sharded on F) and the row layer a GEMM + reduce-scatter
(``jaxoverlap.matmul_rs``: back to ``[B, S, H]`` sharded on S). With
``sequence_parallel=False`` they are Megatron's f/g pair: the column layer
takes a replicated input (its gradient is all-reduced), the row layer
all-reduces its output.

The layers work on global arrays under ``jax.jit`` (the mesh from ``mesh=``,
``jax.set_mesh`` or the inputs' sharding; mesh axes other than ``axis_name`` on
the batch, data parallel or FSDP, pass through), on local shards inside the
user's own ``jax.shard_map`` over ``axis_name`` (then the parameters are the
local shards), and with no mesh at all as the plain Flax layer (so
``jax.eval_shape(model.init, ...)`` needs no mesh).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta
from flax.linen import fp8_ops
from flax.linen import module as _flax_module
from flax.linen.dtypes import promote_dtype
from flax.typing import Dtype, Initializer, PrecisionLike

from jaxoverlap import fp8
from jaxoverlap.flax import _common
from jaxoverlap.flax._common import COLUMN, ROW

default_kernel_init = nn.initializers.lecun_normal()
default_bias_init = nn.initializers.zeros_init()

__all__ = [
    "ColumnParallelDense",
    "ColumnParallelDenseGeneral",
    "ParallelMLP",
    "ParallelMultiHeadDotProductAttention",
    "RowParallelDense",
    "RowParallelDenseGeneral",
    "partition_specs",
]


def _tuple(x: int | Sequence[int]) -> tuple[int, ...]:
    return tuple(x) if isinstance(x, Sequence) else (x,)


# ---------------------------------------------------------------- parameters


def _param(module: nn.Module, layer: str, kind: str, name: str, init: Callable,
           shape: tuple[int, ...], n_in: int, tp_dim: int | None, mesh: Any,
           axis_name: str) -> jax.Array:
    """Creates or fetches ``name`` like ``nn.DenseGeneral`` does; keeps and checks its metadata.

    The initialiser sees the flat shape ``(prod(shape[:n_in]), prod(shape[n_in:]))``
    (``n_in`` = 0: ``(prod(shape),)``), as in ``nn.DenseGeneral``, so the values
    equal Flax's for the same key. A user's box stays as written; an
    unannotated value stays a plain array, as Flax's, laid out with ``tp_dim``
    split over ``axis_name`` (boxed with those names only for
    :func:`partition_specs`).
    """
    own = _common.own_names(len(shape), tp_dim, axis_name)

    def init_fn(key, shape, dtype):
        flat = (int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:]))) if n_in else \
            (int(np.prod(shape)),)
        value = init(key, flat, dtype)
        if isinstance(value, meta.AxisMetadata):
            # replace_boxed of the box itself: flax's meta.replace_boxed unboxes with a
            # sharding constraint, an assertion that fails under Explicit mesh axes.
            return value.replace_boxed(jnp.reshape(_raw(value), shape))
        value = jnp.reshape(value, shape)
        if own is None:
            return value
        value = _common.place_value(value, own, axis_name, mesh)
        # No mesh in the box: flax would then constrain every nn.unbox to it,
        # which fails under Explicit axes; the value is placed here instead.
        return nn.Partitioned(value, names=own) if _REPORT_OWN.get() else value

    boxed = module.param(name, init_fn, shape, module.param_dtype, unbox=False)
    return _checked_value(layer, kind, name, boxed, shape, n_in, tp_dim, axis_name)


# Set only while partition_specs traces an init: the unannotated parameters are boxed with
# the layers' own names there, so that Flax's nn.get_partition_spec reports them.
_REPORT_OWN: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxoverlap_report_own",
                                                                   default=False)


def partition_specs(module: nn.Module, *init_args: Any, **init_kwargs: Any) -> Any:
    """The partition specs of ``module.init(*init_args, **init_kwargs)``'s variables, as
    ``nn.get_partition_spec`` gives them, with these layers' own layout where the user gave
    no metadata: column kernel ``(None, axis_name)``, column bias ``(axis_name,)``, row
    kernel ``(axis_name, None)`` (the general layers: ``axis_name`` on the split dim).

    The variables themselves are Flax's plain arrays there (the stock tree); this is the
    layout as specs, e.g. for ``jax.shard_map``'s ``in_specs`` or ``jit``'s
    ``out_shardings``. The user's ``nn.with_logical_partitioning`` names stay logical names
    (``nn.logical_to_mesh_sharding`` resolves them). Abstract (``jax.eval_shape``): no mesh
    needed, nothing computed::

      >>> import jax, jax.numpy as jnp
      >>> x = jnp.ones((2, 8, 4))                       # [B, S, H]
      >>> specs = partition_specs(ParallelMLP(features=16), jax.random.key(0), x)["params"]
      >>> from jax.sharding import PartitionSpec as P
      >>> specs["up"]["kernel"] == P(None, "tp") and specs["down"]["kernel"] == P("tp", None)
      True
    """
    token = _REPORT_OWN.set(True)
    try:
        # A new function each time: no cached trace made without the boxes is reused.
        abstract = jax.eval_shape(lambda *a, **k: module.init(*a, **k), *init_args,
                                  **init_kwargs)
    finally:
        _REPORT_OWN.reset(token)
    return nn.get_partition_spec(abstract)


def _raw(box: meta.AxisMetadata):
    """The value inside a box, without flax's sharding constraint (see below)."""
    return box.unbox(apply_constraint=False) if isinstance(box, nn.Partitioned) else box.unbox()


def _checked_value(layer: str, kind: str, name: str, boxed: Any, shape: tuple[int, ...],
                   n_in: int, tp_dim: int | None, axis_name: str):
    """The parameter's value; its partitioning names checked first when they can be resolved.

    Unboxed by hand: flax's own unboxing adds a sharding constraint, which is
    an assertion under Explicit mesh axes and invalid inside shard_map; the ops
    lay the parameters out themselves.
    """
    if not isinstance(boxed, meta.AxisMetadata):
        return boxed
    if isinstance(boxed, nn.Partitioned):
        names = tuple(boxed.names)
        # Names given for the flat (2-d) kernel, as nn.DenseGeneral's initialiser sees it.
        flat_dim = tp_dim
        if len(names) != len(shape) and len(names) == 2 and n_in and tp_dim is not None:
            flat_dim = 0 if tp_dim < n_in else 1
        if isinstance(boxed, nn.LogicallyPartitioned):
            rules = boxed.rules if boxed.rules is not None else nn.get_logical_axis_rules()
            if rules:
                axes = tuple(nn.logical_to_mesh_axes(names, rules))
                _common.check_layout(layer, name, kind, axis_name, flat_dim, axes, names=names,
                                     how=f" (its logical names {names} under the rules in "
                                         "force)")
        else:
            _common.check_layout(layer, name, kind, axis_name, flat_dim, names)
    return _raw(boxed)


# ---------------------------------------------------------------- Flax's FP8 recipe


def fp8_recipe(dot: Any) -> _common.Fp8Recipe | None:
    """Delayed scaling with the variables of ``dot`` if it is Flax's FP8 op
    (``nn.Fp8DotGeneralOp`` or ``nn.Fp8DirectDotGeneralOp``, with e4m3 and e5m2), else None.

    The variables (``_overwrite_with_gradient``: ``input_scale``, ``input_amax_history``,
    ...) are read here, where the op made them; their gradients are their new values, as
    with Flax's own op, so ``TrainState.apply_gradients`` updates them the same way.
    """
    if type(dot) not in (fp8_ops.Fp8DotGeneralOp, fp8_ops.Fp8DirectDotGeneralOp):
        return None
    if (jnp.dtype(dot.e4m3_dtype), jnp.dtype(dot.e5m2_dtype)) != (fp8.E4M3, fp8.E5M2):
        return None
    return _common.Fp8Recipe(fp8.DelayedScaling(
        *(getattr(dot, name).value for name in fp8.DelayedScaling._fields)))


# ---------------------------------------------------------------- Flax's auto-names


class _NamedLikeFlax:
    """Makes an unnamed layer take the name Flax gives the layer it replaces.

    Flax names an unnamed submodule after its class (``Dense_0``, ``Dense_1``,
    ...). Counting under the Flax layer's name keeps the parameter paths of a
    model whose ``nn.Dense`` were swapped for these layers, so its checkpoints
    and partitioning rules keep working. Flax's own autonaming
    (``flax.linen.Module.__post_init__``) does the same with the class name.
    """

    _flax_name: str = ""

    def __post_init__(self) -> None:
        parent = self.parent
        if parent is getattr(_flax_module, "_unspecified_parent", None):
            # Flax takes the parent from its module stack in its own __post_init__.
            stack = getattr(getattr(_flax_module, "_context", None), "module_stack", [None])
            parent = stack[-1]
        state = getattr(parent, "_state", None)
        if (self.name is None and isinstance(parent, nn.Module) and state is not None
                and not state.in_setup and hasattr(state, "autoname_cursor")):
            cursor = state.autoname_cursor.get(self._flax_name, 0)
            object.__setattr__(self, "name", f"{self._flax_name}_{cursor}")
            state.autoname_cursor[self._flax_name] = cursor + 1
        super().__post_init__()


# ---------------------------------------------------------------- the layers


class _ParallelLinear(_NamedLikeFlax, nn.Module):
    """Shared computation of the dense layers (the fields live in the subclasses)."""

    _kind = COLUMN

    def _check_fields(self, layer: str) -> None:
        _common.check_common(layer, axis_name=self.axis_name,
                             sequence_parallel=self.sequence_parallel, impl=self.impl,
                             use_bias=self.use_bias, kernel_init=self.kernel_init,
                             bias_init=self.bias_init, mesh=self.mesh)

    def _matmul(self, layer: str) -> _common.Matmul:
        """How this call multiplies: the fused ops, Flax's FP8 recipe fused, or the user's
        dot_general unfused (an instance of ``dot_general_cls`` made here, as nn.Dense
        does: Flax's FP8 ops keep their variables under its name)."""
        recipe = None
        if self.dot_general_cls is not None:
            dot = self.dot_general_cls()
            recipe = fp8_recipe(dot)
            if recipe is None:
                dot = _common.choose_dot_general(layer, dot, "dot_general_cls was given")
        elif self.dot_general is fp8.dot_general:
            dot, recipe = fp8.dot_general, _common.Fp8Recipe()
        elif isinstance(self.dot_general, fp8.MXFP8BlockScaling):
            dot, recipe = self.dot_general, _common.Fp8Recipe(self.dot_general)
        else:
            dot = _common.choose_dot_general(layer, self.dot_general)
        return _common.Matmul(layer=layer, kind=self._kind, axis_name=self.axis_name,
                              sequence_parallel=self.sequence_parallel, impl=self.impl,
                              precision=self.precision, mesh=self.mesh, dot_general=dot,
                              fp8=recipe)

    def _general(self, inputs: jax.Array, features: tuple[int, ...], n_contract: int):
        """The layer on ``inputs [..., S, *contracted]``: kernel ``[*contracted, *features]``."""
        layer = type(self).__name__
        self._check_fields(layer)
        _common.check_input(layer, inputs, n_contract + 1)
        _common.check_feature_dims(layer, "features", features)
        for f in features:
            _common.check_features(layer, "features", f)
        contracted = tuple(inputs.shape[inputs.ndim - n_contract:])
        n = _common.tp_size_if_bound(self.axis_name)
        if n is not None:  # inside shard_map: the parameters are local shards
            if self._kind == COLUMN:
                features = (_common.divide(layer, "features", features[0], n, self.axis_name),
                            *features[1:])
        elif (known := _common.known_tp_size(self.axis_name, self.mesh)) is not None:
            # Checked before the parameters are created and laid out on the mesh.
            if self._kind == COLUMN:
                _common.divide(layer, "features", features[0], known, self.axis_name)
            else:
                _common.divide(layer, f"inputs.shape[{-n_contract}] (the input features)",
                               contracted[0], known, self.axis_name)
        kernel = _param(self, layer, self._kind, "kernel", self.kernel_init,
                        contracted + features, n_contract,
                        n_contract if self._kind == COLUMN else 0, self.mesh, self.axis_name)
        bias = None
        if self.use_bias:
            bias = _param(self, layer, self._kind, "bias", self.bias_init, features, 0,
                          0 if self._kind == COLUMN else None, self.mesh, self.axis_name)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        return _common.general_forward(self._matmul(layer), inputs, kernel, bias, n_contract)


class ColumnParallelDense(_ParallelLinear):
    """A ``nn.Dense`` whose output features are split over ``axis_name``.

    With ``sequence_parallel=True``: ``[..., S, H]`` sharded on S -> all-gather
    overlapped with the GEMM -> ``[..., S, features]`` sharded on features.
    With ``False``: a replicated input (Megatron f) -> sharded features.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxoverlap.flax.linen import ColumnParallelDense
      >>> mesh = jax.make_mesh((4,), ("tp",))
      >>> layer = ColumnParallelDense(features=16, mesh=mesh)
      >>> x = jnp.ones((2, 8, 4))                       # [B, S, H]
      >>> variables = layer.init(jax.random.key(0), x)
      >>> jax.tree.map(jnp.shape, variables)            # nn.Dense's tree, plain arrays
      {'params': {'bias': (16,), 'kernel': (4, 16)}}
      >>> variables["params"]["kernel"].sharding.spec == P(None, "tp")
      True
      >>> jax.jit(layer.apply)(variables, x).shape
      (2, 8, 16)

    Attributes:
      features: the number of output features (global; divisible by the size
        of ``axis_name``).
      use_bias: whether to add a bias to the output (default: True).
      dtype: the dtype of the computation (default: infer from input and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      precision: numerical precision of the computation, see ``jax.lax.Precision``
        (for the fused ops it is applied as ``jax.default_matmul_precision``).
      kernel_init: initializer function for the weight matrix; one wrapped in
        ``nn.with_logical_partitioning`` / ``nn.with_partitioning`` keeps its names.
      bias_init: initializer function for the bias (likewise).
      promote_dtype: function to promote the dtype of the arrays to the desired
        dtype (as in ``nn.Dense``).
      dot_general: a custom ``dot_general``; the layer then runs unfused with it
        (``jaxoverlap.fp8.dot_general``, FP8 with current scaling, and a
        ``jaxoverlap.fp8.MXFP8BlockScaling()``, MXFP8, run fused).
      dot_general_cls: a module class whose instance is the ``dot_general``: Flax's
        ``nn.Fp8DotGeneralOp`` / ``nn.Fp8DirectDotGeneralOp`` run fused (Flax's FP8
        recipe, its variables kept); others (quantisation) unfused.
      axis_name: the tensor-parallel mesh axis (default: "tp").
      impl: "auto", "xla", "ring" or "native", passed to the op (default: "auto").
      mesh: the mesh for global arrays; None takes the ``jax.set_mesh`` mesh or
        the inputs' sharding (default: None).
      sequence_parallel: inputs sharded on the sequence dim (all-gather + GEMM)
        if True, replicated (Megatron f) if False (default: True).
    """

    features: int
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: PrecisionLike = None
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = default_bias_init
    promote_dtype: Callable[..., Any] = promote_dtype
    dot_general: Callable[..., Any] | None = None
    dot_general_cls: Any = None
    axis_name: str = "tp"
    sequence_parallel: bool = True
    impl: str = "auto"
    mesh: jax.sharding.Mesh | None = None

    _kind = COLUMN
    _flax_name = "Dense"

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Applies the layer to ``inputs`` ``[..., S, in_features]`` (global, or the local
        shard inside ``shard_map``); returns ``[..., S, features]``."""
        _common.check_features(type(self).__name__, "features", self.features)
        return self._general(inputs, (self.features,), 1)


class RowParallelDense(_ParallelLinear):
    """A ``nn.Dense`` whose input features are split over ``axis_name``.

    With ``sequence_parallel=True``: ``[..., S, F]`` sharded on F -> GEMM
    overlapped with a reduce-scatter -> ``[..., S, features]`` sharded on S.
    With ``False``: the partial products are all-reduced (Megatron g) and the
    output is replicated. The bias is replicated and added once, after the
    reduction.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from jaxoverlap.flax.linen import RowParallelDense
      >>> mesh = jax.make_mesh((4,), ("tp",))
      >>> layer = RowParallelDense(features=4, mesh=mesh)
      >>> h = jnp.ones((2, 8, 16))                      # [B, S, F]
      >>> variables = layer.init(jax.random.key(0), h)
      >>> jax.tree.map(jnp.shape, variables)
      {'params': {'bias': (4,), 'kernel': (16, 4)}}
      >>> jax.jit(layer.apply)(variables, h).shape
      (2, 8, 4)

    Attributes:
      features: the number of output features.
      use_bias, dtype, param_dtype, precision, kernel_init, bias_init,
      promote_dtype, dot_general, dot_general_cls, axis_name, impl, mesh: as in
        :class:`ColumnParallelDense`.
      sequence_parallel: output sharded on the sequence dim (GEMM +
        reduce-scatter) if True, replicated (Megatron g) if False (default: True).
    """

    features: int
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: PrecisionLike = None
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = default_bias_init
    promote_dtype: Callable[..., Any] = promote_dtype
    dot_general: Callable[..., Any] | None = None
    dot_general_cls: Any = None
    axis_name: str = "tp"
    sequence_parallel: bool = True
    impl: str = "auto"
    mesh: jax.sharding.Mesh | None = None

    _kind = ROW
    _flax_name = "Dense"

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Applies the layer to ``inputs`` ``[..., S, in_features]`` (global, or the local
        shard inside ``shard_map``); returns ``[..., S, features]``."""
        _common.check_features(type(self).__name__, "features", self.features)
        return self._general(inputs, (self.features,), 1)


def _contracted_dims(layer: str, axis: Any, batch_dims: Any, ndim: int) -> int:
    """How many trailing dims ``axis`` contracts; raises unless they are x's last ones."""
    if _tuple(batch_dims):
        raise ValueError(f"{layer}: batch_dims={batch_dims!r} is not supported (the tensor-"
                         "parallel layers contract the trailing dims of a batch-first input); "
                         "use batch_dims=().")
    dims = sorted(a % ndim for a in _tuple(axis))
    if dims != list(range(ndim - len(dims), ndim)) or len(dims) >= ndim:
        raise ValueError(f"{layer}: axis={axis!r} must name the trailing dims of the inputs "
                         f"(e.g. -1 or (-2, -1)), with a sequence dim before them; inputs have "
                         f"rank {ndim}.")
    return len(dims)


class _ParallelDenseGeneral(_ParallelLinear):
    """``nn.DenseGeneral``'s fields and call, shared by the column and row variants."""

    features: int | Sequence[int]
    axis: int | Sequence[int] = -1
    batch_dims: Sequence[int] = ()
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = default_bias_init
    precision: PrecisionLike = None
    promote_dtype: Callable[..., Any] = promote_dtype
    dot_general: Callable[..., Any] | None = None
    dot_general_cls: Any = None
    axis_name: str = "tp"
    sequence_parallel: bool = True
    impl: str = "auto"
    mesh: jax.sharding.Mesh | None = None

    _flax_name = "DenseGeneral"

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Applies the layer: ``[..., S, *contracted]`` -> ``[..., S, *features]``."""
        layer = type(self).__name__
        _common.check_input(layer, inputs)
        n_contract = _contracted_dims(layer, self.axis, self.batch_dims, inputs.ndim)
        return self._general(inputs, _tuple(self.features), n_contract)


class ColumnParallelDenseGeneral(_ParallelDenseGeneral):
    """A ``nn.DenseGeneral`` whose first output feature dim is split over ``axis_name``.

    ``features=(heads, head_dim)`` gives the attention projections: kernel
    ``[..in, heads, head_dim]`` split on ``heads``. ``axis`` names the trailing
    input dims contracted (default: the last); the dim before them is the
    sequence dim. Otherwise as :class:`ColumnParallelDense`.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from jaxoverlap.flax.linen import ColumnParallelDenseGeneral
      >>> mesh = jax.make_mesh((4,), ("tp",))
      >>> qkv = ColumnParallelDenseGeneral(features=(8, 2), mesh=mesh)
      >>> x = jnp.ones((2, 8, 16))
      >>> variables = qkv.init(jax.random.key(0), x)
      >>> variables["params"]["kernel"].shape           # a plain array, as Flax's
      (16, 8, 2)
      >>> jax.jit(qkv.apply)(variables, x).shape
      (2, 8, 8, 2)

    Attributes:
      features: int or tuple of the output features; ``features[0]`` is split
        over ``axis_name`` (divisible by its size).
      axis: int or tuple of the trailing input dims to contract (default: -1).
      batch_dims: must be () (kept for ``nn.DenseGeneral``'s signature).
      use_bias, dtype, param_dtype, precision, kernel_init, bias_init,
      promote_dtype, dot_general, dot_general_cls, axis_name, impl, mesh: as in
        :class:`ColumnParallelDense`.
      sequence_parallel: as in :class:`ColumnParallelDense`.
    """


    _kind = COLUMN


class RowParallelDenseGeneral(_ParallelDenseGeneral):
    """A ``nn.DenseGeneral`` whose first contracted input dim is split over ``axis_name``.

    ``axis=(-2, -1)`` on ``[..., S, heads, head_dim]`` inputs split on ``heads``
    gives the attention output projection. Otherwise as :class:`RowParallelDense`.

    Attributes:
      features: int or tuple of the output features.
      axis: int or tuple of the trailing input dims to contract; the first one
        is split over ``axis_name`` (default: -1).
      batch_dims: must be () (kept for ``nn.DenseGeneral``'s signature).
      use_bias, dtype, param_dtype, precision, kernel_init, bias_init,
      promote_dtype, dot_general, dot_general_cls, axis_name, impl, mesh: as in
        :class:`ColumnParallelDense`.
      sequence_parallel: as in :class:`RowParallelDense`.
    """


    _kind = ROW


class ParallelMLP(nn.Module):
    """The Megatron MLP: column-parallel up-projection, activation, row-parallel down-projection.

    Maps ``[..., S, H]`` to ``[..., S, out_features or H]`` through ``features``
    hidden units split over ``axis_name``; the hidden activations never leave
    their shard. The sub-layers are named ``up`` and ``down`` (``nnx.ParallelMLP``
    uses the same names, so parameters copy between the two APIs).

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from jaxoverlap.flax.linen import ParallelMLP
      >>> mesh = jax.make_mesh((4,), ("tp",))
      >>> mlp = ParallelMLP(features=32, mesh=mesh)
      >>> x = jnp.ones((2, 8, 4))
      >>> variables = mlp.init(jax.random.key(0), x)
      >>> jax.tree.map(jnp.shape, variables)["params"]["up"]
      {'bias': (32,), 'kernel': (4, 32)}
      >>> jax.jit(mlp.apply)(variables, x).shape
      (2, 8, 4)

    Attributes:
      features: the hidden (feed-forward) width, divisible by the size of
        ``axis_name``.
      out_features: the output width (default: None, the input's width).
      activation: applied between the two layers (default: ``nn.gelu``).
      use_bias, dtype, param_dtype, precision, kernel_init, bias_init,
      promote_dtype, dot_general, dot_general_cls, axis_name,
      sequence_parallel, impl, mesh: as in ``ColumnParallelDense``, for both
        layers.
    """

    features: int
    out_features: int | None = None
    activation: Callable[[jax.Array], jax.Array] = nn.gelu
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: PrecisionLike = None
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = default_bias_init
    promote_dtype: Callable[..., Any] = promote_dtype
    dot_general: Callable[..., Any] | None = None
    dot_general_cls: Any = None
    axis_name: str = "tp"
    sequence_parallel: bool = True
    impl: str = "auto"
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Applies the MLP.

        Args:
          inputs: ``[..., S, H]``, laid out as for ``ColumnParallelDense``.

        Returns:
          ``[..., S, out_features or H]``, laid out as for ``RowParallelDense``.
        """
        if not callable(self.activation):
            raise TypeError(f"ParallelMLP: activation={self.activation!r} must be callable.")
        _common.check_input("ParallelMLP", inputs)
        out = self.out_features if self.out_features is not None else jnp.shape(inputs)[-1]
        _common.check_features("ParallelMLP", "out_features", out)
        shared: dict[str, Any] = dict(
            use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
            precision=self.precision, kernel_init=self.kernel_init, bias_init=self.bias_init,
            promote_dtype=self.promote_dtype, dot_general=self.dot_general,
            dot_general_cls=self.dot_general_cls, axis_name=self.axis_name,
            sequence_parallel=self.sequence_parallel, impl=self.impl, mesh=self.mesh,
        )
        h = ColumnParallelDense(self.features, name="up", **shared)(inputs)
        return RowParallelDense(out, name="down", **shared)(self.activation(h))


class _Projection(nn.Module):
    """The parameters of one column-parallel projection, made as
    :class:`ColumnParallelDenseGeneral` makes them, for a fused multiply."""

    features: tuple[int, ...]
    use_bias: bool
    param_dtype: Dtype
    kernel_init: Initializer
    bias_init: Initializer
    axis_name: str
    mesh: Any
    layer: str

    @nn.compact
    def __call__(self, in_features: int):
        features = self.features
        n = _common.tp_size_if_bound(self.axis_name)
        if n is not None:
            features = (_common.divide(self.layer, "num_heads", features[0], n,
                                       self.axis_name), *features[1:])
        kernel = _param(self, self.layer, COLUMN, "kernel", self.kernel_init,
                        (in_features, *features), 1, 1, self.mesh, self.axis_name)
        bias = _param(self, self.layer, COLUMN, "bias", self.bias_init, features, 0, 0,
                      self.mesh, self.axis_name) if self.use_bias else None
        return kernel, bias


class ParallelMultiHeadDotProductAttention(_NamedLikeFlax, nn.Module):
    """A ``nn.MultiHeadDotProductAttention`` whose heads are split over ``axis_name``.

    Same fields (then ``axis_name``, ``sequence_parallel``, ``impl``, ``mesh``),
    same call, same parameters (``query``, ``key``, ``value``: kernels
    ``[features, heads, head_dim]``; ``out``: ``[heads, head_dim, features]``)
    with their global shapes and initial values. Megatron's layout: each device
    holds ``num_heads / N`` heads.

    * The query, key and value projections of one input are one column-parallel
      multiply (self-attention: one ``ag_matmul`` for all three; its backward
      one GEMM+reduce-scatter); the output projection is row-parallel
      (``matmul_rs``). With ``sequence_parallel=False`` they are Megatron's f/g.
    * ``attention_fn`` runs per head on each device's heads; masks broadcast
      over heads as in Flax, and dropout draws the same bits as the unsplit
      layer on global arrays (threefry is partitionable).
    * ``qkv_dot_general`` / ``out_dot_general`` (or their ``_cls``) run the
      projections unfused with the user's function, as the dense layers do.
    * ``decode=True``: Flax's autoregressive cache, in the ``cache`` collection
      with Flax's names (``cached_key``, ``cached_value``: ``[batch..., length,
      heads, head_dim]`` global, split on the heads so each device holds its
      own; ``cache_index``). ``init`` makes it from the inputs' shape; each
      later call is one decode step of one token, computed without sequence
      parallelism (replicated token, GEMM + all-reduce), with Flax's mask of
      the positions written. Inside ``shard_map`` the cache holds the device's
      heads and a step takes and returns the replicated token.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from jaxoverlap.flax.linen import ParallelMultiHeadDotProductAttention
      >>> mesh = jax.make_mesh((4,), ("tp",))
      >>> attn = ParallelMultiHeadDotProductAttention(num_heads=8, qkv_features=16, mesh=mesh)
      >>> x = jnp.ones((2, 8, 16))
      >>> variables = attn.init(jax.random.key(0), x)
      >>> variables["params"]["query"]["kernel"].shape
      (16, 8, 2)
      >>> jax.jit(attn.apply)(variables, x).shape
      (2, 8, 16)

    Attributes:
      num_heads, dtype, param_dtype, qkv_features, out_features,
      broadcast_dropout, dropout_rate, deterministic, precision, kernel_init,
      out_kernel_init, bias_init, out_bias_init, use_bias, attention_fn, decode,
      normalize_qk, force_fp32_for_softmax, qkv_dot_general, out_dot_general,
      qkv_dot_general_cls, out_dot_general_cls, qk_attn_weights_einsum_cls,
      attn_weights_value_einsum_cls: as in ``nn.MultiHeadDotProductAttention``
        (``num_heads`` divisible by the size of ``axis_name``).
      axis_name, sequence_parallel, impl, mesh: as in ``ColumnParallelDense``.
    """

    num_heads: int
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    qkv_features: int | None = None
    out_features: int | None = None
    broadcast_dropout: bool = True
    dropout_rate: float = 0.0
    deterministic: bool | None = None
    precision: PrecisionLike = None
    kernel_init: Initializer = default_kernel_init
    out_kernel_init: Initializer | None = None
    bias_init: Initializer = default_bias_init
    out_bias_init: Initializer | None = None
    use_bias: bool = True
    attention_fn: Callable[..., jax.Array] = nn.dot_product_attention
    decode: bool = False
    normalize_qk: bool = False
    force_fp32_for_softmax: bool = False
    qkv_dot_general: Callable[..., Any] | None = None
    out_dot_general: Callable[..., Any] | None = None
    qkv_dot_general_cls: Any = None
    out_dot_general_cls: Any = None
    qk_attn_weights_einsum_cls: Callable[..., Callable[..., jax.Array]] | None = None
    attn_weights_value_einsum_cls: Callable[..., Callable[..., jax.Array]] | None = None
    axis_name: str = "tp"
    sequence_parallel: bool = True
    impl: str = "auto"
    mesh: jax.sharding.Mesh | None = None

    _flax_name = "MultiHeadDotProductAttention"

    @nn.compact
    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        inputs_kv: jax.Array | None = None,
        mask: jax.Array | None = None,
        deterministic: bool | None = None,
        dropout_rng: jax.Array | None = None,
        sow_weights: bool = False,
    ) -> jax.Array:
        """Applies multi-head dot-product attention, as ``nn.MultiHeadDotProductAttention``.

        Args:
          inputs_q: ``[batch..., length, features]`` queries (global, or the local
            shard inside ``shard_map``; sharded on length with sequence parallelism).
          inputs_k, inputs_v, inputs_kv: keys and values (default: ``inputs_q``).
          mask: ``[batch..., num_heads or 1, q_length, kv_length]``; False masks out.
          deterministic: disables dropout when True.
          dropout_rng: the dropout key (default: ``self.make_rng('dropout')``).
          sow_weights: sow the attention weights into ``intermediates``.

        Returns:
          ``[batch..., length, out_features]``, laid out as ``RowParallelDense``'s output.
        """
        layer = type(self).__name__
        # With decode=True the first call (init) makes the cache; each later one is a step.
        step = self.decode and self.has_variable("cache", "cached_key")
        if step:
            _common.check_decode_step(layer, inputs_q)
        if inputs_kv is not None:
            if inputs_k is not None or inputs_v is not None:
                raise ValueError(f"{layer}: give either inputs_kv or inputs_k/inputs_v.")
            inputs_k = inputs_v = inputs_kv
            warnings.warn("The inputs_kv arg will be deprecated soon. Use inputs_k and "
                          "inputs_v instead.", DeprecationWarning, stacklevel=2)
        else:
            if inputs_k is None:
                if inputs_v is not None:
                    raise ValueError(f"{layer}: inputs_k cannot be None if inputs_v is not "
                                     "None.")
                inputs_k = inputs_q
            if inputs_v is None:
                inputs_v = inputs_k
        _common.check_input(layer, inputs_q)
        _common.check_features(layer, "num_heads", self.num_heads)
        features = self.out_features or inputs_q.shape[-1]
        qkv_features = self.qkv_features or inputs_q.shape[-1]
        if qkv_features % self.num_heads:
            raise ValueError(f"{layer}: qkv_features={qkv_features} must be divisible by "
                             f"num_heads={self.num_heads}.")
        head_dim = qkv_features // self.num_heads
        n = _common.tp_size_if_bound(self.axis_name) or _common.known_tp_size(self.axis_name,
                                                                              self.mesh)
        if n is not None:
            _common.divide(layer, "num_heads", self.num_heads, n, self.axis_name)
        sequence_parallel = self.sequence_parallel
        if step and sequence_parallel:     # one token cannot be split over the ranks
            _common.say_once(layer, _common.DECODE_STEP_SAYS, logging.DEBUG)
            sequence_parallel = False
        shared = dict(dtype=self.dtype, param_dtype=self.param_dtype, use_bias=self.use_bias,
                      precision=self.precision, axis_name=self.axis_name,
                      sequence_parallel=sequence_parallel, impl=self.impl, mesh=self.mesh)
        inputs = (inputs_q, inputs_k, inputs_v)
        names = ("query", "key", "value")
        if self.qkv_dot_general is not None or self.qkv_dot_general_cls is not None:
            dense = functools.partial(
                ColumnParallelDenseGeneral, features=(self.num_heads, head_dim), axis=-1,
                kernel_init=self.kernel_init, bias_init=self.bias_init,
                dot_general=self.qkv_dot_general, dot_general_cls=self.qkv_dot_general_cls,
                **shared)
            query, key, value = (dense(name=n)(x) for n, x in zip(names, inputs, strict=True))
        else:
            query, key, value = self._fused_qkv(layer, inputs, names, head_dim,
                                                sequence_parallel)
        if self.normalize_qk:
            query = nn.LayerNorm(name="query_ln", use_bias=False, dtype=self.dtype,
                                 param_dtype=self.param_dtype)(query)
            key = nn.LayerNorm(name="key_ln", use_bias=False, dtype=self.dtype,
                               param_dtype=self.param_dtype)(key)
        if self.decode:
            query, key, value, mask = self._cache(layer, step, query, key, value, mask)
        if self.dropout_rate > 0.0:
            m_deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
            if not m_deterministic and dropout_rng is None:
                dropout_rng = self.make_rng("dropout")
        else:
            m_deterministic = True
        if dropout_rng is not None and _common.tp_size_if_bound(self.axis_name) is not None:
            # On local shards each device holds other heads: give them other bits.
            dropout_rng = jax.random.fold_in(dropout_rng, jax.lax.axis_index(self.axis_name))
        attn_kwargs = dict(
            mask=mask, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
            broadcast_dropout=self.broadcast_dropout, deterministic=m_deterministic,
            dtype=self.dtype, precision=self.precision,
            force_fp32_for_softmax=self.force_fp32_for_softmax,
            qk_attn_weights_einsum=(self.qk_attn_weights_einsum_cls()
                                    if self.qk_attn_weights_einsum_cls else None),
            attn_weights_value_einsum=(self.attn_weights_value_einsum_cls()
                                       if self.attn_weights_value_einsum_cls else None),
        )
        accepted = inspect.signature(self.attention_fn).parameters
        attn_kwargs = {k: v for k, v in attn_kwargs.items() if k in accepted}
        if sow_weights:
            attn_kwargs["module"] = self
        x = self.attention_fn(query, key, value, **attn_kwargs)
        return RowParallelDenseGeneral(
            features=features, axis=(-2, -1), kernel_init=self.out_kernel_init or self.kernel_init,
            bias_init=self.out_bias_init or self.bias_init, dot_general=self.out_dot_general,
            dot_general_cls=self.out_dot_general_cls, name="out", **shared)(x)

    def _cache(self, layer: str, step: bool, query, key, value, mask):
        """Flax's autoregressive cache in the ``cache`` collection: ``cached_key`` and
        ``cached_value`` ``[batch..., length, heads, head_dim]`` (global, split on the heads
        over ``axis_name``; inside shard_map this device's heads) and ``cache_index``.

        Made, as zeros of the keys' shape and layout, by the first call (``init``); each
        later call writes its token at ``cache_index`` and attends to the positions written.
        """
        cached_key = self.variable("cache", "cached_key", _common.new_cache, key,
                                   self.axis_name, self.mesh)
        cached_value = self.variable("cache", "cached_value", _common.new_cache, value,
                                     self.axis_name, self.mesh)
        cache_index = self.variable("cache", "cache_index",
                                    lambda: jnp.array(0, dtype=jnp.int32))
        if not step:
            return query, key, value, mask
        query, key, value, cache_index.value, mask = _common.decode_step(
            layer, cached_key.value, cached_value.value, cache_index.value, query, key, value,
            mask, nn.combine_masks, axis_name=self.axis_name, mesh=self.mesh,
            heads_of="query", where="Make the cache with init(..., decode=True) on inputs of "
            "the batch and length you decode, with this layer's num_heads and qkv_features.")
        cached_key.value, cached_value.value = key, value
        return query, key, value, mask

    def _fused_qkv(self, layer: str, inputs: tuple, names: tuple[str, ...], head_dim: int,
                   sequence_parallel: bool):
        """The three projections, one multiply per distinct input (self-attention: one)."""
        projections = {
            name: _Projection((self.num_heads, head_dim), self.use_bias, self.param_dtype,
                              self.kernel_init, self.bias_init, self.axis_name, self.mesh,
                              layer, name=name)(x.shape[-1])
            for name, x in zip(names, inputs, strict=True)}
        groups: list[tuple[Any, list[str]]] = []      # inputs by identity, in order
        for name, x in zip(names, inputs, strict=True):
            for group_x, members in groups:
                if group_x is x:
                    members.append(name)
                    break
            else:
                groups.append((x, [name]))
        m = _common.Matmul(layer=layer, kind=COLUMN, axis_name=self.axis_name,
                           sequence_parallel=sequence_parallel, impl=self.impl,
                           precision=self.precision, mesh=self.mesh)
        out: dict[str, jax.Array] = {}
        for x, members in groups:
            kernels, biases = [], []
            for name in members:
                kernel, bias = projections[name]
                x, kernel, bias = promote_dtype(x, kernel, bias, dtype=self.dtype)
                kernels.append(kernel)
                biases.append(bias)
            out.update(zip(members, _common.fused_columns(m, x, kernels, biases), strict=True))
        return tuple(out[n] for n in names)
