"""moeblaze.launch's cache key: at least as fine as Triton's specialization, so a cached kernel is only
relaunched for arguments Triton itself would have launched it for (the launches run on GPUs only; the
GPU test in tests/gpu/test_gpu.py checks their results); leave_sms's smaller persistent grids, which change
which program computes a tile and nothing else."""
import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from moeblaze import ExpertsConfig
from moeblaze.experts import moe_experts
from moeblaze.launch import arg_key, leave_sms, sm_count
from moeblaze.routing import build_routing_index

from helpers import random_problem


def test_tensor_keys_follow_dtype_and_16_byte_alignment():
    base = torch.empty(64)
    assert arg_key(base) == arg_key(torch.empty(8))
    assert arg_key(base[1:]) != arg_key(base)  # 4 bytes off: Triton specializes on 16-byte alignment
    assert arg_key(base[4:]) == arg_key(base)
    assert arg_key(base.to(torch.float16)) != arg_key(base)


def test_scalar_keys_are_exact_values():
    keys = {arg_key(v) for v in (1, 16, 17, 32, True, False, None, 1.0)}
    assert len(keys) == 8  # 1 and True, 1 and 1.0 differ too


def test_descriptor_keys_follow_shape_strides_and_block():
    t = torch.empty(64, 32)
    d = TensorDescriptor(t, [64, 32], [32, 1], [16, 16])
    assert arg_key(d) == arg_key(TensorDescriptor(torch.empty(64, 32), [64, 32], [32, 1], [16, 16]))
    assert arg_key(d) != arg_key(TensorDescriptor(t, [64, 32], [32, 1], [16, 32]))
    assert arg_key(d) != arg_key(TensorDescriptor(t, [48, 32], [32, 1], [16, 16]))
    assert arg_key(d) != arg_key(TensorDescriptor(t[:, :16], [64, 16], [32, 1], [16, 16]))


def test_leave_sms_shrinks_persistent_grids_on_this_thread_and_restores_them():
    cpu = torch.device("cpu")
    assert sm_count(cpu) == 4  # the interpreter's grid
    with leave_sms(1):
        assert sm_count(cpu) == 3
        with leave_sms(16):
            assert sm_count(cpu) == 1  # never below one program
        assert sm_count(cpu) == 3
    with pytest.raises(RuntimeError), leave_sms(2):
        raise RuntimeError
    assert sm_count(cpu) == 4


@pytest.mark.parametrize("checkpoint", ["preact", "recompute"])
def test_fewer_persistent_programs_give_the_same_bits(checkpoint):
    """The op's output and every gradient with the persistent kernels on 4, 3 and 1 programs: bit for bit equal."""
    torch.manual_seed(3)
    x, w1, w2, idx, w = random_problem(40, 16, 16, 4, 2, skew="skewed")
    dy = torch.randn(40, 16)
    config = ExpertsConfig(checkpoint=checkpoint)
    results = []
    for left in (0, 1, 3):
        leaves = [t.clone().requires_grad_() for t in (x, w, w1, w2)]
        with leave_sms(left):
            out = moe_experts(leaves[0], build_routing_index(idx, 4), leaves[1], leaves[2], leaves[3], config=config)
            grads = torch.autograd.grad(out, leaves, dy)
        results.append((out, *grads))
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            assert torch.equal(a, b)
