"""What matmul_ar's kernel algorithms serve (docs/gpu.md §12): the GEMM, then ONE all-reduce
kernel whose flags and sequence numbers live on the device, so that XLA can capture the call
into a command buffer and replay it.

One home for their limits, read by the planning rule (``_plan``), the call's description
(``_executors.call``), the performance model (``sim``) and the selftest; the executors refuse
the rest (``cpp/core/build.cc``, ``cpp/core/allreduce_layout.h``).
"""

from __future__ import annotations

# matmul_ar's algorithms, in the order of the custom call's `algorithm` attribute
# (cpp/core/program.h, ArAlgorithm).
AR_ALGORITHMS = ("two_shot", "one_shot", "one_shot_kernel", "two_shot_kernel")
KERNEL_ALGORITHMS = ("one_shot_kernel", "two_shot_kernel")
# The kernel writes into its peers' memory: never nccl.
KERNEL_TRANSPORTS = ("p2p", "multicast")


def splits_rows(algorithm: str) -> bool:
    """Whether the algorithm splits x's rows into N blocks (only the two-shot ring does; the
    two-shot kernel splits y's elements, any number of rows)."""
    return algorithm == "two_shot"


def without_kernel(algorithm: str) -> str:
    """The algorithm a call runs where its transport has no kernel (nccl): the same data
    movement as separate ops, on any rows."""
    return "one_shot" if algorithm in KERNEL_ALGORITHMS else algorithm


def fits(transport: str, algorithm: str, nranks: int, y_bytes: int) -> bool:
    """Whether a kernel algorithm's call of y's ``y_bytes`` over ``nranks`` ranks fits the
    kernel's fixed area (``_host.allreduce_fits``: cpp/core/allreduce_layout.h)."""
    from jaxoverlap._executors.runtime import load_host

    return bool(load_host().allreduce_fits(transport, algorithm, nranks, y_bytes))
