"""Discrete-event simulation of one call: every rank's program, every stream.

Consumes the program dicts of ``_host.build_program`` (the very programs the
executors run). Semantics follow ``tests/native/schedule_check.py``: each
stream runs its ops in list order; Wait blocks until the flag's Signal has
arrived, StreamWait until the event was recorded, a Send/Recv group is posted
together and its stream continues when every op of the group completed; a
Send/Recv transfer starts once both sides are posted (NCCL rendezvous).

What a call costs beyond its ops (``model.py`` has the formulas):

* the fork and the join: the communication streams start one event latency
  after the call (the executor records an event on XLA's stream and the comm
  streams wait on it), and the call ends one event latency after the last comm
  stream (XLA's stream waits on them);
* every transfer pays its fixed start and its size ramp before its bytes flow
  (``model.transfer_fill``);
* the host enqueues every op: a call takes at least ``model.host_time``.

Resources (fluid model): each rank has an egress and an ingress port of
``link_gbps``; every active transfer moves its wire bytes at
``min(capacity / active transfers)`` over the ports it uses. A compute op runs at
``model.compute_rate`` of its full speed: less while NCCL or multicast kernels
of its rank take SMs, and less while transfers move bytes through its rank's
memory (the copy engine takes no SMs, but its traffic still interferes).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxoverlap import _kinds
from jaxoverlap.sim import allreduce, fused, launch, model, reduction
from jaxoverlap.sim.presets import Preset

Program = dict[str, Any]
COMPUTE_KINDS = ("Gemm", "Add", "FusedGemm", "Reduce")
TRANSFER_KINDS = ("Copy", "Send", "Recv", "McStore", "McReduce", "AllReduce")


class SimulationError(RuntimeError):
    pass


@dataclass(frozen=True)
class Span:
    """One op on one stream: [start, end) in seconds from the call's start.

    ``start`` is when the stream reached the op, so blocking time (Wait, a
    transfer waiting for its peer, a GEMM slowed by NCCL) is inside the span.
    """

    rank: int
    stream: int
    index: int  # position in the rank's program
    kind: str
    text: str
    start: float
    end: float
    chunk: int = -1
    sub: int = -1

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """The raw outcome of a simulation: end time and every op's span; ``captured``: the call
    was priced captured in a command buffer (``launch.replays``), not enqueued by the host."""

    total: float
    spans: list[Span] = field(default_factory=list)
    captured: bool = False

    def of(self, rank: int, stream: int | None = None) -> list[Span]:
        return [s for s in self.spans
                if s.rank == rank and (stream is None or s.stream == stream)]


@dataclass(slots=True)
class _Activity:
    remaining: float  # compute: seconds at full speed; transfer: wire bytes
    on_done: Callable[[], None]
    rank: int = -1  # compute: whose SMs
    ports: tuple[tuple[str, int], ...] = ()  # transfer: ("out"|"in", rank)
    # ("nccl"|"mc", ranks whose SMs[, how many: a kernel's own budget, else the preset's])
    sm_user: tuple[str, tuple[int, ...]] | tuple[str, tuple[int, ...], int] | None = None
    memory: tuple[int, ...] = ()  # transfer: ranks whose HBM each payload byte passes
    payload_per_wire: float = 1.0  # transfer: payload bytes per wire byte
    cap: float = float("inf")  # transfer: its own top rate (wire bytes/s)
    spared: int = 0  # compute: SMs it leaves to other kernels (a fused GEMM's spare_sms)
    hbm: float = 0.0  # compute at a fixed pace (a reduction): its HBM bytes/s; rate always 1
    rate: float = 0.0


def _nothing() -> None:
    """A wake-up: the loop looks again at that time."""


class _Engine:
    def __init__(self, programs: Sequence[Program], preset: Preset, gemm_extra_passes: int = 0,
                 block_scaled: bool = False):
        self.p = preset
        self.extra = gemm_extra_passes
        self.block_scaled = block_scaled
        self.dequantized_w: set[int] = set()  # ranks whose float32 copy of w is made
        self.n = len(programs)
        if [pr["rank"] for pr in programs] != list(range(self.n)):
            raise SimulationError("programs must be ranks 0..N-1 of one call, in order")
        self.programs = programs
        self.streams: dict[tuple[int, int], list[tuple[int, dict[str, Any]]]] = {}
        for pr in programs:
            for s in range(pr["num_streams"]):
                self.streams[(pr["rank"], s)] = []
            for i, op in enumerate(pr["ops"]):
                self.streams[(pr["rank"], op["stream"])].append((i, op))
        # A replayable program's wait that ends its stream (only ResetFlags after it: the
        # acknowledgement wait) is a kernel, the bounded flag-wait (cpp/cuda/executor.cc
        # TailWait): (rank, op index) of each; it ends no sooner than a kernel's start after its
        # stream reached it. Its need of an SM the rank's fused GEMM may hold is not priced: it
        # waits for an acknowledgement its reader raises after its own fused GEMM ended.
        self.wait_kernels = {(r, ops[i][0]) for (r, st), ops in self.streams.items()
                             if programs[r].get("replayable") and self.n > 1
                             for i in range(len(ops)) if ops[i][1]["kind"] == "Wait"
                             and all(o["kind"] == "ResetFlags" for _, o in ops[i + 1:])}
        # A call whose every program replays is priced captured (launch.replays): no host
        # enqueue, and each op a replayed node of graph_node_us (launch.replay) on its stream —
        # a graph launch runs each captured stream's nodes on a stream of its own (CUDA
        # programming guide, "CUDA Graphs"), so the nodes of a stream beside the GEMM cost the
        # call only where they lie on its longest path. A stream of one op after another (the
        # one-launch all-reduce's) pays every node, as launch.call_time(captured=True) does.
        self.captured = all(launch.replays(pr, self.n) for pr in programs)
        self.node_seconds = launch.replay(preset, 1) if self.captured else 0.0
        # each op's replayed nodes (model.op_nodes), by stream position: a blocked stream asks
        # again at every step
        self.nodes = ({key: [model.op_nodes(op) for _, op in ops]
                       for key, ops in self.streams.items()} if self.node_seconds else {})
        self.pos = dict.fromkeys(self.streams, 0)
        self.finished = 0  # streams that ran their last op
        self.busy = dict.fromkeys(self.streams, False)
        self.reached = dict.fromkeys(self.streams, 0.0)
        self.now = 0.0
        self.flags: dict[tuple[int, int], float] = {}  # (rank, flag) -> visible at
        self.events: dict[tuple[int, int], float] = {}
        # per rank, bumped by every write to its flags or events: a stream or a fused GEMM that
        # could not move at (now, its rank's version) cannot move until one of them changes
        # (the run loop skips it)
        self.version = [0] * self.n
        self.blocked: dict[tuple[int, int], tuple[float, int]] = {}  # stream -> (now, version)
        self.posted: dict[tuple[str, int, int, int], Callable[[], None]] = {}
        self.heap: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = 0
        self.activities: list[_Activity] = []
        self.rates_stale = False  # the activities changed since set_rates
        self.transports: dict[tuple[str, bool], tuple[float, float]] = {}  # see transfer
        self.carriers: dict[tuple[int, str], str] = {}  # see carrier
        self.gemm_times: dict[tuple[Any, ...], float] = {}  # the ranks' GEMMs share shapes
        self.fused: list[_FusedGemm] = []  # running fused GEMMs (their stalled tiles)
        # per rank: the SMs its fused GEMM leaves to the kernels sized to them (Op::sms)
        self.spare = [max((fused.spare_sms(preset, pr["dtype"], op) for op in pr["ops"]
                           if op["kind"] == "FusedGemm"), default=0) for pr in programs]
        self.all_reduces: dict[int, int] = {}  # rank -> AllReduce ops it started
        self.all_reduce_waiting: dict[int, list[Callable[[], None]]] = {}  # k-th: arrived
        self.spans: list[Span] = []
        self.cap = preset.link_gbps * 1e9
        self.event_latency = preset.event_latency_us * model.US
        self.signal_latency = preset.signal_latency_us * model.US
        fork = self.event_latency
        for key in self.streams:
            if key[1] > 0 and fork > 0:  # comm streams wait for the fork event
                self.busy[key] = True
                self.at(fork, lambda key=key: self.release(key))

    # ---- helpers -------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, fn))

    def span(self, key: tuple[int, int], idx: int, op: dict[str, Any], start: float) -> None:
        self.spans.append(Span(key[0], key[1], idx, op["kind"], op["text"], start, self.now,
                               op.get("chunk", -1), op.get("sub", -1)))

    def add(self, activity: _Activity) -> None:
        self.activities.append(activity)
        self.rates_stale = True

    def raise_flag(self, key: tuple[int, int], t: float) -> None:
        """Flag ``key`` (rank, flag) becomes visible at ``t``; the loop wakes then."""
        self.flags[key] = t
        self.version[key[0]] += 1
        self.at(t, _nothing)

    def release(self, key: tuple[int, int]) -> None:
        self.busy[key] = False
        self.reached[key] = self.now
        self.blocked.pop(key, None)

    def finish(self, key: tuple[int, int], count: int = 1) -> None:
        self.pos[key] += count
        if self.pos[key] == len(self.streams[key]):
            self.finished += 1
        self.busy[key] = False
        self.reached[key] = self.now
        self.blocked.pop(key, None)

    def budget(self, rank: int, op: dict[str, Any]) -> int:
        """The SMs a kernel's grid is sized to: ``Op::sms``, at most those its rank's fused GEMM
        leaves it (as the CUDA executor sizes it; a program without one, made by hand: its
        own); 0: the whole device."""
        most = int(op.get("sms", 0) or 0)
        return min(most, self.spare[rank]) if most > 0 and self.spare[rank] > 0 else most

    def elem(self, rank: int) -> int:
        return int(self.programs[rank]["elem_bytes"])

    def carrier(self, rank: int, mechanism: str) -> str:
        """The transport whose rates a transfer of ``mechanism`` (what its op kind does: a
        peer copy, a multicast store or load-reduce, a Send/Recv) is charged at: the program's
        own transport where it has that mechanism, else the first that does (``_kinds``)."""
        found = self.carriers.get((rank, mechanism))
        if found is None:  # once per rank and mechanism: thousands of transfers ask
            own = self.programs[rank].get("transport")
            if own is not None and _kinds.transport(own).mechanism == mechanism:
                found = own
            else:
                found = next(t.name for t in _kinds.TRANSPORTS if t.mechanism == mechanism)
            self.carriers[(rank, mechanism)] = found
        return found

    def transfer(self, transport: str, nbytes: int, ports: tuple[tuple[str, int], ...],
                 memory: tuple[int, ...], sm_user: tuple[str, tuple[int, ...]] | None,
                 on_done: Callable[[], None], hops: int = 1) -> None:
        """Fixed start and size ramp first (no bandwidth used), then the fluid transfer.

        A payload byte costs link / transport-rate wire bytes (protocol overhead); one
        transfer moves at most ``model.transfer_gbps`` (NCCL send/recv: fewer channels
        than a ring collective). ``hops`` > 1: a ring collective's pipeline.
        """
        rates = self.transports.get((transport, hops > 1))
        if rates is None:  # a few transports per call, thousands of transfers: computed once
            per_wire = self.p.transport_gbps(transport) / self.p.link_gbps
            single = model.transfer_gbps(self.p, transport, collective=hops > 1)
            rates = self.transports[(transport, hops > 1)] = (per_wire, single * 1e9 / per_wire)
        per_wire, cap = rates
        wire_bytes = nbytes / per_wire

        def start() -> None:
            self.add(_Activity(wire_bytes, on_done, ports=ports, sm_user=sm_user, memory=memory,
                               payload_per_wire=per_wire, cap=cap))
        self.at(self.now + model.transfer_fill(self.p, transport, nbytes, hops), start)

    # ---- one stream ----------------------------------------------------------------------
    def advance(self, key: tuple[int, int]) -> bool:
        """Runs the stream as far as it can at ``now``; True if anything happened."""
        # called millions of times per evaluation: what it reads is bound once
        ops = self.streams[key]
        count = len(ops)
        pos, busy, now, reached = self.pos, self.busy, self.now, self.reached
        node_seconds = self.node_seconds
        nodes = self.nodes[key] if node_seconds else None
        spans = self.spans
        moved = False
        r, stream = key
        while pos[key] < count and not busy[key]:
            at = pos[key]
            idx, op = ops[at]
            kind = op["kind"]
            if node_seconds:  # a replayed node starts its op
                ready = reached[key] + node_seconds * nodes[at]
                if ready > now:
                    self.at(ready, _nothing)
                    self.blocked[key] = (now, self.version[r])
                    return moved
            if kind == "Wait":
                t = self.flags.get((r, op["id"]))
                if t is not None and (r, idx) in self.wait_kernels:  # its kernel's start first
                    t = max(t, reached[key] + self.p.ar_start_us * model.US)
                    if t > now:
                        self.at(t, _nothing)
                if t is None or t > now:
                    self.blocked[key] = (now, self.version[r])
                    return moved
            elif kind == "ResetFlags":  # its own flags lowered (a stream write each), in order
                flags = self.flags
                for f in range(op["id"], op["id"] + op["n"]):
                    flags.pop((r, f), None)
                self.version[r] += 1
            elif kind == "StreamWait":
                t = self.events.get((r, op["id"]))
                if t is None or t + self.event_latency > now:
                    self.blocked[key] = (now, self.version[r])
                    return moved
            elif kind == "Signal":
                self.raise_flag((op["peer"], op["id"]), now + self.signal_latency)
            elif kind == "Record":
                self.events[(r, op["id"])] = now
                self.version[r] += 1
                if self.event_latency:
                    self.at(now + self.event_latency, _nothing)
            elif kind == "Send" or kind == "Recv":
                self.post_group(key)
                moved = True
                continue
            else:
                self.start_work(key, idx, op)
                moved = True
                continue
            # a stream op done at once: its span from when the stream reached it (as span()),
            # then the stream moves on (as finish(); the stream is not busy)
            spans.append(Span(r, stream, idx, kind, op["text"], reached[key], now,
                              op.get("chunk", -1), op.get("sub", -1)))
            pos[key] = at + 1
            if at + 1 == count:
                self.finished += 1
            reached[key] = now
            self.blocked.pop(key, None)
            moved = True
        return moved

    def start_work(self, key: tuple[int, int], idx: int, op: dict[str, Any]) -> None:
        r, kind, p = key[0], op["kind"], self.p
        self.busy[key] = True
        start = self.now

        def done() -> None:
            self.span(key, idx, op, start)
            self.finish(key)

        dtype = self.programs[r]["dtype"]
        if kind == "Gemm":
            shape = (dtype, op["batch"], op["m"], op["n"], op["k"], bool(op.get("accumulate")))
            if self.block_scaled:  # dequantize, then multiply in float32; w once per rank
                t = model.dequantized_gemm_time(p, *shape[1:],
                                                dequantize_w=r not in self.dequantized_w)
                self.dequantized_w.add(r)
            else:
                t = self.gemm_times.get(shape)
                if t is None:
                    t = self.gemm_times[shape] = model.gemm_time(p, *shape)
            if self.extra:
                t += model.elementwise_time(p, op["bytes"], self.extra)
            self.add(_Activity(t, done, rank=r))
        elif kind == "Add":
            self.add(_Activity(model.elementwise_time(p, op["bytes"], 3), done, rank=r))
        elif kind == "FusedGemm":
            run = _FusedGemm(self, r, fused.tile_plan(p, dtype, op), done,
                             p.sms - fused.kernel_sms(p, dtype, op))
            self.at(self.now + run.plan.overhead, lambda: self.fused.append(run))
        elif kind == "Reduce":  # N partials in one pass on its SM budget (sim.reduction)
            sources = op["sources"] or ()
            remote = any(src["rank"] != r for src in sources)
            t = reduction.reduction_time(p, len(sources), op["bytes"],
                                         self.budget(r, op) or None, remote)
            start_s = p.ar_start_us * model.US
            hbm = (len(sources) + 1) * op["bytes"] / max(t - start_s, 1e-12)
            sms = reduction.reduction_sms(p, self.budget(r, op))
            self.at(self.now + start_s, lambda: self.add(_Activity(
                t - start_s, done, rank=r, sm_user=("reduce", (r,), sms), hbm=hbm)))
        elif kind == "AllReduce":  # one kernel on every rank: its flag rounds join them
            self.all_reduce(key, op, done)
        elif kind == "Copy":
            # the symmetric workspace, elements or scale slots, is the peers' memory too: a
            # copy into another rank's is a peer copy (an fp8 shard's scale is one, 4 bytes)
            peer_memory = op["d"]["buf"] in ("WORKSPACE", "WORKSPACE_SCALES")
            dst = op["d"]["rank"] if peer_memory else r
            if dst == r:  # local copy: HBM traffic on the copy engine
                self.at(self.now + model.elementwise_time(p, op["bytes"], 2), done)
            else:
                self.transfer(self.carrier(r, "peer_copies"), op["bytes"],
                              (("out", r), ("in", dst)), (r, dst), None, done,
                              hops=int(op.get("hops", 1)))
        elif kind == "McStore":  # the switch replicates: every peer's memory is written
            peers = tuple(q for q in range(self.n) if q != r)
            self.transfer(self.carrier(r, "multicast"), op["bytes"],
                          (("out", r), *(("in", q) for q in peers)), (r, *peers), ("mc", (r,)),
                          done)
        elif kind == "McReduce":  # every peer's memory is read, the switch reduces
            peers = tuple(q for q in range(self.n) if q != r)
            sms = self.budget(r, op) or p.mc_sms  # the SMs a fused GEMM leaves it, or mc_sms
            self.transfer(self.carrier(r, "multicast"), op["bytes"],
                          (("in", r), *(("out", q) for q in peers)), (r, *peers),
                          ("mc", (r,), sms), done)
        else:
            raise SimulationError(f"rank {r}: op kind {kind!r} has no cost model")

    def all_reduce(self, key: tuple[int, int], op: dict[str, Any],
                   done: Callable[[], None]) -> None:
        """A one-launch all-reduce (``sim.allreduce.kernel_time``): its first flag round waits
        for every rank's kernel, so all ranks' k-th AllReduce end together, one kernel time
        after the last arrives."""
        r = key[0]
        pr = self.programs[r]
        k = self.all_reduces.get(r, 0)
        self.all_reduces[r] = k + 1
        waiting = self.all_reduce_waiting.setdefault(k, [])
        waiting.append(done)
        if len(waiting) == self.n:
            t = allreduce.kernel_time(self.p, pr["algorithm"], pr["transport"], self.n,
                                      op["bytes"])
            for finish in self.all_reduce_waiting.pop(k):
                self.at(self.now + t, finish)

    def post_group(self, key: tuple[int, int]) -> None:
        """Posts every op of the Send/Recv group at the stream's position (one ncclGroup)."""
        ops = self.streams[key]
        first = self.pos[key]
        group = ops[first][1]["bundle"]
        members = [ops[first]]
        if group >= 0:
            j = first + 1
            while (j < len(ops) and ops[j][1]["kind"] in ("Send", "Recv")
                   and ops[j][1]["bundle"] == group):
                members.append(ops[j])
                j += 1
        self.busy[key] = True
        start = self.now
        left = [len(members)]
        r = key[0]

        for idx, op in members:
            def done(idx: int = idx, op: dict[str, Any] = op) -> None:
                self.span(key, idx, op, start)
                left[0] -= 1
                if left[0] == 0:
                    self.finish(key, len(members))

            if op["kind"] == "Send":
                mine, other = ("send", r, op["peer"], op["id"]), ("recv", r, op["peer"], op["id"])
                src, dst = r, op["peer"]
            else:
                mine, other = ("recv", op["peer"], r, op["id"]), ("send", op["peer"], r, op["id"])
                src, dst = op["peer"], r
            if mine in self.posted:
                raise SimulationError(f"rank {r}: {op['text']} posted twice")
            if other in self.posted:
                peer_done = self.posted.pop(other)

                def both(a: Callable[[], None] = done, b: Callable[[], None] = peer_done) -> None:
                    a()
                    b()

                self.transfer(self.carrier(r, "messages"), op["bytes"],
                              (("out", src), ("in", dst)), (src, dst), ("nccl", (src, dst)),
                              both, hops=int(op.get("hops", 1)))
            else:
                self.posted[mine] = done

    # ---- the fluid part ------------------------------------------------------------------
    def set_rates(self) -> None:
        """Transfers share their ports; compute ops then run at model.compute_rate.

        The rates depend only on which activities run: recomputed when that changed."""
        if not self.rates_stale:
            return
        self.rates_stale = False
        count: dict[tuple[str, int], int] = {}
        taken = [0] * self.n
        traffic = [0.0] * self.n  # payload bytes/s through each rank's memory
        users: dict[tuple[str, int], int] = {}
        transfers, paced, computes = [], [], []
        for a in self.activities:
            if a.ports:
                transfers.append(a)
                for port in a.ports:
                    count[port] = count.get(port, 0) + 1
            if a.hbm:  # a reduction: memory-bound at its own pace, its bytes slow the others
                paced.append(a)
            elif not a.ports:
                computes.append(a)
            if a.sm_user:
                what, ranks = a.sm_user[0], a.sm_user[1]
                sms = (a.sm_user[2] if len(a.sm_user) > 2 else
                       self.p.nccl_sms if what == "nccl" else self.p.mc_sms)
                for q in ranks:  # one NCCL / multicast kernel per rank; reductions add up
                    key = (what, q) if what != "reduce" else (what, q, id(a))
                    users[key] = max(users.get(key, 0), sms)
        for key, sms in users.items():
            taken[key[1]] += sms
        cap = self.cap
        for a in transfers:
            rate = a.cap  # the smallest of its own cap and its ports' shares
            for port in a.ports:
                share = cap / count[port]
                if share < rate:
                    rate = share
            a.rate = rate
            for q in a.memory:
                traffic[q] += a.rate * a.payload_per_wire
        for a in paced:
            traffic[a.rank] += a.hbm
            a.rate = 1.0
        compute: dict[tuple[int, int], float] = {}  # (rank, spared) -> rate: one per kind
        for a in computes:
            rate = compute.get((a.rank, a.spared))
            if rate is None:
                rate = compute[(a.rank, a.spared)] = model.compute_rate(
                    self.p, max(0, taken[a.rank] - a.spared), traffic[a.rank])
            a.rate = rate

    def run(self) -> Timeline:
        # the loop runs hundreds of thousands of times per call: what it reads is bound once
        busy, blocked, version, heap = self.busy, self.blocked, self.version, self.heap
        advance = self.advance
        live = list(self.streams)  # the streams with ops left, in the order they are scanned
        finished = self.finished
        never = float("inf")
        while True:
            if finished != self.finished:  # a finished stream never moves again: not scanned
                finished = self.finished
                live = [key for key in live if self.pos[key] < len(self.streams[key])]
            progress = True
            while progress:
                progress = False
                now = self.now
                for key in live:
                    if busy[key]:
                        continue
                    seen = blocked.get(key)  # could not move at (now, its rank's version)
                    if seen is not None and seen[0] == now and seen[1] == version[key[0]]:
                        continue
                    if advance(key):
                        progress = True
                for run in self.fused:  # polling starts tiles; only a callback ends a run
                    if run.poll():
                        progress = True
            activities = self.activities
            if not activities and not heap:
                break
            self.set_rates()
            now = self.now
            t_next = heap[0][0] if heap else never
            finishing: _Activity | None = None
            for a in activities:
                if a.rate > 0:
                    t = now + a.remaining / a.rate
                    if t < t_next:
                        t_next, finishing = t, a
            if t_next == never:
                break
            dt = t_next - now
            self.now = now = t_next
            done = []
            kept = []
            for a in activities:
                a.remaining -= a.rate * dt
                scale = 1e-3 if a.ports else 1e-15  # bytes / seconds
                if a is finishing or a.remaining <= scale:
                    done.append(a)
                else:
                    kept.append(a)
            if done:
                self.activities = kept
                self.rates_stale = True
                for a in done:
                    a.on_done()
            while heap and heap[0][0] <= now:
                heapq.heappop(heap)[2]()
        blocked = [f"rank {k[0]} stream {k[1]}: {ops[self.pos[k]][1]['text']}"
                   for k, ops in self.streams.items() if self.pos[k] < len(ops)]
        if blocked:
            raise SimulationError("deadlock; blocked ops:\n  " + "\n  ".join(blocked))
        if self.posted:
            raise SimulationError(f"unmatched send/recv: {sorted(self.posted)}")
        join = self.p.event_latency_us * model.US  # XLA's stream waits on the comm streams
        end = max((s.end + (join if s.stream > 0 else 0.0) for s in self.spans), default=0.0)
        # captured (a one-launch all-reduce's call, or one built replayable: sim.launch): its
        # replayed nodes are in the spans, no host enqueue per call
        total = end if self.captured else max(end, model.host_time(self.p, self.programs))
        return Timeline(total, sorted(self.spans, key=lambda s: (s.rank, s.stream, s.start)),
                        self.captured)


class _FusedGemm:
    """One persistent fused GEMM on one rank, tile by tile (``fused.TilePlan``).

    CTA j of a lane takes units j, j + ctas, ... of the lane (the stock scheduler's static
    striding, ``fused.grid``); a unit's tile starts once the CTA finished its previous one and
    every block the tile waits for has arrived (its flag visible). CTAs in the same state move
    together as a cohort (a range of consecutive units of one run), one compute activity per
    cohort, so a call has a handful of activities, not one per tile. A block whose tiles are
    all stored is released: its flag is raised (the epilogue's release), visible one flag
    latency later, as a stream's Signal.
    """

    def __init__(self, engine: _Engine, rank: int, plan: fused.TilePlan,
                 on_done: Callable[[], None], spared: int = 0):
        self.e, self.rank, self.plan, self.spared = engine, rank, plan, spared
        self.on_done = on_done
        self.left = sum(lane.units for lane in plan.lanes)
        self.block_left = list(plan.block_units)
        self.stalled: list[tuple[int, int, int, int]] = []  # (lane, first unit, end, run)
        self.idle_at: tuple[float, int] | None = None  # (now, version) of the last poll
        # each lane's runs are consecutive: their starts, to find a unit's run by bisection
        self.starts = [[run.start for run in lane.runs] for lane in plan.lanes]
        # each run's flags to wait for, as keys of the engine's flags
        self.waits = [[tuple((rank, plan.wait_flags + b) for b in run.waits) for run in lane.runs]
                      for lane in plan.lanes]
        for i, lane in enumerate(plan.lanes):
            self.queue(i, 0, lane.ctas)

    def queue(self, lane: int, a: int, b: int) -> None:
        """Units [a, b) of `lane` (one per CTA) wait for their runs' blocks."""
        of = self.plan.lanes[lane]
        runs, units = of.runs, of.units
        if b > units:
            b = units
        self.idle_at = None
        i = bisect.bisect_right(self.starts[lane], a) - 1
        if i < 0:
            i = 0
        stalled, count = self.stalled, len(runs)
        while i < count:  # the runs of [a, b): each cut to it (as max(a, start), min(b, end))
            run = runs[i]
            start = run.start
            if start >= b:
                break
            end = run.end
            lo = a if a >= start else start
            hi = b if b <= end else end
            if lo < hi:
                stalled.append((lane, lo, hi, i))
            i += 1

    def poll(self) -> bool:
        """Starts every stalled cohort whose blocks arrived; True if any started."""
        e = self.e
        if self.idle_at == (e.now, e.version[self.rank]):  # nothing it waits on changed
            return False
        flags, now, waits = e.flags, e.now, self.waits
        started = []
        rest = []
        for c in self.stalled:
            for flag in waits[c[0]][c[3]]:  # every block it waits for arrived?
                t = flags.get(flag)
                if t is None or t > now:
                    rest.append(c)
                    break
            else:
                started.append(c)
        if started:  # equal cohorts wait for the same blocks: all of them started
            self.stalled = rest
        for c in started:
            e.add(_Activity(self.plan.tile_seconds, lambda c=c: self.stored(*c), rank=self.rank,
                            spared=self.spared))
        self.idle_at = (e.now, e.version[self.rank])  # none of the rest can start until then
        return bool(started)

    def stored(self, lane: int, a: int, b: int, run_index: int) -> None:
        """The cohort's tiles are stored: count them into their blocks, take the next units."""
        for block in self.plan.lanes[lane].runs[run_index].touched:
            self.block_left[block] -= b - a
            if self.block_left[block] == 0:
                self.release(block)
        self.left -= b - a
        if self.left == 0:
            self.e.fused.remove(self)
            self.on_done()
            return
        ctas = self.plan.lanes[lane].ctas
        self.queue(lane, a + ctas, b + ctas)

    def release(self, block: int) -> None:
        if self.plan.release_flags < 0:
            return
        e = self.e
        e.raise_flag((self.rank, self.plan.release_flags + block),
                     e.now + e.p.signal_latency_us * model.US)


def simulate_programs(programs: Sequence[Program], preset: Preset,
                      gemm_extra_passes: int = 0, block_scaled: bool = False) -> Timeline:
    """Simulates one call given every rank's program (rank order); raises on deadlock.

    ``gemm_extra_passes``: extra HBM passes over each GEMM's output (impl="ring");
    ``block_scaled``: the fp8 operands carry block scales, and each GEMM is the ring's
    dequantize-then-multiply (``model.dequantized_gemm_time``).
    """
    with cyclic_gc_paused():
        return _Engine(programs, preset, gemm_extra_passes, block_scaled).run()


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """A run allocates up to hundreds of thousands of short-lived objects (activities, their
    callbacks, spans) and reference counting frees them all; the cyclic collector, triggered
    by the allocations alone, finds nothing to free yet scans the process's live objects each
    time (a fifth of ``sim.published.evaluate()``'s time). Paused for the run, as ``timeit``
    does; it resumes (if it was on) when the run ends or raises. Results do not depend on it.
    Also a decorator: ``sim.plan`` pauses it for a whole projection (building the programs
    allocates as much again) and a whole choice, so that it scans between choices, not
    between the runs of one."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
