"""Train a model of your own with mindpipe_jax: a tiny byte-level MLP language model.

    python examples/train_custom_model.py               # 100 steps, output in a new temp dir
    python examples/train_custom_model.py --steps 300 --out-dir runs/byte_mlp

Any Flax NNX module works: ``mindpipe_jax.train`` takes a factory ``rngs -> module``
(so the parameters are created directly in their shards), trains a model that
returns logits on next-token cross-entropy, and shards each parameter by the
logical axis names it carries (``out_sharding``) through the rules table. On a
machine without a GPU, ``train`` simulates 8 CPU devices (a data=4 x tensor=2 mesh).
The text is the Python standard library's own source, read byte by byte.
"""

import argparse
import sys
import tempfile

from flax import nnx

import mindpipe_jax as mp


class ByteMLP(nnx.Module):
    """Embed each byte, one hidden layer, logits for the next byte (a bigram model)."""

    def __init__(self, d_model: int, hidden: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(256, d_model, rngs=rngs)  # unnamed: replicated
        # Logical axes: the hidden layer is split over the `tensor` mesh axis.
        self.hidden = nnx.Linear(d_model, hidden, rngs=rngs,
                                 kernel_metadata={"out_sharding": ("embed", "mlp")})
        self.out = nnx.Linear(hidden, 256, rngs=rngs,
                              kernel_metadata={"out_sharding": ("mlp", None)})

    def __call__(self, tokens):  # [batch, length] ints -> [batch, length, 256] logits
        return self.out(nnx.gelu(self.hidden(self.embed(tokens))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="training steps (default: 100)")
    parser.add_argument("--out-dir", default=None,
                        help="where metrics and checkpoints go (default: a new temporary directory)")
    args = parser.parse_args()
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="mindpipe_byte_mlp_")

    config = mp.load_config(overrides=[
        "model.seq_len=64",            # sequence length of the batches
        f"train.steps={args.steps}",
        "train.global_batch=16",
        f"train.eval_every={max(args.steps // 2, 1)}",
        "train.progress=false",
        f"train.out_dir={out_dir}",
    ])
    result = mp.train(lambda rngs: ByteMLP(64, 128, rngs=rngs), config=config)

    print(f"final train loss {result.history[-1]['loss']:.3f}, "
          f"validation loss {result.final_val_loss:.3f}, output in {result.out_dir}")


if __name__ == "__main__":
    try:
        main()
    except mp.ConfigError as err:  # a bad --steps or --out-dir: one line and exit 2, as `mindpipe` does
        print(f"{sys.argv[0]}: error: {err}", file=sys.stderr)
        sys.exit(2)
