"""On CUDA GPUs (`pytest -m gpu`): scripts/megatron_check.py under torchrun on one GPU (NCCL, world 1) and, where
the machine has two, expert parallelism over two: moeblaze's Megatron-Core layer against Megatron's own (fp32
within 1e-6, bf16 within twice Megatron's own error against fp64) and a dist-checkpointing round trip."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("gpus", [1, 2])
def test_megatron_layer_equals_megatrons_own(gpus, tmp_path):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}", "--standalone",
                        os.path.join(ROOT, "scripts", "megatron_check.py"), "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    print(r.stdout)
