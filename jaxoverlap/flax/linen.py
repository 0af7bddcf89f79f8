"""Tensor-parallel Flax linen layers: drop-in replacements for ``nn.Dense``.

``ColumnParallelDense`` and ``RowParallelDense`` have ``nn.Dense``'s fields,
parameter names (``kernel``, ``bias``) and *global* parameter shapes, so a
checkpoint of the unparallel model loads unchanged. Their kernels and biases
carry ``nn.with_partitioning`` metadata, so ``nn.get_partition_spec`` gives the
layout a ``jit`` with a mesh needs:

=================  ======================  ==================
layer              kernel                  bias
=================  ======================  ==================
column-parallel    ``(None, axis_name)``   ``(axis_name,)``
row-parallel       ``(axis_name, None)``   replicated ``()``
=================  ======================  ==================

Inputs are batch-first, ``[..., S, features]``; the sequence dim is the second
to last. With ``sequence_parallel=True`` the column layer is an all-gather +
GEMM (``jaxoverlap.ag_matmul``: ``[B, S, H]`` sharded on S to ``[B, S, F]``
sharded on F) and the row layer a GEMM + reduce-scatter
(``jaxoverlap.matmul_rs``: back to ``[B, S, H]`` sharded on S). With
``sequence_parallel=False`` they are Megatron's f/g pair: the column layer
takes a replicated input (its gradient is all-reduced), the row layer
all-reduces its output.

The layers work on global arrays under ``jax.jit`` (with a mesh from ``mesh=``,
``jax.set_mesh`` or the inputs' sharding) and on local shards inside the user's
own ``jax.shard_map`` over ``axis_name``; there the parameters are the local
shards (``kernel`` of a column layer is ``[in, features / N]``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta
from flax.linen.dtypes import promote_dtype
from flax.typing import Dtype, Initializer, PrecisionLike

from jaxoverlap.flax import _common
from jaxoverlap.flax._common import COLUMN, ROW

default_kernel_init = nn.initializers.lecun_normal()
default_bias_init = nn.initializers.zeros_init()

__all__ = ["ColumnParallelDense", "ParallelMLP", "RowParallelDense"]


class _ParallelDense(nn.Module):
    """Shared fields and the parameter handling of the two linen layers."""

    features: int
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: PrecisionLike = None
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = default_bias_init
    axis_name: str = "tp"
    sequence_parallel: bool = True
    impl: str = "auto"
    mesh: jax.sharding.Mesh | None = None

    _kind = COLUMN

    def _param(self, name: str, init: Callable, shape: tuple[int, ...]) -> jax.Array:
        """Creates or fetches ``name``; checks that any stored layout is the one the op needs."""
        layer = type(self).__name__
        names = _common.partition_names(self._kind, self.axis_name, name)
        init_fn = _common.placed_init(init, names, self.axis_name, self.mesh)
        if names is not None:
            # No mesh in the box: flax would then constrain every nn.unbox to
            # it, which fails under Explicit axes; placement is done above.
            init_fn = nn.with_partitioning(init_fn, names)
        # Unboxed by hand: flax's own unboxing adds a sharding constraint, which
        # is an assertion under Explicit mesh axes and invalid inside shard_map;
        # the layer's shard_map lays the parameters out itself.
        value = self.param(name, init_fn, shape, self.param_dtype, unbox=False)
        if isinstance(value, meta.Partitioned):
            expected = tuple(names) if names is not None else (None,) * len(shape)
            if tuple(value.names) != expected:
                raise ValueError(
                    f"{layer}: parameter {name!r} carries partitioning {tuple(value.names)} but "
                    f"a {self._kind}-parallel layer over {self.axis_name!r} needs {expected}."
                )
            value = value.unbox(apply_constraint=False)
        elif isinstance(value, meta.AxisMetadata):
            value = value.unbox()
        return value

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Applies the layer to ``inputs``.

        Args:
          inputs: ``[..., S, in_features]`` (global, or the local shard inside
            ``shard_map``; the sequence dim is the second to last).

        Returns:
          The transformed input, ``[..., S, features]``, laid out as the class
          docstring says.
        """
        layer = type(self).__name__
        _common.check_features(layer, "features", self.features)
        _common.check_common(layer, axis_name=self.axis_name,
                             sequence_parallel=self.sequence_parallel, impl=self.impl,
                             use_bias=self.use_bias, kernel_init=self.kernel_init,
                             bias_init=self.bias_init, mesh=self.mesh)
        _common.check_input(layer, inputs)
        n = _common.tp_size_if_bound(self.axis_name)
        in_features = jnp.shape(inputs)[-1]
        features = self.features
        if n is not None:  # inside shard_map: the parameters are local shards
            if self._kind == COLUMN:
                features = _common.divide(layer, "features", self.features, n, self.axis_name)
        elif (known := _common.known_tp_size(self.axis_name, self.mesh)) is not None:
            # Checked before the parameters are created and laid out on the mesh.
            if self._kind == COLUMN:
                _common.divide(layer, "features", self.features, known, self.axis_name)
            else:
                _common.divide(layer, "inputs.shape[-1] (the input features)", in_features,
                               known, self.axis_name)
        kernel = self._param("kernel", self.kernel_init, (in_features, features))
        bias = self._param("bias", self.bias_init, (features if self._kind == COLUMN
                                                    else self.features,)) \
            if self.use_bias else None
        inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        return _common.forward(layer, self._kind, inputs, kernel, bias,
                               axis_name=self.axis_name,
                               sequence_parallel=self.sequence_parallel, impl=self.impl,
                               precision=self.precision, mesh=self.mesh)


class ColumnParallelDense(_ParallelDense):
    """A ``nn.Dense`` whose output features are split over ``axis_name``.

    With ``sequence_parallel=True``: ``[..., S, H]`` sharded on S -> all-gather
    overlapped with the GEMM -> ``[..., S, features]`` sharded on features.
    With ``False``: a replicated input (Megatron f) -> sharded features.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> import flax.linen as nn
      >>> from jaxoverlap.flax.linen import ColumnParallelDense
      >>> mesh = jax.make_mesh((4,), ("tp",))
      >>> layer = ColumnParallelDense(features=16, mesh=mesh)
      >>> x = jnp.ones((2, 8, 4))                       # [B, S, H]
      >>> variables = layer.init(jax.random.key(0), x)
      >>> jax.tree.map(jnp.shape, nn.unbox(variables))
      {'params': {'bias': (16,), 'kernel': (4, 16)}}
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
      kernel_init: initializer function for the weight matrix.
      bias_init: initializer function for the bias.
      axis_name: the tensor-parallel mesh axis (default: "tp").
      sequence_parallel: inputs sharded on the sequence dim (all-gather + GEMM)
        if True, replicated (Megatron f) if False (default: True).
      impl: "auto", "xla", "ring" or "native", passed to the op (default: "auto").
      mesh: the mesh for global arrays; None takes the ``jax.set_mesh`` mesh or
        the inputs' sharding (default: None).
    """

    _kind = COLUMN


class RowParallelDense(_ParallelDense):
    """A ``nn.Dense`` whose input features are split over ``axis_name``.

    With ``sequence_parallel=True``: ``[..., S, F]`` sharded on F -> GEMM
    overlapped with a reduce-scatter -> ``[..., S, features]`` sharded on S.
    With ``False``: the partial products are all-reduced (Megatron g) and the
    output is replicated. The bias is replicated and added once, after the
    reduction.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> import flax.linen as nn
      >>> from jaxoverlap.flax.linen import RowParallelDense
      >>> mesh = jax.make_mesh((4,), ("tp",))
      >>> layer = RowParallelDense(features=4, mesh=mesh)
      >>> h = jnp.ones((2, 8, 16))                      # [B, S, F]
      >>> variables = layer.init(jax.random.key(0), h)
      >>> jax.tree.map(jnp.shape, nn.unbox(variables))
      {'params': {'bias': (4,), 'kernel': (16, 4)}}
      >>> jax.jit(layer.apply)(variables, h).shape
      (2, 8, 4)

    Attributes:
      features: the number of output features.
      use_bias: whether to add a bias to the output (default: True).
      dtype: the dtype of the computation (default: infer from input and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      precision: numerical precision of the computation, see ``jax.lax.Precision``
        (for the fused ops it is applied as ``jax.default_matmul_precision``).
      kernel_init: initializer function for the weight matrix.
      bias_init: initializer function for the bias.
      axis_name: the tensor-parallel mesh axis (default: "tp").
      sequence_parallel: output sharded on the sequence dim (GEMM +
        reduce-scatter) if True, replicated (Megatron g) if False (default: True).
      impl: "auto", "xla", "ring" or "native", passed to the op (default: "auto").
      mesh: the mesh for global arrays; None takes the ``jax.set_mesh`` mesh or
        the inputs' sharding (default: None).
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
      >>> import flax.linen as nn
      >>> from jaxoverlap.flax.linen import ParallelMLP
      >>> mesh = jax.make_mesh((4,), ("tp",))
      >>> mlp = ParallelMLP(features=32, mesh=mesh)
      >>> x = jnp.ones((2, 8, 4))
      >>> variables = mlp.init(jax.random.key(0), x)
      >>> jax.tree.map(jnp.shape, nn.unbox(variables))["params"]["up"]
      {'bias': (32,), 'kernel': (4, 32)}
      >>> jax.jit(mlp.apply)(variables, x).shape
      (2, 8, 4)

    Attributes:
      features: the hidden (feed-forward) width, divisible by the size of
        ``axis_name``.
      out_features: the output width (default: None, the input's width).
      activation: applied between the two layers (default: ``nn.gelu``).
      use_bias, dtype, param_dtype, precision, kernel_init, bias_init,
      axis_name, sequence_parallel, impl, mesh: as in ``ColumnParallelDense``,
        for both layers.
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
            axis_name=self.axis_name, sequence_parallel=self.sequence_parallel, impl=self.impl,
            mesh=self.mesh,
        )
        h = ColumnParallelDense(self.features, name="up", **shared)(inputs)
        return RowParallelDense(out, name="down", **shared)(self.activation(h))
