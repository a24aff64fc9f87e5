"""Plot training-loss curves written by `moeblaze train --loss-log` (one JSON line per step).

    python scripts/plot_curves.py FOLDER [OUT.png]     every FOLDER/*.jsonl on one chart (default FOLDER.png)
"""
import glob
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(folder: str, out: str | None = None) -> str:
    out = out or folder.rstrip("/") + ".png"
    fig, ax = plt.subplots(figsize=(7, 4))
    for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))):
        rows = [r for r in map(json.loads, filter(str.strip, open(path))) if "loss" in r]  # not the val rows
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=os.path.basename(path)[:-6], lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


if __name__ == "__main__":
    print(main(*sys.argv[1:]))
