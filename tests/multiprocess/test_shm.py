"""The shared-memory transport's defences, one process at a time (no jax.distributed job).

What another local user or process, a squatter or a corrupted segment can do to a clique spanning
processes, and that each is refused. A domain is made through the same bindings the bootstrap
uses (``_shm_domain_create`` gives the leader's control segment parked, out of the fd table:
``take()`` brings it back as an fd; ``_shm_domain_attach`` maps one received from it); a real
job with a same-user watcher is in test_multiprocess.py.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import subprocess
import sys
import textwrap

import pytest
import testing_ext

from jaxoverlap._executors.runtime import load_host

# Processes of their own: seconds each.
pytestmark = pytest.mark.slow

host = load_host()
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


@pytest.fixture
def domain():
    """A domain of 2 ranks in processes 0 (here) and 1 (nobody): its key and control fd."""
    key = secrets.randbits(62)
    (fd,) = host._shm_domain_create(key, 0, [0, 1], 0, 1).take()
    yield key, fd
    host._forget_domain(key, 0)
    os.close(fd)


def _sealed_copy(fd: int, size: int | None = None, mode: int = 0o600, seal: bool = True,
                 patch: bytes = b"") -> int:
    """A memfd holding `fd`'s bytes (resized to `size`, its start overwritten by `patch`)."""
    data = os.pread(fd, os.fstat(fd).st_size, 0)
    if size is not None:
        data = data[:size].ljust(size, b"\0")
    data = patch + data[len(patch):]
    copy = os.memfd_create("jo-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(copy, data)
    os.fchmod(copy, mode)
    if seal:
        fcntl.fcntl(copy, fcntl.F_ADD_SEALS, SEALS)
    return copy


def _attach(key: int, fd: int, attempt: int = 1, table=(0, 1)) -> None:
    host._shm_domain_attach(key, 0, list(table), 1, attempt, fd)


def test_segments_have_no_name_and_are_private_reserved_and_sealed(domain):
    _, fd = domain
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")  # nothing in a file system
    st = os.fstat(fd)
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()
    assert st.st_blocks * 512 >= st.st_size  # reserved with posix_fallocate, not sparse
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    with pytest.raises(PermissionError):  # sealed: nobody resizes it under a mapping
        os.ftruncate(fd, st.st_size // 2)
    before = sorted(os.listdir("/dev/shm"))
    key2 = secrets.randbits(62)
    (fd2,) = host._shm_domain_create(key2, 0, [0, 1], 0, 1).take()
    try:
        assert sorted(os.listdir("/dev/shm")) == before
    finally:
        host._forget_domain(key2, 0)
        os.close(fd2)


def _segments_held() -> list[str]:
    """This process's open descriptors of jaxoverlap segments, as /proc/self/fd shows them."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return [link for link in links if link.startswith("/memfd:jaxoverlap ")]


def test_a_segment_waiting_to_be_handed_out_is_in_no_fd_table():
    """Parked: nothing in /proc/<pid>/fd reopens it (the same user's read-level access)."""
    key = secrets.randbits(62)
    held = _segments_held()
    parked = host._shm_domain_create(key, 0, [0, 1], 0, 1)
    try:
        assert parked.count == 1 and _segments_held() == held
        (fd,) = parked.take()                      # back for a hand-out: now it is there
        assert len(_segments_held()) == len(held) + 1 and parked.count == 0
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
        os.close(fd)
    finally:
        host._forget_domain(key, 0)


def test_a_segment_that_is_not_a_sealed_private_memfd_of_ours_is_refused(domain, tmp_path):
    key, fd = domain
    size = os.fstat(fd).st_size
    r, w = os.pipe()
    try:
        with pytest.raises(RuntimeError, match="refusing the shared-memory segment .* it is not "
                                               "a shared-memory file"):
            _attach(key, r)
    finally:
        os.close(r)
        os.close(w)
    # A file with a name (here in a directory; /dev/shm alike) is not a memfd: others could
    # open it by that name.
    path = tmp_path / "segment"
    path.write_bytes(os.pread(fd, size, 0))
    path.chmod(0o600)
    named = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(RuntimeError, match="is not a sealed memfd"):
            _attach(key, named)
    finally:
        os.close(named)
    for kwargs, message in [
        (dict(seal=False), "is not a sealed memfd"),
        (dict(mode=0o644), r"has mode 0644 \(other users may open it"),
        (dict(size=size - 64), f"has {size - 64} bytes, expected {size}"),
        (dict(patch=b"\xff" * 16), "is not a jaxoverlap control segment"),
    ]:
        copy = _sealed_copy(fd, **kwargs)
        try:
            with pytest.raises(RuntimeError, match=message):
                _attach(key, copy)
        finally:
            os.close(copy)
    with pytest.raises(RuntimeError, match="describes clique .* with 2 ranks, but this process "
                                           "bootstraps clique .* with 2"):
        _attach(key + 1, fd)  # another clique's segment
    with pytest.raises(RuntimeError, match="bytes, expected"):
        _attach(key, fd, table=(0, 1, 1))  # another rank count: another size
    with pytest.raises(RuntimeError, match="belongs to bootstrap attempt 1 of clique .* this "
                                           "process joins attempt 2"):
        _attach(key, fd, attempt=2)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a segment to another uid needs root")
def test_a_segment_of_another_user_is_refused(domain):
    key, fd = domain
    foreign = _sealed_copy(fd)
    os.fchown(foreign, 65534, 65534)
    try:
        with pytest.raises(RuntimeError, match=r"belongs to uid 65534, not to this user"):
            _attach(key, foreign)
    finally:
        os.close(foreign)


def test_the_call_site_directory_counts_live_sites_not_sites_ever_made():
    """At the real capacity (4096): one site stays open while 10000 others open and close one
    after another (a long job recompiling); each finds its own segment, and nothing is left
    held. Then, with room for 64, the 64th site opened while 63 are open (plus the kept one)
    is refused at once, naming the capacity, and closing them lets every fd go."""
    testing = testing_ext.load()
    churn = testing.site_directory(4096, 10_000)
    assert churn["churned"] == 10_000 and churn["kept_site"] == 1, churn
    assert churn["offers_closed"] == 0, churn
    full = testing.site_directory(64, 100, fill=True)
    assert full["filled"] == 63, full  # 64 live sites with the kept one
    assert "has no room for another call site: 64 call sites" in full["full_error"], full
    assert "JAXOVERLAP_MAX_CALL_SITES" in full["full_error"], full
    assert full["offers_open"] == 64 and full["offers_closed"] == 0, full


def test_the_fd_client_refuses_a_squatter_on_the_socket_name():
    """Anyone may bind an abstract socket name first: the client must check who serves it."""
    name = f"jaxoverlap-test-{secrets.token_hex(8)}"
    squatter = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import os, sys
            from jaxoverlap._executors.runtime import load_host
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


def test_a_small_dev_shm_does_not_matter():
    """Docker's default /dev/shm is 64 MiB; here a 4 MiB tmpfs (in a user and mount namespace)
    meets a job whose call site needs more. The segments are memfds, not files in /dev/shm:
    the job runs and gets the right numbers."""
    if not _namespaces_allowed():
        pytest.skip("this machine does not allow user + mount namespaces (unshare -Urm), "
                    "so a small /dev/shm cannot be made here")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {os.path.dirname(tests)!r})
        from tests.multiprocess import harness
        procs = harness.run("small_dev_shm", 2, 1, timeout_s=120, expect_success=False)
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
        assert returncode == 0, run.stderr
        assert result["site_bytes"] > 4 << 20, result  # more than the whole /dev/shm
        assert result["dev_shm_bytes"] <= 4 << 20, result
        assert result["checked"], result
