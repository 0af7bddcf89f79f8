"""One native call, described once: where its ranks are, which clique, which transport.

The lowering rule of the native primitive (``_native``) builds a :class:`NativeCall` from the
concrete mesh it lowers for; everything downstream — the bootstrap of cliques spanning
processes, the custom call's attributes, the C++ handler's placement — reads this record and
nothing else. :func:`resolve_transport` is the one place where ``transport="auto"`` becomes a
transport.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import jax
import numpy as np


class NativeUnavailableError(ValueError):
    """``impl="native"`` (or a native transport) was asked for but cannot run here."""


# transport="auto" prefers them in this order (when every GPU of the clique can serve it).
AUTO_ORDER = ("multicast", "p2p", "nccl")
GPU_PLATFORMS = ("cuda", "gpu")


@dataclasses.dataclass(frozen=True)
class Rank:
    """One device of the call: its process, JAX's global device id, its local ordinal."""

    process: int
    device_id: int
    ordinal: int


@dataclasses.dataclass(frozen=True)
class NativeCall:
    """What the custom call and its cliques need to know, identical in every process."""

    platform: str                 # "cpu" or "cuda"
    axis_name: str
    axis_size: int
    # Every device of the mesh, in (group, rank) order; empty only for a CPU call in one
    # process whose mesh was abstract where it lowered (the handler then places itself by
    # its coords operand, lax.axis_index).
    ranks: tuple[Rank, ...]
    transport: str                # resolved: "nccl", "p2p" or "multicast"
    clique_key: int               # the same in every process

    def groups(self) -> list[tuple[Rank, ...]]:
        """The cliques: one per group of the other mesh axes, ranks in axis order."""
        n = self.axis_size
        return [self.ranks[i:i + n] for i in range(0, len(self.ranks), n)]

    @property
    def spans_processes(self) -> bool:
        return any(len({r.process for r in group}) > 1 for group in self.groups())

    def attributes(self) -> dict:
        """The rank table as the handlers bind it (int64 arrays, (group, rank) order)."""
        return dict(
            clique_key=np.int64(self.clique_key),
            processes=np.array([r.process for r in self.ranks], np.int64),
            device_ids=np.array([r.device_id for r in self.ranks], np.int64),
            ordinals=np.array([r.ordinal for r in self.ranks], np.int64),
        )


def local_ordinal(device) -> int:
    """The device's ordinal within its process (what the GPU handler sees as its device)."""
    ordinal = getattr(device, "local_hardware_id", None)
    return int(device.id if ordinal is None else ordinal)


def describe(mesh, axis_name: str, platform: str, requested: str,
             preferred: str | None, process: int) -> NativeCall:
    """The call over ``axis_name`` of ``mesh`` (concrete, or abstract: no rank table), for the
    process ``process``."""
    names = tuple(mesh.axis_names)
    if isinstance(mesh, jax.sharding.Mesh):
        devices = np.moveaxis(np.asarray(mesh.devices), names.index(axis_name), -1).reshape(-1)
        ranks = tuple(Rank(int(d.process_index), int(d.id), local_ordinal(d)) for d in devices)
    else:
        ranks = ()
    axis_size = int(mesh.shape[axis_name])
    probe = NativeCall(platform, axis_name, axis_size, ranks, "nccl", 0)
    mine = sorted({r.ordinal for r in ranks if r.process == process})
    transport = resolve_transport(platform, requested, preferred,
                                  spans_processes=probe.spans_processes, local_ordinals=mine)
    text = repr((names, tuple(int(s) for s in mesh.axis_sizes), axis_name, transport,
                 tuple((r.process, r.device_id) for r in ranks)))
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    key = int.from_bytes(digest, "little", signed=True)
    return NativeCall(platform, axis_name, axis_size, ranks, transport, key)


def transport_reasons(platform: str, local_ordinals: Sequence[int],
                      spans_processes: bool) -> dict[str, str | None]:
    """For each transport, why it cannot serve the call here (None: it can).

    On CPU the host executor emulates every transport, across processes too. On GPU the
    reasons come from this process's GPUs of the clique (``_cuda_caps``).
    """
    if platform not in GPU_PLATFORMS:
        return {t: None for t in AUTO_ORDER}
    from jaxoverlap import _cuda_caps

    return _cuda_caps.transport_reasons(_cuda_caps.capabilities(), local_ordinals,
                                        across_processes=spans_processes)


def resolve_transport(platform: str, requested: str, preferred: str | None, *,
                      spans_processes: bool, local_ordinals: Sequence[int]) -> str:
    """The transport of a call: the one asked for, else the best one that can serve it.

    ``auto`` picks ``nccl`` for a clique spanning processes (whether peers in other processes
    can reach our buffers directly is not known here); else the performance model's
    ``preferred`` pick if it can serve, else the first of ``AUTO_ORDER`` that can. An explicit
    request that cannot be served raises ``ValueError`` naming the reason and what can.
    """
    reasons = transport_reasons(platform, local_ordinals, spans_processes)
    usable = [t for t in AUTO_ORDER if reasons[t] is None]
    if requested in (None, "auto"):
        if spans_processes and reasons["nccl"] is None:
            return "nccl"
        if preferred is not None and reasons.get(preferred) is None:
            return preferred
        if usable:
            return usable[0]
        raise NativeUnavailableError(
            f"jaxoverlap: no transport can run here: {reasons['nccl']}")
    if requested not in reasons:
        raise ValueError(f"transport: expected one of auto, {', '.join(AUTO_ORDER)}; got "
                         f"{requested!r}")
    if reasons[requested] is not None:
        where = f"GPUs {list(local_ordinals)}" if platform in GPU_PLATFORMS else platform
        raise NativeUnavailableError(
            f"transport={requested!r} is not available on {where}: {reasons[requested]}. "
            f"Available: {usable or 'none'} (or transport='auto')")
    return requested
