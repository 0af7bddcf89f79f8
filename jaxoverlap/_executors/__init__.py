"""The executors as this process sees them: what the planning rule consults, below it.

The C++ executors (the host executor in ``_host``, the CUDA executor in ``_cuda``) run the
native calls; this package is what Python knows of them before and while a call lowers, and
imports nothing above it (not ``_plan``, not ``_native``). Its modules from the top down; each
imports only modules listed after it:

* ``call`` — one call described once: rank table, clique key, and its transport, decided
  there through the one resolver;
* ``capabilities`` — what can run here: platforms, dtypes, the GPUs' capability table, the
  transports each clique can use and the one transport resolver;
* ``bootstrap`` — cliques spanning processes, over ``jax.distributed``'s key-value store;
* ``runtime`` — the extensions ``_host`` and ``_cuda`` in this process: loading them and
  registering their handlers with XLA.
"""
