"""End-to-end training of transformers MoE models on each experts backend (`moeblaze bench --hf`).

Models are built from their published configs (the values below; no download) with random weights and fewer
layers (LAYERS) so that one H200 holds them with AdamW. Each backend trains the same model (same seed, same
batches) for warmup + timed steps: tokens/s, peak memory, the loss after the last step, and the experts' share of
the step, measured against the same model whose experts compute nothing (the "skip" backend: zeros, and zero
gradients for the experts' weights, so the router, attention, embeddings and the optimizer over every parameter
cost what they cost). Then the largest batch (× seq) that still trains one step: doubling until out of memory,
and one step between the last fit and the first failure. With `profile`, one more step per backend under
torch.profiler: the GPU's busy time (the kernels' time) against the step's wall time (where they differ, the
host is the limit) and the kernels that take the most.

Memory: one model, its gradients and AdamW state at a time (freed between backends).
"""
from __future__ import annotations

import gc
import time

import torch

LAYERS = {"qwen3-30b-a3b": 12, "olmoe-1b-7b": 16, "mixtral-8x7b": 2, "gpt-oss-20b": 6}


def model_config(name: str, layers: int | None = None):
    """The published config of `name` (hidden sizes, experts, heads, vocabulary) with `layers` layers."""
    import transformers as T

    n = layers or LAYERS[name]
    if name == "qwen3-30b-a3b":
        return T.Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=n,
                                num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                max_position_embeddings=40960, rms_norm_eps=1e-6,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if name == "olmoe-1b-7b":
        return T.OlmoeConfig(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_experts=64,
                             num_experts_per_tok=8, num_hidden_layers=n, num_attention_heads=16,
                             num_key_value_heads=16, max_position_embeddings=4096)
    if name == "mixtral-8x7b":
        return T.MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                               num_experts_per_tok=2, num_hidden_layers=n, num_attention_heads=32,
                               num_key_value_heads=8, max_position_embeddings=32768,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if name == "gpt-oss-20b":
        return T.GptOssConfig(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                              num_experts_per_tok=4, num_hidden_layers=n, num_attention_heads=64,
                              num_key_value_heads=8, head_dim=64, sliding_window=128,
                              layer_types=(["sliding_attention", "full_attention"] * n)[:n])
    raise ValueError(f"unknown model {name!r}; one of {tuple(LAYERS)}")


def _skip_experts(module, hidden_states, top_k_index, top_k_weights):
    """The "skip" backend: zeros, with zero gradients for the experts' parameters, so that the optimizer updates
    them as on any other backend and the step differs only by the experts' computation."""
    zero = sum(p.sum() for p in module.parameters(recurse=False)) * 0
    return torch.zeros_like(hidden_states) + zero.to(hidden_states.dtype)


def _sonicmoe_experts(module, hidden_states, top_k_index, top_k_weights):
    """SonicMoE's moe_general_routing_inputs on an experts module in transformers' default layout with SwiGLU
    (gate rows first, no biases); anything else raises rather than computing another function."""
    from ..integrations.transformers import activation_of

    spec, reason = activation_of(module)
    if reason is not None or spec != ("swiglu", False) or getattr(module, "has_bias", False) or \
            getattr(module, "is_transposed", False):
        raise NotImplementedError(f"the SonicMoE adapter takes SwiGLU experts in the default layout only "
                                  f"({reason or spec})")
    import sonicmoe
    from sonicmoe.enums import ActivationType

    T, K = top_k_index.shape
    tokens = torch.arange(T, device=hidden_states.device, dtype=torch.int32).repeat_interleave(K)
    out, _ = sonicmoe.moe_general_routing_inputs(
        hidden_states, top_k_weights.reshape(-1).float(), tokens, top_k_index.reshape(-1).int(),
        module.gate_up_proj.permute(1, 2, 0), None, module.down_proj.permute(1, 2, 0), None, module.num_experts,
        torch.cuda.current_stream().cuda_stream, ActivationType.SWIGLU, False, True)
    return out.to(hidden_states.dtype)


def _register_backends() -> None:
    """The skip backend and the SonicMoE adapter, as transformers experts implementations."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register("skip", _skip_experts)
    ExpertsInterface.register("sonicmoe-adapter", _sonicmoe_experts)


def _implementation(backend: str) -> tuple[str, str | None]:
    """(transformers' experts_implementation, moeblaze's checkpoint policy or None)."""
    if backend.startswith("moeblaze-"):
        return "moeblaze", backend.split("-", 1)[1]
    return backend, None


def build(name: str, backend: str, layers: int | None, device: torch.device, seed: int = 0):
    """The model in bf16 on device, its weights drawn from seed, on backend's experts implementation."""
    import transformers

    import moeblaze.integrations.transformers as mbt
    from moeblaze import ExpertsConfig

    implementation, policy = _implementation(backend)
    torch.manual_seed(seed)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(model_config(name, layers), dtype=torch.bfloat16,
                                                              experts_implementation=implementation)
    if policy is not None:
        mbt.configure(model, ExpertsConfig(checkpoint=policy))
    model.train()
    return model


def adamw(model, lr: float = 1e-4) -> torch.optim.AdamW:
    """AdamW, fused on CUDA (one kernel over all parameters: the foreach form took ~half of Qwen3-30B-A3B's step
    at 12 layers and batch 1 on an H200)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, fused=next(model.parameters()).is_cuda)


def _batches(vocab: int, batch: int, seq: int, n: int, device: torch.device, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), device=device, generator=g) for _ in range(n)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model, opt, ids) -> torch.Tensor:
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def train_run(name: str, backend: str, layers: int | None, batch: int, seq: int, warmup: int, steps: int,
              device: torch.device, *, lr: float = 1e-4) -> dict:
    """Train warmup + steps steps; the timed steps' tokens/s and step time, peak memory, the losses."""
    model = build(name, backend, layers, device)
    opt = adamw(model, lr)
    data = _batches(model.config.vocab_size, batch, seq, warmup + steps, device)
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for ids in data[:warmup]:
            _step(model, opt, ids)
        _sync(device)
        t0 = time.perf_counter()
        losses = [_step(model, opt, ids) for ids in data[warmup:]]
        _sync(device)
        step_s = (time.perf_counter() - t0) / steps
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        return dict(step_ms=step_s * 1e3, tokens_per_s=batch * seq / step_s, peak_gb=peak, loss=float(losses[-1]),
                    losses=[round(float(v), 4) for v in losses], status="ok")
    finally:
        del model, opt, data
        _free()


def profile_step(name: str, backend: str, layers: int | None, batch: int, seq: int, device: torch.device,
                 top: int = 12) -> dict:
    """One step (after two warmup steps) under torch.profiler: wall ms, kernels' busy ms, the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    model = build(name, backend, layers, device)
    opt = adamw(model)
    data = _batches(model.config.vocab_size, batch, seq, 3, device)
    try:
        for ids in data[:2]:
            _step(model, opt, ids)
        _sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            _step(model, opt, data[2])
            _sync(device)
            wall = (time.perf_counter() - t0) * 1e3
        kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not getattr(e, "is_user_annotation", False) and "#" not in e.key]  # ranges, not kernels
        kernels.sort(key=lambda e: -e.self_device_time_total)
        busy = sum(e.self_device_time_total for e in kernels) / 1e3
        return dict(wall_ms=wall, busy_ms=busy, top=[(e.key[:90], round(e.self_device_time_total / 1e3, 2), e.count)
                                                     for e in kernels[:top]])
    finally:
        del model, opt, data
        _free()


def _fits(model, opt, batch: int, seq: int, device: torch.device) -> bool:
    """Whether one AdamW step at this batch trains without running out of memory."""
    try:
        _step(model, opt, _batches(model.config.vocab_size, batch, seq, 1, device)[0])
        _sync(device)
        return True
    except Exception as e:
        if not _oom(e):
            raise
        opt.zero_grad(set_to_none=True)
        _free()
        return False


def max_batch(name: str, backend: str, layers: int | None, seq: int, start: int, limit: int,
              device: torch.device) -> int:
    """The largest batch (sequences of seq tokens) that trains one AdamW step: from start, doubling until out of
    memory or past limit, then one bisection step (1.5x the last fit); 0 where even start does not fit."""
    model = build(name, backend, layers, device)
    opt = adamw(model)
    try:
        best, b = 0, start
        while b <= limit and _fits(model, opt, b, seq, device):
            best, b = b, 2 * b
        mid = best + best // 2
        if best >= 2 and mid <= limit and _fits(model, opt, mid, seq, device):
            best = mid
        return best
    finally:
        del model, opt
        _free()


def run_model(name: str, backends, layers: int | None, batch: int, seq: int, warmup: int, steps: int, *,
              find_max: bool, max_limit: int, device: torch.device, report=None, profile: bool = False
              ) -> list[dict]:
    """One model on every backend: the skip backend's row first, then a row per backend (its experts' share
    against the skip backend's step), each handed to report (when given) as soon as it is measured."""
    _register_backends()
    base = dict(model=name, layers=layers or LAYERS[name], batch=batch, seq=seq, steps=steps)
    skip = dict(base, backend="skip", **train_run(name, "skip", layers, batch, seq, warmup, steps, device))
    rows = [skip]
    if report:
        report(skip)
    for backend in backends:
        row = dict(base, backend=backend)
        try:
            row.update(train_run(name, backend, layers, batch, seq, warmup, steps, device))
            row["experts_share"] = max(0.0, 1 - skip["step_ms"] / row["step_ms"])
        except Exception as e:  # one backend's failure is its row's status, never the run's end
            _free()
            row["status"] = _status(e)
        if find_max and row["status"] == "ok":
            try:
                row["max_batch"] = max_batch(name, backend, layers, seq, batch, max_limit, device)
            except Exception as e:
                _free()
                row["max_batch_status"] = _status(e)
        if profile and row["status"] == "ok":
            row["profile"] = profile_step(name, backend, layers, batch, seq, device)
        rows.append(row)
        if report:
            report(row)
    return rows


def _status(e: BaseException) -> str:
    return "oom" if _oom(e) else f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"


def format_row(r: dict) -> str:
    if r.get("status") != "ok":
        return f"  {r['model']:>14} {r['backend']:>18} | {r.get('status')}"
    if r["backend"] == "skip":
        return f"  {r['model']:>14} {'skip (no experts)':>18} | step {r['step_ms']:8.1f} ms"
    mb, peak = r.get("max_batch"), r.get("peak_gb")
    return (f"  {r['model']:>14} {r['backend']:>18} | {r['tokens_per_s']:>9.0f} tok/s | step {r['step_ms']:8.1f} ms"
            + (f" | peak {peak:6.1f} GB" if peak is not None else "")
            + f" | experts {100 * r.get('experts_share', 0):5.1f}% | loss {r['loss']:.4f}"
            + (f" | max batch {mb} x {r['seq']}" if mb is not None else "")
            + (f" | profiled step {r['profile']['wall_ms']:.1f} ms, GPU busy {r['profile']['busy_ms']:.1f} ms"
               if r.get("profile") else ""))


def markdown(rows: list[dict]) -> str:
    """The results table (README): per model, each backend's tokens/s, its ratio to grouped_mm, peak memory, the
    experts' share, the final loss and the largest batch."""
    out = ["| model (layers) | backend | tokens/s | vs grouped_mm | peak GB | experts share | loss | max batch × seq |",
           "|---|---|---|---|---|---|---|---|"]
    gmm = {r["model"]: r for r in rows if r["backend"] == "grouped_mm" and r.get("status") == "ok"}
    for r in rows:
        if r["backend"] == "skip":
            continue
        head = f"| {r['model']} ({r['layers']}) | {r['backend']} |"
        if r.get("status") != "ok":
            out.append(head + f" {r.get('status')} | | | | | |")
            continue
        ratio = r["tokens_per_s"] / gmm[r["model"]]["tokens_per_s"] if r["model"] in gmm else None
        mb = f"{r['max_batch']} × {r['seq']}" if r.get("max_batch") is not None else "-"
        peak = "-" if r.get("peak_gb") is None else f"{r['peak_gb']:.1f}"
        out.append(head + f" {r['tokens_per_s']:.0f} | {'-' if ratio is None else f'{ratio:.2f}x'} | "
                   f"{peak} | {100 * r['experts_share']:.0f}% | {r['loss']:.4f} | {mb} |")
    return "\n".join(out)
