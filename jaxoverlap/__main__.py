"""``python -m jaxoverlap info|bench|selftest``: the command-line entry."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxoverlap", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, devices, native build and effective configuration")
    from jaxoverlap import _bench

    _bench.add_arguments(sub.add_parser(
        "bench", help="time every impl side by side (or --model PRESET: the projection)"))
    selftest = sub.add_parser("selftest", help="run the native ops against the xla impl on this "
                              "machine (every transport, dtype, a few shapes)")
    selftest.add_argument("--quick", action="store_true", help="one shape instead of three")
    selftest.add_argument("--fake", action="store_true", help="run the CUDA executor against "
                          "the host-side fake of CUDA/NCCL/cuBLASLt instead (no GPU needed; "
                          "honours CUDA_DEVICE_MAX_CONNECTIONS)")
    selftest.add_argument("--graph", action="store_true", help="with --fake: only the rows "
                          "whose program replays (matmul_ar's kernel algorithms, which XLA may "
                          "capture; the replayable p2p and multicast programs of every op, "
                          "which no call asks for yet), each captured into a CUDA "
                          "graph and replayed; the others are skipped with the reason")
    selftest.add_argument("--loopback", metavar="N", type=int,
                          help="run N ranks' p2p programs (and FP8, fused) on ONE GPU: a first "
                          "contact that needs one GPU (with --fake: on the host-side fake)")
    selftest.add_argument("--report", metavar="FILE", help="also write a report to attach to a "
                          "bug report (JSON: versions, topology, every row's result and time, the "
                          "first error with the state of the cliques)")
    args = parser.parse_args(argv)
    if args.command == "selftest":
        from jaxoverlap._selftest import main as selftest_main

        return selftest_main(quick=args.quick, fake=args.fake, report=args.report,
                             graph=args.graph, loopback=args.loopback)
    if args.command == "info":
        from jaxoverlap._info import format_info, info

        print(format_info(info()))
    elif args.command == "bench":
        _host_devices()
        return _bench.run(args)
    return 0


def _host_devices() -> None:
    """Eight host devices when no accelerator is present (set before JAX starts)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()


if __name__ == "__main__":
    sys.exit(main())
