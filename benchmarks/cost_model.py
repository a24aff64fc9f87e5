"""Expert parallelism against FSDP2 on paper: a cost model of one training step's communication, checked against
the step times measured on 1, 2 and 4 GPUs of one host, and its predictions for 8 GPUs of one host and for 2-16
hosts. It prints the tables of docs/distributed.md's "Cost model" section.

    python benchmarks/cost_model.py --run f306ade

The model, per GPU and step: T = T1 + sum over the layout's collectives of bytes / rate.
  T1     the one-GPU step of the same model, batch and recipe (torchtitan's benchmark, --run's row of world 1).
  bytes  what one rank sends to other ranks in a step. Expert parallelism: the (token, rank) or (token, expert)
         rows each all-to-all moves, counted by the transport's own code on a uniform top-K routing
         (Transport.rows_per_dest for exact dispatch, transports.capacity_rows for capacity dispatch), times what
         crosses per row (ROW_BYTES); FSDP2 with the blocks kept gathered: one all-gather of the bf16 weights and
         one reduce-scatter of their bf16 gradients, (N - 1) / N of the bytes each; an all-reduce (the benchmark's
         replicated non-expert weights under EP, their float32 gradients; replicas across hosts): 2 (N - 1) / N.
  rate   that collective's GB/s between these GPUs at that message size (benchmarks/comm_bandwidth.py's rows of
         the same run, interpolated in log size; 8 GPUs of one host: the 4-GPU rates, an assumption), or
         --ib-gbs per GPU between hosts (an assumption: no multi-host machine measured here).
Nothing is fitted: no overlap term (the all-to-alls run between the expert GEMMs on one stream; FSDP2's collectives
overlap compute but slow it, measured as nearly their whole time) and no term for ranks waiting on each other.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from moeblaze.configs.layer import DEFAULT_CAPACITY_FACTOR
from moeblaze.distributed.transports import TRANSPORTS, capacity_rows

RESULTS = Path(__file__).resolve().parent / "results"

# torchtitan 0.3.0's qwen3 30B-A3B flavor cut to 4 layers, as benchmarks/torchtitan_train.py runs it: parameters
# counted on a meta-device build (experts 4 x 128 x 3 x 2048 x 768; the rest attention, router, norms, the
# 151,936-token embedding and untied head)
MODEL = dict(layers=4, D=2048, E=128, K=8, expert_params=2_415_919_104, dense_params=698_895_360)


def row_bytes(transport: str, D: int, K: int, b: int = 2) -> int:
    """What crosses per row and layer in one step (checkpoint "preact": the rows are not sent again in backward)."""
    if transport == "tokens":  # x out, its K ids and weights (float32), the partial sum back; dy out, dx and dS back
        return 4 * D * b + 2 * K * 4 + K * 4
    return 4 * D * b + 4 + 4  # pairs: x out, y back; the router weight (float32) and dy out, dx and dS back


def a2a_rows(transport: str, ep: int, L: int, capacity: bool, seed: int = 0) -> float:
    """Rows one rank sends to the other ranks in one all-to-all, counted by the transport's code on a uniform
    routing of L tokens (E experts, top-K)."""
    E, K = MODEL["E"], MODEL["K"]
    t, E_loc = TRANSPORTS[transport], E // ep
    if capacity:
        return (ep - 1) * capacity_rows(t, DEFAULT_CAPACITY_FACTOR, L, K, ep, E_loc)
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(L, E, generator=g).topk(K, dim=1).indices
    per_dest = t.rows_per_dest(idx, E_loc, ep).double()
    return float(per_dest.sum() - per_dest.mean())  # a rank's own block stays (each rank's mean share)


def load(path: Path, run: str | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if run is None or r.get("git_sha") == run]


class Rates:
    """A collective's GB/s between N GPUs at a message size, from comm_bandwidth.py's rows (log-size interpolation,
    clamped to the sizes measured; N past the largest measured: its rates)."""

    def __init__(self, rows: list[dict]):
        self.points: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for r in rows:
            self.points.setdefault((r["impl"], r["world"]), []).append((r["mb_per_rank"] * 2**20, r["gb_s"]))
        for p in self.points.values():
            p.sort()

    def __call__(self, op: str, world: int, size: float) -> float:
        worlds = sorted(w for o, w in self.points if o == op)
        pts = self.points[(op, max([w for w in worlds if w <= world] or worlds[:1]))]
        if size <= pts[0][0]:
            return pts[0][1]
        for (s0, g0), (s1, g1) in zip(pts, pts[1:]):
            if size <= s1:
                f = math.log(size / s0) / math.log(s1 / s0)
                return g0 + f * (g1 - g0)
        return pts[-1][1]


def ep_ms(transport: str, ep: int, L: int, capacity: bool, rate: float | None, rates: Rates | None) -> tuple:
    """(bytes a step, ms) of expert parallelism's all-to-alls: 4 per layer (rows out and back, forward and
    backward) at the all-to-all's rate for that size (rate: a fixed GB/s, across hosts)."""
    rows = a2a_rows(transport, ep, L, capacity)
    per_layer = rows * row_bytes(transport, MODEL["D"], MODEL["K"])
    total = per_layer * MODEL["layers"]
    gbs = rate or rates("all_to_all", ep, per_layer / 4 * ep / max(1, ep - 1))
    return total, total / gbs / 1e6


def ring_ms(op: str, n: int, nbytes: float, rate: float | None, rates: Rates | None, chunk: float) -> float:
    """ms of an all-gather or reduce-scatter ((N - 1) / N of nbytes sent) or an all-reduce (twice that) over n
    GPUs, in messages of `chunk` bytes (a block's weights)."""
    if n == 1:
        return 0.0
    sent = nbytes * (n - 1) / n * (2 if op == "all_reduce" else 1)
    gbs = rate or rates("reduce_scatter" if op == "all_reduce" else op, n, chunk)
    return sent / gbs / 1e6


def fsdp_ms(n: int, params: float, rate: float | None, rates: Rates | None) -> float:
    """FSDP2 kept gathered with bf16 reductions over n GPUs: one all-gather and one reduce-scatter of params' bf16
    bytes a step, a block at a time."""
    chunk = 2 * params / (MODEL["layers"] + 2)
    return sum(ring_ms(op, n, 2 * params, rate, rates, chunk) for op in ("all_gather", "reduce_scatter"))


def validate(titan: list[dict], rates: Rates) -> list[str]:
    base = next(r for r in titan if r["world"] == 1 and r["variant"] == "preact")
    T1, L = base["step_ms"], base["batch"] * base["seq"]
    out = ["| run | all-to-all MB a step: counted by the model / measured | step ms: model / measured | error |",
           "|---|---|---|---|",
           f"| one GPU, moeblaze `preact` (T1) | | {T1:.1f} | |"]
    for r in titan:
        n = r["world"]
        if n == 1 or not r["variant"].startswith("preact"):
            continue
        if r["ep"] > 1:
            transport = r["variant"].partition("@")[2] or "tokens"
            nbytes, a2a = ep_ms(transport, n, L, "capacity" in r["variant"], None, rates)
            dense = MODEL["dense_params"] * 4  # the benchmark's replicated weights: float32 gradients, all-reduced
            model = T1 + a2a + ring_ms("all_reduce", n, dense, None, rates, dense / (MODEL["layers"] + 2))
            name = f"EP {n}, `{r['variant']}`"
            counted = f"{nbytes / 2**20:,.0f} / {r['a2a_mb_per_step']:,.0f}"
        else:
            model = T1 + fsdp_ms(n, MODEL["expert_params"] + MODEL["dense_params"], None, rates)
            name, counted = f"FSDP2 {n}, bf16 reductions, kept gathered", ""
        error = 100 * (model / r["step_ms"] - 1)
        out.append(f"| {name} | {counted} | {model:.1f} / {r['step_ms']:.1f} | {error:+.1f}% |")
    return out


def predict(T1: float, L: int, rates: Rates, ib: float) -> list[str]:
    """Scaling (T1 / T) of the layouts on 8 GPUs of one host and on H hosts of 8 (exact dispatch: the rows that
    must cross; capacity dispatch adds its padding)."""
    P, dense, experts = MODEL["expert_params"] + MODEL["dense_params"], MODEL["dense_params"], MODEL["expert_params"]
    within = fsdp_ms(8, P, None, rates)  # FSDP2 over one host's 8 GPUs, every weight
    dense_within = fsdp_ms(8, dense, None, rates)  # EP 8 in the host: only the dense weights FSDP2-sharded
    ep8 = {t: ep_ms(t, 8, L, False, None, rates)[1] for t in ("tokens", "pairs")}
    out = ["| GPUs | EP across hosts, FSDP2 within: `tokens` / `pairs` | EP 8 within each host, replicas across "
           "hosts: `tokens` / `pairs` | HSDP: FSDP2 within, replicas across hosts | FSDP2 over all GPUs |",
           "|---|---|---|---|---|",
           f"| 8, one host | EP 8: {T1 / (T1 + ep8['tokens'] + dense_within):.3f} / "
           f"{T1 / (T1 + ep8['pairs'] + dense_within):.3f} | | FSDP2 8: {T1 / (T1 + within):.3f} | |"]
    for H in (2, 4, 8, 16):
        # EP across hosts: each host's E/H experts and the dense weights FSDP2 within; the dense gradients'
        # shards all-reduced across hosts
        across = fsdp_ms(8, dense + experts / H, None, rates) + ring_ms("all_reduce", H, 2 * dense / 8, ib, None, 0)
        # EP 8 within each host: every GPU's shard (experts / 8, dense / 8) all-reduced across hosts
        replicas = dense_within + ring_ms("all_reduce", H, 2 * P / 8, ib, None, 0)
        ep_h = {t: ep_ms(t, H, L, False, ib, None)[1] for t in ("tokens", "pairs")}
        hsdp = T1 + within + ring_ms("all_reduce", H, 2 * P / 8, ib, None, 0)
        flat = T1 + fsdp_ms(8 * H, P, ib, None)
        out.append(f"| {8 * H}, {H} hosts | {T1 / (T1 + ep_h['tokens'] + across):.3f} / "
                   f"{T1 / (T1 + ep_h['pairs'] + across):.3f} | {T1 / (T1 + ep8['tokens'] + replicas):.3f} / "
                   f"{T1 / (T1 + ep8['pairs'] + replicas):.3f} | {T1 / hsdp:.3f} | {T1 / flat:.3f} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", default="f306ade", help="the commit whose rows (torchtitan.jsonl, comm-bandwidth.jsonl) "
                   "give T1, the rates and the measured steps")
    p.add_argument("--ib-gbs", type=float, default=40.0, help="GB/s per GPU between hosts (400 Gb/s InfiniBand "
                   "per GPU at ~80%%: an assumption)")
    p.add_argument("--tokens", default="4096,16384,65536", help="tokens per GPU for the crossover table")
    a = p.parse_args()
    rates = Rates(load(RESULTS / "comm-bandwidth.jsonl", a.run))
    titan = load(RESULTS / "torchtitan.jsonl", a.run)
    if not titan or not rates.points:
        raise SystemExit(f"no rows of run {a.run!r} in {RESULTS}")
    print(f"## validation, run {a.run}: {titan[0]['gpu']}, torch {titan[0]['torch']}\n")
    print("\n".join(validate(titan, rates)))
    base = next(r for r in titan if r["world"] == 1 and r["variant"] == "preact")
    T1, L = base["step_ms"], base["batch"] * base["seq"]
    for tokens in (int(t) for t in a.tokens.split(",")):
        print(f"\n## predicted scaling, {tokens:,} tokens per GPU (T1 = {T1 * tokens / L:.1f} ms, linear in tokens), "
              f"{a.ib_gbs:g} GB/s per GPU between hosts\n")
        print("\n".join(predict(T1 * tokens / L, tokens, rates, a.ib_gbs)))


if __name__ == "__main__":
    main()
