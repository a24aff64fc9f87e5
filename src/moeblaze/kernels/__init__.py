"""@triton.jit kernels and their launch configurations; nothing else. Launchers live in routing/ and ops/."""
