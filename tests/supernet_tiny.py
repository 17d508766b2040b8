"""The tiny SuperGPT the SPara layout and pipeline tests share: its config, four subnets of
three sliced shapes, the optimizer settings and a batch maker."""

from __future__ import annotations

import numpy as np

from mindpipe_jax.config import ModelConfig, OptimConfig
from mindpipe_jax.supernet import SuperGPT

CFG = ModelConfig(d_model=32, n_layers=2, n_heads=4, seq_len=32)  # d_ff 128, vocab 256
OPS = ("gelu", "silu", "tanh")
OPTIM = OptimConfig(lr=3e-3, warmup_steps=0, clip_norm=0.5, eps=1e-3)
# depth, then (op, FFN width of (32, 64, 128), heads of 1..4) per block: three sliced shapes.
SUBNETS = np.array([[1, 0, 0, 0, 1, 1, 2],
                    [0, 2, 2, 3, 0, 0, 0],
                    [1, 1, 2, 2, 2, 2, 1],
                    [0, 1, 0, 0, 0, 0, 0]], np.int32)


def make_tiny(rngs):
    return SuperGPT(CFG, ops=OPS, ffn_widths=(32, 64, 128), depths=(1, 2), rngs=rngs)


def tiny_batch(rows, seed):
    toks = np.random.default_rng(seed).integers(0, 256, (rows, CFG.seq_len + 1)).astype(np.int32)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
