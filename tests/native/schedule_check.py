"""Whole-clique checks of programs from ``_host.build_program``.

``check_deadlock_free(programs)`` plays every stream of every rank of one
clique forward: an op runs once its dependency is met (Wait: its flag was
signalled by the named writer; StreamWait: the event was recorded; Recv: the
matching Send was posted; everything else: always). Dependencies only ever
become true, so running any enabled op greedily finds a complete schedule if
one exists: the programs are deadlock-free exactly when this finishes.
Sends are eager (posted without waiting for the receiver), as the host
mailbox and NCCL's grouped send/recv treat them.
"""

from __future__ import annotations

from jaxoverlap import _kinds


class ScheduleError(AssertionError):
    pass


def fused_blocks(program, op):
    """A FusedGemm as the block-level ops it stands for, in its order: per row block, the wait
    for its flag (if it waits), the GEMM of its rows, the release of its flag (if it releases).
    The kernel does the same per tile; a tile touching several blocks waits for all of them
    first (so reads happen no earlier) and a block is released only once every tile touching
    it is stored (so no later), which these checks cannot tell from this (a fused GEMM waits
    or releases, never both)."""
    f, rank = op["fused"], program["rank"]
    rows, chunks = f["shard_rows"], f["chunks"]
    out = []
    for b in f["sequence"]:
        shard, sub = divmod(b, chunks)
        begin = shard * rows + rows * sub // chunks
        end = shard * rows + rows * (sub + 1) // chunks
        if f["wait_flags"] >= 0 and shard != f["ready_shard"]:
            out.append({"kind": "Wait", "stream": op["stream"], "id": f["wait_flags"] + b,
                        "peer": f["writers"][b], "text": f"{op['text']} block {b} wait"})
        part = {**op, "kind": "Gemm", "m": end - begin, "accumulate": False,
                "text": f"{op['text']} block {b}"}
        part["a"] = {**op["a"], "offset": op["a"]["offset"] + begin * op["a"]["ld"]}
        part["d"] = {**op["d"], "offset": op["d"]["offset"] + begin * op["d"]["ld"]}
        if op.get("a_scale") is not None:  # fp8: the block's rows take their shard's slot
            part["a_scale"] = {**op["a_scale"], "offset": op["a_scale"]["offset"]
                               + shard * f["x_scale_stride"]}
        out.append(part)
        if f["release_flags"] >= 0:
            out.append({"kind": "Signal", "stream": op["stream"], "id": f["release_flags"] + b,
                        "peer": rank, "text": f"{op['text']} block {b} release"})
    return out


def all_reduce_ops(program, op):
    """An AllReduce (matmul_ar's kernel algorithms) as the block-level ops of its semantics on
    the program's declared workspace (what the host executor runs): y pushed into slot `rank`
    of every peer's workspace and the peer's flag `rank` raised; then every peer's flag; then
    the slots summed into y. On the GPU the kernel does the same in its own area, with its
    own flags (docs/gpu-internals.md §7)."""
    n, r = program["nranks"], program["rank"]
    elems = op["batch"] * op["m"] * op["n"]
    y = {**op["d"], "ld": elems, "batch_stride": elems}  # y is dense: one run of elements
    dense = {"batch": 1, "m": 1, "n": elems, "k": 0, "accumulate": False}

    def slot(owner, writer):
        return {"buf": "WORKSPACE", "rank": owner, "offset": writer * elems,
                "batch_stride": elems, "ld": elems}

    out = []
    for k in range(1, n):
        peer = (r + k) % n
        out.append({**dense, "kind": "Copy", "stream": op["stream"], "a": y, "d": slot(peer, r),
                    "text": f"{op['text']} push to {peer}"})
        out.append({**dense, "kind": "Signal", "stream": op["stream"], "peer": peer, "id": r,
                    "text": f"{op['text']} flag of {peer}"})
    for k in range(1, n):
        writer = (r + k) % n
        out.append({**dense, "kind": "Wait", "stream": op["stream"], "peer": writer, "id": writer,
                    "text": f"{op['text']} wait for {writer}"})
    for j in range(n):
        if j != r:
            out.append({**dense, "kind": "Add", "stream": op["stream"], "a": slot(r, j), "d": y,
                        "text": f"{op['text']} sum of {j}"})
    return out


def _expanded(program, op):
    """The block-level ops an op stands for (a FusedGemm's, an AllReduce's), else itself."""
    if op["kind"] == "FusedGemm":
        return fused_blocks(program, op)
    if op["kind"] == "AllReduce":
        return all_reduce_ops(program, op)
    return [op]


def _scale_blocks(program, op):
    """(role, ref, batch, rows, cols) of a GEMM's scales: one float32 slot each, or, block-scaled
    (MXFP8), a's scale rows beside its rows and all of w's, k/32 per row."""
    kb = program["k"] // 32
    shapes = {"a_scale": (op["batch"], op["m"], kb), "b_scale": (1, kb, op["n"])}
    return [(role, op[role], *(shapes[role] if program.get("block_scaled") else (1, 1, 1)))
            for role in ("a_scale", "b_scale") if op.get(role) is not None]


def _block_ops(program):
    """The program's ops with every AllReduce as its block-level ops (a FusedGemm kept whole:
    its checks look at its blocks themselves)."""
    return [part for op in program["ops"]
            for part in (all_reduce_ops(program, op) if op["kind"] == "AllReduce" else [op])]


def _streams(program):
    streams = [[] for _ in range(program["num_streams"])]
    for op in program["ops"]:
        streams[op["stream"]] += _expanded(program, op)
    return streams


def check_deadlock_free(programs):
    """Raises ScheduleError naming the blocked ops; returns the op count run."""
    n = len(programs)
    assert [p["rank"] for p in programs] == list(range(n))
    streams = [_streams(p) for p in programs]
    pos = [[0] * len(s) for s in streams]
    flags = {}  # (rank, flag) -> writer
    events = set()  # (rank, event)
    mailbox = {}  # (src, dst, tag) -> bytes
    executed = 0
    progress = True
    while progress:
        progress = False
        for r in range(n):
            for s, ops in enumerate(streams[r]):
                while pos[r][s] < len(ops):
                    op = ops[pos[r][s]]
                    kind = op["kind"]
                    if kind == "Wait":
                        writer = flags.get((r, op["id"]))
                        if writer is None:
                            break
                        if writer != op["peer"]:
                            raise ScheduleError(
                                f"rank {r}: {op['text']} satisfied by rank {writer}, "
                                f"expected writer {op['peer']}")
                    elif kind == "StreamWait":
                        if (r, op["id"]) not in events:
                            break
                    elif kind == "Recv":
                        key = (op["peer"], r, op["id"])
                        if key not in mailbox:
                            break
                        if mailbox.pop(key) != op["bytes"]:
                            raise ScheduleError(f"rank {r}: {op['text']} size mismatch")
                    elif kind == "Signal":
                        if (op["peer"], op["id"]) in flags:
                            raise ScheduleError(f"rank {r}: {op['text']} signals a flag twice")
                        flags[(op["peer"], op["id"])] = r
                    elif kind == "Record":
                        events.add((r, op["id"]))
                    elif kind == "ResetFlags":  # a replayable program's reader consuming
                        for f in range(op["id"], op["id"] + op["n"]):
                            flags.pop((r, f), None)
                    elif kind == "Send":
                        key = (r, op["peer"], op["id"])
                        if key in mailbox:
                            raise ScheduleError(f"rank {r}: {op['text']} duplicate message")
                        mailbox[key] = op["bytes"]
                    pos[r][s] += 1
                    executed += 1
                    progress = True
    blocked = [
        f"rank {r} stream {s}: {ops[pos[r][s]]['text']}"
        for r in range(n)
        for s, ops in enumerate(streams[r])
        if pos[r][s] < len(ops)
    ]
    if blocked:
        raise ScheduleError("deadlock; blocked ops:\n  " + "\n  ".join(blocked))
    if mailbox:
        raise ScheduleError(f"sends never received: {sorted(mailbox)}")
    return executed


# ---- data races ----------------------------------------------------------------------------

# The call's inputs (x, w and their fp8 scales): written before the call, never by it.
_INPUTS = ("X", "W", "XSCALE", "WSCALE")
# Symmetric per-clique memory, peers write it: the workspace and its scale slots.
_SYMMETRIC = ("WORKSPACE", "WORKSPACE_SCALES")


def _elements(ref, batch, rows, cols):
    out = set()
    for b in range(batch):
        for i in range(rows):
            start = ref["offset"] + b * ref["batch_stride"] + i * ref["ld"]
            out.update(range(start, start + cols))
    return out


def _accesses(program, op):
    """[(owner rank, buffer, element set, is_write)] of one op (the call's inputs left out)."""
    me, n = program["rank"], program["nranks"]
    kind, acc = op["kind"], []

    def add_block(ref, batch, rows, cols, write, owner=None):
        if ref["buf"] in _INPUTS:
            return
        if owner is None:
            owner = ref["rank"] if ref["buf"] in _SYMMETRIC else me
        elements = frozenset(_elements(ref, batch, rows, cols))
        acc.append((owner, ref["buf"], elements, write))

    def add(ref, cols, write, owner=None):
        add_block(ref, op["batch"], op["m"], cols, write, owner)

    if kind == "Gemm":
        add(op["a"], op["k"], False)
        if op["accumulate"]:
            add(op["c"], op["n"], False)
        for _, scale, batch, rows, cols in _scale_blocks(program, op):
            add_block(scale, batch, rows, cols, False)
        add(op["d"], op["n"], True)
    elif kind == "Add":
        add(op["a"], op["n"], False)
        add(op["d"], op["n"], False)
        add(op["d"], op["n"], True)
    elif kind == "Copy":
        add(op["a"], op["n"], False)
        add(op["d"], op["n"], True)
    elif kind == "Send":
        add(op["a"], op["n"], False)
    elif kind == "Recv":
        add(op["d"], op["n"], True)
    elif kind == "McStore":
        add(op["a"], op["n"], False)
        for owner in range(n):
            add(op["d"], op["n"], True, owner)
    elif kind == "McReduce":
        for owner in range(n):
            add(op["a"], op["n"], False, owner)
        add(op["d"], op["n"], True)
    elif kind == "Reduce":
        for src in op["sources"]:
            add(src, op["n"], False)
        add(op["d"], op["n"], True)
    return acc


def buffer_sizes(program):
    """Elements of each buffer of one rank's call (the workspace per parity)."""
    local = program["batch"] * program["rows"]
    # AR one-shot and the kernel algorithms: the rows are all of them (not N blocks).
    one_shot = program.get("algorithm", "two_shot") != "two_shot"
    gathered = local if one_shot else local * program["nranks"]
    rule = _kinds.op(program["op"]).rows  # gather: x one shard; scatter: y one block; all
    return {
        "X": (local if rule == "gather" else gathered) * program["k"],
        "W": program["k"] * program["n"],
        "Y": (local if rule == "scatter" else gathered) * program["n"],
        "XGATHERED": gathered * program["k"] if program["return_gathered"] else 0,
        "SCRATCH": program["scratch_elems"],
        "WORKSPACE": program["workspace_elems"],
        # fp8: the scale operands (one float32 each; block scales: their operand's shape with k
        # divided by 32) and the moved shards' scale slots.
        "XSCALE": (1 if not program.get("block_scaled") else
                   (local if rule == "gather" else gathered) * (program["k"] // 32)),
        "WSCALE": 1 if not program.get("block_scaled") else program["k"] // 32 * program["n"],
        "SCRATCH_SCALES": program.get("scratch_scales", 0),
        "WORKSPACE_SCALES": program.get("workspace_scales", 0),
    }


def _blocks(program, op):
    """(role, ref, batch, rows, cols) of every block an op touches."""
    b, m, n, k = op["batch"], op["m"], op["n"], op["k"]
    kind = op["kind"]
    if kind in ("Gemm", "FusedGemm"):
        out = [("a", op["a"], b, m, k), ("b", op["b"], 1, k, n), ("d", op["d"], b, m, n)]
        if op["accumulate"]:
            out.append(("c", op["c"], b, m, n))
        return out + _scale_blocks(program, op)
    if kind in ("Add", "Copy", "McStore", "McReduce"):
        return [("a", op["a"], b, m, n), ("d", op["d"], b, m, n)]
    if kind == "Send":
        return [("a", op["a"], b, m, n)]
    if kind == "Recv":
        return [("d", op["d"], b, m, n)]
    if kind == "Reduce":
        return [("d", op["d"], b, m, n)] + [(f"source {i}", ref, b, m, n)
                                            for i, ref in enumerate(op["sources"])]
    return []


def check_bounds(program):
    """Raises ScheduleError unless every block an op touches lies inside its buffer and every
    peer, flag, event, stream and workspace owner is in range (an independent check of what
    the executors check in C++ before running a program)."""
    sizes = buffer_sizes(program)
    nranks = program["nranks"]
    for op in _block_ops(program):
        where = f"rank {program['rank']}: {op['text']}"
        if not 0 <= op["stream"] < program["num_streams"]:
            raise ScheduleError(f"{where}: stream out of range")
        for role, ref, batch, rows, cols in _blocks(program, op):
            if ref["offset"] < 0 or ref["batch_stride"] < 0 or ref["ld"] < cols:
                raise ScheduleError(f"{where}: operand {role} has a negative offset or stride, "
                                    f"or ld < {cols}")
            if ref["buf"] in _SYMMETRIC and not 0 <= ref["rank"] < nranks:
                raise ScheduleError(f"{where}: operand {role} names workspace owner "
                                    f"{ref['rank']}")
            end = (ref["offset"] + (batch - 1) * ref["batch_stride"] + (rows - 1) * ref["ld"]
                   + cols)
            if end > sizes[ref["buf"]]:
                raise ScheduleError(f"{where}: operand {role} reaches element {end} of a "
                                    f"{ref['buf']} buffer of {sizes[ref['buf']]} elements")
        if op["kind"] in ("Send", "Recv", "Signal", "Wait") and not 0 <= op["peer"] < nranks:
            raise ScheduleError(f"{where}: peer out of range")
        if op["kind"] in ("Signal", "Wait") and not 0 <= op["id"] < program["num_flags"]:
            raise ScheduleError(f"{where}: flag out of range")
        if op["kind"] in ("Record", "StreamWait") and not 0 <= op["id"] < program["num_events"]:
            raise ScheduleError(f"{where}: event out of range")
        if op["kind"] == "ResetFlags" and not (
                op["n"] >= 1 and 0 <= op["id"] and op["id"] + op["n"] <= program["num_flags"]):
            raise ScheduleError(f"{where}: flags out of range")
        if op["kind"] == "FusedGemm":
            for part in fused_blocks(program, op):
                if part["kind"] in ("Wait", "Signal") and not (
                        0 <= part["id"] < program["num_flags"] and 0 <= part["peer"] < nranks):
                    raise ScheduleError(f"{where}: {part['text']}: flag or peer out of range")


def check_dtypes(program):
    """Raises ScheduleError unless every op reads and writes buffers of the dtypes it must:
    a block op moves between buffers of one dtype and sums (Add, McReduce) never on fp8 or
    scales; a Gemm reads x's and w's dtypes, writes y's, and names a float32 scale slot for
    exactly its fp8 operands (an independent check of the C++ CheckProgram's dtype rules)."""
    dtypes = program["buffer_dtypes"]
    x, w, y = program["dtype"], program["w_dtype"], program["out_dtype"]
    scales = ("XSCALE", "WSCALE", "SCRATCH_SCALES", "WORKSPACE_SCALES")
    for op in _block_ops(program):
        where = f"rank {program['rank']}: {op['text']}"
        kind = op["kind"]
        if kind == "Gemm":
            want = {"a": x, "b": w, "d": y, "c": y}
            for role, dtype in want.items():
                if op[role] is not None and dtypes[op[role]["buf"]] != dtype:
                    raise ScheduleError(f"{where}: operand {role} is "
                                        f"{dtypes[op[role]['buf']]}, expected {dtype}")
            for role, operand in (("a_scale", x), ("b_scale", w)):
                fp8 = operand.startswith("f8")
                ref = op.get(role)
                if (ref is not None) != fp8 or (ref is not None and ref["buf"] not in scales):
                    raise ScheduleError(f"{where}: {role} must "
                                        f"{'name a scale slot' if fp8 else 'be unset'}")
        elif kind in ("Add", "Copy", "McStore", "McReduce"):
            a, d = dtypes[op["a"]["buf"]], dtypes[op["d"]["buf"]]
            if a != d:
                raise ScheduleError(f"{where}: moves {a} into {d}")
            if kind in ("Add", "McReduce") and (d.startswith("f8") or op["d"]["buf"] in scales):
                raise ScheduleError(f"{where}: sums {d} ({op['d']['buf']})")
        elif kind == "Reduce":
            d = dtypes[op["d"]["buf"]]
            if d.startswith("f8") or op["d"]["buf"] in scales:
                raise ScheduleError(f"{where}: sums {d} ({op['d']['buf']})")
            for src in op["sources"]:
                if dtypes[src["buf"]] != d:
                    raise ScheduleError(f"{where}: sums {dtypes[src['buf']]} into {d}")


def check_race_free(programs, calls=1, parities=2):
    """Raises ScheduleError unless every conflicting pair of accesses is ordered.

    Replays `calls` back-to-back calls of the same programs (call c has epoch c+1 and
    uses the WORKSPACE half and flag set of parity (c+1) % 2; a rank enters call c+1
    once all its streams finished call c, as the handler does). Happens-before comes
    from stream order, call order per rank, Signal -> Wait (same epoch),
    Record -> StreamWait and Send -> Recv (vector clocks). Two accesses to one
    element conflict when one writes; every read must see, as its latest ordered
    write, a write of the same call (no stale or uninitialized data). With calls > 1
    this checks the epoch-parity double-buffering across calls (`parities=1` models a
    single buffer, which tests use to show that double-buffering is needed).

    A replayable program (``program["replayable"]``, core/program.h) is played as the GPU
    replays it: one workspace region whatever the call, and flags that hold 0 or 1 with no
    call number in them. A Signal raises its flag (ScheduleError if it is still raised: its
    reader has not consumed the last call, and the signal would be lost), a Wait waits for it
    to be raised and takes the raising Signal's clock (ScheduleError if that Signal was of
    another call: the wait would let stale or early data through), a ResetFlags lowers flags
    (ScheduleError if one is not raised: a reset not after its wait).
    """
    for program in programs:
        check_bounds(program)
        check_dtypes(program)
    check_deadlock_free(programs)
    n = len(programs)
    streams = [_streams(p) for p in programs]
    sid = {}
    for r in range(n):
        for s in range(len(streams[r])):
            sid[(r, s)] = len(sid)
    clocks = {key: [0] * len(sid) for key in sid}
    pos = {key: (0, 0) for key in sid}  # (call, op index)
    finished = {}  # (rank, call) -> [clock of each stream at its end of that call]
    signals, records, sends = {}, {}, {}
    replayable = bool(programs[0].get("replayable"))
    raised = {}  # replayable: (rank, flag) -> (clock of the raising Signal, its call, text)
    log = {}  # element key -> [(clock, stream id, is_write, call, text)]

    def join(clock, other):
        for i, v in enumerate(other):
            if v > clock[i]:
                clock[i] = v

    def key_of(owner, buf, element, call):
        if buf in _SYMMETRIC and replayable:  # one region, every call
            return (owner, buf, 0, element)
        if buf in _SYMMETRIC:  # symmetric memory: shared across calls of one parity
            return (owner, buf, (call + 1) % parities, element)
        return (owner, buf, call, element)  # per-call buffers

    progress = True
    while progress:
        progress = False
        for (r, s), i in sid.items():
            ops = streams[r][s]
            clock = clocks[(r, s)]
            while True:
                call, k = pos[(r, s)]
                if call == calls:
                    break
                if k == 0 and call > 0:  # enter call: the rank's previous call is over
                    ends = finished.get((r, call - 1), [])
                    if len(ends) < len(streams[r]):
                        break
                    for end in ends:
                        join(clock, end)
                if k == len(ops):  # leave call
                    finished.setdefault((r, call), []).append(list(clock))
                    pos[(r, s)] = (call + 1, 0)
                    progress = True
                    continue
                op = ops[k]
                epoch = call + 1
                kind = op["kind"]
                text = f"call {call} rank {r} stream {s}: {op['text']}"
                if kind == "Wait" and replayable:
                    got = raised.get((r, op["id"]))
                    if got is None:
                        break
                    if got[1] != call:
                        raise ScheduleError(f"{text} is satisfied by call {got[1]}'s signal: "
                                            f"{got[2]}")
                    join(clock, got[0])
                elif kind == "Wait":
                    got = signals.get((r, epoch, op["id"]))
                    if got is None:
                        break
                    join(clock, got)
                elif kind == "StreamWait":
                    if (r, call, op["id"]) not in records:
                        break
                    join(clock, records[(r, call, op["id"])])
                elif kind == "Recv":
                    if (epoch, op["peer"], r, op["id"]) not in sends:
                        break
                    join(clock, sends[(epoch, op["peer"], r, op["id"])])
                clock[i] += 1
                snapshot = list(clock)
                if kind == "Signal" and replayable:
                    if (op["peer"], op["id"]) in raised:
                        raise ScheduleError(
                            f"{text} signals a flag still raised by "
                            f"{raised[(op['peer'], op['id'])][2]} (its reader has not consumed "
                            "that call: the signal is lost)")
                    raised[(op["peer"], op["id"])] = (snapshot, call, text)
                elif kind == "ResetFlags":
                    for f in range(op["id"], op["id"] + op["n"]):
                        if raised.pop((r, f), None) is None:
                            raise ScheduleError(f"{text} resets flag {f}, which is not raised "
                                                "(a reset not after its wait)")
                elif kind == "Signal":
                    signals[(op["peer"], epoch, op["id"])] = snapshot
                elif kind == "Record":
                    records[(r, call, op["id"])] = snapshot
                elif kind == "Send":
                    sends[(epoch, r, op["peer"], op["id"])] = snapshot
                for owner, buf, elements, write in _accesses(programs[r], op):
                    for e in elements:
                        log.setdefault(key_of(owner, buf, e, call), []).append(
                            (snapshot, i, write, call, text))
                pos[(r, s)] = (call, k + 1)
                progress = True

    stuck = [key for key, (call, _) in pos.items() if call < calls]
    if stuck:
        raise ScheduleError(f"streams stuck across calls: {stuck}")

    def before(a, b):  # a happens-before b
        return a is not b and a[0][a[1]] <= b[0][a[1]]

    for key, accesses in log.items():
        for j, a in enumerate(accesses):
            if not a[2]:
                writes = [w for w in accesses if w[2] and before(w, a)]
                mine = [w for w in writes if w[3] == a[3]]
                if not mine:
                    raise ScheduleError(f"read of {key} with no write of its call before it: "
                                        f"{a[4]}")
                if any(not any(before(w, m) for m in mine) for w in writes if w[3] != a[3]):
                    raise ScheduleError(f"read of {key} may see another call's data: {a[4]}")
            for b in accesses[j + 1:]:
                if (a[2] or b[2]) and a[4] != b[4] and not (before(a, b) or before(b, a)):
                    raise ScheduleError(f"race on {key}:\n  {a[4]}\n  {b[4]}")
    return len(log)
