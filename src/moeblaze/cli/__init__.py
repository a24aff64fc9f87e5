"""The `moeblaze` command: train, bench, profile."""
from __future__ import annotations

import argparse
import sys


class UsageError(SystemExit):
    """A bad command-line argument, found before any work starts: main prints `moeblaze <command>: error: ...`
    on one line and returns 2, as argparse does."""


def check_device(device: str) -> None:
    """UsageError for --device cuda where no CUDA device is available (every command's first check)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and "default" not in text and action.default not in (None, False, "", [])
                and action.default is not argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moeblaze", description="Memory-efficient Mixture-of-Experts training")
    sub = p.add_subparsers(dest="command")
    from . import bench, profile, train

    for name, mod, text in (("train", train, "train the small MoE language model on the built-in corpus"),
                            ("bench", bench, "time and measure MoE layers side by side with peers"),
                            ("profile", profile, "where a layer's memory goes in one training step")):
        mod.add_arguments(sub.add_parser(name, help=text, formatter_class=HelpFormatter))
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.command is None:
        args = p.parse_args(["train"] + list(argv if argv is not None else sys.argv[1:]))
    from . import bench, profile, train

    mod = {"train": train, "bench": bench, "profile": profile}[args.command]
    try:
        mod.run(args)
    except UsageError as e:
        print(f"moeblaze {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0
