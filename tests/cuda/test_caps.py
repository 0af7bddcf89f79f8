"""Transport selection from capability tables (injected: no GPU needed).

``choose_transport`` runs the one resolver (``capabilities.resolve_transport``) with the
table injected as this machine's capabilities.
"""

from __future__ import annotations

from unittest import mock

import pytest

from jaxoverlap._executors import capabilities, runtime
from jaxoverlap._executors.capabilities import gpu_transport_reasons, resolve_transport


def choose_transport(caps, devices, requested="auto", *, across_processes=False):
    with mock.patch.object(capabilities, "gpu_table", lambda: caps):
        return resolve_transport("cuda", requested, None, spans_processes=across_processes,
                                 local_ordinals=list(devices))


def table(n=8, cc=(9, 0), multicast=True, peer=True, driver=13000, api=True, name="H100"):
    devices = [{"ordinal": i, "name": name, "compute_capability": cc, "multicast": multicast}
               for i in range(n)]
    if callable(peer):
        matrix = [[a == b or peer(a, b) for b in range(n)] for a in range(n)]
    else:
        matrix = [[a == b or peer for b in range(n)] for a in range(n)]
    return {"error": None, "devices": devices, "peer_access": matrix, "cuda_driver_int": driver,
            "driver_multicast_api": api}


def test_hgx_h100_with_nvswitch_picks_multicast():
    caps = table()
    assert choose_transport(caps, range(8)) == "multicast"
    assert choose_transport(caps, [0, 1, 2, 3], "p2p") == "p2p"
    assert choose_transport(caps, [0, 1], "nccl") == "nccl"


def test_h100_without_fabric_manager_falls_back_to_p2p():
    caps = table(multicast=False)
    assert choose_transport(caps, range(8)) == "p2p"
    with pytest.raises(ValueError, match="Fabric Manager"):
        choose_transport(caps, range(8), "multicast")


def test_a100_has_no_multimem():
    caps = table(cc=(8, 0), multicast=False)
    assert choose_transport(caps, range(4)) == "p2p"
    assert "sm_90" in gpu_transport_reasons(caps, range(4))["multicast"]


def test_old_driver_without_the_multicast_api():
    caps = table(driver=12000, api=False)
    assert choose_transport(caps, range(8)) == "p2p"
    assert "12.1" in gpu_transport_reasons(caps, range(8))["multicast"]


def test_pcie_without_peer_access_uses_nccl():
    caps = table(n=4, cc=(8, 9), multicast=False, peer=False, name="L40S")
    assert choose_transport(caps, range(4)) == "nccl"
    match = r"peer access between GPUs 0 and 1.*Available: \['nccl'\]"
    with pytest.raises(ValueError, match=match):
        choose_transport(caps, range(4), "p2p")


def test_partial_peer_access_only_matters_inside_the_clique():
    # Two NVLink islands {0,1} and {2,3}: p2p inside an island, nccl across.
    caps = table(n=4, multicast=False, peer=lambda a, b: a // 2 == b // 2)
    assert choose_transport(caps, [0, 1]) == "p2p"
    assert choose_transport(caps, [2, 3]) == "p2p"
    assert choose_transport(caps, [1, 2]) == "nccl"


def test_no_gpu():
    caps = {"error": "no usable GPU: cudaErrorNoDevice", "devices": [], "peer_access": []}
    with pytest.raises(ValueError, match="no transport can run here"):
        choose_transport(caps, [0])
    with pytest.raises(ValueError, match="not available"):
        choose_transport(caps, [0], "nccl")


def test_invisible_device_and_bad_name():
    caps = table(n=2)
    with pytest.raises(ValueError, match=r"GPU\(s\) \[5\] not visible"):
        choose_transport(caps, [0, 5], "p2p")
    with pytest.raises(ValueError, match="expected one of auto"):
        choose_transport(caps, [0, 1], "nvshmem")


def test_single_gpu_clique_needs_nothing():
    caps = table(n=1, cc=(8, 0), multicast=False, peer=False)
    assert gpu_transport_reasons(caps, [0]) == {"multicast": None, "p2p": None, "nccl": None}


def test_real_table_has_the_same_shape():
    """The table _cuda.capabilities() returns is what these functions read."""
    if runtime.cuda_error() is not None:
        pytest.skip(f"_cuda not built: {runtime.cuda_error()}")
    caps = capabilities.gpu_table()
    keys = {"error", "devices", "peer_access", "cuda_driver_int", "driver_multicast_api"}
    assert keys <= set(caps)
    ordinals = [d["ordinal"] for d in caps["devices"]]
    reasons = gpu_transport_reasons(caps, ordinals or [0])
    assert set(reasons) == {"multicast", "p2p", "nccl"}


def test_cliques_spanning_processes():
    """Across processes: auto picks nccl; p2p and multicast on request when this process's GPUs
    serve them (multicast: ones that support it; several: peer access among them)."""
    caps = table()
    assert choose_transport(caps, [0], "auto", across_processes=True) == "nccl"
    assert choose_transport(caps, [0, 1], "auto", across_processes=True) == "nccl"
    assert choose_transport(caps, [0], "nccl", across_processes=True) == "nccl"
    assert choose_transport(caps, [0], "p2p", across_processes=True) == "p2p"
    assert choose_transport(caps, [0, 1], "p2p", across_processes=True) == "p2p"
    assert choose_transport(caps, [0], "multicast", across_processes=True) == "multicast"
    assert choose_transport(caps, [0, 1, 2, 3], "multicast", across_processes=True) == "multicast"
    with pytest.raises(ValueError, match="peer access"):
        choose_transport(table(peer=False), [0, 1], "p2p", across_processes=True)
    with pytest.raises(ValueError, match="MULTICAST_SUPPORTED"):
        choose_transport(table(multicast=False), [0, 1], "multicast", across_processes=True)
    with pytest.raises(ValueError, match="older than sm_90"):
        choose_transport(table(cc=(8, 0)), [0], "multicast", across_processes=True)
    with pytest.raises(ValueError, match="MULTICAST_SUPPORTED"):
        choose_transport(table(multicast=False), [0], "multicast", across_processes=True)
    # In one process the same GPUs keep every transport.
    assert choose_transport(caps, [0, 1], "auto") == "multicast"
