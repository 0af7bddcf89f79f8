"""One-launch all-reduce kernels (matmul_ar's one_shot_kernel / two_shot_kernel; never run on
a GPU).

A small all-reduce in one kernel launch: its flags (device-side counters) and its data movement
inside, no host-enqueued copies or stream memory ops. What such a kernel costs, per algorithm
and transport, is what a program's ``AllReduceKernel`` op (one launch: algorithm, transport,
bytes) will be priced with:

* its **start**, ``Preset.ar_start_us`` (the launch reaching the SMs in a stream that is
  already running: a queued kernel or a replayed graph node);
* **flag rounds**, ``Preset.ar_flag_us`` each: every rank raises a flag in every peer's memory
  (``st.release.sys``) and waits for the peers' (``ld.acquire.sys``). A one-shot needs two
  (peers' inputs ready; peers done reading, so the buffer may be reused: PyTorch's symmetric-
  memory kernels' barriers before and after, vLLM's ``cross_device_reduce_1stage``), a two-shot
  three (before, between its reduce-scatter and its all-gather, after);
* its **bytes** on the busiest port, at the transport's rate: SM loads from peers' memory over
  the links (``p2p``: ``Preset.p2p_load_gbps``, default the line rate) or the switch's
  ``multimem`` load-reduce and store (``multicast``: ``Preset.multicast_gbps``).

``ar_start_us`` and ``ar_flag_us`` are fitted to the leanest published one-launch one-shot
kernels on H100 (``sim.published.fit_one_launch``); the published two-shot kernels (PyTorch's
symmetric-memory ones, vLLM's two-stage) take 1.5-2.5x longer than this prices a two-shot: their
barriers cost more than one lean flag round, and docs/performance.md §4 shows by how much. The
margin a one-launch plan needs before the automatic choice takes it comes from these
comparisons (``sim.families``).
"""

from __future__ import annotations

from jaxoverlap.sim.presets import Preset

US = 1e-6
ALGORITHMS = ("one_shot", "two_shot")
TRANSPORTS = ("p2p", "multicast")


def base_algorithm(name: str | None) -> str | None:
    """The one-launch algorithm (``ALGORITHMS``) a program's matmul_ar algorithm names, or
    None: ``one_shot_kernel`` / ``two_shot_kernel`` are the one-launch kernels (one
    ``AllReduce`` op, replayable: a program of them is priced captured), ``one_shot`` /
    ``two_shot`` the host-enqueued programs."""
    if name and name.endswith("_kernel") and name.removesuffix("_kernel") in ALGORITHMS:
        return name.removesuffix("_kernel")
    return None


def flag_rounds(algorithm: str) -> int:
    """Flag rounds of one call: a one-shot two, a two-shot three (see the module docstring)."""
    _check(algorithm, "p2p")
    return 2 if algorithm == "one_shot" else 3


def port_bytes(algorithm: str, transport: str, nranks: int, nbytes: float) -> float:
    """Bytes through the busiest port direction of one GPU for an all-reduce of ``nbytes``.

    one-shot p2p: every rank loads the N-1 peers' inputs (ingress, and as much egress serving
    them); two-shot p2p: a reduce-scatter and an all-gather of (N-1)/N of the input each;
    one-shot multicast: every rank load-reduces the whole input from the multicast address, so
    the switch reads each GPU's copy once per rank (egress N x); two-shot multicast: each rank
    load-reduces its 1/N (its memory read once per slice: egress S) and stores the result to
    all (ingress (N-1)/N S), with its own slice's store, egress S (N+1)/N in all.
    """
    _check(algorithm, transport)
    n, s = nranks, float(nbytes)
    if transport == "p2p":
        return (n - 1) * s if algorithm == "one_shot" else 2.0 * (n - 1) / n * s
    return n * s if algorithm == "one_shot" else (n + 1) / n * s


def rate_gbps(p: Preset, transport: str) -> float:
    """The transport's rate for a kernel's own loads and stores (GB/s per direction)."""
    if transport == "p2p":
        if not p.p2p_gbps:
            raise ValueError(f"preset {p.name!r} has no peer access (p2p)")
        return float(p.p2p_load_gbps or p.link_gbps)
    return p.transport_gbps("multicast")


def kernel_time(p: Preset, algorithm: str, transport: str, nranks: int, nbytes: float) -> float:
    """Seconds of one one-launch all-reduce of ``nbytes`` per rank over ``nranks`` GPUs, on a
    running stream (captured, or queued behind other work): start + flag rounds + bytes.

    A program's ``AllReduce`` op is priced with this (``sim.engine``): its program's
    ``algorithm`` (``one_shot_kernel`` / ``two_shot_kernel``, or the bare names) and
    ``transport``, the op's ``bytes``."""
    if nranks <= 1:
        return 0.0
    p.check_group(nranks)
    algorithm = algorithm.removesuffix("_kernel")
    return ((p.ar_start_us + flag_rounds(algorithm) * p.ar_flag_us) * US
            + port_bytes(algorithm, transport, nranks, nbytes) / (rate_gbps(p, transport) * 1e9))


def best(p: Preset, nranks: int, nbytes: float, transports: tuple[str, ...] | None = None,
         algorithms: tuple[str, ...] = ALGORITHMS) -> tuple[float, str, str]:
    """(seconds, algorithm, transport) of the fastest one-launch all-reduce the preset runs."""
    offered = [t for t in (transports or TRANSPORTS) if t in p.transports]
    if not offered:
        raise ValueError(f"preset {p.name!r} offers none of {transports or TRANSPORTS}")
    return min((kernel_time(p, a, t, nranks, nbytes), a, t)
               for a in algorithms for t in offered)


def _check(algorithm: str, transport: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {ALGORITHMS}, got {algorithm!r}")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport: expected one of {TRANSPORTS} (a one-launch kernel moves "
                         f"its own bytes), got {transport!r}")
