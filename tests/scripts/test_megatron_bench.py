"""benchmarks/megatron_bench.py's grouped-GEMM baseline on the CPU: Megatron's own GroupedMLP with its grouped_gemm
hook served by torch._grouped_mm computes Megatron's SequentialMLP layer (the same weights, laid out as GroupedMLP
keeps them): output, dx and every gradient within twice Megatron's own bf16 error against its layer in fp64."""
import contextlib
import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers import assert_within_torch_error, run_ranks  # noqa: E402
import megatron_cpu as mc  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import megatron_bench  # noqa: E402  (outside the package)


def _as_grouped(layer, E, grad: bool):
    """SequentialMLP's expert weights (or their gradients) as GroupedMLP keeps them: expert e's fc1 transposed at
    weight1.view(E, hidden, 2F)[e], its fc2 transposed at weight2.view(E, F, hidden)[e]."""
    experts = layer.experts.local_experts
    fc1, fc2 = ([getattr(e, name).weight.grad if grad else getattr(e, name).weight for e in experts]
                for name in ("linear_fc1", "linear_fc2"))
    w1, w2 = torch.stack([w.t() for w in fc1]), torch.stack([w.t() for w in fc2])
    return w1.reshape(w1.shape[1], -1), w2.reshape(-1, w2.shape[2])


def _sequential_grads(layer, E):
    return (layer.router.weight.grad, *_as_grouped(layer, E, grad=True))


def _grouped_equals_sequential(rank, world, found):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    mc.init()
    try:
        megatron_bench.grouped_gemm_on_torch()
        bf16 = dict(bf16=True, params_dtype=torch.bfloat16)
        config = mc.transformer_config(**bf16)
        E = config.num_moe_experts
        stock = mc.build(mc.stock_mlp(E), config, seed=0)
        grouped = mc.build(get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=True).submodules.mlp,
                           mc.transformer_config(moe_grouped_gemm=True, **bf16), seed=1)
        assert type(grouped.experts).__name__ == "GroupedMLP", type(grouped.experts)
        exact = mc.build(mc.stock_mlp(E), mc.transformer_config(), seed=2).double()
        exact.load_state_dict({k: v.double() if torch.is_tensor(v) else v for k, v in stock.state_dict().items()})
        with torch.no_grad():
            grouped.router.weight.copy_(stock.router.weight)
            w1, w2 = _as_grouped(stock, E, grad=False)
            grouped.experts.weight1.copy_(w1)
            grouped.experts.weight2.copy_(w2)
        g = torch.Generator().manual_seed(3)
        x, dout = (torch.randn(12, 2, config.hidden_size, generator=g, dtype=torch.float64) for _ in range(2))
        want = mc.layer_step(exact, x, dout, torch.float64)[:2] + _sequential_grads(exact, E)
        same = mc.layer_step(stock, x, dout, torch.bfloat16)[:2] + _sequential_grads(stock, E)
        got = mc.layer_step(grouped, x, dout, torch.bfloat16)[:2] + (
            grouped.router.weight.grad, grouped.experts.weight1.grad, grouped.experts.weight2.grad)
        for name, a, b, w in zip(("out", "dx", "router", "fc1", "fc2"), got, same, want):
            try:
                assert_within_torch_error(a, b, w)
            except AssertionError as e:
                found.put((rank, name, str(e)))
    finally:
        mc.destroy()


def test_grouped_gemm_baseline_computes_megatrons_sequential_layer():
    try:
        from megatron.core.transformer.moe.experts import GroupedMLP  # noqa: F401
    except ImportError:
        pytest.skip("megatron-core 0.17 removed GroupedMLP, the baseline this checks (megatron_bench refuses it)")
    run_ranks(_grouped_equals_sequential, 1)


def _flash_equals_local(rank, world, found):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    import megatron.core.fusions.fused_softmax as fused_softmax

    from megatron.core import tensor_parallel

    mc.init()
    real_mask = fused_softmax.get_default_causal_mask  # Megatron makes its causal mask on CUDA
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()
    tracker = tensor_parallel.get_cuda_rng_tracker()  # and forks its CUDA generator around the (here no) dropout
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        config = mc.transformer_config(num_attention_heads=4, num_query_groups=2, kv_channels=8, attention_dropout=0.0)
        made = {}
        for name, cls in (("local", DotProductAttention), ("flash", megatron_bench.flash_attention())):
            made[name] = cls(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                             attention_type="self").eval()
        g = torch.Generator().manual_seed(4)
        s, b = 12, 2
        qkv = [torch.randn(s, b, n, 8, generator=g, dtype=torch.float64) for n in (4, 2, 2)]
        dout = torch.randn(s, b, 32, generator=g, dtype=torch.float64)

        def step(layer, dtype):
            ins = [t.to(dtype).clone().requires_grad_() for t in qkv]
            out = layer(*ins, attention_mask=None)
            out.backward(dout.to(dtype))
            return [out.detach(), *(t.grad for t in ins)]
        exact, same, got = step(made["local"], torch.float64), step(made["local"], torch.float32), step(
            made["flash"], torch.float32)
        for what, a, b_, w in zip(("out", "dq", "dk", "dv"), got, same, exact):
            try:
                assert_within_torch_error(a, b_, w)
            except AssertionError as e:
                found.put((rank, what, str(e)))
        try:
            made["flash"](*qkv, attention_mask=torch.ones(s, s, dtype=torch.bool))
            found.put((rank, "mask", "a mask passed where the flash attention can't apply it"))
        except ValueError:
            pass
    finally:
        fused_softmax.get_default_causal_mask = real_mask
        del tracker.fork
        mc.destroy()


def test_flash_attention_computes_megatrons_local_attention():
    """The benchmark's --attention flash against the local spec's DotProductAttention (causal, grouped queries):
    output and the query, key and value gradients within twice its own fp32 error against it in fp64."""
    run_ranks(_flash_equals_local, 1)
