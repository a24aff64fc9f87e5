"""`moeblaze train`'s models by name (--preset); a flag given on the command line overrides its preset's value.
Torch-free: the command line reads it before torch loads. Memory: none (data)."""
from __future__ import annotations

# "small": the default model. "qwen3-30b-a3b": MoE layers shaped as Qwen3-30B-A3B's (hidden 2048, 128 experts,
# top-8, expert width 768; 16 heads of 128), 4 of them. "deepseek-v3-small": DeepSeek-V3's routing (sigmoid scores,
# expert-bias balancing, 8 groups of which 4 are kept, scale 2.5, the sequence loss), a shared expert and a dense
# first layer, at a small size. "qwen3-next-small": Qwen3-Next's routing (softmax, renormalized, global-batch loss)
# with a gated shared expert. "deepseek-v3-layer": one MoE layer shaped as DeepSeek-V3's (hidden 7168, 256 experts,
# top-8, expert width 2048, a shared expert; 56 heads of 128) with its routing: 11.5 B parameters, whose fp32
# weights, gradients and AdamW's two states take 185 GB: not one H200 (its forward and backward fit, the optimizer's
# states do not), a quarter of that each on four under FSDP2, an eighth on eight.
SHAPE = ("seq_len", "d_model", "n_layers", "n_heads", "num_experts", "top_k", "d_expert")
EXTRAS = ("router", "shared_experts", "d_shared", "shared_gate", "dense_layers")
PRESETS = {
    "small": dict(seq_len=128, d_model=128, n_layers=2, n_heads=4, num_experts=8, top_k=2, d_expert=256),  # the model
    "qwen3-30b-a3b": dict(seq_len=4096, d_model=2048, n_layers=4, n_heads=16, num_experts=128, top_k=8,
                          d_expert=768),
    "deepseek-v3-small": dict(seq_len=128, d_model=128, n_layers=3, n_heads=4, num_experts=16, top_k=2, d_expert=128,
                              router="deepseek-v3", shared_experts=1, dense_layers=1),
    "qwen3-next-small": dict(seq_len=128, d_model=128, n_layers=2, n_heads=4, num_experts=16, top_k=4, d_expert=64,
                             router="qwen3-next", shared_experts=1, d_shared=128, shared_gate=True),
    "deepseek-v3-layer": dict(seq_len=4096, d_model=7168, n_layers=1, n_heads=56, num_experts=256, top_k=8,
                              d_expert=2048, router="deepseek-v3", shared_experts=1),
}
