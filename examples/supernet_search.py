"""Train a small weight-sharing supernet with SPara, then search it for the best subnet.

    python examples/supernet_search.py                       # operator-causal, subnet=4 x data=2
    python examples/supernet_search.py --semantics sync --steps 60 --budget 60000

The supernet is the reference GPT with searchable blocks (``SuperGPT``): each of its
2 blocks chooses one of 3 FFN operators (gelu / relu / silu, each with its own
weights), the FFN's hidden width and the number of attention heads, and the model
chooses how many blocks run. Every step trains 4 subnets at once over the shared
weights: on a CPU-only machine the 8 simulated devices are split as
``subnet=4 x data=2`` (each subnet on its own pair of devices, its batch split over
the pair). The result is bit for bit the same on any number of devices.

Afterwards an evolutionary search scores subnets on held-out text with the weights
they inherit from the supernet — no retraining — and prints the best ones within a
parameter budget. The text is the Python standard library's own source, read byte
by byte (cached after the first run).
"""

import argparse
import sys

import numpy as np

import mindpipe_jax as mp
from mindpipe_jax.supernet import train_supernet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps (default: 40)")
    parser.add_argument("--semantics", default="operator-causal", choices=mp.supernet.SEMANTICS,
                        help="sync, sequential or operator-causal (default: operator-causal)")
    parser.add_argument("--subnet", type=int, default=4,
                        help="device groups the 4 subnets of a step are split over; the rest of the "
                             "devices split each subnet's batch (default: 4; use 1 on a single GPU)")
    parser.add_argument("--budget", type=int, default=0,
                        help="search only subnets with at most this many parameters (default: no limit)")
    args = parser.parse_args()

    config = mp.Config().replace(
        # A tiny byte-level GPT: 2 blocks, d_model 64, 4 heads, context 64.
        "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.seq_len=64",
        f"train.steps={args.steps}", "train.global_batch=16", "train.log_every=10",
        "optim.lr=3e-3", "optim.warmup_steps=5",
        # 8 devices: 4 groups train one subnet each, every subnet's batch split over 2.
        f"parallel.subnet={args.subnet}", "parallel.data=-1", "parallel.tensor=1",
        # The space and how it is trained.
        f"supernet.semantics={args.semantics}", "supernet.subnets_per_step=4",
        "supernet.strategy=sandwich",  # largest + smallest + 2 random subnets per step
        "supernet.ops=['gelu', 'relu', 'silu']", "supernet.ffn_ratios=[0.25, 0.5, 1.0]",
        # The search: 12 subnets, 3 generations of mutation and crossover, top 5.
        "supernet.search_population=12", "supernet.search_generations=3", "supernet.search_top_k=5",
        f"supernet.search_max_params={args.budget}",
    )
    result = train_supernet(config=config)  # prints progress and the search table

    space = result.space
    top = result.search.top[0]
    print(f"\nsearch space: {space.num_architectures:,} architectures; scored {result.search.evaluated}")
    print(f"best subnet {top['subnet']} = {top['arch']}: validation loss {top['loss']:.4f} nats/byte, "
          f"{top['params']:,} parameters")
    print("best validation loss per generation:",
          " ".join(f"{x:.4f}" for x in result.search.best_per_generation))
    # The trained weights serve any subnet: e.g. the largest one's next-byte logits.
    model = result.spec.merge(result.state["params"])
    prompt = np.frombuffer(b"def main():\n    ", np.uint8).astype(np.int32)[None]
    logits = model(prompt, space.largest())
    print(f"largest subnet's most likely byte after {bytes(prompt[0].astype(np.uint8))!r}:",
          repr(bytes([int(logits[0, -1].argmax())])))


if __name__ == "__main__":
    try:
        main()
    except mp.ConfigError as err:  # a bad --steps or --out-dir: one line and exit 2, as `mindpipe` does
        print(f"{sys.argv[0]}: error: {err}", file=sys.stderr)
        sys.exit(2)
