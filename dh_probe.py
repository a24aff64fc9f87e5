import sys
import torch
sys.path.insert(0, "src")
import moeblaze.ops.experts as ops
from moeblaze.bench.harness import CONFIGS
L, d, h, E, K = CONFIGS[sys.argv[1] if len(sys.argv) > 1 else "E"]
LK = L * K
counts = torch.full((E,), LK // E, dtype=torch.int32, device="cuda")
offsets = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
offsets[1:] = counts.cumsum(0)
sched = ops.tile_schedule(counts, offsets, LK)
eti = torch.randperm(LK, device="cuda").to(torch.int32) // K
w2 = torch.randn(E, d, h, device="cuda", dtype=torch.bfloat16) * h ** -0.5
dy = torch.randn(L, d, device="cuda", dtype=torch.bfloat16)
preact = torch.randn(LK, 2 * h, device="cuda", dtype=torch.bfloat16)
token_slot = torch.argsort(eti).to(torch.int32).reshape(L, K)
topk_w = torch.rand(L, K, device="cuda")
out = torch.empty_like(preact)
ops.GLUON = sys.argv[2] != "tl" if len(sys.argv) > 2 else True
for _ in range(3):
    ops._down_bwd(dy, w2, preact, topk_w, token_slot, out, eti, offsets, sched, "swiglu")
torch.cuda.synchronize()
