"""What a call costs the host, and what capturing it in a command buffer saves.

The executors enqueue every op of a call from the host: a per-call cost (the FFI handler, the
clique and program look-up, ``Preset.host_call_us``) and one CUDA driver call per op (a kernel,
a copy, a stream memory op, an event: ``Preset.host_op_us``). In a loop of calls the GPU cannot
run faster than the host enqueues, so a call takes at least that long (``model.host_time``).
Published designs that issue their ops from eager Python (PyTorch's decomposed AG+GEMM,
Triton-distributed's and kraken's copy-engine GEMM+RS) pay Python's per-op dispatch instead
(``Preset.python_op_us``, ``python_call_us``): ``python_enqueue``, and ``issued_from_python``
to run such a program through the engine.

XLA captures runs of command-buffer-compatible operations into command buffers (CUDA graphs)
and replays them; a replayed call runs none of its handler's host code (openxla/xla
``command_buffer_thunk.cc``: the handler runs again only when a buffer address changes). Its
ops then cost only their GPU time plus ``Preset.graph_node_us`` per node (the replay's
per-node cost, ahrefs/ocannl#488). ``call_time`` prices a call both ways; a program whose
handler is registered command-buffer compatible is priced ``captured=True``.
"""

from __future__ import annotations

from jaxoverlap.sim.presets import Preset

US = 1e-6


def host_enqueue(p: Preset, ops: int, calls: int = 1) -> float:
    """Seconds the host spends enqueueing ``calls`` calls of ``ops`` ops each (not captured)."""
    return calls * (p.host_call_us + ops * p.host_op_us) * US


def python_enqueue(p: Preset, ops: int, calls: int = 1) -> float:
    """Seconds eager Python spends issuing ``calls`` calls of ``ops`` ops each."""
    return calls * (p.python_call_us + ops * p.python_op_us) * US


def issued_from_python(p: Preset) -> Preset:
    """``p`` with its host's enqueue Python's: a program the engine prices as ours, issued op by
    op from eager Python (a published design's)."""
    return p.replace(host_op_us=p.python_op_us, host_call_us=p.python_call_us)


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
