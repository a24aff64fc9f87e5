"""What the benchmarks name, torch-free (the command line offers and refuses these before torch loads): the
anchors' configs, the implementations of the side-by-side layer benchmark (moeblaze.bench.harness.IMPLS runs
them) and the experts backends of the transformers benchmark (moeblaze.bench.hf).

Memory: none (names).
"""
from __future__ import annotations

# (L tokens, d hidden, h expert intermediate, E experts, K top-k): the anchors' configs
CONFIGS = {
    "A": (8192, 1024, 4096, 16, 2),
    "B": (32768, 2048, 8192, 16, 2),
    "C": (24576, 1536, 256, 128, 8),
    "D": (32768, 2048, 768, 128, 8),
    "E": (32768, 4096, 1024, 64, 4),
}
# what `moeblaze bench` on the CPU measures by default: small enough for Triton's interpreter
CPU_CONFIG = ("cpu", (128, 32, 64, 4, 2))
IMPLS = ("moeblaze", "moeblaze-tl", "moeblaze-gluon", "moeblaze-fp8", "moeblaze-e4m3", "moeblaze-e4m3-cached",
         "reference", "torch_gmm", "sonicmoe", "liger")
HF_BACKENDS = ("eager", "grouped_mm", "batched_mm", "sonicmoe", "moeblaze-preact", "moeblaze-recompute")
