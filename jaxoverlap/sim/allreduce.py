"""One-launch all-reduce kernels (matmul_ar's one_shot_kernel / two_shot_kernel; never run on
a GPU), ours and the published ones, each priced by its mechanism.

A small all-reduce in one kernel launch: its flags (device-side counters) and its data movement
inside, no host-enqueued copies or stream memory ops. A ``Mechanism`` says what such a kernel
does per call, and ``mechanism_time`` what that costs:

* its **start**, ``Preset.ar_start_us`` (the launch reaching the SMs in a stream that is
  already running: a queued kernel or a replayed graph node);
* **flag rounds**, ``Preset.ar_flag_us`` each: every rank raises a flag in every peer's memory
  (``st.release.sys``) and waits for the peers' (``ld.acquire.sys``);
* its **bytes** on the busiest port, at the transport's rate: SM loads from (or stores to)
  peers' memory over the links (``p2p``: ``Preset.p2p_load_gbps``, default the line rate) or
  the switch's ``multimem`` load-reduce and store (``multicast``: ``Preset.multicast_gbps``);
* its **local bytes** through the GPU's own memory (copies into and out of the area the peers
  see, the reduction's reads of pushed partials), at ``Preset.hbm_gbps``;
* **copy kernels** a call launches besides the all-reduce (a wrapper's copy of the input into a
  registered buffer and of the result out): a start and 2 S through HBM each.

``OURS`` is what our kernels do as built (cpp/cuda/kernels/allreduce_body.h): one flag round for
a one-shot (double-buffered halves make an exit barrier unnecessary), two for a two-shot.
``sim.published.ONE_LAUNCH_KERNELS`` describes the published kernels the same way, read from
their code; ``ar_start_us`` and ``ar_flag_us`` are fitted to the leanest of them
(``sim.published.fit_one_launch``: vLLM's two-barrier one-stage kernel and sglang's one-barrier
one), the others are held out, and how optimistic the model is on each design sets the margin of
the family of ours closest to it (``sim.families``).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxoverlap.sim.presets import Preset

US = 1e-6
ALGORITHMS = ("one_shot", "two_shot")
TRANSPORTS = ("p2p", "multicast")


def _check(algorithm: str, transport: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {ALGORITHMS}, got {algorithm!r}")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport: expected one of {TRANSPORTS} (a one-launch kernel moves "
                         f"its own bytes), got {transport!r}")


@dataclass(frozen=True)
class Mechanism:
    """What one call of a one-launch all-reduce does (see the module docstring)."""

    algorithm: str  # "one_shot" / "two_shot": the port bytes (``port_bytes``)
    transport: str  # "p2p" (SM loads / stores of peers' memory) / "multicast" (multimem)
    rounds: int  # flag rounds (barriers across the clique) per call
    local_per_rank: float = 0.0  # bytes through the own HBM inside the kernel: this x N x S ...
    local_fixed: float = 0.0  # ... plus this x S
    copy_kernels: int = 0  # separate copy kernels per call (a start and 2 S through HBM each)

    def __post_init__(self) -> None:
        _check(self.algorithm, self.transport)


# Ours as built (cpp/cuda/kernels/allreduce_body.h; docs/gpu-internals.md §7):
#   one-shot p2p: push y into slot r of every area (y read once), one round, sum the N slots
#     (N S read) into y (S written): (N + 2) S local;
#   one-shot multicast: copy y into the own area (2 S), one round, multimem.ld_reduce into y
#     (S written): 3 S;
#   two-shot p2p: push the slices (S read), one round, reduce the own slice (S read), write and
#     push it, one round, copy the other slices from the result area (2 S): 4 S;
#   two-shot multicast: copy y into the own area (2 S), one round, ld_reduce + multimem.st of
#     the own slice, one round, copy the result area into y (2 S): 4 S.
OURS: dict[tuple[str, str], Mechanism] = {
    ("one_shot", "p2p"): Mechanism("one_shot", "p2p", 1, local_per_rank=1.0, local_fixed=2.0),
    ("one_shot", "multicast"): Mechanism("one_shot", "multicast", 1, local_fixed=3.0),
    ("two_shot", "p2p"): Mechanism("two_shot", "p2p", 2, local_fixed=4.0),
    ("two_shot", "multicast"): Mechanism("two_shot", "multicast", 2, local_fixed=4.0),
}


def base_algorithm(name: str | None) -> str | None:
    """The one-launch algorithm (``ALGORITHMS``) a program's matmul_ar algorithm names, or
    None: ``one_shot_kernel`` / ``two_shot_kernel`` are the one-launch kernels (one
    ``AllReduce`` op, replayable: a program of them is priced captured), ``one_shot`` /
    ``two_shot`` the host-enqueued programs."""
    if name and name.endswith("_kernel") and name.removesuffix("_kernel") in ALGORITHMS:
        return name.removesuffix("_kernel")
    return None


def ours(algorithm: str, transport: str) -> Mechanism:
    """The mechanism of our kernel of ``algorithm`` (``_kernel`` suffix accepted) over
    ``transport``."""
    algorithm = algorithm.removesuffix("_kernel")
    _check(algorithm, transport)
    return OURS[(algorithm, transport)]


def flag_rounds(algorithm: str, transport: str = "p2p") -> int:
    """Flag rounds of one call of our kernel: a one-shot one, a two-shot two."""
    return ours(algorithm, transport).rounds


def port_bytes(algorithm: str, transport: str, nranks: int, nbytes: float) -> float:
    """Bytes through the busiest port direction of one GPU for an all-reduce of ``nbytes``.

    one-shot p2p: every rank's input reaches the N-1 peers (pulled or pushed: (N-1) S in and
    out); two-shot p2p: a reduce-scatter and an all-gather of (N-1)/N of the input each;
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


def mechanism_time(p: Preset, m: Mechanism, nranks: int, nbytes: float) -> float:
    """Seconds of one call of a one-launch all-reduce working as ``m`` over ``nranks`` GPUs,
    ``nbytes`` per rank, on a running stream: start + flag rounds + port bytes + local bytes
    (+ its copy kernels)."""
    if nranks <= 1:
        return 0.0
    p.check_group(nranks)
    s = float(nbytes)
    hbm = p.hbm_gbps * 1e9
    local = (m.local_per_rank * nranks + m.local_fixed) * s
    copies = m.copy_kernels * (p.ar_start_us * US + 2.0 * s / hbm)
    return ((p.ar_start_us + m.rounds * p.ar_flag_us) * US
            + port_bytes(m.algorithm, m.transport, nranks, s) / (rate_gbps(p, m.transport) * 1e9)
            + local / hbm + copies)


def kernel_time(p: Preset, algorithm: str, transport: str, nranks: int, nbytes: float) -> float:
    """Seconds of one call of our one-launch all-reduce (``OURS``) of ``nbytes`` per rank over
    ``nranks`` GPUs, on a running stream (captured, or queued behind other work).

    A program's ``AllReduce`` op is priced with this (``sim.engine``): its program's
    ``algorithm`` (``one_shot_kernel`` / ``two_shot_kernel``, or the bare names) and
    ``transport``, the op's ``bytes``."""
    return mechanism_time(p, ours(algorithm, transport), nranks, nbytes)


def best(p: Preset, nranks: int, nbytes: float, transports: tuple[str, ...] | None = None,
         algorithms: tuple[str, ...] = ALGORITHMS) -> tuple[float, str, str]:
    """(seconds, algorithm, transport) of the fastest one-launch all-reduce the preset runs."""
    offered = [t for t in (transports or TRANSPORTS) if t in p.transports]
    if not offered:
        raise ValueError(f"preset {p.name!r} offers none of {transports or TRANSPORTS}")
    return min((kernel_time(p, a, t, nranks, nbytes), a, t)
               for a in algorithms for t in offered)

