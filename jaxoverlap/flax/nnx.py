"""Tensor-parallel Flax NNX layers: drop-in replacements for ``nnx.Linear``.

``ColumnParallelLinear(in_features, out_features, *, rngs, ...)`` and
``RowParallelLinear`` take ``nnx.Linear``'s arguments and hold ``kernel`` and
``bias`` ``nnx.Param``s of ``nnx.Linear``'s *global* shapes, so the state of an
unparallel model loads unchanged. The params carry ``out_sharding`` metadata,
so ``nnx.get_partition_spec`` gives column kernel ``(None, axis_name)``, column
bias ``(axis_name,)``, row kernel ``(axis_name, None)`` and a replicated row
bias; built under a mesh (``mesh=`` or ``jax.set_mesh``) the params are placed
that way at once (Flax's eager sharding). Without a mesh they are built
unplaced, with the metadata kept.

Semantics are those of ``jaxoverlap.flax.linen`` (see there): batch-first
``[..., S, features]`` inputs; ``sequence_parallel=True`` gives all-gather +
GEMM / GEMM + reduce-scatter, ``False`` Megatron's f/g pair. Global arrays under
``jit`` with a mesh, or local shards inside the user's ``jax.shard_map`` (then
the state holds local shards, e.g. ``nnx.split`` the model and give the state
to ``shard_map`` with ``in_specs=nnx.get_partition_spec(state)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from flax.typing import Dtype, Initializer, PrecisionLike

from jaxoverlap.flax import _common
from jaxoverlap.flax._common import COLUMN, ROW

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()

__all__ = ["ColumnParallelLinear", "ParallelMLP", "RowParallelLinear"]


class _ParallelLinear(nnx.Module):
    """Shared constructor and call of the two nnx layers."""

    _kind = COLUMN

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
        promote_dtype: Callable[..., Any] = nnx_dtypes.promote_dtype,
        axis_name: str = "tp",
        sequence_parallel: bool = True,
        impl: str = "auto",
        mesh: jax.sharding.Mesh | None = None,
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        layer = type(self).__name__
        _common.check_features(layer, "in_features", in_features)
        _common.check_features(layer, "out_features", out_features)
        _common.check_common(layer, axis_name=axis_name, sequence_parallel=sequence_parallel,
                             impl=impl, use_bias=use_bias, kernel_init=kernel_init,
                             bias_init=bias_init, mesh=mesh)
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"{layer}: rngs={rngs!r} must be an nnx.Rngs.")
        n = _common.known_tp_size(axis_name, mesh)
        known = n is not None
        if known:  # fail at construction when the mesh is already known
            if self._kind == COLUMN:
                _common.divide(layer, "out_features", out_features, n, axis_name)
            else:
                _common.divide(layer, "in_features", in_features, n, axis_name)

        def metadata(param: str, user: Mapping[str, Any]) -> dict[str, Any]:
            names = _common.partition_names(self._kind, axis_name, param)
            given = dict(user)
            for key in ("out_sharding", "sharding_names", "sharding"):
                if key in given and tuple(given[key]) != (names or ()):
                    raise ValueError(
                        f"{layer}: {param}_metadata[{key!r}]={given[key]!r} disagrees with the "
                        f"layout a {self._kind}-parallel layer over {axis_name!r} needs: {names}."
                    )
                given.pop(key, None)
            if names is None:
                return given
            given["out_sharding"] = names
            if mesh is not None:
                given["mesh"] = mesh
            # Eager placement needs a mesh with the axis, outside shard_map.
            if not known or _common.tp_size_if_bound(axis_name) is not None:
                given["eager_sharding"] = False
            return given

        self.kernel = nnx.Param(
            kernel_init(rngs.params(), (in_features, out_features), param_dtype),
            **metadata("kernel", kernel_metadata),
        )
        self.bias: nnx.Param | None
        if use_bias:
            self.bias = nnx.Param(
                bias_init(rngs.params(), (out_features,), param_dtype),
                **metadata("bias", bias_metadata),
            )
        else:
            self.bias = nnx.data(None)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.promote_dtype = promote_dtype
        self.axis_name = axis_name
        self.sequence_parallel = sequence_parallel
        self.impl = impl
        self.mesh = mesh

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Applies the layer to ``inputs``.

        Args:
          inputs: ``[..., S, in_features]`` (global, or the local shard inside
            ``shard_map``; the sequence dim is the second to last).

        Returns:
          ``[..., S, out_features]``, laid out as the class docstring says.
        """
        layer = type(self).__name__
        _common.check_input(layer, inputs)
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        n = _common.tp_size_if_bound(self.axis_name)
        in_f, out_f = self.in_features, self.out_features
        if n is not None:  # inside shard_map the state holds local shards
            if self._kind == COLUMN:
                out_f = _common.divide(layer, "out_features", out_f, n, self.axis_name)
            else:
                in_f = _common.divide(layer, "in_features", in_f, n, self.axis_name)
            if tuple(kernel.shape) != (in_f, out_f):
                raise ValueError(
                    f"{layer}: inside shard_map over {self.axis_name!r} the kernel must be the "
                    f"local shard of shape {(in_f, out_f)}, got {tuple(kernel.shape)}. Pass the "
                    "state with in_specs=nnx.get_partition_spec(state)."
                )
        if inputs.shape[-1] != in_f:
            raise ValueError(
                f"{layer}: inputs.shape[-1]={inputs.shape[-1]} but the layer expects {in_f} "
                f"input features (in_features={self.in_features}"
                + (f", split over {n} ranks" if n is not None and in_f != self.in_features
                   else "") + ")."
            )
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        return _common.forward(layer, self._kind, inputs, kernel, bias,
                               axis_name=self.axis_name,
                               sequence_parallel=self.sequence_parallel, impl=self.impl,
                               precision=self.precision, mesh=self.mesh)


class ColumnParallelLinear(_ParallelLinear):
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
      >>> nnx.get_partition_spec(nnx.state(layer))["kernel"].get_value() == P(None, "tp")
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
      kernel_init: initializer function for the weight matrix.
      bias_init: initializer function for the bias.
      promote_dtype: function to promote the dtype of the arrays to the desired
        dtype; takes a tuple ``(inputs, kernel, bias)`` and a ``dtype`` keyword.
      axis_name: the tensor-parallel mesh axis (default: "tp").
      sequence_parallel: inputs sharded on the sequence dim (all-gather + GEMM)
        if True, replicated (Megatron f) if False (default: True).
      impl: "auto", "xla", "ring" or "native", passed to the op (default: "auto").
      mesh: the mesh for global arrays and for placing the params; None takes
        the ``jax.set_mesh`` mesh or the inputs' sharding (default: None).
      rngs: rng key.
      kernel_metadata: extra metadata for the kernel ``nnx.Param``.
      bias_metadata: extra metadata for the bias ``nnx.Param``.
    """

    _kind = COLUMN


class RowParallelLinear(_ParallelLinear):
    """An ``nnx.Linear`` whose input features are split over ``axis_name``.

    With ``sequence_parallel=True``: ``[..., S, F]`` sharded on F -> GEMM
    overlapped with a reduce-scatter -> ``[..., S, out_features]`` sharded on S.
    With ``False``: the partial products are all-reduced (Megatron g) and the
    output is replicated. The bias is replicated and added after the reduction.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxoverlap.flax.nnx import RowParallelLinear
      >>> layer = RowParallelLinear(16, 4, rngs=nnx.Rngs(0))   # no mesh yet: unplaced
      >>> from jax.sharding import PartitionSpec as P
      >>> nnx.get_partition_spec(nnx.state(layer))["kernel"].get_value() == P("tp", None)
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
      promote_dtype, axis_name, impl, mesh, rngs, kernel_metadata, bias_metadata:
        as in ``ColumnParallelLinear``.
      sequence_parallel: output sharded on the sequence dim (GEMM +
        reduce-scatter) if True, replicated (Megatron g) if False (default: True).
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
      promote_dtype, axis_name, sequence_parallel, impl, mesh, rngs: as in
        ``ColumnParallelLinear``, for both layers.
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
        axis_name: str = "tp",
        sequence_parallel: bool = True,
        impl: str = "auto",
        mesh: jax.sharding.Mesh | None = None,
        rngs: nnx.Rngs,
    ):
        if not callable(activation):
            raise TypeError(f"ParallelMLP: activation={activation!r} must be callable.")
        out_features = in_features if out_features is None else out_features
        shared: dict[str, Any] = dict(
            use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, precision=precision,
            kernel_init=kernel_init, bias_init=bias_init, promote_dtype=promote_dtype,
            axis_name=axis_name, sequence_parallel=sequence_parallel, impl=impl, mesh=mesh,
            rngs=rngs,
        )
        self.up = ColumnParallelLinear(in_features, hidden_features, **shared)
        self.down = RowParallelLinear(hidden_features, out_features, **shared)
        self.activation = activation

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Applies the MLP.

        Args:
          inputs: ``[..., S, in_features]``, laid out as for ``ColumnParallelLinear``.

        Returns:
          ``[..., S, out_features]``, laid out as for ``RowParallelLinear``.
        """
        return self.down(self.activation(self.up(inputs)))
