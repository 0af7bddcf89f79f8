"""Program families, the published designs closest to each, and each family's margin.

A *family* is a kind of program whose mechanism the model prices one way: the chunked programs
(separate GEMMs per block, ordered by flags), the fused ones (one persistent GEMM waiting on or
releasing per-block flags), the one-launch all-reduce kernels... How well the model reproduces
the published results of the designs closest to a family is how far its projections for that
family can be trusted, so the automatic choice needs a predicted gain above that family's own
margin (``margins``), not one margin per op: a published loss of Flux's fused GEMM+RS speaks
against our fused GEMM+RS, not against our chunked ring.

``DESIGNS`` names each published design by its mechanism (where the partials live, who moves
and who reduces them, what is exposed after the GEMM: the sources' own code, cited), and the
family of ours closest to it; docs/performance.md §4 shows the table. A family with no
published comparison on a machine gets a conservative margin: the largest derived there.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jaxoverlap import _kinds

FAMILIES: dict[str, str] = {
    "ag_matmul:chunked": "AG+GEMM, chunked: a GEMM per shard or sub-chunk after its transfer "
                         "(native, not fused; impl='ring' too)",
    "ag_matmul:fused": "AG+GEMM, fused: one persistent GEMM whose tiles wait on per-block flags",
    "matmul_rs:chunked": "GEMM+RS, chunked ring: each step's GEMM accumulates onto the partial "
                         "received, the sum folded into the GEMMs' epilogues",
    "matmul_rs:fused": "GEMM+RS, release-only fused: one persistent GEMM releases each "
                       "destination's partial; the copies and the owner's reduction (a copy and "
                       "N-1 adds over p2p, a load-reduce over multicast) after the kernel",
    "matmul_rs:overlapped": "GEMM+RS whose reduction overlaps the GEMM: the persistent GEMM "
                            "releases each block in rounds of sub-chunks, a reduction kernel on "
                            "the SMs it leaves sums the block from every rank (multicast, or "
                            "p2p with sub-chunks)",
    "matmul_ar:chunked": "GEMM+AR, two-shot: a chunked reduce-scatter ring, then an all-gather",
    "matmul_ar:one_shot": "GEMM+AR, one-shot over host-enqueued copies or stores",
    "matmul_ar:one_launch:one_shot:p2p": "all-reduce in one kernel launch, one-shot "
                                         "(one_shot_kernel): peers' memory over the links",
    "matmul_ar:one_launch:one_shot:multicast": "all-reduce in one kernel launch, one-shot "
                                               "(one_shot_kernel): multimem load-reduce",
    "matmul_ar:one_launch:two_shot:p2p": "all-reduce in one kernel launch, two-shot "
                                         "(two_shot_kernel): peers' memory over the links",
    "matmul_ar:one_launch:two_shot:multicast": "all-reduce in one kernel launch, two-shot "
                                               "(two_shot_kernel): multimem load-reduce and "
                                               "store",
}


def family(op: str, candidate: Any) -> str:
    """The family of a ``sim.Candidate`` of ``op`` (the xla path has none: "")."""
    if candidate.impl == "xla":
        return ""
    if op == "matmul_ar":
        from jaxoverlap.sim.allreduce import base_algorithm

        if kernel := base_algorithm(candidate.algorithm):
            # peer loads and multimem are different mechanisms, with published designs of their
            # own: a family each
            return f"matmul_ar:one_launch:{kernel}:{candidate.transport}"
        return "matmul_ar:one_shot" if candidate.algorithm == "one_shot" else "matmul_ar:chunked"
    if op == "matmul_rs" and candidate.fused and (
            _kinds.transport(candidate.transport).mechanism == "multicast"
            or candidate.chunks > 1):
        # the fused program's reduction of sub-chunk s runs beside the kernel's later rounds
        # (core/build_rs_fused.cc); over p2p with one sub-chunk it runs after the kernel
        return "matmul_rs:overlapped"
    return f"{op}:{'fused' if candidate.fused else 'chunked'}"


@dataclass(frozen=True)
class Design:
    """A published design: its mechanism in a line, the family of ours closest to it, and how
    its published times were taken (``timed``): ``"eager"`` (the benchmark's loop enqueues each
    call from the host), ``"graphs"`` (captured in a CUDA graph and replayed) or ``"unknown"``
    (no public script behind the numbers), with the evidence (``timed_by``). The published
    comparison prices our program run the same way (``sim.published.evaluate_call``)."""

    name: str
    family: str
    mechanism: str
    source: str
    timed: str = "unknown"
    timed_by: str = "no public script behind the published numbers found"

    def __post_init__(self) -> None:
        if self.timed not in TIMINGS:
            raise ValueError(f"timed: expected one of {TIMINGS}, got {self.timed!r}")


TIMINGS = ("eager", "graphs", "unknown")


DESIGNS: dict[str, Design] = {d.name: d for d in (
    Design("flux-ag", "ag_matmul:fused",
           "copy-engine all-gather; a CUTLASS GEMM whose tiles wait on the shards' signals",
           "bytedance/flux README, docs/design.md",
           timed="eager",
           timed_by="test/python/ag_gemm/test_ag_kernel.py perf_flux: a CUDA event pair around "
                    "each host call; no graph code in the repository"),
    Design("symm-mem-ag", "ag_matmul:fused",
           "copy-engine pulls; a persistent Triton GEMM waiting on per-shard flags",
           "yifuwang/symm-mem-recipes README",
           timed="eager",
           timed_by="symm_mem_recipes/utils.py benchmark_with_event: an event pair around each "
                    "call, median of 25"),
    Design("triton-dist-ag", "ag_matmul:fused",
           "a persistent GEMM waiting on per-block flags of a copy-engine or SM all-gather",
           "ByteDance-Seed/Triton-distributed README",
           timed="eager",
           timed_by="python/triton_dist/profiler_utils.py perf_func: one event pair around a host"
                    " loop of calls (test_ag_gemm.py)"),
    Design("multicast-ag", "ag_matmul:chunked",
           "a multicast all-gather, then one GEMM (separate kernels)",
           "pytorch/pytorch PR #143160",
           timed="unknown",
           timed_by="PR #143160 gives numbers and a chart, no script"),
    Design("decomposed-ag", "ag_matmul:chunked",
           "PyTorch's decomposed AG+GEMM: copy-engine copies and a GEMM per shard on two "
           "alternating streams", "pytorch/pytorch PR #143160",
           timed="unknown",
           timed_by="PR #143160 gives numbers and a chart, no script"),
    Design("flux-rs", "matmul_rs:fused",
           "Hopper, fuse_reduction=False (from db4ffe0 on; the only mode for bf16): the GEMM "
           "kernel's extra warps TMA-pull peers' tiles into a reduce buffer of the whole "
           "output; after the kernel a separate torch sum over the N stacked partials",
           "bytedance/flux src/gemm_rs/sm90_reduce_scatter_utils.hpp, "
           "ths_op/gemm_reduce_scatter.cc",
           timed="eager",
           timed_by="test/python/gemm_rs/test_gemm_rs.py perf_flux: a CUDA event pair around each"
                    " host call"),
    Design("flux-rs-inkernel", "matmul_rs:fused",
           "Hopper, the 2024 release: the GEMM kernel's extra warps TMA-pull peers' tiles and "
           "add them in place (red.global.add) into a buffer of the own block; after the "
           "kernel a copy of that block",
           "bytedance/flux @239a13d src/reduce_scatter/sm90_reduce_scatter_utils.hpp, "
           "ths_op/gemm_reduce_scatter.cc",
           timed="eager",
           timed_by="test/test_gemm_rs.py perf_flux: a CUDA event pair around each host call"),
    Design("triton-dist-rs", "matmul_rs:fused",
           "intra-node: a persistent GEMM on every SM stores its partial locally; the copy "
           "engine pushes each destination's block once its tiles are stored; after a barrier "
           "one whole-grid kernel reduces the N partials",
           "ByteDance-Seed/Triton-distributed python/triton_dist/kernels/nvidia/"
           "gemm_reduce_scatter.py, reduce_scatter.py",
           timed="eager",
           timed_by="python/triton_dist/test/nvidia/test_gemm_rs.py (as merged with PR #166): "
                    "perf_func, a host loop between two events, no graph option"),
    Design("kraken-ce-rs", "matmul_rs:fused",
           "as triton-dist-rs: a persistent GEMM, per-destination counters, copy-engine pushes, "
           "a tail reduction kernel",
           "meta-pytorch/kraken kraken/fused/gemm_reduce_scatter_ce_persistent.py",
           timed="unknown",
           timed_by="benchmark/benchmark_matmul_reduce_scatter.py is eager (benchmark_with_event,"
                    " cuda_graph=False), but the published table (PR #19) predates the script's "
                    "copy-engine backend"),
    Design("async-tp-rs", "matmul_rs:chunked",
           "PyTorch async-TP (decomposed): a cuBLAS GEMM per destination on two streams, "
           "copy-engine pulls, a torch sum of the stacked partials after",
           "pytorch/pytorch torch/distributed/_symmetric_memory fused_matmul_reduce_scatter",
           timed="eager",
           timed_by="end-to-end torchtitan training throughput "
                    "(benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md): torch.compile in its"
                    " default mode, no CUDA graphs in torchtitan then"),
    Design("te-ring-rs", "matmul_rs:chunked",
           "TransformerEngine ring exchange: a GEMM chunk per destination, copy-engine sends, "
           "the chunks reduced after", "NVIDIA/TransformerEngine comm_gemm_overlap.cpp",
           timed="eager",
           timed_by="tests/pytorch/distributed/run_gemm_with_overlap.py: --use-cuda-graphs is "
                    "opt-in (default off); the repository publishes no times"),
    Design("cutlass-distgemm-rs", "matmul_rs:chunked",
           "CUTLASS Distributed GEMM, ReduceScatter1D_TilingA_RotatingC: a ring whose GEMM "
           "epilogues read the neighbour's partial (the sum folded into the epilogue)",
           "NVIDIA/cutlass include/cutlass/experimental/distributed",
           timed="graphs",
           timed_by="include/cutlass/experimental/distributed/device/dist_gemm_universal_wrapper."
                    "hpp: run() is cudaGraphLaunch of a graph built at initialize()"),
    Design("te-pipeline-rs", "matmul_rs:overlapped",
           "TransformerEngine pipeline: 4 GEMM chunks on S - 16 SMs, a 16-SM reduce-scatter "
           "kernel (SM loads of peers' buffers) overlapping the next chunk; the last on all SMs",
           "NVIDIA/TransformerEngine comm_gemm_overlap.cpp, userbuffers.cu",
           timed="eager",
           timed_by="tests/pytorch/distributed/run_gemm_with_overlap.py: --use-cuda-graphs is "
                    "opt-in (default off); the repository publishes no times"),
    Design("thunderkittens-rs", "matmul_rs:overlapped",
           "a persistent GEMM that TMA store-adds each finished tile into its owner's output "
           "(no staging buffer, the adds in bf16 at the destination)",
           "HazyResearch/ThunderKittens kernels/parallel/gemm_rs/gemm_rs_h100.cu",
           timed="eager",
           timed_by="kernels/parallel/common.py benchmark_no_l2_clear: one event pair around a "
                    "host loop of 5 calls"),
    Design("vllm-one-stage", "matmul_ar:one_launch:one_shot:p2p",
           "one kernel: a barrier, every rank loads the peers' inputs in place and sums, a "
           "barrier", "vllm-project/vllm csrc/custom_all_reduce.cuh (cross_device_reduce_1stage)",
           timed="graphs",
           timed_by="benchmarks/kernels/benchmark_device_communicators.py: 10 all-reduces "
                    "captured in one CUDA graph, replayed"),
    Design("trt-one-shot", "matmul_ar:one_launch:one_shot:p2p",
           "one kernel: the input copied into the shared buffer, ONE barrier, every rank loads "
           "the peers' buffers and sums",
           "sgl-project/sglang sgl-kernel/src/sgl-kernel/csrc/trt_reduce_internal.cu "
           "(oneShotAllReduceKernel, from TensorRT-LLM)",
           timed="eager",
           timed_by="sgl-project/sglang PR #2904: 'unit test performance in H100 (without cuda "
                    "graph)', sgl-kernel/tests/test_trt_reduce.py"),
    Design("torch-symm-mem-multimem", "matmul_ar:one_launch:two_shot:multicast",
           "a copy in, one kernel: a barrier, multimem.ld_reduce and multimem.st of the own "
           "slice, a barrier; a copy out", "pytorch/pytorch CUDASymmetricMemoryOps.cu "
           "(multimem_all_reduce_), vllm/distributed/device_communicators/symm_mem.py",
           timed="unknown",
           timed_by="PyTorch's charts name no script; third-party harnesses differ (vLLM's "
                    "graphs, kraken's eager)"),
    Design("torch-symm-mem-two-shot", "matmul_ar:one_launch:two_shot:p2p",
           "a copy in, one kernel: a barrier, the own slice loaded from every peer, reduced and "
           "stored into every peer, a barrier; a copy out",
           "pytorch/pytorch CUDASymmetricMemoryOps.cu (two_shot_all_reduce_), "
           "vllm/distributed/device_communicators/symm_mem.py",
           timed="unknown",
           timed_by="PyTorch's charts name no script; third-party harnesses differ (vLLM's "
                    "graphs, kraken's eager)"),
    Design("vllm-two-stage", "matmul_ar:one_launch:two_shot:p2p",
           "one kernel: a barrier, a reduce-scatter into a registered buffer, a barrier, an "
           "all-gather",
           "vllm-project/vllm csrc/custom_all_reduce.cuh (cross_device_reduce_2stage)",
           timed="graphs",
           timed_by="benchmarks/kernels/benchmark_device_communicators.py: 10 all-reduces "
                    "captured in one CUDA graph, replayed"),
    Design("nvls-one-shot-norm", "matmul_ar:one_launch:one_shot:multicast",
           "one kernel: multimem stores and load-reduce fused with residual add and RMSNorm",
           "lightseekorg/tokenspeed PR #860"),
)}


# Published designs that check a family of ours besides the designs closest to it: those whose
# mechanisms its program is built from. The overlapped GEMM+RS is the release-only persistent
# GEMM (per-block flags, the next rank's block first), its blocks moved by copies or loaded by a
# multicast load-reduce, each summed in one N-input pass (sim.reduction) — the parts of
# Triton-distributed's and kraken's copy-engine GEMM+RS, which only run the reduction after the
# GEMM instead of beside it; the designs closest to it (TransformerEngine's pipeline,
# ThunderKittens) published no GEMM+RS times. Flux's Hopper GEMM+RS is not among them: its
# transfers are pulls by the GEMM kernel's own warps, a mechanism none of our programs has.
BUILT_FROM: dict[str, tuple[str, ...]] = {
    "matmul_rs:overlapped": ("triton-dist-rs", "kraken-ce-rs"),
}


def check_designs() -> None:
    """Every design's family is a known family, every BUILT_FROM entry a family and designs
    (an import-time check in the tests)."""
    unknown = sorted({d.family for d in DESIGNS.values()} - set(FAMILIES))
    if unknown:
        raise ValueError(f"designs name unknown families {unknown}")
    for fam, names in BUILT_FROM.items():
        if fam not in FAMILIES or not set(names) <= set(DESIGNS):
            raise ValueError(f"BUILT_FROM[{fam!r}] names an unknown family or design: {names}")


def checked_by(fam: str) -> set[str]:
    """The published designs a family answers to: those closest to it, and those its program
    is built from (``BUILT_FROM``)."""
    return {d.name for d in DESIGNS.values() if d.family == fam} | set(BUILT_FROM.get(fam, ()))


def margin(serial_errors: Sequence[float], fused_ratios: Sequence[float]) -> float:
    """The fallback margin from the model's measured errors.

    ``serial_errors``: model / measured - 1 of unfused calls (what the model can be
    checked against); ``fused_ratios``: measured / model of fused calls (> 1: the model
    was optimistic). A plan must be predicted faster than the unfused path by more than
    the model's worst serial error, and by more than its worst optimism on fused calls
    (1 - 1/ratio: how much slower the fused call really was, relative to its
    prediction), so that a predicted gain inside the model's error is not acted on.
    """
    worst_serial = max((abs(e) for e in serial_errors), default=0.0)
    worst_fused = max(fused_ratios, default=1.0)
    # rounded up: a margin never below the error it covers (the chooser's test is t <= xla x
    # (1 - margin), so the row that sets it must stay on the unfused side)
    return math.ceil(max(worst_serial, 1.0 - 1.0 / max(worst_fused, 1.0)) * 1000 - 1e-9) / 1000


def derived(serial_errors: Iterable[float], optimism: Mapping[str, Iterable[float]]
            ) -> dict[str, float]:
    """Each family's margin from its own comparisons (``margin``: the model's worst serial
    error, and its worst optimism — published / model time, or our speedup over the published
    one — on that family's designs); families without a comparison are absent."""
    serial = list(serial_errors)
    return {f: margin(serial, ratios) for f, r in optimism.items() if (ratios := list(r))}


def complete(known: Mapping[str, float]) -> dict[str, float]:
    """Every family's margin: its own where ``known`` has it, else the largest known
    (conservative); each op's key too (the fallback for a family a preset does not list)."""
    largest = max(known.values(), default=0.0)
    out = {f: known.get(f, largest) for f in FAMILIES}
    out.update({op: largest for op in ("ag_matmul", "matmul_rs", "matmul_ar")})
    return out
