"""Bootstrap over ``jax.distributed``: what cliques spanning processes exchange, and how.

Everything goes through the key-value store of the ``jax.distributed`` job — no MPI, no files,
no launcher of ours. The client is reachable only through the private
``jax._src.distributed.global_state.client``; every use of it is in this module.

Keys are namespaced ``jaxoverlap/v1/<clique id>/...``: the clique id is derived from the mesh
and is the same in every process. Every wait has a deadline and its error names the process
that did not answer.

Two layers:

* ``broadcast_bytes`` / ``allgather_bytes``: bytes in, bytes out, keyed by clique id and tag,
  among a list of processes. This is what the CUDA executor calls for the NCCL unique id and
  CUDA IPC / multicast handles (``exchange_cuda_handles`` spells out that protocol), from Python
  or, through ``StoreExchange`` and ``jo::Exchange`` (``cpp/core/exchange.h``), from C++;
  ``share_fds`` moves POSIX-fd handles.
* ``ensure_host_clique``: the host executor's cliques spanning processes (protocol below).

Host clique protocol (once per mesh-axis group per process, when a call lowers: from the native
primitive's lowering rule; docs/multiprocess.md §3 has the whole story):

0. every other process publishes its pid (with its machine and namespaces) under
   ``.../pid/<process>``;
1. the leader (the process of rank 0) takes the next attempt number from an atomic counter in
   the store, creates the group's control segment (a memfd: no name anyone could open),
   collects the others' pids, serves the segment's fd to exactly those pids on an abstract
   Unix socket with a random name (``share_fds``'s server) and publishes
   ``{"attempt", "socket", "pid", "rank_process", "machine", "namespaces"}`` under
   ``.../leader``;
2. every other process waits for a leader entry newer than any attempt it has seen, checks
   that the leader's rank table, machine and namespaces equal its own, fetches the fd from
   the leader's pid only, maps it (checked: a sealed memfd of this user, of the right size and
   contents), and answers ``.../<attempt>/attached/<process>`` (``ok`` or the reason);
3. the leader collects every answer (naming the processes that do not answer) and publishes
   the verdict ``.../<attempt>/result``, which every process waits for: a failure is raised
   everywhere, the segment is marked broken, and the next trace bootstraps anew.

While the leader waits for a process whose pid it knows, and a process for the leader's
verdict, it watches that process (a pidfd, :class:`_Peers`): one that exits is reported at
once, by name and pid, not at the deadline.

From then on ranks talk through shared memory only (``cpp/host/shm_domain.h``: each call site
gets its own clique in the group's domain at its first call, its segment's fd passed between
the processes by their segment servers, ``cpp/host/fd_share.h``). The host executor learns which
ranks are threads of this process and which are other processes from the rank table given
here (``rank_process``); it treats both alike, all through shared memory.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxoverlap._config import timeout_ms
from jaxoverlap._executors import runtime

NAMESPACE = "jaxoverlap/v1"

_lock = threading.Lock()
_host_lock = threading.RLock()  # one host-clique bootstrap at a time in this process
_generations: dict[tuple[str, str], int] = {}


class BootstrapError(RuntimeError):
    """A process did not answer in time, or the processes disagree on a clique.

    ``timed_out``: a wait on the store reached its deadline (the message names who did not
    answer)."""

    timed_out = False


def _timed_out(message: str) -> BootstrapError:
    error = BootstrapError(message)
    error.timed_out = True
    return error


def client() -> Any | None:
    """The ``jax.distributed`` key-value client, or None when no distributed job runs."""
    try:
        from jax._src.distributed import global_state
    except ImportError:  # pragma: no cover - layout of a future jax
        return None
    return getattr(global_state, "client", None)


def is_multiprocess() -> bool:
    """True when this is one process of a ``jax.distributed`` job with more than one process."""
    return client() is not None and jax.process_count() > 1


def _require_client() -> Any:
    c = client()
    if c is None:
        raise BootstrapError(
            "jaxoverlap: exchanging data between processes needs jax.distributed; call "
            "jax.distributed.initialize() in every process first")
    return c


def _next_generation(clique_id: str, tag: str) -> int:
    with _lock:
        n = _generations.get((clique_id, tag), 0)
        _generations[(clique_id, tag)] = n + 1
        return n


def _key(clique_id: str, generation: int, tag: str, *rest: object) -> str:
    return "/".join([NAMESPACE, clique_id, str(generation), tag, *map(str, rest)])


def _set(key: str, value: bytes) -> None:
    try:
        _require_client().key_value_set_bytes(key, value)
    except BootstrapError:
        raise
    except Exception as e:  # noqa: BLE001 - the client raises XlaRuntimeError subclasses
        raise BootstrapError(f"jaxoverlap: could not publish {key!r} in the jax.distributed "
                             f"key-value store: {e}") from e


def _get(key: str, deadline: float, who: str, what: str) -> bytes:
    # The store takes a 32-bit millisecond count: ~24 days is "forever" enough there.
    remaining_ms = min(timeout_ms(deadline - time.monotonic()), 2**31 - 1)
    try:
        return bytes(_require_client().blocking_key_value_get_bytes(key, remaining_ms))
    except BootstrapError:
        raise
    except Exception as e:  # noqa: BLE001
        text = str(e)
        if "DEADLINE_EXCEEDED" in text or "timed out" in text.lower():
            raise _timed_out(
                f"jaxoverlap: {who} did not answer within the timeout ({what}; key {key!r}). "
                f"Is that process still running the same program, and did it reach the same "
                f"jaxoverlap call? (JAXOVERLAP_TIMEOUT_S / timeout_s set the deadline)") from e
        raise BootstrapError(f"jaxoverlap: reading {key!r} ({what}) failed: {e}") from e


def _check_processes(processes: Sequence[int]) -> list[int]:
    procs = sorted({int(p) for p in processes})
    me = jax.process_index()
    if me not in procs:
        raise ValueError(f"jaxoverlap: process {me} is not among the processes {procs} of this "
                         "exchange")
    return procs


def broadcast_bytes(clique_id: str, tag: str, data: bytes | None, *, root: int,
                    processes: Sequence[int], timeout_s: float) -> bytes:
    """``root`` publishes ``data``; every process of ``processes`` returns it.

    Non-root processes pass ``data=None``. ``clique_id`` must be the same string in every
    process (e.g. ``f"{clique_key:016x}-{group}"``); a (clique_id, tag) pair may be used
    repeatedly: each use gets fresh keys.
    """
    procs = _check_processes(processes)
    if root not in procs:
        raise ValueError(f"jaxoverlap: root {root} is not among the processes {procs}")
    generation = _next_generation(clique_id, tag)
    key = _key(clique_id, generation, tag, "root")
    if jax.process_index() == root:
        if data is None:
            raise ValueError("jaxoverlap: the root of broadcast_bytes must pass data")
        _set(key, bytes(data))
        return bytes(data)
    deadline = time.monotonic() + timeout_s
    return _get(key, deadline, f"process {root}", f"root of broadcast {tag!r} of {clique_id}")


def allgather_bytes(clique_id: str, tag: str, data: bytes, *, processes: Sequence[int],
                    timeout_s: float) -> dict[int, bytes]:
    """Every process of ``processes`` contributes ``data``; returns process -> its bytes.

    A timeout names every process that did not contribute.
    """
    procs = _check_processes(processes)
    me = jax.process_index()
    generation = _next_generation(clique_id, tag)
    _set(_key(clique_id, generation, tag, me), bytes(data))
    deadline = time.monotonic() + timeout_s
    out: dict[int, bytes] = {me: bytes(data)}
    missing: list[int] = []
    first_error: BootstrapError | None = None
    for p in procs:
        if p == me:
            continue
        try:
            out[p] = _get(_key(clique_id, generation, tag, p), deadline, f"process {p}",
                          f"allgather {tag!r} of {clique_id}")
        except BootstrapError as e:
            missing.append(p)
            first_error = first_error or e
            deadline = time.monotonic() + 0.01  # only collect who else is missing
    if missing:
        raise BootstrapError(
            f"jaxoverlap: process(es) {missing} did not answer the allgather {tag!r} of "
            f"clique {clique_id} within {timeout_s:g} s (this is process {me})") from first_error
    return out


class StoreExchange:
    """One clique's exchange for C++ set-up code: the Python side of ``jo::Exchange``.

    ``cpp/core/exchange.h`` declares the interface and ``cpp/python/py_exchange.h`` adapts an
    object of this class to it, so the CUDA executor's clique creation (called from Python at
    trace time) can broadcast its NCCL unique id and allgather its handles from C++.
    """

    def __init__(self, clique_id: str, processes: Sequence[int], timeout_s: float) -> None:
        self.clique_id = clique_id
        self.processes = _check_processes(processes)
        self.process = jax.process_index()
        self.timeout_s = float(timeout_s)

    def broadcast(self, tag: str, root: int, data: bytes | None) -> bytes:
        return broadcast_bytes(self.clique_id, tag, data, root=root, processes=self.processes,
                               timeout_s=self.timeout_s)

    def allgather(self, tag: str, data: bytes) -> dict[int, bytes]:
        return allgather_bytes(self.clique_id, tag, data, processes=self.processes,
                               timeout_s=self.timeout_s)

    def share_fds(self, tag: str, fds: Sequence[int]) -> dict[int, list[int]]:
        return share_fds(self.clique_id, tag, fds, processes=self.processes,
                         timeout_s=self.timeout_s, allow_empty=True)


def exchange_cuda_handles(clique_id: str, *, rank_process: Sequence[int], local_handles: bytes,
                          nccl_unique_id: bytes | None, timeout_s: float
                          ) -> tuple[bytes, dict[int, bytes]]:
    """The exchange the CUDA executor makes when it sets up a clique spanning processes.

    ``rank_process[r]`` is the process of rank r. The process of rank 0 passes the NCCL unique id
    (``ncclGetUniqueId``, 128 bytes), the others None; every process passes its own packed
    handles (CUDA IPC handles of its ranks' workspaces, a multicast fabric handle, ...).
    Returns the unique id and process -> that process's handles. The bytes are opaque here.
    """
    procs = sorted(set(int(p) for p in rank_process))
    root = int(rank_process[0])
    uid = broadcast_bytes(clique_id, "nccl_id", nccl_unique_id, root=root, processes=procs,
                          timeout_s=timeout_s)
    handles = allgather_bytes(clique_id, "cuda_handles", local_handles, processes=procs,
                              timeout_s=timeout_s)
    return uid, handles


def share_fds(clique_id: str, tag: str, fds: Sequence[int], *, processes: Sequence[int],
              timeout_s: float, method: str = "socket",
              allow_empty: bool = False) -> dict[int, list[int]]:
    """Every process of ``processes`` shares its ``fds`` with the others (same machine only).

    For POSIX-fd handles (``cuMemExportToShareableHandle``). Returns process -> duplicates, in
    this process, of that process's fds, in order; the caller owns (and closes) them.
    ``method="socket"``: SCM_RIGHTS over an abstract Unix socket that only serves the expected
    peers' pids (works under any ptrace policy). ``method="pidfd"``: ``pidfd_getfd`` (Linux >= 5.6,
    needs ptrace access to the owner). Pids, fd numbers and socket names go through the store.
    ``allow_empty``: a process may offer no fds (e.g. only the owner of a multicast object
    exports it); processes that offered none get no entry in the result.
    """
    if method not in ("socket", "pidfd"):
        raise ValueError(f"jaxoverlap: share_fds method={method!r}: use 'socket' or 'pidfd'")
    if not fds and not allow_empty:
        raise ValueError("jaxoverlap: share_fds needs at least one fd")
    host = runtime.load_host()
    procs = _check_processes(processes)
    me = jax.process_index()
    deadline = time.monotonic() + timeout_s
    mine = {"pid": os.getpid(), "fds": [int(f) for f in fds]}
    peers = {p: json.loads(b) for p, b in allgather_bytes(
        clique_id, f"fds/{tag}", json.dumps(mine).encode(), processes=procs,
        timeout_s=timeout_s).items()}
    out: dict[int, list[int]] = {}
    try:
        if method == "pidfd":
            for p in procs:
                if p != me and peers[p]["fds"]:
                    out[p] = []
                    for fd in peers[p]["fds"]:
                        out[p].append(host._fd_dup_from_process(peers[p]["pid"], fd))
            # Owners keep their fds open until every peer has its copies.
            allgather_bytes(clique_id, f"fds/{tag}/done", b"1", processes=procs,
                            timeout_s=max(0.1, deadline - time.monotonic()))
            return out
        # The socket is bound before its name is published (an unguessable name: nobody can
        # bind it first), and each side checks the other's pid and uid (cpp/host/fd_share.h).
        others = [peers[p]["pid"] for p in procs if p != me]
        name = f"jaxoverlap-{os.getpid()}-{secrets.token_hex(16)}"
        server = (host._fd_serve(name, mine["fds"], others, timeout_ms(timeout_s))
                  if mine["fds"] else None)
        try:
            sockets = allgather_bytes(clique_id, f"fds/{tag}/socket", name.encode(),
                                      processes=procs,
                                      timeout_s=max(0.1, deadline - time.monotonic()))
            for p in procs:
                if p != me and peers[p]["fds"]:
                    out[p] = host._fd_receive(sockets[p].decode(), len(peers[p]["fds"]),
                                              peers[p]["pid"],
                                              timeout_ms(deadline - time.monotonic()))
        finally:
            if server is not None:
                server.finish()  # raises if a peer never fetched its copies
        return out
    except BaseException:
        for got in out.values():
            for fd in got:
                os.close(fd)
        raise


def namespaces() -> str:
    """This process's pid and network namespaces (the inodes of /proc/self/ns/*)."""
    parts = []
    for kind in ("pid", "net"):
        try:
            parts.append(f"{kind}:{os.stat(f'/proc/self/ns/{kind}').st_ino}")
        except OSError:
            parts.append(f"{kind}:?")
    return ",".join(parts)


def machine_id() -> str:
    """This machine, as shared memory sees it: hostname and kernel boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def clique_id(clique_key: int, group: int) -> str:
    """The clique's name in keys: its key as 16 hex digits and its group."""
    return f"{clique_key & 0xFFFFFFFFFFFFFFFF:016x}-g{group}"


def setup_cliques(call: Any, timeout_s: float) -> None:
    """Sets up every clique of ``call`` (a ``call.NativeCall``) that spans processes and has
    a rank here. Called when the call lowers, in every process; cliques whose ranks are all
    in one process need nothing (they are made at their first call)."""
    processes = np.array([r.process for r in call.ranks], np.int64)
    if call.platform == "cpu":
        host = runtime.load_host()
        for group, ranks in enumerate(call.groups()):
            ensure_host_clique(host, call.clique_key, group, [r.process for r in ranks],
                               timeout_s)
    else:
        ensure_gpu_cliques(runtime.load_cuda(), call.clique_key, processes, call.axis_size,
                           timeout_s)


_gpu_bootstrapped: set[tuple[int, int, int]] = set()


def ensure_gpu_cliques(cuda: Any, clique_key: int, processes: np.ndarray, axis_size: int,
                       timeout_s: float) -> dict[int, bytes]:
    """GPU cliques spanning processes: the NCCL id and the exchange of each clique here.

    The process of each clique's rank 0 makes the id (``cuda.nccl_unique_id()``); it travels
    through the store (``broadcast_bytes``; a silent root is named after ``timeout_s``) and is
    registered with ``cuda.set_nccl_id`` for the handler to find at the first execution, where
    every process creates its ranks' communicators. The clique's exchange (``StoreExchange``)
    is registered too: p2p and multicast move their buffer handles through it from C++ at the
    first execution. Once per clique per process (every process lowers the same programs, so
    all skip alike). ``cuda`` is ``_cuda``, or ``_cuda_fake`` in tests. Returns group -> id for
    the cliques set up now.
    """
    me = jax.process_index()
    done: dict[int, bytes] = {}
    for group, ranks in enumerate(np.asarray(processes).reshape(-1, axis_size)):
        table = [int(p) for p in ranks]
        if me not in table or len(set(table)) == 1:
            continue
        token = (id(cuda), int(clique_key), group)
        with _lock:
            if token in _gpu_bootstrapped:
                continue
        cid = clique_id(int(clique_key), group)
        root = table[0]
        uid = broadcast_bytes(
            f"{cid}-gpu", "nccl_id", bytes(cuda.nccl_unique_id()) if me == root else None,
            root=root, processes=sorted(set(table)), timeout_s=timeout_s)
        cuda.set_nccl_id(int(clique_key), group, me, uid)
        cuda.set_exchange(int(clique_key), group, me,
                          StoreExchange(f"{cid}-gpu", sorted(set(table)), timeout_s))
        with _lock:
            _gpu_bootstrapped.add(token)
        done[group] = uid
    return done


def ensure_host_clique(host: Any, clique_key: int, group: int, rank_process: Sequence[int],
                       timeout_s: float) -> bool:
    """Sets up the domain of host clique (clique_key, group) spanning processes; True if now.

    Called at trace time by every process that owns a rank of the clique. Does nothing when
    the domain exists (and is not broken) in this process, or when all its ranks are local (an
    in-process clique is made on first use). A broken domain (an earlier failure) is replaced:
    re-tracing after a failure bootstraps the clique again.
    """
    with _host_lock:
        return _ensure_host_clique(host, clique_key, group, [int(p) for p in rank_process],
                                   timeout_s)


# Per clique id: the newest bootstrap attempt this process took part in (a follower never
# joins an attempt older than that: its leader key may still be in the store).
_attempts_seen: dict[str, int] = {}

# How often a bootstrap wait looks at the peers it waits for (docs/multiprocess.md §3).
_WATCH_S = 0.2


class _Peers:
    """Peer processes of this machine and pid namespace, watched while a bootstrap waits for
    them: one that exits ends the wait at once, naming it, not at the deadline.

    A pidfd per process (``pidfd_open``, Linux >= 5.3), taken when its pid is learnt: it
    refers to that very process, never to a later one reusing the pid, and becomes readable
    when it exits. Peers whose pid means nothing here (another machine or namespace, which
    the bootstrap refuses anyway) and kernels without pidfds are not watched: their waits
    end at the deadline, as before.
    """

    def __init__(self) -> None:
        self._pidfds: dict[int, tuple[int, int | None]] = {}   # process -> (pid, pidfd)

    def watch(self, process: int, pid: int) -> None:
        try:
            fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            fd = None                  # gone already
        except (OSError, AttributeError):
            return
        self._pidfds[process] = (pid, fd)

    def gone(self) -> list[tuple[int, int]]:
        """(process, pid) of every watched process that has exited."""
        fds = [fd for _, fd in self._pidfds.values() if fd is not None]
        ready = set(select.select(fds, [], [], 0)[0]) if fds else set()
        return [(p, pid) for p, (pid, fd) in sorted(self._pidfds.items())
                if fd is None or fd in ready]

    def close(self) -> None:
        for _, fd in self._pidfds.values():
            if fd is not None:
                os.close(fd)
        self._pidfds.clear()


def _get_watched(key: str, deadline: float, who: str, what: str, peers: _Peers,
                 gone: Any) -> bytes:
    """``_get`` that also ends, with ``gone(exited)``'s error, as soon as a watched peer
    exits (``exited``: its (process, pid) pairs)."""
    while True:
        try:
            return _get(key, min(deadline, time.monotonic() + _WATCH_S), who, what)
        except BootstrapError as e:
            if not e.timed_out:
                raise
            if exited := peers.gone():
                raise gone(exited) from None
            if time.monotonic() >= deadline:
                raise


def _named(exited: list[tuple[int, int]]) -> str:
    return ", ".join(f"process {p} (pid {pid})" for p, pid in exited)


def _ensure_host_clique(host: Any, clique_key: int, group: int, table: list[int],
                        timeout_s: float) -> bool:
    me = jax.process_index()
    if me not in table or len(set(table)) == 1:
        return False
    if host._domain_state(clique_key, group) == "ok":
        return False
    cid = clique_id(clique_key, group)
    deadline = time.monotonic() + timeout_s
    if me == table[0]:
        _lead_host_bootstrap(host, clique_key, group, table, cid, deadline, timeout_s)
    else:
        _follow_host_bootstrap(host, clique_key, group, table, cid, deadline)
    return True


def _host_key(cid: str, *rest: object) -> str:
    return "/".join([NAMESPACE, cid, "host", *map(str, rest)])


def _delete(key: str) -> None:
    """Deletes ``key`` and every key under it (best effort: a leftover key is harmless)."""
    try:
        _require_client().key_value_delete(key)
    except Exception:  # noqa: BLE001 - cleanup must not mask the real outcome
        pass


def _lead_host_bootstrap(host: Any, clique_key: int, group: int, table: list[int], cid: str,
                         deadline: float, timeout_s: float) -> None:
    """The leader (process of rank 0): create, serve, collect every answer, give the verdict.

    Attempts are numbered by an atomic counter in the store, so every process agrees on which
    attempt it joins whatever failed before; the previous attempt's keys are deleted.
    """
    me = jax.process_index()
    attempt = int(_require_client().key_value_increment(_host_key(cid, "attempts"), 1))
    if attempt > 1:
        _delete(_host_key(cid, attempt - 1))
    _attempts_seen[cid] = attempt
    # The control segment's fd is parked, in no fd table (cpp/host/fd_share.h ParkedFds): no
    # other process of the user can reopen it through /proc/<pid>/fd while it waits.
    parked = host._shm_domain_create(clique_key, group, table, me, attempt)
    server = None
    peers = _Peers()

    def died(exited: list[tuple[int, int]]) -> BootstrapError:
        return BootstrapError(
            f"jaxoverlap: {_named(exited)} exited during the bootstrap of host clique {cid} "
            f"(rank table {table}), before it attached to the shared memory; this is its "
            f"leader, process {me}. Every process of the job must reach the same native "
            "calls: see why that process ended (its own output).")

    try:
        missing, errors, pids = [], [], []
        for p in sorted(set(table)):
            if p == me:
                continue
            try:
                entry = json.loads(_get(_host_key(cid, "pid", p), deadline, f"process {p}",
                                        f"attach to the shared memory of host clique {cid}"))
            except BootstrapError as e:
                missing.append(p)
                errors.append(str(e))
                deadline = time.monotonic() + 0.01  # only collect who else is missing
                continue
            pids.append(int(entry["pid"]))
            if (entry["machine"], entry["namespaces"]) == (machine_id(), namespaces()):
                peers.watch(p, int(entry["pid"]))
        if not missing:
            # Bound before its name is published; it serves exactly these pids (SO_PEERCRED).
            socket_name = f"jaxoverlap-{os.getpid()}-{secrets.token_hex(16)}"
            server = host._fd_serve(socket_name, parked, pids,
                                    timeout_ms(max(0.1, deadline - time.monotonic())))
            _set_overwrite(_host_key(cid, "leader"), json.dumps(
                {"attempt": attempt, "socket": socket_name, "pid": os.getpid(),
                 "rank_process": table, "machine": machine_id(),
                 "namespaces": namespaces()}).encode())
        for p in sorted(set(table)):
            if p == me or missing:
                continue
            try:
                answer = _get_watched(_host_key(cid, attempt, "attached", p), deadline,
                                      f"process {p}",
                                      f"attach to the shared memory of host clique {cid}",
                                      peers, died)
            except BootstrapError as e:
                if not e.timed_out:
                    raise
                missing.append(p)
                errors.append(str(e))
                deadline = time.monotonic() + 0.01  # only collect who else is missing
                continue
            if answer != b"ok":
                raise BootstrapError(f"jaxoverlap: process {p} could not attach to host "
                                     f"clique {cid}: {answer.decode(errors='replace')}")
        if missing:
            raise BootstrapError(
                f"jaxoverlap: process(es) {missing} did not attach to host clique {cid} "
                f"(rank table {table}) within {timeout_s:g} s; this is its leader, process "
                f"{me}. First error: {errors[0]}")
    except BaseException as e:
        # Processes that attached hold the domain too: break it (their calls fail fast) and
        # tell them, before this process forgets it; a later trace bootstraps anew.
        reason = str(e) or type(e).__name__
        host._break_domain(clique_key, group, f"the bootstrap of host clique {cid} failed: "
                                              f"{reason}")
        try:
            _set(_host_key(cid, attempt, "result"), reason.encode())
        except BootstrapError:
            pass
        _delete(_host_key(cid, "leader"))
        host._forget_domain(clique_key, group)
        del server, parked  # stops serving; drops the segment's last reference here
        raise
    finally:
        peers.close()
    _set(_host_key(cid, attempt, "result"), b"ok")
    server.finish()  # every process answered ok: each has its copy already


def _follow_host_bootstrap(host: Any, clique_key: int, group: int, table: list[int], cid: str,
                           deadline: float) -> None:
    """Every other process: join the leader's newest attempt, answer, await the verdict."""
    me = jax.process_index()
    # The leader serves the control segment to the pids it reads here, and to no other, and
    # watches those of its machine and pid namespace (an exit ends its wait at once).
    _set_overwrite(_host_key(cid, "pid", me), json.dumps(
        {"pid": os.getpid(), "machine": machine_id(), "namespaces": namespaces()}).encode())
    what = f"leader (rank 0) of host clique {cid} publishing its shared memory"
    peers = _Peers()
    try:
        _follow(host, clique_key, group, table, cid, deadline, what, peers)
    finally:
        peers.close()


def _follow(host: Any, clique_key: int, group: int, table: list[int], cid: str,
            deadline: float, what: str, peers: _Peers) -> None:
    """The follower's attempts, watching the leader (``peers``) once its pid is known."""
    me, leader = jax.process_index(), table[0]

    def died(exited: list[tuple[int, int]]) -> BootstrapError:
        host._forget_domain(clique_key, group)
        return BootstrapError(
            f"jaxoverlap: {_named(exited)}, the leader of host clique {cid}, exited during "
            f"its bootstrap (before it confirmed that every process attached); this is "
            f"process {me}. See why that process ended (its own output).")

    while True:
        info = json.loads(_poll(_host_key(cid, "leader"), deadline, f"process {leader}", what,
                                lambda raw: json.loads(raw)["attempt"]
                                > _attempts_seen.get(cid, 0)))
        attempt = int(info["attempt"])
        _attempts_seen[cid] = attempt
        problem = None
        if info["rank_process"] != table:
            problem = (
                f"jaxoverlap: host clique {cid}: the leader (process {leader}) has rank table "
                f"{info['rank_process']} (rank -> process), process {me} has {table}. All "
                "processes must build the mesh from the same devices in the same order.")
        elif info["machine"] != machine_id():
            problem = (
                f"jaxoverlap: host clique {cid} spans machines (process {leader} runs on "
                f"{info['machine']}, process {me} on {machine_id()}): the host executor shares "
                "memory between processes, which works on one machine only. Use impl='ring' or "
                "impl='xla' for CPU meshes that span machines.")
        elif info["namespaces"] != namespaces():
            problem = (
                f"jaxoverlap: host clique {cid}: process {leader} and process {me} run in "
                f"different pid or network namespaces ({info['namespaces']} and "
                f"{namespaces()}; separate containers?). Their shared memory passes over Unix "
                "sockets that check each other's pid: run the job's processes on one machine in "
                "one container, or with the pid and network namespaces shared.")
        else:
            remaining = max(0.1, deadline - time.monotonic())
            peers.close()
            peers.watch(leader, int(info["pid"]))
            try:
                # The leader listens before it publishes: only a leader that gave this attempt
                # up is silent, and then a newer attempt follows (unless it has exited). The
                # segment's fd is received, mapped and closed in one call.
                host._shm_domain_receive(clique_key, group, table, me, attempt, info["socket"],
                                         int(info["pid"]), timeout_ms(min(remaining, 10.0)))
            except RuntimeError as e:
                if exited := peers.gone():
                    raise died(exited) from e
                if "nobody listens" in str(e) and time.monotonic() < deadline:
                    continue
                problem = f"jaxoverlap: process {me}: {e}"
        _set(_host_key(cid, attempt, "attached", me),
             b"ok" if problem is None else problem.encode())
        if problem is not None:
            raise BootstrapError(problem)
        verdict = _get_watched(
            _host_key(cid, attempt, "result"), deadline, f"process {leader}",
            f"leader of host clique {cid} confirming that every process attached", peers, died)
        if verdict != b"ok":
            host._forget_domain(clique_key, group)
            raise BootstrapError(f"jaxoverlap: the bootstrap of host clique {cid} failed (its "
                                 f"leader, process {leader}, reports): "
                                 f"{verdict.decode(errors='replace')}")
        return


def _set_overwrite(key: str, value: bytes) -> None:
    try:
        _require_client().key_value_set_bytes(key, value, allow_overwrite=True)
    except Exception as e:  # noqa: BLE001 - the client raises XlaRuntimeError subclasses
        raise BootstrapError(f"jaxoverlap: could not publish {key!r} in the jax.distributed "
                             f"key-value store: {e}") from e


def _poll(key: str, deadline: float, who: str, what: str, accept) -> bytes:
    """The value of ``key`` once ``accept(value)`` holds; polls the store until ``deadline``.

    For keys that are rewritten (a leader's newest attempt): a blocking get would return the
    stale value at once.
    """
    client_ = _require_client()
    delay = 0.005
    while True:
        try:
            value = bytes(client_.key_value_try_get_bytes(key))
        except Exception as e:  # noqa: BLE001 - NOT_FOUND until the key is written
            if "NOT_FOUND" not in str(e) and "not found" not in str(e).lower():
                raise BootstrapError(f"jaxoverlap: reading {key!r} ({what}) failed: {e}") from e
        else:
            if accept(value):
                return value
        if time.monotonic() >= deadline:
            raise BootstrapError(
                f"jaxoverlap: {who} did not answer within the timeout ({what}; key {key!r}). "
                f"Is that process still running the same program, and did it reach the same "
                f"jaxoverlap call? (JAXOVERLAP_TIMEOUT_S / timeout_s set the deadline)")
        time.sleep(delay)
        delay = min(0.1, delay * 2)
