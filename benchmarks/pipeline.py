"""Pipeline benchmark: the autodiff GPipe baselines against the vPipe runtime's schedules.

Table 1 (p = 4 pipeline stages on 4 of the 8 simulated CPU devices; the reference
GPT with 4·k layers, d_model 128, seq 64, microbatch 8 rows, m = 4p = 16):

* GPipe-autodiff without and with remat (``gpipe_autodiff.py``: a ``lax.scan`` over
  m + p - 1 iterations + ``ppermute``, differentiated by ``jax.value_and_grad``;
  remat saves only each iteration's input, MaxText's default), and
* the vPipe runtime (``runtime.pipeline_grads``) with the schedules gpipe, 1f1b,
  interleaved (v = 2) and zb-h1 keeping residuals (remat "none" on every stage),
  1f1b with remat "dots" and "full" on every stage, and
* the vPipe plan: the partitioner (``partition.partition``) given measured layer
  costs and GPipe-autodiff+remat's compiled temp memory as its budget picks the
  layers and a remat policy per stage; the runtime executes exactly that plan.

Columns:

``bubble``   idle fraction of the table, ``Schedule.bubble_fraction_weighted()`` with
             the default costs (F = B = W = 1, BW = 2); for GPipe-autodiff
             (p - 1)/(m + p - 1) — its bubble iterations compute garbage instead of
             idling, which is what the work columns count.
``temp MB``  per-device temp memory of the compiled step,
             ``jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes``.
``work``     executed / useful work, counted from the schedule table × the work each
             task's branch really computes (``cost_analysis`` cannot: it counts a
             loop body once and a ``cond`` at its most expensive branch).
             ``units``: F = 1, fused backward = 2 per layer, embed/head ignored.
             ``flops``: per-task FLOPs measured with ``cost_analysis`` on unrolled
             single-layer / embed / head functions, embed and head included.
             What a branch computes (read from ``runtime.py``): a forward on the
             last global stage is empty (its forward runs inside its backward,
             which is forward + head + backward); every backward branch (BW, and
             ZB's B and W alike) forms both the weight and the input gradient (one
             of them is then unused; the DCE probe printed below says what XLA can
             drop); a "none" backward is the plain vjp from stored residuals, every
             other backward differentiates the "dots"-checkpointed layers (the
             ``bw_dots`` probe: it re-runs attention and elementwise work), and a
             "full" backward re-runs its chunk's forward first; the first stage's
             backward re-runs the embedding lookup and its vjp.
             GPipe-autodiff computes every stage every iteration, forward and
             backward, plus one more forward per iteration with remat.
``step ms``  median wall time of the timed calls after a warm-up call: up to ``--calls``
             (10), fewer for a slow row (``calls`` says how many). On this machine the
             simulated devices share 2 cores, so an idle device frees a core: wall
             times favour schedules that skip bubbles, and are not a cluster claim.

Table 2: simulated utilization (``simulate.predict_utilization``) of a GPT-class
model (32 layers of the same block) at p = 8, m = 32 for every schedule, in the
simulator's three modes: async (an MPMD executor), lockstep (a global barrier per
tick) and neighbour (the SPMD runtime as it executes: per-device clocks, each tick's
two ring ppermutes wait only for the ring neighbours), from per-layer F, B,
W, BW times and embed/head times measured on this machine (jit +
``block_until_ready``, median of repeats; B = backward of ``jax.vjp`` w.r.t. the
input only, W = w.r.t. the parameters only, BW = w.r.t. both; backward-only: the
vjp's residuals are an argument of the timed function). Transfers are free.

Usage: ``python benchmarks/pipeline.py [--calls 10] [--layers-per-stage 2]
[--out benchmarks/results/DATE-cpu-pipeline.txt]``.
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import flax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _report import Tee  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from flax import nnx  # noqa: E402

from mindpipe_jax.config import ModelConfig, ParallelConfig  # noqa: E402
from mindpipe_jax.models.gpt import GPT  # noqa: E402
from mindpipe_jax.parallel.mesh import make_mesh  # noqa: E402
from mindpipe_jax.parallel.pipeline import Kind, get_schedule  # noqa: E402
from mindpipe_jax.parallel.pipeline.contract import stage_fns  # noqa: E402
from mindpipe_jax.parallel.pipeline.plan.partition import measure_layer_costs, partition  # noqa: E402
from mindpipe_jax.parallel.pipeline.runtime import pipeline_grads  # noqa: E402
from mindpipe_jax.parallel.pipeline.runtime.gpipe_autodiff import gpipe_autodiff_grads  # noqa: E402
from mindpipe_jax.sim import LayerCost, predict_utilization  # noqa: E402

P, M, ROWS, SEQ, D_MODEL, HEADS, VOCAB = 4, 16, 8, 64, 128, 4, 256
SIM_P, SIM_M, SIM_LAYERS = 8, 32, 32



# ------------------------------------------------------------------ probes
def _compile(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def _backward_only(fn, primals, cotangent, select=lambda g: g):
    """(jitted backward, its args): the vjp's residuals are an argument."""
    _, vjp_fn = jax.vjp(fn, *primals)
    return (lambda vf, dy: select(vf(dy))), (vjp_fn, cotangent)


def _time_all(compiled: dict, repeats: int) -> dict:
    """Median seconds per call of every compiled ``(f, args)``, timed round-robin (one
    call of each per round) so that load drifting on a shared machine hits all alike."""
    for f, args in compiled.values():  # warm-up
        jax.block_until_ready(f(*args))
        jax.block_until_ready(f(*args))
    times = {k: [] for k in compiled}
    for _ in range(repeats):
        for k, (f, args) in compiled.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def piece_probes(fns, params, tokens, targets):
    """Per-task pieces: one layer's forward / backwards, embed and head, each as
    (function, args) with the backward taken from stored residuals."""
    layer_p = jax.tree.map(lambda x: x[0], params["blocks"])
    h = jax.jit(fns.embed)(params["embed"], tokens)
    dy = jnp.ones_like(h)
    layer = fns.layer
    return {
        "f": (layer, (layer_p, h)),
        "bw": _backward_only(layer, (layer_p, h), dy),
        # remat "dots" (and every recomputing backward in the runtime): the backward
        # of the checkpointed layer re-runs what the policy did not keep.
        "bw_dots": _backward_only(jax.checkpoint(
            layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable), (layer_p, h), dy),
        "b": _backward_only(lambda x: layer(layer_p, x), (h,), dy),
        "w": _backward_only(lambda lp: layer(lp, h), (layer_p,), dy),
        # DCE probes: the fused vjp (as ResidualStore.backward forms it) with one output used.
        "bw_keep_x": _backward_only(layer, (layer_p, h), dy, select=lambda g: g[1]),
        "bw_keep_w": _backward_only(layer, (layer_p, h), dy, select=lambda g: g[0]),
        "E": (fns.embed, (params["embed"], tokens)),
        "Eb": _backward_only(lambda e: fns.embed(e, tokens), (params["embed"],), dy),
        "H": (fns.head_loss, (params["head"], h, targets)),
        "Hb": _backward_only(lambda hp, x: fns.head_loss(hp, x, targets), (params["head"], h),
                             jnp.ones((), jnp.float32)),
        "Hb_x": _backward_only(lambda x: fns.head_loss(params["head"], x, targets), (h,),
                               jnp.ones((), jnp.float32)),
        "Hb_w": _backward_only(lambda hp: fns.head_loss(hp, h, targets), (params["head"],),
                               jnp.ones((), jnp.float32)),
    }


# --------------------------------------------------------------- work model
def task_work(kind: Kind, pos: str, policy: str, layers: int, c: dict) -> float:
    """What one runtime branch computes for one (microbatch, chunk of ``layers`` layers)
    under the stage's remat ``policy`` (read from ``runtime.py``)."""
    fwd = layers * c["f"]
    # A backward from "none" residuals is the plain vjp; every other backward
    # differentiates the "dots"-checkpointed layers and re-runs what they drop.
    bwd = layers * (c["bw"] if policy == "none" else c["bw_dots"])
    if kind is Kind.F:
        if pos == "last":
            return 0.0  # folded into the last stage's backward
        return fwd + (c["E"] if pos == "first" else 0.0)
    # BW, B and W alike: the full vjp (both gradients) of the chunk.
    if pos == "last":
        return fwd + c["H"] + c["Hb"] + bwd  # forward + head + backward, in every backward kind
    work = bwd + (fwd if policy == "full" else 0.0)
    if pos == "first":
        work += c["E"] + c["Eb"]  # embedding re-run and its vjp
    return work


def runtime_work(schedule, policies, counts, c: dict) -> float:
    G = schedule.num_global_stages
    total = 0.0
    for row in schedule.table:
        for s, task in enumerate(row):
            if task is None:
                continue
            g = schedule.global_stage(s, task.chunk)
            pos = "first" if g == 0 else ("last" if g == G - 1 else "mid")
            total += task_work(task.kind, pos, policies[g], counts[g], c)
    return total


def autodiff_work(p: int, m: int, remat: bool, num_layers: int, c: dict) -> float:
    layers = num_layers // p
    per_iteration = c["E"] + layers * c["f"] + layers * c["bw"] + c["Eb"]
    if remat:
        per_iteration += c["E"] + layers * c["f"]
    return (m + p - 1) * p * per_iteration + m * (c["H"] + c["Hb"])


def useful_work(m: int, num_layers: int, c: dict) -> float:
    return m * (c["E"] + c["Eb"] + num_layers * (c["f"] + c["bw"]) + c["H"] + c["Hb"])


def vpipe_plan(cfg, budget_bytes, fns, mesh, step_args):
    """The partitioner's plan for this model: measured layer costs, 1F1B, every remat
    policy allowed, GPipe-autodiff+remat's compiled temp memory as the budget, and
    each candidate's fit judged by compiling it (``measure_memory``), not by the model."""
    from mindpipe_jax.parallel.pipeline.runtime.layout import StageLayout

    tried = []

    def compiled_temp(remat, counts):
        run = pipeline_grads(fns, get_schedule("1f1b", P, M), mesh, remat=remat,
                             layout=StageLayout(counts, P, 1))
        with jax.set_mesh(mesh):
            temp = jax.jit(run).lower(*step_args).compile().memory_analysis().temp_size_in_bytes
        tried.append((remat, counts, temp))
        return temp

    profile = measure_layer_costs(cfg, microbatch=ROWS, dots=True)
    plan = partition(profile, p=P, m=M, schedule="1f1b", memory_budget_bytes=float(budget_bytes),
                     remat_options=("none", "dots", "full"), param_copies=1.0, measure_memory=compiled_temp)
    return plan, tried


# ------------------------------------------------------------------- table 1
def table1(args, out):
    layers = P * args.layers_per_stage
    cfg = ModelConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=D_MODEL, n_layers=layers, n_heads=HEADS)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    fns = stage_fns(model)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (M, ROWS, SEQ + 1)).astype(np.int32)
    inputs, targets = tokens[..., :-1], tokens[..., 1:]
    mesh = make_mesh(ParallelConfig(pipe=P, data=1, tensor=1), devices=jax.devices()[:P])
    step_args = (params["embed"], params["blocks"], params["head"], inputs, targets)

    probes = {k: (_compile(fn, *a), a)
              for k, (fn, a) in piece_probes(fns, params, inputs[0], targets[0]).items()}
    flops = {k: float(c.cost_analysis()["flops"]) for k, (c, _) in probes.items()}
    units = {k: 0.0 for k in flops} | {"f": 1.0, "bw": 2.0, "bw_dots": 2.0}
    useful = {"units": useful_work(M, layers, units), "flops": useful_work(M, layers, flops)}

    rows = [("GPipe-autodiff", "-", "no", None), ("GPipe-autodiff", "-", "yes", None)]
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
        rows.append(("vPipe runtime", f"{name}" + (f" v={v}" if v > 1 else ""), "none", (name, v)))
        if name == "1f1b":
            rows += [("vPipe runtime", name, "dots", (name, v)), ("vPipe runtime", name, "full", (name, v))]
    rows.append(("vPipe plan", "1f1b", "plan", ("1f1b", 1)))
    plan_note = ""

    print(f"Table 1: p={P} on {P} of the 8 simulated CPU devices; GPT {layers} layers "
          f"(d_model {D_MODEL}, {HEADS} heads, vocab {VOCAB}), seq {SEQ}, microbatch {ROWS} rows, "
          f"m={M}; fp32", file=out)
    head = (f"{'pipeline':<15} {'schedule':<15} {'remat':<22} {'bubble':>7} {'temp MB':>8} "
            f"{'work(units)':>11} {'work(flops)':>11} {'step ms':>9} {'calls':>5}")
    print(head, file=out)
    print("-" * len(head), file=out)
    baseline_temp = None
    for kind, label, remat, sched in rows:
        if sched is None:
            run = gpipe_autodiff_grads(fns, P, M, mesh, remat=remat == "yes")
            bubble = (P - 1) / (M + P - 1)
            work = {k: autodiff_work(P, M, remat == "yes", layers, c) for k, c in (("units", units),
                                                                                   ("flops", flops))}
        else:
            schedule = get_schedule(sched[0], P, M, sched[1])
            G = schedule.num_global_stages
            counts, layout = (layers // G,) * G, None
            if remat == "plan":
                plan, tried = vpipe_plan(cfg, baseline_temp, fns, mesh, step_args)
                counts, layout, remat = plan.counts, plan.layout(), ",".join(plan.remat)
                steps = "; ".join(f"{'/'.join(r)} {list(c)}: {t / 2**20:.1f} MB" for r, c, t in tried)
                plan_note = (f"vPipe plan: partition(measure_layer_costs(...), p={P}, m={M}, 1f1b, "
                             f"remat_options=none/dots/full, memory budget = GPipe-autodiff+remat's "
                             f"temp {baseline_temp / 2**20:.1f} MB, param_copies=1 (the step holds "
                             f"gradients, no optimizer state), each candidate compiled to check it fits) "
                             f"chose layers {list(plan.counts)} and remat {list(plan.remat)}. "
                             f"Candidates compiled: {steps}.")
            policies = tuple(remat.split(",")) if "," in remat else (remat,) * G
            run = pipeline_grads(fns, schedule, mesh, remat=policies, layout=layout)
            bubble = schedule.bubble_fraction_weighted()
            work = {k: runtime_work(schedule, policies, counts, c) for k, c in (("units", units),
                                                                                ("flops", flops))}
        with jax.set_mesh(mesh):
            compiled = jax.jit(run).lower(*step_args).compile()
        temp_bytes = compiled.memory_analysis().temp_size_in_bytes
        temp = temp_bytes / 2**20
        if kind == "GPipe-autodiff" and remat == "yes":
            baseline_temp = temp_bytes
        start = time.perf_counter()
        jax.block_until_ready(compiled(*step_args))  # warm-up
        first = time.perf_counter() - start
        calls = max(args.min_calls, min(args.calls, int(args.row_budget_s / max(first, 1e-3))))
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*step_args))
            times.append(time.perf_counter() - t0)
        print(f"{kind:<15} {label:<15} {remat:<22} {bubble:>7.3f} {temp:>8.1f} "
              f"{work['units'] / useful['units']:>11.2f} {work['flops'] / useful['flops']:>11.2f} "
              f"{1e3 * statistics.median(times):>9.0f} {calls:>5}", file=out)
    print(f"\n{plan_note}", file=out)
    print(f"Useful work per step: {useful['flops'] / 1e9:.1f} GFLOP (m·(embed + {layers} layers "
          f"F+BW + head), per-task FLOPs from cost_analysis of unrolled pieces).", file=out)
    dropped = flops["bw_keep_x"] < 0.9 * flops["bw"] or flops["bw_keep_w"] < 0.9 * flops["bw"]
    print(f"DCE probe (one block, backward from stored residuals, cost_analysis): fused vjp "
          f"{flops['bw'] / 1e6:.0f} MFLOP; the same vjp with only the input grad used compiles to "
          f"{flops['bw_keep_x'] / 1e6:.0f} MFLOP, with only the weight grad used to "
          f"{flops['bw_keep_w'] / 1e6:.0f} MFLOP (forward {flops['f'] / 1e6:.0f}). The work columns count "
          f"what the runtime's code asks for: its B and W branches form the full vjp and use half of it"
          + ("; XLA drops the unused half in this probe, and may inside a branch too if its DCE reaches "
             "through the stage's scan over layers, so ZB-H1's figures are an upper bound." if dropped
             else "; XLA does not drop the unused half here either."), file=out)
    print("Wall times: the simulated devices share this machine's 2 cores (and other jobs may be "
          "running), so an idle device frees a core for the others: wall time favours schedules that "
          "skip bubbles and is no claim about a cluster; table 2 is the cluster estimate.", file=out)
    return params, probes


# ------------------------------------------------------------------- table 2
def table2(args, out, params, probes):
    t = _time_all({k: v for k, v in probes.items() if k not in ("bw_keep_x", "bw_keep_w", "bw_dots")},
                  args.repeats)
    act = ROWS * SEQ * D_MODEL * 4
    layer_bytes = sum(x[0].size * x.dtype.itemsize for x in jax.tree.leaves(params["blocks"]))
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    layer = LayerCost(F=t["f"], B=t["b"], W=t["w"], BW=t["bw"], activation_bytes=act,
                      param_bytes=layer_bytes)
    embed = LayerCost(F=t["E"], B=0.0, W=t["Eb"], BW=t["Eb"], activation_bytes=act,
                      param_bytes=nbytes(params["embed"]))
    head = LayerCost(F=t["H"], B=t["Hb_x"], W=t["Hb_w"], BW=t["Hb"], param_bytes=nbytes(params["head"]))

    print(f"\nTable 2: simulated utilization, GPT-class model of {SIM_LAYERS} layers of the block above "
          f"(microbatch {ROWS}x{SEQ}), p={SIM_P}, m={SIM_M}, free transfers; costs measured on this "
          f"machine (one device, jit + block_until_ready, median of {args.repeats}, round-robin):", file=out)
    ms = lambda x: f"{1e3 * x:.2f}"  # noqa: E731
    print(f"  layer: F {ms(t['f'])} ms, B (vjp wrt input) {ms(t['b'])} ms, W (vjp wrt params) "
          f"{ms(t['w'])} ms, BW (vjp wrt both) {ms(t['bw'])} ms; BW - B = {ms(t['bw'] - t['b'])} ms",
          file=out)
    print(f"  embed: F {ms(t['E'])} ms, W {ms(t['Eb'])} ms;  head: F {ms(t['H'])} ms, B {ms(t['Hb_x'])} ms, "
          f"W {ms(t['Hb_w'])} ms, BW {ms(t['Hb'])} ms", file=out)
    zb_split = LayerCost(F=t["f"], B=t["b"], W=max(t["bw"] - t["b"], 0.0), BW=t["bw"],
                         activation_bytes=act, param_bytes=layer_bytes)
    as_run = LayerCost(F=t["f"], B=t["bw"], W=t["bw"], BW=t["bw"], activation_bytes=act,
                       param_bytes=layer_bytes)
    head_split = LayerCost(F=t["H"], B=t["Hb_x"], W=max(t["Hb"] - t["Hb_x"], 0.0), BW=t["Hb"],
                           param_bytes=head.param_bytes)
    head_as_run = LayerCost(F=t["H"], B=t["Hb"], W=t["Hb"], BW=t["Hb"], param_bytes=head.param_bytes)
    cases = [("gpipe", 1, layer, head, ""), ("1f1b", 1, layer, head, ""),
             ("interleaved", 2, layer, head, ""),
             ("interleaved", 4, layer, head, ""), ("zb-h1", 1, layer, head, "W = vjp wrt params"),
             ("zb-h1", 1, zb_split, head_split, "W = BW - B (W reuses B's grads)"),
             ("zb-h1", 1, as_run, head_as_run, "B = W = BW (this runtime, residual mode)")]
    # Utilization = useful work / (p · step time), useful = each layer's F and fused BW
    # plus embed and head, once per microbatch: a schedule whose B and W together cost
    # more than BW (the recomputing splits below) gets no credit for the extra.
    useful = SIM_M * (SIM_LAYERS * (t["f"] + t["bw"]) + t["E"] + t["Eb"] + t["H"] + t["Hb"])
    hdr = f"{'schedule':<15} {'costs':<44} {'async':>7} {'lockstep':>9} {'neighbour':>9}"
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    for name, v, lc, hc, note in cases:
        util = {}
        for mode in ("async", "lockstep", "neighbour"):
            res = predict_utilization(lc, schedule=name, p=SIM_P, m=SIM_M, v=v, num_layers=SIM_LAYERS,
                                      embed=embed, head=hc, mode=mode)
            util[mode] = useful / (SIM_P * res.step_time)
        label = name + (f" v={v}" if v > 1 else "")
        print(f"{label:<15} {note or 'measured F, BW':<44} {util['async']:>7.3f} {util['lockstep']:>9.3f} "
              f"{util['neighbour']:>9.3f}", file=out)
    # The autodiff GPipe runs every stage every iteration (lockstep by construction):
    # m + p - 1 forward iterations, as many backward ones, the head after the scan.
    per_stage = SIM_LAYERS // SIM_P
    for remat in (False, True):
        stage_f = per_stage * t["f"] + t["E"]
        stage_b = per_stage * t["bw"] + t["Eb"] + (stage_f if remat else 0.0)
        makespan = (SIM_M + SIM_P - 1) * (stage_f + stage_b) + SIM_M * (t["H"] + t["Hb"])
        label = "GPipe-autodiff" + (" remat" if remat else "")
        print(f"{label:<21} {'every iteration computes (analytic)':<38} {'-':>7} "
              f"{useful / (SIM_P * makespan):>9.3f}", file=out)
    print(f"(1F1B's ideal with F:BW = 1:2 and no embed/head: "
          f"{1 - get_schedule('1f1b', SIM_P, SIM_M).bubble_fraction_weighted():.3f}; utilization here = "
          f"useful work (F + fused BW per layer, embed, head) / (p x simulated step time))", file=out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=10, help="timed calls per row (at most)")
    parser.add_argument("--row-budget-s", type=float, default=12.0,
                        help="fewer timed calls for a row whose warm-up call is slow (keeps the "
                             "benchmark within minutes on 2 cores)")
    parser.add_argument("--min-calls", type=int, default=2, help="timed calls per row (at least)")
    parser.add_argument("--layers-per-stage", type=int, default=2, help="k: the GPT has 4·k layers")
    parser.add_argument("--repeats", type=int, default=50, help="timed repeats per measured cost")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--out", default=None, help="also write the output to this file")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, to check the script runs")
    args = parser.parse_args()
    if args.smoke:
        global SEQ, D_MODEL, VOCAB, SIM_LAYERS
        SEQ, D_MODEL, VOCAB = 16, 32, 64
    buffer = io.StringIO()
    out = Tee(sys.stdout, buffer)
    start = time.perf_counter()
    print(f"# mindpipe_jax pipeline benchmark, {args.date}", file=out)
    print(f"# machine: {os.cpu_count()}-core CPU container ({platform.machine()}, Python "
          f"{platform.python_version()}), {len(jax.devices())} simulated CPU devices; jax {jax.__version__}, "
          f"flax {flax.__version__}", file=out)
    print(f"# command: python benchmarks/pipeline.py {' '.join(sys.argv[1:])}\n", file=out)
    pieces = table1(args, out)
    table2(args, out, *pieces)
    print(f"\n(benchmark took {time.perf_counter() - start:.0f} s)", file=out)
    if args.out:
        with open(args.out, "w") as f:
            f.write(buffer.getvalue())


if __name__ == "__main__":
    main()
