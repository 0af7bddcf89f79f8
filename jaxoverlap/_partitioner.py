"""The partition callback of the ops' ``custom_partitioning`` primitives: one per distinct call.

XLA's SPMD partitioner calls back into Python for every instance of a ``custom_partitioning``
primitive, and JAX's callback (``jax/_src/custom_partitioning.py``,
``_custom_partitioning_partition``) runs the op's partition rule, traces the per-device
function and lowers it into a module of its own, each time: a model of L layers pays L times
for each of its layers' calls (5–6 ms of CPU time an instance for ``xla``, 12–16 ms for
``ring``, with jax 0.12 on a CPU: docs/performance.md §9).

The ops' calls (``_partition``) are retargeted here instead: their custom call names a
partitioner of this module (:data:`TARGET`, registered with XLA as JAX registers its own),
which hands an instance to JAX's callback once per distinct signature — the primitive
(forward or backward pass) and its call, the mesh, the platform, JAX's trace-time settings,
and the shapes and shardings of the operands and results that propagation chose — and gives
every later instance of that signature in the same program the module and shardings the first
one got. XLA still converts and inlines a module per instance; the Python work is done once
per signature. Only within one program (one lowering's module context): another program
partitions its calls afresh, so nothing a process changes between two compilations (the
per-device function's code included) can reach it through a module made for the other. The
last program's context is held until the next one comes (its identity is the key).

A per-device function that lowers a native call is never shared: each native call is named
and registered where it lowers (``_native/site_key.py``, docs/native.md §4), so every instance
lowers on its own. Elsewhere the call's place in the program (``where``, a static argument)
only names the per-device function's ops, so an instance may carry another's name.

A call keeps JAX's ``backend_config`` (the key of its callbacks: a per-process object id, as
for JAX's own target), so a program with these calls is compiled by every process that runs
it, as before: a native call's group is set up where it lowers (docs/multiprocess.md).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from jax._src import config as jax_config
from jax._src import custom_partitioning as jax_cp
from jax._src import xla_bridge
from jax._src.lib import xla_client
from jax._src.lib.mlir import ir

from jaxoverlap._native import primitive as native

# JAX's target name, suffixed: a reader (or a tool) of the lowered program still sees a
# custom-partitioned call.
TARGET = jax_cp._CUSTOM_PARTITIONING_CALL_NAME + "_jaxoverlap"
_lock = threading.Lock()
_program: Any = None                 # the module context of the program _partitions serves
_partitions: dict[Any, Any] = {}     # its partitions by signature


def adopt(op: Any) -> None:
    """Retargets the custom call that JAX's ``custom_partitioning`` lowering just made to this
    module's partitioner. Anything else (the body lowered in place, as on one device) is left
    alone."""
    op = op.operation if hasattr(op, "operation") else op
    if op.name == "stablehlo.custom_call" and ir.StringAttr(
            op.attributes["call_target_name"]).value == jax_cp._CUSTOM_PARTITIONING_CALL_NAME:
        op.attributes["call_target_name"] = ir.StringAttr.get(TARGET)


def _partition(arg_shapes, arg_shardings, result_shape, result_sharding, backend_string: bytes):
    """XLA's partition callback: JAX's, once per signature of a program (module docstring)."""
    global _program, _partitions
    info = jax_cp._sharding_callbacks[backend_string]
    call = info.static_args[0]         # not `where` (below)
    signature = (info.partition, call, info.mesh, tuple(info.module_context.platforms),
                 jax_config.trace_context(), tuple(map(str, arg_shapes)),
                 tuple(map(repr, arg_shardings)), str(result_shape), repr(result_sharding))
    program = info.module_context      # one lowering's: the program these instances are of
    with _lock:
        done = _partitions.get(signature) if program is _program else None
    if done is not None:
        return done
    before = native.lowered()
    done = jax_cp._custom_partitioning_partition(arg_shapes, arg_shardings, result_shape,
                                                 result_sharding, backend_string)
    if native.lowered() == before:     # no native call in it: `where` named its ops only
        with _lock:
            if program is not _program:  # another program's instances: start afresh
                _program, _partitions = program, {}
            _partitions[signature] = done
    return done


# Registered as JAX registers its own (for the CPU and every plugin backend).
_register = functools.partial(
    xla_client.register_custom_call_partitioner, name=TARGET,
    prop_user_sharding=jax_cp._custom_partitioning_propagate_user_sharding,
    partition=_partition,
    infer_sharding_from_operands=jax_cp._custom_partitioning_infer_sharding_from_operands,
    can_side_effecting_have_replicated_sharding=True)
_register()
xla_bridge.register_plugin_callbacks(_register)
