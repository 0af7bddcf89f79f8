"""Program families and their margins (sim.families), and the presets' topology (GB200 NVL72)."""

import dataclasses

import pytest

from jaxoverlap import sim
from jaxoverlap.sim import families, published

# The performance model: no JAX.
pytestmark = pytest.mark.jax_independent

H100 = sim.get_preset("h100")
RS = sim.Shape.from_global(8192, 3584, 8192, 8)


def test_every_published_row_names_a_design_of_a_known_family():
    families.check_designs()
    # the overlapped GEMM+RS answers to its own designs and to those it is built from, never to
    # Flux's (pulls by the GEMM kernel's warps: no program of ours has them)
    assert families.checked_by("matmul_rs:overlapped") == {
        "te-pipeline-rs", "thunderkittens-rs", "triton-dist-rs", "kraken-ce-rs"}
    assert "flux-rs" in families.checked_by("matmul_rs:fused")
    assert {r.design for r in published.CALLS} <= set(families.DESIGNS)
    for d in families.DESIGNS.values():
        assert d.family in families.FAMILIES and d.mechanism and d.source, d.name
    c = sim.Candidate
    assert families.family("matmul_rs", c("native", "p2p", 1, False, fused=True)) == \
        "matmul_rs:fused"
    assert families.family("matmul_rs", c("ring", None)) == "matmul_rs:chunked"
    assert families.family("matmul_ar", c("native", "p2p", 1, False, "one_shot")) == \
        "matmul_ar:one_shot"
    assert families.family("ag_matmul", c("xla", None)) == ""


def test_each_family_gets_its_own_margin_and_the_rest_a_conservative_one():
    serial = [0.05, -0.03]
    own = families.derived(serial, {"matmul_rs:fused": [0.9, 1.25], "ag_matmul:fused": [0.98],
                                    "ag_matmul:chunked": []})
    assert own == {"matmul_rs:fused": 0.2, "ag_matmul:fused": 0.05}  # no comparison: absent
    full = families.complete(own)
    assert set(full) == set(families.FAMILIES) | {"ag_matmul", "matmul_rs", "matmul_ar"}
    assert full["ag_matmul:chunked"] == full["matmul_rs:overlapped"] == full["ag_matmul"] == 0.2


def test_the_chooser_applies_the_margin_of_each_plans_family():
    """A family with a small margin is picked where a faster plan of a family with a large one
    is not: the margin belongs to the family, not the op."""
    fused = sim.Candidate("native", "p2p", 1, False, fused=True)
    chunked = sim.Candidate("native", "p2p", 2, True)
    cands = [sim.Candidate("xla", None), chunked, fused]
    table = {r.candidate: r for r in sim.choose("matmul_rs", RS, "bf16", 8, H100, cands).table}
    gain = {c: table[c].speedup_vs_xla for c in (chunked, fused)}
    assert min(gain.values()) > 1.0
    low = min(gain.values()) - 1.0
    for trusted in (chunked, fused):
        other = fused if trusted is chunked else chunked
        fam = families.family("matmul_rs", trusted)
        p = H100.replace(min_gain={**H100.min_gain, fam: low / 2,
                                   families.family("matmul_rs", other): 0.9})
        choice = sim.choose("matmul_rs", RS, "bf16", 8, p, cands)
        assert choice.candidate == trusted, choice.format()
        assert choice.min_gain == low / 2 and "per family" in choice.format()
    # the h100's own margins: the release-only fused GEMM+RS answers to Flux's losses on 8xH100
    # (F8), by Flux's design priced by its own mechanism (sim.reduction.pulled) and by our plan
    # of that family there, the more optimistic; the chunked ring to PyTorch's async-TP (its
    # losses reproduced: the serial error). At RS std the fused plan is the faster but its
    # projection is within what our own plan of its family projects at Flux's losses: the
    # chunked ring, above its own margin, is picked; with the fused family's margin below its
    # gain the fused plan is
    choice = sim.choose("matmul_rs", RS, "bf16", 8, H100, cands)
    assert table[fused].t_fused < table[chunked].t_fused
    assert H100.margin("matmul_rs", "matmul_rs:fused") > H100.margin("matmul_rs",
                                                                     "matmul_rs:chunked")
    assert 1 - 1 / gain[fused] <= H100.margin("matmul_rs", "matmul_rs:fused")
    assert choice.candidate == chunked, choice.format()
    lax = H100.replace(min_gain={**H100.min_gain,
                                 "matmul_rs:fused": 1 - 1 / gain[fused] - 1e-3})
    assert sim.choose("matmul_rs", RS, "bf16", 8, lax, cands).candidate == fused


def test_the_overlapped_gemm_rs_is_held_to_the_margin_its_designs_give():
    """On the h100 the overlapped GEMM+RS (multicast: the reduction beside the GEMM) is the
    fastest plan at Flux's RS shape (published there: 1.51x on 8xH800, F2; RS std: test_model)
    and is picked exactly when its projection clears its family's margin, which comes from the
    copy-engine designs it is built from (Triton-distributed's TDH-s4, a published loss); at
    Triton-distributed's small shape (PR #166: 0.52x at TP8) it is not picked."""
    choice = sim.choose("matmul_rs", sim.Shape.from_global(4096, 6144, 12288, 8), "bf16", 8, H100)
    fastest = min((r for r in choice.table if r.candidate.impl == "native"),
                  key=lambda r: r.t_fused)
    assert families.family("matmul_rs", fastest.candidate) == "matmul_rs:overlapped"
    assert 1.10 <= fastest.speedup_vs_xla <= 1.05 * 1.51, choice.format()
    margin = H100.margin("matmul_rs", "matmul_rs:overlapped")
    picked = families.family("matmul_rs", choice.candidate) == "matmul_rs:overlapped"
    assert picked == (1 - 1 / fastest.speedup_vs_xla > margin), choice.format()
    small = sim.choose("matmul_rs", sim.Shape.from_global(4096, 1024, 4096, 8), "bf16", 8, H100)
    assert small.candidate.impl == "xla", small.format()


def test_gb200_groups_span_trays_through_fabric_handles():
    gb = sim.get_preset("gb200-nvl72")
    assert (gb.gpus_per_node, gb.nvlink_domain) == (4, 72)
    assert gb.transports == ("nccl", "p2p", "multicast")
    assert gb.transport_needs(4) == {}
    needs = gb.transport_needs(8)
    assert set(needs) == {"p2p", "multicast"} and all("IMEX" in v for v in needs.values())
    assert H100.transport_needs(8) == {} and not H100.spans_nodes(8)
    # the model prices one NVLink domain: a 16-GPU group on an HGX board is refused by name
    with pytest.raises(ValueError, match="nranks=16.*NVLink domain of 8"):
        sim.simulate("ag_matmul", sim.Shape(1, 64, 1024, 1024), "bf16", 16, H100)
    r = sim.simulate("ag_matmul", sim.Shape(1, 64, 1024, 1024), "bf16", 16, gb,
                     sim.Candidate("native", "p2p", 1, True))
    assert r.t_fused > 0
    # GB200's GPUs: the B200's fits at the 1200 W part's peaks
    b200 = sim.get_preset("b200")
    assert gb.peak_tflops["bfloat16"] == 2500.0 and b200.peak_tflops["bfloat16"] == 2250.0
    assert sim.gemm_time(gb, "bf16", 1, 8192, 8192, 8192) < sim.gemm_time(b200, "bf16", 1, 8192,
                                                                           8192, 8192)


def test_a_published_run_is_compared_with_our_program_run_the_way_it_was_timed(monkeypatch):
    """Every design says how its published times were taken, with the evidence; a row whose
    design was timed captured in a CUDA graph is compared with our replayable programs, the rest
    with the plain ones (host-enqueued) — and every GEMM with communication in the set was timed
    eagerly or unknowably (no captured run checks a capture's saving)."""
    for d in families.DESIGNS.values():
        assert d.timed in families.TIMINGS and d.timed_by, d.name
    gemm_rows = [r for r in published.CALLS if r.op != "matmul_ar"]
    assert {families.DESIGNS[r.design].timed for r in gemm_rows} <= {"eager", "unknown"}
    with pytest.raises(ValueError, match="timed: expected one of"):
        families.Design("x", "ag_matmul:fused", "m", "s", timed="cudagraph")
    row = next(r for r in gemm_rows if r.id == "TDH-s8")
    plain = published.evaluate_call.__wrapped__(row)
    assert not plain.closest.candidate.replayable and not plain.best_native.candidate.replayable
    design = families.DESIGNS[row.design]
    monkeypatch.setitem(families.DESIGNS, row.design,
                        dataclasses.replace(design, timed="graphs"))
    captured = published.evaluate_call.__wrapped__(row)
    assert captured.closest.candidate.replayable, captured.closest.candidate
    assert captured.best_native.candidate.replayable
    # captured: without the host enqueue that makes the plain programs lose here
    assert captured.closest.t_fused < plain.closest.t_fused


def test_a_replayable_program_is_picked_only_for_a_plan_whose_plain_program_wins():
    """At Triton-distributed's small GEMM+RS (TDH-s8, a published loss) a replayable program,
    priced captured, clears the margin alone; its plain program, host-bound, does not: xla.
    Where plain programs win (P1/8192), the captured twin may be the pick."""
    small = sim.choose("matmul_rs", sim.Shape.from_global(4096, 1024, 4096, 8), "bf16", 8, H100)
    xla = small.table[0]
    assert xla.candidate.impl == "xla" and small.candidate.impl == "xla", small.format()
    margin = {r.candidate: small.margins[families.family("matmul_rs", r.candidate)]
              for r in small.table if r.candidate.impl != "xla"}
    twins = [r for r in small.table if r.candidate.replayable
             and r.t_fused <= xla.t_fused * (1 - margin[r.candidate])]
    assert twins, small.format()  # captured alone, they would be picked
    plain = {r.candidate: r for r in small.table if not r.candidate.replayable}
    for r in twins:
        sibling = plain[r.candidate.plain]
        assert sibling.t_fused > xla.t_fused * (1 - margin[sibling.candidate]), sibling
    row = next(r for r in published.CALLS if r.id == "P1/8192")
    pick = published.evaluate_call(row).pick
    assert pick.candidate.replayable and pick.captured, pick.candidate
    choice = sim.choose(row.op, row.shape, row.dtype, row.nranks, published.machine(row.machine))
    sibling = next(r for r in choice.table
                   if r.candidate == pick.candidate.plain)
    assert sibling.t_fused <= choice.table[0].t_fused * (1 - choice.min_gain)
