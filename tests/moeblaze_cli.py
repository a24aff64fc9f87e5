"""`moeblaze` as tests run it in a subprocess, alone or as torchrun's ranks (`python tests/moeblaze_cli.py train
...`): the command line, with the Triton interpreter's builtins found as in the test process
(helpers.speed_up_triton_interpreter)."""
import sys

from helpers import speed_up_triton_interpreter  # this file's folder is the script's sys.path[0]

from moeblaze.cli import main

if __name__ == "__main__":
    speed_up_triton_interpreter()
    sys.exit(main())
