"""Starts real processes that join one ``jax.distributed`` job on loopback; cleans up after them.

``run(scenario, nprocs, devices)`` launches ``nprocs`` copies of ``worker.py`` (one JAX process
each, ``devices`` CPU devices each), gives them a free coordinator port, waits for all of them
under a hard deadline, and returns what each printed. Whatever happens (timeout, failure,
KeyboardInterrupt), every child's process group is killed and reaped before ``run`` returns, and
entries the run left in ``/dev/shm`` are removed and reported. The job's entries are those its
processes were seen holding (open or mapped, sampled from /proc while they run) that were not
there before, and those whose names carry the unique ``JAXOVERLAP_SHM_TAG`` the children get
(the files the scenarios make themselves): never another job's on the same machine.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
SHM_DIR = "/dev/shm"
_runs = itertools.count()


@dataclasses.dataclass
class Proc:
    """What one child did: exit code (None if it had to be killed), output, wall time."""

    process_id: int
    returncode: int | None
    stdout: str
    stderr: str
    elapsed_s: float

    def result(self) -> dict[str, Any]:
        """The JSON the worker printed on its ``JO_MP_RESULT`` line ({} if none)."""
        for line in self.stdout.splitlines():
            if line.startswith("JO_MP_RESULT "):
                return json.loads(line[len("JO_MP_RESULT "):])
        return {}


class HarnessError(AssertionError):
    """A run that timed out, failed, or left something behind; carries every child's output."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shm_segments(tag: str) -> list[str]:
    """Names in /dev/shm that contain ``tag``."""
    return sorted(n for n in _dev_shm() if tag in n)


def _dev_shm() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return set()


def shm_held(pid: int | str = "self") -> tuple[set[str], set[str]]:
    """The shared memory process ``pid`` holds: the /dev/shm paths among its open files and
    mappings (" (deleted)" once unlinked), and the names of its memfds. Empty once it is gone."""
    targets = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:  # closed meanwhile
                pass
        with open(f"/proc/{pid}/maps") as maps:
            # start-end perms offset dev inode [path]
            targets += [f[5].strip() for f in (line.split(maxsplit=5) for line in maps)
                        if len(f) == 6]
    except OSError:  # the process is gone
        pass
    named = {t for t in targets if t.startswith(SHM_DIR + "/")}
    memfds = {t.removeprefix("/memfd:").removesuffix(" (deleted)") for t in targets
              if t.startswith("/memfd:")}
    return named, memfds


def describe(procs: list[Proc], tail: int = 4000) -> str:
    parts = []
    for p in procs:
        parts.append(
            f"--- process {p.process_id}: exit {p.returncode}, {p.elapsed_s:.1f} s\n"
            f"[stdout]\n{p.stdout[-tail:]}\n[stderr]\n{p.stderr[-tail:]}"
        )
    return "\n".join(parts)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_PORT_TAKEN = ("Address already in use", "Failed to add port", "Failed to bind")

# linux/securebits.h, linux/prctl.h, linux/capability.h
_SECURE_NOROOT = 0b11 | 0b1100 | 0b100000  # noroot, no_setuid_fixup, keep_caps: set and locked
_PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _PR_SET_NO_NEW_PRIVS = 24, 28, 38
_CAPABILITY_VERSION_3 = 0x20080522


def _without_privileges() -> None:
    """In a child before it executes: keeps its uid (root's too) but drops every capability,
    for good (securebits: execve grants none back). What stays is an ordinary process of that
    uid: it may do to the other processes of the uid what the same user may, and no more."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")

    if os.geteuid() == 0 or _capabilities("CapEff"):
        check(libc.prctl(_PR_SET_SECUREBITS, _SECURE_NOROOT, 0, 0, 0), "PR_SET_SECUREBITS")
        for cap in range(64):
            libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)   # EINVAL past the last one
        header = ctypes.create_string_buffer(struct.pack("Ii", _CAPABILITY_VERSION_3, 0))
        data = ctypes.create_string_buffer(24)           # two empty cap_user_data_t
        check(libc.capset(header, data), "capset")
    check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")


def _capabilities(field: str, pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1], 16)
    return 0


def run(
    scenario: str,
    nprocs: int,
    devices: int = 1,
    params: dict[str, Any] | None = None,
    timeout_s: float = 150.0,
    env: dict[str, str] | None = None,
    expect_success: bool = True,
    unprivileged: bool = False,
    process_env: Any = None,
) -> list[Proc]:
    """Runs ``worker.py scenario`` in ``nprocs`` processes; returns their ``Proc`` records.

    Raises ``HarnessError`` when the deadline passes (the children are killed), when
    ``expect_success`` and a child failed, or when a shared-memory segment is left behind.
    If the coordinator's port was taken between choosing and binding it (the machine is
    shared), the job is started once more on another port. ``unprivileged``: the children
    run without any capability (as root too: still uid 0, but an ordinary user's process).
    ``process_env(process_id)``: more environment for that process (e.g. its own hash seed).
    """
    args = (scenario, nprocs, devices, params, timeout_s, env, expect_success, unprivileged,
            process_env)
    try:
        return _run_once(*args)
    except HarnessError as e:
        if not any(text in str(e) for text in _PORT_TAKEN):
            raise
    return _run_once(*args)


def _xla_flags(devices: int) -> str:
    """The suite's XLA flags (conftest.py) with this run's count of host devices per process."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])


def _run_once(
    scenario: str,
    nprocs: int,
    devices: int = 1,
    params: dict[str, Any] | None = None,
    timeout_s: float = 150.0,
    env: dict[str, str] | None = None,
    expect_success: bool = True,
    unprivileged: bool = False,
    process_env: Any = None,
) -> list[Proc]:
    tag = f"jotest{os.getpid()}x{next(_runs)}"
    port = free_port()
    base = dict(os.environ)
    base.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=_xla_flags(devices),
        JO_MP_COORDINATOR=f"127.0.0.1:{port}",
        JO_MP_NUM_PROCESSES=str(nprocs),
        JAXOVERLAP_SHM_TAG=tag,
        PYTHONUNBUFFERED="1",
    )
    base.update(env or {})
    argv = [sys.executable, WORKER, scenario, json.dumps(params or {})]
    children: list[tuple[subprocess.Popen, Any, Any, float]] = []
    ended: dict[int, float] = {}
    before = _dev_shm()
    held: set[str] = set()  # /dev/shm names the children were seen holding
    start = sampled = time.monotonic()
    timed_out = False
    try:
        for pid in range(nprocs):
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            child_env = dict(base, JO_MP_PROCESS_ID=str(pid),
                             **(process_env(pid) if process_env is not None else {}))
            proc = subprocess.Popen(argv, env=child_env, stdout=out, stderr=err,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=_without_privileges if unprivileged else None)
            children.append((proc, out, err, time.monotonic()))
        deadline = start + timeout_s
        while len(ended) < nprocs:
            for i, (proc, _, _, _) in enumerate(children):
                if i not in ended and proc.poll() is not None:
                    ended[i] = time.monotonic()
            if len(ended) == nprocs:
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            if time.monotonic() - sampled > 0.25:
                sampled = time.monotonic()
                for i, (proc, _, _, _) in enumerate(children):
                    if i not in ended:
                        held |= {os.path.basename(p.removesuffix(" (deleted)"))
                                 for p in shm_held(proc.pid)[0]}
            time.sleep(0.05)
    finally:
        for proc, _, _, _ in children:
            _kill_group(proc)  # the child is done or must go: also kills anything it started
            proc.wait()
    procs = []
    for i, (proc, out, err, t0) in enumerate(children):
        out.seek(0)
        err.seek(0)
        procs.append(Proc(
            process_id=i,
            returncode=proc.returncode if i in ended else None,
            stdout=out.read().decode(errors="replace"),
            stderr=err.read().decode(errors="replace"),
            elapsed_s=ended.get(i, time.monotonic()) - t0,
        ))
        out.close()
        err.close()
    leftovers = sorted(n for n in _dev_shm() if tag in n or (n in held and n not in before))
    for name in leftovers:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass
    if timed_out:
        raise HarnessError(f"{scenario}: hard timeout after {timeout_s:.0f} s; children killed\n"
                           + describe(procs))
    if expect_success and any(p.returncode != 0 for p in procs):
        raise HarnessError(f"{scenario}: a process failed\n" + describe(procs))
    if leftovers:
        raise HarnessError(f"{scenario}: shared-memory segments left behind: {leftovers}\n"
                           + describe(procs))
    return procs
