"""Call sites are named by what they are (docs/native.md §4, ``jaxoverlap/_native/site_key.py``
and ``cpp/core/call.h`` CallSite).

Every process must find the same site for the same custom call whatever else it compiled: the
key comes from the lowering (program, name stack, types, attributes, ordinal), never from the
order of compiles. Calls that JAX lowers once and XLA repeats (a nested jit called three times,
the partitioner's per-call modules under Auto axes) are told apart in the order XLA instantiates
them, and the same program compiled twice is one site.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import testing_ext
from helpers import put, rand, tp_mesh
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap as jo
from jaxoverlap._executors.runtime import load_host

SITE_KEY = re.compile(r"site_key = (-?\d+) : i64")


def _qkv(mesh: Mesh, shape=(8, 16)):
    """Q, K and V of one input: three native calls, same types and attributes."""
    def local(x, wq, wk, wv):
        return tuple(jo.ag_matmul(x, w, "tp", impl="native", transport="p2p")
                     for w in (wq, wk, wv))

    spec_w = P(None, "tp")
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("tp", None),) + (spec_w,) * 3,
                              out_specs=(P(None, "tp"),) * 3))
    x = put(rand(0, shape), mesh, P("tp", None))
    ws = [put(rand(1 + i, (shape[1], 8)), mesh, spec_w) for i in range(3)]
    return f, x, ws


def _site_ids() -> set[str]:
    return set(re.findall(r"/site (0x[0-9a-f]+)/", load_host().cliques()))


def _assert_three_new_sites(f, x, ws) -> None:
    """``f(x, *ws)`` is x @ w for each w, made by three call sites new to this process."""
    before = _site_ids()
    outs = f(x, *ws)
    for y, w in zip(outs, ws, strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ np.asarray(w), rtol=1e-5,
                                   atol=1e-5)
    assert len(_site_ids() - before) == 3


def test_site_keys_name_the_call_not_the_compile():
    mesh = tp_mesh(4, kind=AxisType.Explicit)
    f, x, ws = _qkv(mesh)
    keys = SITE_KEY.findall(f.lower(x, *ws).as_text())
    assert len(keys) == 3 and len(set(keys)) == 3, keys  # Q, K, V: one site each
    again, _, _ = _qkv(mesh)  # a new jit of the same program: the same keys
    assert SITE_KEY.findall(again.lower(x, *ws).as_text()) == keys
    g, x2, ws2 = _qkv(mesh, shape=(8, 24))  # other types: other sites
    assert not set(SITE_KEY.findall(g.lower(x2, *ws2).as_text())) & set(keys)


def _keys_by_weight(order: str) -> dict[str, str]:
    """The site key of each of three alike ag_matmul calls made inside a shard_map in
    ``order``, by the name of the kernel it multiplies."""
    mesh = tp_mesh(kind=AxisType.Explicit)
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P("tp", None)))
    ws = {n: jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(
        mesh, P(None, "tp"))) for n in "qkv"}
    f = jax.jit(jax.shard_map(
        lambda x, ws: {n: jo.ag_matmul(x, ws[n], "tp", impl="native", transport="p2p")
                       for n in order}, mesh=mesh,
        in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp")))
    # jit flattens the dict in sorted order (k, q, v): the body's %arg5, %arg6, %arg7
    calls = re.findall(r"custom_call @jaxoverlap_ag_matmul\(%\w+, %arg(\d+),.*?site_key = "
                       r"(-?\d+)", f.lower(x, ws).as_text())
    return {"kqv"[int(a) - 5]: k for a, k in calls}


def test_alike_calls_are_named_by_their_weight_not_the_trace_order():
    """A loop over a set traces Q, K and V in another order in every process (its hash seed):
    each call's site key follows the kernel it multiplies, not its place in the trace
    (across real processes: test_multiprocess.py)."""
    first, second = _keys_by_weight("qkv"), _keys_by_weight("kvq")
    assert len(first) == 3 and len(set(first.values())) == 3 and first == second, (first,
                                                                                   second)


def _keys_by_input(order: str) -> dict[str, str]:
    """The site key of each of three ag_matmul calls of one kernel on three inputs made inside
    a shard_map in ``order``, by the name of its input."""
    mesh = tp_mesh(kind=AxisType.Explicit)
    xs = {n: jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(
        mesh, P("tp", None))) for n in "qkv"}
    w = jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(mesh, P(None, "tp")))
    f = jax.jit(jax.shard_map(
        lambda xs, w: {n: jo.ag_matmul(xs[n], w, "tp", impl="native", transport="p2p")
                       for n in order}, mesh=mesh,
        in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp")))
    # jit flattens the dict in sorted order (k, q, v): the body's %arg4, %arg5, %arg6
    calls = re.findall(r"custom_call @jaxoverlap_ag_matmul\(%arg(\d+), .*?site_key = "
                       r"(-?\d+)", f.lower(xs, w).as_text())
    return {"kqv"[int(a) - 4]: k for a, k in calls}


def test_calls_of_one_weight_are_named_by_their_input_not_the_trace_order():
    """One kernel on the inputs of a set: once a second such call lowers, every one is keyed
    by where its input comes from (the first re-keyed), so another order gives the same key
    to each input (across real processes: test_multiprocess.py)."""
    first, again, other = _keys_by_input("qkv"), _keys_by_input("qkv"), _keys_by_input("kvq")
    assert len(set(first.values())) == 3 and first == again == other, (first, other)


def _backward_calls(order: str) -> list[tuple[bool, str]]:
    """The native calls of the gradient of one kernel applied to the results of ``order``'s
    kernels inside a shard_map, in the order of the lowered text: (whether its coords come
    out of a dynamic_slice, its site key)."""
    mesh = tp_mesh(kind=AxisType.Explicit)
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P("tp", None)))
    ws = {n: jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(
        mesh, P(None, "tp"))) for n in "qkv"}
    v = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P("tp", None)))
    kw = {"impl": "native", "transport": "p2p"}
    layer = jax.shard_map(
        lambda x, ws, v: {n: jo.matmul_rs(jo.ag_matmul(x, ws[n], "tp", **kw), v, "tp", **kw)
                          for n in order}, mesh=mesh,
        in_specs=(P("tp", None), P(None, "tp"), P("tp", None)), out_specs=P("tp", None))
    grad = jax.jit(jax.grad(lambda x, ws, v: sum(jnp.sum(y) for y in layer(x, ws, v).values())))
    text = grad.lower(x, ws, v).as_text()
    sliced = set(re.findall(r"(%[\w#]+) = stablehlo.dynamic_slice", text))
    return [(c in sliced, k) for c, k in re.findall(
        r"custom_call @jaxoverlap_\w+\(%[\w#]+, %[\w#]+, %[\w#]+, %[\w#]+, (%[\w#]+)\)"
        r".*?site_key = (-?\d+)", text)]


def test_calls_of_a_block_with_alike_calls_run_in_the_order_of_their_keys():
    """The backward pass of one kernel on the results of a set's kernels: whatever order the
    trace met them in, the block's native calls come in one order, each made to wait for the
    one before it (its coords depend on that call's result, docs/native.md §4), so every
    process starts them in the same order."""
    first, other = _backward_calls("qkv"), _backward_calls("kvq")
    keys = [int(k) for _, k in first]
    assert len(keys) == 6 and keys == [int(k) for _, k in other], (first, other)
    # after the first, every call's coords come out of a dynamic_slice made from the last
    assert [gated for gated, _ in first] == [False] + [True] * 5, first
    # calls alike in depth are in the order of their keys: the three ag_matmul of one kernel
    # on the one cotangent lead
    assert keys[:3] == sorted(keys[:3]), keys


def test_alike_calls_around_side_effects_and_with_empty_results_run_right():
    """Two cases the order must survive: a call feeding a print that precedes an unordered
    callback feeding the other call (the side effects keep their order, so the chain follows
    that path: it made a cycle when the depth counted data alone), and alike calls whose
    results hold no element (nothing to wait on: they are passed over as the one to wait on).
    Each program lowers and runs right."""
    from jax.experimental import io_callback

    mesh = tp_mesh(4, kind=AxisType.Explicit)
    x1 = put(rand(31, (8, 16)), mesh, P("tp", None))
    x2 = put(rand(32, (8, 16)), mesh, P("tp", None))
    w = put(rand(33, (16, 8)), mesh, P(None, "tp"))

    def body(x1, x2, w):
        b = jo.ag_matmul(x2 * 3, w, "tp", impl="native")
        jax.debug.print("{}", b.sum() * 0)
        z = io_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(x1.shape, x1.dtype),
                        x1, ordered=False)
        return jo.ag_matmul(z, w, "tp", impl="native"), b

    specs = dict(mesh=mesh, in_specs=(P("tp", None),) * 2 + (P(None, "tp"),),
                 out_specs=(P(None, "tp"),) * 2)
    a, b = jax.jit(jax.shard_map(body, **specs))(x1, x2, w)
    x1_, x2_, w_ = (np.asarray(v, np.float64) for v in (x1, x2, w))
    np.testing.assert_allclose(np.asarray(a), 2 * x1_ @ w_, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(b), 3 * x2_ @ w_, rtol=1e-5, atol=1e-5)
    empty = put(np.zeros((16, 0), np.float32), mesh, P(None, "tp"))
    ys = jax.jit(jax.shard_map(lambda a, b, w: (jo.ag_matmul(a, w, "tp", impl="native"),
                                                 jo.ag_matmul(b, w, "tp", impl="native")),
                               **specs))(x1, x2, empty)
    assert [y.shape for y in ys] == [(8, 0), (8, 0)]


def test_instances_of_one_lowered_call_are_different_sites():
    """A nested jit called three times is lowered once (one site key) and inlined three times
    by XLA; the three instances get three site ids, and each its own clique."""
    mesh = tp_mesh(4, kind=AxisType.Explicit)

    @jax.jit
    def proj(x, w):
        return jo.ag_matmul(x, w, "tp", impl="native", transport="p2p")

    f = jax.jit(jax.shard_map(lambda x, a, b, c: tuple(proj(x, w) for w in (a, b, c)),
                              mesh=mesh, in_specs=(P("tp", None),) + (P(None, "tp"),) * 3,
                              out_specs=(P(None, "tp"),) * 3))
    x = put(rand(4, (8, 20)), mesh, P("tp", None))
    ws = [put(rand(5 + i, (20, 8)), mesh, P(None, "tp")) for i in range(3)]
    assert len(set(SITE_KEY.findall(f.lower(x, *ws).as_text()))) == 1  # lowered once
    _assert_three_new_sites(f, x, ws)


def test_calls_on_global_arrays_under_auto_axes_are_different_sites():
    """Under Auto axes each call lowers in a partitioner module of its own, all alike: the
    three instances of Q, K and V still get three sites."""
    mesh = tp_mesh(4)
    x = put(rand(8, (8, 28)), mesh, P("tp", None))
    ws = [put(rand(9 + i, (28, 8)), mesh, P(None, "tp")) for i in range(3)]
    f = jax.jit(lambda x, *ws: tuple(jo.ag_matmul(x, w, "tp", impl="native", mesh=mesh)
                                     for w in ws))
    _assert_three_new_sites(f, x, ws)


def test_the_same_program_compiled_twice_is_the_same_sites():
    """AOT-compiled, then recompiled after jax.clear_caches() while the first executable lives:
    both executables have the same site ids (their peers in other processes see one program)."""
    mesh = tp_mesh(4, kind=AxisType.Explicit)
    f, x, ws = _qkv(mesh, shape=(8, 36))
    before = _site_ids()
    first = f.lower(x, *ws).compile()
    jax.block_until_ready(first(x, *ws))
    ids = _site_ids() - before
    assert len(ids) == 3
    jax.clear_caches()
    jax.block_until_ready(f(x, *ws))  # a new executable of the same program
    lines = [line for line in load_host().cliques().splitlines()
             if any(f"/site {i}/" in line for i in ids)]
    assert len(lines) == 6, lines  # each site id twice: one in-process clique per executable
    del first


@pytest.mark.slow
def test_a_process_s_other_compiles_do_not_change_the_keys():
    """In fresh processes: the keys of a program are the same whether or not the process
    compiled other programs first, in any order, on other threads."""
    script = textwrap.dedent("""
        import re, sys, threading
        import jax, numpy as np
        from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
        import jaxoverlap as jo
        mesh = Mesh(np.array(jax.devices()[:4]), ("tp",), axis_types=(AxisType.Explicit,))
        def program(k):
            return jax.jit(jax.shard_map(
                lambda x, w: jo.ag_matmul(x, w, "tp", impl="native", transport="p2p"),
                mesh=mesh, in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp")))
        def args(k):
            return (jax.device_put(np.ones((8, k), np.float32),
                                   NamedSharding(mesh, P("tp", None))),
                    jax.device_put(np.ones((k, 8), np.float32),
                                   NamedSharding(mesh, P(None, "tp"))))
        if sys.argv[1] == "busy":
            program(12).lower(*args(12)).compile()
            t = threading.Thread(target=lambda: program(16).lower(*args(16)).compile())
            t.start(); t.join()
        print(re.findall(r"site_key = (-?\\d+) : i64", program(8).lower(*args(8)).as_text()))
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    outs = [subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True,
                           env=env, timeout=120) for mode in ("idle", "busy")]
    for out in outs:
        assert out.returncode == 0, out.stderr
    keys = [out.stdout.strip().splitlines()[-1] for out in outs]
    assert keys[0] == keys[1] and keys[0] != "[]", keys


@pytest.mark.parametrize("kind", ["local", "shm"])
def test_a_rank_runs_the_calls_of_a_site_one_at_a_time_in_order(kind):
    """The parity rule needs each rank to run a site's calls one at a time: a device's call 2,
    started first, waits until its call 1 has run (claimed and released), however the worker
    threads are scheduled; a second device calling as a rank that is inside a call fails at
    once (ClaimRank, on both kinds of clique)."""
    out = testing_ext.load().claim_order(kind)
    assert out["waited"] and out["first"] == "" and out["second"] == "", out
    assert not out["claimed_before_release"], out
    assert out["one"] == "", out
    assert "devices 3 and 4 call as rank 1 at the same time" in out["two_devices"], out
    assert out["two_devices_s"] < 1.0, out
