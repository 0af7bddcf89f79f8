"""``jo.info()``: what this installation and machine support."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jaxlib

from jaxoverlap._config import current_config
from jaxoverlap._executors import capabilities, runtime
from jaxoverlap._version import __version__


def _host_build() -> dict[str, Any] | None:
    try:
        from jaxoverlap import _host
    except ImportError:
        return None
    return dict(_host.build_info())


def _available(reason: str | None) -> str:
    return "available" if reason is None else f"unavailable: {reason}"


def info() -> dict[str, Any]:
    """A plain dict describing versions, devices, the native build and the effective config."""
    devices = jax.devices()
    native_reason = capabilities.unavailable_reason(capabilities.current_platform(),
                                                    jax.numpy.float32)
    result: dict[str, Any] = {
        "jaxoverlap": __version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": devices[0].platform,
        "devices": len(devices),
        "process_count": jax.process_count(),
        "impls": {
            "xla": "available",
            "ring": "available",
            "native": _available(native_reason),
        },
        # fp8 operands: the native path's answer is for e4m3 x e4m3 (on GPUs the CUDA executor
        # refuses an fp8 operand with a non-fp8 one, and e5m2 x e5m2: capabilities.gpu_fp8_reason)
        "fp8": {"xla": "available", "ring": "available",
                "native": _available(capabilities.unavailable_reason(
                    capabilities.current_platform(), jax.numpy.float8_e4m3fn))},
        "host_extension": _host_build(),
        "cuda_extension": runtime.extension_summary(),
        "config": dataclasses.asdict(current_config()),
    }
    if devices[0].platform in ("gpu", "cuda") and runtime.cuda_error() is not None:
        result["warning"] = (f"JAX sees {len(devices)} GPUs but jaxoverlap has no CUDA extension "
                             "here: impl='auto' runs unfused (see cuda_extension for the fix)")
    result["native"] = capabilities.info()
    return result


def format_info(data: dict[str, Any], indent: int = 0) -> str:
    lines = []
    for key, value in data.items():
        if isinstance(value, dict):
            lines.append(" " * indent + f"{key}:")
            lines.append(format_info(value, indent + 2))
        else:
            lines.append(" " * indent + f"{key}: {value}")
    return "\n".join(lines)
