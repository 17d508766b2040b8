"""Framework overhead: ``mindpipe_jax.train`` vs a minimal hand-written jitted step.

Same model (the reference GPT, d_model=128, 4 layers, 4 heads, seq_len=128), same
global batch (32 rows of synthetic tokens), same update (fp32 AdamW, lr 3e-3, b1 0.9,
b2 0.95, weight decay 0.1; mindpipe's lr follows its cosine schedule and its decay
mask skips norms and biases: a scalar and a mask, no measurable cost), on 1 device
and on 8 simulated CPU devices
(data parallel). Each device count runs in its own subprocess, because
``jax_num_cpu_devices`` must be set before JAX starts: the script re-invokes
itself with ``--worker N``.

Method (the same clock on both sides):

* Both sides are timed over **intervals of K=5 steps that end in one host sync**.
  For mindpipe that is exactly what ``TrainResult.history[i]["step_time_s"]``
  is with ``train.log_every=5``: the wall time between two consecutive
  ``device_get`` of the metrics, divided by the steps in between, so it includes
  all host work of the loop (grain batch, ``make_array_from_process_local_data``,
  dispatch, tqdm, metrics writer). The hand-written side dispatches K steps and
  then blocks on the last loss, timed with the same ``perf_counter``.
* The machine may be shared, so wall time is noisy. The process's CPU time
  (``time.process_time``: all threads, XLA's included) per interval is measured
  too: for mindpipe by wrapping the loop's ``mfu`` helper, which it calls once
  per interval right after the sync (a probe that adds no work), for the
  hand-written side around each interval. Work done is what CPU time counts, and
  other tenants do not inflate it.
* Compile and warm-up are excluded: ``train`` compiles its step ahead of time,
  before the loop whose intervals are timed, and the hand-written step is
  compiled and run 3 times before any timing. The first interval of every
  ``train`` call (and of every hand-written block) is dropped as warm-up (first
  execution of a freshly loaded executable, grain's prefetch thread starting).
  The jit cache is persisted to a temporary directory so that the later
  ``train`` calls (same config, same program) load their step instead of
  compiling it again: that only shortens the benchmark.
* The two sides **alternate** in rounds (mindpipe 20 steps, hand-written 20
  steps, order swapped every round), so drift of a shared machine hits both;
  the table gives the median interval of each side.

What the hand-written step does: ``nnx.split`` the model, ``jax.value_and_grad``
of ``model.loss``, ``optax.adamw``, ``jax.jit`` with the params and optimizer
state donated, params replicated and the batch sharded over a ``data`` mesh
(``Auto`` axes). It moves one host batch (NumPy, from the same synthetic tokens)
to the devices with ``jax.device_put`` each step. mindpipe runs with
``optim.clip_norm=0`` and ``optim.warmup_steps=0`` so that both compute the same
update (clipping is a user-chosen extra reduction, not overhead); everything else
is the default loop (progress bar and TensorBoard on, checkpoint only at the end,
after the last timed interval).

Usage: ``python benchmarks/train_overhead.py [--rounds 3] [--devices 1 8]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

K = 5  # steps per timed interval (= train.log_every)
MODEL = ("model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.seq_len=128")
BATCH = 32


def _worker(n: int, rounds: int, steps: int) -> dict:
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

    tmp = tempfile.mkdtemp(prefix="train_overhead_")
    jax.config.update("jax_compilation_cache_dir", os.path.join(tmp, "jit_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    assert len(jax.devices()) == n

    base = mp.Config().replace(
        *MODEL, 'data.source="synthetic"', f"train.global_batch={BATCH}", f"train.log_every={K}",
        "train.eval_every=0", "train.checkpoint_every=0", "optim.clip_norm=0", "optim.warmup_steps=0",
        f"parallel.data={n}", "parallel.tensor=1", "parallel.simulate_cpu_devices=0")
    splits = load_tokens(base.data, base.model.vocab_size)
    calls = 0

    # CPU-time probe: the loop calls ``mfu`` once per interval, right after its sync.
    loop = sys.modules["mindpipe_jax.train.loop"]
    marks: list[float] = []
    real_mfu = loop.mfu

    def probe(*a, **k):
        marks.append(time.process_time())
        return real_mfu(*a, **k)

    loop.mfu = probe

    def mindpipe_intervals(num_steps: int) -> tuple[list[float], list[float]]:
        nonlocal calls
        calls += 1
        marks.clear()
        cfg = base.replace(f"train.steps={num_steps}", f'train.out_dir="{tmp}/run{calls}"')
        result = mp.train(data=splits, config=cfg)
        wall = [h["step_time_s"] for h in result.history if "step_time_s" in h]
        assert len(wall) == len(marks) == -(-num_steps // K), (len(wall), len(marks))
        cpu = [(b - a) / K for a, b in zip(marks[:-1], marks[1:], strict=True)]  # = wall[1:]
        return wall[1:], cpu

    # --- hand-written -------------------------------------------------------------
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    model = mp.GPT(base.model, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adamw(base.optim.lr, b1=base.optim.b1, b2=base.optim.b2, eps=base.optim.eps,
                     weight_decay=base.optim.weight_decay)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    opt_state = jax.jit(tx.init)(params)
    batch_sharding = NamedSharding(mesh, P("data"))

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        def loss_fn(p):
            return nnx.merge(graphdef, p).loss(batch["inputs"], batch["targets"])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    T = base.model.seq_len
    rows = np.lib.stride_tricks.sliding_window_view(splits.train[: 64 * BATCH * T + 1], T + 1)[::T]
    host_batches = [{"inputs": rows[i * BATCH:(i + 1) * BATCH, :-1].astype(np.int32),
                     "targets": rows[i * BATCH:(i + 1) * BATCH, 1:].astype(np.int32)}
                    for i in range(64)]
    state = {"params": params, "opt": opt_state, "i": 0}

    def hand_intervals(num_steps: int) -> tuple[list[float], list[float]]:
        wall, cpu = [], []
        for _ in range(num_steps // K):
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(K):
                batch = jax.device_put(host_batches[state["i"] % 64], batch_sharding)
                state["params"], state["opt"], loss = step(state["params"], state["opt"], batch)
                state["i"] += 1
            loss.block_until_ready()
            wall.append((time.perf_counter() - t0) / K)
            cpu.append((time.process_time() - c0) / K)
        return wall[1:], cpu[1:]

    # --- warm-up (compile, caches), then alternate -----------------------------------
    t0 = time.perf_counter()
    for _ in range(3):
        state["params"], state["opt"], loss = step(
            state["params"], state["opt"], jax.device_put(host_batches[0], batch_sharding))
    loss.block_until_ready()
    warm_hand = time.perf_counter() - t0
    out = {"mindpipe": [], "hand": [], "mindpipe_cpu": [], "hand_cpu": [], "mindpipe_call_s": []}
    for r in range(rounds):
        for side in (("mindpipe", "hand") if r % 2 == 0 else ("hand", "mindpipe")):
            t0 = time.perf_counter()
            wall, cpu = (mindpipe_intervals if side == "mindpipe" else hand_intervals)(steps)
            if side == "mindpipe":
                out["mindpipe_call_s"].append(time.perf_counter() - t0)
            out[side] += wall
            out[side + "_cpu"] += cpu
    return {"devices": n, "warm_hand_s": warm_hand, **out}


def _machine() -> str:
    cpu = platform.processor() or "cpu"
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
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help=f"steps per side per round (multiple of {K})")
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(_worker(args.worker, args.rounds, args.steps)), flush=True)
        return

    from importlib.metadata import version

    import numpy as np

    print(f"# train overhead: mindpipe_jax.train vs hand-written jitted step — "
          f"{time.strftime('%Y-%m-%d %H:%M %Z')}")
    print(f"# machine: {_machine()}; jax {version('jax')}; load average at start "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"# GPT {' '.join(m.split('.')[1] for m in MODEL)}, global batch {BATCH}, fp32 AdamW; "
          f"{args.rounds} alternating rounds x {args.steps} steps per side; "
          f"median of {K}-step intervals (first interval of each call dropped)")
    rows = []
    t_start = time.perf_counter()
    for n in args.devices:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"}
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", str(n),
                               "--rounds", str(args.rounds), "--steps", str(args.steps)],
                              env=env, capture_output=True, text=True, timeout=900)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            sys.exit(f"worker for {n} devices failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        res = json.loads(line[len("RESULT "):])
        med = {k: 1e3 * float(np.median(res[k])) for k in ("mindpipe", "hand", "mindpipe_cpu", "hand_cpu")}
        rows.append((n, med))
        for key, label in (("mindpipe", "mindpipe wall"), ("hand", "hand-written wall"),
                           ("mindpipe_cpu", "mindpipe CPU"), ("hand_cpu", "hand-written CPU")):
            print(f"# {n} device(s): {label} ms/step per interval: "
                  f"{' '.join(f'{1e3 * t:.0f}' for t in res[key])}")
        print(f"# {n} device(s): hand-written compile + 3 warm-up steps {res['warm_hand_s']:.1f}s; "
              f"mindpipe train() calls, setup and compile included (first call compiles, later "
              f"ones load the persisted jit cache): "
              f"{' '.join(f'{t:.1f}s' for t in res['mindpipe_call_s'])}")
    print()
    print(f"{'devices':>7}  {'mindpipe ms/step':>16}  {'hand-written ms/step':>20}  {'ratio':>6}"
          f"  |  {'CPU ms/step: mindpipe':>21}  {'hand-written':>12}  {'ratio':>6}")
    for n, m in rows:
        print(f"{n:>7}  {m['mindpipe']:>16.1f}  {m['hand']:>20.1f}  {m['mindpipe'] / m['hand']:>6.3f}"
              f"  |  {m['mindpipe_cpu']:>21.1f}  {m['hand_cpu']:>12.1f}  "
              f"{m['mindpipe_cpu'] / m['hand_cpu']:>6.3f}")
    print("# ms/step: median wall time per step over the timed intervals (the goal: ratio <= 1.05);"
          " CPU: process CPU time per step (all threads), robust to other tenants")
    print(f"\n# total {time.perf_counter() - t_start:.0f}s; load average at end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
