"""moeblaze inside Megatron-Core: its spec with moeblaze's layer against Megatron's own MoE layer (SequentialMLP over
its all-to-all dispatcher) on gloo ranks of the CPU (megatron_cpu stands in for the CUDA calls Megatron's MoE path
makes). Output, dx and every parameter's gradient (router included) within twice Megatron's own fp32 error
against its layer in fp64; the parameter names and state dicts are Megatron's, a checkpoint loads both ways
(torch state dicts and Megatron's dist-checkpointing); the refusals, each named."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import moeblaze.experts  # routed_call's moe_experts: what the integrations' calls reach

pytest.importorskip("megatron.core")

from helpers import assert_within_torch_error, run_ranks  # noqa: E402
import megatron_cpu as mc  # noqa: E402

from moeblaze import EPConfig, ExpertsConfig  # noqa: E402

T, B, D = 12, 2, 32  # sequence, batch, hidden


def _inputs(seed: int, dtype=torch.float32, padding: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, B, D, generator=g, dtype=torch.float64)
    dout = torch.randn(T, B, D, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) < 0.25) if padding else None
    return x, dout, mask


def _within_torchs_error(found, rank, got, same, want) -> None:
    """Output, dx and every parameter's gradient of the step `got` within twice the error of the same computation
    `same` (torch's, at got's precision) against `want` (fp64); each that is not goes on found."""
    got, same, want = ({"out": out, "dx": dx, **grads} for out, dx, grads in (got, same, want))
    assert set(got) == set(want)
    for name, w in want.items():
        if w is None:
            found.put((rank, name, "no gradient"))
            continue
        try:
            assert_within_torch_error(got[name], same[name], w)
        except AssertionError as e:
            found.put((rank, name, str(e)))


def _parity(rank, world, found, config_kw, ours_kw, seed, padding=False, layout=None):
    """ours (moeblaze's spec) against Megatron's layer in fp32 and in fp64, the same weights, at EP = world. layout:
    ours' parameters as allocated (None), or moved into one buffer in order ("forward") or last first ("reversed",
    as Megatron's DDP lays them)."""
    mc.init(ep=world)
    config = mc.transformer_config(**config_kw)
    E = config.num_moe_experts
    stock = mc.build(mc.stock_mlp(E), config, seed=seed)
    ours = mc.build(mc.moeblaze_mlp(E, **ours_kw), config, seed=seed + 1)
    exact = mc.build(mc.stock_mlp(E), config, seed=seed + 2).double()
    ours.load_state_dict(stock.state_dict())
    if layout is not None:
        mc.lay_out_in_one_buffer(ours, reverse=layout == "reversed")
    exact.load_state_dict({k: v.double() if torch.is_tensor(v) else v for k, v in stock.state_dict().items()})
    x, dout, mask = _inputs(seed + rank, padding=padding)
    want = mc.layer_step(exact, x, dout, torch.float64, mask)
    same = mc.layer_step(stock, x, dout, torch.float32, mask)
    got = mc.layer_step(ours, x, dout, torch.float32, mask)
    _within_torchs_error(found, rank, got, same, want)
    mc.destroy()


SWIGLU = {}
CASES = {
    "reference": (SWIGLU, dict(experts=ExpertsConfig(backend="reference"))),
    "kernels": (SWIGLU, dict(experts=ExpertsConfig(backend="triton"))),
    "kernels-recompute": (SWIGLU, dict(experts=ExpertsConfig(backend="triton", checkpoint="recompute"))),
    "shared-experts": (dict(moe_shared_expert_intermediate_size=40), dict(experts=ExpertsConfig(backend="triton"))),
    "gelu": (dict(gated_linear_unit=False, activation_func=F.gelu), dict(experts=ExpertsConfig(backend="triton"))),
    "k1-sigmoid": (dict(moe_router_topk=1, moe_router_score_function="sigmoid"),
                   dict(experts=ExpertsConfig(backend="triton"))),
    "dispatch-megatron": (SWIGLU, dict(experts=ExpertsConfig(backend="triton"), dispatch="megatron")),
    "megatron-allgather": (dict(moe_token_dispatcher_type="allgather"),
                           dict(experts=ExpertsConfig(backend="triton"), dispatch="megatron")),
    "allgather-config": (dict(moe_token_dispatcher_type="allgather"), dict(experts=ExpertsConfig(backend="triton"))),
    "megatron-capacity": (dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
                          dict(experts=ExpertsConfig(backend="triton"), dispatch="megatron")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_rank_equals_megatrons_layer(case):
    config_kw, ours_kw = CASES[case]
    run_ranks(_parity, 1, config_kw, ours_kw, 0)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("layout", ["forward", "reversed"])
def test_weights_in_one_buffer_equal_megatrons(layout, world):
    """Parameters as views of one buffer (Megatron's DDP lays them out so, last first, fc1 and fc2 interleaved): the
    operands are stacked from them as from separate ones, and the results equal Megatron's."""
    run_ranks(_parity, world, SWIGLU, dict(experts=ExpertsConfig(backend="triton")), 9, False, layout)



def test_a_padding_mask_leaves_fewer_experts_and_they_add_nothing():
    run_ranks(_parity, 1, SWIGLU, dict(experts=ExpertsConfig(backend="triton")), 3, True)


def _biases(rank, world, found):
    """Expert biases (add_bias_linear): Megatron-Core 0.16's SequentialMLP raises in its own backward here (an
    in-place add of p · b2 to its row-parallel output, a view), so the gradients are held to moeblaze's reference,
    whose expert is p · (W2 act(W1 x + b1) + b2) as Megatron's MLP computes it (in fp64 exact, in fp32 the error
    torch makes), and the output to Megatron's own biased layer, run in fp64 without autograd."""
    mc.init(ep=world)
    config = mc.transformer_config(add_bias_linear=True)
    layers = [mc.build(mc.moeblaze_mlp(4, experts=ExpertsConfig(backend=b)), config, seed=i)
              for i, b in enumerate(["triton", "reference", "reference"])]
    for p in layers[0].parameters():  # Megatron initializes biases to zero: make them count
        p.data.normal_(std=0.5)
    layers[1].load_state_dict(layers[0].state_dict())
    layers[2].load_state_dict(layers[0].state_dict())
    layers[2].double()
    x, dout, _ = _inputs(7)
    want = mc.layer_step(layers[2], x, dout, torch.float64)
    same = mc.layer_step(layers[1], x, dout, torch.float32)
    got = mc.layer_step(layers[0], x, dout, torch.float32)
    _within_torchs_error(found, rank, got, same, want)
    if not any("bias" in n for n in want[2]):
        found.put("no bias parameters")
    stock = [mc.build(mc.stock_mlp(4), config, seed=3) for _ in range(2)]  # Megatron's biased layer: forward only
    for layer in stock:
        layer.load_state_dict(layers[0].state_dict())
    with torch.no_grad():
        stock32, _ = stock[0](x.float())
        stock64, _ = stock[1].double()(x)
    try:  # the kernels' output against Megatron's layer in fp64, within twice the error Megatron's makes in fp32
        assert_within_torch_error(got[0], stock32, stock64)
    except AssertionError as e:
        found.put((rank, "out against Megatron's biased layer", str(e)))
    mc.destroy()


def test_expert_biases_equal_the_reference():
    run_ranks(_biases, 1)


@pytest.mark.parametrize("ours_kw", [dict(experts=ExpertsConfig(backend="triton")),
                                     dict(experts=ExpertsConfig(backend="triton"), ep=EPConfig("capacity", 4.0)),
                                     dict(experts=ExpertsConfig(backend="triton"), dispatch="megatron")],
                         ids=["moeblaze-exact", "moeblaze-capacity", "megatron-alltoall"])
def test_expert_parallel_two_ranks_equal_megatrons_alltoall(ours_kw):
    run_ranks(_parity, 2, dict(num_moe_experts=4), ours_kw, 5)


def _sharded(module) -> dict:
    """What Megatron's dist-checkpointing writes and reads a module by: each ShardedTensor's key, global shape,
    offsets and replica id, by state-dict name."""
    return {name: (t.key, tuple(t.global_shape), tuple(t.global_offset), t.replica_id)
            for name, t in module.sharded_state_dict().items() if hasattr(t, "global_shape")}


def _names_and_checkpoints(rank, world, found):
    """The parameters, state dicts and sharded state dicts (dist-checkpointing's layout) of moeblaze's layer are
    stock Megatron's: a state dict loads strictly both ways, values intact, at EP = world. (Megatron's
    dist-checkpointing save itself forks writer processes, which a pool's rank can't: the GPU suite runs it.)"""
    mc.init(ep=world)
    config = mc.transformer_config(moe_shared_expert_intermediate_size=40)
    stock = mc.build(mc.stock_mlp(4), config, seed=0)
    ours = mc.build(mc.moeblaze_mlp(4), config, seed=1)
    if [n for n, _ in stock.named_parameters()] != [n for n, _ in ours.named_parameters()]:
        found.put("parameter names differ")
    if _sharded(stock) != _sharded(ours) or not _sharded(ours):
        found.put(("sharded state dicts differ", _sharded(stock), _sharded(ours)))
    for src, dst, name in [(ours, stock, "ours-to-stock"), (stock, ours, "stock-to-ours")]:
        for p in src.parameters():
            p.data.normal_()
        dst.load_state_dict(src.state_dict())  # strict
        for (n, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
            if torch.is_tensor(a) and not torch.equal(a, b):
                found.put((name, n, "differs after loading"))
    mc.destroy()


@pytest.mark.parametrize("world", [1, 2])
def test_checkpoints_load_both_ways_between_stock_megatron_and_moeblaze(world):
    run_ranks(_names_and_checkpoints, world)


REFUSED = {
    "expert_tensor_parallel_size": dict(expert_tensor_parallel_size=2),
    "moe_layer_recompute": dict(recompute_granularity="selective", recompute_modules=["moe"]),
    "overlap_moe_expert_parallel_comm": dict(overlap_moe_expert_parallel_comm=True, expert_model_parallel_size=2,
                                             bf16=True),
    "cuda_graph_scope": dict(cuda_graph_impl="local", cuda_graph_scope="full"),
    "moe_apply_probs_on_input": dict(moe_apply_probs_on_input=True, moe_router_topk=1, moe_router_pre_softmax=True),
    "moe_expert_capacity_factor": dict(moe_expert_capacity_factor=1.0),
    "activation_func_clamp_value": dict(activation_func_clamp_value=7.0),
    "activation_func": dict(activation_func=torch.tanh),
    "moe_shared_expert_overlap": dict(moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True,
                                      moe_token_dispatcher_type="alltoall"),
    "moe_token_dispatcher_type='flex'": dict(moe_token_dispatcher_type="flex"),
    "moe_latent_size": dict(moe_latent_size=16),
}  # TE's fp8/fp4 recipes: Megatron's TransformerConfig itself needs TransformerEngine for them (not on the CPU)


def _refusals(rank, world, found, names):
    """Each refused option raises a ValueError naming it when the layer is built."""
    mc.init(ep=world)
    for name in names:
        try:
            config = mc.transformer_config(**REFUSED[name])
        except Exception as e:  # Megatron's own config refused the combination first: nothing to build
            found.put((name, f"Megatron-Core's TransformerConfig refused it: {e}"))
            continue
        try:
            mc.build(mc.moeblaze_mlp(4), config)
        except ValueError as e:
            if name not in str(e):
                found.put((name, f"the error does not name it: {e}"))
        else:
            found.put((name, "built"))
    mc.destroy()


def test_each_refused_option_is_named_when_the_layer_is_built():
    run_ranks(_refusals, 1, list(REFUSED))


def test_refused_recipes_and_spec_options():
    from moeblaze.integrations.megatron import get_moeblaze_gpt_layer_spec

    with pytest.raises(ValueError, match="dispatch"):
        get_moeblaze_gpt_layer_spec(4, dispatch="deepep")
    with pytest.raises(ValueError, match="ep is moeblaze's"):
        get_moeblaze_gpt_layer_spec(4, dispatch="megatron", ep=EPConfig())
    with pytest.raises(TypeError, match="ExpertsConfig"):
        get_moeblaze_gpt_layer_spec(4, experts={"checkpoint": "recompute"})
    for bad, error in ((0, ValueError), (-4, ValueError), ("4", TypeError), (4.0, TypeError)):
        with pytest.raises(error, match="num_experts"):
            get_moeblaze_gpt_layer_spec(bad)
    with pytest.raises(ValueError, match="moe_grouped_gemm=True builds Megatron's grouped-GEMM experts"):
        get_moeblaze_gpt_layer_spec(4, moe_grouped_gemm=True)
    get_moeblaze_gpt_layer_spec(4, moe_grouped_gemm=False)  # what it builds anyway: taken


def test_use_te_without_transformer_engine_is_refused_by_name():
    import importlib.util

    from moeblaze.integrations.megatron import get_moeblaze_gpt_layer_spec

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("TransformerEngine is installed here")
    with pytest.raises(ValueError, match="use_te=True starts from Megatron's TransformerEngine spec"):
        get_moeblaze_gpt_layer_spec(4, use_te=True)


def _recipe_refusals(rank, world, found):
    mc.init(ep=world)
    config = mc.transformer_config()
    for experts, words in [(ExpertsConfig(activation="gelu"), "activation"),
                           (ExpertsConfig(precision="fp8", fp8_weight_cache=True), "fp8_weight_cache")]:
        try:
            mc.build(mc.moeblaze_mlp(4, experts=experts), config)
        except ValueError as e:
            if words not in str(e):
                found.put((words, str(e)))
        else:
            found.put((words, "built"))
    mc.destroy()


def test_a_recipe_the_megatron_config_contradicts_is_refused():
    run_ranks(_recipe_refusals, 1)


def _stacked_storages_outlive_forward(rank, world, found, restack: bool):
    """Whether a stacked copy of the experts' weights is alive between forward and backward, where the parameters
    are laid out so that the layer stacks them (last first, as Megatron's DDP buffer): with the layer's saved-tensor
    hooks (restack) none is, what autograd saved restacks from the parameters in backward; without them (the
    control) autograd keeps the copies."""
    import contextlib
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    from moeblaze.integrations import megatron

    mc.init(ep=world)
    ours = mc.build(mc.moeblaze_mlp(4, experts=ExpertsConfig(backend="triton")), mc.transformer_config())
    mc.lay_out_in_one_buffer(ours, reverse=True)
    made, stack, hooks = [], megatron._stack, megatron._restacked

    def recorded(parts):
        t = stack(parts)
        made.append(StorageWeakRef(t.untyped_storage()))
        return t
    megatron._stack = recorded
    if not restack:
        megatron._restacked = lambda stacks: contextlib.nullcontext()
    try:  # (the rank's process runs other tests after this one)
        out, _ = ours(torch.randn(T, B, D, requires_grad=True))
        gc.collect()
        alive = sum(not r.expired() for r in made)
        out.sum().backward()
    finally:
        megatron._stack, megatron._restacked = stack, hooks
    if len(made) != 2 or alive != (0 if restack else 2):
        found.put((len(made), alive))
    if any(p.grad is None for p in ours.parameters()):
        found.put("a parameter got no gradient")
    mc.destroy()


@pytest.mark.parametrize("restack", [True, False], ids=["the-layer", "control-without-its-hooks"])
def test_no_stacked_copy_of_the_weights_lives_from_forward_to_backward(restack):
    run_ranks(_stacked_storages_outlive_forward, 1, restack)


class _NewStorages(TorchDispatchMode):
    """The out-of-place ops that make a new storage of at least `numel` elements outside `known` (storage
    addresses; in-place ops make none: Triton's interpreter copies its kernels' results back with them)."""

    def __init__(self, numel: int, known: set):
        super().__init__()
        self.numel, self.known, self.made = numel, known, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}  # a view's output shares its input's storage
        for t in torch.utils._pytree.tree_leaves(out):
            if (isinstance(t, torch.Tensor) and not func._schema.is_mutable and t.numel() >= self.numel
                    and t.untyped_storage().data_ptr() not in self.known | inputs):
                self.made.append(str(func))
        return out


def _weight_sized_storages(rank, world, found, layout, convert):
    """The new storages of at least one kind of expert weight (E·D·H elements: the activations here are smaller)
    that the layer's forward makes: none where the layer lays its experts out (as built, and after a dtype
    conversion, which makes each parameter anew), a stacked copy per kind where they are laid out otherwise (also
    when that happens after a call that read them in place, with the same output)."""
    mc.init(ep=world)
    config = mc.transformer_config()
    ours = mc.build(mc.moeblaze_mlp(4, experts=ExpertsConfig(backend="triton")), config)
    if convert:
        ours.double().float()  # each parameter made anew twice
    x = torch.randn(T, B, D, dtype=next(ours.parameters()).dtype, requires_grad=True)
    before = ours(x)[0].detach() if layout == "reversed-after-a-call" else None
    if layout is not None:
        mc.lay_out_in_one_buffer(ours, reverse=layout.startswith("reversed"))
    known = {p.untyped_storage().data_ptr() for p in ours.parameters()}
    with _NewStorages(4 * D * config.moe_ffn_hidden_size, known) as mode:
        out, _ = ours(x)
    out.sum().backward()
    want = 2 if layout is not None and layout.startswith("reversed") else 0
    if len(mode.made) != want:
        found.put((layout, convert, mode.made))
    if before is not None and not torch.equal(before, out.detach()):  # the same values, read from the new layout
        found.put((layout, "another output"))
    fc1 = {e.linear_fc1.weight.untyped_storage().data_ptr() for e in ours.experts.local_experts}
    if layout is None and len(fc1) != 1:
        found.put(("fc1's weights in", len(fc1), "storages"))
    mc.destroy()


@pytest.mark.parametrize("layout,convert", [(None, False), (None, True), ("reversed", False),
                                            ("reversed-after-a-call", False)],
                         ids=["as-built", "after-dtype-conversions", "control-laid-out-last-first",
                              "laid-out-last-first-after-a-call"])
def test_the_layer_reads_its_experts_weights_in_place(layout, convert):
    run_ranks(_weight_sized_storages, 1, layout, convert)


def _megatron_ddp_grads(layer, order: str) -> list:
    """Megatron DistributedDataParallel's gradient protocol on the CPU, without its buffers' collectives: each
    parameter's float32 main_grad in one buffer (order "last-first", DDP's own; "first-first"), or each in its own
    ("apart"), grad_added_to_main_grad False, and DDP's own backward hook (its _make_backward_post_hook, bound to a
    stand-in holding what the hook reads). Returns the grad accumulators the hooks hang on (keep them alive)."""
    import types

    from megatron.core.distributed import DistributedDataParallel
    params = [p for p in layer.parameters() if p.requires_grad]
    ddp = types.SimpleNamespace(param_to_bucket_group=dict.fromkeys(params),
                                ddp_config=types.SimpleNamespace(overlap_grad_reduce=False))
    buffer, at, accs = torch.zeros(sum(p.numel() for p in params)), 0, []
    for p in params[::-1] if order == "last-first" else params:
        p.main_grad = torch.zeros(p.shape) if order == "apart" else buffer[at:at + p.numel()].view(p.shape)
        at += p.numel()
        p.grad_added_to_main_grad = False
        accs.append(p.expand_as(p).grad_fn.next_functions[0][0])
        accs[-1].register_hook(DistributedDataParallel._make_backward_post_hook(ddp, p))
    return accs


def _main_grads(rank, world, found, order, weights):
    """Two micro-batches through the layer under DDP's protocol: the main_grads equal those of DDP's hooks adding
    each parameter's gradient (the layer's adds turned off), bitwise; the experts' flagged as added where they sit a
    fixed distance apart, not flagged where they don't; every parameter's .grad dropped by the hook."""
    from moeblaze.integrations import megatron_weights
    mc.init(ep=world)
    config = mc.transformer_config()
    x, dout, _ = _inputs(7)
    results = []
    for fused in (True, False):
        layer = mc.build(mc.moeblaze_mlp(4, experts=ExpertsConfig(backend="triton")), config, seed=3)
        if weights == "last-first":
            mc.lay_out_in_one_buffer(layer, reverse=True)  # the layer stacks its weights per call
        accs = _megatron_ddp_grads(layer, order)
        add = megatron_weights.add_into_main_grads
        if not fused:
            megatron_weights.add_into_main_grads = lambda params, grad: False
        try:
            for i in range(2):
                out, _ = layer(x.float() + i)
                out.backward(dout.float())
        finally:
            megatron_weights.add_into_main_grads = add
        results.append({n: (p.main_grad.clone(), p.grad_added_to_main_grad, p.grad) for n, p in
                        layer.named_parameters()})
        del accs
    fused, hooks = results
    for name, (main, added, grad) in fused.items():
        expert = "local_experts" in name
        if not torch.equal(main, hooks[name][0]):
            found.put((order, weights, name, "main_grad differs", (main - hooks[name][0]).abs().max().item()))
        if added != (expert and order != "apart") or hooks[name][1]:
            found.put((order, weights, name, "flagged added", added))
        if grad is not None or not main.abs().sum():
            found.put((order, weights, name, "the hook's .grad left, or no gradient"))
    mc.destroy()


@pytest.mark.parametrize("weights,order", [("as-built", "last-first"), ("as-built", "first-first"),
                                           ("as-built", "apart"), ("last-first", "last-first")],
                         ids=["read-in-place", "buffer-first-first", "control-main-grads-apart", "stacked"])
def test_the_experts_gradients_go_into_megatrons_buffer_in_one_launch_per_kind(weights, order):
    run_ranks(_main_grads, 1, order, weights)


def test_the_main_grads_layout_is_checked_again_when_ddp_makes_them_anew():
    """add_into_main_grads knows a kind's main_grads by identity after one full check: main_grads made anew (another
    buffer, or one apart from the rest) are checked again, and the sums land where they now are."""
    from moeblaze.integrations.megatron_weights import add_into_main_grads
    params = [torch.nn.Parameter(torch.zeros(3, 5)) for _ in range(4)]

    def lay_out(last_first: bool, apart: int | None = None):
        buffer = torch.randn(len(params) * 15 + 7)
        for e, p in enumerate(params):
            at = 7 + 15 * (len(params) - 1 - e if last_first else e)
            p.main_grad = torch.randn(3, 5) if e == apart else buffer[at:at + 15].view(3, 5)
            p.grad_added_to_main_grad = False
        return [p.main_grad.clone() for p in params]

    for last_first, apart, fused in [(True, None, True), (True, None, True), (False, None, True), (False, 2, False),
                                     (True, None, True)]:
        before, grad = lay_out(last_first, apart), torch.randn(len(params), 3, 5)
        assert add_into_main_grads(params, grad) is fused
        for p, b, g in zip(params, before, grad):
            assert torch.equal(p.main_grad, b + g if fused else b) and p.grad_added_to_main_grad is fused


def _restored(rank, world, found):
    real = {name: getattr(torch.cuda, name) for name in mc._CUDA}
    mc.init(ep=world)
    if torch.cuda.current_device() != "cpu":
        found.put("the stand-ins are not in place")
    mc.destroy()
    changed = [name for name, f in real.items() if getattr(torch.cuda, name) is not f]
    if changed:
        found.put(("left stood in", changed))


def test_the_cuda_stand_ins_are_gone_after_a_test():
    """A pool's rank runs other tests after these: torch.cuda's own functions are back after each."""
    run_ranks(_restored, 1)


def _fp8_under_autocast(rank, world, found):
    mc.init(ep=world)
    fp8 = ExpertsConfig(backend="triton", precision="fp8", fp8_min_rows=0)
    ours = mc.build(mc.moeblaze_mlp(4, experts=fp8), mc.transformer_config(hidden_size=128))
    seen, real = [], moeblaze.experts.moe_experts

    def spy(x, routing, weights, w1, w2, *args, **kw):
        seen.append((x.dtype, w1.dtype, w2.dtype))
        return real(x, routing, weights, w1, w2, *args, **kw)
    moeblaze.experts.moe_experts = spy
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            out, _ = ours(torch.randn(T, B, 128))
    finally:
        moeblaze.experts.moe_experts = real
    if seen != [(torch.float16, torch.float32, torch.float32)] or not out.isfinite().all():
        found.put(("the op's operands", seen))
    mc.destroy()


def test_fp8_under_autocast_takes_the_float32_stacks_as_masters():
    """Under autocast (CPU, float16) with precision="fp8" the op gets the experts' stacked weights in float32 (the
    quantizers read them; experts.autocast_weights) and x in float16. Forward only: Megatron's router backward does
    not take torch's autocast (Megatron trains bf16 parameters); the masters' gradients are tested at the op
    (tests/experts/test_fp8_masters.py)."""
    run_ranks(_fp8_under_autocast, 1)


def _disagreeing_layers(rank, world, found, field):
    """A layer spec that differs across the expert-parallel ranks (the dispatch, the recipe, moeblaze's EP dispatch):
    one ValueError naming it on every rank when the layer is built, before any collective of a forward could wait
    on the other ranks' different ones; then agreeing specs build."""
    mc.init(ep=world)
    config = mc.transformer_config()
    odd = rank % 2 == 1
    kw = {"dispatch": dict(dispatch="megatron" if odd else "moeblaze"),
          "recipe": dict(experts=ExpertsConfig(backend="triton", checkpoint="recompute" if odd else "preact")),
          "ep_config": dict(ep=EPConfig("capacity") if odd else None)}[field]
    try:
        mc.build(mc.moeblaze_mlp(4, **kw), config)
    except ValueError as e:
        if "every rank of the expert-parallel group must pass the same" not in str(e):
            found.put((rank, field, f"not the agreement's error: {e}"))
    else:
        found.put((rank, field, "built"))
    mc.build(mc.moeblaze_mlp(4, experts=ExpertsConfig(backend="triton")), config)  # the group goes on
    mc.destroy()


@pytest.mark.parametrize("world", [2, 4])
def test_layers_that_differ_across_ranks_are_one_error_on_every_rank(world):
    for field in ("dispatch", "recipe", "ep_config"):
        run_ranks(_disagreeing_layers, world, field)


def _block_model(spec, config, seed):
    from megatron.core.models.gpt import GPTModel
    torch.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=T,
                    position_embedding_type="rope")


def _positions_and_mask(ids):
    """GPTModel's position ids and causal mask (True: masked out; Megatron's default mask is made on CUDA)."""
    t = ids.shape[1]
    return torch.arange(t)[None].expand_as(ids), torch.ones(t, t, dtype=torch.bool).triu(1)[None, None]


def _model_step(model, ids, dlogits, dtype):
    """(logits, {name: grad}) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    logits = model(ids, *_positions_and_mask(ids))
    logits.backward(dlogits.to(logits.dtype))
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def _dense_then_moe(rank, world, found):
    """A DeepSeek-V3-style GPTModel (first layer dense, MoE after) from moeblaze's block spec against Megatron's own
    block spec: Megatron's dense layer, moeblaze's MoE layers; logits and every parameter's gradient within twice
    Megatron's fp32 error against its model in fp64; and SGD steps lower the loss."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from moeblaze.integrations.megatron import MoeblazeMoELayer, get_moeblaze_gpt_decoder_block_spec
    mc.init()
    # attention forks the CUDA RNG for its dropout (none here): Megatron's inference tracker, whose fork does nothing
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    try:
        config = mc.transformer_config(num_layers=3, moe_layer_freq=[0, 1, 1], hidden_dropout=0.0,
                                       attention_dropout=0.0)
        ours = _block_model(get_moeblaze_gpt_decoder_block_spec(config, experts=ExpertsConfig(backend="triton")),
                            config, 0)
        stock_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        stock = _block_model(stock_spec, config, 1)
        exact = _block_model(stock_spec, config, 2).double()
        kinds = [type(layer.mlp).__name__ for layer in ours.decoder.layers]
        assert kinds == ["MLP", "MoeblazeMoELayer", "MoeblazeMoELayer"], kinds
        assert isinstance(ours.decoder.layers[1].mlp, MoeblazeMoELayer)
        assert ours.state_dict().keys() == stock.state_dict().keys()
        ours.load_state_dict(stock.state_dict())
        exact.load_state_dict({k: v.double() if torch.is_tensor(v) else v for k, v in stock.state_dict().items()})
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(0, 64, (B, T), generator=g)
        dlogits = torch.randn(B, T, 64, generator=g, dtype=torch.float64)
        (want, want_g), (same, same_g), (got, got_g) = (_model_step(m, ids, dlogits, dt) for m, dt in
                                                        ((exact, torch.float64), (stock, None), (ours, None)))
        for name, a, b, w in [("logits", got, same, want)] + [(n, got_g[n], same_g[n], want_g[n]) for n in want_g]:
            try:
                assert a is not None, "no gradient"
                assert_within_torch_error(a, b, w)
            except AssertionError as e:
                found.put((rank, name, str(e)))
        opt = torch.optim.SGD(ours.parameters(), lr=0.5)
        losses = []
        for _ in range(4):
            opt.zero_grad()
            logits = ours(ids[:, :-1], *_positions_and_mask(ids[:, :-1]))
            loss = F.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            losses.append(float(loss))
        if not losses[-1] < losses[0]:
            found.put((rank, "training", losses))
    finally:
        initialize_rng_tracker(force_reset=True)
        mc.destroy()


def test_a_block_with_a_dense_first_layer_equals_megatrons_and_trains():
    run_ranks(_dense_then_moe, 1)


def test_the_block_spec_refuses_what_it_cannot_build():
    from moeblaze.integrations.megatron import get_moeblaze_gpt_decoder_block_spec
    with pytest.raises(ValueError, match="num_moe_experts is not set"):
        get_moeblaze_gpt_decoder_block_spec(mc.transformer_config(num_moe_experts=None, moe_ffn_hidden_size=None))
    with pytest.raises(ValueError, match="moe_grouped_gemm=True"):
        get_moeblaze_gpt_decoder_block_spec(mc.transformer_config(moe_grouped_gemm=True))
    with pytest.raises(ValueError, match="applies to dispatch='moeblaze'"):
        get_moeblaze_gpt_decoder_block_spec(mc.transformer_config(), dispatch="megatron", ep=EPConfig())


def _explicit_groups(rank, world, found):
    """M1: a TransformerLayer built with an explicit pg_collection (expert parallelism over both ranks) while
    Megatron's global parallel state has none: Megatron-Core 0.16 hands the collection only to its own MLP classes,
    so moeblaze's MoE layer took the global state (8 local experts of 8 where stock builds 4), unsaid. Now it gets
    the layer's groups as stock's does: the same local experts, its expert-parallel group the collection's."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.spec_utils import build_module

    from moeblaze.integrations.megatron import get_moeblaze_gpt_layer_spec
    mc.init(ep=1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    try:
        everyone = torch.distributed.new_group(list(range(world)))
        alone = [torch.distributed.new_group([r]) for r in range(world)][rank]
        pgc = ProcessGroupCollection.use_mpu_process_groups()
        pgc.ep = pgc.tp_ep = everyone
        pgc.expt_tp, pgc.expt_dp = alone, alone
        config = mc.transformer_config(num_moe_experts=8)
        layers = {}
        for name, spec in (("stock", get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)),
                           ("moeblaze", get_moeblaze_gpt_layer_spec(8))):
            layers[name] = build_module(spec, config=config, pg_collection=pgc).mlp
        counts = {n: len(m.experts.local_experts) for n, m in layers.items()}
        if counts != {"stock": 4, "moeblaze": 4}:
            found.put((rank, "local experts", counts))
        if layers["moeblaze"].ep_group.size() != world:
            found.put((rank, "ep group", layers["moeblaze"].ep_group.size()))
    finally:
        initialize_rng_tracker(force_reset=True)
        mc.destroy()


def test_an_explicit_pg_collection_reaches_the_moe_layer_as_stocks():
    run_ranks(_explicit_groups, 2)
