"""GPT train-step throughput on one accelerator: tokens/s, TFLOP/s, MFU, per-layer F/B/W/BW.

    python benchmarks/gpu/train_step.py            # H200-sized GPT in bf16 (run via run.sh)
    python benchmarks/gpu/train_step.py --smoke    # tiny config, any device (CPU: seconds)

The full train step (forward, backward, clip + AdamW via optax) of the reference GPT
is jitted once, warmed up, then timed as the median of ``--steps`` steps, each waited
for with ``block_until_ready``. Compute is bf16, parameters and optimizer state fp32.
``--batch 0`` (default) picks the batch from XLA's own memory analysis: two small
batches are compiled, their memory extrapolated linearly to ``--mem-frac`` of the
device's memory, and the chosen batch is compiled and checked before it runs (halved
while it does not fit). Model FLOPs are ``flops_per_token`` (6N + attention, PaLM's
convention) × tokens/s; MFU divides by the device's dense bf16 peak from
``mindpipe_jax.train.metrics.PEAK_TFLOPS`` (H200: 989 TFLOP/s) or ``--peak-tflops``.
Then ``measure_layer_costs`` times one block's F, B, W and BW (and the embed and head)
at the same batch, the numbers the pipeline simulator takes.

A results file ``DATE-<device>-<platform>.txt`` goes to ``--out``, else to ``$OUT``
when set (the device tool's folder of files that come back), else (not with
``--smoke``) to ``benchmarks/results/``.

Only ``mindpipe_jax.models.gpt``, ``config``, ``train.metrics`` and
``parallel.pipeline.profile`` are used, but importing any of them runs the package's
``__init__``, which imports ``dacite`` (config), ``grain`` (data) and the training
loop. Where such a package is not installed (the H200 image has neither dacite nor
grain, and nothing can be fetched there) an inert stand-in module is registered so
the import succeeds; nothing here calls it. Carried wheels (``.whl/``, see run.sh)
take precedence when installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import importlib.util
import math
import os
import statistics
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
T_START = time.perf_counter()
sys.path.insert(0, str(REPO))


def _stub_missing(names=("dacite", "grain", "tensorboardX")) -> list[str]:
    """Register an inert module for each absent import-time dependency; return their names."""
    stubbed = []
    for name in names:
        if importlib.util.find_spec(name) is not None:
            continue
        mod = types.ModuleType(name)

        def __getattr__(attr, _name=name):
            if attr.startswith("__"):
                raise AttributeError(attr)

            def unavailable(*args, **kwargs):
                raise ImportError(f"{_name} is not installed (benchmark stand-in module)")

            # A class, so it can be called at import time, subclassed or used in except.
            return type(attr, (Exception,), {"__init__": lambda self, *a, **k: None,
                                            "__call__": unavailable})

        mod.__getattr__ = __getattr__
        sys.modules[name] = mod
        stubbed.append(name)
    return stubbed


STUBBED = _stub_missing()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxlib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from mindpipe_jax.config import ModelConfig  # noqa: E402
from mindpipe_jax.models.gpt import GPT, flops_per_token, matmul_params  # noqa: E402
from mindpipe_jax.parallel.pipeline.plan.profile import measure_layer_costs  # noqa: E402
from mindpipe_jax.train.metrics import PEAK_TFLOPS, peak_flops_per_device  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny config for any device (CPU check)")
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--remat", choices=("none", "dots", "full"), default="none")
    p.add_argument("--attention", choices=("auto", "xla", "cudnn"), default="auto",
                   help="auto: cudnn flash attention on a GPU, xla elsewhere")
    p.add_argument("--no-compare", action="store_true",
                   help="skip re-timing the step with XLA attention at the same batch")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="skip the optional parts (comparison, per-layer costs) past this many seconds")
    p.add_argument("--batch", type=int, default=0, help="0: choose from memory_analysis")
    p.add_argument("--mem-frac", type=float, default=0.85, help="share of device memory to fill")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layer-repeats", type=int, default=5)
    p.add_argument("--no-layers", action="store_true", help="skip the per-layer F/B/W/BW costs")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="override the device's peak")
    p.add_argument("--out", default="", help="directory for the results file")
    a = p.parse_args(argv)
    if a.smoke:
        a.d_model, a.heads, a.layers, a.seq, a.vocab = 64, 4, 2, 64, 256
        a.batch = a.batch or 2
        a.steps, a.warmup, a.layer_repeats = 2, 1, 1
    return a


class Log:
    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, *parts):
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.lines.append(line)


def make_step(cfg: ModelConfig):
    model = GPT(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1))

    def loss_fn(p, x, y):
        return nnx.merge(graphdef, p).loss(x, y)

    def step(p, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        updates, opt_state = opt.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    opt_state = opt.init(params)
    return jax.jit(step, donate_argnums=(0, 1)), params, opt_state


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def compiled_bytes(step, params, opt_state, batch: int, seq: int) -> tuple[int, object]:
    tok = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    compiled = step.lower(_abstract(params), _abstract(opt_state), tok, tok).compile()
    m = compiled.memory_analysis()
    if m is None:
        return 0, compiled
    total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
             + m.temp_size_in_bytes)
    return int(total), compiled


def device_capacity() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit") or None


def choose_batch(step, params, opt_state, seq: int, args, log: Log, given: int = 0,
                 fit: bool = False) -> tuple[int, object]:
    cap = device_capacity()
    while given:
        need, compiled = compiled_bytes(step, params, opt_state, given, seq)
        log(f"batch {given} (given): XLA memory {need / 2**30:.2f} GiB"
            + (f" of {cap / 2**30:.1f} GiB" if cap else ""))
        if not (fit and cap and need > args.mem_frac * cap and given > 1):
            return given, compiled
        given //= 2
    if cap is None:
        raise SystemExit("no device memory limit known: pass --batch")
    budget = args.mem_frac * cap
    m1, _ = compiled_bytes(step, params, opt_state, 1, seq)
    m4, _ = compiled_bytes(step, params, opt_state, 4, seq)
    per = max((m4 - m1) / 3, 1.0)
    fixed = m1 - per
    b = int(max(1, min(args.max_batch, (budget - fixed) // per)))
    log(f"memory_analysis: batch 1 {m1 / 2**30:.2f} GiB, batch 4 {m4 / 2**30:.2f} GiB -> "
        f"{per / 2**30:.3f} GiB per sequence; budget {budget / 2**30:.1f} of {cap / 2**30:.1f} GiB")
    # Round down to a multiple of 8 where that is possible (friendlier GEMM shapes).
    if b >= 16:
        b -= b % 8
    while True:
        need, compiled = compiled_bytes(step, params, opt_state, b, seq)
        log(f"batch {b}: XLA memory {need / 2**30:.2f} GiB")
        if need <= budget or b == 1:
            return b, compiled
        b = max(1, b // 2 if b < 16 else b - 8)


def time_steps(compiled, params, opt_state, tokens, targets, steps: int, warmup: int):
    losses, times = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, tokens, targets)
        loss = float(jax.block_until_ready(loss))
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
            losses.append(loss)
    return times, losses


def matmul_ceiling(n: int, repeats: int = 10) -> float:
    """Measured bf16 matrix-product rate (FLOP/s) of an n x n x n product on random data:
    the ceiling this device reaches in practice, beside its datasheet peak."""
    key = jax.random.key(0)
    a = jax.random.normal(key, (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    for _ in range(3):
        mm(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def device_slug(dev) -> str:
    kind = dev.device_kind
    for name in PEAK_TFLOPS:
        if name.lower() in kind.lower():
            return name.lower().replace(" ", "")
    return "".join(c for c in kind.split()[0].lower() if c.isalnum()) or dev.platform


def main(argv=None) -> int:
    args = parse_args(argv)
    log = Log()
    dev = jax.devices()[0]
    now = _dt.datetime.now(_dt.UTC)
    cmd = " ".join([os.path.relpath(sys.argv[0], REPO) if sys.argv[0] else "train_step.py"]
                   + (sys.argv[1:] if argv is None else list(argv)))
    log(f"# GPT train step benchmark, {now:%Y-%m-%d %H:%M} UTC")
    log(f"# device: {dev.device_kind} ({dev.platform}), {jax.device_count()} device(s); "
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}")
    log(f"# command: python {cmd}")
    log(f"# XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
    if STUBBED:
        log(f"# not installed, stood in for (unused here): {', '.join(STUBBED)}")

    attention = args.attention
    if attention == "auto":
        attention = "cudnn" if dev.platform == "gpu" else "xla"
    cfg = ModelConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model,
                      n_layers=args.layers, n_heads=args.heads, dtype="bfloat16",
                      param_dtype="float32", remat=args.remat, attention=attention)
    n_params = matmul_params(cfg) + cfg.vocab_size * cfg.d_model + cfg.seq_len * cfg.d_model
    fpt = flops_per_token(cfg)
    log(f"model: d_model={cfg.d_model} heads={cfg.n_heads} layers={cfg.n_layers} "
        f"seq={cfg.seq_len} vocab={cfg.vocab_size} ff={cfg.ff_dim} remat={cfg.remat} "
        f"attention={cfg.attention}, "
        f"bf16 compute, fp32 params; ~{n_params / 1e9:.3f} B params; "
        f"{fpt / 1e9:.3f} GFLOP/token (train)")

    out = args.out or os.environ.get("OUT") or ("" if args.smoke else str(REPO / "benchmarks" / "results"))
    path = Path(out) / f"{now:%Y-%m-%d}-{device_slug(dev)}-{dev.platform}.txt" if out else None

    def save():
        # After every section, so a run cut short by its time limit still leaves its numbers.
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(log.lines) + "\n")

    n = 1024 if args.smoke else 8192
    ceiling = matmul_ceiling(n)
    log(f"bf16 {n}x{n}x{n} matmul, random data, median of 10: {ceiling / 1e12:.1f} TFLOP/s measured")
    args.ceiling = ceiling

    try:
        cfg, batch, stats = run_section(cfg, args, log, args.batch)
    except Exception as e:  # noqa: BLE001 - a kernel the image lacks must not cost the whole run
        if cfg.attention != "cudnn":
            raise
        log(f"attention=cudnn failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            f"falling back to attention=xla")
        cfg = dataclasses.replace(cfg, attention="xla")
        cfg, batch, stats = run_section(cfg, args, log, args.batch)
    save()
    elapsed = lambda: time.perf_counter() - T_START  # noqa: E731

    if cfg.attention == "cudnn" and not args.no_compare:
        if elapsed() > args.budget_s * 0.55:
            log(f"skipped: attention=xla comparison ({elapsed():.0f} s spent of {args.budget_s:.0f})")
        else:
            xla_cfg = dataclasses.replace(cfg, attention="xla")
            try:
                _, xla_batch, xla = run_section(xla_cfg, args, log, batch, fit=True)
                log(f"cudnn / xla attention: tokens/s {stats['tok_s'] / xla['tok_s']:.3f}x "
                    f"(batch {batch} vs {xla_batch}), step time at batch {batch}: "
                    + (f"{xla['med'] / stats['med']:.3f}x" if xla_batch == batch else "n/a"))
            except Exception as e:  # noqa: BLE001
                log(f"attention=xla comparison failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        save()

    if not args.no_layers:
        if elapsed() > args.budget_s * 0.75:
            log(f"skipped: per-layer costs ({elapsed():.0f} s spent of {args.budget_s:.0f})")
        else:
            layer_costs(cfg, batch, stats["med"], args, log)
        save()

    log(f"# total {elapsed():.0f} s")
    save()
    if path is not None:
        print(f"results written to {path}")
    return 0


def run_section(cfg: ModelConfig, args, log: Log, given_batch: int, fit: bool = False):
    """Compile the train step for ``cfg`` (batch given, or chosen from memory), time it,
    log tokens/s, TFLOP/s and MFU. ``fit``: halve a given batch until it fits."""
    t0 = time.perf_counter()
    step, params, opt_state = make_step(cfg)
    log(f"-- attention={cfg.attention}")
    batch, compiled = choose_batch(step, params, opt_state, cfg.seq_len, args, log, given_batch, fit)
    log(f"compile + batch choice: {time.perf_counter() - t0:.1f} s")
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len)), jnp.int32)
    times, losses = time_steps(compiled, params, opt_state, tokens, targets, args.steps, args.warmup)
    del params, opt_state, compiled
    med = statistics.median(times)
    tok_s = batch * cfg.seq_len / med
    tflops = tok_s * flops_per_token(cfg) / 1e12
    peak = peak_flops_per_device(args.peak_tflops)
    log(f"train step: batch {batch} x seq {cfg.seq_len} = {batch * cfg.seq_len} tokens; "
        f"median {med * 1e3:.2f} ms over {len(times)} steps (min {min(times) * 1e3:.2f}, "
        f"max {max(times) * 1e3:.2f}); loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    log(f"tokens/s: {tok_s:.1f}")
    log(f"TFLOP/s: {tflops:.3f} (model FLOPs, 6N + attention)")
    if peak:
        log(f"MFU: {100 * tflops * 1e12 / peak:.2f}% of {peak / 1e12:.0f} TFLOP/s bf16 dense peak "
            f"({100 * tflops * 1e12 / args.ceiling:.1f}% of the measured matmul rate)")
    else:
        log(f"MFU: n/a (no published peak for {jax.devices()[0].device_kind}; pass --peak-tflops)")
    if not all(math.isfinite(x) for x in losses):
        log("WARNING: non-finite loss")
    return cfg, batch, {"med": med, "tok_s": tok_s, "tflops": tflops}


def layer_costs(cfg: ModelConfig, batch: int, step_s: float, args, log: Log) -> None:
    t1 = time.perf_counter()
    prof = measure_layer_costs(cfg, microbatch=batch, repeats=args.layer_repeats, dots=False,
                               model=lambda rngs: GPT(cfg, rngs=rngs))
    log(f"per-layer costs (measure_layer_costs, attention={cfg.attention}, microbatch {batch}, "
        f"median of {args.layer_repeats}; {time.perf_counter() - t1:.1f} s):")
    parts = [("embed", prof.embed), ("layer", prof.layers[0]), ("head", prof.head)]
    for name, c in parts:
        log(f"  {name:5s} F {c.F * 1e3:9.3f} ms  B {c.B * 1e3:9.3f} ms  W {c.W * 1e3:9.3f} ms  "
            f"BW {c.fused * 1e3:9.3f} ms  act {c.activation_bytes / 2**20:9.1f} MiB  "
            f"params {c.param_bytes / 2**20:9.1f} MiB")
    lay = prof.layers[0]
    total = prof.embed.F + prof.embed.fused + prof.head.F + prof.head.fused \
        + cfg.n_layers * (lay.F + lay.fused)
    log(f"  sum F+BW over embed + {cfg.n_layers} layers + head: {total * 1e3:.2f} ms "
        f"(train step {step_s * 1e3:.2f} ms; the rest is the optimizer and fusion differences)")
    log(f"  residual bytes per layer: {prof.residual_bytes[0] / 2**20:.1f} MiB")


if __name__ == "__main__":
    raise SystemExit(main())
