"""moeblaze's experts under torchtitan's own parallelization (parallelize_qwen3 on 2 CPU processes, gloo; and its
pipeline parallelism, pipeline_llm, last test): FSDP2 over both ranks, and FSDP2 with expert parallelism 2
(torchtitan's all-to-all dispatcher feeding moeblaze's op the received rows, or moeblaze's own ep_experts).
Each rank's logits and every parameter's gradient (whole, across the ranks) equal torchtitan's own experts under
the same parallelization, in fp32 (its experts computed in fp32), on torchtitan's Qwen3 builder at interpreter
widths; the expert-bias state after an optimizer step too.

Two adaptations to the CPU, the same for both sides: torchtitan's device is set to "cpu" (it assumes CUDA), and
FSDP2's gradient divide factor is left at its default (gloo has no PREMUL_SUM, which torchtitan's factor of 1
needs): every gradient is then the mean over ranks on both sides. Under this parallelization the router gates'
gradients come out at round-off (~1e-12) for torchtitan's own experts as for moeblaze's; they are checked to be
so on both sides."""
import pytest
import torch

pytest.importorskip("torchtitan")

from helpers import close_pools, run_ranks  # noqa: E402

TOL = 1e-5


@pytest.fixture(autouse=True)
def _fresh_ranks_after():
    """torchtitan's parallelization leaves process-wide state in the ranks (after it, FSDP2 with expert parallelism
    in moeblaze's own test gives other gradients in the same processes): its ranks are not reused."""
    yield
    close_pools()
ZERO = 1e-9  # the router gates' gradients come out ~1e-12 here on both sides (3e-5 in one process): compared as zero


def _parallelized(converters, world, ep, folder):
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.qwen3 import parallelize_qwen3

    from titan import model_config, parallel_build

    FSDPModule.set_gradient_divide_factor = lambda self, factor: None
    config = ParallelismConfig(data_parallel_shard_degree=world, expert_parallel_degree=ep,
                               spmd_backend="partial_dtensor")
    model, dims = parallel_build(model_config("qwen3", converters, narrow=True), config, world, "cpu")
    model = parallelize_qwen3(model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32"),
                              parallelism=config, compile_config=CompileConfig(), ac_config=SelectiveAC.Config(),
                              dump_folder=folder)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def _compare_gradients(rank, errors, default, ours) -> None:
    """Every parameter's gradient of ours (whole, across the ranks) against torchtitan's experts' (default)."""
    for (name, a), (_, b) in zip(default.named_parameters(), ours.named_parameters()):
        ga, gb = (g.full_tensor() if hasattr(g, "full_tensor") else g for g in (a.grad, b.grad))
        if float(ga.norm()) < ZERO:  # a gradient torchtitan's own experts leave at round-off: ours too
            if not float(gb.norm()) < ZERO:
                errors.put(f"rank {rank}: {name}'s gradient is {float(gb.norm())}, torchtitan's {float(ga.norm())}")
            continue
        err = float((gb - ga).norm() / ga.norm())
        if not err <= TOL:
            errors.put(f"rank {rank}: {name}'s gradient differs by {err}")


def _body(rank, world, errors, ep, folder, dispatch=None):
    from moeblaze import EPConfig, ExpertsConfig
    from moeblaze.integrations.torchtitan import MoeblazeConverter, MoeblazeRoutedExperts
    from titan import fp32_default

    default = fp32_default(_parallelized([], world, ep, folder))
    moeblaze_ep = None if dispatch is None else EPConfig(dispatch=dispatch)  # None: torchtitan's dispatcher
    ours = _parallelized([MoeblazeConverter.Config(experts=ExpertsConfig(backend="triton"), ep=moeblaze_ep)],
                         world, ep, folder)
    routed = [m for m in ours.modules() if isinstance(m, MoeblazeRoutedExperts)]
    if not routed or any((m.token_dispatcher.ep_mesh is not None) != (ep > 1) for m in routed):
        errors.put(f"rank {rank}: {len(routed)} MoeblazeRoutedExperts, EP mesh "
                   f"{[m.token_dispatcher.ep_mesh for m in routed]} at ep={ep}")
    ours.load_state_dict(default.state_dict())
    x = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(rank))
    logits = []
    for model in (default, ours):
        out = model(x)
        out.float().square().mean().backward()
        logits.append(out)
    err = float((logits[1] - logits[0]).norm() / logits[0].norm())
    if not err <= TOL:
        errors.put(f"rank {rank}: logits differ by {err}")
    _compare_gradients(rank, errors, default, ours)
    counts = [[m.tokens_per_expert_E.clone() for m in model.modules() if type(m).__name__ == "MoE"]
              for model in (default, ours)]
    if not all(torch.equal(a, b) for a, b in zip(*counts)):
        errors.put(f"rank {rank}: the experts' token counts differ")


@pytest.mark.parametrize("ep", [1, 2])
def test_fsdp2_and_expert_parallelism_equal_torchtitans_experts(ep, tmp_path):
    run_ranks(_body, 2, ep, str(tmp_path))


@pytest.mark.parametrize("dispatch", ["exact", "capacity"])
def test_moeblazes_own_expert_parallelism_on_torchtitans_ep_mesh(dispatch, tmp_path):
    """ep=EPConfig(dispatch="exact"/"capacity"): moeblaze's ep_experts over torchtitan's EP mesh in place of its
    dispatcher (no row dropped at these sizes, capacity 1.25x)."""
    run_ranks(_body, 2, 2, str(tmp_path), dispatch)


def _pipelined(converters, folder):
    """torchtitan's pipeline_llm over the two ranks (1F1B, one layer per stage, microbatches of 1 sequence), each
    stage parallelized by parallelize_qwen3, as its trainer does; (schedule, this rank's model part, first, last)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.qwen3 import parallelize_qwen3

    from titan import model_config, parallel_build

    FSDPModule.set_gradient_divide_factor = lambda self, factor: None
    config = ParallelismConfig(pipeline_parallel_degree=2, pipeline_parallel_schedule="1F1B",
                               pipeline_parallel_microbatch_size=1, spmd_backend="partial_dtensor")
    spec = model_config("qwen3", converters, narrow=True)
    model, dims = parallel_build(spec, config, 2, "cpu")
    training = TrainingConfig(local_batch_size=2, seq_len=16, mixed_precision_param="float32")

    def loss_fn(pred, labels):  # torchtitan's loss functions return (loss, the tokens it counted)
        return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten()), labels.numel()

    schedule, parts, first, last = pipeline_llm(
        model, parallel_dims=dims, training=training, parallelism=config, compile_config=CompileConfig(),
        ac_config=SelectiveAC.Config(), dump_folder=folder, device=torch.device("cpu"), model_config=spec,
        parallelize_fn=parallelize_qwen3, loss_fn=loss_fn)
    (part,) = parts
    part.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        part.init_weights(buffer_device=torch.device("cpu"))
    return schedule, part, first, last


def _pp_body(rank, world, errors, folder):
    from moeblaze import ExpertsConfig
    from moeblaze.integrations.torchtitan import MoeblazeConverter, MoeblazeRoutedExperts
    from titan import fp32_default

    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 2048, (2, 16), generator=g), torch.randint(0, 2048, (2, 16), generator=g)
    runs = []
    for converters in ([], [MoeblazeConverter.Config(experts=ExpertsConfig(backend="triton"))]):
        schedule, part, first, last = _pipelined(converters, folder)
        fp32_default(part)
        if runs:
            part.load_state_dict(runs[0][0].state_dict())
            if not any(isinstance(m, MoeblazeRoutedExperts) for m in part.modules()):
                errors.put(f"rank {rank}: its stage has no moeblaze experts")
        losses = []
        if first:
            schedule.step(x, target=y if last else None, losses=losses)
        else:
            schedule.step(target=y if last else None, losses=losses)
        runs.append((part, losses, last))
    (default, losses_a, last), (ours, losses_b, _) = runs
    if last:
        err = max(abs(float(a) - float(b)) / abs(float(a)) for a, b in zip(losses_a, losses_b))
        if not (len(losses_a) == 2 and err <= TOL):
            errors.put(f"rank {rank}: microbatch losses {losses_a} against {losses_b}")
    _compare_gradients(rank, errors, default, ours)


def test_pipeline_parallelism_equals_torchtitans_experts(tmp_path):
    """torchtitan's pipeline parallelism (pipeline_llm, 2 stages of one layer, 1F1B) with moeblaze's experts in the
    stages: the microbatch losses and every gradient of each stage equal torchtitan's experts under the same
    schedule."""
    run_ranks(_pp_body, 2, str(tmp_path))
