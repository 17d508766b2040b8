"""Per-device bytes of the train state (parameters, AdamW's state) as the train
layout stores them, beside the rules table's storage alone (the embedding and head
whole on every pipeline stage) and a replicated optimizer state (what the compiled
``tx.init`` gave before ``train/state.py`` placed the moments as their parameters).

Shapes and shardings only: nothing is allocated or compiled, so the figures are
exact for this model on any machine. Usage::

    python benchmarks/state_memory.py [--vocab 32768] [--d-model 256] [--layers 8]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

import mindpipe_jax as mp  # noqa: E402
from mindpipe_jax.models import build_model  # noqa: E402
from mindpipe_jax.train.reconfigure import build_layout  # noqa: E402
from mindpipe_jax.train.state import model_spec  # noqa: E402

LAYOUTS = {
    "fsdp8": ["parallel.fsdp=8", "parallel.data=1"],
    "pipe2 x fsdp4": ["parallel.pipe=2", "parallel.fsdp=4", "parallel.data=1", "parallel.microbatches=4"],
    "pipe4 x data2": ["parallel.pipe=4", "parallel.data=2", "parallel.microbatches=4"],
    "pipe2 x data2 x tensor2": ["parallel.pipe=2", "parallel.data=2", "parallel.tensor=2",
                                "parallel.microbatches=4"],
}


def per_device(tree) -> int:
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
               for x in jax.tree.leaves(tree))


def whole(tree) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    model = [f"model.vocab_size={args.vocab}", f"model.d_model={args.d_model}",
             f"model.n_layers={args.layers}", "model.n_heads=4", "model.seq_len=128", "train.global_batch=16",
             "parallel.tensor=1"]
    mib = 2**20
    print(f"GPT vocab {args.vocab}, d_model {args.d_model}, {args.layers} layers, 8 devices; MiB per device")
    print(f"{'layout':26s} {'params':>8s} {'rules only':>11s} {'AdamW':>8s} {'replicated':>11s} "
          f"{'model / 8':>10s}")
    for name, over in LAYOUTS.items():
        cfg = mp.Config().replace(*model, *over)
        layout = build_layout(cfg, lambda c: (lambda rngs: build_model(c.model, rngs)))
        with jax.set_mesh(None):
            rules_only, _ = model_spec(lambda rngs, m=cfg.model: build_model(m, rngs), layout.mesh,
                                       cfg.train.seed)
        state = layout.abstract_state
        print(f"{name:26s} {per_device(state['params']) / mib:8.2f}"
              f" {per_device(rules_only.abstract_params) / mib:11.2f}"
              f" {per_device(state['opt']) / mib:8.2f} {whole(state['opt']) / mib:11.2f}"
              f" {whole(state['params']) / 8 / mib:10.2f}")
    print("params: as the train layout stores them; rules only: the rules table alone (embedding and head "
          "whole on every stage); AdamW: its state as stored; replicated: that state whole on every device")


if __name__ == "__main__":
    main()
