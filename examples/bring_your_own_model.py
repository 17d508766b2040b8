"""Bring your own model: a Llama-style decoder written for nothing but Flax NNX, trained
with data x tensor, fsdp and a 2-stage pipeline, with no adapter class.

    python examples/bring_your_own_model.py              # 20 steps per layout, temp dirs
    python examples/bring_your_own_model.py --steps 50

The model only names logical axes on its weights (``embed``, ``heads``, ``mlp``,
``vocab``) — the rules table maps them to mesh axes. Its layers are one stack made
with ``nnx.vmap`` and run with ``nnx.scan``; the pipeline finds that stack in the
traced loss and splits it into stages, with the embedding before it on the first
stage and the output after it on the last. The output projection is the input
embedding's table (tied): one parameter, its gradient the sum of both uses.
"""

import argparse
import math
import sys
import tempfile

import jax
import jax.numpy as jnp
from flax import nnx

import mindpipe_jax as mp


def param(rngs, shape, names, std=0.02):
    return nnx.Param(nnx.initializers.normal(std)(rngs.params(), shape), out_sharding=names,
                     eager_sharding=False)


def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def rotary(x):  # [batch, length, heads, head_dim]
    half = x.shape[-1] // 2
    angle = jnp.arange(x.shape[1])[:, None] / 10000 ** (jnp.arange(half) / half)
    cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1)


class Block(nnx.Module):
    """RMSNorm, grouped-query attention with rotary positions, SwiGLU."""

    def __init__(self, d, heads, kv_heads, ff, rngs):
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.norm1 = nnx.Param(jnp.ones(d), out_sharding=("norm",), eager_sharding=False)
        self.wq = param(rngs, (d, heads, self.hd), ("embed", "heads", None))
        self.wkv = param(rngs, (2, d, kv_heads, self.hd), (None, "embed", None, None))
        self.wo = param(rngs, (heads, self.hd, d), ("heads", None, "embed"))
        self.norm2 = nnx.Param(jnp.ones(d), out_sharding=("norm",), eager_sharding=False)
        self.w_gate_up = param(rngs, (2, d, ff), (None, "embed", "mlp"))
        self.w_down = param(rngs, (ff, d), ("mlp", "embed"))

    def __call__(self, x):
        h = rms_norm(x, self.norm1[...])
        q = rotary(jnp.einsum("btd,dnh->btnh", h, self.wq[...]))
        k, v = jnp.einsum("btd,cdnh->cbtnh", h, self.wkv[...])
        k = jnp.repeat(rotary(k), self.heads // self.kv_heads, axis=2)
        v = jnp.repeat(v, self.heads // self.kv_heads, axis=2)
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + jnp.einsum("btnh,nhd->btd", y, self.wo[...])
        h = rms_norm(x, self.norm2[...])
        gate, up = jnp.einsum("btd,cdf->cbtf", h, self.w_gate_up[...])
        return x + (jax.nn.silu(gate) * up) @ self.w_down[...]


class Llama(nnx.Module):
    def __init__(self, *, vocab=256, d=128, layers=4, heads=4, kv_heads=2, ff=344, rngs):
        self.tok_embeddings = param(rngs, (vocab, d), ("vocab", "embed"), 1 / math.sqrt(d))

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(rngs):
            return Block(d, heads, kv_heads, ff, rngs)

        self.layers = make_layers(rngs)
        self.norm = nnx.Param(jnp.ones(d), out_sharding=("norm",), eager_sharding=False)

    def __call__(self, tokens):  # [batch, length] ints -> [batch, length, vocab] logits
        h = jnp.take(self.tok_embeddings[...], tokens, axis=0)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, layer):
            return layer(x)

        return rms_norm(run(h, self.layers), self.norm[...]) @ self.tok_embeddings[...].T


LAYOUTS = {
    "data x tensor": ["parallel.data=4", "parallel.tensor=2"],
    "fsdp": ["parallel.data=1", "parallel.fsdp=8", "parallel.tensor=1"],
    "pipeline (1F1B) x data x tensor": ["parallel.pipe=2", "parallel.data=2", "parallel.tensor=2",
                                        "parallel.schedule=1f1b", "parallel.microbatches=4"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per layout (default: 20)")
    parser.add_argument("--out-dir", default=None, help="parent of the runs (default: a temp dir)")
    args = parser.parse_args()
    root = args.out_dir or tempfile.mkdtemp(prefix="mindpipe_byom_")
    base = ["model.seq_len=64", f"train.steps={args.steps}", "train.global_batch=16",
            f"train.log_every={max(args.steps // 5, 1)}", "train.eval_every=0", "train.progress=false",
            "train.tensorboard=false"]
    for i, (name, layout) in enumerate(LAYOUTS.items()):
        cfg = mp.load_config(overrides=[*base, *layout, f"train.out_dir={root}/{i}"])
        result = mp.train(lambda rngs: Llama(rngs=rngs), None, cfg)
        first, last = result.history[0]["loss"], result.history[-1]["loss"]
        mesh = {a: n for a, n in result.mesh.shape.items() if n > 1}
        print(f"{name:34s} loss {first:.4f} -> {last:.4f} over {result.step} steps (mesh {mesh})")
    print("The same model, data and seed: the layouts agree to float32 rounding.")


if __name__ == "__main__":
    try:
        main()
    except mp.ConfigError as err:  # a bad --steps or --out-dir: one line and exit 2, as `mindpipe` does
        print(f"{sys.argv[0]}: error: {err}", file=sys.stderr)
        sys.exit(2)
