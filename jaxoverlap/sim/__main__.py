"""python -m jaxoverlap.sim table|gantt|preset|published: the model from the shell (a model,
not a measurement).

  python -m jaxoverlap.sim table [--preset h100 --preset my.json] [--text]
  python -m jaxoverlap.sim gantt --preset h100 --case "AG std" --out plan.png
  python -m jaxoverlap.sim preset h100 > my.json      # a preset file to edit / calibrate
  python -m jaxoverlap.sim published                  # the model vs published measurements
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxoverlap import _optional
from jaxoverlap.sim.plan import choose
from jaxoverlap.sim.presets import ALIASES, PRESETS, get_preset, load_preset
from jaxoverlap.sim.report import STANDARD_CASES, format_table, gantt, projection_table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxoverlap.sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="projected table for the standard cases")
    t.add_argument("--preset", action="append", help="built-in name or JSON file (repeatable)")
    t.add_argument("--text", action="store_true", help="plain text instead of markdown")
    g = sub.add_parser("gantt", help="Gantt chart PNG of one plan")
    g.add_argument("--preset", default="h100")
    g.add_argument("--case", default=STANDARD_CASES[0].label,
                   choices=[c.label for c in STANDARD_CASES])
    g.add_argument("--out", default="plan.png")
    g.add_argument("--ranks", default="0,1", help="comma-separated ranks to draw")
    pr = sub.add_parser("preset", help="print a preset as JSON")
    pr.add_argument("name", choices=sorted([*PRESETS, *ALIASES]))
    sub.add_parser("published", help="the model against published measurements (markdown, "
                                     "the tables of docs/performance.md)")
    a = ap.parse_args(argv)
    if a.cmd == "table":
        rows = projection_table(a.preset or tuple(PRESETS))
        print(format_table(rows, markdown=not a.text))
    elif a.cmd == "gantt":
        absent = _optional.missing("matplotlib")
        if absent:
            print(f"gantt needs matplotlib: {_optional.install_hint(absent, 'examples')}")
            return 2
        case = next(c for c in STANDARD_CASES if c.label == a.case)
        choice = choose(case.op, case.shape, case.dtype, case.nranks, load_preset(a.preset))
        print(choice.format())
        print(gantt(choice.best, a.out, ranks=[int(r) for r in a.ranks.split(",")]))
    elif a.cmd == "published":
        from jaxoverlap.sim import published

        print(published.markdown_inputs_table())
        print()
        print(published.markdown_one_launch_table())
        print()
        print(published.markdown_overlapped_table())
        print()
        print(published.markdown_designs_table())
        print()
        print(published.markdown_table())
    else:
        json.dump(get_preset(a.name).to_dict(), sys.stdout, indent=2, sort_keys=True)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
