"""A process of the job's user that is not part of the job, looking for the job's shared memory.

Usage: ``watcher.py PID,PID,...`` (the job's processes); prints ``watching``, scans until a line
arrives on stdin, then prints one JSON report. Started by worker.py's ``watched`` scenario in a
session of its own (``setsid``): a child of a job process, not an ancestor of any, with the
job's uid and capabilities (none, when the harness drops them: see harness.run's
``unprivileged``). It never ptraces, nor uses anything that needs ptrace's attach-level access
(``/proc/<pid>/mem``, ``pidfd_getfd``, ``process_vm_readv``): those read any memory of a process
and are outside the model (docs/multiprocess.md §3). What it does use is what the same user
may do without that: read-level access, by which ``/proc/<pid>/fd/N`` reopens whatever a job
process holds open. Over and over, it tries

* every name in /dev/shm that was not there when it started, and every name with "jaxoverlap",
  opened read-write — but the names of other test jobs running on this machine at the same time
  (with a harness tag, ``jotest<pid>x<run>``, that is not this job's ``JAXOVERLAP_SHM_TAG``):
  they cannot be this job's, whose names would carry its tag or none;
* /proc/<pid>/fd/* of each job process that is a memfd (or names jaxoverlap or /dev/shm),
  opened read-write, and /proc/<pid>/map_files/* (the mappings);
* every abstract Unix socket named like the job's fd servers, asking for fds.

Whatever it could open or receive is in the report, by path, with its own and the job
processes' uids and effective capabilities (what makes it a peer of the same user).
"""

from __future__ import annotations

import json
import os
import re
import select
import socket
import struct
import sys
import time


def credentials(pid: int | str) -> dict[str, str]:
    """uid and effective capabilities of process ``pid`` (from /proc/<pid>/status)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Uid", "CapEff"):
                out[key] = value.split()[0]
    return out


class Report:
    def __init__(self) -> None:
        self.opened: dict[str, str] = {}  # path -> how
        self.targets: dict[str, str] = {}  # path -> what the opened descriptor is
        self.tries: dict[str, int] = {}
        self.refusals: dict[str, str] = {}
        self.others: set[str] = set()  # names of other test jobs, left alone
        self.seen: set[str] = set()    # what /proc/<pid>/{fd,map_files} of the job showed

    def tried(self, kind: str, error: OSError | None = None) -> None:
        self.tries[kind] = self.tries.get(kind, 0) + 1
        if error is not None:
            self.refusals.setdefault(kind, f"{type(error).__name__}: {error.strerror}")

    def got(self, path: str, how: str, target: str) -> None:
        self.opened.setdefault(path, how)
        self.targets.setdefault(path, target)


def try_open(report: Report, kind: str, path: str, flags: int = os.O_RDWR) -> None:
    try:
        fd = os.open(path, flags | os.O_CLOEXEC)
    except OSError as e:
        report.tried(kind, e)
        return
    report.tried(kind)
    try:  # what was opened, read from this process's own descriptor (no race with the job's)
        target = os.readlink(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    report.got(path, kind, target)


# The tag the test harness gives each job it runs (harness.py), in every name that job makes.
HARNESS_TAG = re.compile(r"jotest\d+x\d+")


def another_jobs(name: str) -> bool:
    """Does ``name`` carry the harness tag of another test job than this one?"""
    return any(tag != os.environ.get("JAXOVERLAP_SHM_TAG") for tag in HARNESS_TAG.findall(name))


def scan_dev_shm(report: Report, before: set[str]) -> None:
    for name in os.listdir("/dev/shm"):
        if another_jobs(name):
            report.others.add(name)
        elif name not in before or "jaxoverlap" in name:
            try_open(report, "dev_shm", f"/dev/shm/{name}")


def scan_proc(report: Report, pids: list[int]) -> None:
    for pid in pids:
        for sub in ("fd", "map_files"):
            try:
                entries = os.listdir(f"/proc/{pid}/{sub}")
            except OSError as e:
                report.tried(f"proc_{sub}_list", e)
                continue
            report.tried(f"proc_{sub}_list")
            for entry in entries:
                path = f"/proc/{pid}/{sub}/{entry}"
                try:
                    target = os.readlink(path)
                except OSError as e:
                    report.tried(f"proc_{sub}", e)
                    continue
                if "memfd:" in target or "jaxoverlap" in target or "/dev/shm" in target:
                    report.seen.add(f"{pid} {sub}: {target}")
                    try_open(report, f"proc_{sub}", path)


def job_sockets() -> list[str]:
    names = []
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if len(parts) >= 8 and parts[-1].startswith("@jaxoverlap-"):
                names.append(parts[-1][1:])
    return sorted(set(names))


def ask_socket(report: Report, name: str) -> None:
    """Connects and asks for fds the way the job's processes do (a token, then a reply)."""
    for token in (0, 1, 2, (1 << 32) | 1, int.from_bytes(os.urandom(8), "little")):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(0.5)
        try:
            s.connect("\0" + name)
            s.sendall(struct.pack("<Q", token))
            _, ancillary, _, _ = s.recvmsg(1, socket.CMSG_SPACE(64 * 4))
        except OSError as e:
            report.tried("socket", e)
            continue
        finally:
            s.close()
        report.tried("socket")
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                for fd in struct.unpack(f"{len(data) // 4}i", data[: len(data) // 4 * 4]):
                    report.got(f"@{name} token {token}", "socket")
                    os.close(fd)


def main() -> int:
    pids = [int(p) for p in sys.argv[1].split(",")]
    before = set(os.listdir("/dev/shm")) - {n for n in os.listdir("/dev/shm") if "canary" in n}
    report = Report()
    sockets: set[str] = set()
    job = {pid: credentials(pid) for pid in pids}
    print("watching", flush=True)
    start = time.monotonic()
    rounds = 0
    while not select.select([sys.stdin], [], [], 0)[0]:
        scan_dev_shm(report, before)
        scan_proc(report, pids)
        for name in job_sockets():
            sockets.add(name)
            ask_socket(report, name)
        rounds += 1
        time.sleep(0.002)
    sys.stdin.readline()
    print(json.dumps({
        "opened": report.opened, "targets": report.targets, "tries": report.tries,
        "refusals": report.refusals,
        "sockets": sorted(sockets), "others": sorted(report.others), "rounds": rounds,
        "seen": sorted(report.seen), "seconds": time.monotonic() - start,
        "me": credentials("self"), "job": {str(p): c for p, c in job.items()},
        "parent": os.getppid(), "session_leader": os.getsid(0) == os.getpid(),
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
