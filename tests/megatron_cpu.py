"""Megatron-Core's MoE layer on the CPU, for the tests (gloo ranks from helpers.run_ranks).

Megatron-Core is CUDA-only at run time in a few places that its MoE layer reaches; on the CPU they are stood in
for, here only (stand_ins), never in the library:
  torch.cuda.current_device      -> "cpu": the router moves its weight to the current CUDA device
  torch.cuda.Stream, Event, current_stream, stream -> no-ops: the all-to-all dispatcher makes a stream and events
  torch.cuda.synchronize         -> a no-op: the dist-checkpointing writer waits for the device before it writes
  moe_utils.te_general_gemm      -> None where TransformerEngine is absent: Megatron-Core 0.16 reads the name
                                    without defining it when TE's import fails
  maybe_move_tensor_to_cpu       -> a numpy array for a CPU tensor where asked for one (as for a CUDA one): the
                                    all-to-all dispatcher's split sizes, which c10d takes as a sequence of ints
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


class _NoStream:
    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name):  # wait_stream, record_event, wait_event, record, synchronize, ...
        return lambda *args, **kwargs: _NoStream()


_CUDA = ("current_device", "Stream", "Event", "current_stream", "stream", "synchronize")
_REAL: dict = {}  # torch.cuda's own, while the stand-ins are in place


def stand_ins() -> None:
    """Megatron-Core's CUDA calls on the MoE path stood in for on the CPU (the module header), until destroy()
    puts torch.cuda's own back (a pool's rank runs other tests after these); the Megatron-side ones stay."""
    if _REAL:
        return
    _REAL.update({name: getattr(torch.cuda, name) for name in _CUDA})
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = torch.cuda.Event = _NoStream
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    _megatron_stand_ins()


@functools.cache
def _megatron_stand_ins() -> None:
    """The stand-ins inside Megatron-Core's own modules, once a process (nothing else imports them)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    to_cpu = moe_utils.maybe_move_tensor_to_cpu

    def to_cpu_as_on_cuda(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)
    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = to_cpu_as_on_cuda


def init(ep: int = 1) -> None:
    """Megatron's parallel state over the current gloo world: expert parallelism `ep`, the rest data parallel."""
    stand_ins()
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)


def destroy() -> None:
    """Megatron's parallel state torn down, and torch.cuda's own functions back."""
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    for name, real in _REAL.items():
        setattr(torch.cuda, name, real)
    _REAL.clear()


def transformer_config(**overrides):
    """A small MoE TransformerConfig (E=4, K=2, d=32, moe_ffn 48, SwiGLU, alltoall), fields overridden."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    fields = dict(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, num_moe_experts=4,
                  moe_router_topk=2, moe_ffn_hidden_size=48, gated_linear_unit=True, activation_func=F.silu,
                  add_bias_linear=False, moe_token_dispatcher_type="alltoall", use_cpu_initialization=True,
                  bias_activation_fusion=False, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)
    return TransformerConfig(**{**fields, **overrides})


def build(mlp, config, seed: int = 0):
    """The MoE layer of a spec's MLP builder (0.16's ModuleSpec or 0.19's partial), seeded."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    torch.manual_seed(seed)
    return build_module(mlp, config=config) if isinstance(mlp, ModuleSpec) else mlp(config=config)


def stock_mlp(num_experts: int):
    """Megatron's own MoE layer builder (local spec: SequentialMLP)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    return get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False).submodules.mlp


def moeblaze_mlp(num_experts: int, **kwargs):
    from moeblaze.integrations.megatron import get_moeblaze_gpt_layer_spec
    return get_moeblaze_gpt_layer_spec(num_experts, **kwargs).submodules.mlp


def layer_step(layer, x, dout, dtype, mask=None):
    """(out, dx, {name: grad}) of one forward and backward of a Megatron MoE layer in dtype (its bias output None;
    mask: a padding mask)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().to(dtype).requires_grad_()
    out, bias = layer(x) if mask is None else layer(x, padding_mask=mask)
    assert bias is None
    out.backward(dout.to(dtype))
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def lay_out_in_one_buffer(module, reverse: bool) -> None:
    """Every parameter of `module` moved into one flat buffer, back to back (reverse: the last parameter first, as
    Megatron's DistributedDataParallel lays them in its buffer), values unchanged: parameters as views of one
    storage, without building DDP."""
    params = list(module.parameters())
    order = params[::-1] if reverse else params
    flat = params[0].new_empty(sum(p.numel() for p in params))
    at = 0
    for p in order:
        view = flat[at:at + p.numel()].view(p.shape)
        view.copy_(p.data)
        p.data = view
        at += p.numel()
