"""Flax layers on the collective matmuls: ``jaxoverlap.flax.linen`` and ``jaxoverlap.flax.nnx``.

Import the API you use; each imports only its own part of Flax::

    from jaxoverlap.flax.linen import (
        ColumnParallelDense, RowParallelDense, ColumnParallelDenseGeneral,
        RowParallelDenseGeneral, ParallelMultiHeadDotProductAttention, ParallelMLP)
    from jaxoverlap.flax.nnx import (
        ColumnParallelLinear, RowParallelLinear, ColumnParallelLinearGeneral,
        RowParallelLinearGeneral, ParallelMultiHeadAttention, ParallelMLP)

Given Flax's FP8 recipe (linen ``dot_general_cls=nn.Fp8DotGeneralOp``; nnx
``jaxoverlap.flax.nnx.Fp8DotGeneral``) the layers run it fused (``jaxoverlap.fp8``).
"""

from jaxoverlap import _optional

if _optional.missing("flax"):
    raise ModuleNotFoundError(
        f"jaxoverlap.flax needs Flax: {_optional.install_hint(['flax'], 'flax')}", name="flax")
