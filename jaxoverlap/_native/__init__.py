"""The native impl (``impl="native"``): the executors' custom calls, above the planning rule.

What runs once a plan says ``native``, as ``_xla`` and ``_ring`` run the other impls; what the
rule consults about the executors before that lies below it, in ``jaxoverlap._executors``. Its
modules from the top down; each imports only modules listed after it (and ``_plan``,
``_executors``), and none imports the ops (docs/native.md §0 follows one call through):

* ``primitive`` — the JAX primitive the ops bind with their plan: abstract evaluation,
  batching, and the lowering rule that emits the custom call;
* ``attributes`` — the custom call's attributes: one schema (held to ``cpp/ffi/ffi_call.h``)
  and the one function that makes them from the plan and the call's description;
* ``site_key`` — the call's site key: what the call is, the same in every process (a hash of
  where it lowers, its types and attributes, and its ordinal among identical calls).
"""
