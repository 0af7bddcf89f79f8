"""jaxoverlap: tensor-parallel collective matmuls for JAX with communication hidden behind compute.

>>> import jaxoverlap as jo
>>> sorted(jo.info()["impls"])
['native', 'ring', 'xla']
"""

from jaxoverlap._executors import runtime as _runtime

if (_source_tree_error := _runtime.source_tree_error()) is not None:
    if _runtime.run_as_command():
        raise SystemExit(_source_tree_error)
    raise ImportError(_source_tree_error)

from jaxoverlap._config import config as config
from jaxoverlap._config import current_config as current_config
from jaxoverlap._executors.capabilities import NativeUnavailableError as NativeUnavailableError
from jaxoverlap._info import info as info
from jaxoverlap._profile import profile as profile
from jaxoverlap._version import __version__ as __version__
from jaxoverlap.ops import ag_matmul as ag_matmul
from jaxoverlap.ops import matmul_ar as matmul_ar
from jaxoverlap.ops import matmul_rs as matmul_rs

__all__ = [
    "NativeUnavailableError",
    "ag_matmul",
    "config",
    "current_config",
    "info",
    "matmul_ar",
    "matmul_rs",
    "profile",
]
