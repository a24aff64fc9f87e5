"""The router's options against hand-computed cases: sigmoid scores with renormalization and a route scale, a
selection bias that changes the choice and not the weights, group-limited selection, gpt-oss's learned gate bias
with a softmax over the chosen logits, the expert-bias sign rule, the per-sequence loss and the global-batch loss
(2 CPU processes: the ranks' mean equals one process's switch loss over every token)."""
import math

import pytest
import torch

from moeblaze import RouterConfig
from moeblaze.routing import TopKRouter, route_topk, update_expert_biases
from moeblaze.routing.router import sequence_aux_loss, switch_aux_loss

from helpers import run_ranks


def sig(v):
    return 1 / (1 + math.exp(-v))


def test_sigmoid_scores_renormalized_and_scaled():
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    idx, w = route_topk(logits, 2, "sigmoid_topk", renormalize=True, route_scale=2.5)
    assert idx.tolist() == [[1, 3]]
    s1, s3 = sig(2.0), sig(1.0)
    assert torch.allclose(w, torch.tensor([[2.5 * s1 / (s1 + s3), 2.5 * s3 / (s1 + s3)]]))
    _, raw = route_topk(logits, 2, "sigmoid_topk", renormalize=False)
    assert torch.allclose(raw, torch.tensor([[s1, s3]]))


def test_selection_bias_moves_the_choice_not_the_weights():
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    bias = torch.tensor([0.0, 0.0, 0.9, 0.0])  # sigmoid(-1) + 0.9 = 1.169 > sigmoid(1) = 0.731
    idx, w = route_topk(logits, 2, "sigmoid_topk", renormalize=False, selection_bias=bias)
    assert idx.tolist() == [[2, 1]]
    assert torch.allclose(w, torch.tensor([[sig(-1.0), sig(2.0)]]))


def test_group_limited_selection():
    # 4 groups of 2 experts, scored by the sum of their two: g0 = 0.9 + 0, g1 = 0.5 + 0.49, g2 = 0.46 + 0.45, g3 = 0
    scores = torch.tensor([[0.9, 0.0, 0.5, 0.49, 0.46, 0.45, 0.0, 0.0]])
    logits = torch.log(scores.clamp(min=1e-9))  # softmax of log(s) is s / sum(s)
    chosen = {g: sorted(route_topk(logits, 2, "softmax_topk", num_groups=4, topk_groups=g)[0].tolist()[0])
              for g in (1, 2, 3)}
    assert chosen == {1: [2, 3], 2: [2, 3], 3: [0, 2]}  # expert 0, the best alone, is out until g0 is kept
    assert sorted(route_topk(logits, 2, "softmax_topk")[0].tolist()[0]) == [0, 2]
    with pytest.raises(ValueError, match="top_k"):
        route_topk(logits, 3, "softmax_topk", num_groups=4, topk_groups=1)
    with pytest.raises(ValueError, match="divide"):
        route_topk(logits, 2, "softmax_topk", num_groups=3)


def test_gate_bias_and_softmax_over_the_chosen_logits():
    r = TopKRouter(2, 4, 2, config=RouterConfig(scoring="topk_softmax", gate_bias=True))
    with torch.no_grad():
        r.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]))
        r.bias.copy_(torch.tensor([0.0, 0.0, -3.0, 2.5]))
    out = r(torch.tensor([[1.0, 2.0]]))  # logits + bias: 1, 2, 0, 2.5
    assert out.topk_idx.tolist() == [[3, 1]]
    e = math.exp(0.5)
    assert torch.allclose(out.topk_weights, torch.tensor([[e / (e + 1), 1 / (e + 1)]]))
    out.topk_weights[0, 0].backward()
    assert r.bias.grad is not None and r.bias.grad.abs().sum() > 0


def test_expert_bias_sign_rule():
    r = TopKRouter(4, 4, 1, config=RouterConfig(scoring="sigmoid_topk", expert_bias=True, expert_bias_rate=0.01))
    with torch.no_grad():
        r.weight.copy_(torch.eye(4))
    x = torch.tensor([[5.0, 0, 0, 0]] * 4 + [[0, 0, 5.0, 0]] * 2 + [[0, 0, 0, 5.0]] * 2)  # loads 4, 0, 2, 2
    r(x)
    r.eval()
    r(x)  # evaluation counts nothing
    r.train()
    assert r.expert_load.tolist() == [4, 0, 2, 2]
    assert update_expert_biases(torch.nn.Sequential(r)) == 1
    assert torch.allclose(r.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))  # sign(2 - load), centred
    assert r.expert_load.tolist() == [0, 0, 0, 0]
    assert r.weight.grad is None and not r.expert_bias.requires_grad


def test_sequence_loss_hand_computed():
    # 2 sequences of 2 tokens, E = 2, K = 1; uniform probabilities: P = 1/2 everywhere
    logits = torch.zeros(4, 2)
    idx = torch.tensor([[0], [0], [0], [1]])
    # sequence 0: f = (1, 0) -> 2 * (1 * 0.5) = 1; sequence 1: f = (1/2, 1/2) -> 2 * 0.5 = 1
    assert torch.allclose(sequence_aux_loss(logits, idx, 2), torch.tensor(1.0))
    # a sequence's imbalance counts even where the batch as a whole is balanced
    logits = torch.tensor([[2.0, 0.0], [2.0, 0.0], [0.0, 2.0], [0.0, 2.0]])
    idx = torch.tensor([[0], [0], [1], [1]])
    p = 1 / (1 + math.exp(-2.0))
    assert torch.allclose(sequence_aux_loss(logits, idx, 2), torch.tensor(2 * p))
    assert torch.allclose(switch_aux_loss(logits, idx), torch.tensor(1.0))
    with pytest.raises(ValueError, match="whole sequences"):
        sequence_aux_loss(logits, idx, 3)
    r = TopKRouter(2, 2, 1, config=RouterConfig(aux_loss="sequence"))
    with pytest.raises(ValueError, match="seq_len"):
        r(torch.randn(4, 2))


def _global(rank, world, errors):
    torch.manual_seed(0)
    r = TopKRouter(8, 6, 2, config=RouterConfig(aux_loss="global"))
    x_all = torch.randn(10 * world, 8, generator=torch.Generator().manual_seed(1))
    want = switch_aux_loss(x_all @ r.weight.t(), route_topk(x_all @ r.weight.t(), 2)[0])
    mine = r(x_all[10 * rank: 10 * (rank + 1)]).aux_loss
    total = mine.detach().clone()
    torch.distributed.all_reduce(total)
    # fp32 both ways, the per-rank counts summed in another order and one division: within 8 ulps (2^-23 each)
    if not torch.allclose(total / world, want, rtol=1e-6):
        errors.put(f"rank {rank}: mean global loss {float(total / world)} vs one process {float(want)}")
    e = TopKRouter(8, 6, 2, config=RouterConfig(expert_bias=True))
    e(x_all[10 * rank: 10 * (rank + 1)])
    load = e.update_expert_bias()
    one = TopKRouter(8, 6, 2, config=RouterConfig(expert_bias=True))
    one.load_state_dict(e.state_dict() | {"expert_bias": torch.zeros(6), "expert_load": torch.zeros(6)})
    one(x_all)
    if not torch.equal(load, one.expert_load):
        errors.put(f"rank {rank}: summed loads {load.tolist()} vs one process {one.expert_load.tolist()}")


def test_global_loss_and_bias_counts_over_ranks():
    run_ranks(_global, 2)
