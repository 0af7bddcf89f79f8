"""Timelines of native calls: a Chrome/Perfetto trace and the overlap report.

``jo.profile(directory)`` (a context manager) or ``JAXOVERLAP_PROFILE=DIR`` (read when the
first native call is lowered: the profiler hooks itself into the registration of the native
handlers, ``runtime.on_register``; written at exit) turns on the executors' recording
(``cpp/core/trace.h``): every rank's call logs its span and one span per op of its program —
which op, on which stream, for which shard and sub-chunk, and when it started, when what it
waited for was there, and when it ended. From those measured spans, per call:

* ``t_call``: the call, from the first op to the last (the rank's program, after agreement);
* ``t_gemm``: the total time of its Gemm ops;
* ``t_comm``: the total busy time of its communication ops (Copy, Send, Recv, McStore,
  McReduce, Signal; a Recv's wait for its message, a Wait's whole time are waiting, not
  communication, and are counted in ``t_wait``);
* ``t_unfused = t_gemm + t_comm``: the same work done one after the other;
* the overlap efficiency ``(t_gemm + t_comm - t_call) / min(t_gemm, t_comm)``: 1 when the
  shorter of the two is entirely hidden behind the other, 0 when nothing overlaps, negative
  when the call takes longer than its parts in sequence.

The report has one row per call site (an executable's custom call: its clique key and site,
op, problem and plan), with the medians over its calls (every rank, every execution) and the
model's projection of the same problem and plan (``jaxoverlap.sim``) on a named preset. Only
the host executor records spans today; on CPU its times are the host executor's emulation
(threads, memcpy and OpenBLAS), not a GPU's, and the report says so. See docs/profiling.md.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import statistics
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxoverlap import _kinds
from jaxoverlap._config import logger
from jaxoverlap._executors import runtime

GEMM_KINDS = frozenset({"Gemm", "FusedGemm"})  # a FusedGemm's span includes its blocks' waits
COMM_KINDS = frozenset({"Copy", "Send", "Recv", "McStore", "McReduce", "Signal", "Wait"})
STREAM_NAMES = {0: "stream 0 (compute)", 1: "stream 1 (comm, clockwise)",
                2: "stream 2 (comm, counter-clockwise)"}
EMULATION_NOTE = ("These timings are the host executor's emulation on the CPU (one thread per "
                  "stream, memcpy and OpenBLAS), not a GPU's: they show the schedule and its "
                  "waits, not GPU performance.")
_DEFAULT_PRESET = "h100"

_lock = threading.Lock()
_collectors: list[list[dict]] = []
_env_session: Profile | None = None
_process = (0, 1)  # (index, count) when recording started: jax.distributed may be gone at exit


@dataclass
class Profile:
    """What ``jo.profile`` recorded; filled in when its block exits.

    ``calls``: the recorded calls (dicts of ``_host.take_calls``, with ``process``);
    ``sites``: the report, one dict per call site; ``trace_path`` / ``report_path``: the files
    written (None without a directory); ``preset``: the preset of the model column.
    """

    directory: str | None = None
    preset: str | None = None
    calls: list[dict] = field(default_factory=list)
    sites: list[dict] = field(default_factory=list)
    trace_path: str | None = None
    report_path: str | None = None
    emulation: bool = True

    def format(self) -> str:
        return format_report(self.sites, self.preset, self.emulation)


# ---------------------------------------------------------------- recording


def _drain() -> None:
    """Moves the calls the executors logged into every active collector."""
    calls = runtime.load_host().take_calls()
    for call in calls:
        call["process"] = _process[0]
    with _lock:
        for collector in _collectors:
            collector.extend(calls)


def _start() -> list[dict]:
    global _process
    import jax

    collector: list[dict] = []
    host = runtime.load_host()
    _process = (jax.process_index(), jax.process_count())
    _drain()  # what was recorded before now belongs to the sessions already running
    with _lock:
        _collectors.append(collector)
        host.set_recording(True)
    return collector


def _stop(collector: list[dict]) -> list[dict]:
    _drain()
    host = runtime.load_host()
    with _lock:
        _collectors.remove(collector)
        if not _collectors:
            host.set_recording(False)
    return collector


@contextlib.contextmanager
def profile(directory: str | os.PathLike[str] | None = None, *, preset: str | None = None,
            show: bool = True) -> Iterator[Profile]:
    """Records the native calls made inside the block and reports on them at its end.

    For example (``step`` a jitted function making native calls)::

        with jo.profile("prof") as prof:
            jax.block_until_ready(step(x, w))
        prof.sites[0]["efficiency"]

    Block on the results inside the block: a call still running at its end is not recorded.
    With ``directory``, writes ``trace.json`` (Chrome/Perfetto: open it in ui.perfetto.dev or
    chrome://tracing) and ``report.json`` there. ``preset`` names the model's preset (default:
    the configured one, the GPU's, else h100). ``show`` prints the report.
    """
    session = Profile(directory=os.fspath(directory) if directory is not None else None)
    collector = _start()
    try:
        yield session
    finally:
        _finish(session, _stop(collector), preset, show)


def _finish(session: Profile, calls: list[dict], preset: str | None, show: bool) -> None:
    session.calls = list(calls)
    session.emulation = bool(calls) and all(c.get("executor") == "host" for c in calls)
    session.preset = _preset_name(preset)
    session.sites = site_report(session.calls, session.preset)
    if session.directory is not None:
        os.makedirs(session.directory, exist_ok=True)
        suffix = _process_suffix()
        session.trace_path = write_trace(
            session.calls, os.path.join(session.directory, f"trace{suffix}.json"))
        session.report_path = os.path.join(session.directory, f"report{suffix}.json")
        with open(session.report_path, "w") as f:
            json.dump({"preset": session.preset, "emulation": session.emulation,
                       "note": EMULATION_NOTE if session.emulation else None,
                       "sites": session.sites}, f, indent=2)
    if show:
        print_report(session.sites, session.preset, session.emulation)
        if session.trace_path:
            print(f"trace: {session.trace_path} (open in ui.perfetto.dev or chrome://tracing)")


def _process_suffix() -> str:
    """"" in one process; ".process3" in process 3 of several (each writes its own ranks)."""
    return f".process{_process[0]}" if _process[1] > 1 else ""


def start_from_env() -> None:
    """``JAXOVERLAP_PROFILE=DIR``: record from now on, write DIR at exit (once per process)."""
    global _env_session
    directory = os.environ.get("JAXOVERLAP_PROFILE")
    with _lock:
        if not directory or _env_session is not None:
            return
        _env_session = Profile(directory=directory)
    collector = _start()

    def write() -> None:
        try:
            _finish(_env_session, _stop(collector), None, show=True)
        except Exception as err:  # at exit: say it, do not raise
            logger.warning("JAXOVERLAP_PROFILE=%s: could not write the profile: %s",
                           directory, err)

    atexit.register(write)
    logger.info("JAXOVERLAP_PROFILE=%s: recording native calls' timelines", directory)


runtime.on_register(start_from_env)  # from the first native call on


# ---------------------------------------------------------------- analysis


def _group(call: dict) -> int:
    found = re.search(r"/group (\d+)", call.get("clique", ""))
    return int(found.group(1)) if found else 0


def _site_key(call: dict) -> tuple:
    clique = re.sub(r"/group \d+", "", call.get("clique", ""))
    return (clique, call["op"], call["transport"], call["nranks"], call["batch"], call["rows"],
            call["k"], call["n"], call["dtype"], call["chunks"], call["bidirectional"],
            call["return_gathered"])


def call_times(call: dict) -> dict[str, float]:
    """Seconds of one recorded call: t_call, t_gemm, t_comm, t_wait (docstring of the module)."""
    t_gemm = t_comm = t_wait = 0.0
    for op in call["ops"]:
        if op["kind"] in GEMM_KINDS:
            t_gemm += (op["end_ns"] - op["start_ns"]) * 1e-9
        elif op["kind"] in COMM_KINDS:
            t_comm += (op["end_ns"] - op["ready_ns"]) * 1e-9
        t_wait += (op["ready_ns"] - op["start_ns"]) * 1e-9
    return {"t_call": (call["end_ns"] - call["start_ns"]) * 1e-9, "t_gemm": t_gemm,
            "t_comm": t_comm, "t_wait": t_wait}


def overlap_efficiency(t_gemm: float, t_comm: float, t_call: float) -> float | None:
    """(T_gemm + T_comm - T_call) / min(T_gemm, T_comm); None when either is zero."""
    shorter = min(t_gemm, t_comm)
    return (t_gemm + t_comm - t_call) / shorter if shorter > 0 else None


def _preset_name(preset: str | None) -> str:
    if preset:
        return preset
    from jaxoverlap._config import current_config
    from jaxoverlap._plan import machine_preset

    try:
        import jax

        kind = jax.devices()[0].device_kind
    except Exception:  # no backend: the configured preset or the default
        kind = None
    return machine_preset(current_config().preset, kind) or _DEFAULT_PRESET


def _model(call: dict, preset: str) -> dict[str, Any]:
    """The model's projection of this call's problem and plan on ``preset`` (seconds)."""
    from jaxoverlap import sim

    algorithm = call.get("algorithm", "two_shot")
    rows = call["rows"]
    op = _kinds.op(call["op"])
    if op.rows == "all" and algorithm == "two_shot":
        rows *= call["nranks"]  # the program's rows per block; the model's shape has them all
    shape = sim.Shape(call["batch"], rows, call["k"], call["n"])
    plan = sim.Candidate("native", call["transport"], call["chunks"], call["bidirectional"],
                         algorithm if op.one_shot else "two_shot",
                         fused=bool(call.get("fused", False)),
                         replayable=bool(call.get("replayable", False)))
    try:
        r = sim.simulate(call["op"], shape, call["dtype"], call["nranks"], preset, plan,
                         return_gathered=call["return_gathered"])
    except (ValueError, OSError, sim.SimulationError) as err:
        return {"model_error": str(err).splitlines()[0]}
    return {"model_t_fused": r.t_fused, "model_t_unfused": r.t_unfused,
            "model_t_gemm": r.t_gemm, "model_t_comm": r.t_comm,
            "model_efficiency": overlap_efficiency(r.t_gemm, r.t_comm, r.t_fused)}


def site_report(calls: Sequence[dict], preset: str | None = None) -> list[dict]:
    """One row per call site: medians over its calls of the measured times (seconds), the
    overlap efficiency (median of the calls'), and the model's projection on ``preset``
    (None: no model column)."""
    by_site: dict[tuple, list[dict]] = {}
    for call in calls:
        by_site.setdefault(_site_key(call), []).append(call)
    rows = []
    for key, site_calls in by_site.items():
        first = site_calls[0]
        times = [call_times(c) for c in site_calls if c.get("ok", True)]
        if not times:
            continue
        effs = [e for t in times
                if (e := overlap_efficiency(t["t_gemm"], t["t_comm"], t["t_call"])) is not None]
        med = {name: statistics.median(t[name] for t in times) for name in times[0]}
        row = {
            "site": key[0], "op": first["op"], "transport": first["transport"],
            "nranks": first["nranks"], "batch": first["batch"], "rows": first["rows"],
            "k": first["k"], "n": first["n"], "dtype": first["dtype"],
            "chunks": first["chunks"], "bidirectional": first["bidirectional"],
            "executor": first.get("executor", "host"), "calls": len(times),
            "executions": len({c["epoch"] for c in site_calls}),
            **med, "t_unfused": med["t_gemm"] + med["t_comm"],
            "efficiency": statistics.median(effs) if effs else None,
        }
        if preset is not None:
            row["preset"] = preset
            row.update(_model(first, preset))
        rows.append(row)
    return rows


# ---------------------------------------------------------------- output


def _event_name(call: dict, op: dict) -> str:
    name = f"{call['op']} {op['kind']}"
    if op["shard"] >= 0:
        name += f" shard {op['shard']}"
    if op["sub"] >= 0:
        name += f" sub {op['sub']}"
    return name


def trace_events(calls: Sequence[dict]) -> list[dict]:
    """Chrome trace events: pid = a rank (of a group, in a process), tid = its stream; one
    "X" event per call (on stream 0's track, around its ops) and per op; times in µs from the
    first recorded call."""
    if not calls:
        return []
    t0 = min(c["start_ns"] for c in calls)
    events: list[dict] = []
    named: set[tuple] = set()
    for call in calls:
        group = _group(call)
        pid = call.get("process", 0) * 1_000_000 + group * call["nranks"] + call["rank"]
        if (pid,) not in named:
            named.add((pid,))
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {
                "name": f"rank {call['rank']} group {group} (process {call.get('process', 0)})"}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                           "args": {"sort_index": pid}})
        for stream in {0} | {op["stream"] for op in call["ops"]}:
            if (pid, stream) not in named:
                named.add((pid, stream))
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": stream,
                               "args": {"name": STREAM_NAMES.get(stream, f"stream {stream}")}})
        events.append({
            "ph": "X", "cat": "call", "pid": pid, "tid": 0,
            "name": f"jaxoverlap.{call['op']} ({call['transport']})",
            "ts": (call["start_ns"] - t0) / 1e3, "dur": (call["end_ns"] - call["start_ns"]) / 1e3,
            "args": {"clique": call["clique"], "epoch": call["epoch"], "ok": call["ok"],
                     "transport": call["transport"], "executor": call.get("executor"),
                     "problem": f"batch {call['batch']} rows {call['rows']} k {call['k']} "
                                f"n {call['n']} {call['dtype']}",
                     "chunks": call["chunks"], "bidirectional": call["bidirectional"]}})
        for op in call["ops"]:
            events.append({
                "ph": "X", "cat": "gemm" if op["kind"] in GEMM_KINDS else (
                    "comm" if op["kind"] in COMM_KINDS else "other"),
                "pid": pid, "tid": op["stream"], "name": _event_name(call, op),
                "ts": (op["start_ns"] - t0) / 1e3,
                "dur": (op["end_ns"] - op["start_ns"]) / 1e3,
                "args": {"transport": call["transport"], "bytes": op["bytes"],
                         "peer": op["peer"], "wait_us": (op["ready_ns"] - op["start_ns"]) / 1e3,
                         "epoch": call["epoch"], "index": op["index"]}})
    return events


def write_trace(calls: Sequence[dict], path: str) -> str:
    """Writes the calls as a Chrome/Perfetto trace JSON; returns the path."""
    with open(path, "w") as f:
        json.dump({"traceEvents": trace_events(calls), "displayTimeUnit": "ns",
                   "otherData": {"source": "jaxoverlap", "emulation": all(
                       c.get("executor") == "host" for c in calls)}}, f)
    return path


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def _eff(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


_COLUMNS = ("call site", "plan", "calls", "measured ms", "T_gemm ms", "T_comm ms", "wait ms",
            "unfused ms", "efficiency", "model ms", "model unfused ms", "model eff.")


def _cells(row: dict) -> tuple[str, ...]:
    bidi = " bidi" if row["bidirectional"] else ""
    site = (f"{row['op']} {row['site'].split('/', 1)[-1]}\n"
            f"{row['nranks']}x[{row['batch']},{row['rows']},{row['k']}]@{row['n']} "
            f"{row['dtype']}")
    model = ((_ms(row.get("model_t_fused")), _ms(row.get("model_t_unfused")),
              _eff(row.get("model_efficiency")))
             if "model_error" not in row else ("n/a", "n/a", "n/a"))
    return (site, f"{row['transport']} chunks={row['chunks']}{bidi}", str(row["calls"]),
            _ms(row["t_call"]), _ms(row["t_gemm"]), _ms(row["t_comm"]), _ms(row["t_wait"]),
            _ms(row["t_unfused"]), _eff(row["efficiency"]), *model)


def _notes(rows: Sequence[dict], preset: str | None, emulation: bool) -> list[str]:
    notes = []
    if emulation:
        notes.append(EMULATION_NOTE)
    if preset is not None:
        notes.append(f"model: jaxoverlap.sim on preset {preset!r} for the same problem and plan "
                     "(a model, not a measurement"
                     + ("; a GPU's projection, not comparable in absolute terms with the host "
                        "emulation)" if emulation else ")"))
    for row in rows:
        if "model_error" in row:
            notes.append(f"{row['op']} {row['site']}: no model ({row['model_error']})")
    notes.append("efficiency = (T_gemm + T_comm - T_call) / min(T_gemm, T_comm), medians over "
                 "every rank's calls; T_comm excludes waits")
    return notes


def format_report(rows: Sequence[dict], preset: str | None, emulation: bool) -> str:
    """The report as plain text."""
    if not rows:
        return ("jaxoverlap profile: no native calls were recorded (only the host executor "
                "records timelines; the CUDA executor's are not recorded yet).")
    lines = ["jaxoverlap overlap report", " | ".join(_COLUMNS)]
    for row in rows:
        lines.append(" | ".join(c.replace("\n", " ") for c in _cells(row)))
    return "\n".join(lines + _notes(rows, preset, emulation))


def print_report(rows: Sequence[dict], preset: str | None, emulation: bool) -> None:
    """Prints the report: a rich table when rich is installed, else plain text."""
    from jaxoverlap import _optional

    if not rows or _optional.missing("rich"):
        print(format_report(rows, preset, emulation))
        return
    from rich.console import Console
    from rich.table import Table

    title = "jaxoverlap overlap report" + (" (host executor emulation, not a GPU)"
                                           if emulation else "")
    table = Table(title=title)
    for name in _COLUMNS:
        table.add_column(name, justify="left" if name in ("call site", "plan") else "right")
    for row in rows:
        table.add_row(*_cells(row))
    console = Console()
    if not console.is_terminal:  # a log or a pipe: do not squeeze the table into 80 columns
        console = Console(width=200)
    console.print(table)
    for note in _notes(rows, preset, emulation):
        console.print(note, highlight=False, markup=False)
