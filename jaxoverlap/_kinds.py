"""The kinds of the package, one table each: the ops, the transports, the dtypes (and
``matmul_ar``'s algorithms).

Every list, tuple or dict of the package that names the members of a kind is made from these
rows; nothing else lists them. The executors have the same tables (``cpp/core/kinds.h``): the
columns both sides know (each class's ``native`` columns) are held equal by
``tests/test_kinds.py`` through ``_host.kinds()``. docs/native.md §8 says what else a new row
needs.

Plain data, importable without JAX or the extensions (the performance model reads it too). Row
order is id order: an id is the custom call's attribute value.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import ClassVar

# ---------------------------------------------------------------- ops


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where an op's global arrays are split over its mesh axis (``_layout``): x on its row dim
    ``axis`` (``"row"``), its last (contraction) dim (``"last"``) or not at all (None); w on
    dim 1 (its columns) or 0 (its rows); y likewise as x. An op that returns the gathered x
    returns it whole (not split)."""

    x: str | None
    w: int
    y: str | None


@dataclasses.dataclass(frozen=True)
class Op:
    """One op: an overlapped GEMM + collective.

    ``collective``: the collective it hides behind its GEMMs; ``communicates``: the dimension
    that travels — ``"k"``, x's rows (an all-gather of the input), or ``"n"``, partial sums of
    y's rows (a reduction of the output); ``rows``: how the canonical problem's rows come from
    x (docs/native.md §1) — ``"gather"`` (x holds one shard of the rows on ``axis``, y all N),
    ``"scatter"`` (x holds the N blocks, y one) or ``"all"`` (every dim of x but the last is a
    row, y has them all); ``fused``: the fused GEMM serves it; ``gathered``: it may also return
    the gathered x; ``one_shot``: the one-shot algorithm applies. Python only: ``transpose``,
    the call (an op, or ``"matmul"``: Megatron's f) that computes this one's input gradient, and
    ``layout``, its global arrays' split.
    """

    native: ClassVar = ("id", "name", "collective", "communicates", "rows", "fused", "gathered",
                        "one_shot")
    id: int
    name: str
    collective: str
    communicates: str
    rows: str
    fused: bool
    gathered: bool
    one_shot: bool
    transpose: str
    layout: Layout


OPS: tuple[Op, ...] = (
    Op(0, "ag_matmul", "all_gather", "k", "gather", fused=True, gathered=True, one_shot=False,
       transpose="matmul_rs", layout=Layout(x="row", w=1, y="last")),
    Op(1, "matmul_rs", "reduce_scatter", "n", "scatter", fused=True, gathered=False,
       one_shot=False, transpose="ag_matmul", layout=Layout(x="last", w=0, y="row")),
    Op(2, "matmul_ar", "all_reduce", "n", "all", fused=False, gathered=False, one_shot=True,
       transpose="matmul", layout=Layout(x="last", w=0, y=None)),
)

@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One of matmul_ar's algorithms (docs/native.md §3). ``splits_rows``: x's rows split into
    N blocks (the two-shot ring's: rows divisible by N; else every rank has them all);
    ``kernel``: the all-reduce is one kernel launch whose flags and sequence numbers live on
    the device (docs/gpu-internals.md §7), so the call replays — over a transport with peer
    memory only (not ``"messages"``)."""

    native: ClassVar = ("id", "name", "splits_rows", "kernel")
    id: int
    name: str
    splits_rows: bool
    kernel: bool


# The first is the default where it applies.
ALGORITHMS: tuple[Algorithm, ...] = (
    Algorithm(0, "two_shot", splits_rows=True, kernel=False),
    Algorithm(1, "one_shot", splits_rows=False, kernel=False),
    Algorithm(2, "one_shot_kernel", splits_rows=False, kernel=True),
    Algorithm(3, "two_shot_kernel", splits_rows=False, kernel=True),
)
AR_ALGORITHMS: tuple[str, ...] = tuple(a.name for a in ALGORITHMS)

# ---------------------------------------------------------------- transports


@dataclasses.dataclass(frozen=True)
class GpuFacts:
    """What decides which transports a clique's GPUs in this process can serve, each a reason
    it cannot (None: it can), from the capability table (``_executors/capabilities``): peer
    access among them, and their (and the driver's) multicast support."""

    peer_access: str | None
    multicast: str | None


@dataclasses.dataclass(frozen=True)
class PresetKeys:
    """The performance model's numbers of a transport (``sim.presets.Preset`` fields): its top
    rate (None in a preset: the machine lacks it), the fixed start of one transfer and the
    per-hop pipeline overhead."""

    gbps: str
    latency_us: str
    ramp_us: str


def _always(gpus: GpuFacts) -> str | None:
    del gpus
    return None


def _needs_peer_access(gpus: GpuFacts) -> str | None:
    return gpus.peer_access


def _needs_multicast(gpus: GpuFacts) -> str | None:
    if gpus.multicast is not None:
        return gpus.multicast
    if gpus.peer_access is not None:
        return gpus.peer_access + " (flags live in peer memory)"
    return None


@dataclasses.dataclass(frozen=True)
class Transport:
    """One transport of the native path.

    ``auto_rank``: ``transport="auto"`` takes the lowest that can serve a clique; ``fused``: the
    fused GEMM runs over it (never NCCL, docs/gpu-internals.md §5); ``mechanism``: how its programs
    move blocks — ``"messages"`` (Send/Recv round a ring: the transport orders and moves the data
    itself), ``"peer_copies"`` (copies into the peers' workspace round a ring, each raising a
    flag in peer memory) or ``"multicast"`` (stores and load-reduces through one multicast
    object: every transfer one hop). Python only: ``reason``, why a clique's GPUs cannot serve
    it (None: they can), and ``preset``, its numbers in the performance model's presets.
    """

    native: ClassVar = ("id", "name", "auto_rank", "fused", "mechanism")
    id: int
    name: str
    auto_rank: int
    fused: bool
    mechanism: str
    reason: Callable[[GpuFacts], str | None]
    preset: PresetKeys

    @property
    def ring(self) -> bool:
        """Two-shot programs pass blocks round a ring (else every transfer is one hop)."""
        return self.mechanism != "multicast"


TRANSPORTS: tuple[Transport, ...] = (
    Transport(0, "nccl", 2, fused=False, mechanism="messages", reason=_always,
              preset=PresetKeys("nccl_gbps", "nccl_latency_us", "nccl_ramp_us")),
    Transport(1, "p2p", 1, fused=True, mechanism="peer_copies", reason=_needs_peer_access,
              preset=PresetKeys("p2p_gbps", "ce_latency_us", "ce_ramp_us")),
    Transport(2, "multicast", 0, fused=True, mechanism="multicast", reason=_needs_multicast,
              preset=PresetKeys("multicast_gbps", "mc_latency_us", "mc_ramp_us")),
)

# ---------------------------------------------------------------- dtypes


@dataclasses.dataclass(frozen=True)
class DType:
    """One dtype the executors take: ``name`` JAX's (NumPy's), ``short`` the programs';
    ``bytes`` per element; ``fp8``: an operand with a float32 dequantization scale; ``out``:
    allowed as y's dtype; ``fused``: the fused GEMM is compiled for it. Python only:
    ``aliases``, other names the performance model accepts, and ``peak``, the key of its GEMMs'
    rate in a preset's ``peak_tflops``."""

    native: ClassVar = ("id", "name", "short", "bytes", "fp8", "out", "fused")
    id: int
    name: str
    short: str
    bytes: int
    fp8: bool
    out: bool
    fused: bool
    aliases: tuple[str, ...] = ()
    peak: str = ""
    roundoff: float = 0.0


DTYPES: tuple[DType, ...] = (
    DType(0, "float32", "f32", 4, fp8=False, out=True, fused=False, peak="float32",
          roundoff=2.0**-24),
    DType(1, "bfloat16", "bf16", 2, fp8=False, out=True, fused=True, peak="bfloat16",
          roundoff=2.0**-8),
    DType(2, "float16", "f16", 2, fp8=False, out=True, fused=True, peak="float16",
          roundoff=2.0**-11),
    DType(3, "float8_e4m3fn", "f8e4m3fn", 1, fp8=True, out=False, fused=False,
          aliases=("e4m3", "fp8"), peak="float8", roundoff=2.0**-4),
    DType(4, "float8_e5m2", "f8e5m2", 1, fp8=True, out=False, fused=False, aliases=("e5m2",),
          peak="float8", roundoff=2.0**-3),
)


@dataclasses.dataclass(frozen=True)
class FusedFp8:
    """An FP8 triple the fused GEMM is compiled for (``cpp/core/kinds.h`` ``JO_FUSED_FP8``): x's,
    w's and y's dtypes. A 16-bit dtype is fused for x, w and y alike (``DType.fused``); FP8 is
    one instantiation per triple, each ~30 CPU-s of compile, so only these."""

    native: ClassVar = ("x", "w", "y")
    x: str
    w: str
    y: str


FUSED_FP8: tuple[FusedFp8, ...] = (
    FusedFp8("float8_e4m3fn", "float8_e4m3fn", "bfloat16"),  # the FP8 recipes' forward
    FusedFp8("float8_e4m3fn", "float8_e4m3fn", "float16"),  # the same, a float16 model's
    FusedFp8("float8_e4m3fn", "float8_e4m3fn", "float32"),  # the same, a float32 model's
    FusedFp8("float8_e5m2", "float8_e4m3fn", "bfloat16"),  # their gradient's dy @ w^T
)


def fused_serves(x, w, y) -> bool:
    """Whether the fused GEMM is compiled for x, w and y of these dtypes (names or NumPy
    dtypes): a 16-bit dtype for all three, or a ``FUSED_FP8`` triple."""
    x, w, y = (dtype(d).name for d in (x, w, y))
    if dtype(x).fused:
        return w == x and y == x
    return FusedFp8(x, w, y) in FUSED_FP8


def fused_listing() -> str:
    """What the fused GEMM is compiled for, for errors."""
    sixteen = listing(names(DTYPES, fused=True), "and")
    fp8 = ", ".join(f"{t.x} x {t.w} -> {t.y}" for t in FUSED_FP8)
    return f"{sixteen} (x, w and y alike); {fp8}"


# ---------------------------------------------------------------- looking rows up


def names(rows, **where) -> tuple[str, ...]:
    """The names of ``rows`` (in id order) whose columns have the values ``where`` gives:
    ``names(OPS, fused=True)``."""
    return tuple(r.name for r in rows if all(getattr(r, k) == v for k, v in where.items()))


def listing(items, last: str = "or") -> str:
    """"a, b or c": names for an error that says what is expected."""
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {last} {items[-1]}"


def auto_order() -> tuple[str, ...]:
    """The transports in the order ``transport="auto"`` prefers them."""
    return tuple(t.name for t in sorted(TRANSPORTS, key=lambda t: t.auto_rank))


def _by_name(rows, kind: str, name: str):
    for row in rows:
        if row.name == name:
            return row
    raise ValueError(f"{kind}: expected one of {', '.join(names(rows))}; got {name!r}")


def op(name: str) -> Op:
    """The op named ``name`` (ValueError naming the others otherwise)."""
    return _by_name(OPS, "op", name)


def transport(name: str) -> Transport:
    return _by_name(TRANSPORTS, "transport", name)


def ar_algorithm(name: str) -> Algorithm:
    """matmul_ar's algorithm named ``name``."""
    return _by_name(ALGORITHMS, "algorithm", name)


def call_replays(algorithm: str, replayable: bool, nranks: int) -> bool:
    """Whether a call may be captured into a command buffer and replayed (docs/gpu.md §6): a
    one-launch kernel algorithm's, or a program built replayable, of more than one rank. The
    one rule of the lowering's routing (``NativeCall.replays``) and the model's pricing
    (``sim.launch.replays``); the handlers hold the same (``cpp/ffi/ffi_call.h`` ``Replays``)."""
    return nranks > 1 and (ar_algorithm(algorithm).kernel or replayable)


def dtype(name) -> DType:
    """The dtype of ``name``: JAX's name (or a NumPy dtype: its ``.name``), the short one, or
    an alias."""
    row = _dtype_by_text(str(getattr(name, "name", name)))
    if row is None:
        raise ValueError(f"dtype: expected one of {', '.join(names(DTYPES))}; got {name!r}")
    return row


@functools.cache
def _dtype_by_text(text: str) -> DType | None:
    """The row a dtype's text names (cached: the performance model asks millions of times)."""
    return next((r for r in DTYPES if text in (r.name, r.short, *r.aliases)), None)


# ---------------------------------------------------------------- the rows rule


@dataclasses.dataclass(frozen=True)
class Canonical:
    """A call's canonical problem (docs/native.md §1): ``batch``, ``rows``, ``k`` and ``n``
    (the output columns), and the shapes of its results: ``y``, and the gathered x of an op
    that returns it (``()`` for the others)."""

    batch: int
    rows: int
    k: int
    n: int
    y: tuple[int, ...]
    x_gathered: tuple[int, ...]


def _dims(shape) -> str:
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


def canonical_problem(op_name: str, x_shape, w_shape, axis: int, nranks: int,
                      algorithm: str = "two_shot") -> Canonical:
    """The canonical problem of a call of ``op_name`` over ``nranks`` ranks on x of
    ``x_shape`` (sharded on dim ``axis``) and w of ``w_shape``, by the op's ``rows`` rule.

    The executors' rule is ``CanonicalProblem`` (``cpp/core/call.h``; ``_host.
    canonical_problem``): this is its mirror for where the extension does not load, held to it
    on a grid of shapes by ``tests/test_kinds.py`` — results and errors alike (ValueError with
    the executors' text)."""
    row = op(op_name)
    xd, wd = tuple(int(d) for d in x_shape), tuple(int(d) for d in w_shape)

    def bad(text: str) -> ValueError:
        return ValueError(f"{row.name}: {text}")

    if nranks < 1:
        raise bad(f"axis_size expected >= 1, got {nranks}")
    if len(xd) < 2:
        raise bad(f"operand x expected rank >= 2, got rank {len(xd)} (shape {_dims(xd)})")
    if len(wd) != 2:
        raise bad(f"operand w expected rank 2, got rank {len(wd)} (shape {_dims(wd)})")
    if wd[0] != xd[-1]:
        raise bad(f"operand w expected {xd[-1]} rows (x's last dim), got shape {_dims(wd)}")
    if not 0 <= axis <= len(xd) - 2:
        raise bad(f"attribute axis expected in [0, {len(xd) - 2}], got {axis}")
    k, n, s = xd[-1], wd[1], xd[axis]
    batch = math.prod(xd[:axis])
    post = math.prod(xd[axis + 1:-1])

    def result(at_axis: int, last: int) -> tuple[int, ...]:
        return tuple(at_axis if d == axis else last if d == len(xd) - 1 else v
                     for d, v in enumerate(xd))

    if row.rows == "gather":
        return Canonical(batch, s * post, k, n, result(s * nranks, n), result(s * nranks, k))
    if row.rows == "scatter":
        if s % nranks:
            raise bad(f"operand x dim {axis} ({s}) expected divisible by axis_size {nranks}")
        return Canonical(batch, s // nranks * post, k, n, result(s // nranks, n), ())
    # "all": every dim but the last is a row (one-shot: any number of them)
    if axis != 0:
        raise bad(f"attribute axis expected 0, got {axis}")
    total = math.prod(xd[:-1])
    one_shot = not ar_algorithm(algorithm).splits_rows  # one-shot and the kernels
    if not one_shot and total % nranks:
        raise bad(f"operand x expected rows (the product of all dims but the last, {total}) "
                  f"divisible by axis_size {nranks}")
    return Canonical(1, total if one_shot else total // nranks, k, n, result(xd[0], n), ())
