"""What matmul_ar's kernel algorithms serve (docs/gpu-internals.md §7): the GEMM, then ONE
all-reduce kernel whose flags and sequence numbers live on the device, so that XLA can capture
the call into a command buffer and replay it.

One home for their limits, read by the planning rule (``_plan``), the call's description
(``_executors.call``), the performance model (``sim``) and the selftest; the algorithms and
transports are the kinds' rows (``_kinds``); the executors refuse the rest
(``cpp/core/build.cc``, ``cpp/core/allreduce_layout.h``).
"""

from __future__ import annotations

from jaxoverlap import _kinds

KERNEL_ALGORITHMS = _kinds.names(_kinds.ALGORITHMS, kernel=True)
# The kernel writes into its peers' memory: never a transport that moves messages (nccl).
KERNEL_TRANSPORTS = tuple(t.name for t in _kinds.TRANSPORTS if t.mechanism != "messages")


def splits_rows(algorithm: str) -> bool:
    """Whether the algorithm splits x's rows into N blocks (only the two-shot ring does; the
    two-shot kernel splits y's elements, any number of rows)."""
    return _kinds.ar_algorithm(algorithm).splits_rows


def without_kernel(algorithm: str) -> str:
    """The algorithm a call runs where its transport has no kernel (nccl): the same data
    movement as separate ops, on any rows."""
    return "one_shot" if algorithm in KERNEL_ALGORITHMS else algorithm


def fits(transport: str, algorithm: str, nranks: int, y_bytes: int) -> bool:
    """Whether a kernel algorithm's call of y's ``y_bytes`` over ``nranks`` ranks fits the
    kernel's fixed area (``_host.allreduce_fits``: cpp/core/allreduce_layout.h)."""
    from jaxoverlap._executors.runtime import load_host

    return bool(load_host().allreduce_fits(transport, algorithm, nranks, y_bytes))
