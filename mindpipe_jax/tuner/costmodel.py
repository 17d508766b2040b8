"""EPara's cost model: a candidate's step time from the compiled pieces' FLOPs and
bytes, a per-machine calibration, per-axis collective fits and the pipeline
simulator replaying the fused ticks the runtime runs; corrected by trials.

Inputs, each measured rather than assumed:

* ``ModelCosts`` — for each *piece* of the model (one block's forward; its
  backward under each remat policy; embedding + head + loss, forward and
  backward; the optimizer update of all parameters), compiled on one device:
  FLOPs and bytes accessed (``cost_analysis``), per sequence (row) and per call
  (weights), and the number of kernels the compiled program launches. Each remat
  policy is compiled as such: the forward writing the residuals the policy keeps
  (a step without remat stores every residual; "full" only the inputs) and the
  backward from them. Pieces,
  not the candidate's whole step: a compiled step counts a ``scan`` body (the
  stacked blocks, the pipeline's tick loop) once and a ``cond`` at its dearest
  branch, so its totals miss most of the work (4 blocks counted as 1 here).
* ``Hardware`` — the machine's ``calibrate.Calibration`` (cached per machine):
  matmul rate and memory bandwidth per device with all devices busy and with one
  alone, the fixed cost of a kernel, of a launch and of a loop iteration, and α–β
  fits of all-reduce / all-gather / reduce-scatter / ppermute per axis size.

Compute: each piece costs a roofline *per piece* —
``max(FLOPs / matmul rate, bytes / memory bandwidth) + kernels × kernel cost`` —
the max over the two op classes of one compiled piece (not per HLO op), plus
the sum of its kernels' fixed costs. Pieces are summed as the step runs them:
per microbatch, every block's forward and backward, and the embedding/head;
tensor parallelism divides FLOPs and bytes (not kernels) by ``tensor`` (not
inside a pipeline today: see ``CostModel``). Without a pipeline a step's compute
is that sum at the all-busy rates. With ``pipe > 1``
the schedule is re-timed into fused ticks as the runtime does
(``schedules.fused.fuse``, mode ``"auto"`` unless the config says otherwise) and
replayed by the simulator (``simulate(fused, mode="neighbour")``): once at the
solo rates (the critical path: simulated CPU devices idle in a bubble free the
host's cores for the busy ones) and all devices' work is summed at the busy
rates (what shared cores deliver at best); compute is the larger. The loop runs
one iteration per *fused* tick (not per table tick), and each fused tick pays
its ppermutes.

Communication per step and device (``Calibration.collective_time`` of the axis
size, or the ``Link``'s ring model when no calibration is given): tensor — 4
all-reduces of a microbatch's hidden state per block per microbatch (2 forward,
2 backward, Megatron; 2 more under remat "full") and 2 for the head; pipe — 2
ppermutes of a hidden state per fused tick (4 for a V placement on p > 2);
data — an all-reduce of the device's gradient shard; fsdp — an all-gather of
the parameters and a reduce-scatter of the gradient; expert — 4 all-gathers of
the routed tokens per block per microbatch.

A candidate's prediction is ``coef · (compute, comm, update, 1, ticks)``:
``update`` is the optimizer's piece over the device's parameter shard, ``ticks``
the pipeline's fused ticks (0 without a pipeline); the priors are 1, 1, 1, the
calibrated launch and the calibrated loop iteration.
``observe`` refits the five coefficients by ridge regression towards those
priors from measured trials, so a few fitted layouts teach it what the
micro-benchmarks cannot see (the runtime's per-tick bookkeeping, a step's host
work); ``benchmarks/costmodel.py`` measures how it predicts layouts it has not
run.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

from mindpipe_jax.config import Config
from mindpipe_jax.sim.network import Collective, Link
from mindpipe_jax.tuner.calibrate import Calibration
from mindpipe_jax.tuner.space import V_SCHEDULES, Candidate

FEATURES = ("compute_s", "comm_s", "update_s", "launch", "pipeline_ticks")


@dataclasses.dataclass(frozen=True)
class Piece:
    """One compiled piece: FLOPs and bytes accessed per row and per call, kernels per call."""

    flops: float = 0.0  # per row
    bytes: float = 0.0  # per row
    fixed_flops: float = 0.0  # per call (e.g. the optimizer, or weight reads)
    fixed_bytes: float = 0.0
    kernels: float = 0.0

    def __add__(self, other: Piece) -> Piece:
        return Piece(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other),
                                             strict=True)))

    def scaled(self, k: float) -> Piece:
        """The same work ``k`` times (k calls)."""
        return Piece(*(a * k for a in dataclasses.astuple(self)))


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    """FLOPs per sequence (row), sizes and compiled pieces of the reference model.

    ``pieces`` (from ``measure``): "layer_F" (plain), "layer_F:<remat>" (the forward
    a step runs, writing the residuals the policy keeps), "layer_BW:<remat>", "rest_F",
    "rest_BW" and "update" (the optimizer over all parameters). Without them
    (a hand-written model) the FLOP fields alone give the pieces."""

    n_layers: int
    layer_fwd: float
    layer_bwd: dict  # remat policy -> backward FLOPs of one block (recompute included)
    rest_fwd: float  # embedding + head + loss
    rest_bwd: float
    param_bytes: float
    hidden_bytes_per_row: float  # one sequence's hidden state (what tensor/pipe collectives move)
    expert_tokens_factor: float = 0.0  # routed copies per token (top_k x capacity) for MoE, else 0
    pieces: dict | None = None

    def layer_total(self, remat: str) -> float:
        return self.layer_fwd + self.layer_bwd[remat]

    def step_flops(self, rows: int, remat: str = "none") -> float:
        return rows * (self.n_layers * self.layer_total(remat) + self.rest_fwd + self.rest_bwd)

    def piece(self, name: str) -> Piece:
        if self.pieces is not None and name in self.pieces:
            return self.pieces[name]
        if name.startswith("layer_F:"):  # no per-policy forward measured: the plain one
            return self.piece("layer_F")
        if name == "layer_F":
            return Piece(self.layer_fwd)
        if name.startswith("layer_BW:"):
            return Piece(self.layer_bwd[name.split(":")[1]])
        if name == "rest_F":
            return Piece(self.rest_fwd)
        if name == "rest_BW":
            return Piece(self.rest_bwd)
        return Piece()  # "update": unknown without a measurement

    @classmethod
    def measure(cls, cfg: Config, rows: int = 2, model=None) -> ModelCosts:
        """Compile one block, the embedding, the head and the optimizer update on one
        device, at 1 and ``rows`` + 1 sequences, and read FLOPs, bytes accessed and
        kernels (per row from the difference, per call from the rest). ``model``: a
        user's factory ``rngs -> nnx.Module`` measured instead of ``cfg.model``."""
        import jax

        with jax.set_mesh(None):  # one device whatever the caller's context
            return _measure_pieces(cfg, max(rows, 1), model)


_NOT_KERNELS = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast",
                          "after-all", "partition-id", "replica-id"})
_OPCODE = re.compile(r"=\s+\S+\s+([a-z][a-z0-9\-]*)\(")


def count_kernels(hlo_text: str) -> int:
    """Instructions of the compiled module's entry computation that run as kernels
    (fusions, dots, copies, custom calls...; not parameters, constants, tuples)."""
    count, inside = 0, False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY"):
            inside = True
            continue
        if inside:
            if line.startswith("}"):
                break
            found = _OPCODE.search(line)
            if found and found.group(1) not in _NOT_KERNELS:
                count += 1
    return count


def _compiled_piece(fn, *args) -> tuple[float, float, int]:
    """(FLOPs, bytes accessed, kernels) of ``fn(*args)`` compiled."""
    import jax

    compiled = jax.jit(fn).lower(*args).compile()
    analysis = compiled.cost_analysis()
    if isinstance(analysis, Sequence):
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}
    return (float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0)),
            count_kernels(compiled.as_text()))


def _measure_pieces(cfg: Config, rows: int, factory) -> ModelCosts:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mindpipe_jax.models.gpt import GPT
    from mindpipe_jax.parallel.pipeline.contract import PipelineModel
    from mindpipe_jax.train.state import make_optimizer

    m = cfg.model
    experts = m.n_experts if factory is None else 0
    # An MoE block is measured as its dense twin with FLOPs and bytes scaled by the
    # active-parameter ratio (top_k expert MLPs + router).
    dense = dataclasses.replace(m, n_experts=0) if experts else m
    with nnx.use_eager_sharding(False):
        model = factory(nnx.Rngs(0)) if factory is not None else GPT(dense, rngs=nnx.Rngs(0))
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    params = jax.device_put(nnx.to_pure_dict(state), jax.devices()[0])
    rng = np.random.default_rng(0)
    sizes = (1, rows + 1)

    def pieces_at(n_rows: int) -> tuple[dict, int, float]:
        """Each piece's (FLOPs, bytes, kernels) at ``n_rows`` rows; units; hidden bytes per row."""
        tokens = jnp.asarray(rng.integers(0, m.vocab_size, (n_rows, m.seq_len)), jnp.int32)
        split = PipelineModel(model, params, lambda p: nnx.merge(graphdef, p, rest), tokens)
        fns = split.fns
        embed_p, stack, head_p = split.split(params)
        block = jax.tree.map(lambda x: x[0], stack)
        hidden = jax.jit(fns.embed)(embed_p, tokens)
        dy = jnp.ones_like(hidden)

        def head(w, h):
            return fns.head_loss(w, h, tokens)

        def embed_bw(e, ct):
            return jax.vjp(lambda ee: fns.embed(ee, tokens), e)[1](ct)

        def backward(fn, w, x, ct):
            """The backward alone: the vjp closure (its residuals) is an argument."""
            vjp_fn = jax.jit(lambda a, b: jax.vjp(fn, a, b)[1])(w, x)
            return _compiled_piece(lambda f, c: f(c), vjp_fn, ct)

        dots = jax.checkpoint(fns.layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
        full = jax.checkpoint(fns.layer)  # keeps only the inputs: the backward re-runs the forward
        found = {
            "layer_F": _compiled_piece(fns.layer, block, hidden),
            # the forward a step runs: it also writes the residuals its policy keeps
            **{f"layer_F:{name}": _compiled_piece(lambda w, x, f=f: jax.vjp(f, w, x), block, hidden)
               for name, f in (("none", fns.layer), ("dots", dots), ("full", full))},
            "layer_BW:none": backward(fns.layer, block, hidden, dy),
            "layer_BW:dots": backward(dots, block, hidden, dy),
            "layer_BW:full": backward(full, block, hidden, dy),
            "embed_F": _compiled_piece(fns.embed, embed_p, tokens),
            "embed_BW": _compiled_piece(embed_bw, embed_p, dy),
            "head_F": _compiled_piece(head, head_p, hidden),
            "head_BW": backward(head, head_p, hidden, jnp.ones((), jnp.float32)),
        }
        return found, split.num_units, hidden.size * hidden.dtype.itemsize / n_rows

    measured: dict[str, list[tuple[float, float, int]]] = {}
    for n_rows in sizes:
        found, n_units, hidden_bytes = pieces_at(n_rows)
        for k, v in found.items():
            measured.setdefault(k, []).append(v)

    def fitted(name) -> Piece:
        (f1, b1, k1), (f2, b2, _) = measured[name]
        per_f, per_b = (f2 - f1) / rows, (b2 - b1) / rows
        return Piece(per_f, per_b, max(f1 - per_f, 0.0), max(b1 - per_b, 0.0), float(k1))

    pieces = {k: fitted(k) for k in measured if not k.startswith(("embed", "head"))}
    pieces["rest_F"] = fitted("embed_F") + fitted("head_F")
    pieces["rest_BW"] = fitted("embed_BW") + fitted("head_BW")
    if experts:
        from mindpipe_jax.models import gpt, moe

        ratio = moe.flops_per_token(m) / gpt.flops_per_token(dense)
        pieces = {k: (Piece(v.flops * ratio, v.bytes * ratio, v.fixed_flops * ratio, v.fixed_bytes * ratio,
                            v.kernels) if k.startswith("layer_") else v) for k, v in pieces.items()}

    tx = make_optimizer(cfg.optim, cfg.train.steps, None)
    opt_state = jax.jit(tx.init)(params)

    def update(g, s, p):
        import optax

        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    uf, ub, uk = _compiled_piece(update, params, opt_state, params)
    pieces["update"] = Piece(0.0, 0.0, uf, ub, float(uk))

    param_bytes = float(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)))
    if experts:  # the dense twin has one MLP per block; the MoE block has n_experts and a router
        param_bytes += 4.0 * m.n_layers * ((experts - 1) * 2 * m.d_model * m.ff_dim + m.d_model * experts)
    factor = m.top_k * m.capacity_factor if experts else 0.0
    p = pieces
    bwd = {r: p[f"layer_BW:{r}"].flops for r in ("none", "dots", "full")}
    return ModelCosts(n_units, p["layer_F"].flops, bwd, p["rest_F"].flops, p["rest_BW"].flops, param_bytes,
                      hidden_bytes, factor, pieces)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Per-device FLOP rate (all devices busy), the collective link, launch costs;
    with ``calibration`` also memory bandwidth, kernel cost and per-axis collective
    fits (``Hardware.calibrate`` measures and caches them)."""

    flop_rate: float
    link: Link
    solo_rate: float  # one device computing alone (CPU devices then get the idle cores)
    launch_s: float  # one step's fixed cost (dispatch, optimizer, host sync)
    iteration_s: float  # one loop iteration's fixed cost (microbatch or pipeline tick)
    memory_bytes: float = math.inf
    note: str = ""
    calibration: Calibration | None = None

    @classmethod
    def calibrate(cls, devices=None, *, memory_bytes: float = math.inf, cache_dir=None,
                  refresh: bool = False) -> Hardware:
        """This machine's calibration (``calibrate.load_or_measure``: measured once per
        machine key and cached) on ``devices``."""
        import jax

        from mindpipe_jax.tuner.calibrate import load_or_measure

        devices = list(jax.devices() if devices is None else devices)
        return cls.from_calibration(load_or_measure(devices, cache_dir=cache_dir, refresh=refresh),
                                    memory_bytes)

    @classmethod
    def from_calibration(cls, cal: Calibration, memory_bytes: float = math.inf) -> Hardware:
        n = cal.key.get("devices", 1)
        alpha, beta = cal.collectives.get(f"all-reduce:{n}", (0.0, 0.0))
        link = Link(alpha, 1.0 / beta if beta > 0 else math.inf)
        return cls(cal.flops_busy, link, cal.flops_solo, cal.launch_s, cal.iteration_s, memory_bytes,
                   cal.note(), cal)

    # --------------------------------------------------------------- rates
    def piece_time(self, piece: Piece, rows: float, *, split: int = 1, solo: bool = False) -> float:
        """Seconds of one call of ``piece`` on ``rows`` rows with its work split
        ``split`` ways (tensor parallelism): the roofline max of flop time and
        memory time, plus its kernels' fixed cost."""
        cal = self.calibration
        flops = (piece.flops * rows + piece.fixed_flops) / split
        rate = self.solo_rate if solo else self.flop_rate
        if cal is None:
            return flops / rate
        nbytes = (piece.bytes * rows + piece.fixed_bytes) / split
        mem = cal.mem_solo if solo else cal.mem_busy
        kernel = cal.kernel_solo_s if solo else cal.kernel_busy_s
        return max(flops / rate, nbytes / mem) + piece.kernels * kernel

    def collective(self, kind: str, ranks: int, nbytes: float) -> float:
        """One collective of ``nbytes`` per device over an axis of ``ranks`` devices."""
        if ranks <= 1:
            return 0.0
        if self.calibration is not None:
            return self.calibration.collective_time(kind, ranks, nbytes)
        if kind == "ppermute":
            return self.link.time(nbytes)
        return Collective(ranks, self.link, kind).time(nbytes)


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """A candidate's predicted step, by feature (seconds unless said)."""

    compute_s: float  # critical path of compute, pipeline bubbles included
    comm_s: dict  # axis -> seconds
    iterations: int  # loop iterations (accumulated microbatches or fused pipeline ticks)
    step_s: float  # the corrected total
    bubble_fraction: float = 0.0
    update_s: float = 0.0

    @property
    def comm_total(self) -> float:
        return sum(self.comm_s.values())


class CostModel:
    """Predicts candidates' step times; ``observe`` folds in measured trials.

    Implements the step-model protocol the online tuner uses:
    ``step_time(candidate) -> seconds`` and ``observe(candidate, seconds)``.
    ``fuse_mode``: how the runtime re-times a pipeline's table (``parallel.fuse_ticks``).
    ``pipeline_tensor_split``: whether ``tensor`` divides a pipeline stage's work. It
    does not in the runtime today: the compiled step of t2 p4 m4 B32 (tiny GPT, 8 CPU
    devices) has 2.0x the FLOPs per device of d2 p4 m4 B32, where d4 t2 and d8 without
    a pipeline have the same (the stage programs inside the pipeline's ``shard_map``
    run unsharded over ``tensor``), and its step took 2.2x as long."""

    def __init__(self, costs: ModelCosts, hardware: Hardware, seq_len: int, ridge: float = 0.1,
                 fuse_mode: str = "auto", pipeline_tensor_split: bool = False):
        self.costs, self.hw, self.seq_len = costs, hardware, seq_len
        self.fuse_mode = fuse_mode
        self.pipeline_tensor_split = pipeline_tensor_split
        self.prior = np.array([1.0, 1.0, 1.0, hardware.launch_s, hardware.iteration_s])
        self.coef = self.prior.copy()
        self.ridge = ridge
        self.observed: list[tuple[Candidate, float]] = []
        self._cache: dict[Candidate, tuple] = {}

    # ---------------------------------------------------------------- features
    def fused_schedule(self, c: Candidate):
        """The fused ticks the runtime runs for ``c`` (``pipe > 1``)."""
        from mindpipe_jax.parallel.pipeline import get_schedule
        from mindpipe_jax.parallel.pipeline.schedules.fused import fuse

        return fuse(get_schedule(c.schedule, c.pipe, c.microbatches, c.virtual_stages), self.fuse_mode)

    def _stage_costs(self, c: Candidate, rows_mb: float, solo: bool):
        from mindpipe_jax.sim import even_assignment
        from mindpipe_jax.sim.costs import StageCosts

        k, hw = self.costs, self.hw
        stages = c.pipe * c.virtual_stages
        per_stage = [0] * stages
        for g in even_assignment(k.n_layers, stages):
            per_stage[g] += 1
        split = c.tensor if self.pipeline_tensor_split else 1
        f1 = hw.piece_time(k.piece(f"layer_F:{c.remat}"), rows_mb, split=split, solo=solo)
        b1 = hw.piece_time(k.piece(f"layer_BW:{c.remat}"), rows_mb, split=split, solo=solo)
        rf = hw.piece_time(k.piece("rest_F"), rows_mb, split=split, solo=solo)
        rb = hw.piece_time(k.piece("rest_BW"), rows_mb, split=split, solo=solo)
        F = [n * f1 for n in per_stage]
        BW = [n * b1 for n in per_stage]
        # embedding on the first global stage, head + loss on the last (their split is
        # not measured separately; half each is close for a small vocabulary)
        F[0] += 0.5 * rf
        F[-1] += 0.5 * rf
        BW[0] += 0.5 * rb
        BW[-1] += 0.5 * rb
        return StageCosts(F=F, B=[b / 2 for b in BW], W=[b / 2 for b in BW], BW=BW)

    def _compute(self, c: Candidate) -> tuple[float, float, int]:
        """(compute seconds, bubble fraction, loop iterations)."""
        k, hw = self.costs, self.hw
        rows_mb = c.global_batch / (c.batch_shards * c.microbatches)
        if c.pipe == 1:
            per_mb = (k.n_layers * (hw.piece_time(k.piece(f"layer_F:{c.remat}"), rows_mb, split=c.tensor)
                                    + hw.piece_time(k.piece(f"layer_BW:{c.remat}"), rows_mb, split=c.tensor))
                      + hw.piece_time(k.piece("rest_F"), rows_mb, split=c.tensor)
                      + hw.piece_time(k.piece("rest_BW"), rows_mb, split=c.tensor))
            return c.microbatches * per_mb, 0.0, c.microbatches
        from mindpipe_jax.sim.engine import simulate

        fused = self.fused_schedule(c)
        solo = simulate(fused, self._stage_costs(c, rows_mb, solo=True), mode="neighbour")
        busy = simulate(fused, self._stage_costs(c, rows_mb, solo=False), mode="neighbour")
        pooled = sum(busy.busy) / len(busy.busy)  # every device's work at the all-busy rate
        bubble = 1.0 - pooled / busy.step_time if busy.step_time > 0 else 0.0
        return max(solo.step_time, pooled), bubble, fused.num_ticks

    def _update(self, c: Candidate) -> float:
        """The optimizer over this device's parameter shard (all-busy rates)."""
        shards = c.tensor * c.pipe * c.fsdp * c.expert
        return self.hw.piece_time(self.costs.piece("update"), 0.0, split=shards)

    def _comm(self, c: Candidate) -> dict:
        k, hw = self.costs, self.hw
        rows_mb = c.global_batch / (c.batch_shards * c.microbatches)
        hidden = rows_mb * k.hidden_bytes_per_row
        layers_here = k.n_layers / c.pipe
        out = {}
        if c.tensor > 1:
            per_layer = 6 if c.remat == "full" else 4
            count = c.microbatches * (per_layer * layers_here + 2)
            out["tensor"] = count * hw.collective("all-reduce", c.tensor, hidden)
        if c.pipe > 1:
            ticks = self.fused_schedule(c).num_ticks
            sends = 4 if (c.schedule in V_SCHEDULES and c.pipe > 2) else 2
            out["pipe"] = sends * ticks * hw.collective("ppermute", c.pipe, hidden / c.tensor)
        grad = k.param_bytes / (c.tensor * c.pipe * c.expert)
        if c.data > 1:
            out["data"] = hw.collective("all-reduce", c.data, grad / c.fsdp)
        if c.fsdp > 1:
            out["fsdp"] = (hw.collective("all-gather", c.fsdp, grad)
                           + hw.collective("reduce-scatter", c.fsdp, grad))
        if c.expert > 1 and k.expert_tokens_factor:
            routed = hidden * k.expert_tokens_factor
            count = c.microbatches * 4 * layers_here
            out["expert"] = count * hw.collective("all-gather", c.expert, routed)
        return out

    def _parts(self, c: Candidate) -> tuple:
        if c not in self._cache:
            compute, bubble, iters = self._compute(c)
            self._cache[c] = (compute, bubble, iters, self._comm(c), self._update(c))
        return self._cache[c]

    def features(self, c: Candidate) -> np.ndarray:
        """``FEATURES`` of ``c``. The loop-iteration term counts the pipeline's fused
        ticks only: a tick runs the runtime's bookkeeping (buffer slots, a branch
        per part) besides its tasks, while an accumulated microbatch's cost is its
        pieces' kernels, already in the compute term."""
        compute, _, iters, comm, update = self._parts(c)
        ticks = float(iters) if c.pipe > 1 else 0.0
        return np.array([compute, sum(comm.values()), update, 1.0, ticks])

    # ------------------------------------------------------------- prediction
    def breakdown(self, c: Candidate) -> Breakdown:
        compute, bubble, iters, comm, update = self._parts(c)
        step = float(max(self.features(c) @ self.coef, 1e-9))
        return Breakdown(compute, dict(comm), iters, step, bubble, update)

    def step_time(self, c: Candidate) -> float:
        return self.breakdown(c).step_s

    def observe(self, c: Candidate, seconds: float) -> None:
        """Add a measured step time and refit the coefficients.

        The fit minimizes the *relative* errors of the observed trials (what the
        model is judged by; a slow layout does not outweigh a fast one) plus a ridge
        pull towards the prior, per coefficient: compute, comm and update are
        multipliers (prior 1; update held closer, since few layouts tell it apart
        from the fixed cost); the fixed costs are measured in units of the mean
        observed step, so trials can teach the model an overhead the
        micro-benchmarks did not see (a pipeline tick's bookkeeping, a step's host
        work). All coefficients stay >= 0."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        self.observed.append((c, float(seconds)))
        X = np.stack([self.features(cand) for cand, _ in self.observed])
        y = np.array([s for _, s in self.observed])
        ybar = float(np.mean(y))
        scale = np.array([1.0, 1.0, 1.0, ybar, ybar / 10])  # a fixed cost of ~ybar, a tick ~ybar/10
        u0 = self.prior / scale
        Z = X * scale / y[:, None]  # rows in units of their own measurement: relative errors
        lam = self.ridge * np.array([1.0, 1.0, 10.0, 1.0, 0.1])
        A = np.vstack([Z, np.diag(np.sqrt(lam))])
        b = np.concatenate([np.ones(len(y)), np.sqrt(lam) * u0])
        u, *_ = np.linalg.lstsq(A, b, rcond=None)
        self.coef = np.maximum(u, 0.0) * scale

    def rank(self, candidates: Sequence[Candidate]) -> list[tuple[Candidate, Breakdown]]:
        """Candidates by predicted step time per sample (fastest first)."""
        scored = [(c, self.breakdown(c)) for c in candidates]
        return sorted(scored, key=lambda cb: cb[1].step_s / cb[0].global_batch)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(x):
        x = np.asarray(x, float)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for value in np.unique(x):  # ties share their mean rank
            tie = x == value
            r[tie] = r[tie].mean()
        return r
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])
