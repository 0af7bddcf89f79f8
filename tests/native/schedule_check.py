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


class ScheduleError(AssertionError):
    pass


def _streams(program):
    streams = [[] for _ in range(program["num_streams"])]
    for op in program["ops"]:
        streams[op["stream"]].append(op)
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
