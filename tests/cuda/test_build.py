"""The CUDA module builds, imports without a GPU, and registers its handlers for CUDA."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from jaxoverlap import _kinds
from jaxoverlap._executors import capabilities, runtime


def _so(module) -> str:
    return module.__file__


def test_imports_and_reports_build(cuda):
    info = cuda.build_info()
    assert info["cuda_runtime_linkage"] == "static"
    assert info["transports"] == _kinds.names(_kinds.TRANSPORTS)
    # No arch-specific (sm_90a, sm_100a) code but the fused GEMM's, which runs on compute
    # capability 9.0 and 10.0 only and is refused elsewhere (docs/gpu-internals.md §5): the
    # others must run on newer GPUs (sm_100 cubins for B200/B300, compute_90 PTX beyond).
    assert info["kernel_images"] == {"add": ("sm_80", "sm_90", "compute_90", "sm_100"),
                                     "fused": ("sm_90a",),
                                     "fused_sm100": ("sm_100a",),
                                     "multimem": ("sm_90", "compute_90", "sm_100")}
    assert info["kernels"] == ("add: sm_80 sm_90 compute_90 sm_100; fused: sm_90a; "
                               "fused_sm100: sm_100a; multimem: sm_90 compute_90 sm_100")
    assert info["nccl_headers"].startswith("2.")


def test_capabilities_never_raise(cuda):
    caps = cuda.capabilities()
    assert caps["nccl"].startswith("2.")
    assert caps["cublas"].count(".") == 2
    if not caps["devices"]:
        # No GPU here (every CI machine): the table says why instead of failing.
        assert caps["error"]
        assert caps["peer_access"] == []


@pytest.mark.skipif(shutil.which("readelf") is None or shutil.which("nm") is None,
                    reason="binutils (readelf, nm) not installed")
def test_no_link_to_libcuda_or_shared_cudart(cuda):
    needed = subprocess.run(["readelf", "-d", _so(cuda)], capture_output=True, text=True,
                            check=True).stdout
    assert "libcuda.so" not in needed, "the driver API must come from cudaGetDriverEntryPoint"
    assert "libcudart" not in needed, "the CUDA runtime is linked statically"
    assert "libnccl.so" in needed and "libcublasLt.so" in needed
    assert "$ORIGIN/../nvidia/nccl/lib" in needed
    undefined = subprocess.run(["nm", "-D", "--undefined-only", _so(cuda)], capture_output=True,
                               text=True, check=True).stdout.split()
    driver = [s for s in undefined if s.startswith("cu") and s[2:3].isupper()]
    assert driver == [], f"direct driver API references: {driver}"


@pytest.mark.skipif(shutil.which("nm") is None, reason="binutils (nm) not installed")
def test_fake_build_resolves_every_cuda_call_itself(fake):
    """_cuda_fake must not need any CUDA/NCCL/cuBLAS library: the fake defines every call."""
    undefined = subprocess.run(["nm", "-D", "--undefined-only", fake.__file__],
                               capture_output=True, text=True, check=True).stdout.split()
    foreign = [s for s in undefined if s.startswith(("cuda", "nccl", "cublas", "cu"))
               and not s.startswith("cxa")]
    assert foreign == []


def test_handlers_registered_for_cuda(cuda):
    from jax._src.lib import xla_client

    runtime.register("cuda")
    with xla_client._custom_callback_lock:
        pending = list(xla_client._custom_callback.get("CUDA", []))
    if "CUDA" in xla_client._custom_callback_handler:
        pytest.skip("a CUDA plugin is loaded: registrations went straight to it")
    entries = {name: (api, traits) for name, _fn, api, traits in pending}
    for target in ("jaxoverlap_cuda_ag_matmul", "jaxoverlap_cuda_matmul_rs"):
        assert target in entries, f"{target} not registered for CUDA"
        api, traits = entries[target]
        assert api == 1  # typed FFI
        # Not command-buffer compatible (no traits: docs/gpu-internals.md §1).
        assert traits == xla_client.CustomCallTargetTraits.DEFAULT


def test_native_gpu_questions(cuda):
    import jax.numpy as jnp

    assert capabilities.unavailable_reason("gpu", jnp.float32) is None
    assert capabilities.unavailable_reason("gpu", jnp.bfloat16) is None
    assert "int32" in capabilities.unavailable_reason("gpu", jnp.int32)
    assert capabilities.transports() == _kinds.names(_kinds.TRANSPORTS)


def test_info_has_a_gpu_section(cuda):
    import jaxoverlap as jo

    gpu = jo.info()["native"]["backends"]["gpu"]
    assert gpu["nccl"] == capabilities.gpu_table()["nccl"]
    assert "cuda_extension" in gpu and isinstance(gpu["cuda_extension"], dict)
    assert "gpus" in gpu
