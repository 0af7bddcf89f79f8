"""The build backend: scikit-build-core, plus the CUDA library wheels when ``_cuda`` is built.

``jaxoverlap._cuda`` compiles against NCCL and cuBLASLt from the ``nvidia-*`` wheels, which
CMake (``cmake/jo_cuda.cmake``) looks for in the building Python. Under pip's build isolation
that Python has only the build requirements, so this backend adds the two wheels to them when
the build will want them: ``JAXOVERLAP_CUDA`` is not ``OFF`` and nvcc is found (``CUDACXX``, else
``PATH``, as CMake looks), picking the wheels of nvcc's CUDA major, and CUTLASS's headers
(``nvidia-cutlass``, pinned) for the fused GEMM. Everything else is
scikit-build-core's (https://scikit-build-core.readthedocs.io; in-tree backends: PEP 517,
``backend-path``).

``JAXOVERLAP_CUDA`` (``AUTO``, ``ON``, ``OFF``) is read from everywhere scikit-build-core takes
it for CMake: the ``JAXOVERLAP_CUDA`` variable, ``-C cmake.define.JAXOVERLAP_CUDA=OFF`` (pip's
``--config-settings``), ``SKBUILD_CMAKE_DEFINE``, and ``-DJAXOVERLAP_CUDA=...`` in ``CMAKE_ARGS``,
``SKBUILD_CMAKE_ARGS`` or ``-C cmake.args``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from scikit_build_core import build as _scikit
from scikit_build_core.build import *  # noqa: F403 - the PEP 517 hooks not overridden below

# The wheels _cuda links, per CUDA major of nvcc (docs/gpu.md).
CUDA_WHEELS = {
    13: ("nvidia-nccl-cu13", "nvidia-cublas>=13,<14"),
    12: ("nvidia-nccl-cu12", "nvidia-cublas-cu12"),
}
# CUTLASS's C++ headers (the fused GEMM), for any CUDA major; the version cmake/jo_cuda.cmake
# requires (and the Makefile installs).
CUTLASS_WHEEL = "nvidia-cutlass==4.2.0.0"
_SPELLINGS = {"ON": "ON", "1": "ON", "TRUE": "ON", "YES": "ON",
              "OFF": "OFF", "0": "OFF", "FALSE": "OFF", "NO": "OFF", "AUTO": "AUTO"}
_DEFINE = re.compile(r"-DJAXOVERLAP_CUDA(?::\w+)?=(\S+)")


def cuda_setting(config_settings: dict | None) -> str:
    """``JAXOVERLAP_CUDA`` as CMake will see it: ``AUTO`` (the default), ``ON`` or ``OFF``.

    In scikit-build-core's order, lowest precedence first: the ``JAXOVERLAP_CUDA`` variable
    (pyproject.toml's ``cmake.define``), ``SKBUILD_CMAKE_DEFINE`` and ``-C cmake.define...``
    (which replace it), then ``-D`` arguments, which CMake reads last.
    """
    settings = config_settings or {}
    values = [os.environ.get("JAXOVERLAP_CUDA", "")]
    for item in os.environ.get("SKBUILD_CMAKE_DEFINE", "").split(";"):
        key, _, value = item.partition("=")
        if key.split(":")[0].strip() == "JAXOVERLAP_CUDA":
            values.append(value)
    define = settings.get("cmake.define.JAXOVERLAP_CUDA")
    values.append(define[-1] if isinstance(define, list) else (define or ""))
    for args in (os.environ.get("SKBUILD_CMAKE_ARGS", "").replace(";", " "),
                 settings.get("cmake.args"), os.environ.get("CMAKE_ARGS")):
        text = " ".join(args) if isinstance(args, list) else (args or "")
        values.extend(_DEFINE.findall(text))
    given = [v.strip().strip("\"'").upper() for v in values if v and v.strip()]
    value = given[-1] if given else "AUTO"
    return _SPELLINGS.get(value, value)


def find_nvcc() -> str | None:
    """nvcc as CMake's ``check_language(CUDA)`` finds it: ``CUDACXX``, else ``PATH``."""
    configured = os.environ.get("CUDACXX")
    if configured:
        return shutil.which(configured)
    return shutil.which("nvcc")


def nvcc_major(nvcc: str) -> int | None:
    """The CUDA major version nvcc reports (``release 13.0``), or None."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60,
                             check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"release (\d+)\.", out)
    return int(match.group(1)) if match else None


def cuda_requirements(config_settings: dict | None) -> list[str]:
    """The wheels to add to the build requirements (none when ``_cuda`` will not be built)."""
    if cuda_setting(config_settings) == "OFF":
        return []
    nvcc = find_nvcc()
    if nvcc is None:
        return []
    wheels = list(CUDA_WHEELS.get(nvcc_major(nvcc), ()))
    return [*wheels, CUTLASS_WHEEL] if wheels else []


def get_requires_for_build_wheel(config_settings: dict | None = None) -> list[str]:
    return [*_scikit.get_requires_for_build_wheel(config_settings),
            *cuda_requirements(config_settings)]


def get_requires_for_build_editable(config_settings: dict | None = None) -> list[str]:
    return [*_scikit.get_requires_for_build_editable(config_settings),
            *cuda_requirements(config_settings)]
