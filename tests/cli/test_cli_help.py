"""The command line's help: every flag of every command says what it does and shows its default."""
import argparse

from moeblaze.cli import parser


def test_every_flag_has_help_and_its_default():
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing, seen = [], 0
    for name, p in sub.choices.items():
        text = p.format_help()
        for action in p._actions:
            if not action.option_strings or action.option_strings[0] in ("-h", "--help"):
                continue
            seen += 1
            if not action.help:
                missing.append(f"{name} {action.option_strings[0]}: no help")
            shown = action.default not in (None, False, "", []) and action.default is not argparse.SUPPRESS
            if shown and "default" not in p._get_formatter()._get_help_string(action):
                missing.append(f"{name} {action.option_strings[0]}: default not shown")
        assert "usage: moeblaze" in text
    assert seen > 60, seen
    assert not missing, missing


# what a user types that must answer before torch loads: every --help, and refused flags of each kind (argparse's
# invalid choice and malformed number, and the checks that read only the flags)
ANSWERED_AT_ONCE = [
    ["--help"], ["train", "--help"], ["bench", "--help"], ["profile", "--help"],
    ["train", "--router", "bogus"], ["train", "--steps", "x"], ["train", "--top-k", "9"],
    ["train", "--rounding-tile", "4"], ["train", "--threads", "100000"], ["train", "--ep-dispatch", "capacity"],
    ["train", "--activation", "tanh"], ["train", "--lr", "nan"], ["train", "--resume", "--save", ""],
    ["bench", "--configs", "Z"], ["bench", "--policies", "bogus"], ["bench", "--config", "0,16,8,4,2"],
    ["bench", "--impls", "nope"], ["bench", "--activation", "tanh"], ["bench", "--iters", "0"],
    ["profile", "--tokens", "0"], ["profile", "--top-k", "9"], ["profile", "--precision", "fp4"],
]


def test_help_and_refused_flags_answer_before_torch_loads():
    """Issue: `moeblaze --help` and a refused flag took 3-17 s because the parser imported torch, FSDP and the
    bench harness first. Each call runs in a fresh interpreter; what is measured is whether torch (or triton) was
    imported by the time the command answered, not the time."""
    import json
    import subprocess
    import sys

    code = ("import json, sys\nfrom moeblaze.cli import main\n"
            "try:\n    rc = main(json.loads(sys.argv[1]))\nexcept SystemExit as e:\n    rc = e.code\n"
            "print(json.dumps([rc, sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules)]))")
    for argv in ANSWERED_AT_ONCE:
        out = subprocess.run([sys.executable, "-c", code, json.dumps(argv)], capture_output=True, text=True,
                             timeout=120)
        rc, heavy = json.loads(out.stdout.strip().splitlines()[-1])
        assert rc == (0 if argv[-1] == "--help" else 2), (argv, out.stderr)
        assert heavy == [], (argv, heavy)
        if rc == 2:  # the one line that says what is wrong
            assert len(out.stderr.strip().splitlines()) == 1 and "error:" in out.stderr, (argv, out.stderr)


def test_the_torch_free_tables_match_what_runs():
    """The command line's torch-free tables (the default preset, the benchmark's implementation names) are the
    ones the library runs: ModelConfig's defaults, harness.IMPLS."""
    from moeblaze.bench.harness import IMPLS
    from moeblaze.bench.names import IMPLS as NAMES
    from moeblaze.cli.presets import PRESETS
    from moeblaze.nn import ModelConfig

    assert tuple(IMPLS) == NAMES
    d = ModelConfig()
    assert PRESETS["small"] == dict(seq_len=d.max_seq_len, d_model=d.d_model, n_layers=d.n_layers, n_heads=d.n_heads,
                                    num_experts=d.num_experts, top_k=d.top_k, d_expert=d.d_expert)
