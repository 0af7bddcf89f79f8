"""What the fused GEMM serves (docs/gpu-internals.md §5): its ops, transports, dtypes and row
alignment.

One home for the kernel's limits, read by the planning rule (``_plan``), the performance model
(``sim.fused``) and the selftest; the executors refuse the rest (``cpp/core/build.cc``, the CUDA
executor's prepare). Which ops, transports and dtypes it serves is a column of their tables
(``_kinds``, ``fused``).
"""

from jaxoverlap import _kinds

FUSED_OPS = _kinds.names(_kinds.OPS, fused=True)
# Never nccl: a persistent kernel holding every SM while an NCCL kernel waits for SMs can
# deadlock (docs/gpu-internals.md §5, rule 1).
FUSED_TRANSPORTS = _kinds.names(_kinds.TRANSPORTS, fused=True)
FUSED_DTYPES = _kinds.names(_kinds.DTYPES, fused=True)  # the kernel's instantiations
FUSED_ALIGN = 8  # elements: rows of whole 16-byte units (TMA loads and stores), 16-bit types
