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
