"""The whole ``mindpipe_jax.train`` loop on one accelerator, against the bare train step.

    bash benchmarks/gpu/loop.sh             # on the lent H200 (carry .whl: see loop.sh)
    python benchmarks/gpu/train_loop.py --smoke

Same model (the reference GPT in bf16 with fp32 parameters), same batch, same
update (clip 1.0 + AdamW): first the bare jitted step of ``train_step.py`` is
timed (median of ``--steps`` after warm-up), then ``mindpipe_jax.train`` runs
``--loop-steps`` steps on synthetic tokens with its default loop (grain loader,
host-to-device batches, metrics every ``log_every`` steps, TensorBoard, a
checkpoint at the end, outside the timed intervals), then the bare step again,
so drift shows as a difference between the two bare medians. The loop is timed
by its own history (``step_time_s`` per logging interval, the first interval,
which holds the first dispatch, dropped). Printed: both step times, their ratio
(the framework's overhead), tokens/s and MFU of each.

Unlike ``train_step.py`` this needs the framework's import-time dependencies
(dacite, grain, tensorboardX); the H200 image lacks them, so ``loop.sh`` installs
wheels carried in ``.whl/``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE)]

MISSING = [m for m in ("dacite", "grain", "tensorboardX") if importlib.util.find_spec(m) is None]
if MISSING:
    raise SystemExit(f"train_loop.py needs {', '.join(MISSING)} (the whole framework runs here); "
                     f"carry their wheels in .whl/ as benchmarks/gpu/loop.sh says")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import train_step as bare  # noqa: E402

import mindpipe_jax as mp  # noqa: E402
from mindpipe_jax.models.gpt import flops_per_token  # noqa: E402
from mindpipe_jax.train.metrics import peak_flops_per_device  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny config for any device (CPU check)")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--attention", choices=("auto", "xla", "cudnn"), default="auto")
    p.add_argument("--steps", type=int, default=10, help="timed bare steps (each side)")
    p.add_argument("--loop-steps", type=int, default=60)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", default="", help="directory for the results file")
    a = p.parse_args(argv)
    if a.smoke:
        a.d_model, a.heads, a.layers, a.seq, a.vocab, a.batch = 64, 4, 2, 64, 256, 4
        a.steps, a.loop_steps, a.log_every = 3, 30, 5
    if a.loop_steps < 3 * a.log_every:
        p.error(f"--loop-steps={a.loop_steps} must be >= 3 x --log-every={a.log_every} "
                f"(the first interval is dropped, two must remain)")
    return a


def bare_step_s(cfg, args, log) -> float:
    step, params, opt_state = bare.make_step(cfg)
    _, compiled = bare.compiled_bytes(step, params, opt_state, args.batch, cfg.seq_len)
    rng = np.random.default_rng(0)
    shape = (args.batch, cfg.seq_len)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, shape), jnp.int32)
    targets = jnp.asarray(rng.integers(0, cfg.vocab_size, shape), jnp.int32)
    times, _ = bare.time_steps(compiled, params, opt_state, tokens, targets, args.steps, 2)
    med = statistics.median(times)
    log(f"bare step: median {med * 1e3:.2f} ms over {len(times)} "
        f"(min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f})")
    return med


def loop_step_s(cfg, args, log, out_dir: str) -> float:
    run = mp.Config().replace(
        f"model.vocab_size={cfg.vocab_size}", f"model.seq_len={cfg.seq_len}",
        f"model.d_model={cfg.d_model}", f"model.n_layers={cfg.n_layers}", f"model.n_heads={cfg.n_heads}",
        'model.dtype="bfloat16"', 'model.param_dtype="float32"', f'model.attention="{cfg.attention}"',
        'data.source="synthetic"', f"train.global_batch={args.batch}", f"train.steps={args.loop_steps}",
        f"train.log_every={args.log_every}", "train.eval_every=0", "train.checkpoint_every=0",
        f'train.out_dir="{out_dir}"', "train.progress=false")
    t0 = time.perf_counter()
    result = mp.train(config=run)
    wall = time.perf_counter() - t0
    intervals = [h["step_time_s"] for h in result.history if "step_time_s" in h][1:]
    med = statistics.median(intervals)
    log(f"mindpipe_jax.train: {args.loop_steps} steps, {len(intervals)} timed intervals of "
        f"{args.log_every} steps: median {med * 1e3:.2f} ms per step "
        f"(intervals {', '.join(f'{x * 1e3:.1f}' for x in intervals)}); "
        f"whole call {wall:.1f} s with compile and final checkpoint")
    return med


def main(argv=None) -> int:
    args = parse_args(argv)
    log = bare.Log()
    dev = jax.devices()[0]
    attention = args.attention
    if attention == "auto":
        attention = "cudnn" if dev.platform == "gpu" else "xla"
    cfg = bare.ModelConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model,
                           n_layers=args.layers, n_heads=args.heads, dtype="bfloat16",
                           param_dtype="float32", attention=attention)
    log(f"# mindpipe_jax.train loop vs bare step, {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC")
    log(f"# device: {dev.device_kind} ({dev.platform}), {jax.device_count()} device(s); "
        f"jax {jax.__version__}")
    log(f"# command: python benchmarks/gpu/train_loop.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    log(f"model: d_model={cfg.d_model} heads={cfg.n_heads} layers={cfg.n_layers} seq={cfg.seq_len} "
        f"vocab={cfg.vocab_size} attention={cfg.attention}, batch {args.batch}")

    before = bare_step_s(cfg, args, log)
    with tempfile.TemporaryDirectory(prefix="mindpipe_loop_") as tmp:
        loop = loop_step_s(cfg, args, log, os.path.join(tmp, "run"))
    after = bare_step_s(cfg, args, log)

    bare_med = statistics.median([before, after])
    tokens = args.batch * cfg.seq_len
    peak = peak_flops_per_device(0.0)
    for name, s in (("bare step", bare_med), ("train loop", loop)):
        tflops = tokens / s * flops_per_token(cfg) / 1e12
        mfu = f", MFU {100 * tflops * 1e12 / peak:.2f}%" if peak else ""
        log(f"{name:10s}: {s * 1e3:9.2f} ms/step, {tokens / s:10.1f} tokens/s, {tflops:.3f} TFLOP/s{mfu}")
    log(f"loop / bare step time: {loop / bare_med:.3f} (bare before/after: {after / before:.3f})")

    out = args.out or os.environ.get("OUT") or ("" if args.smoke else str(REPO / "benchmarks" / "results"))
    if out:
        path = Path(out) / f"{time.strftime('%Y-%m-%d', time.gmtime())}-{bare.device_slug(dev)}-loop.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(log.lines) + "\n")
        print(f"results written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
