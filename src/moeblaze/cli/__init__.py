"""The `moeblaze` command: train, bench, profile."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time


class UsageError(SystemExit):
    """A bad command-line argument, found before any work starts: main prints `moeblaze <command>: error: ...`
    on one line and returns 2, as argparse does."""


class RunError(SystemExit):
    """A run that stopped after its work began, for a reason it can say in one line (a capacity overflow under
    --on-overflow error, say): main prints `moeblaze <command>: error: ...` and returns 1, with no traceback."""


def default_device(device: str | None) -> str:
    """--device as given, or where it was left out, cuda where a GPU is available and cpu otherwise."""
    import torch

    return device or ("cuda" if torch.cuda.is_available() else "cpu")


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


class Parser(argparse.ArgumentParser):
    """argparse's parser, but a refused argument is one line (argparse prints its whole usage block first), with
    where to read the flags; its subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the flags)\n")


COMMANDS = {"train": "train the small MoE language model on the built-in corpus",
            "bench": "time and measure MoE layers side by side with peers",
            "profile": "where a layer's memory goes in one training step"}


def _flags(command: str):
    """The command's flags module (cli/<command>_flags.py): its arguments and the checks that read only them,
    torch-free, so that --help and a refused flag answer before torch loads."""
    return importlib.import_module(f"{__name__}.{command}_flags")


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="moeblaze", description="Memory-efficient Mixture-of-Experts training. `moeblaze COMMAND "
               "--help` lists a command's flags.")
    from .. import __version__

    p.add_argument("--version", action="version", version=f"moeblaze {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in COMMANDS.items():
        _flags(name).add_arguments(sub.add_parser(name, help=text, formatter_class=HelpFormatter))
    return p


def _subparser(p: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def _unrecognized(sub: argparse.ArgumentParser, extra: list[str]) -> str:
    """argparse's message for flags a command lacks, with the nearest flag it has for each."""
    import difflib

    flags = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    hints = [f"{e} -> did you mean {m[0]}?" for e in extra if e.startswith("-")
             for m in [difflib.get_close_matches(e.split("=")[0], flags, n=1)] if m]
    return f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})" if hints else "")


def _busy_cores(wait_s: float = 0.25) -> float:
    """Cores' worth of CPU time that other processes took over wait_s (this one sleeps meanwhile): /proc/stat's
    busy time where it exists, else the 1-minute load average; 0 where neither does."""
    def ticks():
        with open("/proc/stat") as f:
            t = [int(v) for v in f.readline().split()[1:]]
        return sum(t), t[3] + t[4]  # all, idle + iowait

    try:
        (t0, i0), _, (t1, i1) = ticks(), time.sleep(wait_s), ticks()
        return (os.cpu_count() or 1) * (1 - (i1 - i0) / max(1, t1 - t0))
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def wait_passively_when_busy() -> None:
    """OMP_WAIT_POLICY=passive when other processes keep a core or more busy, set before torch loads OpenMP.

    OpenMP threads spin at every barrier by default: on a busy machine the spinning thread takes the core from
    the one it waits for (`moeblaze train`'s two threads at 1.5x one thread's time on a 2-core machine that two
    other processes kept busy), while sleeping threads give it back (0.66-0.88x one thread's time); on an idle
    machine, sleeping costs a wake-up at every parallel region (1.8x spinning's time). docs/cli.md has the
    measurements. Left alone where torch is loaded already or OMP_WAIT_POLICY / GOMP_SPINCOUNT is set."""
    if "torch" in sys.modules or "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    if _busy_cores() >= 1:
        os.environ["OMP_WAIT_POLICY"] = "passive"


def interpret_on_the_cpu(device: str | None) -> None:
    """TRITON_INTERPRET=1 for a bench or profile run on the CPU, so that it shows the kernels (under Triton's
    interpreter) rather than the reference alone: set before triton loads (it reads it once), where nothing set it."""
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules or device == "cuda":
        return
    if device is None:
        import torch  # loads no triton

        if torch.cuda.is_available():
            return
    os.environ["TRITON_INTERPRET"] = "1"


def main(argv=None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)
    if args.command is None:  # a bare `moeblaze`: what it can do, and nothing started
        if extra:
            p.error(f"unrecognized arguments: {' '.join(extra)}; a command comes first: {', '.join(COMMANDS)}")
        p.print_help()
        return 0
    if extra:  # said by the command that lacks them, with the nearest flag it has
        sub = _subparser(p, args.command)
        sub.error(_unrecognized(sub, extra))
    try:
        config = _flags(args.command).check_flags(args)  # before torch loads; run checks it with the machine's
        wait_passively_when_busy()
        if args.command in ("bench", "profile"):
            interpret_on_the_cpu(config.device)
        importlib.import_module(f"{__name__}.{args.command}").run(config)
    except UsageError as e:
        print(f"moeblaze {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RunError as e:  # on a line of its own, after a progress bar's
        print(f"\nmoeblaze {args.command}: error: {e}", file=sys.stderr)
        return 1
    return 0
