"""Flax layers on the collective matmuls: ``jaxoverlap.flax.linen`` and ``jaxoverlap.flax.nnx``.

Import the API you use; each imports only its own part of Flax::

    from jaxoverlap.flax.linen import (
        ColumnParallelDense, RowParallelDense, ColumnParallelDenseGeneral,
        RowParallelDenseGeneral, ParallelMultiHeadDotProductAttention, ParallelMLP)
    from jaxoverlap.flax.nnx import (
        ColumnParallelLinear, RowParallelLinear, ColumnParallelLinearGeneral,
        RowParallelLinearGeneral, ParallelMultiHeadAttention, ParallelMLP)
"""

from jaxoverlap import _optional

if _optional.missing("flax"):
    raise ModuleNotFoundError(
        f"jaxoverlap.flax needs Flax: {_optional.install_hint(['flax'], 'flax')}", name="flax")
