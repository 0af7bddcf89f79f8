"""One native call, described once: where its ranks are, which clique, which transport.

A :class:`NativeCall` is made from the concrete mesh the call runs on: by the planning rule
where it knows that mesh (global arrays), else by the native primitive's lowering rule, which
always does. Everything downstream — the bootstrap of cliques spanning processes, the custom
call's attributes, the C++ handler's placement — reads this record and nothing else. The
transport is decided here, once per call: ``transport="auto"`` becomes a transport through the
one rule (``capabilities.resolve_transport``), and whether the call runs the fused GEMM, or
matmul_ar's one-launch kernel, follows from it (the plan asks; the transport must be one the
kernel runs with). Whether a GPU call's program is built replayable is the program builder's
word, asked where the call lowers (``replay``, ``_native.primitive``).
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import numpy as np

from jaxoverlap import _kinds
from jaxoverlap._executors import capabilities
from jaxoverlap._fused_gemm import FUSED_TRANSPORTS
from jaxoverlap._one_launch import KERNEL_TRANSPORTS, without_kernel


@dataclasses.dataclass(frozen=True)
class Rank:
    """One device of the call: its process, JAX's global device id, its local ordinal (on CPU,
    JAX gives another process's device no local ordinal, so there it is that device's id: the
    ordinals are the only part of a call's description that may differ between processes)."""

    process: int
    device_id: int
    ordinal: int


@dataclasses.dataclass(frozen=True)
class NativeCall:
    """What the custom call and its cliques need to know, identical in every process (but the
    ordinals of other processes' devices, see :class:`Rank`)."""

    platform: str                 # "cpu" or "cuda"
    axis_name: str
    axis_size: int
    # Every device of the mesh, in (group, rank) order: the rank table. Empty only for a CPU
    # call in one process whose mesh was abstract where it lowered (the handler then places
    # itself by its coords operand, lax.axis_index).
    ranks: tuple[Rank, ...]
    transport: str                # resolved: a name of _kinds.TRANSPORTS
    clique_key: int               # the same in every process
    # Runs the fused GEMM (one persistent GEMM waiting on per-block flags,
    # docs/gpu-internals.md §5).
    fused: bool = False
    # matmul_ar's algorithm as the call runs it: a kernel algorithm (docs/gpu-internals.md §7)
    # only over a transport the kernel runs with, else the one-shot program of separate ops.
    algorithm: str = "two_shot"
    # Its program is built replayable (Problem::replayable: the `replayable` attribute), as the
    # builder says where the GPU call lowers and its shapes are known (``replay``); never on CPU.
    replayable: bool = False

    @property
    def replays(self) -> bool:
        """Whether the call may be captured into a command buffer and replayed
        (``_kinds.call_replays``). Its GPU handler is then the command-buffer compatible one,
        which refuses any other call and the other handlers it (``cpp/ffi/ffi_call.h``
        ``CheckTarget``)."""
        return _kinds.call_replays(self.algorithm, self.replayable, self.axis_size)

    def groups(self) -> list[tuple[Rank, ...]]:
        """The cliques: one per group of the other mesh axes, ranks in axis order."""
        n = self.axis_size
        return [self.ranks[i:i + n] for i in range(0, len(self.ranks), n)]

    @property
    def spans_processes(self) -> bool:
        return any(len({r.process for r in group}) > 1 for group in self.groups())


def describe(mesh, axis_name: str, platform: str, requested: str,
             preferred: str | None, process: int, fused: bool = False,
             algorithm: str = "two_shot") -> NativeCall:
    """The call over ``axis_name`` of ``mesh`` (concrete, or abstract: no rank table), for the
    process ``process``; ``requested`` and ``preferred`` are the plan's transport and the
    performance model's pick for ``"auto"``, ``fused`` the plan's fused GEMM, ``algorithm``
    matmul_ar's (a kernel algorithm whose transport resolves to nccl runs one-shot).

    A plan the model picked fused leaves the transport to the call (``auto``), which may resolve
    to nccl (a clique spanning processes): that call runs the chunked program. A fused plan
    asked for explicitly names its transport (``_plan.make``), so it runs fused or fails to
    resolve.
    """
    table = ranks(mesh, axis_name)
    axis_size = int(mesh.shape[axis_name])
    probe = NativeCall(platform, axis_name, axis_size, table, "nccl", 0)
    mine = sorted({r.ordinal for r in table if r.process == process})
    transport = capabilities.resolve_transport(platform, requested, preferred,
                                               spans_processes=probe.spans_processes,
                                               local_ordinals=mine)
    text = repr((tuple(mesh.axis_names), tuple(int(s) for s in mesh.axis_sizes), axis_name,
                 transport, tuple((r.process, r.device_id) for r in table)))
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    key = int.from_bytes(digest, "little", signed=True)
    return NativeCall(platform, axis_name, axis_size, table, transport, key,
                      fused=fused and transport in FUSED_TRANSPORTS,
                      algorithm=algorithm if transport in KERNEL_TRANSPORTS
                      else without_kernel(algorithm))


def ranks(mesh, axis_name: str) -> tuple[Rank, ...]:
    """The rank table of a call over ``axis_name`` of ``mesh``: every device in (group, rank)
    order; empty for an abstract mesh."""
    if not isinstance(mesh, jax.sharding.Mesh):
        return ()
    names = tuple(mesh.axis_names)
    devices = np.moveaxis(np.asarray(mesh.devices), names.index(axis_name), -1).reshape(-1)
    return tuple(Rank(int(d.process_index), int(d.id), capabilities.local_ordinal(d))
                 for d in devices)
