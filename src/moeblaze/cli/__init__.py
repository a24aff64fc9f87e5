"""The `moeblaze` command: train, bench, profile."""
from __future__ import annotations

import argparse
import sys


class UsageError(SystemExit):
    """A bad command-line argument, found before any work starts: main prints `moeblaze <command>: error: ...`
    on one line and returns 2, as argparse does."""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moeblaze", description="Memory-efficient Mixture-of-Experts training")
    sub = p.add_subparsers(dest="command")
    from . import bench, profile, train

    train.add_arguments(sub.add_parser("train", help="train the small MoE language model on the built-in corpus"))
    bench.add_arguments(sub.add_parser("bench", help="time and measure MoE layers side by side with peers"))
    profile.add_arguments(sub.add_parser("profile", help="where a layer's memory goes in one training step"))
    args = p.parse_args(argv)
    if args.command is None:
        args = p.parse_args(["train"] + list(argv if argv is not None else sys.argv[1:]))
    mod = {"train": train, "bench": bench, "profile": profile}[args.command]
    try:
        mod.run(args)
    except UsageError as e:
        print(f"moeblaze {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0
