"""Top-k token-choice router: a linear d -> E (optionally with a learned bias), scores in fp32, and its losses.

Scores and weights (`scoring`):
  "softmax_topk": softmax over all E experts, keep the top K probabilities (Mixtral, Qwen3, OLMoE);
  "sigmoid_topk": a sigmoid per expert, keep the top K (DeepSeek-V3, Kimi K2, GLM-4.5);
  "topk_softmax": top K of the logits, then a softmax over those K (gpt-oss, Switch, SonicMoE).
`renormalize` divides the kept scores by their sum (not for "topk_softmax", whose weights sum to 1 already);
`route_scale` multiplies the weights (DeepSeek-V3's routed_scaling_factor).
Selection only (the weights stay the scores above):
  expert_bias  a per-expert bias added to the scores when choosing, learned without gradients: the router counts
               the tokens each expert gets while training, and `update_expert_bias()` (once per optimizer step,
               the counts summed over a process group first) moves it by rate · sign(mean load − load), centred
               (DeepSeek-V3's aux-loss-free balancing);
  num_groups / topk_groups: experts in num_groups equal groups; each token keeps the topk_groups groups with the
               largest sum of their two best (biased) scores and chooses its K among them (DeepSeek-V3: 8 / 4).
Balancing losses (`aux_loss`), over P_e = a token's normalized scores (softmax probabilities; sigmoid scores over
their sum) and f_e = the fraction of the pairs that go to expert e (counted before any rounding):
  "switch"    E · sum_e f_e · mean_t P_e over this micro-batch (1.0 when balanced);
  "sequence"  the same per sequence (forward's seq_len), averaged over sequences (DeepSeek-V3);
  "global"    f from counts summed over the ranks of `aux_group` (one all-reduce, detached), P local (Qwen);
  "none"      0.
The router z-loss mean_t logsumexp(logits_t)^2. Every loss is 0 (finite, with zero gradients) for an empty batch.
No host sync anywhere. Logits of bf16 x and weight come from bf16 GEMMs that accumulate in fp32 (router_logits), not
fp32 GEMMs: fp32 logits within ~1e-5 of x.float() @ weight.float().t()'s on tensor cores (see _Bf16Logits), where
a model's own bf16 linear would round them to bf16 (~4e-3).
Memory: the (L, E) fp32 logits and scores live only until backward of the router, as in any router; two (E,)
fp32 buffers with expert_bias. The logits' backward keeps x itself (no fp32 copy of it) when x and weight are bf16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ..args import check_int
from ..configs import AUX_LOSSES, SCORINGS, RouterConfig, check_config, check_layer  # noqa: F401
from .index import count_per_expert


@dataclass
class RouterOutput:
    """What TopKRouter.forward returns.

    Args:
        topk_idx: (L, K) int32 expert ids.
        topk_weights: (L, K) fp32 weights, differentiable.
        aux_loss: the balancing loss of the router's kind, an fp32 scalar.
        z_loss: the router z-loss, an fp32 scalar.
        logits: (L, E) fp32 logits, the gate bias included (token rounding reads them).
    """
    topk_idx: torch.Tensor  # (L, K) int32 expert ids
    topk_weights: torch.Tensor  # (L, K) fp32, differentiable
    aux_loss: torch.Tensor  # scalar fp32, the load-balancing loss (the router's aux_loss kind)
    z_loss: torch.Tensor  # scalar fp32
    logits: torch.Tensor | None = None  # (L, E) fp32, the gate bias included (token rounding reads them)


def _group_mask(sel_LE: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """sel with every expert outside each token's topk_groups best groups set to -inf; a group's score is the sum
    of its two best scores (its best one where a group has one expert)."""
    L, E = sel_LE.shape
    grouped = sel_LE.view(L, num_groups, E // num_groups)
    score_LG = grouped.topk(min(2, E // num_groups), dim=-1).values.sum(-1)
    keep_LG = torch.zeros_like(score_LG, dtype=torch.bool).scatter_(1, score_LG.topk(topk_groups, dim=-1).indices,
                                                                   True)
    return grouped.masked_fill(~keep_LG[..., None], float("-inf")).view(L, E)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32 for bf16 a, b: one bf16 GEMM accumulating in fp32 on GPUs, the fp32 product elsewhere."""
    return torch.mm(a, b, out_dtype=torch.float32) if a.is_cuda else a.float() @ b.float()


class _Bf16Logits(torch.autograd.Function):
    """x (L, D) @ weight (E, D)ᵀ in fp32 for bf16 x and weight. Forward: the products of two bf16 values are exact
    in fp32, so one bf16 GEMM accumulating in fp32 gives x.float() @ weight.float().t() up to its sums: tensor cores
    add each 16-deep step to the fp32 sum with truncation, so up to (D / 16) · 2^-23 · sum_k |x_k w_k| apart (a
    model of that sum in the router tests: 1.4e-5 at most at D 2048, the fp32 GEMM 1.2e-6). Backward: the fp32
    gradient g goes in as two bf16 terms, hi = bf16(g) and lo = bf16(g - hi), |g - hi - lo| <= 2^-16 |g| (bf16
    keeps 8 bits of 24, and fp32's exponent range): two GEMMs over [hi | lo] instead of two fp32 SIMT GEMMs.
    Keeps x and weight, no fp32 copy."""

    @staticmethod
    def forward(ctx, x_LD, w_ED):
        ctx.save_for_backward(x_LD, w_ED)
        return _mm_fp32(x_LD, w_ED.t())

    @staticmethod
    def backward(ctx, g_LE):
        x_LD, w_ED = ctx.saved_tensors
        g_LE = g_LE.float()
        hi = g_LE.to(torch.bfloat16)
        g2 = torch.cat([hi, (g_LE - hi.float()).to(torch.bfloat16)], dim=1)  # (L, 2E): [hi | lo]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _mm_fp32(g2, torch.cat([w_ED, w_ED])).to(x_LD.dtype)
        if ctx.needs_input_grad[1]:
            dw = _mm_fp32(g2.t(), x_LD).view(2, *w_ED.shape).sum(0).to(w_ED.dtype)
        return dx, dw


def router_logits(x_LD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """(L, E) fp32 logits x @ weightᵀ: through bf16 GEMMs with fp32 accumulation where both are bf16 (see
    _Bf16Logits), else in fp32."""
    if x_LD.dtype == weight_ED.dtype == torch.bfloat16:
        return _Bf16Logits.apply(x_LD, weight_ED)
    return x_LD.float() @ weight_ED.float().t()


def route_topk(logits_LE: torch.Tensor, top_k: int, scoring: str = "softmax_topk", renormalize: bool = True,
               route_scale: float = 1.0, selection_bias: torch.Tensor | None = None, num_groups: int = 1,
               topk_groups: int = 1):
    """(topk_idx int32 (L, K), topk_weights fp32 (L, K)) from logits (L, E) (see the module header; the options
    as RouterConfig's); selection_bias (E,) shifts the choice only.

    Args:
        logits_LE: (L, E) float logits.
        top_k: K, 1 <= K <= E.
        scoring, renormalize, route_scale, num_groups, topk_groups: as moeblaze.RouterConfig's fields.
        selection_bias: (E,) float, added to the scores for the choice only (DeepSeek-V3's expert bias), or None.

    Returns:
        (topk_idx (L, K) int32, topk_weights (L, K) fp32, differentiable in the logits).
    """
    config = RouterConfig(scoring=scoring, renormalize=renormalize, route_scale=route_scale, num_groups=num_groups,
                          topk_groups=topk_groups)
    E = logits_LE.shape[-1]
    check_layer(E, top_k, config)
    if selection_bias is not None and (not isinstance(selection_bias, torch.Tensor) or selection_bias.shape != (E,)
                                       or not selection_bias.is_floating_point()
                                       or selection_bias.device != logits_LE.device):
        raise ValueError(f"selection_bias must be a float tensor of shape ({E},) (one per expert) on "
                         f"{logits_LE.device}, got " + (f"{tuple(selection_bias.shape)} {selection_bias.dtype} on "
                                                       f"{selection_bias.device}" if isinstance(selection_bias,
                                                                                                 torch.Tensor)
                                                       else type(selection_bias).__name__))
    return _select(logits_LE, top_k, config, selection_bias)


def _select(logits_LE: torch.Tensor, top_k: int, config: RouterConfig, selection_bias: torch.Tensor | None):
    """route_topk after its checks."""
    scoring = config.scoring
    logits_LE = logits_LE.float()
    scores = logits_LE if scoring == "topk_softmax" else (
        logits_LE.softmax(dim=-1) if scoring == "softmax_topk" else logits_LE.sigmoid())
    sel = scores if selection_bias is None else scores + selection_bias.float()
    if config.num_groups > 1:
        sel = _group_mask(sel, config.num_groups, config.topk_groups)
    idx = sel.topk(top_k, dim=-1).indices
    w = scores.gather(1, idx)
    if scoring == "topk_softmax":
        w = w.softmax(dim=-1)
    elif config.renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + (1e-20 if scoring == "sigmoid_topk" else 0.0))
    if config.route_scale != 1.0:
        w = w * config.route_scale
    return idx.to(torch.int32), w


def balance_probs(logits_LE: torch.Tensor, scoring: str = "softmax_topk") -> torch.Tensor:
    """P (L, E): each token's scores normalized to sum to 1 (softmax probabilities; sigmoid scores over their
    sum), what the balancing losses weigh."""
    logits_LE = logits_LE.float()
    if scoring == "sigmoid_topk":
        s = logits_LE.sigmoid()
        return s / (s.sum(dim=-1, keepdim=True) + 1e-20)
    return logits_LE.softmax(dim=-1)


def switch_aux_loss(logits_LE: torch.Tensor, topk_idx_LK: torch.Tensor, scoring: str = "softmax_topk",
                    counts_E: torch.Tensor | None = None, pairs: torch.Tensor | float | None = None) -> torch.Tensor:
    """E * sum_e f_e * P_e; gradients flow through P, as in Switch Transformer. counts_E and pairs (detached)
    replace this micro-batch's counts and pair count where given (the global-batch loss)."""
    L, E = logits_LE.shape
    probs_mean_E = balance_probs(logits_LE, scoring).sum(dim=0) / max(L, 1)  # 0, not NaN, at L = 0
    if counts_E is None:
        counts_E, pairs = count_per_expert(topk_idx_LK, E).float(), float(topk_idx_LK.numel())
    frac_E = counts_E.float() / (pairs.clamp(min=1) if isinstance(pairs, torch.Tensor) else max(pairs, 1))
    return E * (frac_E * probs_mean_E).sum()


def sequence_aux_loss(logits_LE: torch.Tensor, topk_idx_LK: torch.Tensor, seq_len: int,
                      scoring: str = "softmax_topk") -> torch.Tensor:
    """The switch loss of each sequence (seq_len consecutive tokens), averaged over the sequences."""
    L, E = logits_LE.shape
    if L % seq_len:
        raise ValueError(f"the sequence loss needs whole sequences: {L} tokens is not a multiple of {seq_len}")
    n, K = L // seq_len, topk_idx_LK.shape[1]
    probs_NE = balance_probs(logits_LE, scoring).view(n, seq_len, E).mean(dim=1)
    onehot = torch.zeros(n, seq_len * K, E, device=logits_LE.device)
    onehot.scatter_(2, topk_idx_LK.long().reshape(n, seq_len * K, 1), 1.0)
    frac_NE = onehot.sum(dim=1) / (seq_len * K)
    return E * (frac_NE * probs_NE).sum() / max(n, 1)


def router_z_loss(logits_LE: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits_LE.float(), dim=-1).square().sum() / max(logits_LE.shape[0], 1)


class TopKRouter(nn.Module):
    """x (L, D) -> RouterOutput (see the module header). weight (E, D); `bias` (E,) with gate_bias; the buffers
    expert_bias and expert_load (E,) with expert_bias.

    Args:
        d_model, num_experts, top_k: the input width, the experts, the experts per token.
        config: the moeblaze.RouterConfig (scoring, renormalization, scale, biases, groups, balancing loss; None:
            the default).
        aux_group: the process group the "global" loss sums over.
        device, dtype: of the parameters.

    Returns:
        forward(x (L, D), seq_len=None) -> RouterOutput: topk_idx (L, K) int32, topk_weights (L, K) fp32,
        aux_loss and z_loss fp32 scalars, logits (L, E) fp32.
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, *, config: RouterConfig | None = None,
                 aux_group=None, device=None, dtype=None):
        super().__init__()
        check_int("d_model", d_model)
        config = check_config("config", config, RouterConfig) or RouterConfig()
        check_layer(num_experts, top_k, config)
        self.config, self.num_experts, self.top_k, self.aux_group = config, num_experts, top_k, aux_group
        self.weight = nn.Parameter(torch.empty(num_experts, d_model, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=d_model ** -0.5)
        self.bias = nn.Parameter(torch.zeros(num_experts, device=device, dtype=dtype)) if config.gate_bias else None
        if config.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device))
            self.register_buffer("expert_load", torch.zeros(num_experts, device=device))
        else:
            self.expert_bias = self.expert_load = None

    def forward(self, x_LD: torch.Tensor, seq_len: int | None = None) -> RouterOutput:
        """seq_len: tokens per sequence (x's rows are whole sequences, one after another); the "sequence" loss
        needs it."""
        D = self.weight.shape[1]
        if not isinstance(x_LD, torch.Tensor) or x_LD.dim() != 2 or x_LD.shape[1] != D or not x_LD.is_floating_point():
            raise ValueError(f"the router takes x of shape (L, {D}), float, got "
                             f"{tuple(x_LD.shape) if isinstance(x_LD, torch.Tensor) else type(x_LD).__name__}"
                             + (f" {x_LD.dtype}" if isinstance(x_LD, torch.Tensor) else ""))
        if seq_len is not None and (x_LD.shape[0] or seq_len):  # an empty batch of any shape: (B, 0, D) too
            if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1 or x_LD.shape[0] % seq_len:
                raise ValueError(f"seq_len must be a positive int dividing the {x_LD.shape[0]} tokens, got {seq_len!r}")
        logits_LE = router_logits(x_LD, self.weight)
        if self.bias is not None:
            logits_LE = logits_LE + self.bias.float()
        idx, w = _select(logits_LE, self.top_k, self.config, self.expert_bias)
        if self.expert_load is not None and self.training:
            self.expert_load += count_per_expert(idx, self.num_experts).float()
        return RouterOutput(idx, w, self._aux(logits_LE, idx, seq_len), router_z_loss(logits_LE), logits_LE)

    def _aux(self, logits_LE, idx, seq_len):
        if self.config.aux_loss == "none":
            return logits_LE.sum() * 0.0
        if self.config.aux_loss == "sequence":
            if seq_len is None:
                raise ValueError('aux_loss="sequence" needs forward(x, seq_len=...) (the layer passes it)')
            return sequence_aux_loss(logits_LE, idx, seq_len, self.config.scoring)
        if self.config.aux_loss == "global" and dist.is_available() and dist.is_initialized():
            both = torch.cat([count_per_expert(idx, self.num_experts).float(),
                              torch.tensor([float(idx.numel())], device=idx.device)])
            dist.all_reduce(both, group=self.aux_group)
            return switch_aux_loss(logits_LE, idx, self.config.scoring, both[:-1], both[-1])
        return switch_aux_loss(logits_LE, idx, self.config.scoring)

    @torch.no_grad()
    def update_expert_bias(self, group=None) -> torch.Tensor | None:
        """Once per optimizer step (after it): move expert_bias by rate · sign(mean load − load), centred, from
        the loads counted since the last update (summed over `group`'s ranks when distributed; every rank then
        applies the same update), and restart the count. Returns the loads used (None without expert_bias)."""
        if self.expert_load is None:
            return None
        load = self.expert_load.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(load, group=group)
        delta = self.config.expert_bias_rate * torch.sign(load.mean() - load)
        self.expert_bias += delta - delta.mean()
        self.expert_load.zero_()
        return load

    def extra_repr(self) -> str:
        c = self.config
        extra = "".join(f", {k}={v}" for k, v in (("route_scale", c.route_scale), ("num_groups", c.num_groups),
                                                  ("topk_groups", c.topk_groups)) if v != 1)
        return (f"d_model={self.weight.shape[1]}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"scoring={self.config.scoring}, aux_loss={self.config.aux_loss}{extra}"
                + (", gate_bias" if self.bias is not None else "")
                + (f", expert_bias(rate={self.config.expert_bias_rate})" if self.expert_bias is not None else ""))


def update_expert_biases(model: nn.Module, group=None) -> int:
    """update_expert_bias() on every router of the model that has an expert bias; how many.

    Args:
        model: any nn.Module; its TopKRouters with an expert bias are updated.
        group: the process group their loads are summed over (None: the world, where distributed).

    Returns:
        The number of routers updated.
    """
    n = 0
    for m in model.modules():
        if isinstance(m, TopKRouter) and m.expert_bias is not None:
            m.update_expert_bias(group)
            n += 1
    return n
