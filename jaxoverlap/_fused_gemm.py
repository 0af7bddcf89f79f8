"""What the fused GEMM serves (docs/gpu.md §10): its ops, transports, dtypes and row alignment.

One home for the kernel's limits, read by the planning rule (``_plan``), the performance model
(``sim.fused``) and the selftest; the executors refuse the rest (``cpp/core/build.cc``, the CUDA
executor's prepare).
"""

FUSED_OPS = ("ag_matmul", "matmul_rs")
# Never nccl: a persistent kernel holding every SM while an NCCL kernel waits for SMs can
# deadlock (docs/gpu.md §10, rule 1).
FUSED_TRANSPORTS = ("p2p", "multicast")
FUSED_DTYPES = ("bfloat16", "float16")  # the kernel's instantiations
FUSED_ALIGN = 8  # elements: rows of whole 16-byte units (TMA loads and stores), 16-bit types
