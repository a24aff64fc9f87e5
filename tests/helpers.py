"""Random MoE problems for tests: fresh random inputs, never zeros."""
import torch

from moeblaze.reference import up_width


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def random_routing(L: int, E: int, K: int, skew: str = "uniform", gen=None) -> torch.Tensor:
    """(L, K) int32 distinct expert ids per token. skew: "uniform", "one" (every token's first choice
    is expert 0), or "empty" (experts E//2.. never chosen when K <= E//2)."""
    if skew == "one":
        rest = torch.stack([torch.randperm(E - 1, generator=gen)[: K - 1] + 1 for _ in range(L)]) if K > 1 else None
        first = torch.zeros(L, 1, dtype=torch.long)
        return (first if rest is None else torch.cat([first, rest], 1)).int()
    pool = E // 2 if skew == "empty" else E
    return torch.stack([torch.randperm(pool, generator=gen)[:K] for _ in range(L)]).int()


def random_problem(L, D, H, E, K, activation="swiglu", dtype=torch.float32, skew="uniform", device="cpu"):
    x = torch.randn(L, D, dtype=dtype, device=device)
    w1 = torch.randn(E, up_width(activation, H), D, dtype=dtype, device=device) / D ** 0.5
    w2 = torch.randn(E, D, H, dtype=dtype, device=device) / H ** 0.5
    idx = random_routing(L, E, K, skew).to(device)
    w = torch.rand(L, K, device=device) + 0.1
    return x, w1, w2, idx, w
