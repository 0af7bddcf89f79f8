"""The shared-memory transport's defences, one process at a time (no jax.distributed job).

What another local user, a squatter, a killed job or a corrupted segment can do to a clique
spanning processes, and that each is refused or cleaned up. The segments of a domain are made
through the same bindings the bootstrap uses (``_shm_domain_create`` / ``_shm_domain_attach``).
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import textwrap

import pytest

from jaxoverlap._native.runtime import load_host

# Processes of their own: seconds each.
pytestmark = pytest.mark.slow

host = load_host()
SHM = "/dev/shm"
# A name as NewShmName makes them: creator's pid namespace and pid, then 128 random bits.
NAME = re.compile(r"^/jaxoverlap-(?:\w+-)?p(\d+)\.(\d+)-([0-9a-f]{32})$")


@pytest.fixture
def domain():
    """A domain of 2 ranks in processes 0 (here) and 1 (nobody): its name, then cleanup."""
    key = secrets.randbits(62)
    name = host._shm_domain_create(key, 0, [0, 1], 0, 1)
    yield key, name
    host._forget_domain(key, 0)
    host._shm_unlink(name)


def _control_bytes(name: str) -> int:
    return os.stat(SHM + name).st_size


def _copy_segment(name: str, mode: int = 0o600, size: int | None = None) -> str:
    """A new segment holding a copy of `name`'s bytes (optionally resized), with `mode`."""
    data = open(SHM + name, "rb").read()
    if size is not None:
        data = data[:size].ljust(size, b"\0")
    copy = f"/jaxoverlap-test-{secrets.token_hex(8)}"
    fd = os.open(SHM + copy, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
    os.write(fd, data)
    os.fchmod(fd, mode)  # regardless of the umask
    os.close(fd)
    return copy


def _attach(key: int, name: str, attempt: int = 1, table=(0, 1)) -> None:
    host._shm_domain_attach(key, 0, list(table), 1, attempt, name)


def test_names_are_unguessable_and_name_their_creator(domain):
    key, name = domain
    match = NAME.match(name)
    assert match, name
    assert int(match.group(2)) == os.getpid()
    assert int(match.group(1)) == os.stat("/proc/self/ns/pid").st_ino
    other = host._shm_domain_create(key + 1, 0, [0, 1], 0, 1)
    try:
        assert NAME.match(other).group(3) != match.group(3)  # fresh random bits every time
    finally:
        host._forget_domain(key + 1, 0)
        host._shm_unlink(other)


def test_segments_are_private_reserved_and_keep_no_fd(domain):
    _, name = domain
    st = os.stat(SHM + name)
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()
    # Reserved with posix_fallocate: every page is allocated, not a sparse file.
    assert st.st_blocks * 512 >= st.st_size
    fds = len(os.listdir("/proc/self/fd"))
    key2 = secrets.randbits(62)
    other = host._shm_domain_create(key2, 0, [0, 1], 0, 1)
    try:
        assert len(os.listdir("/proc/self/fd")) == fds  # mapped, and its fd closed
    finally:
        host._forget_domain(key2, 0)
        host._shm_unlink(other)


def test_a_segment_other_users_may_open_is_refused(domain):
    key, name = domain
    loose = _copy_segment(name, mode=0o644)
    try:
        with pytest.raises(RuntimeError, match=r"refusing shared-memory segment .*mode 0644"):
            _attach(key, loose)
    finally:
        os.unlink(SHM + loose)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a segment to another uid needs root")
def test_a_segment_of_another_user_is_refused(domain):
    key, name = domain
    foreign = _copy_segment(name)
    os.chown(SHM + foreign, 65534, 65534)
    try:
        with pytest.raises(RuntimeError, match=r"belongs to uid 65534, not to this user"):
            _attach(key, foreign)
    finally:
        os.unlink(SHM + foreign)


def test_a_symlink_is_not_followed(domain):
    key, name = domain
    link = f"/jaxoverlap-test-{secrets.token_hex(8)}"
    os.symlink(SHM + name, SHM + link)
    try:
        with pytest.raises(RuntimeError, match=r"shm_open\(" + re.escape(link)):
            _attach(key, link)
    finally:
        os.unlink(SHM + link)


def test_a_segment_of_the_wrong_size_or_contents_is_refused(domain):
    key, name = domain
    size = _control_bytes(name)
    short = _copy_segment(name, size=size - 64)
    try:
        with pytest.raises(RuntimeError, match=f"has {size - 64} bytes, expected {size}"):
            _attach(key, short)
    finally:
        os.unlink(SHM + short)
    garbage = _copy_segment(name)
    with open(SHM + garbage, "r+b") as f:
        f.write(b"\xff" * 16)  # the magic and version
    try:
        with pytest.raises(RuntimeError, match="is not a jaxoverlap clique segment"):
            _attach(key, garbage)
    finally:
        os.unlink(SHM + garbage)
    with pytest.raises(RuntimeError, match="describes clique .* with 2 ranks, but this process "
                                           "bootstraps clique .* with 2"):
        _attach(key + 1, name)  # another clique's segment
    with pytest.raises(RuntimeError, match="bytes, expected"):
        _attach(key, name, table=(0, 1, 1))  # another rank count: another size
    with pytest.raises(RuntimeError, match="belongs to bootstrap attempt 1 of clique .* this "
                                           "process joins attempt 2"):
        _attach(key, name, attempt=2)
    with pytest.raises(RuntimeError, match="not a jaxoverlap shared-memory name"):
        _attach(key, "/etc-passwd")


def test_segments_a_killed_job_left_behind_are_swept(domain):
    key, _ = domain
    # A process that exits without unlinking (as one killed between create and the last
    # attach): its pid is then free.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(dead.stdout)
    ns = os.stat("/proc/self/ns/pid").st_ino
    stale = f"/jaxoverlap-p{ns}.{pid}-{secrets.token_hex(16)}"
    alive = f"/jaxoverlap-p{ns}.{os.getpid()}-{secrets.token_hex(16)}"
    elsewhere = f"/jaxoverlap-p{ns + 1}.{pid}-{secrets.token_hex(16)}"
    for name in (stale, alive, elsewhere):
        fd = os.open(SHM + name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)
    try:
        other = host._shm_domain_create(key + 7, 0, [0, 1], 0, 1)  # creating a domain sweeps
        host._forget_domain(key + 7, 0)
        host._shm_unlink(other)
        assert not os.path.exists(SHM + stale)
        assert os.path.exists(SHM + alive)  # its creator (this process) is alive
        assert os.path.exists(SHM + elsewhere)  # another pid namespace: its pid means nothing
    finally:
        for name in (stale, alive, elsewhere):
            if os.path.exists(SHM + name):
                os.unlink(SHM + name)


def test_the_fd_client_refuses_a_squatter_on_the_socket_name():
    """Anyone may bind an abstract socket name first: the client must check who serves it."""
    name = f"jaxoverlap-test-{secrets.token_hex(8)}"
    squatter = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import os, sys
            from jaxoverlap._native.runtime import load_host
            r, w = os.pipe()
            server = load_host()._fd_serve({name!r}, [r], [{os.getpid()}], 20000)
            print("ready", flush=True)
            server.finish()
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline().strip() == "ready"
        owner = os.getpid() + 1_000_000  # the pid the store says owns the fds
        with pytest.raises(RuntimeError, match=rf"refusing @{name}: it is served by pid "
                                               rf"{squatter.pid} .* not by the owner, pid {owner}"):
            host._fd_receive(name, 1, owner, 5000)
    finally:
        squatter.kill()
        squatter.wait()


def test_the_fd_server_serves_its_owner_pid_only_and_the_client_accepts_it():
    name = f"jaxoverlap-test-{secrets.token_hex(8)}"
    r, w = os.pipe()
    try:
        os.write(w, b"hello")
        server = host._fd_serve(name, [r], [os.getpid()], 5000)
        (fd,) = host._fd_receive(name, 1, os.getpid(), 5000)
        server.finish()
        assert os.read(fd, 5) == b"hello"
        os.close(fd)
    finally:
        os.close(r)
        os.close(w)


SMALL_TMPFS = "mount -t tmpfs -o size=4m tmpfs /dev/shm"


def _namespaces_allowed() -> bool:
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", SMALL_TMPFS], capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
def test_a_small_dev_shm_gives_an_error_naming_the_size_not_sigbus():
    """Docker's default /dev/shm is 64 MiB; here a 4 MiB tmpfs (in a user and mount namespace)
    meets a clique whose buffers need more. Without the reservation the first write past the
    free space killed the processes with SIGBUS; now every process fails with an error naming
    the size and the fix."""
    if not _namespaces_allowed():
        pytest.skip("this machine does not allow user + mount namespaces (unshare -Urm), "
                    "so a small /dev/shm cannot be made here")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {os.path.dirname(tests)!r})
        from tests.multiprocess import harness
        procs = harness.run("shm_full", 2, 1, timeout_s=120, expect_success=False)
        print("RESULTS " + json.dumps([[p.returncode, p.result()] for p in procs]))
        print(harness.describe(procs), file=sys.stderr)
    """)
    run = subprocess.run(["unshare", "-Urm", "sh", "-c", f"{SMALL_TMPFS} && exec "
                          f"{sys.executable} -c \"$0\"", script],
                         capture_output=True, text=True, timeout=240)
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert line is not None, run.stdout + run.stderr
    import json

    results = json.loads(line[len("RESULTS "):])
    for returncode, result in results:
        assert returncode == 0, run.stderr  # no SIGBUS (-7)
        error = result["error"]
        assert error is not None and "could not reserve" in error, run.stderr
        assert "--shm-size=" in error and "/dev/shm has" in error, error
