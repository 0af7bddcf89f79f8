"""The native impl (``impl="native"``): the Python side of the executors' custom calls.

Its modules from the top down; each imports only modules listed after it, and none imports the
ops (docs/native.md §0 follows one call through):

* ``primitive`` — the JAX primitive the ops bind with their plan: abstract evaluation,
  batching, and the lowering rule that emits the custom call;
* ``attributes`` — the custom call's attributes: one schema (held to ``cpp/ffi/ffi_call.h``)
  and the one function that makes them from the plan and the call's description;
* ``site_key`` — the call's site key: what the call is, the same in every process (a hash of
  where it lowers, its types and attributes, and its ordinal among identical calls);
* ``call`` — the call described once, where it lowers: rank table, clique key, transport;
* ``capabilities`` — what can run here: platforms, dtypes, the GPUs' capability table, the
  one transport resolver;
* ``bootstrap`` — cliques spanning processes, over ``jax.distributed``'s key-value store;
* ``runtime`` — the extensions ``_host`` and ``_cuda`` in this process: loading them and
  registering their handlers with XLA.
"""
