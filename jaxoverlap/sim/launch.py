"""What a call costs the host, and what capturing it in a command buffer saves.

The executors enqueue every op of a call from the host: a per-call cost (the FFI handler, the
clique and program look-up, ``Preset.host_call_us``) and one per op (a kernel, a copy, a stream
memory op, an event: ``Preset.host_op_us``). In a loop of calls the GPU cannot run faster than
the host enqueues, so a call takes at least that long (``model.host_time``): what makes a
16-op decode program cost ~140 us on the host whatever its bytes.

XLA captures runs of command-buffer-compatible operations into command buffers (CUDA graphs)
and replays them; a replayed call runs none of its handler's host code (openxla/xla
``command_buffer_thunk.cc``: the handler runs again only when a buffer address changes). Its
ops then cost only their GPU time plus ``Preset.graph_node_us`` per node (the replay's
per-node cost, ahrefs/ocannl#488). ``call_time`` prices a call both ways; a program whose
handler is registered command-buffer compatible is priced ``captured=True``: one whose every
rank's program replays (:func:`replays`), as the lowering routes it.

Whether XLA captures such a call: its default ``--xla_gpu_enable_command_buffer`` set holds
``CUSTOM_CALL`` (openxla/xla ``xla/debug_options_flags.cc``), and a custom call whose FFI handler
carries the command-buffer trait is a command (``command_buffer_conversion_pass.cc``,
``IsConvertible``); a run of commands is captured when it has at least
``--xla_gpu_graph_min_graph_size`` of them, 5 by default. So the model assumes XLA's defaults and
a call among at least four other capturable operations (a decoder layer's fusions and GEMMs): a
call alone in its program, or with command buffers turned off, runs eagerly and costs
``call_time(..., captured=False)`` (docs/gpu.md §6, docs/performance.md §2.5).
"""

from __future__ import annotations

from typing import Any

from jaxoverlap import _kinds
from jaxoverlap.sim.presets import Preset

US = 1e-6


def replays(program: dict[str, Any], nranks: int) -> bool:
    """Whether one rank's program (``_host.build_program``'s dict) of a call of ``nranks`` ranks
    replays, so that the call is routed to the command-buffer compatible target and priced
    captured (``_kinds.call_replays``)."""
    return _kinds.call_replays(program.get("algorithm") or "two_shot",
                               bool(program.get("replayable")), nranks)


def host_enqueue(p: Preset, ops: int, calls: int = 1) -> float:
    """Seconds the host spends enqueueing ``calls`` calls of ``ops`` ops each (not captured)."""
    return calls * (p.host_call_us + ops * p.host_op_us) * US


def replay(p: Preset, nodes: int) -> float:
    """GPU seconds a replayed command buffer adds for ``nodes`` captured operations."""
    return nodes * p.graph_node_us * US


def call_time(p: Preset, gpu_seconds: float, ops: int, captured: bool = False) -> float:
    """One call in a loop of calls: its GPU time, bounded below by the host's enqueue of its
    ``ops`` when launched from the host; captured, the GPU time plus the replay of its nodes
    (no host work per call)."""
    if captured:
        return gpu_seconds + replay(p, ops)
    return max(gpu_seconds, host_enqueue(p, ops))


def captured_saving(p: Preset, gpu_seconds: float, ops: int) -> float:
    """Seconds per call that capturing saves (0 when the GPU, not the host, bounds the call)."""
    return call_time(p, gpu_seconds, ops) - call_time(p, gpu_seconds, ops, captured=True)
