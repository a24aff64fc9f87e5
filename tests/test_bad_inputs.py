"""Every rejected input of the public API and the error it gets, checked here and rendered as the table in
docs/bad-inputs.md: each case must raise the exception type it names, and the doc must show what the cases
raise now. After changing a case or a message, `python tests/test_bad_inputs.py` rewrites the doc."""
import contextlib
import io
import os
import pathlib
import shlex
import sys
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")  # run as a script (to write the doc) as under pytest (conftest.py)

import pytest
import torch

import moeblaze.experts
from moeblaze import (EPConfig, ExpertsConfig, ModelConfig, MoELayer, RoundingConfig, RouterConfig, SharedConfig,
                      TopKRouter, build_routing_index, moe_experts)
from moeblaze.distributed import ExpertParallel, ep_experts
from moeblaze.routing import round_to_index, route_topk
from moeblaze.routing.rounding import round_tokens
from moeblaze.cli import main
from moeblaze.cli.checkpoint import load_checkpoint

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "bad-inputs.md"

# (the call, as the doc shows it, and the error it must raise); names: x (6, 16) fp32, idx (6, 2) int32 ids,
# routing = build_routing_index(idx, 4), w (6, 2) router weights, logits (6, 4), w1 (4, 64, 16), w2 (4, 16, 32),
# layer = MoELayer(16, 32, 4, 2); `moeblaze ...` lines run the command line; `damaged` is a checkpoint with one
# byte flipped; command lines run in a folder that holds a file notes.txt.
CASES = [
    ("MoELayer(16, 0, 4, 2)", ValueError),
    ("MoELayer(0, 32, 4, 2)", ValueError),
    ("MoELayer(16, 32, 4.0, 2)", TypeError),
    ("MoELayer(16, 32, 4, 2, rounding=RoundingConfig(max_experts=1))", ValueError),  # below top_k
    ("MoELayer(16, 32, 4, 2, rounding=RoundingConfig(max_experts=10**6))", ValueError),  # above E: bounds nothing
    ("RouterConfig(expert_bias_rate=0.01)", ValueError),  # the step of a bias that is off
    ("ExpertsConfig(fp8_min_rows=0)", ValueError),  # read by precision='fp8' only
    ("MoELayer(16, 32, 4, 2, impl='reference', backend='tl')", ValueError),  # 0.1's form: the reference runs no kernel
    ("RoundingConfig('sr-f')", ValueError),
    ("RoundingConfig(tile=0)", ValueError),
    ("MoELayer(16, 32, 4, 5)", ValueError),
    ("MoELayer(16, 32, 4, True)", TypeError),
    ("MoELayer(16, 32, 4, 2, chunk_tokens=0)", ValueError),
    ("MoELayer(16, 32, 4, 2, activation='tanh')", ValueError),
    ("MoELayer(16, 32, 4, 2, checkpoint='all')", ValueError),
    ("MoELayer(16, 32, 4, 2, impl='cuda')", ValueError),
    ("MoELayer(16, 32, 4, 2, backend='cutlass')", ValueError),
    ("MoELayer(16, 32, 4, 2, index_method='radix')", ValueError),
    ("RouterConfig(scoring='sigmoid')", ValueError),
    ("RouterConfig(renormalize='yes')", TypeError),
    ("TopKRouter(16, 0, 1)", ValueError),
    ("TopKRouter(16, 8, 2, config=RouterConfig(num_groups=3))", ValueError),
    ("TopKRouter(16, 8, 4, config=RouterConfig(num_groups=4, topk_groups=1))", ValueError),
    ("RouterConfig(num_groups=2, topk_groups=3)", ValueError),
    ("RouterConfig(route_scale=0.0)", ValueError),
    ("RouterConfig(route_scale='2')", TypeError),
    ("RouterConfig(aux_loss='z')", ValueError),
    ("TopKRouter(16, 8, 2, config=RouterConfig(aux_loss='sequence'))(x)", ValueError),
    ("TopKRouter(16, 8, 2, config='deepseek-v3')", TypeError),
    ("route_topk(logits, 2, selection_bias=torch.zeros(3))", ValueError),  # an expert bias of the wrong length
    ("route_topk(logits, 2, selection_bias=torch.zeros(1))", ValueError),  # would broadcast
    ("moe_experts(x, routing, w, (w1[:, :32], w1[:, 32:31]), w2)", ValueError),  # W1's two parts differ
    ("moe_experts(x, routing, w, (w1[:, :32], w1[:, 32:], w1[:, 32:]), w2)", ValueError),
    ("MoELayer(16, 32, 4, 2, shared=SharedConfig(count=0))", ValueError),
    ("RouterConfig.family('llama')", ValueError),
    ("ModelConfig(dense_layers=3)", ValueError),
    ("ModelConfig(n_layers=0)", ValueError),
    ("ModelConfig(n_heads=3)", ValueError),
    ("ModelConfig(vocab_size=256.0)", TypeError),
    ("ModelConfig(top_k=9)", ValueError),
    ("ModelConfig(experts=ExpertsConfig(backend='gpu'))", ValueError),
    ("layer(torch.tensor(1.0))", ValueError),
    ("layer(torch.randn(4, 15))", ValueError),
    ("layer(torch.ones(4, 16, dtype=torch.long))", TypeError),
    ("layer(x.numpy())", TypeError),
    ("build_routing_index(torch.tensor([[0, 4]]), 4)", ValueError),
    ("build_routing_index(torch.tensor([[-1, 0]]), 4)", ValueError),
    ("build_routing_index(torch.tensor([[1, 1]]), 4)", ValueError),
    ("build_routing_index(torch.tensor([[0.0, 1.0]]), 4)", TypeError),
    ("build_routing_index(torch.tensor([0, 1]), 4)", ValueError),
    ("build_routing_index(idx, 1)", ValueError),
    ("build_routing_index(idx, 4, method='radix')", ValueError),
    ("moe_experts(x, routing, w, w1[:, :32], w2)", ValueError),
    ("moe_experts(x, routing, w, w1, w2[:3])", ValueError),
    ("moe_experts(x[:, :8], routing, w, w1, w2)", ValueError),
    ("moe_experts(x.double(), routing, w, w1, w2)", TypeError),
    ("moe_experts(x[:5], routing, w[:5], w1, w2)", ValueError),
    ("moe_experts(x, routing, w[:, :1], w1, w2)", ValueError),
    ("moe_experts(x, routing, w.int(), w1, w2)", TypeError),
    ("moe_experts(x, routing, torch.full_like(w, float('nan')), w1, w2)", ValueError),
    ("moe_experts(x, routing, w, w1, w2, activation='tanh')", ValueError),
    ("moe_experts(x, routing, w, w1, w2, checkpoint='all')", ValueError),
    ("moe_experts(x, routing, w, w1, w2, precision='fp4')", ValueError),
    ("moe_experts(x, routing, w, w1, w2, chunk_tokens=0)", ValueError),
    ("moe_experts(x, routing, w, w1, w2, experts=ExpertsConfig(backend='triton'))  # CPU, TRITON_INTERPRET unset",
     RuntimeError),
    ("moe_experts(x.bfloat16(), routing, w, w1.bfloat16(), w2.bfloat16(), experts=ExpertsConfig(backend='triton'))",
     TypeError),
    ("ExpertsConfig(fp8_weight_cache=True)", ValueError),
    ("MoELayer(16, 32, 4, 2, router='deepseek')", TypeError),
    ("MoELayer(16, 32, 4, 2, router=['sigmoid_topk'])", TypeError),
    ("MoELayer(16, 32, 8, 2, scoring='softmax_topk', router='deepseek-v3')", TypeError),  # a name is no config
    ("MoELayer(16, 32, 4, 2, shared_gate=True)", TypeError),  # SharedConfig(gated=True) holds it
    ("MoELayer(16, 32, 4, 2, shared=SharedConfig(gated='no'))", TypeError),
    ("MoELayer(16, 32, 4, 2, shared=SharedConfig(), shared_experts=2)", TypeError),  # both forms
    ("MoELayer(16, 32, 4, 2, rounding='up')", TypeError),
    ("ModelConfig(shared=SharedConfig(d_hidden=0))", ValueError),
    ("ModelConfig(num_experts=16, router=RouterConfig.family('deepseek-v3'), top_k=9)", ValueError),
    ("layer.router(x[:, :8])", ValueError),
    ("layer.router(x[None])", ValueError),
    ("layer.router(x, seq_len=0)", ValueError),
    ("layer.router(x, seq_len=4)  # 6 tokens", ValueError),
    ("MoELayer(16, 32, 4, 2, experts=ExpertsConfig(), activation='gelu')", TypeError),
    ("configure(None)", TypeError),
    ("configure(torch.nn.Linear(4, 4))", ValueError),
    ("moe_experts(x, routing, w, w1, w2, b1=torch.zeros(4, 32))", ValueError),
    ("moe_experts(x, routing, w, w1, w2, b2=torch.zeros(4, 16).double())", TypeError),
    ("moe_experts(x.half(), routing, w, w1.half(), w2)", TypeError),  # float32 masters: only under precision='fp8'
    ("moe_experts(x.half(), routing, w, w1, w2.half(), experts=ExpertsConfig(precision='fp8'))", TypeError),  # all
    ("moe_experts(x, routing, w, w1[:, :32], w2, activation='gelu', interleaved=True)", ValueError),
    ("round_to_index(logits, idx, w, 16, 'sr-f', max_experts=2, max_rows=40)", ValueError),
    ("round_to_index(logits[:5], idx, w, 16, max_experts=2, max_rows=40)", ValueError),
    ("round_to_index(logits.int(), idx, w, 16, max_experts=2, max_rows=40)", TypeError),
    ("round_to_index(logits[0], idx, w, 16, max_experts=2, max_rows=40)", ValueError),
    ("round_to_index(logits, idx, w[:, :1], 16, max_experts=2, max_rows=40)", ValueError),
    ("round_to_index(logits, idx, w, 16, max_experts=1, max_rows=40)", ValueError),
    ("round_to_index(logits, idx + 2, w, 16, max_experts=2, max_rows=40)", ValueError),
    ("round_to_index(logits, idx, w, 16, route_scale=float('nan'))", ValueError),
    ("round_to_index(logits, idx, w, 16, route_scale=-1.0)", ValueError),
    ("round_to_index(logits, idx, w, 16, renormalize='yes')", TypeError),
    ("round_to_index(logits, idx[:, [0, 0]], w, 16)", ValueError),
    ("round_to_index(logits, idx, w * float('nan'), 16)", ValueError),
    ("round_to_index(logits * float('inf'), idx, w, 16)", ValueError),
    ("round_tokens(logits, idx + 2, w, 16)", ValueError),
    ("round_tokens(logits, idx[:, [0, 0]], w, 16)", ValueError),
    ("moe_experts(x, routing, w, (w1,), w2)", ValueError),  # W1 in one part, as a 1-tuple
    ("build_routing_index(idx, 4.0)", TypeError),
    ("configure(torch.nn.Linear(4, 4), ExpertsConfig(activation='gelu'))", ValueError),  # read from the model
    ("converter(ep='exact')", TypeError),  # moeblaze's expert parallelism is an EPConfig
    ("converter(ep_dispatch='exact')", TypeError),  # the flat fields of before
    ("converter(ep=EPConfig('capacity', capacity_factor='2'))", TypeError),
    ("ExpertParallel(layer.experts, None)", TypeError),
    ("ExpertParallel(layer.experts, None, ep_config='capacity')", TypeError),
    ("ExpertParallel(layer.experts, None, ep_config=EPConfig('capacity', capacity_factor=float('inf')))", ValueError),
    ("ExpertParallel(layer.experts, None, ep_config=EPConfig('capacity'), tracker=16)", TypeError),
    ("EPConfig('alltoall')", ValueError),
    ("EPConfig('capacity', capacity_factor=float('inf'))", ValueError),
    ("EPConfig('capacity', capacity='64')", TypeError),
    ("EPConfig('capacity', capacity=64, capacity_factor=2.0)", ValueError),
    ("EPConfig('capacity', on_overflow='ignore')", ValueError),
    ("EPConfig(capacity_factor=2.0)", ValueError),  # exact dispatch reads no capacity option
    ("EPConfig(chunks=0)", ValueError),
    ("ep_experts(x, idx, w, w1, w2, experts=ExpertsConfig(chunk_tokens=4))", ValueError),
    ("ep_experts(x, idx, w, w1, w2, dispatch='alltoall')", TypeError),  # keyword options: EPConfig holds them
    ("load_checkpoint(damaged)", ValueError),
    ("moeblaze train --steps -5", SystemExit),
    ("moeblaze train --batch-size 0", SystemExit),
    ("moeblaze train --seq-len 0", SystemExit),
    ("moeblaze train --eval-every 0", SystemExit),
    ("moeblaze train --eval-batches 0", SystemExit),
    ("moeblaze train --fsdp-units layers", SystemExit),
    ("moeblaze train --save-every 0", SystemExit),
    ("moeblaze train --lr 0", SystemExit),
    ("moeblaze train --top-k 9", SystemExit),
    ("moeblaze train --n-heads 3", SystemExit),
    ("moeblaze train --save notes.txt/ck.pt", SystemExit),
    ("moeblaze train --save .", SystemExit),
    ("moeblaze train --resume --save ''", SystemExit),
    ("moeblaze train --ep 2  # one process", SystemExit),
    ("moeblaze train --ep-dispatch capacity", SystemExit),
    ("moeblaze train --capacity-factor 0", SystemExit),
    ("moeblaze train --router deepseek-v3 --num-experts 4", SystemExit),
    ("moeblaze train --ep 2 --checkpoint-policy preact-fp8", SystemExit),
    ("moeblaze train --ep 2 --token-rounding nr-f", SystemExit),
    ("moeblaze train --ep 2 --precision fp8", SystemExit),
    ("moeblaze train --cuda-graph  # on a CPU", SystemExit),
    ("moeblaze train --cuda-graph --ep 2", SystemExit),
    ("moeblaze train --cuda-graph --ep 2 --ep-dispatch capacity", SystemExit),
    ("moeblaze train --cuda-graph --ep 2 --ep-dispatch capacity --on-overflow error", SystemExit),
    ("moeblaze train --cuda-graph --precision fp8 --fp8-weight-cache", SystemExit),
    ("moeblaze train --cuda-graph --compile", SystemExit),
    ("moeblaze train --save ckdir/", SystemExit),
    ("moeblaze train --save notes.txt --resume", SystemExit),  # not a checkpoint: said before any work
    ("moeblaze train --save notes.txt", SystemExit),  # a file there already: never replaced unasked
    ("moeblaze train --resume --overwrite", SystemExit),
    ("moeblaze train --fp8-min-rows 0", SystemExit),
    ("moeblaze train --n-layers 1 --dense-layers 1", SystemExit),
    ("moeblaze train --stpes 10", SystemExit),
    ("moeblaze profile --impl reference --backend tl", SystemExit),
    ("moeblaze profile --device cuda  # on a CPU", SystemExit),
    ("moeblaze profile --top-k 9", SystemExit),
    ("moeblaze profile --tokens 0", SystemExit),
    ("moeblaze bench --configs Z", SystemExit),
    ("moeblaze bench --config 1,2,3", SystemExit),
    ("moeblaze bench --impls fastest", SystemExit),
    ("moeblaze train --loss-log .", SystemExit),
    ("moeblaze train --loss-log notes.txt/loss.jsonl", SystemExit),
    ("moeblaze train --bench-steps 2 --results notes.txt/sub", SystemExit),
    ("moeblaze train --preset gpt5", SystemExit),  # argparse's own refusals: one line too
    ("moeblaze train --lr 1e-3x", SystemExit),
    ("moeblaze train --resume missing.pt", SystemExit),
    ("moeblaze train --on-overflow drop", SystemExit),  # read by capacity dispatch only
    ("moeblaze train --capacity-factor 2", SystemExit),
    ("moeblaze train --rounding-tile 64", SystemExit),  # read by token rounding only
    ("moeblaze train --backend gluon  # TRITON_INTERPRET=1, no GPU", SystemExit),
    ("moeblaze train --ep 2 --chunk-tokens 64", SystemExit),
    ("moeblaze bench --activation tanh", SystemExit),
    ("moeblaze bench --out notes.txt/sub", SystemExit),
    ("moeblaze bench --policies bogus", SystemExit),
    ("moeblaze bench --config 0,16,8,4,2", SystemExit),
]


HEADER = """# Bad inputs and the errors they get

Every input below is rejected with the error shown. The table is generated by `tests/test_bad_inputs.py`,
which checks each row. Names: `x` (6, 16) fp32 tokens, `idx` (6, 2) int32 expert ids,
`routing = build_routing_index(idx, 4)`, `w` (6, 2) router weights, `logits` (6, 4) router logits, `w1` (4, 64, 16),
`w2` (4, 16, 32),
`layer = MoELayer(16, 32, 4, 2)`, `configure` is `moeblaze.integrations.transformers.configure`,
`converter(**options)` is `MoeblazeConverter(MoeblazeConverter.Config(**options))` (torchtitan);
`damaged` is a checkpoint with a wrong checksum; command lines run in a
folder holding a file `notes.txt`.

Value checks (ids out of range, a token routed twice to one expert, NaN weights) raise on the CPU; on a GPU
they are device-side asserts, which stop the program without a host sync. `moeblaze` command lines print
the one line shown and exit with status 2 before any work starts.
"""


def _relative(message: str, tmp: str) -> str:
    for folder in (os.path.realpath(tmp), tmp):
        message = message.replace(folder + os.sep, "")
    return message


def _converter(**options):
    """The torchtitan converter with these options (its import needs torchtitan)."""
    from moeblaze.integrations.torchtitan import MoeblazeConverter
    return MoeblazeConverter(MoeblazeConverter.Config(**options))


def _configure(*args, **kwargs):
    """The transformers backend's configure (its import needs transformers)."""
    from moeblaze.integrations.transformers import configure
    return configure(*args, **kwargs)


def outcome(call: str, tmp: str) -> tuple[type, str]:
    """(exception type, message) of one case; SystemExit for a command line that exits with status 2."""
    torch.manual_seed(0)
    if call.startswith("moeblaze "):
        err, cwd = io.StringIO(), os.getcwd()
        pathlib.Path(tmp, "notes.txt").write_text("")
        os.chdir(tmp)
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                rc = main(shlex.split(call.split("  #")[0])[1:])
        except SystemExit as e:  # argparse's own checks (choices, types) exit from inside parse_args
            rc = e.code
        finally:
            os.chdir(cwd)
        assert rc == 2, f"{call}: exit status {rc}"
        lines = err.getvalue().strip().splitlines()
        assert len(lines) == 1, f"{call}: {len(lines)} lines: {lines}"  # the one line the doc promises
        return SystemExit, _relative(lines[0], tmp)
    x, w1, w2 = torch.randn(6, 16), torch.randn(4, 64, 16), torch.randn(4, 16, 32)
    idx = torch.stack([torch.randperm(4)[:2] for _ in range(6)]).int()
    damaged = os.path.join(tmp, "damaged.pt")
    with open(damaged, "wb") as f:
        f.write(b"moeblaze-checkpoint 1 " + b"0" * 64 + b"\npayload")
    names = dict(torch=torch, MoELayer=MoELayer, TopKRouter=TopKRouter, ModelConfig=ModelConfig,
                 build_routing_index=build_routing_index, moe_experts=moe_experts, ep_experts=ep_experts,
                 load_checkpoint=load_checkpoint, round_to_index=round_to_index, round_tokens=round_tokens,
                 route_topk=route_topk,
                 logits=torch.randn(6, 4),
                 x=x, idx=idx, routing=build_routing_index(idx, 4), w=torch.rand(6, 2), w1=w1, w2=w2,
                 layer=MoELayer(16, 32, 4, 2), damaged=damaged, ExpertsConfig=ExpertsConfig, configure=_configure,
                 converter=_converter, ExpertParallel=ExpertParallel, RouterConfig=RouterConfig,
                 SharedConfig=SharedConfig, RoundingConfig=RoundingConfig, EPConfig=EPConfig)
    interpret = moeblaze.env.INTERPRET
    moeblaze.env.INTERPRET = "TRITON_INTERPRET unset" not in call and interpret
    try:
        eval(call.split("  #")[0], names)
    except Exception as e:
        return type(e), _relative(str(e), tmp)
    finally:
        moeblaze.env.INTERPRET = interpret
    raise AssertionError(f"{call} raised nothing")


def render(tmp: str) -> str:
    rows = [HEADER, "| input | raises | message |", "|---|---|---|"]
    for call, _ in CASES:
        exc, msg = outcome(call, tmp)
        kind = "exit 2" if exc is SystemExit else exc.__name__
        if exc is not SystemExit and exc.__base__ is not Exception:
            kind += f" ({exc.__base__.__name__})"
        rows.append(f"| `{call}` | {kind} | {msg.replace('|', '&#124;')} |")
    return "\n".join(rows) + "\n"


@pytest.mark.parametrize("call,exc", CASES, ids=[c for c, _ in CASES])
def test_bad_input_raises_what_it_should(tmp_path, call, exc):
    got, msg = outcome(call, str(tmp_path))
    assert issubclass(got, exc) and msg, (got, msg)


def test_a_numpy_integer_is_an_expert_count(poison_alloc):
    """numpy's integers pass the int check (numbers.Integral): the index's build takes them as the int they are,
    on the kernels too, where one once failed deep inside (`bit_length`)."""
    import numpy as np

    idx = torch.tensor([[0, 1], [2, 3], [1, 0]], dtype=torch.int32)
    for method in ("dense", "sort"):
        got, want = build_routing_index(idx, np.int64(4), method), build_routing_index(idx, 4, method)
        assert all(torch.equal(a, b) for a, b in zip(got.tensors(), want.tensors()))


def test_the_doc_table_shows_what_the_cases_raise(tmp_path):
    assert DOC.read_text() == render(str(tmp_path)), "docs/bad-inputs.md is stale: run python tests/test_bad_inputs.py"


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        DOC.write_text(render(d))
    print(f"wrote {DOC}")
    sys.exit(0)
