"""Real processes joined by jax.distributed on loopback (see harness.py and worker.py).

Each test starts its own job: 2 or 4 processes with 1 or 2 CPU devices each. The harness kills
every child at its deadline and fails the test if a shared-memory segment is left behind.
"""

from __future__ import annotations

import os
import re

import pytest

from jaxoverlap import _kinds

from . import harness

# Real processes: seconds each.
pytestmark = pytest.mark.slow

TRANSPORTS = list(_kinds.names(_kinds.TRANSPORTS))


@pytest.mark.jax_api
@pytest.mark.parametrize("nprocs,devices", [(2, 2)])
def test_portable_impls_across_processes(nprocs, devices):
    procs = harness.run("portable", nprocs, devices, params={"impls": ["xla", "ring"]})
    for p in procs:
        assert len(p.result()["checked"]) == 8, p.stdout


@pytest.mark.jax_api
@pytest.mark.parametrize("nprocs,devices", [(2, 2), (4, 1)])
def test_native_every_transport_fwd_and_bwd(nprocs, devices):
    """Both ops, forward and gradients, and matmul_ar's one-shot on one row, every transport,
    against float64 NumPy.

    With 2 processes x 2 devices the one clique mixes threads and processes; with 4 x 1 every
    rank is its own process.
    """
    procs = harness.run("native", nprocs, devices, params={"transports": TRANSPORTS})
    for p in procs:
        result = p.result()
        assert len(result["checked"]) == 2 * 2 * len(TRANSPORTS), p.stdout
        assert result["one_shot"] == list(TRANSPORTS), p.stdout  # matmul_ar, one row
        # Every clique of the run spans processes (none fell back to an in-process clique):
        # one domain per transport, and every call site's clique in it.
        cliques = result["cliques"].strip().splitlines()
        domains = [c for c in cliques if ": domain of" in c]
        assert len(domains) == len(TRANSPORTS), cliques
        assert all(f"shared memory across {nprocs} processes" in c for c in cliques), cliques
        # Nothing of the job has a name in /dev/shm while it runs (segments are memfds).
        assert result["linked"] == [], result["linked"]


def test_native_bfloat16_across_processes():
    procs = harness.run("native", 2, 1, params={"transports": TRANSPORTS, "dtype": "bfloat16",
                                                "axes": [1]})
    assert all(len(p.result()["checked"]) == 2 * len(TRANSPORTS) for p in procs)


def test_native_fused_across_processes():
    """The fused programs (one FusedGemm waiting on per-block flags) on cliques spanning
    processes: 2 processes x 2 devices, both ops over p2p and multicast, each call site's clique
    in shared memory across the processes."""
    procs = harness.run("fused", 2, 2, params={"transports": ["p2p", "multicast"]},
                        env={"JAXOVERLAP_FUSED": "1"})
    for p in procs:
        result = p.result()
        assert len(result["checked"]) == 4, p.stdout
        assert "shared memory across 2 processes" in result["cliques"], result["cliques"]


def test_native_fp8_across_processes():
    """fp8 operands, every rank with its own scales, every op and transport; with 2 processes x
    2 devices each clique mixes threads and processes, and the shards' scales cross both."""
    procs = harness.run("fp8", 2, 2, params={"transports": TRANSPORTS})
    assert all(len(p.result()["checked"]) == 3 * len(TRANSPORTS) for p in procs)


def test_native_mxfp8_across_processes():
    """Block scales (MXFP8) on the host executor with cliques spanning processes (2 x 2
    devices): each sub-chunk's e8m0 scale rows cross processes with its rows, on every
    transport, and every rank's y is the reference bit for bit."""
    procs = harness.run("mxfp8", 2, 2, params={"transports": TRANSPORTS})
    assert all(p.result()["checked"] == list(TRANSPORTS) for p in procs)


def test_mixed_meshes_interleaved_ring_and_growth():
    """A ring alternating processes, dp x tp with tp inside / across processes, growing shapes,
    and a user's own shard_map (refused without the concrete mesh, right under jax.set_mesh)."""
    procs = harness.run("mixed", 2, 2)
    for p in procs:
        result = p.result()
        assert result["checked"] == ["interleaved ring", "tp within a process",
                                     "tp across processes", "growth", "user shard_map"], p.stdout
        kinds = result["cliques"]
        assert "in-process" in kinds and "shared memory across 2 processes" in kinds, kinds
        assert result["linked"] == [], result["linked"]  # nothing named in /dev/shm


# JAX's own failure handling: its coordination service (in process 0) sees the lost process go
# and may terminate the others (seen on a loaded 2-core machine). What a survivor reported before
# that is still ours; a survivor terminated before it reported leaves nothing to check, and the
# scenario runs once more.
_JAX_TERMINATED = "Terminating process because the JAX distributed service detected fatal errors"


def _lose_a_peer(mode: str, timeout_s: float) -> list[dict]:
    """Runs the peer_loss scenario (3 processes, process 1 lost); the survivors' results."""
    for attempt in range(2):
        procs = harness.run("peer_loss", 3, 1,
                            params={"victim": 1, "mode": mode, "timeout_s": timeout_s},
                            timeout_s=150, expect_success=False)  # a hang fails at 150 s
        survivors = [p for p in procs if p.process_id != 1]
        for p in survivors:  # exited cleanly, or was terminated by JAX's service
            assert p.returncode == 0 or _JAX_TERMINATED in p.stderr, harness.describe(procs)
        if all(p.result() for p in survivors):
            break
        assert attempt == 0, harness.describe(procs)
    results = [p.result() for p in survivors]
    for result in results:
        error = result["error"]
        assert error is not None, result
        assert "DEADLINE_EXCEEDED" in error or "ABORTED" in error, error
        assert "clique 0x" in error and "epoch 1" in error, error  # g's first call
    return results


@pytest.mark.jax_api
@pytest.mark.parametrize("mode", ["exit", "kill"])
def test_a_dead_peer_is_reported_within_seconds_not_at_the_timeout(mode):
    """A peer that exits between calls, or is killed inside one, is seen dead (its pid) by the
    waits of the others, which fail saying so, not at their timeout (ten minutes: the harness
    fails the test at 150 s)."""
    for result in _lose_a_peer(mode, timeout_s=600.0):
        error = result["error"]
        assert "peer process 1 (pid " in error and "has exited" in error, error
        assert "rank(s) 1 will never arrive" in error, error
        assert "timeout after" not in error, error


def test_a_stalled_peer_gives_a_timeout_error_naming_it_not_a_hang():
    timeout_s = 4.0
    for result in _lose_a_peer("stall", timeout_s=timeout_s):
        error = result["error"]
        assert "timeout after 4.000 s" in error and "missing peer rank(s) 1 did not arrive" in error
        assert "rank 1 (process 1)" in error, error
        # (No hang: the harness fails the test at 150 s. A survivor that started its call later
        # than the one that timed out is woken earlier, by the broken clique.)


def test_a_process_that_never_bootstraps_is_named_by_the_leader():
    procs = harness.run("bootstrap_missing", 2, 1, params={"timeout_s": 3.0}, timeout_s=120,
                        expect_success=False)
    result = procs[0].result()
    assert procs[0].returncode == 0, harness.describe(procs)
    assert "BootstrapError" in result["error"], result
    assert "process(es) [1] did not attach to host clique" in result["error"], result
    assert result["elapsed_s"] >= 2.5, result  # not before its 3 s timeout
    assert result["leftover"] == [], result  # nothing named in /dev/shm after the error


@pytest.mark.parametrize("role", ["follower", "leader"])
def test_a_process_that_dies_in_the_bootstrap_is_named_at_once(role):
    """A peer whose pid the bootstrap knows and that dies in it (a follower before attaching,
    the leader before its verdict) is reported within a second or so, naming it, not after
    the timeout (60 s here)."""
    for attempt in range(2):
        procs = harness.run("bootstrap_death", 2, 1, params={"role": role, "timeout_s": 60.0},
                            timeout_s=120, expect_success=False)
        survivor = procs[0]
        assert survivor.returncode == 0 or _JAX_TERMINATED in survivor.stderr, \
            harness.describe(procs)
        if survivor.result():
            break
        assert attempt == 0, harness.describe(procs)
    result = survivor.result()
    assert procs[1].returncode == 7, harness.describe(procs)
    error = result["error"]
    assert error is not None and "BootstrapError" in error, result
    assert "process 1 (pid " in error and "exited during" in error, error
    assert ("the leader of host clique" in error) == (role == "leader"), error
    assert result["elapsed_s"] < 20, result   # the timeout is 60 s


def test_a_failed_bootstrap_recovers_when_the_call_is_retried():
    procs = harness.run("bootstrap_retry", 2, 1, params={"timeout_s": 3.0}, timeout_s=150)
    leader, late = procs[0].result(), procs[1].result()
    assert len(leader["errors"]) == 1, leader
    assert "process(es) [1] did not attach to host clique" in leader["errors"][0], leader
    assert late["errors"] == [], late  # it joined the second attempt, never the failed one
    for result in (leader, late):
        assert "BROKEN" not in result["cliques"], result["cliques"]
        assert result["linked"] == [], result


@pytest.mark.parametrize("nprocs,devices", [(2, 2), (4, 1)])
def test_independent_calls_in_flight_with_rank_skew_are_right(nprocs, devices):
    """Q/K/V-style: three independent native calls over one mesh axis in one program, ranks
    at uneven speeds (a different rank sleeps before a different call every step), forward
    and backward, every transport. Not one shard may be wrong, and nothing may fail."""
    procs = harness.run("qkv", nprocs, devices,
                        params={"transports": TRANSPORTS, "steps": 12, "skew_s": 0.03},
                        timeout_s=400)
    for p in procs:
        assert p.result()["wrong"] == {t: 0 for t in TRANSPORTS}, p.stdout


@pytest.mark.jax_api
def test_identical_calls_traced_in_another_order_per_process_are_matched_by_what_they_compute():
    """A loop over a set of names, with a hash seed of its own in each process: each process
    traces the same calls in another order (checked), native on every transport, inside a
    shard_map and on global arrays, forward and backward; every shard is right."""
    procs = harness.run("set_order", 3, 1, params={"transports": TRANSPORTS}, timeout_s=400,
                        process_env=lambda pid: {"PYTHONHASHSEED": str(2 * pid + 1)})
    results = [p.result() for p in procs]
    assert len({tuple(r["order"]) for r in results}) > 1, results   # the orders differ
    for r in results:
        assert set(r["wrong"].values()) == {0}, r


def test_calls_of_one_weight_traced_in_another_order_per_process_are_matched_by_their_input():
    """One kernel applied to the results of a set of others, each process its own order:
    such calls are keyed by where their input comes from, and the calls of each block run in
    the order of their keys (docs/native.md §4), so every transport pairs them right, forward
    and backward (a call without its peers would fail at the short timeout)."""
    procs = harness.run("set_order_one_weight", 3, 1, params={"transports": TRANSPORTS},
                        timeout_s=300, env={"JAXOVERLAP_TIMEOUT_S": "20"},
                        process_env=lambda pid: {"PYTHONHASHSEED": str(2 * pid + 1)})
    results = [p.result() for p in procs]
    assert len({tuple(r["order"]) for r in results}) > 1, results   # the orders differ
    for r in results:
        assert r["error"] is None and set(r["wrong"]) == set(TRANSPORTS), r
        assert set(r["wrong"].values()) == {0}, r


def test_calls_started_in_another_order_per_process_fail_at_once_naming_the_cause():
    """Two processes start the same two native calls in opposite orders (each makes its
    second call wait for its first), every transport: every process fails within a few
    seconds of a 20 s timeout, naming both calls, the different orders and the fix. A rank
    that merely runs late (process 1 sleeps 1.5 s before a call while process 0 waits in it,
    longer than the check lets ranks settle: 1 s at this timeout) is no deadlock: that run is
    right."""
    procs = harness.run("order_mismatch", 2, 1, params={"transports": TRANSPORTS,
                                                        "slow_s": 1.5},
                        timeout_s=300, env={"JAXOVERLAP_TIMEOUT_S": "20"})
    for p in procs:
        r = p.result()
        assert r["wrong"] == 0 and r["slow_run_s"] >= 1.5, r
        assert set(r["errors"]) == set(TRANSPORTS), r
        for transport, (error, seconds) in r["errors"].items():
            assert seconds < 10, (transport, seconds, error)
            assert "ranks wait for each other in calls that none of them can reach" in error
            assert "or the same calls in different orders" in error, error
            assert "never a set" in error and error.count("waits in call 1 of site") == 2, error
            # every wait of the cycle, as the check read it (a peer that gave up first has
            # cleared its own record by the time this process writes its error)
            assert all(f"rank {r} (process {r}) waits in call 1" in error for r in (0, 1)), error


@pytest.mark.jax_api
@pytest.mark.parametrize("nprocs", [3])
def test_exchange_api_bytes_through_the_store(nprocs):
    """allgather / broadcast / CUDA-handle exchange keyed by clique id, their timeout, fds (also
    from C++, one owner's fd as for a multicast object), and a C++ exchange from inside a jitted
    XLA execution (as the CUDA handlers' first execution does)."""
    procs = harness.run("exchange", nprocs, 1)
    assert "process 1 did not answer" in procs[0].result()["error"]
    for p in procs:
        checked = p.result()["checked"]
        assert len(checked) == 10 and "fds over socket" in checked, checked
        assert "exchange inside an XLA execution" in checked, checked
        assert "c++ exchange" in checked and "c++ share_fds from one owner" in checked, checked
        # pidfd_getfd works where ptrace is allowed; elsewhere it must say why.
        assert checked[-1] == "fds over pidfd" or "no ptrace access" in checked[-1], checked


def test_harness_kills_children_at_its_deadline():
    with pytest.raises(harness.HarnessError, match="hard timeout after 5 s") as info:
        harness.run("hang", 2, timeout_s=5)
    assert "process 1: exit None" in str(info.value)


def test_harness_reports_failures_and_removes_leftover_segments():
    with pytest.raises(harness.HarnessError, match="a process failed") as info:
        harness.run("fail", 2)
    assert "Not equal to tolerance" in str(info.value)
    with pytest.raises(harness.HarnessError, match="segments left behind") as info:
        harness.run("leak_shm", 1)
    assert not harness.shm_segments(f"jotest{os.getpid()}x")
    # The untagged one too: the job held it, and it was not there before.
    untagged = re.search(r"jo-untagged-leak-\d+", str(info.value))
    assert untagged is not None, str(info.value)
    assert not os.path.exists(os.path.join(harness.SHM_DIR, untagged.group()))


def test_processes_that_run_different_calls_fail_before_the_timeout_naming_both_sites():
    """Process 1 calls with another contraction size: another call, so another call site, and
    each process waits in its own for a peer that waits in another: refused once that has
    lasted a second, well before the timeout (8 s), naming this process's call and the
    peer's."""
    procs = harness.run("disagree", 2, 1, params={"timeout_s": 8.0}, timeout_s=120)
    results = [p.result() for p in procs]
    for r in results:
        error = r["error"]
        assert error is not None and r["elapsed_s"] < 6, results
        assert "ranks wait for each other in calls that none of them can reach" in error, error
        assert "the processes run different calls" in error, error
        # Both calls named: this process's and the peer's.
        assert "[1,2,8]x2" in error and "[1,2,16]x2" in error, error


@pytest.mark.jax_api
def test_a_chiefs_extra_compiles_shift_no_call_site():
    """The chief alone AOT-compiles an eval step (to log its memory), keeps another AOT program,
    compiles on a background thread; the processes compile two programs in opposite orders; the
    chief recompiles the train step after jax.clear_caches() while the old executable lives, then
    drops it and compiles it again while its peer keeps its own. Every common step runs at once
    (a site shifted by one extra compile would wait the whole timeout) and right."""
    procs = harness.run("chief_aot", 2, 2, params={"timeout_s": 30.0}, timeout_s=300)
    for p in procs:
        result = p.result()
        assert result["checked"][-3:] == ["common steps", "recompiled while alive", "rejoined"], \
            p.stdout
        assert result["common_s"] < 25.0, result  # no step waited for the 30 s timeout
        assert "shared memory across 2 processes" in result["cliques"], result["cliques"]
    chief = procs[0].result()
    assert chief["checked"][:2] == ["chief AOT eval step (True)", "chief-only programs"], chief
    # The chief dropped the train step while its peer kept it: it kept the mapping.
    assert "kept for peers" in chief["kept_for_peers"], chief["kept_for_peers"]


def test_thousands_of_sites_over_a_job_while_one_stays_alive():
    """With room for 8 live call sites, a train step stays alive while 15 programs of 3 calls
    each (45 sites) are compiled, run and dropped: each finds room, because the directory counts
    live sites. Then a program of 9 calls at once fails at once in every process (2 local
    ranks each: one deadline, not one per rank), naming the capacity. The directory at its real
    capacity (4096) with 10000 sites over time is test_shm.py's."""
    procs = harness.run("many_sites", 2, 2, params={"programs": 15, "calls": 3,
                                                     "timeout_s": 60.0},
                        env={"JAXOVERLAP_MAX_CALL_SITES": "8"}, timeout_s=400,
                        expect_success=False)
    for p in procs:
        result = p.result()
        assert p.returncode == 0 or _JAX_TERMINATED in p.stderr, harness.describe(procs)
        assert result["made"] == 46 and 1 <= result["most_open"] <= 8, result
        error = result["error"]
        assert error is not None and "has no room for another call site: 8 call sites" in error, \
            result
        assert result["full_elapsed_s"] < 20.0, result  # not the 60 s timeout


def test_a_process_of_the_same_user_outside_the_job_cannot_open_its_memory():
    """While a job makes and uses call sites, a process of the same user that is not part of it
    and does not ptrace (same uid and capabilities: none, root's dropped) scans /dev/shm and
    /proc/<pid>/{fd,map_files} of the job's processes and asks the job's fd sockets for fds: it
    opens nothing but the canaries, a named segment in /dev/shm and a memfd a job process keeps
    open, made to show that it would. (A segment's descriptor is held only while it is handed
    over: docs/multiprocess.md §3.)"""
    procs = harness.run("watched", 2, 1, params={"iterations": 10}, timeout_s=300,
                        unprivileged=True)
    report = procs[0].result()["watcher"]
    # A peer of the job's processes: their uid and capabilities (none), not their ancestor.
    assert {c["Uid"] for c in report["job"].values()} == {report["me"]["Uid"]}, report
    assert {int(c["CapEff"], 16) for c in report["job"].values()} == {0}, report
    assert int(report["me"]["CapEff"], 16) == 0 and report["session_leader"], report
    # It opened the canaries: /dev/shm's, and the memfd through /proc/<pid>/fd (what it opened
    # is read from its own descriptor: the job's fd numbers are reused) ...
    opened, targets = dict(report["opened"]), report["targets"]
    assert [path for path in opened if path.endswith("-canary")] != [], report
    memfd_canary = [path for path, how in opened.items()
                    if how == "proc_fd" and "jaxoverlap-canary-memfd" in targets[path]]
    assert len(memfd_canary) == 1, report
    assert any("fd: /memfd:jaxoverlap-canary-memfd" in seen for seen in report["seen"]), report
    # ... and nothing of the job's own: no segment, a memfd of ours or a name in /dev/shm (it
    # saw their mappings, which need CAP_SYS_ADMIN). Files of the install the job has open
    # (jaxoverlap's extension modules, by path) are readable by anyone anyway.
    ours = {path: target for path, target in targets.items() if "canary" not in target
            and (target.startswith("/memfd:jaxoverlap") or target.startswith("/dev/shm/"))}
    assert ours == {}, (ours, report)
    assert report["sockets"], report  # it found the job's fd servers, and got nothing there
    assert report["tries"]["socket"] > 0 and report["tries"]["proc_fd_list"] > 0, report
    assert report["rounds"] > 10, report


def test_an_executable_whose_calls_never_lowered_here_fails_at_once_naming_why(tmp_path):
    """A program serialized by one job and loaded by the next never lowers its native call
    there, so its group spanning processes has no shared memory: every process fails at once
    saying why and what to do, instead of waiting for its peers until the timeout (30 s)."""
    first = harness.run("deserialized", 2, 1, params={"directory": str(tmp_path),
                                                       "timeout_s": 30.0}, expect_success=False)
    for p in first:  # as below: it reported, then left (or process 0's leaving took it down)
        assert p.returncode == 0 or _JAX_TERMINATED in p.stderr, harness.describe(first)
    assert [p.result()["loaded"] for p in first] == ["serialized"] * 2
    second = harness.run("deserialized", 2, 1, params={"directory": str(tmp_path),
                                                        "timeout_s": 30.0}, timeout_s=120,
                         expect_success=False)
    for p in second:
        # It reported, then left without jax.distributed's shutdown (or JAX's service, whose
        # process left first, took it down): either way, what it reported is the result.
        assert p.returncode == 0 or _JAX_TERMINATED in p.stderr, harness.describe(second)
        result = p.result()
        error = result["error"]
        assert result["loaded"] == "failed" and error is not None, result
        assert f"but process {p.process_id} has no shared memory set up for it" in error, error
        assert "did not lower in this process" in error and "jax.shard_map" in error, error
        assert result["elapsed_s"] < 10.0, result


@pytest.mark.jax_api
def test_a_program_from_the_persistent_compilation_cache_runs_right(tmp_path):
    """The second job loads a user's shard_map program from JAX's persistent cache (nothing
    new written): it lowers there all the same (the cache key is the lowered program), so its
    group is set up and its call sites are the cached program's own; it runs right."""
    first = harness.run("cached", 2, 1, params={"cache_dir": str(tmp_path)})
    assert all(p.result()["new_entries"] > 0 for p in first)
    second = harness.run("cached", 2, 1, params={"cache_dir": str(tmp_path)})
    for p in second:
        result = p.result()
        assert result["new_entries"] == 0, result  # a cache hit
        assert "shared memory across 2 processes" in result["cliques"], result


def require_module(name: str) -> None:
    """Skips (fails under JAXOVERLAP_REQUIRE_CUDA=1) when ``jaxoverlap.<name>`` is not built."""
    import importlib

    from jaxoverlap._executors import runtime

    try:
        runtime.load_cuda()
        importlib.import_module(f"jaxoverlap.{name}")
    except ImportError as e:
        if os.environ.get("JAXOVERLAP_REQUIRE_CUDA", "") == "1":
            pytest.fail(f"jaxoverlap.{name} must be built (JAXOVERLAP_REQUIRE_CUDA=1): {e}")
        pytest.skip(f"jaxoverlap.{name} is not built in this installation: {e}")


@pytest.mark.parametrize("nprocs", [2, 3])
def test_gpu_clique_bootstrap_across_processes_on_the_fake(nprocs):
    """The NCCL unique id of GPU cliques spanning processes travels through the store; each
    process then runs the CUDA executor's multi-process path on its host-side fake. Processes 0
    and 1 also send each other the CUDA IPC handles of a p2p clique from C++ (jo::Exchange over
    the store); the fake cannot open another process's memory and says whose handle it got."""
    require_module("_cuda_fake")
    procs = harness.run("cuda_nccl_id", nprocs, 1)
    for p in procs:
        result = p.result()
        want = [f"{op}/g{g}" for op in ("ag_matmul", "matmul_rs") for g in (0, 1)]
        if p.process_id < 2:
            want.append("p2p-ipc-handles")
        assert sorted(result["checked"]) == sorted(want), p.stdout


def test_gpu_clique_bootstrap_names_a_silent_root():
    require_module("_cuda_fake")
    procs = harness.run("cuda_nccl_id", 2, 1, params={"timeout_s": 3.0, "root_absent": True},
                        timeout_s=120, expect_success=False)
    result = procs[1].result()
    assert procs[1].returncode == 0, harness.describe(procs)
    assert "BootstrapError" in result["error"] and "process 0 did not answer" in result["error"], \
        result
    assert "nccl_id" in result["error"], result
    assert result["elapsed_s"] >= 2.5, result  # not before its 3 s timeout


def test_jaxoverlap_profile_writes_one_trace_per_process(tmp_path):
    """JAXOVERLAP_PROFILE in a job of 2 processes: each writes the ranks it ran, under its own
    name, at exit (after jax.distributed shut down)."""
    import json

    harness.run("native", 2, 1, params={"transports": ["p2p"], "axes": [0]},
                env={"JAXOVERLAP_PROFILE": str(tmp_path)})
    for process in (0, 1):
        trace = json.loads((tmp_path / f"trace.process{process}.json").read_text())
        calls = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "call"]
        assert calls and all(e["pid"] // 1_000_000 == process for e in calls)
        report = json.loads((tmp_path / f"report.process{process}.json").read_text())
        assert {s["op"] for s in report["sites"]} == set(_kinds.names(_kinds.OPS))
    assert not (tmp_path / "trace.json").exists()
