"""TF32 on the CUDA executor, on the fake: what precision does to a float32 result.

The native ops hand the executor ``tf32`` (tests/test_precision.py: true below HIGHEST); the
executor then asks cuBLASLt for ``CUBLAS_COMPUTE_32F_FAST_TF32``, and the fake's cuBLASLt rounds
each input to TF32's 10-bit mantissa, as tensor cores do. A float32 result computed so misses the
selftest's float32 bound against a float64 reference — the reason the selftest compares at
HIGHEST — while the same call at HIGHEST meets it.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxoverlap._selftest import bound, rank_products

from .fake_cases import OPS, TRANSPORTS, inputs, play, problem

# The CUDA executor on its fake, driven directly: no JAX.
pytestmark = pytest.mark.jax_independent


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_tf32_only_when_asked_and_it_shows(fake, op, transport):
    n, batch, rows, k, nw = 4, 2, 4, 256, 8
    xs, ws = inputs(problem(op, "nccl", n, batch=batch, rows=rows, k=k, nw=nw))
    products = rank_products(np, op, xs, ws, rows)
    refs = [a @ b for a, b in products]
    allowed = [bound(op, "float32", n, k, a, b) for a, b in products]
    errors = {}
    for tf32 in (False, True):
        fake.reset()
        out = play(fake, problem(op, transport, n, batch=batch, rows=rows, k=k, nw=nw, chunks=2,
                                 tf32=tf32), xs, ws, list(range(n)))
        assert out["drained"] and fake.errors() == [] and all(s is None for s in out["statuses"])
        ys = [np.frombuffer(y, np.float32).reshape(r.shape) for y, r in zip(out["ys"], refs,
                                                                            strict=True)]
        errors[tf32] = max(float(np.max(np.abs(y - r))) for y, r in zip(ys, refs, strict=True))
        close = all(np.all(np.abs(y - r) <= a) for y, r, a in zip(ys, refs, allowed,
                                                                    strict=True))
        assert close != tf32, (tf32, errors)
    assert errors[True] > 10 * errors[False]


def test_tf32_is_dropped_for_half_matrices(fake):
    """FAST_TF32 is a compute type for float32 matrices only: the executor never asks for it
    with bf16, even when told tf32 (the fake would refuse it)."""
    p = problem("ag_matmul", "nccl", 2, batch=1, rows=4, k=8, nw=4, dtype="bfloat16", tf32=True)
    xs, ws = inputs(p)
    out = play(fake, p, xs, ws, [0, 1])
    # The executor drops the bit for non-float32 problems, so nothing is refused ...
    assert fake.errors() == [] and all(s is None for s in out["statuses"])
    # (the rule itself is broken on purpose in test_fake's misuse checks).
