"""``python -m jaxoverlap info|selftest``: the command-line entry."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxoverlap", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, devices, native build and effective configuration")
    selftest = sub.add_parser("selftest", help="run the native ops against the xla impl on this "
                              "machine (every transport, dtype, a few shapes)")
    selftest.add_argument("--quick", action="store_true", help="one shape instead of three")
    args = parser.parse_args(argv)
    if args.command == "selftest":
        from jaxoverlap._selftest import main as selftest_main

        return selftest_main(quick=args.quick)
    if args.command == "info":
        from jaxoverlap._info import format_info, info

        print(format_info(info()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
