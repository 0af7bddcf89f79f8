"""What the fused GEMM serves (docs/gpu-internals.md §5): its ops, transports, dtypes, row
alignment, and the kernel each GPU runs.

One home for the kernel's limits, read by the planning rule (``_plan``), the performance model
(``sim.fused``) and the selftest; the executors refuse the rest (``cpp/core/build.cc``, the CUDA
executor's prepare). Which ops, transports and dtypes it serves is a column of their tables
(``_kinds``, ``fused``).
"""

from dataclasses import dataclass

from jaxoverlap import _kinds

FUSED_OPS = _kinds.names(_kinds.OPS, fused=True)
# Never nccl: a persistent kernel holding every SM while an NCCL kernel waits for SMs can
# deadlock (docs/gpu-internals.md §5, rule 1).
FUSED_TRANSPORTS = _kinds.names(_kinds.TRANSPORTS, fused=True)
FUSED_DTYPES = _kinds.names(_kinds.DTYPES, fused=True)  # the kernel's instantiations
FUSED_ALIGN = 8  # elements: rows of whole 16-byte units (TMA loads and stores), 16-bit types


@dataclass(frozen=True)
class FusedKernel:
    """One build of the kernel: its image, the dtypes it is instantiated for, and its MMA tile in
    CTA tiles of 128 rows (2 on sm100: 2-SM MMA, two CTAs of a cluster computing a 256-row
    tile; the tile order is over MMA tiles, cpp/core/fused_tiles.h CtaTileAt)."""

    image: str
    dtypes: tuple[str, ...]
    mma_pair: int


# By compute capability (cpp/cuda/fused/fused_gemm.cc FusedKernelFor): arch-specific code runs
# on exactly its architecture, so 10.3 (B300) and 12.0 run neither.
FUSED_KERNELS: dict[tuple[int, int], FusedKernel] = {
    (9, 0): FusedKernel("sm_90a", FUSED_DTYPES, 1),
    (10, 0): FusedKernel("sm_100a", ("bfloat16",), 2),
}
