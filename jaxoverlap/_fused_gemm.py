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
FUSED_DTYPES = _kinds.names(_kinds.DTYPES, fused=True)  # 16-bit: x, w and y alike
# FP8: one instantiation per (x, w, y) triple (``_kinds.FUSED_FP8``), for every fused op: the
# all-gather's rows take their shard's scale, the GEMM + reduce-scatter's the rank's one.
FUSED_ALIGN = 8  # elements: rows of whole 16-byte units (TMA loads and stores), 16-bit types


@dataclass(frozen=True)
class FusedKernel:
    """One build of the kernel: its image, the dtypes it is instantiated for, its MMA tile in
    CTA tiles of 128 rows (2 on sm100: 2-SM MMA, two CTAs of a cluster computing a 256-row
    tile; the tile order is over MMA tiles, cpp/core/fused_tiles.h CtaTileAt), and the CTA tile
    (rows, columns of y) its persistent grid is made of, for 16-bit operands and for FP8 (None:
    no FP8 build). The tiles are ``fused_tiles.h`` ``CtaTileOf``'s (tests/native/
    test_fused_tiles.py holds them equal): they set the grid's waves, so how many SMs a fused
    GEMM + reduce-scatter leaves to its reduction (``SpareSms``)."""

    image: str
    dtypes: tuple[str, ...]  # x's (FP8: those of the ``_kinds.FUSED_FP8`` triples)
    mma_pair: int
    tile: tuple[int, int]
    fp8_tile: tuple[int, int] | None

    def tile_for(self, dtype) -> tuple[int, int] | None:
        """The CTA tile of x of ``dtype`` (None: not built for it)."""
        row = _kinds.dtype(dtype)
        if row.name not in self.dtypes:
            return None
        return self.fp8_tile if row.fp8 else self.tile


# By compute capability (cpp/cuda/fused/fused_gemm.cc FusedKernelFor): arch-specific code runs
# on exactly its architecture, so 10.3 (B300) and 12.0 run neither. The sm100 one is built for
# the 16-bit types only (no FP8).
_FP8_XS = tuple(dict.fromkeys(t.x for t in _kinds.FUSED_FP8))  # the FP8 kernels are sm90 only
# Tiles: sm_90a 128 x 256 x 64 (16-bit) and 128 x 128 x 128 (FP8, CUTLASS's promoting FP8
# mainloop); sm_100a 256 x 256 x 64 MMA tiles, each CTA of the pair a 128 x 256 half.
FUSED_KERNELS: dict[tuple[int, int], FusedKernel] = {
    (9, 0): FusedKernel("sm_90a", FUSED_DTYPES + _FP8_XS, 1, tile=(128, 256),
                        fp8_tile=(128, 128)),
    (10, 0): FusedKernel("sm_100a", FUSED_DTYPES, 2, tile=(128, 256), fp8_tile=None),
}


def fused_dtype_reason(op: str, x, w, y) -> str | None:
    """Why the fused GEMM has no instantiation for x, w and y of these dtypes in ``op`` (None
    if it has): ``cpp/core/build.cc``'s refusal."""
    x, w, y = (_kinds.dtype(d).name for d in (x, w, y))
    if not _kinds.fused_serves(x, w, y):
        return (f"the fused GEMM is compiled for {_kinds.fused_listing()}, not x {x} with w "
                f"{w} and y {y} (the chunked path runs them)")
    return None


def fused_align(dtype) -> int:
    """Elements of ``dtype`` in one 16-byte unit: the fused GEMM's rows (x's k, y's columns)
    are whole units (TMA)."""
    return 16 // _kinds.dtype(dtype).bytes
