"""Framework overhead: ``mindpipe_jax.train`` vs a minimal hand-written jitted step.

Same model (the reference GPT, d_model=128, 4 layers, 4 heads, seq_len=128), same
global batch (32 rows of synthetic tokens), same update (fp32 AdamW, lr 3e-3, b1 0.9,
b2 0.95, weight decay 0.1; mindpipe's lr follows its cosine schedule and its decay
mask skips norms and biases: a scalar and a mask, no measurable cost), on 1 device
and on 8 simulated CPU devices (data parallel). Each device count runs in its own
subprocess, because ``jax_num_cpu_devices`` must be set before JAX starts: the
script re-invokes itself with ``--worker N``.

Method — the two sides alternate every K=5 steps inside ONE ``train`` call:

* mindpipe is timed by its own history: with ``train.log_every=5``,
  ``TrainResult.history[i]["step_time_s"]`` is the wall time between two
  consecutive host syncs (``device_get`` of the metrics) divided by the 5 steps in
  between, so it includes all the loop's host work: grain batch,
  ``make_array_from_process_local_data``, dispatch, tqdm, metrics writer.
* The hand-written side runs *between* those intervals: the loop calls its
  ``mfu`` helper once per interval, after it has read the clock and before it
  restarts it, so a wrapper around ``mfu`` runs 5 hand-written steps (dispatch,
  then block on the last loss) there, and that time is outside mindpipe's
  intervals by construction. Interval i of mindpipe and block i of the
  hand-written step are therefore adjacent in time (ABAB...), so a shared
  machine's drift hits both alike; besides the medians, the median of the paired
  ratios is reported.
* Compile and warm-up are excluded: ``train`` compiles its step ahead of time,
  before the loop; the hand-written step is compiled and run 3 times before
  ``train`` starts; the first interval and the first block are dropped.
* The process's CPU time (``time.process_time``: all threads, XLA's included) is
  recorded for each interval and block too. Other tenants of the machine inflate
  wall time more than CPU time (XLA's spinning worker threads still inflate it
  somewhat), so both are printed.

The hand-written step: ``nnx.split`` the model, ``jax.value_and_grad`` of
``model.loss``, ``optax.adamw``, ``jax.jit`` donating params and optimizer state,
params replicated and the batch sharded over a one-axis ``data`` mesh (``Auto``
axes); each step moves a host NumPy batch (the same synthetic tokens) to the
devices with ``jax.device_put``. mindpipe runs with ``optim.clip_norm=0`` and
``optim.warmup_steps=0`` so both compute the same update (clipping is a
user-chosen extra reduction, not loop overhead); everything else is the default
loop (progress bar and TensorBoard on; the only checkpoint is after the last
interval, outside the timing).

Usage: ``python benchmarks/train_overhead.py [--steps 60] [--devices 1 8]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

K = 5  # steps per timed interval (= train.log_every)
MODEL = ("model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.seq_len=128")
BATCH = 32


def _worker(n: int, steps: int) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", n)
    import tempfile
    from functools import partial

    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import mindpipe_jax as mp
    from mindpipe_jax.data import load_tokens

    assert len(jax.devices()) == n
    tmp = tempfile.mkdtemp(prefix="train_overhead_")
    cfg = mp.Config().replace(
        *MODEL, 'data.source="synthetic"', f"train.global_batch={BATCH}", f"train.steps={steps}",
        f"train.log_every={K}", "train.eval_every=0", "train.checkpoint_every=0",
        f'train.out_dir="{tmp}/run"', "optim.clip_norm=0", "optim.warmup_steps=0",
        f"parallel.data={n}", "parallel.tensor=1", "parallel.simulate_cpu_devices=0")
    splits = load_tokens(cfg.data, cfg.model.vocab_size)

    # --- the hand-written side ---------------------------------------------------------
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    graphdef, params = nnx.split(mp.GPT(cfg.model, rngs=nnx.Rngs(0)), nnx.Param)
    tx = optax.adamw(cfg.optim.lr, b1=cfg.optim.b1, b2=cfg.optim.b2, eps=cfg.optim.eps,
                     weight_decay=cfg.optim.weight_decay)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    batch_sharding = NamedSharding(mesh, P("data"))

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        def loss_fn(p):
            return nnx.merge(graphdef, p).loss(batch["inputs"], batch["targets"])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    T = cfg.model.seq_len
    rows = np.lib.stride_tricks.sliding_window_view(splits.train[: 64 * BATCH * T + 1], T + 1)[::T]
    host_batches = [{"inputs": rows[i * BATCH:(i + 1) * BATCH, :-1].astype(np.int32),
                     "targets": rows[i * BATCH:(i + 1) * BATCH, 1:].astype(np.int32)}
                    for i in range(64)]
    hand = {"params": params, "opt": jax.jit(tx.init)(params), "i": 0}

    def hand_steps(count: int):
        for _ in range(count):
            batch = jax.device_put(host_batches[hand["i"] % 64], batch_sharding)
            hand["params"], hand["opt"], loss = step(hand["params"], hand["opt"], batch)
            hand["i"] += 1
        loss.block_until_ready()

    t0 = time.perf_counter()
    hand_steps(3)  # compile + warm-up
    hand_warm_s = time.perf_counter() - t0

    # --- interleave: K hand-written steps at each of mindpipe's interval boundaries -----
    loop = sys.modules["mindpipe_jax.train.loop"]
    real_mfu = loop.mfu
    marks = []  # per interval: (cpu at mindpipe's sync, hand wall, hand cpu, cpu after hand block)

    def mfu_then_hand_block(*args, **kwargs):
        c0 = time.process_time()
        hand_wall = hand_cpu = float("nan")
        if len(marks) < steps // K - 1:  # none after the last interval
            t, c = time.perf_counter(), time.process_time()
            hand_steps(K)
            hand_wall, hand_cpu = (time.perf_counter() - t) / K, (time.process_time() - c) / K
        marks.append((c0, hand_wall, hand_cpu, time.process_time()))
        return real_mfu(*args, **kwargs)

    loop.mfu = mfu_then_hand_block
    t0 = time.perf_counter()
    try:
        result = mp.train(data=splits, config=cfg)
    finally:
        loop.mfu = real_mfu
    train_s = time.perf_counter() - t0
    wall = [h["step_time_s"] for h in result.history if "step_time_s" in h]
    assert len(wall) == len(marks) == steps // K, (len(wall), len(marks), steps // K)
    # Pair i >= 1: mindpipe interval i (after hand block i-1), then hand block i.
    pairs = range(1, steps // K - 1)
    return {
        "devices": n,
        "mindpipe": [wall[i] for i in pairs],
        "hand": [marks[i][1] for i in pairs],
        "mindpipe_cpu": [(marks[i][0] - marks[i - 1][3]) / K for i in pairs],
        "hand_cpu": [marks[i][2] for i in pairs],
        "hand_warm_s": hand_warm_s,
        "train_s": train_s,
    }


def _machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()}-core CPU container ({cpu})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=60,
                    help=f"mindpipe steps per device count (a multiple of {K}); as many hand-written")
    args = ap.parse_args()
    if args.steps % K or args.steps < 3 * K:
        ap.error(f"--steps must be a multiple of {K} and at least {3 * K}")
    if args.worker:
        print("RESULT " + json.dumps(_worker(args.worker, args.steps)), flush=True)
        return

    from importlib.metadata import version

    import numpy as np

    print(f"# train overhead: mindpipe_jax.train vs a hand-written jitted step — "
          f"{time.strftime('%Y-%m-%d %H:%M %Z')}")
    print(f"# machine: {_machine()}; jax {version('jax')}, flax {version('flax')}, "
          f"optax {version('optax')}; load average at start "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"# GPT {' '.join(m.split('.')[1] for m in MODEL)}, global batch {BATCH}, fp32 AdamW; "
          f"{args.steps} steps per side, alternating every {K} steps in one train() call; "
          f"first interval dropped")
    rows = []
    t_start = time.perf_counter()
    for n in args.devices:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"}
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", str(n),
                               "--steps", str(args.steps)],
                              env=env, capture_output=True, text=True, timeout=900)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            sys.exit(f"worker for {n} devices failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        res = json.loads(line[len("RESULT "):])
        med = {k: 1e3 * float(np.median(res[k])) for k in ("mindpipe", "hand", "mindpipe_cpu", "hand_cpu")}
        med["paired"] = float(np.median(np.divide(res["mindpipe"], res["hand"])))
        med["paired_cpu"] = float(np.median(np.divide(res["mindpipe_cpu"], res["hand_cpu"])))
        rows.append((n, med))
        for key, label in (("mindpipe", "mindpipe wall"), ("hand", "hand-written wall"),
                           ("mindpipe_cpu", "mindpipe CPU"), ("hand_cpu", "hand-written CPU")):
            print(f"# {n} device(s), {label} ms/step per {K}-step interval: "
                  f"{' '.join(f'{1e3 * t:.0f}' for t in res[key])}")
        print(f"# {n} device(s): hand-written compile + 3 steps {res['hand_warm_s']:.1f}s; "
              f"train() call (setup, compile, both sides' steps, final checkpoint) {res['train_s']:.1f}s")
    print()
    print(f"{'devices':>7}  {'mindpipe ms/step':>16}  {'hand-written ms/step':>20}  {'ratio':>6}  "
          f"{'paired':>6}  |  {'CPU ms/step: mindpipe':>21}  {'hand-written':>12}  {'ratio':>6}  "
          f"{'paired':>6}")
    for n, m in rows:
        print(f"{n:>7}  {m['mindpipe']:>16.1f}  {m['hand']:>20.1f}  {m['mindpipe'] / m['hand']:>6.3f}  "
              f"{m['paired']:>6.3f}  |  {m['mindpipe_cpu']:>21.1f}  {m['hand_cpu']:>12.1f}  "
              f"{m['mindpipe_cpu'] / m['hand_cpu']:>6.3f}  {m['paired_cpu']:>6.3f}")
    print("# ms/step: median over the intervals; ratio = mindpipe / hand-written (goal <= 1.05); "
          "paired = median of the per-interval ratios of adjacent mindpipe/hand-written intervals")
    print(f"# total {time.perf_counter() - t_start:.0f}s; load average at end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
