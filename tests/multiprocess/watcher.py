"""A process of the job's user that is not part of the job, looking for the job's shared memory.

Usage: ``watcher.py PID,PID,...`` (the job's processes); prints ``watching``, scans until a line
arrives on stdin, then prints one JSON report. Started by worker.py's ``watched`` scenario.

It stands for another process of the same user without ptrace rights over the job (what Yama's
``ptrace_scope`` 1 gives a non-ancestor): it restricts itself with Landlock, which refuses
ptrace-mode access to processes outside its sandbox, whatever the user (when the kernel has
Landlock). Run as root, it is started in a user namespace of its own (``JO_WATCHER_USERNS=1``),
so it is root without root's privileges over the job: no capability over processes outside its
namespace, hence no ptrace access to the job's (which hold capabilities it lacks). Over and
over, it tries

* every name in /dev/shm that was not there when it started, and every name with "jaxoverlap",
  opened read-write — but the names of other test jobs running on this machine at the same time
  (with a harness tag, ``jotest<pid>x<run>``, that is not this job's ``JAXOVERLAP_SHM_TAG``):
  they cannot be this job's, whose names would carry its tag or none;
* /proc/<pid>/fd/* (the memfds), /proc/<pid>/map_files/* (the mappings) and /proc/<pid>/mem of
  each job process, and pidfd_getfd on their fds;
* every abstract Unix socket named like the job's fd servers, asking for fds.

Whatever it could open or receive is in the report, by path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import select
import socket
import struct
import sys
import time

LANDLOCK_ACCESS_FS_MAKE_BLOCK = 1 << 11
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_RESTRICT_SELF = 444, 446
SYS_PIDFD_OPEN, SYS_PIDFD_GETFD = 434, 438
PR_SET_NO_NEW_PRIVS = 38

libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
libc.syscall.restype = ctypes.c_long


def landlock() -> str:
    """Sandboxes this process (handling one unrelated right: every file access stays allowed,
    but ptrace-mode access to processes outside the sandbox is refused). Returns "" or why not."""
    attr = struct.pack("Q", LANDLOCK_ACCESS_FS_MAKE_BLOCK)
    buf = ctypes.create_string_buffer(attr)
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)), 0)
    if ruleset < 0:
        return f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}"
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return f"prctl(NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}"
    if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
        return f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}"
    os.close(ruleset)
    return ""


class Report:
    def __init__(self) -> None:
        self.opened: dict[str, str] = {}  # path -> how
        self.tries: dict[str, int] = {}
        self.refusals: dict[str, str] = {}
        self.others: set[str] = set()  # names of other test jobs, left alone

    def tried(self, kind: str, error: OSError | None = None) -> None:
        self.tries[kind] = self.tries.get(kind, 0) + 1
        if error is not None:
            self.refusals.setdefault(kind, f"{type(error).__name__}: {error.strerror}")

    def got(self, path: str, how: str) -> None:
        self.opened.setdefault(path, how)


def try_open(report: Report, kind: str, path: str, flags: int = os.O_RDWR) -> None:
    try:
        fd = os.open(path, flags | os.O_CLOEXEC)
    except OSError as e:
        report.tried(kind, e)
        return
    report.tried(kind)
    report.got(path, kind)
    os.close(fd)


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
                    try_open(report, f"proc_{sub}", path)
        try_open(report, "proc_mem", f"/proc/{pid}/mem", os.O_RDONLY)
        pidfd = libc.syscall(SYS_PIDFD_OPEN, pid, 0)
        if pidfd < 0:
            continue
        for target_fd in range(3, 64):
            got = libc.syscall(SYS_PIDFD_GETFD, pidfd, target_fd, 0)
            if got >= 0:
                link = os.readlink(f"/proc/self/fd/{got}")
                if "memfd:" in link:
                    report.got(f"pidfd_getfd({pid}, {target_fd}) -> {link}", "pidfd_getfd")
                os.close(got)
            report.tried("pidfd_getfd", None if got >= 0 else OSError(
                ctypes.get_errno(), os.strerror(ctypes.get_errno())))
        os.close(pidfd)


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
    sandbox = landlock()
    before = set(os.listdir("/dev/shm")) - {n for n in os.listdir("/dev/shm") if "canary" in n}
    report = Report()
    sockets: set[str] = set()
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
        time.sleep(0.01)
    sys.stdin.readline()
    print(json.dumps({
        "opened": report.opened, "tries": report.tries, "refusals": report.refusals,
        "sockets": sorted(sockets), "others": sorted(report.others), "rounds": rounds,
        "seconds": time.monotonic() - start,
        # What takes its ptrace rights over the job away.
        "no_ptrace": (["landlock"] if not sandbox else [])
        + (["user namespace"] if os.environ.get("JO_WATCHER_USERNS") == "1" else []),
        "landlock": sandbox or "on", "uid": os.getuid(), "euid": os.geteuid(),
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
