"""What the tests of the CUDA executor on its fake share: a call's problem, its inputs, the calls
played on every rank, and the check against a float64 reference.

``_cuda_fake.run(problem, xs=, ws=, devices=, **played)`` (``fake_harness.h``, ``PlayCalls``)
takes the problem as ``_host.build_program`` gives it (:func:`problem` makes one) and the played
calls' settings by name; :func:`run_case` makes the inputs, plays them and returns what the fake
gave back, :func:`check` holds it to the reference. No JAX.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jaxoverlap import _kinds, _selftest

OPS = _kinds.names(_kinds.OPS)
TRANSPORTS = _kinds.names(_kinds.TRANSPORTS)
# Every dtype's NumPy type (ml_dtypes has the ones NumPy lacks).
NP = {d: getattr(ml_dtypes, d, None) or np.dtype(d).type for d in _kinds.names(_kinds.DTYPES)}
# The dtypes of calls without fp8 operands, and what each checks within.
DTYPES = {d: NP[d] for d in _kinds.names(_kinds.DTYPES, fp8=False)}
TOL = {"float32": dict(rtol=1e-5, atol=1e-4), "bfloat16": dict(rtol=2e-2, atol=3e-2),
       "float16": dict(rtol=2e-2, atol=3e-2)}


def problem(op: str, transport: str, n: int, *, batch: int = 2, rows: int = 3, k: int = 8,
            nw: int = 6, dtype: str = "float32", **fields) -> dict:
    """The problem of a call (the keys of ``_host.build_program``'s dict): ``rows`` per shard
    (per block for the reductions, all of them for a one-shot), ``nw`` output columns; ``fields``
    any other of its keys (chunks, bidirectional, return_gathered, algorithm, fused, tf32,
    w_dtype, out_dtype)."""
    return dict(op=op, transport=transport, nranks=n, batch=batch, rows=rows, k=k, n=nw,
                dtype=dtype, **fields)


def x_rows(p: dict) -> int:
    """Rows of each rank's x in a problem (by its op's rows rule): the local shard, or the N
    blocks, or for a one-shot all of them."""
    one_shot = not _kinds.ar_algorithm(p.get("algorithm", "two_shot")).splits_rows
    gather = _kinds.op(p["op"]).rows == "gather"
    return p["rows"] if gather or one_shot else p["rows"] * p["nranks"]


def inputs(p: dict, seed: int = 0) -> tuple[list, list]:
    """Per rank, random x and w of the problem, in its dtype."""
    rng = np.random.default_rng(seed)
    np_dtype = NP[p["dtype"]]
    xs = [rng.standard_normal((p["batch"], x_rows(p), p["k"])).astype(np.float32)
          .astype(np_dtype) for _ in range(p["nranks"])]
    ws = [rng.standard_normal((p["k"], p["n"])).astype(np.float32).astype(np_dtype)
          for _ in range(p["nranks"])]
    return xs, ws


def play(fake, p: dict, xs, ws, devices=None, **played) -> dict:
    """``fake.run`` of the problem on per-rank inputs (arrays, or bytes as the handler takes
    them), on GPUs ``devices`` (one per rank: 0..N-1 by default)."""
    devices = list(range(p["nranks"])) if devices is None else devices
    return fake.run(p, xs=[a if isinstance(a, bytes) else a.tobytes() for a in xs],
                    ws=[a if isinstance(a, bytes) else a.tobytes() for a in ws],
                    devices=devices, **played)


def run_case(fake, op, transport, n, *, batch=2, rows=3, k=8, nw=6, dtype="float32", chunks=1,
             bidirectional=False, return_gathered=False, devices=None, calls=1, clique_key=7,
             timeout_ms=120000, algorithm="two_shot", seed=0, **fields):
    """Plays one case on fresh random inputs: (what the fake gave back, xs, ws)."""
    p = problem(op, transport, n, batch=batch, rows=rows, k=k, nw=nw, dtype=dtype, chunks=chunks,
                bidirectional=bidirectional, return_gathered=return_gathered,
                algorithm=algorithm, **fields)
    xs, ws = inputs(p, seed)
    out = play(fake, p, xs, ws, devices, clique_key=clique_key, calls=calls,
               timeout_ms=timeout_ms)
    return out, xs, ws


def reference(op, xs, ws, rows):
    """Every rank's y in float64 (and the gathered x of an all-gather, else None)."""
    x64 = [x.astype(np.float64) for x in xs]
    w64 = [w.astype(np.float64) for w in ws]
    rule = _kinds.op(op).rows
    if rule == "gather":
        gathered = np.concatenate(x64, axis=1)
        return [gathered @ w for w in w64], gathered
    total = sum(x @ w for x, w in zip(x64, w64, strict=True))
    if rule == "all":  # every rank holds the whole sum
        return [total] * len(xs), None
    return [total[:, r * rows:(r + 1) * rows] for r in range(len(xs))], None


def check(fake, out, op, xs, ws, rows, dtype, return_gathered=False):
    """Every rank finished, the fake saw no misuse, and y (and the gathered x) match."""
    assert out["statuses"] == [None] * len(xs), out["statuses"]
    assert out["drained"], fake.errors()
    assert fake.errors() == []
    refs, gathered = reference(op, xs, ws, rows)
    np_dtype = NP[dtype]
    for r, (y, ref) in enumerate(zip(out["ys"], refs, strict=True)):
        got = np.frombuffer(y, np_dtype).reshape(ref.shape).astype(np.float64)
        np.testing.assert_allclose(got, ref, **TOL[dtype], err_msg=f"rank {r}")
    if _kinds.op(op).collective == "all_reduce":  # the same sum everywhere, bit for bit (psum)
        assert all(y == out["ys"][0] for y in out["ys"]), "ranks' sums differ"
    if return_gathered:
        for g in out["x_gathered"]:
            got = np.frombuffer(g, np_dtype).reshape(gathered.shape).astype(np.float64)
            np.testing.assert_array_equal(got, gathered)


# ---------------------------------------------------------------- the fused GEMM


def _gemm(x, w, dtype):
    """The reference GEMM of the fake (its cuBLASLt and its fused kernel alike): every product
    in float32, summed over K in order, rounded once to ``dtype``."""
    x32, w32 = x.astype(np.float32), w.astype(np.float32)
    acc = np.zeros(x.shape[:-1] + (w.shape[1],), np.float32)
    for p in range(x.shape[-1]):
        acc = acc + x32[..., p:p + 1] * w32[p]
    return acc.astype(DTYPES[dtype])


def _fused_expected(op, transport, xs, ws, rows, dtype):
    """Every rank's y as the fused program computes it (None where the order is the switch's:
    the multicast reduce-scatter sums in the switch, checked against the derived bound)."""
    n = len(xs)
    if op == "ag_matmul":
        gathered = np.concatenate(xs, axis=1)
        return [_gemm(gathered, w, dtype) for w in ws]
    if transport == "multicast":
        return [None] * n
    out = []
    for r in range(n):
        partial = [_gemm(xs[i][:, r * rows:(r + 1) * rows], ws[i], dtype) for i in range(n)]
        acc = np.zeros(partial[0].shape, np.float32)  # every rank's partial in rank order, in
        for i in range(n):                             # float32, rounded once (the Reduce)
            acc = acc + partial[i].astype(np.float32)
        out.append(acc.astype(DTYPES[dtype]))
    return out


def run_fused(fake, op, transport, n, *, batch, rows, k, nw, dtype, chunks, bidirectional,
              gathered=False, calls=1, seed=0, fused=True):
    p = problem(op, transport, n, batch=batch, rows=rows, k=k, nw=nw, dtype=dtype, chunks=chunks,
                bidirectional=bidirectional, return_gathered=gathered, fused=fused)
    xs, ws = inputs(p, seed)
    out = play(fake, p, xs, ws, list(range(n)), calls=calls)
    return out, xs, ws


def check_fused(fake, out, op, transport, xs, ws, rows, dtype, gathered=False):
    assert out["statuses"] == [None] * len(xs), out["statuses"]
    assert out["drained"], fake.errors()
    assert fake.errors() == []
    expected = _fused_expected(op, transport, xs, ws, rows, dtype)
    n, k = len(xs), xs[0].shape[-1]
    if any(want is None for want in expected):  # the switch's sums: float64 and the bound
        x64 = np.concatenate([x.astype(np.float64) for x in xs], axis=-1)
        w64 = np.concatenate([w.astype(np.float64) for w in ws], axis=0)
        y64 = x64 @ w64
    for r, (y, want) in enumerate(zip(out["ys"], expected, strict=True)):
        got = np.frombuffer(y, DTYPES[dtype])
        if want is not None:
            np.testing.assert_array_equal(got.reshape(want.shape).view(np.uint16),
                                          want.view(np.uint16), err_msg=f"rank {r}")
            continue
        ref = y64[:, r * rows:(r + 1) * rows]
        err = np.abs(got.reshape(ref.shape).astype(np.float64) - ref)
        limit = _selftest.bound(op, dtype, n, k, x64[:, r * rows:(r + 1) * rows], w64)
        assert (err <= limit).all(), f"rank {r}: {err.max()} > the derived bound"
    if gathered:
        want = np.concatenate(xs, axis=1)
        for g in out["x_gathered"]:
            np.testing.assert_array_equal(np.frombuffer(g, DTYPES[dtype]).reshape(want.shape)
                                          .view(np.uint16), want.view(np.uint16))


def spanning(fake, key, processes, group=0):
    """A clique spanning played processes gets one NCCL unique id, as bootstrap hands it out."""
    uid = fake.nccl_unique_id()
    for p in sorted(set(processes)):
        fake.set_nccl_id(key, group, p, uid)
