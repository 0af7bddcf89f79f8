"""``python -m jaxoverlap selftest``: does the native path work on this machine?

On a machine with GPUs: runs ``ag_matmul``, ``matmul_rs`` and ``matmul_ar`` with
``impl="native"`` for every transport the GPUs offer, every dtype and a few shapes
(with chunks and bidirectional rings), plus ``matmul_ar``'s one-shot on a decode
step's single row, plus (where the GPU runs the fused GEMM: compute capability 9.0, and
10.0 for 16-bit dtypes) the fused GEMM's programs of ``ag_matmul`` and ``matmul_rs`` over
``p2p`` and ``multicast``, and compares each with a float64 product of the same (rounded)
inputs, within a bound derived from the dtype, the number of ranks and the contraction length
(``bound``). Prints a pass/fail table; the
exit status is 0 only if every row passed. ``--report FILE`` also writes what a
bug report needs: versions, topology, every row's result and time, and the first
error with the state of the cliques — rewritten after every row, so that a run
that hangs leaves it behind. A row still running after ``row_deadline_s()`` is
taken for a hang: reported (with every thread's stack), and the process exits.

FP8 rows (the public ops with fp8 operands and per-rank scales, y in bfloat16, float32 or
float16, against the float64 product of the float32 dequantized operands, under the bound for
y's dtype plus the FP8 tensor cores' accumulation error, ``fp8_accumulation``) run where the GPUs
have FP8 GEMMs (compute capability 8.9 or newer; else one line says why not), on host devices
and on the fake.

Without a GPU: says so clearly, then runs the same table on host devices (the
host executor), plus a few rows of the CUDA executor on the fake (if built).

``--fake``: the same rows through the CUDA executor linked against
the host-side fake of CUDA, NCCL and cuBLASLt, on any machine: the executor's
host code, its enqueue order through ``CUDA_DEVICE_MAX_CONNECTIONS`` work queues
(read from the environment as the driver does), NCCL's per-communicator
serialisation and the kernels' own per-element code, compared with float64;
the fused GEMM's rows also on a B200-like fake device (compute capability 10.0:
the sm100 kernel's tile-level model, 16-bit). It checks what decides hangs and
wrong results, not a GPU's speed.

``--loopback N`` (with or without ``--fake``): the rows of the peer-copy transports (p2p; FP8 and
the fused GEMM's included, where the GPU runs them) with N ranks on ONE GPU, through the executor
directly (``loopback_run``: cpp/cuda/loopback.h), no JAX: a first contact that needs one GPU. It
says, and its report lists, what one GPU cannot cover (the other transports, anything between
GPUs).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import platform as host_platform
import shutil
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from jaxoverlap import _kinds
from jaxoverlap._fused_gemm import FUSED_DTYPES, FUSED_OPS, FUSED_TRANSPORTS

SHAPES = (  # (batch dims before the sequence axis, rows per rank, K, Nw per rank)
    ((), 8, 64, 32),
    ((2,), 4, 48, 24),
    ((), 12, 40, 18),
)
DTYPES = _kinds.names(_kinds.DTYPES, fp8=False)
VARIANTS = ((1, False), (2, False), (4, True))  # (chunks, bidirectional); chunks | rows
# "op/algorithm": matmul_ar's one-shot, on rows that do not split over the ranks (a decode step)
OPS = (*_kinds.names(_kinds.OPS),
       *(f"{op}/one_shot" for op in _kinds.names(_kinds.OPS, one_shot=True)))
# matmul_ar's kernel algorithms (one GEMM + ONE all-reduce kernel, docs/gpu-internals.md §7):
# rows of the fake only, each call captured into a CUDA graph and replayed REPLAYS times with new
# inputs (a rank launching late), over the transports the kernel runs with.
KERNEL_OPS = tuple(f"matmul_ar/{a}" for a in _kinds.names(_kinds.ALGORITHMS, kernel=True))
KERNEL_TRANSPORTS = tuple(t.name for t in _kinds.TRANSPORTS if t.mechanism != "messages")
REPLAYS = 3
# The replayable programs (docs/gpu-internals.md §8): every program over p2p and multicast
# (ag_matmul and matmul_rs chunked and fused, matmul_ar's two_shot and one_shot), built with
# acknowledged flags of constant value, rows of the fake only, captured and replayed like the
# kernel algorithms' (XLA does not ask for these programs yet: docs/gpu.md §6). `selftest --fake
# --graph` runs every row of them replayable.
REPLAYABLE_OPS = ("ag_matmul", "matmul_rs", "matmul_ar", "matmul_ar/one_shot")
REPLAYABLE_TRANSPORTS = ("p2p", "multicast")


def _not_replayable(op: str, transport: str) -> str | None:
    """Why a row's program is not captured (docs/gpu.md §6), or None: `selftest --fake --graph`
    skips it with the reason."""
    if op in REPLAYABLE_OPS and transport in REPLAYABLE_TRANSPORTS:
        return None
    return ("nccl: its calls capture, but a dead peer under replay has no bound (no per-call "
            "watchdog lease runs in a replay), NCCL requires every rank to capture an operation "
            "alike where XLA decides per process, and NCCL's guide warns that capture with "
            "several GPUs per process may deadlock (docs/gpu.md §6)")


# Unit roundoff of each dtype (half the distance from 1 to the next number).
UNIT_ROUNDOFF = {d.name: d.roundoff for d in _kinds.DTYPES}
# FP8 rows: (x, w, y) dtypes, every pairing cuBLASLt's FP8 GEMMs have, each output type; a shape
# whose k and output rows meet cuBLASLt's 16-byte rule for FP8 (docs/gpu-internals.md §6).
FP8_DTYPES = (("float8_e4m3fn", "float8_e4m3fn", "bfloat16"),
              ("float8_e4m3fn", "float8_e5m2", "float32"),
              ("float8_e5m2", "float8_e4m3fn", "float16"))
FP8_SHAPE = ((2,), 4, 48, 24)
FP8_OPS = _kinds.names(_kinds.OPS)
# The fused GEMM's FP8 rows: its (x, w, y) instantiations (``_kinds.FUSED_FP8``) on FP8_SHAPE.
FUSED_FP8_DTYPES = tuple((t.x, t.w, t.y) for t in _kinds.FUSED_FP8)
# The FP8 tensor cores' accumulator, as the CUDA fake computes an FP8 GEMM
# (cpp/cuda/fake/fp8_accumulator.h, which cites the sources): per compute capability, the products
# added in one step together with the running sum (block) and the fraction bits kept — every
# addend aligned to the step's largest exponent and truncated there, the step's sum truncated to
# them —, the sum promoted into float32 every FP8_PROMOTION elements of K (cuBLASLt's interval is
# not documented: CUTLASS's default, see the header). Not float32 accumulation on any of them.
FP8_TENSOR_CORES = {89: (16, 13), 90: (32, 13), 100: (32, 23)}
FP8_PROMOTION = 128


def fp8_scales(np, n: int) -> tuple[Any, Any]:
    """Per rank, x's and w's float32 dequantization scales: all different, so a GEMM that used
    another shard's scale would miss the bound by far."""
    return (np.asarray([0.5 * (1 + 0.37 * r) for r in range(n)], np.float32),
            np.asarray([1.25 - 0.1 * r for r in range(n)], np.float32))


def dequantized(np, values, scale):
    """An fp8 operand's real value, ``values.astype(float32) * scale`` in float32, as float64."""
    return (np.asarray(values, np.float32) * np.float32(scale)).astype(np.float64)


def fp8_accumulation(x64, w64, k: int):
    """The worst case, elementwise, of the FP8 tensor cores' accumulation error (every model of
    ``FP8_TENSOR_CORES``) in ``x64 @ w64``, whose contraction is GEMMs of ``k`` each (side by
    side in ``w64``'s rows, as ``bound`` takes them).

    Per step of ``block`` products ``p`` (dequantized: the scales multiply every error alike) and
    the running sum ``c``, with ``M = max(|p|, |c|)`` and ``f`` fraction bits: each of the at most
    ``block + 1`` addends loses less than ``2^-f M`` when aligned (the step's exponent ``E`` has
    ``2^E <= M``; a product counts from its factors' exponents, each at least its format's
    smallest normal one, so a block whose largest product has a subnormal factor is not covered)
    and the truncated sum less than ``2^-f`` of its magnitude, at most ``sum |p| + |c|``; ``|c|``
    is at most the sum of ``|p|`` since the last promotion (truncation toward zero only shrinks);
    a promotion rounds once in float32 (at most ``2^-24`` of the running sum's magnitude)."""
    import numpy as np

    absp = np.abs(x64[..., :, None, :] * np.swapaxes(w64, 0, 1))  # (..., m, n, K)
    total_k = absp.shape[-1]
    worst = np.zeros(absp.shape[:-1])
    for block, fraction_bits in sorted(set(FP8_TENSOR_CORES.values())):
        u = 2.0 ** -fraction_bits
        err = np.zeros(absp.shape[:-1])
        for gemm in range(0, total_k, k):
            for window in range(gemm, gemm + k, FP8_PROMOTION):
                c = np.zeros(absp.shape[:-1])  # a bound on the running sum's magnitude
                end = min(window + FP8_PROMOTION, gemm + k)
                for start in range(window, end, block):
                    p = absp[..., start:min(start + block, end)]
                    step = p.sum(axis=-1)
                    addends = np.count_nonzero(p, axis=-1) + (c > 0)
                    err += u * (addends * np.maximum(p.max(axis=-1), c) + step + c)
                    c = c + step
                err += 2.0 ** -24 * absp[..., gemm:end].sum(axis=-1)  # the promotion
        worst = np.maximum(worst, err)
    return worst


def bound(op: str, dtype: str, n: int, k: int, x64, w64, fp8: bool = False):
    """How far a correct result may be from the float64 product of the same inputs, elementwise.

    ``x64``/``w64`` are the inputs already rounded to ``dtype``, as float64 (for
    ``matmul_rs``/``matmul_ar`` with the ``n`` ranks' slices of the contraction side by side,
    ``k`` each; ``fp8``: the dequantized operands of FP8 GEMMs). Two parts, ``u`` being the
    dtype's unit roundoff and ``u32 = 2^-24``:

    * the float32 accumulation of every GEMM (exact products): with ``K`` the contraction length
      and ``S = |x| @ |w|``, at most ``8 sqrt(K) u32 S`` — the probabilistic bound of Higham and
      Mary ("A New Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput.,
      2019: ``lambda sqrt(K) u S`` fails with probability below ``2 exp(-lambda^2 / 2)``, 3e-14
      per element for ``lambda = 8``); the worst case, ``K u32 S``, would let TF32 pass. FP8
      GEMMs accumulate in the tensor cores' narrower format instead: plus the worst case of
      ``fp8_accumulation``;
    * twice the worst case of the roundings to ``dtype``, each at most ``u |v|`` for the value
      ``v`` rounded: ``ag_matmul`` rounds once, its output ``y``; ``matmul_rs``/``matmul_ar``
      round each rank's partial product ``p_r``, each partial sum of up to ``n - 1`` reduction
      steps (NCCL's ring reduces in the dtype; the p2p ring accumulates into it) and the output,
      every one at most ``P = sum_r |p_r|``: ``(n + 1) u P``.

    The float32 references run at HIGHEST (no TF32 on either side).
    """
    import numpy as np

    u = UNIT_ROUNDOFF[dtype]
    total_k = w64.shape[0]
    accumulation = 8 * np.sqrt(total_k) * UNIT_ROUNDOFF["float32"] * (np.abs(x64) @ np.abs(w64))
    if fp8:
        accumulation = accumulation + fp8_accumulation(x64, w64, k)
    if _kinds.op(op).communicates == "k":  # no reduction: y rounded once
        rounding = u * np.abs(x64 @ w64)
    else:
        partials = sum(np.abs(x64[..., r * k:(r + 1) * k] @ w64[r * k:(r + 1) * k])
                       for r in range(n))
        rounding = (n + 1) * u * partials
    return 2 * rounding + accumulation + np.finfo(np.float32).tiny


def _compare(np, got, ref, allowed) -> tuple[bool, str]:
    err = np.abs(got - ref)
    with np.errstate(divide="ignore", invalid="ignore"):  # a zero bound: any error is inf of it
        worst = float(np.max(err / allowed)) if err.size else 0.0
    detail = f"max |native - float64| = {float(np.max(err, initial=0.0)):.2e} " \
             f"({worst:.2f} of the bound)"
    return bool(np.all(err <= allowed)), detail


def _gpu_table() -> dict[str, Any]:
    from jaxoverlap._executors import capabilities

    return capabilities.gpu_table()


def _prepare_host_devices(n: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _global_inputs(rng, op: str, batch: tuple, rows: int, k: int, nw: int, n: int):
    """Random global x ``[*batch, rows, .]`` and w of ``op`` on ``n`` ranks (each rank's share
    of the split dim: k of the contraction, nw of the output columns), and their specs: where
    the op's layout splits them (``_kinds``)."""
    from jax.sharding import PartitionSpec as P

    layout, lead = _kinds.op(op).layout, (None,) * len(batch)
    if layout.w == 1:  # w's columns split: x whole along k (its rows split, or none)
        x = rng.standard_normal((*batch, rows, k))
        w = rng.standard_normal((k, nw * n))
        row = "tp" if layout.x == "row" else None
        return x, w, P(*lead, row, None), P(None, "tp")
    x = rng.standard_normal((*batch, rows, k * n))  # the contraction split
    w = rng.standard_normal((k * n, nw))
    return x, w, P(*lead, None, "tp"), P("tp", None)


def _axis(op: str, axis: int) -> dict[str, int]:
    """The ``axis=`` argument of an op whose rows are split on one (none for one whose rows are
    every dim but the last)."""
    return {} if _kinds.op(op).rows == "all" else dict(axis=axis)


def _run_row(jo, jax, jnp, np, mesh, op, transport, dtype, shape, chunks, bidirectional,
             fused=False) -> str:
    """One row: the native op on the mesh against the float64 product of its rounded inputs
    (``fused``: the fused GEMM's program, asked for with ``jo.config(fused=True)``)."""
    from jax.sharding import NamedSharding

    batch, rows, k, nw = shape
    n = mesh.shape["tp"]
    rng = np.random.default_rng(0)
    axis = len(batch)
    op, _, algorithm = op.partition("/")
    # one-shot: a decode step's single row per batch, which no N splits
    x, w, xs, ws = _global_inputs(rng, op, batch, 1 if algorithm == "one_shot" else rows * n,
                                  k, nw, n)
    x = jax.device_put(jnp.asarray(x.astype(np.float32), dtype), NamedSharding(mesh, xs))
    w = jax.device_put(jnp.asarray(w.astype(np.float32), dtype), NamedSharding(mesh, ws))
    fn = getattr(jo, op)
    kwargs: dict[str, Any] = dict(mesh=mesh, **_axis(op, axis))
    if algorithm:
        kwargs["algorithm"] = algorithm
    # HIGHEST: float32 dots on A100/H100-class GPUs otherwise default to TF32.
    kwargs["precision"] = "highest"
    native = jax.jit(lambda a, b: fn(a, b, "tp", impl="native", transport=transport,
                                     chunks=chunks, bidirectional=bidirectional, **kwargs))
    with jo.config(fused=fused):  # traced here, at the first call
        got = np.asarray(jnp.asarray(native(x, w), jnp.float32), np.float64)
    x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    w64 = np.asarray(jnp.asarray(w, jnp.float32), np.float64)
    ok, detail = _compare(np, got, x64 @ w64, bound(op, dtype, n, k, x64, w64))
    if not ok:
        raise AssertionError(detail)
    return detail


def _run_fp8_row(jo, jax, jnp, np, mesh, op, transport, fp8, shape, chunks,
                 bidirectional) -> str:
    """One FP8 row: the native op with fp8 operands and per-rank scales (``x_scale=``,
    ``w_scale=`` inside shard_map) on the mesh, against the float64 product of the float32
    dequantized operands, under the bound of y's dtype."""
    from jax.sharding import PartitionSpec as P

    x_dtype, w_dtype, out = fp8
    batch, rows, k, nw = shape
    n = mesh.shape["tp"]
    rng = np.random.default_rng(0)
    axis = len(batch)
    lead = (None,) * axis
    sx, sw = fp8_scales(np, n)
    x, w, x_spec, w_spec = _global_inputs(rng, op, batch, rows * n, k, nw, n)
    specs = (x_spec, w_spec)
    x = jnp.asarray(x * 3, jnp.float32).astype(x_dtype)
    w = jnp.asarray(w * 3, jnp.float32).astype(w_dtype)
    kwargs: dict[str, Any] = _axis(op, axis)

    def local(x, w, sx, sw):  # sx, sw: this rank's scales, shape (1,)
        return getattr(jo, op)(x, w, "tp", impl="native", transport=transport, chunks=chunks,
                               bidirectional=bidirectional, x_scale=sx, w_scale=sw,
                               preferred_element_type=out, **kwargs)

    split = _kinds.op(op).layout.y  # y on its rows, its columns or whole
    y_spec = P(*lead, "tp" if split == "row" else None, "tp" if split == "last" else None)
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(*specs, P("tp"), P("tp")),
                               out_specs=y_spec))
    got = np.asarray(jnp.asarray(fn(x, w, jnp.asarray(sx), jnp.asarray(sw)), jnp.float32),
                     np.float64)
    x64 = np.asarray(x.astype(jnp.float32))
    w64 = np.asarray(w.astype(jnp.float32))
    if _kinds.op(op).rows == "gather":  # shard j's rows with scale j; rank r's columns of w
        a = np.concatenate([dequantized(np, x64[..., j * rows:(j + 1) * rows, :], sx[j])
                            for j in range(n)], axis=-2)
        b = np.concatenate([dequantized(np, w64[:, r * nw:(r + 1) * nw], sw[r])
                            for r in range(n)], axis=1)
        allowed = np.concatenate(
            [bound(op, out, n, k, a, b[:, r * nw:(r + 1) * nw], fp8=True) for r in range(n)],
            axis=-1)
    else:  # rank r's slice of the contraction with its own scales
        a = np.concatenate([dequantized(np, x64[..., r * k:(r + 1) * k], sx[r])
                            for r in range(n)], axis=-1)
        b = np.concatenate([dequantized(np, w64[r * k:(r + 1) * k], sw[r]) for r in range(n)])
        allowed = bound(op, out, n, k, a, b, fp8=True)
    ok, detail = _compare(np, got, a @ b, allowed)
    if not ok:
        raise AssertionError(detail)
    return detail


FAKE_RANKS = 4
# The loopback (``--loopback N``: cpp/cuda/loopback.h): N ranks' programs on ONE GPU, each rank's
# buffers, flags and streams its own, its peers reached as the same device's memory: the
# transports that move blocks by peer copies. What one GPU cannot show (the other transports, by
# their mechanism, and what lies between GPUs), said in the output and the report:
LOOPBACK_TRANSPORTS = tuple(t.name for t in _kinds.TRANSPORTS if t.mechanism == "peer_copies")
_ONE_GPU_CANNOT = {
    "messages": "NCCL puts one rank of a communicator on a GPU (it refuses two on one device)",
    "multicast": "a multicast object binds one memory per GPU (NVLink SHARP)",
}
LOOPBACK_NOT_COVERED = {
    **{t.name: _ONE_GPU_CANNOT[t.mechanism] for t in _kinds.TRANSPORTS
       if t.name not in LOOPBACK_TRANSPORTS},
    "between GPUs": "NVLink / PCIe peer access and its ordering of remote writes (the flags' "
                    "FLUSH), peer copies through the interconnect, one rank's SMs to itself "
                    "(here the ranks share one GPU's SMs and copy engines)",
}
LOOPBACK_CLIQUE = 0x100B  # a transport's loopback rows on one clique: epochs, parities, growth


def rank_products(np, op: str, xs, ws, rows: int) -> list[tuple[Any, Any]]:
    """Per rank, the float64 factors (a, b) whose product ``a @ b`` is that rank's exact result,
    from every rank's (rounded) inputs ``xs[r]`` (batch, rows, K) and ``ws[r]``, as ``bound``
    takes them."""
    x64 = [x.astype(np.float64) for x in xs]
    w64 = [w.astype(np.float64) for w in ws]
    rule = _kinds.op(op).rows
    if rule == "gather":  # rank r: the gathered x times its own w
        gathered = np.concatenate(x64, axis=1)
        return [(gathered, w) for w in w64]
    # The sum over ranks of x_r @ w_r: one product of the concatenations along K.
    xk, wk = np.concatenate(x64, axis=2), np.concatenate(w64, axis=0)
    return [(xk if rule == "all" else xk[:, r * rows:(r + 1) * rows], wk)
            for r in range(len(xs))]


def _all_rows(algorithm: str) -> bool:
    """matmul_ar's algorithms that take every row (one-shot and the kernels): their rows are a
    decode step's, not N blocks."""
    return bool(algorithm) and not _kinds.ar_algorithm(algorithm).splits_rows


def _row_inputs(np, op: str, n: int, shape, dtype: str,
                fp8: tuple[str, str, str] | None, replays: int = 0) -> dict[str, Any]:
    """One case's inputs for ``n`` ranks, as the CUDA executor's handler receives them (an fp8
    w K-major, [nw, k]: docs/gpu-internals.md §6), and per rank the float64 factors of its exact
    result; ``replays``: that many more x per rank (w the same), each with its factors."""
    import ml_dtypes

    batch_dims, rows, k, nw = shape
    batch = int(np.prod(batch_dims)) if batch_dims else 1
    np_dtypes = {d: getattr(ml_dtypes, d, None) or np.dtype(d) for d in _kinds.names(_kinds.DTYPES)}
    x_dtype, w_dtype, out_dtype = fp8 or (dtype, dtype, dtype)
    rng = np.random.default_rng(1)
    op, _, algorithm = op.partition("/")
    if _all_rows(algorithm):
        rows = rows * n + 1  # the canonical one-shot problem: all rows, not N blocks
    x_rows = rows if _kinds.op(op).rows == "gather" or _all_rows(algorithm) else rows * n
    spread = 3.0 if fp8 else 1.0  # fp8 values over a few binades
    xs = [(rng.standard_normal((batch, x_rows, k)) * spread).astype(np.float32)
          .astype(np_dtypes[x_dtype]) for _ in range(n)]
    ws = [(rng.standard_normal((k, nw)) * spread).astype(np.float32).astype(np_dtypes[w_dtype])
          for _ in range(n)]
    scales: dict[str, Any] = {}
    w_bytes = [w.tobytes() for w in ws]
    if fp8:
        sx, sw = fp8_scales(np, n)
        scales = dict(x_scales=list(sx), w_scales=list(sw))
        # the handler receives an fp8 w K-major, [nw, k] (docs/gpu-internals.md §6)
        w_bytes = [np.ascontiguousarray(w.T).tobytes() for w in ws]
        xs_ref = [dequantized(np, x, s) for x, s in zip(xs, sx, strict=True)]
        ws_ref = [dequantized(np, w, s) for w, s in zip(ws, sw, strict=True)]
    else:
        xs_ref, ws_ref = xs, ws
    # the problem as the executors' bindings take it (_host.build_program's keys) but for
    # transport, chunks, bidirectional and fused: the caller's
    problem = dict(op=op, nranks=n, batch=batch, rows=rows, k=k, n=nw, dtype=x_dtype,
                   w_dtype=w_dtype, out_dtype=out_dtype, algorithm=algorithm or "two_shot")
    # a replay's new x per rank (the scale operands stay the call's: fp8 x dequantized by them)
    again = [[(rng.standard_normal((batch, x_rows, k)) * spread).astype(np.float32)
              .astype(np_dtypes[x_dtype]) for _ in range(n)] for _ in range(replays)]
    again_ref = [[dequantized(np, x, s) for x, s in zip(r, sx, strict=True)] if fp8 else r
                 for r in again]
    return dict(problem=problem, op=op, k=k, out_dtype=out_dtype,
                out_np=np_dtypes[out_dtype], xs=[x.tobytes() for x in xs], ws=w_bytes,
                scales=scales, refs=rank_products(np, op, xs_ref, ws_ref, rows), fp8=bool(fp8),
                replays=[([x.tobytes() for x in r], rank_products(np, op, ref, ws_ref, rows))
                         for r, ref in zip(again, again_ref, strict=True)])


def _row_verdict(np, n: int, case: dict[str, Any], ys, problems: list[str]) -> tuple[bool, str]:
    """Every rank's y against the float64 product of its factors, under ``bound`` (unless the
    run already has ``problems``): (passed, detail)."""
    details = []
    if not problems:
        for r, (y, (a, b)) in enumerate(zip(ys, case["refs"], strict=True)):
            ref = a @ b
            got = np.frombuffer(y, case["out_np"]).reshape(ref.shape).astype(np.float64)
            ok, detail = _compare(np, got, ref, bound(case["op"], case["out_dtype"], n,
                                                      case["k"], a, b, fp8=case["fp8"]))
            details.append(detail)
            if not ok:
                problems.append(f"rank {r}: {detail}")
                break
    return not problems, "; ".join(problems) or details[-1]


# A B200-like fake device for the sm100 fused GEMM's rows: compute capability 10.0, 148 SMs.
FAKE_B200 = {"cc_major": 10, "cc_minor": 0, "sms": 148}


def _fake_row(fake, np, op, transport, dtype, shape, chunks, bidirectional,
              fp8: tuple[str, str, str] | None = None, fused=False,
              replays: int = 0, device: dict | None = None,
              replayable: bool = False) -> tuple[bool, str]:
    """One case through the CUDA executor on the fake, against a float64 reference. ``fp8``:
    the (x, w, y) dtypes of an FP8 row (``dtype`` is then y's), each rank with its own
    scales; ``fused``: the fused GEMM's program; ``replays``: after the call, each rank's
    thread captures it into a CUDA graph, launched that many times with new x (rank 1 last,
    once the others ran as far as they could), every launch checked against its own inputs;
    ``device``: the fake GPU's Config fields (default: an H100-like 9.0); ``replayable``: the
    program built to be replayed (docs/gpu-internals.md §8)."""
    n = FAKE_RANKS
    case = _row_inputs(np, op, n, shape, dtype, fp8, replays=replays)
    # CUDA_DEVICE_MAX_CONNECTIONS from the environment, as the driver reads it
    fake.reset(fake.Config(**device) if device else fake.Config())
    problem = dict(case["problem"], transport=transport, chunks=chunks,
                   bidirectional=bidirectional, fused=fused, replayable=replayable)
    played = dict(capture=True, replays=replays, replay_late_rank=1,
                  replay_xs=[xs for xs, _ in case["replays"]]) if replays else {}
    out = fake.run(problem, xs=case["xs"], ws=case["ws"], devices=list(range(n)),
                   **case["scales"], **played)
    problems = [*fake.errors()[:2], *[s for s in out["statuses"] if s][:2]]
    if not out["drained"] and not problems:
        problems.append("the fake GPU did not drain")
    if replays and not problems and out["replay_drained"] != [True] * replays:
        problems.append(f"a replay did not drain: {out['replay_drained']}")
    verdict = _row_verdict(np, n, case, out["ys"], problems)
    for i, ys in enumerate(out.get("replay_ys", []) if verdict[0] else []):
        ok, detail = _row_verdict(np, n, dict(case, refs=case["replays"][i][1]), ys, [])
        verdict = (ok, detail if ok else f"replay {i + 1}: {detail}")
        if not ok:
            break
    return verdict


def _loopback_row(module, np, n: int, op, transport, dtype, shape, chunks, bidirectional,
                  fp8: tuple[str, str, str] | None = None, fused=False, device=0,
                  fake=None) -> tuple[bool, str]:
    """One case of ``n`` ranks on ONE GPU (``module.loopback_run``: cpp/cuda/loopback.h; a
    transport of ``LOOPBACK_TRANSPORTS``), against a float64 reference. ``fake``: the run is on
    the host-side fake (its misuse reports count)."""
    case = _row_inputs(np, op, n, shape, dtype, fp8)
    problem = dict(case["problem"], transport=transport, chunks=chunks,
                   bidirectional=bidirectional, fused=fused)
    timeout_ms = int(float(os.environ.get("JAXOVERLAP_TIMEOUT_S", "120")) * 1000)
    seen = len(fake.errors()) if fake else 0
    out = module.loopback_run(problem, case["xs"], case["ws"], device=device,
                              clique_key=LOOPBACK_CLIQUE + _kinds.transport(transport).id,
                              timeout_ms=timeout_ms, **case["scales"])
    problems = [*(fake.errors()[seen:seen + 2] if fake else []),
                *[s for s in out["statuses"] if s][:2]]
    if not out["completed"] and not problems:
        problems.append("the GPU did not finish the calls within twice JAXOVERLAP_TIMEOUT_S")
    return _row_verdict(np, n, case, out["ys"], problems)


def row_deadline_s() -> float:
    """How long one row may take before the selftest calls the process hung: twice the
    watchdog's timeout (``JAXOVERLAP_TIMEOUT_S``, 120 s by default: a call stuck for a peer is
    reported and released after it, and its row then fails) plus a minute of compilation."""
    return 2 * float(os.environ.get("JAXOVERLAP_TIMEOUT_S", "120")) + 60


class Table:
    """The rows run so far (name, passed, detail, seconds), and the first failure's context.

    With ``report`` (a path and the report's header: versions, topology, environment), the JSON
    report is rewritten after every row and when a row starts, so that a run that hangs leaves it
    behind. With ``deadline_s``, a row still running after that long is taken for a hang: it is
    recorded as failed with every Python thread's stack and the cliques' state, the report is
    written, and ``on_hung`` ends the process (its default: exit status 1, the calls cannot be
    interrupted)."""

    def __init__(self, report: tuple[str, dict[str, Any]] | None = None,
                 deadline_s: float | None = None, on_hung=None) -> None:
        self.rows: list[dict[str, Any]] = []
        self.first_error: dict[str, Any] | None = None
        self._report = report
        self._lock = threading.Lock()
        self._running: dict[str, Any] | None = None
        self._deadline_s = deadline_s
        self._on_hung = on_hung or (lambda: os._exit(1))
        if deadline_s is not None:
            threading.Thread(target=self._watch, name="selftest-deadline", daemon=True).start()

    def start(self, name: str, cliques=None) -> None:
        """Row ``name`` begins (``cliques``: how to describe the cliques if it hangs)."""
        with self._lock:
            self._running = dict(name=name, since=time.monotonic(), cliques=cliques)
            self._write()

    def run(self, name: str, row, cliques=None) -> None:
        """Runs ``row`` (it returns the row's detail, or raises: the row fails with the error
        and the run goes on) as row ``name``, under the row deadline."""
        self.start(name, cliques=cliques)
        start = time.perf_counter()
        trace = None
        try:
            detail = row()
            ok = True
        except Exception as e:  # noqa: BLE001 - a row reports, the run goes on
            ok = False
            detail = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            trace = traceback.format_exc()
            if os.environ.get("JAXOVERLAP_LOG") == "debug":
                print(trace)
        self.add(name, ok, detail, time.perf_counter() - start, cliques=cliques, trace=trace)

    def add(self, name: str, ok: bool, detail: str, seconds: float,
            cliques=None, trace: str | None = None) -> None:
        with self._lock:
            self._running = None
            self.rows.append(dict(name=name, passed=ok, detail=detail, seconds=round(seconds, 3)))
            print(f"  {'PASS' if ok else 'FAIL'}  {name}  {detail} ({seconds:.1f} s)", flush=True)
            if not ok and self.first_error is None:
                # The clique trail: every live clique as the executor describes it (transport,
                # GPUs, epoch, generations, broken reason, stuck aborts), at the first failure.
                self.first_error = dict(row=name, error=detail, traceback=trace,
                                        cliques=_cliques(cliques))
            self._write()

    def summary(self, note: str = "") -> int:
        failed = [r for r in self.rows if not r["passed"]]
        print(f"\n{len(self.rows) - len(failed)}/{len(self.rows)} passed{note}")
        for r in failed:
            print(f"FAILED: {r['name']}: {r['detail']}")
        return 0 if self.rows and not failed else 1

    def _write(self) -> None:  # requires self._lock
        if self._report is None:
            return
        path, header = self._report
        running = None
        if self._running is not None:
            running = dict(name=self._running["name"],
                           seconds=round(time.monotonic() - self._running["since"], 3))
        report = dict(header, rows=self.rows, running=running, first_error=self.first_error)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1, default=str)
        os.replace(tmp, path)  # a reader never sees half a report

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self._deadline_s / 10))
            with self._lock:
                row = self._running
                if row is None or time.monotonic() - row["since"] < self._deadline_s:
                    continue
                self._running = None
                detail = (f"did not finish within {self._deadline_s:.0f} s (the row deadline: "
                          "2 x JAXOVERLAP_TIMEOUT_S + 60 s): the process is hung")
                self.rows.append(dict(name=row["name"], passed=False, detail=detail,
                                      seconds=round(self._deadline_s, 3)))
                print(f"  FAIL  {row['name']}  {detail}", flush=True)
                if self.first_error is None:
                    stacks = "".join(
                        f"Thread {ident}:\n{''.join(traceback.format_stack(frame))}"
                        for ident, frame in sys._current_frames().items())
                    self.first_error = dict(row=row["name"], error=detail, traceback=stacks,
                                            cliques=_cliques(row["cliques"]))
                self._write()
                if self._report is not None:
                    print(f"report written to {self._report[0]}", flush=True)
            self._on_hung()
            return


def _cliques(describe) -> list[str]:
    try:
        return [line for line in describe().splitlines() if line] if describe else []
    except Exception as e:  # noqa: BLE001 - the report must be written whatever happened
        return [f"(could not describe the cliques: {e})"]


def _fake_rows(table: Table, quick: bool = True, ops=OPS, graph: bool = False) -> None:
    """The selftest's table through the CUDA executor on the host-side fake (if built), and
    the kernel algorithms' rows, each call captured and replayed. ``graph``: only the rows
    whose program replays; the others are skipped with the reason (docs/gpu.md §6)."""
    try:
        from jaxoverlap._executors import runtime

        runtime.load_cuda()
        from jaxoverlap import _cuda_fake
    except ImportError as e:
        print(f"  (CUDA executor on the fake: skipped, {e})")
        return
    import numpy as np

    shapes = SHAPES[:1] if quick else SHAPES
    dtypes = DTYPES[:1] if quick else DTYPES
    variants = VARIANTS[-1:] if quick else VARIANTS
    cases = [(op, transport, dtype, None, shape, variant, False)
             for op, transport, dtype, shape, variant
             in itertools.product(ops, _kinds.names(_kinds.TRANSPORTS), dtypes, shapes, variants)]
    # FP8: every pairing (one in quick), the variants alternating
    fp8s = FP8_DTYPES[:1] if quick else FP8_DTYPES
    cases += [(op, transport, fp8[2], fp8, FP8_SHAPE, VARIANTS[1 + (i + j) % 2], False)
              for (i, fp8), (j, op), transport in itertools.product(
                  enumerate(fp8s), enumerate(o for o in FP8_OPS if o in ops),
                  _kinds.names(_kinds.TRANSPORTS))]
    # The fused GEMM (docs/gpu-internals.md §5): its ops, transports and dtypes, on the first shape
    cases = [(*c, None) for c in cases]
    cases += [(op, transport, dtype, None, SHAPES[0], variant, True, None)
              for op, transport, dtype, variant in itertools.product(
                  [o for o in FUSED_OPS if o in ops], FUSED_TRANSPORTS,
                  FUSED_DTYPES[:1] if quick else FUSED_DTYPES, variants)]
    # ... and its sm100 kernel (16-bit only) on a B200-like fake device
    cases += [(op, transport, dtype, None, SHAPES[0], variant, True, FAKE_B200)
              for op, transport, dtype, variant in itertools.product(
                  [o for o in FUSED_OPS if o in ops], FUSED_TRANSPORTS,
                  FUSED_DTYPES[:1] if quick else FUSED_DTYPES, variants)]
    # ... and its FP8 instantiations (sm90 only), the variants alternating
    cases += [(*c, None) for c in _fused_fp8_cases([o for o in FUSED_OPS if o in ops],
                                                   FUSED_TRANSPORTS, quick)]
    # The replayable programs (docs/gpu-internals.md §8), captured and replayed: with --graph
    # every row whose program is built replayable, the others skipped with their reason;
    # without, their 16-bit rows chunked and fused on the first shape.
    if graph:
        replayable = [c for c in cases if _not_replayable(c[0], c[1]) is None]
        skipped: dict[str, int] = {}
        for c in cases:
            why = _not_replayable(c[0], c[1])
            if why is not None:
                skipped[why] = skipped.get(why, 0) + 1
        for why, count in skipped.items():
            print(f"  ({count} rows skipped: their programs do not replay yet: {why})")
        cases = []
    else:
        replayable = [(op, transport, dtype, None, SHAPES[0], variant, fused, None)
                      for op, transport, dtype, variant, fused in itertools.product(
                          REPLAYABLE_OPS, REPLAYABLE_TRANSPORTS,
                          FUSED_DTYPES[:1] if quick else FUSED_DTYPES, variants, (False, True))
                      if op in ops and (op in FUSED_OPS or not fused)]
    # The kernel algorithms: one chunk (the kernel has none), captured and replayed.
    cases += [(op, transport, dtype, None, shape, (1, False), False, None)
              for op, transport, dtype, shape
              in itertools.product(KERNEL_OPS, KERNEL_TRANSPORTS, dtypes, shapes)]
    try:
        for row, (op, transport, dtype, fp8, shape, (chunks, bidi), fused, device) in enumerate(
                cases + replayable):
            replay = row >= len(cases)
            captured = op in KERNEL_OPS or replay
            dims = (*shape[0], shape[1] * FAKE_RANKS + _all_rows(op.partition("/")[2]),
                    shape[2])
            gpu = " on a fake B200 (sm_100a)" if device else ""
            name = (f"{op:9s} {transport:9s} {_dtypes_name(dtype, fp8)} "
                    f"{'x'.join(map(str, dims))} chunks={chunks}{' bidi' if bidi else ''}"
                    f"{' fused' if fused else ''}{' replayable' if replay else ''}"
                    f"{f' captured, {REPLAYS} replays' if captured else ''}"
                    f" (CUDA executor on the host-side fake{gpu})")
            table.start(name, cliques=_cuda_fake.cliques)
            start = time.perf_counter()
            ok, detail = _fake_row(_cuda_fake, np, op, transport, dtype, shape, chunks, bidi,
                                   fp8, fused, replays=REPLAYS if captured else 0,
                                   device=device, replayable=replay)
            table.add(name, ok, detail, time.perf_counter() - start, cliques=_cuda_fake.cliques)
    finally:
        _cuda_fake.reset()


def _fused_fp8_cases(ops, transports, quick: bool) -> list[tuple]:
    """The fused GEMM's FP8 rows (cases as ``_fake_rows`` lists them): each instantiation (one
    in quick) in each op and transport, on FP8_SHAPE, the variants alternating."""
    fp8s = FUSED_FP8_DTYPES[:1] if quick else FUSED_FP8_DTYPES
    return [(op, transport, fp8[2], fp8, FP8_SHAPE, VARIANTS[1 + (i + j) % 2], True)
            for (i, fp8), (j, op), transport
            in itertools.product(enumerate(fp8s), enumerate(ops), transports)]


def _loopback_rows(table: Table, module, n: int, quick: bool, fused_why: str | None,
                   fp8_why: str | None, device: int = 0, fake=None,
                   fused_fp8_why: str | None = None) -> None:
    """The selftest's rows of the transports one GPU serves (``LOOPBACK_TRANSPORTS``: FP8 and the
    fused GEMM's included, where the GPU runs them) with ``n`` ranks on GPU ``device``
    (``module.loopback_run``), on one clique per transport."""
    import numpy as np

    shapes = SHAPES[:1] if quick else SHAPES
    dtypes = DTYPES[:1] if quick else DTYPES
    variants = VARIANTS[-1:] if quick else VARIANTS
    transports = LOOPBACK_TRANSPORTS
    cases = [(op, transport, dtype, None, shape, variant, False)
             for op, transport, dtype, shape, variant
             in itertools.product(OPS, transports, dtypes, shapes, variants)]
    if fp8_why is None:
        fp8s = FP8_DTYPES[:1] if quick else FP8_DTYPES
        cases += [(op, transport, fp8[2], fp8, FP8_SHAPE, VARIANTS[1 + (i + j) % 2], False)
                  for (i, fp8), (j, op), transport
                  in itertools.product(enumerate(fp8s), enumerate(FP8_OPS), transports)]
    if fused_why is None:
        cases += [(op, transport, dtype, None, SHAPES[0], variant, True)
                  for op, transport, dtype, variant in itertools.product(
                      FUSED_OPS, [t for t in transports if t in FUSED_TRANSPORTS],
                      FUSED_DTYPES[:1] if quick else FUSED_DTYPES, variants)]
    if fused_why is None and fp8_why is None and fused_fp8_why is None:
        cases += _fused_fp8_cases(
            FUSED_OPS, [t for t in transports if t in FUSED_TRANSPORTS], quick)
    where = f"(loopback: {n} ranks on GPU {device}{', host-side fake' if fake else ''})"
    for op, transport, dtype, fp8, shape, (chunks, bidi), fused in cases:
        dims = (*shape[0], shape[1] * n + op.endswith("one_shot"), shape[2])
        name = (f"{op:9s} {transport:9s} {_dtypes_name(dtype, fp8)} "
                f"{'x'.join(map(str, dims))} chunks={chunks}{' bidi' if bidi else ''}"
                f"{' fused' if fused else ''} {where}")
        table.start(name, cliques=module.cliques)
        start = time.perf_counter()
        try:
            ok, detail = _loopback_row(module, np, n, op, transport, dtype, shape, chunks, bidi,
                                       fp8, fused, device, fake)
        except Exception as e:  # noqa: BLE001 - a row reports, the run goes on
            ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        table.add(name, ok, detail, time.perf_counter() - start, cliques=module.cliques)


def _loopback_report(n: int, device: int, skipped: dict[str, str]) -> dict[str, Any]:
    """What the report says of a loopback run: its ranks and GPU, what one GPU cannot cover,
    and which rows it left out and why."""
    not_covered = dict(LOOPBACK_NOT_COVERED, **skipped)
    print(f"loopback: {n} ranks on GPU {device}; rows not covered by one GPU:")
    for what, why in not_covered.items():
        print(f"  {what}: {why}")
    return dict(ranks=n, device=device, not_covered=not_covered)


def loopback_main(n: int, fake: bool = False, quick: bool = False, report: str | None = None,
                  row_deadline: float | None = None) -> int:
    """``selftest --loopback N`` (``fake``: on the host-side fake): the p2p rows, N ranks on one
    GPU (cpp/cuda/loopback.h). Needs one GPU, not N, and no JAX."""
    from jaxoverlap._executors import capabilities, runtime
    from jaxoverlap._version import __version__

    if n < 2:
        raise ValueError(f"--loopback {n}: the loopback needs at least 2 ranks")
    print(f"jaxoverlap {__version__} selftest --loopback {n}"
          f"{' on the host-side CUDA fake (no GPU is used)' if fake else ''}")
    caps = _gpu_table() if not fake else {}
    skipped: dict[str, str] = {}
    if fake:
        try:
            runtime.load_cuda()
            from jaxoverlap import _cuda_fake as module
        except ImportError as e:
            print(f"  the CUDA executor on the fake is not built: {e}")
            return 1
        module.reset(module.Config(devices=1))
        fused_why = fp8_why = fused_fp8_why = None
        fake_module = module
    else:
        gpus = caps.get("devices", [])
        if not gpus:
            print(f"NO GPU FOUND ({caps.get('error')}): the loopback needs one GPU "
                  "(selftest --fake --loopback N runs it on the host-side fake)")
            return 1
        module = runtime.load_cuda()
        fused_why = capabilities.fused_device_reason("gpu")
        fp8_why = capabilities.gpu_fp8_reason(caps, *FP8_DTYPES[0][:2], devices=[0])
        # the fused GEMM's FP8 instantiations are sm_90a code: a 10.0 GPU runs its 16-bit rows
        fused_fp8_why = next(filter(None, (capabilities.fused_device_reason("gpu", x) for x in
                                           dict.fromkeys(t[0] for t in FUSED_FP8_DTYPES))), None)
        fake_module = None
        print(f"GPU 0: {gpus[0].get('name')}; driver {caps.get('cuda_driver')}, "
              f"cuBLAS {caps.get('cublas')}")
    if fused_why:
        skipped["fused"] = fused_why
    if fp8_why:
        skipped["fp8"] = fp8_why
    if fused_fp8_why and not fused_why and not fp8_why:
        skipped["fused FP8"] = fused_fp8_why
    header = dict(_report_header(caps, fake=fake), loopback=_loopback_report(n, 0, skipped))
    if fake:
        header["topology"] = dict(fake=f"1 fake GPU (sm_90) for {n} ranks")
    table = Table(report=(report, header) if report else None,
                  deadline_s=row_deadline or row_deadline_s())
    try:
        _loopback_rows(table, module, n, quick, fused_why, fp8_why, fake=fake_module,
                       fused_fp8_why=fused_fp8_why)
    finally:
        if fake:
            module.reset()
    status = table.summary(f" (loopback: {n} ranks on one GPU)")
    if report:
        print(f"report written to {report}")
    return status


def _dtypes_name(dtype: str, fp8: tuple[str, str, str] | None) -> str:
    """A row's dtypes: "bfloat16", or an FP8 row's "e4m3 x e5m2 -> float32"."""
    if fp8 is None:
        return f"{dtype:8s}"
    short = {d.name: d.aliases[0] for d in _kinds.DTYPES if d.fp8}
    return f"{short[fp8[0]]} x {short[fp8[1]]} -> {fp8[2]}"


def _versions(caps: dict[str, Any], fake: bool) -> dict[str, Any]:
    import jax

    from jaxoverlap._version import __version__

    out = dict(jaxoverlap=__version__, jax=jax.__version__, python=host_platform.python_version(),
               platform=host_platform.platform())
    for key in ("cuda_driver", "cuda_runtime", "nccl", "cublas"):
        out[key] = caps.get(key)
    try:
        from jaxoverlap._executors import runtime

        out["cuda_extension"] = runtime.load_cuda().build_info()
    except Exception as e:  # noqa: BLE001 - reported, not raised
        out["cuda_extension"] = f"unavailable: {e}"
    if fake:
        out["note"] = ("the CUDA executor ran on the host-side fake: driver, NCCL and cuBLAS "
                       "calls were the fake's, against these headers")
    return out


def _topology(caps: dict[str, Any], fake: bool) -> dict[str, Any]:
    """GPUs, multicast support, the peer-access matrix and the interconnect (nvidia-smi)."""
    if fake:
        return dict(fake=f"{FAKE_RANKS} fake GPUs (sm_90), every pair with peer access, "
                         "multicast supported")
    out: dict[str, Any] = dict(gpus=caps.get("devices", []), peer_access=caps.get("peer_access"),
                               driver_multicast_api=caps.get("driver_multicast_api"),
                               error=caps.get("error"))
    smi = shutil.which("nvidia-smi")
    for key, args in (("nvidia_smi_topo", ("topo", "-m")), ("nvidia_smi_nvlink", ("nvlink", "-s")),
                      ("nvidia_smi_fabric", ("-q", "-d", "FABRIC"))):
        if smi is None:
            out[key] = "nvidia-smi not found"
            continue
        try:
            run = subprocess.run([smi, *args], capture_output=True, text=True, timeout=20)
            out[key] = (run.stdout or run.stderr).strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            out[key] = f"nvidia-smi {' '.join(args)} failed: {e}"
    return out


def _report_header(caps: dict[str, Any], fake: bool) -> dict[str, Any]:
    """What the report says besides the rows: versions, topology, environment."""
    return dict(versions=_versions(caps, fake), topology=_topology(caps, fake),
                environment={k: v for k, v in os.environ.items()
                             if k.startswith(("NCCL_", "CUDA_", "JAXOVERLAP_", "XLA_"))})


def fake_main(quick: bool = False, report: str | None = None,
              row_deadline: float | None = None, graph: bool = False) -> int:
    """``selftest --fake``: the whole table on the CUDA executor against the host-side fake
    (``graph``: only the rows whose call is captured and replayed)."""
    from jaxoverlap._version import __version__

    print(f"jaxoverlap {__version__} selftest on the host-side CUDA fake (no GPU is used)")
    queues, loading = (os.environ.get(v) for v in ("CUDA_DEVICE_MAX_CONNECTIONS",
                                                    "CUDA_MODULE_LOADING"))
    print("Runs the CUDA executor's host code, its enqueue order through the fake's work queues "
          f"({f'CUDA_DEVICE_MAX_CONNECTIONS={queues}' if queues else 'the driver default: 8'};"
          f" module loading {f'CUDA_MODULE_LOADING={loading}' if loading else 'lazy, the default'}"
          "), NCCL's serialisation per communicator, and the kernels' per-element code compiled "
          "for the host; it proves nothing about a GPU's timing.")
    print(f"ranks: {FAKE_RANKS}; ops: {', '.join(OPS)}; transports: "
          f"{', '.join(_kinds.names(_kinds.TRANSPORTS))}; captured and replayed {REPLAYS} times: "
          f"{', '.join(KERNEL_OPS)} over {', '.join(KERNEL_TRANSPORTS)}")
    table = Table(report=(report, _report_header(_gpu_table(), fake=True)) if report else None,
                  deadline_s=row_deadline or row_deadline_s())
    _fake_rows(table, quick=quick, ops=OPS, graph=graph)
    status = table.summary(" (CUDA executor on the fake)")
    if report:
        print(f"report written to {report}")
    return status


def main(quick: bool = False, fake: bool = False, report: str | None = None,
         row_deadline: float | None = None, loopback: int | None = None,
         graph: bool = False) -> int:
    """The selftest. ``report``: the JSON report's path (rewritten after every row);
    ``row_deadline``: seconds a row may take before the process is called hung (default
    ``row_deadline_s()``); ``loopback``: N ranks on one GPU instead (``loopback_main``);
    ``graph`` (with ``fake``): only the rows whose call replays."""
    if graph and not fake:
        raise ValueError("selftest: --graph captures the calls on the CUDA fake only (a GPU "
                         "run through XLA's command buffers is not written yet); add --fake")
    if loopback is not None:
        return loopback_main(loopback, fake=fake, quick=quick, report=report,
                             row_deadline=row_deadline)
    if fake:
        return fake_main(quick=quick, report=report, row_deadline=row_deadline, graph=graph)
    caps = _gpu_table()
    gpus = caps.get("devices", [])
    if not gpus:
        _prepare_host_devices(4)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh

    import jaxoverlap as jo
    from jaxoverlap._executors import capabilities

    devices = jax.devices()
    platform = devices[0].platform
    on_gpu = bool(gpus) and platform in ("gpu", "cuda")
    print(f"jaxoverlap {jo.__version__} selftest; jax {jax.__version__}")
    if on_gpu:
        names = ", ".join(sorted({d["name"] for d in gpus}))
        print(f"GPUs: {len(gpus)} x {names}; driver {caps.get('cuda_driver')}, "
              f"NCCL {caps.get('nccl')}, cuBLAS {caps.get('cublas')}")
    elif gpus:
        print(f"GPUs are present ({len(gpus)}) but JAX runs on {platform!r} (is jax[cuda13] "
              "installed?): testing the host executor only.")
    else:
        print(f"NO GPU FOUND ({caps.get('error')}).")
        print("Running the same checks on host devices with the host executor; this does NOT "
              "test the CUDA executor on a GPU.")
    n = min(len(devices), 8)
    mesh = Mesh(np.array(devices[:n]), ("tp",), axis_types=(AxisType.Auto,))
    transports = capabilities.offered_transports(platform)
    print(f"devices in the test mesh: {n}; transports offered on {platform}: {list(transports)}")
    describe = None
    if on_gpu:
        from jaxoverlap._executors import runtime

        describe = runtime.load_cuda().cliques
    table = Table(report=(report, _report_header(caps, fake=False)) if report else None,
                  deadline_s=row_deadline or row_deadline_s())
    shapes = SHAPES[:1] if quick else SHAPES
    # The fused GEMM's rows where the GPUs run it (docs/gpu-internals.md §5); not on host devices
    # (the host executor's fused programs are the tests').
    fused_why = (capabilities.fused_device_reason(platform) if on_gpu
                 else "not on host devices")
    if fused_why:
        print(f"  (the fused GEMM's rows: skipped, {fused_why})")
    fused_rows = () if fused_why else itertools.product(
        FUSED_OPS, [t for t in FUSED_TRANSPORTS if t in transports], FUSED_DTYPES,
        SHAPES[:1], VARIANTS)
    for op, transport, dtype, shape, (chunks, bidi), fused in itertools.chain(
            ((*c, False) for c in itertools.product(OPS[:3], transports, DTYPES, shapes,
                                                     VARIANTS)),
            ((*c, False) for c in itertools.product(OPS[3:], transports, DTYPES, shapes,
                                                     VARIANTS[:1])),
            ((*c, True) for c in fused_rows)):
        rows = 1 if op.endswith("one_shot") else shape[1] * n  # one-shot: a decode step
        name = (f"{op:9s} {transport:9s} {dtype:8s} "
                f"{'x'.join(map(str, (*shape[0], rows, shape[2])))}"
                f" chunks={chunks}{' bidi' if bidi else ''}{' fused' if fused else ''}")
        table.run(name, functools.partial(_run_row, jo, jax, jnp, np, mesh, op, transport,
                                          dtype, shape, chunks, bidi, fused), cliques=describe)
    fp8_reason = capabilities.gpu_fp8_reason(caps, *FP8_DTYPES[0][:2]) if on_gpu else None
    if fp8_reason is not None:
        print(f"  FP8 rows not run: {fp8_reason}")
    fp8s = () if fp8_reason is not None else FP8_DTYPES[:1] if quick else FP8_DTYPES
    for (i, fp8), (j, op), transport in itertools.product(enumerate(fp8s), enumerate(FP8_OPS),
                                                          transports):
        chunks, bidi = VARIANTS[1 + (i + j) % 2]
        dims = (*FP8_SHAPE[0], FP8_SHAPE[1] * n, FP8_SHAPE[2])
        name = (f"{op:9s} {transport:9s} {_dtypes_name(fp8[2], fp8)} "
                f"{'x'.join(map(str, dims))} chunks={chunks}{' bidi' if bidi else ''}")
        table.run(name, functools.partial(_run_fp8_row, jo, jax, jnp, np, mesh, op, transport,
                                          fp8, FP8_SHAPE, chunks, bidi), cliques=describe)
    if not on_gpu:
        _fake_rows(table, quick=True)
        print("  (the whole table on the CUDA executor: python -m jaxoverlap selftest --fake)")
    status = table.summary("" if on_gpu else "  (no GPU: host executor only)")
    if report:
        print(f"report written to {report}")
    return status
