"""moeblaze.launch's cache key: at least as fine as Triton's specialization, so a cached kernel is only
relaunched for arguments Triton itself would have launched it for (the launches run on GPUs only; the
GPU test in tests/gpu/test_gpu.py checks their results)."""
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from moeblaze.launch import arg_key


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
