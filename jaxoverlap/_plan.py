"""The resolved choices for one call site, shared by every implementation."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one op call will run. Hashable: it is a static argument of the custom_vjp.

    ``axis`` is normalised (non-negative); ``n`` is the size of ``axis_name``;
    ``chunks`` sub-chunks split every shard; ``bidirectional`` sends half the
    traffic each way round the ring.
    """

    impl: str
    axis_name: str
    axis: int
    n: int
    chunks: int = 1
    bidirectional: bool = False
    transport: str = "auto"     # native: as asked ("auto" is resolved when the call lowers)
    preferred: str | None = None  # native, transport "auto": the performance model's pick
    timeout_s: float = 120.0
    precision: str | None = None  # _precision.normalize'd; None: jax.default_matmul_precision
    algorithm: str = "two_shot"   # matmul_ar (ring, native): "two_shot" or "one_shot"

    def describe(self) -> str:
        text = f"impl={self.impl} axis_name={self.axis_name!r} N={self.n} axis={self.axis}"
        if self.impl in ("ring", "native"):
            text += f" chunks={self.chunks} bidirectional={self.bidirectional}"
            if self.algorithm != "two_shot":
                text += f" algorithm={self.algorithm}"
        if self.precision is not None:
            text += f" precision={self.precision}"
        if self.impl == "native":
            text += f" transport={self.transport}"
            if self.preferred is not None:
                text += f" (model prefers {self.preferred})"
        return text
