"""The pure PyTorch oracle for the expert computation of an MoE layer.

    y[t] = sum_k topk_w[t, k] * (W2[e] act(W1[e] x[t] + b1[e]) + b2[e]),   e = topk_idx[t, k]

(the biases b1, b2 are optional).

Gathers every expert's tokens at once, loops over experts, and accumulates the weighted expert outputs in fp32
(or fp64 for fp64 inputs). Differentiable in x, w1, w2 and topk_w through autograd. It is the
reference every kernel is checked against, and is slow and memory-hungry by design: it keeps every
intermediate for backward and synchronizes with the host (one nonzero per expert).

Both take the experts' recipe (moeblaze.ExpertsConfig) as the kernels do; the reference follows what changes the
arithmetic (activation, checkpoint="preact-fp8", precision="fp8") and ignores what does not (backend,
chunk_tokens, index_method, fp8_weight_cache, checkpoint="preact" against "recompute": it keeps what autograd needs).

checkpoint="preact-fp8": the forward is unchanged, and backward reads the
pre-activation H = x W1ᵀ + b1 back from e4m3 with 1 x 128 scales (reference.fp8), as the kernels keep it: dH, the
s·A of dW2 and the router weights' gradient dS = <dy, A W2ᵀ + b2> all come from act(fake_quant_rows(H)).

precision="fp8" is emulated (DeepSeek-V3's recipe, reference.fp8's quantizers, fp32 accumulation): the
four data GEMMs read e4m3 operands, x and dy by token (1 x 128 groups along d), A and dH by row (1 x 128 along h and
F), W1 and W2 by 128 x 128 blocks (one grid serves W and Wᵀ); the weight gradients dW1 = dHᵀ x and dW2 = dyᵀ (s·A)
(of input-precision operands, in the weights' dtype: float32 for master weights) and everything else (SwiGLU,
dS = <dA', A> + <dy, b2>, the combines) stay in the input precision. It tells the format's error from a kernel's.

Legend: L tokens, D hidden, H expert intermediate, E experts, K experts per token.
"""
from __future__ import annotations

import torch

from ..configs import DEFAULT, ExpertsConfig, from_legacy
from .activations import apply_activation
from .fp8 import fake_quant_blocks, fake_quant_rows



def _config(where: str, b1, experts: ExpertsConfig, legacy: dict) -> ExpertsConfig:
    """The call's config (0.1's keyword options accepted with a DeprecationWarning); TypeError for options passed
    positionally or a config of another type."""
    if isinstance(b1, str):
        raise TypeError(f"{where}(x, topk_idx, topk_weights, w1, w2, b1=None, b2=None, *, experts=ExpertsConfig(...)): "
                        f"the options go in experts, not positionally (got {b1!r} for b1)")
    return from_legacy(where, experts, legacy, stacklevel=4)  # (called from the public function's _config)


def moe_experts_reference(x_LD: torch.Tensor, topk_idx_LK: torch.Tensor, topk_w_LK: torch.Tensor,
                          w1_EFD: torch.Tensor, w2_EDH: torch.Tensor, b1_EF: torch.Tensor | None = None,
                          b2_ED: torch.Tensor | None = None, *, experts: ExpertsConfig = DEFAULT,
                          interleaved: bool = False, **legacy) -> torch.Tensor:
    """Expert outputs combined per token, in plain PyTorch: what moe_experts computes, for checks and the CPU.

    Args:
        x_LD: (L, D) tokens, any float dtype.
        topk_idx_LK: (L, K) integer expert ids.
        topk_w_LK: (L, K) router weights, any float dtype.
        w1_EFD: (E, F, D), F = 2H (gate rows, then up rows; alternating where interleaved) for gated
            activations, F = H otherwise.
        w2_EDH: (E, D, H).
        b1_EF, b2_ED: optional biases, in w1's and w2's row order.
        experts: a moeblaze.ExpertsConfig (its activation; precision="fp8" (where fp8_min_rows lets it run: as
            moe_experts) and "preact-fp8" are emulated).
        interleaved: gate and up rows of w1 alternate.

    Returns:
        (L, D) in x's dtype, differentiable in x, the weights, topk_w and the biases.
    """
    config = _config("moe_experts_reference", b1_EF, experts, legacy).at_call(*topk_idx_LK.shape, w1_EFD.shape[0])
    activation, fp8_gemms = config.activation, config.fp8
    preact_fp8 = config.checkpoint == "preact-fp8"
    L, D = x_LD.shape
    E = w1_EFD.shape[0]
    acc_dtype = torch.float64 if x_LD.dtype == torch.float64 else torch.float32
    # unbind, not w[e]: one backward node stacks the experts' weight gradients (indexing would zero-fill a whole
    # gradient per expert). Experts without tokens are not skipped: they add nothing, keep an empty batch in the
    # autograd graph (zero gradients) and leave no data-dependent branch to break torch.compile's graph.
    w1s, w2s = w1_EFD.unbind(0), w2_EDH.unbind(0)
    b1s = (None,) * E if b1_EF is None else b1_EF.unbind(0)
    b2s = (None,) * E if b2_ED is None else b2_ED.unbind(0)
    # Each expert's (token, slot) pairs, then one gather of x for all of them (one backward scatter, not E).
    pairs = [(topk_idx_LK == e).nonzero(as_tuple=True) for e in range(E)]
    toks = [tok for tok, _ in pairs]
    xs = x_LD[torch.cat(toks)].split([len(tok) for tok in toks])
    out_LD = x_LD.new_zeros((L, D), dtype=acc_dtype)
    for e, ((tok_e, slot_e), x_e) in enumerate(zip(pairs, xs)):
        s_e = topk_w_LK[tok_e, slot_e]
        if fp8_gemms:
            out_LD.index_add_(0, tok_e, _Fp8GemmExpert.apply(x_e, w1s[e], w2s[e], b1s[e], b2s[e], s_e, activation,
                                                              interleaved, acc_dtype, preact_fp8))
            continue
        h = x_e @ w1s[e].t()
        if b1s[e] is not None:
            h = h + b1s[e]
        if preact_fp8:
            out_LD.index_add_(0, tok_e, _TailFromFp8Preact.apply(h, w2s[e], b2s[e], s_e, activation, interleaved,
                                                                  acc_dtype))
            continue
        y = apply_activation(h, activation, interleaved) @ w2s[e].t()
        if b2s[e] is not None:
            y = y + b2s[e]
        out_LD.index_add_(0, tok_e, y.to(acc_dtype) * s_e[:, None].to(acc_dtype))
    return out_LD.to(x_LD.dtype)


class _TailFromFp8Preact(torch.autograd.Function):
    """w · (act(H) W2ᵀ + b2) for one expert's rows, whose backward differentiates it at fake_quant_rows(H): the
    pre-activation as checkpoint="preact-fp8" keeps it."""

    @staticmethod
    def forward(ctx, h, w2, b2, w, activation, interleaved, acc_dtype):
        ctx.activation, ctx.interleaved, ctx.acc_dtype, ctx.has_b2 = activation, interleaved, acc_dtype, b2 is not None
        ctx.save_for_backward(fake_quant_rows(h).to(h.dtype), w2, *(() if b2 is None else (b2,)), w)
        return _tail(h, w2, b2, w, activation, interleaved, acc_dtype)

    @staticmethod
    def backward(ctx, g):
        hq, w2, *rest = ctx.saved_tensors
        b2, w = (rest[0], rest[1]) if ctx.has_b2 else (None, rest[0])
        leaves = [t.detach().requires_grad_() for t in (hq, w2, w)]
        b2l = None if b2 is None else b2.detach().requires_grad_()
        with torch.enable_grad():
            out = _tail(leaves[0], leaves[1], b2l, leaves[2], ctx.activation, ctx.interleaved, ctx.acc_dtype)
            grads = torch.autograd.grad(out, leaves + ([b2l] if b2l is not None else []), g)
        dh, dw2, dw = grads[:3]
        return dh, dw2, grads[3] if b2l is not None else None, dw, None, None, None


class _Fp8GemmExpert(torch.autograd.Function):
    """One expert's weighted output rows, w · (act(x W1ᵀ + b1) W2ᵀ + b2), with fp8_gemms's arithmetic (see the
    module header) in forward and backward; H kept as is, or through e4m3 where preact_fp8."""

    @staticmethod
    def forward(ctx, x, w1, w2, b1, b2, w, activation, interleaved, acc_dtype, preact_fp8):
        dt = x.dtype
        w1q, w2q = fake_quant_blocks(w1).to(dt), fake_quant_blocks(w2).to(dt)
        h = fake_quant_rows(x).to(dt) @ w1q.t()
        if b1 is not None:
            h = h + b1
        a = apply_activation(h, activation, interleaved)
        y = fake_quant_rows(a).to(dt) @ w2q.t()
        if b2 is not None:
            y = y + b2
        ctx.activation, ctx.interleaved, ctx.acc_dtype, ctx.w_dtype = activation, interleaved, acc_dtype, w1.dtype
        ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
        kept = fake_quant_rows(h).to(dt) if preact_fp8 else h
        ctx.save_for_backward(x, w1q, w2q, kept, w, *(() if b2 is None else (b2,)))
        return y.to(acc_dtype) * w[:, None].to(acc_dtype)

    @staticmethod
    def backward(ctx, g):
        x, w1q, w2q, h, w, *b2 = ctx.saved_tensors
        dt = x.dtype
        dy = g.to(dt)
        with torch.enable_grad():
            hl = h.detach().requires_grad_()
            a = apply_activation(hl, ctx.activation, ctx.interleaved)
        da = fake_quant_rows(dy).to(dt) @ w2q  # dA' = dy W2, e4m3 operands
        ds = (da * a.detach()).sum(1) + ((dy * b2[0]).sum(1) if b2 else 0)
        (dh,) = torch.autograd.grad(a, hl, da * w[:, None].to(dt))
        dx = fake_quant_rows(dh).to(dt) @ w1q  # dX~ = dH W1, e4m3 operands
        sa = a.detach() * w[:, None].to(dt)
        # the weight gradients from the input-precision operands, summed and returned in the weights' dtype (float32
        # for master weights: the kernels store their float32 sums; else the input precision)
        wd = ctx.w_dtype
        dw1 = dh.t().to(wd) @ x.to(wd)
        dw2 = dy.t().to(wd) @ sa.to(wd)
        db1 = dh.sum(0) if ctx.has_b1 else None
        db2 = (dy * w[:, None].to(dt)).sum(0) if ctx.has_b2 else None
        return dx, dw1, dw2, db1, db2, ds.to(w.dtype), None, None, None, None


def _tail(h, w2, b2, w, activation, interleaved, acc_dtype):
    y = apply_activation(h, activation, interleaved) @ w2.t()
    if b2 is not None:
        y = y + b2
    return y.to(acc_dtype) * w[:, None].to(acc_dtype)


def moe_experts_dense(x_LD: torch.Tensor, topk_idx_LK: torch.Tensor, topk_w_LK: torch.Tensor, w1_EFD: torch.Tensor,
                      w2_EDH: torch.Tensor, b1_EF: torch.Tensor | None = None, b2_ED: torch.Tensor | None = None, *,
                      experts: ExpertsConfig = DEFAULT, interleaved: bool = False, **legacy) -> torch.Tensor:
    """The same function computed token by token with every expert's weights gathered per pair: an
    independent second oracle (O(L·K·F·D) weight memory), for tiny sizes in tests only. Native precision only.

    Args:
        x_LD, topk_idx_LK, topk_w_LK, w1_EFD, w2_EDH, b1_EF, b2_ED: as moe_experts_reference takes them.
        experts: the moeblaze.ExpertsConfig (native precision).
        interleaved: W1's gate and up rows alternate.

    Returns:
        (L, D) in x's dtype.
    """
    config = _config("moe_experts_dense", b1_EF, experts, legacy)
    if config.fp8 or config.checkpoint == "preact-fp8":
        raise ValueError("moe_experts_dense computes native precision only: use moe_experts_reference for the fp8 "
                         "emulation")
    activation = config.activation
    w1 = w1_EFD[topk_idx_LK.long()]  # (L, K, F, D)
    w2 = w2_EDH[topk_idx_LK.long()]  # (L, K, D, H)
    h = torch.einsum("lkfd,ld->lkf", w1, x_LD)
    if b1_EF is not None:
        h = h + b1_EF[topk_idx_LK.long()]
    y = torch.einsum("lkdh,lkh->lkd", w2, apply_activation(h, activation, interleaved))
    if b2_ED is not None:
        y = y + b2_ED[topk_idx_LK.long()]
    return torch.einsum("lkd,lk->ld", y, topk_w_LK.to(y.dtype)).to(x_LD.dtype)
