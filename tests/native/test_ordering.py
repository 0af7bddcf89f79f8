"""Ordering hazards of the native path on XLA:CPU (docs/native.md §4).

XLA:CPU runs thunks as soon as their inputs are ready, possibly in a different
order on each device, and custom calls get no ordering resource. Two hazards
follow, and both are tested here:

* A handler that blocks the device thread until its peers arrive deadlocks
  with an independent XLA collective that some devices run first (XLA then
  aborts the whole process after 40 s). The handlers are asynchronous.
* Independent native calls with the same shapes that devices run in a
  different order would exchange the wrong data if they shared epochs. Every
  call site has its own clique.

Each scenario runs in a subprocess with a hard timeout: XLA's fatal
rendezvous abort would otherwise take pytest down with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from jaxoverlap import _kinds

PRELUDE = """
import os, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
import native_shard
from helpers import absent, f64, late, rand, tp_mesh
from jaxoverlap._executors.runtime import load_host

STALL = {"on": False}

def stalled(x, rank):
    # x on `rank`, while STALL["on"], only once a clique has broken (helpers.absent).
    return absent(x, rank, lambda: STALL["on"])

def perturb(seconds):
    # Competes for the cores from another thread, so that devices drift apart in time.
    import threading
    def spin():
        a = np.random.default_rng(0).standard_normal((192, 192))
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            a = np.tanh(a @ a)
    threading.Thread(target=spin, daemon=True).start()
"""


def run(body: str, timeout: float = 240.0) -> str:
    """Runs PRELUDE + body on 8 host devices; fails on a hang, a crash or an error."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # helpers
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests, env.get("PYTHONPATH")) if p)
    code = PRELUDE + textwrap.dedent(body)
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=timeout, cwd=os.path.dirname(__file__))
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"hung for {timeout} s (deadlock?); stderr:\n{(err.stderr or '')[-3000:]}")
    assert proc.returncode == 0, (
        f"exit code {proc.returncode}\nstdout:\n{proc.stdout[-2000:]}\n"
        f"stderr:\n{proc.stderr[-4000:]}")
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["nccl", "p2p"])
def test_native_calls_next_to_independent_xla_collectives(transport):
    """Native calls and independent psums in one program, many times, no deadlock."""
    out = run(f"""
        n = 8
        mesh = tp_mesh(n)
        x1, w1 = rand(1, (2, n * 32, 64)), rand(2, (64, n * 32))
        x2, w2 = rand(3, (2, n * 32, n * 32)), rand(4, (n * 32, 48))
        b1, b2 = rand(5, (n, 256)), rand(6, (n, 256))

        def body(x1, w1, x2, w2, b1, b2):
            y1 = native_shard.ag_matmul(x1, w1, axis_name="tp", axis=1,
                                        transport="{transport}", timeout_s=20.0)
            s1 = lax.psum(b1, "tp")
            y2 = native_shard.matmul_rs(x2, w2, axis_name="tp", axis=1,
                                        transport="{transport}", timeout_s=20.0)
            s2 = lax.psum(jnp.tanh(b2), "tp")
            return y1, s1, y2, s2

        f = jax.jit(jax.shard_map(
            body, mesh=mesh,
            in_specs=(P(None, "tp", None), P(None, "tp"), P(None, None, "tp"), P("tp", None),
                      P("tp"), P("tp")),
            out_specs=(P(None, None, "tp"), P(), P(None, "tp", None), P())))
        perturb(60)
        want = (f64(x1) @ f64(w1), f64(b1).reshape(n, 1, 256).sum(0),
                f64(x2) @ f64(w2), np.tanh(f64(b2)).reshape(n, 1, 256).sum(0))
        for i in range(60):
            got = f(x1, w1, x2, w2, b1, b2)
            for g, e in zip(got, want):
                np.testing.assert_allclose(f64(g), e, rtol=1e-4, atol=1e-3)
        print("ok")
    """)
    assert "ok" in out


@pytest.mark.slow
def test_flax_mlp_forward_backward_with_bias_at_tp8():
    """The reproducer: ParallelMLP fwd+bwd (the bias gradient is an XLA psum) at tp=8."""
    out = run("""
        import flax.linen as nn
        from jaxoverlap.flax.linen import ParallelMLP

        class Reference(nn.Module):
            features: int
            @nn.compact
            def __call__(self, x):
                h = nn.Dense(self.features, name="up")(x)
                return nn.Dense(x.shape[-1], name="down")(nn.gelu(h))

        n, B, S, H, F = 8, 2, 256, 256, 1024
        mesh = tp_mesh(n)
        x = rand(0, (B, S, H))
        params = Reference(F).init(jax.random.key(1), x)
        params = jax.tree.map(lambda a: a + 0.01, params)     # nonzero biases

        def step_of(apply):
            def loss(params, x):
                return jnp.sum(apply(params, x).astype(jnp.float32) ** 2)
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

        model = ParallelMLP(F, impl="native", mesh=mesh)
        step = step_of(model.apply)
        xs = jax.device_put(x, NamedSharding(mesh, P(None, "tp", None)))
        want = step_of(Reference(F).apply)(jax.tree.map(np.asarray, params), np.asarray(x))
        want = jax.tree.map(f64, want)
        perturb(90)
        for i in range(80):
            got = jax.tree.map(f64, step(params, xs))
            jax.tree.map(lambda g, e: np.testing.assert_allclose(
                g, e, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(e).max())), got, want)
        print("ok")
    """)
    assert "ok" in out


# The three calls of test_three_independent_calls_with_identical_shapes: AG+GEMM (Q, K, V-like
# projections) and matmul_ar's one-shot (decode steps: 3 rows on 8 ranks), as
# (inputs, the call on t, in_specs, out_specs) in the script's terms.
THREE_CALLS = {
    "ag_matmul": (
        "xs = [rand(10 + i, (2, n * 16, 64)) for i in range(3)]; w = rand(20, (64, n * 16)); "
        "zero = jnp.zeros((n, 2, 16, 64), jnp.float32)",
        "native_shard.ag_matmul(t, w, axis_name='tp', axis=1, transport=TRANSPORT, "
        "timeout_s=20.0)",
        "(P(None, 'tp', None),) * 3 + (P(None, 'tp'), P('tp'))", "(P(None, None, 'tp'),) * 3"),
    "matmul_ar_one_shot": (
        "xs = [rand(10 + i, (1, 3, n * 8)) for i in range(3)]; w = rand(20, (n * 8, 32)); "
        "zero = jnp.zeros((n, 1, 3, 8), jnp.float32)",
        "native_shard.matmul_ar(t, w, axis_name='tp', transport=TRANSPORT, "
        "algorithm='one_shot', timeout_s=20.0)[None]",  # every rank's copy, stacked
        "(P(None, None, 'tp'),) * 3 + (P('tp', None), P('tp'))", "(P('tp'),) * 3"),
}


@pytest.mark.slow
@pytest.mark.parametrize("op", list(THREE_CALLS))
@pytest.mark.parametrize("transport", _kinds.names(_kinds.TRANSPORTS))
def test_three_independent_calls_with_identical_shapes(transport, op):
    """Q, K, V-like projections (or three decode-step all-reduces): same shapes, distinct data,
    next to an XLA collective, each late on different ranks; every result is its own (and a
    replicated one the same bits on every rank)."""
    inputs, call, in_specs, out_specs = THREE_CALLS[op]
    out = run(f"""
        n = 8
        TRANSPORT = "{transport}"
        mesh = tp_mesh(n)
        {inputs}
        big = rand(21, (256, 256)) / 16

        def body(a, b, c, w, z):
            r = lax.axis_index("tp")
            a = a + lax.psum(z[0], "tp")     # an XLA collective in front of one call
            ts = [late(t, r, j, big) for j, t in enumerate((a, b, c))]
            return tuple({call} for t in ts)

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs={in_specs},
                                  out_specs={out_specs}, check_vma=False))
        want = [f64(x) @ f64(w) for x in xs]
        perturb(60)
        for i in range(50):
            got = f(*xs, w, zero)
            for j, (g, e) in enumerate(zip(got, want)):
                copies = f64(g).reshape(-1, *e.shape)
                assert all((c == copies[0]).all() for c in copies), (i, j)
                np.testing.assert_allclose(copies[0], e, rtol=1e-5, atol=1e-4,
                                           err_msg=f"iteration {{i}}, call {{j}}")
        # One clique per call site.
        sites = [line for line in load_host().cliques().splitlines() if "8 ranks" in line]
        assert len(sites) == 3, sites
        print("ok")
    """)
    assert "ok" in out


@pytest.mark.slow
@pytest.mark.parametrize("transport", _kinds.names(_kinds.TRANSPORTS, fused=True))
def test_three_fused_rs_calls_in_flight_at_uneven_speeds(transport):
    """The fused GEMM + reduce-scatter (the reduction beside the kernel, sub-chunk by sub-chunk)
    three times in one program, each call late on different ranks, the cores perturbed: every
    result is exact (small integers: every partial and every sum is a bf16 integer, so any
    misrouted, missed or doubled block shows, whatever order the sums take)."""
    out = run(f"""
        n = 8
        rng = np.random.default_rng(3)
        ints = lambda shape: jnp.asarray(rng.integers(-2, 3, shape), jnp.bfloat16)
        xs = [ints((2, n * 16, n * 8)) for _ in range(3)]
        w = ints((n * 8, 16))
        zero = jnp.zeros((n, 2, n * 16, 8), jnp.bfloat16)
        big = rand(21, (256, 256)) / 16

        def body(a, b, c, w, z):
            r = lax.axis_index("tp")
            a = a + lax.psum(z[0], "tp")
            return tuple(native_shard.matmul_rs(late(t, r, j, big), w, axis_name="tp", axis=1,
                                                transport="{transport}", chunks=2,
                                                fused=True, timeout_s=20.0)
                         for j, t in enumerate((a, b, c)))

        spec = P(None, None, "tp")
        f = jax.jit(jax.shard_map(body, mesh=tp_mesh(n), in_specs=(spec,) * 3 + (
            P("tp", None), P("tp")), out_specs=(P(None, "tp", None),) * 3))
        text = f.lower(*xs, w, zero).as_text()
        assert text.count("fused = true") == 3, [l for l in text.splitlines() if "fused" in l]
        want = [f64(x) @ f64(w) for x in xs]
        perturb(40)
        for i in range(30):
            for j, (g, e) in enumerate(zip(f(*xs, w, zero), want)):
                np.testing.assert_array_equal(f64(g), e, err_msg=f"iteration {{i}}, call {{j}}")
        print("ok")
    """)
    assert "ok" in out


@pytest.mark.slow
def test_missing_peer_still_times_out_quickly_and_cleanly():
    """With async handlers the timeout error still names clique, epoch, rank and peer."""
    out = run("""
        mesh = tp_mesh(4)
        x = jnp.ones((2, 8, 8), jnp.float32)
        w = jnp.ones((8, 4), jnp.float32)
        def make():
            return jax.jit(jax.shard_map(
                lambda x, w: native_shard.ag_matmul(stalled(x, 2), w, axis_name="tp",
                                                    axis=1, transport="p2p", timeout_s=0.5),
                mesh=mesh, in_specs=(P(None, "tp", None), P(None, "tp")),
                out_specs=P(None, None, "tp")))
        f = make()
        f(x, w).block_until_ready()
        STALL["on"] = True   # rank 2 comes to the next call after its peers' 0.5 s timeout
        try:
            f(x, w).block_until_ready()
            raise SystemExit("no error")
        except jax.errors.JaxRuntimeError as err:
            message = str(err)
        STALL["on"] = False
        # JAX reports one device's error: the root cause (DEADLINE_EXCEEDED) or a peer's
        # ABORTED, which quotes it.
        assert "DEADLINE_EXCEEDED" in message or "ABORTED" in message, message
        assert "timeout after 0.500 s" in message, message
        assert "missing peer rank(s) 2 did not arrive" in message, message
        for part in ("ag_matmul", "clique 0x", "epoch 2", "rank "):
            assert part in message, (part, message)
        # The clique is broken: the next call, every rank present, fails saying so.
        try:
            f(x, w).block_until_ready()
            raise SystemExit("no error after the failure")
        except jax.errors.JaxRuntimeError as err:
            assert "ABORTED" in str(err) or "aborted" in str(err), str(err)
        # A broken clique belongs to its call site: a new executable has a fresh one.
        np.testing.assert_allclose(np.asarray(make()(x, w)), np.full((2, 8, 4), 8.0))
        print("ok")
    """, timeout=120)
    assert "ok" in out
