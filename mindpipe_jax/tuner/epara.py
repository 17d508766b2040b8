"""EPara's online tuner: switch a running job to the configuration with the best
entropyput = throughput (samples/s) x statistical efficiency.

The loop feeds ``OnlineTuner`` every fetched step's metrics (for the gradient
noise scale, tuner/noise.py: Adam's preconditioned one for this project's AdamW)
and the measured time per step (for the step-time model). Every ``tuner.every``
steps (after ``tuner.warmup``) ``decide`` predicts, for each candidate — the global
batches of the batch ladder and, with ``tuner.meshes``, every data x fsdp x tensor
mesh shape (tuner/space.py) and, in a pipeline, microbatch counts from half to four
times the current one — its step time and so its entropyput
``B / t(B) x efficiency(B)``, and returns a ``Decision`` when the best beats the
current candidate by more than ``tuner.threshold``.
Switching is the loop's job (train/tuned.py, train/reconfigure.py): it compiles the chosen
layout first and refuses one whose step cannot fit in memory beside the run, which the
tuner then drops (``refuse``).

Step times come from a pluggable ``StepModel``: anything with
``step_time(candidate) -> seconds`` and ``observe(candidate, seconds)``, such as
tuner/costmodel.py's ``CostModel``. The default, ``MeasuredThroughput``, knows only
what this run measured.

Two guards keep a model's errors from costing the run (on this project's CPU
benchmark a cost model that over-predicted a batch sent the job 8 -> 16 -> 32 -> 8,
three recompiles for nothing): a candidate this run has measured is judged by its
measured time, and an unmeasured one by the model's time *relative* to the current
candidate, scaled by the current candidate's measured time, so the model's absolute
error cancels. And a switch must pay for itself: the time it saves over the
remaining steps, at the predicted gain, must exceed what the last compile took.

Two more keep a wrong prediction cheap (the same benchmark later went 16 -> 128 on a
prediction and trained 100 steps at a batch 3x slower than predicted, then paid a
recompile to come back): the loop keeps the compiled step of every candidate the
run has run (the learning-rate gain is an argument of the program, not a constant),
so going back costs no compile; and ``tuner.probe`` steps after a switch to a
candidate the run had not run, the tuner decides again on the times it now has.

A fifth sees the model's error *between* layouts, which the anchor cannot: an
unmeasured candidate switched to and measured slower than predicted makes every
unmeasured candidate that much dearer (``OnlineTuner._distrust``). And the model is
asked about each layout as the run's step computes it (``_as_run``: the noise
statistics split a step without a pipeline into two half-batch passes).

Without a noise estimate (a pipeline whose halves the runtime cannot keep apart, a
single microbatch, or too few steps yet) the efficiency of another batch size is
unknown, so only candidates with the current batch are compared (their efficiency is
equal).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import types

import jax
import numpy as np

from mindpipe_jax.config import Config
from mindpipe_jax.tuner.facts import ModelFacts, facts_of
from mindpipe_jax.tuner.measured import MeasuredThroughput, StepModel  # noqa: F401 (re-exported)
from mindpipe_jax.tuner.noise import NOISE_RULES, NoiseScale, efficiency, lr_gain
from mindpipe_jax.tuner.online_notes import start_notes
from mindpipe_jax.tuner.space import Candidate, check_candidate, enumerate_space


@dataclasses.dataclass(frozen=True)
class Decision:
    step: int
    before: Candidate
    after: Candidate
    gain: float  # predicted entropyput gain: 0.12 = +12 %
    b_noise: float | None
    lr_gain: float  # the learning-rate multiplier the new candidate trains with
    reason: str
    # The step model's prediction of the new candidate's step time (anchored on the
    # current one's, before ``OnlineTuner._distrust``): what its measurement is judged by.
    predicted_s: float = math.nan

    def line(self) -> str:
        parts = [f"B {self.before.global_batch} -> {self.after.global_batch}"]
        mesh = lambda c: c.label().split(" | ")[0]  # noqa: E731
        if mesh(self.before) != mesh(self.after):
            parts.append(f"mesh {mesh(self.before)} -> {mesh(self.after)}")
        if self.before.microbatches != self.after.microbatches:
            parts.append(f"microbatches {self.before.microbatches} -> {self.after.microbatches}")
        noise = f"B_noise {self.b_noise:.0f}" if self.b_noise is not None else "no noise estimate"
        return (f"step {self.step} | tuner: {', '.join(parts)}, predicted entropyput "
                f"{self.gain:+.0%} ({noise}), lr x{self.lr_gain:.3g}")

    def to_dict(self) -> dict:
        return {"step": self.step, "from": self.before.label(), "to": self.after.label(),
                "gain": self.gain, "b_noise": self.b_noise, "lr_gain": self.lr_gain, "reason": self.reason,
                "candidate": self.after.to_dict()}


def candidate_of(cfg: Config, mesh) -> Candidate:
    """The candidate a run is: its config with the mesh's real axis sizes."""
    par = cfg.parallel
    pipelined = mesh.shape["pipe"] > 1
    remat = par.stage_remat if isinstance(par.stage_remat, str) else par.stage_remat[0]
    return Candidate(**{a: int(mesh.shape[a]) for a in Candidate().axes},
                     microbatches=par.microbatches, schedule=par.schedule if pipelined else "1f1b",
                     virtual_stages=par.virtual_stages if pipelined else 1,
                     remat=remat if pipelined else cfg.model.remat, global_batch=cfg.train.global_batch)


def initial_lr_gain(cfg: Config) -> float:
    """The gain a fresh tuned run starts with (1 unless tuner.base_batch differs from
    train.global_batch under a fixed rule: the AdaScale rules need a noise estimate first)."""
    b0 = cfg.tuner.base_batch or cfg.train.global_batch
    return lr_gain(cfg.tuner.lr_scaling, cfg.train.global_batch, b0, None)


def batch_ladder(cfg: Config, initial_batch: int) -> list[int]:
    """``tuner.batch_sizes``, or min_batch x 1, 2, 4, ... up to max_batch."""
    tc = cfg.tuner
    if tc.batch_sizes:
        return sorted(set(tc.batch_sizes))
    lo, hi = tc.min_batch or initial_batch, tc.max_batch or 8 * initial_batch
    return [lo << k for k in range(64) if lo << k <= hi]


class OnlineTuner:
    """Decides, from measurements of the running job, when to switch it and to what.

    ``cfg`` is the run's current config and ``current`` its candidate; ``b0`` the
    base batch of efficiency and learning-rate gain; ``initial_batch`` the run's
    first global batch (defaults of the batch ladder). ``noise``, ``lr_gain`` and
    ``decisions`` continue a resumed run (``state_dict``).
    """

    def __init__(self, cfg: Config, current: Candidate, num_devices: int, *,
                 step_model: StepModel | None = None, b0: int = 0, initial_batch: int = 0,
                 lr_gain: float = 1.0, noise: NoiseScale | None = None, decisions: int = 0,
                 facts: ModelFacts | None = None):
        self.cfg, self.current, self.num_devices = cfg, current, num_devices
        self.facts = facts  # a user's model: candidates judged on it, not on cfg.model
        self.model = step_model if step_model is not None else MeasuredThroughput()
        self.initial_batch = initial_batch or current.global_batch
        self.b0 = b0 or cfg.tuner.base_batch or self.initial_batch
        self.lr_gain = lr_gain
        self.noise = noise or NoiseScale(cfg.tuner.ema)
        self.decisions = decisions
        self.candidates = self._candidates()
        self.note = self._noise_note()
        self._discard_until = -1  # time of the first step after a (re)compile is not representative
        self.switch_cost_s = 0.0  # what a switch costs: the last compile time the loop reported
        self._times: dict[Candidate, list[float]] = {}  # this run's step times per candidate
        # Candidates this process has run: the loop keeps their compiled steps, so going
        # back to one compiles nothing (train/loop.py).
        self._ran: set[Candidate] = {current}
        # Candidates compiled ahead in the background (the loop reports them, ``prepared``):
        # a switch to one costs no compile either.
        self._ready: set[Candidate] = set()
        self._next_up: Candidate | None = None  # what ``to_prepare`` hands the loop
        self._probe_at = -1  # the early decision after a switch to an unmeasured candidate
        # Unmeasured candidates switched to, with the step time each switch was decided
        # on: once measured, how far off that was (``_distrust``).
        self._promised: dict[Candidate, float] = {}

    # -- what is compared ------------------------------------------------------
    def _candidates(self) -> list[Candidate]:
        cur, tc = self.current, self.cfg.tuner
        batches = sorted(set(batch_ladder(self.cfg, self.initial_batch)) | {cur.global_batch})
        if tc.meshes:
            # Pipeline and expert axes stay in play only if the run already uses them.
            axes = ("data", "fsdp", "tensor") + tuple(a for a in ("pipe", "expert") if cur.axes[a] > 1)
            # A pipeline also weighs its microbatch count: more fill the bubble, each costs a
            # launch and a smaller matmul (the cost model prices both; the batch is unchanged).
            m = cur.microbatches
            micro = sorted({x for x in (m // 2, m, 2 * m, 4 * m) if x >= 1}) if cur.pipe > 1 else (m,)
            found = enumerate_space(self.cfg, self.num_devices, axes=axes, global_batches=batches,
                                    microbatches=micro, schedules=(cur.schedule,),
                                    virtual_stages=(cur.virtual_stages,), remats=(cur.remat,),
                                    facts=self.facts).valid
        else:
            found = [c for b in batches
                     if check_candidate(self.cfg, c := dataclasses.replace(cur, global_batch=b),
                                        self.num_devices, self.facts) is None]
        return sorted(set(found) | {cur})

    def start_notes(self, steps: int, start: int = 0) -> list[str]:
        """The lines a run starting at ``start`` logs first (tuner/online_notes.py)."""
        return ([self.note] if self.note else []) + start_notes(self, steps, start)

    def _noise_note(self) -> str | None:
        """Why there is no noise estimate for the current candidate, or None."""
        from mindpipe_jax.train.step import noise_microbatches
        if noise_microbatches(self.current.apply(self.cfg), types.SimpleNamespace(
                shape=self.current.axes)):
            return None
        why = (f"parallel.pipe={self.current.pipe}: the pipeline keeps the step's two halves apart only with "
               f"an even parallel.microbatches, grad_sync 'end' in fp32, no stage_layers and fsdp weights "
               f"gathered once per step" if self.current.pipe > 1 else
               "the batch does not split into two halves over the batch devices")
        return (f"tuner: no gradient noise estimate ({why}); only candidates with the current "
                f"batch {self.current.global_batch} are compared")

    # -- measurements --------------------------------------------------------
    def _as_run(self, c: Candidate) -> Candidate:
        """``c`` as this run's step computes it, what the step model prices and is fitted
        on: the tuner's noise statistics make a step without a pipeline accumulate at
        least two microbatches (``train.step.make_grad_fn``: two half-batch passes where
        the layout has one): 1.4-1.6x a plain step's time against a pipeline's 1.2x
        (``benchmarks/noise_stats_cost.py``), so priced as one pass such layouts looked
        faster than they ran beside a pipeline. (The pipeline's own 1.2x is not priced.)"""
        from mindpipe_jax.train.step import noise_microbatches

        if c.pipe > 1 or self.cfg.train.grad_accum * c.microbatches >= 2:
            return c
        if noise_microbatches(c.apply(self.cfg), types.SimpleNamespace(shape=c.axes)) < 2:
            return c  # no statistics: one pass
        return dataclasses.replace(c, microbatches=2)

    def restart(self, step: int, compile_s: float | None = None) -> None:
        """A new step program runs from ``step``: discard the time of its first step.
        ``compile_s``: what compiling it took, the price of the next switch."""
        self._discard_until = step + 1
        if compile_s is not None and math.isfinite(compile_s) and compile_s > 0:  # 0: a kept program
            self.switch_cost_s = float(compile_s)

    def fetch_due(self, step: int) -> bool:
        return step == self._discard_until or self.due(step)

    def due(self, step: int) -> bool:
        return step == self._probe_at or (step >= self.cfg.tuner.warmup and step % self.cfg.tuner.every == 0)

    def switch_cost(self, c: Candidate) -> float:
        """Seconds a switch to ``c`` costs the run: nothing to compile for a candidate it
        has run (the loop kept that program) or compiled ahead (``prepared``), else the
        last compile time."""
        return 0.0 if c in self._ran or c in self._ready else self.switch_cost_s

    def to_prepare(self) -> Candidate | None:
        """The candidate the last decision found most likely to be switched to later
        (``tuner.prepare``: the best positive predicted gain among candidates neither run
        nor compiled ahead), once; None if there is none."""
        c, self._next_up = self._next_up, None
        return c

    def prepared(self, c: Candidate) -> None:
        """The loop has compiled ``c`` ahead: a switch to it now costs no compile."""
        self._ready.add(c)

    def observe(self, metrics: list[dict], seconds_per_step: float | None, last_step: int) -> None:
        """Fetched steps' metrics (host values) and their mean measured step time."""
        for m in metrics:
            if "micro_grad_sq" in m and math.isfinite(float(m["loss"])):
                self.noise.update_from_metrics(m)  # preconditioned for Adam (tuner/noise.py)
        discard = last_step - len(metrics) < self._discard_until <= last_step
        if seconds_per_step is not None and not discard:
            self.model.observe(self._as_run(self.current), seconds_per_step)
            if math.isfinite(seconds_per_step) and seconds_per_step > 0:
                times = self._times.setdefault(self.current, [])
                times.append(seconds_per_step)
                del times[:-8]

    def _anchor(self) -> float:
        """Measured over predicted step time of the current candidate (1 until measured).
        Computed once per decision: a cost model's prediction can run the simulator."""
        here = self._times.get(self.current)
        model_here = self.model.step_time(self._as_run(self.current)) if here else math.nan
        return statistics.median(here) / model_here if model_here > 0 and math.isfinite(model_here) else 1.0

    def _distrust(self) -> float:
        """How much slower than predicted the unmeasured candidates this run switched to
        ran (the median of measured / predicted, at least 1): the step model's error
        *between* layouts, which the anchor (the current layout's error) cannot see.
        Before it, a model that priced non-pipeline layouts 2.5-4x too fast relative to
        the pipeline a run had (a user's small Llama on pipe2 x data4; partly the noise
        statistics' two passes, now priced: ``_as_run``) sent the run to four of them in
        turn and back after each, 7 switches in 40 steps, each measured slower.
        A prediction found pessimistic does not make it trust the others more: a switch
        costs a compile, staying costs only the gain."""
        misses = [statistics.median(self._times[c]) / t for c, t in self._promised.items()
                  if self._times.get(c) and t > 0]
        return max(1.0, statistics.median(misses)) if misses else 1.0

    def _scale(self) -> float:
        """What a prediction is multiplied by (``step_time``'s ``anchor``)."""
        return self._anchor() * self._distrust()

    def step_time(self, c: Candidate, anchor: float | None = None) -> float:
        """``c``'s step time as decisions see it: measured in this run if it was, else the
        step model's prediction relative to the current candidate's, times the current
        candidate's measured time (``anchor``; the model's absolute error cancels) and the
        error of earlier switches' predictions (``_distrust``)."""
        if seen := self._times.get(c):
            return statistics.median(seen)
        predicted = self.model.step_time(self._as_run(c))
        return predicted * (self._scale() if anchor is None else anchor) if predicted > 0 else predicted

    @property
    def b_noise(self) -> float | None:
        return self.noise.b_noise if self.note is None else None

    def metrics(self) -> dict:
        bn = self.b_noise
        return {"tuner/batch": self.current.global_batch, "tuner/b_noise": math.nan if bn is None else bn,
                "tuner/efficiency": efficiency(self.current.global_batch, bn, self.b0)
                if bn is not None else math.nan, "tuner/lr_gain": self.lr_gain}

    # -- decisions -----------------------------------------------------------
    def _entropyput(self, c: Candidate, seconds: float, bn: float | None) -> float:
        eff = 1.0 if bn is None else efficiency(c.global_batch, bn, self.b0)
        return c.global_batch / seconds * eff

    def decide(self, step: int) -> Decision | None:
        """The switch to make after ``step``, or None (not due, nothing measured, no gain)."""
        if not self.due(step):
            return None
        bn = self.b_noise
        distrust = self._distrust()
        anchor = self._anchor() * distrust
        now = self.step_time(self.current, anchor)
        # Reaching the same progress at 1 + gain the rate saves remaining x gain / (1 + gain).
        remaining = max(self.cfg.train.steps - step, 0) * now if now > 0 else 0.0
        best, gain, best_t, saves = None, 0.0, math.nan, 0.0
        ahead, ahead_gain = None, 0.0  # the best not yet compiled, whatever it saves
        if now > 0:
            now_e = self._entropyput(self.current, now, bn)
            for c in self.candidates:
                if c == self.current or (bn is None and c.global_batch != self.current.global_batch):
                    continue
                t = self.step_time(c, anchor)
                if not t > 0:
                    continue
                g = self._entropyput(c, t, bn) / now_e - 1
                s = remaining * g / (1 + g) if g > 0 else 0.0
                # The best candidate that pays back its switch (its compile, if the run has
                # not run it) before the run ends.
                if g > gain and (not self.cfg.tuner.amortize or s > self.switch_cost(c)):
                    best, gain, best_t, saves = c, g, t, s
                if g > ahead_gain and c not in self._ran and c not in self._ready:
                    ahead, ahead_gain = c, g
        index = self.candidates.index(best) if best is not None else -1
        ahead_index = self.candidates.index(ahead) if ahead is not None else -1
        if jax.process_count() > 1:  # every process must make process 0's choice
            from jax.experimental import multihost_utils
            index, gain, ahead_index = multihost_utils.broadcast_one_to_all(
                np.asarray([index, gain, ahead_index], np.float32))
            index, gain, ahead_index = int(index), float(gain), int(ahead_index)
            best = self.candidates[index] if index >= 0 else None
            best_t = self.step_time(best, anchor) if best is not None else math.nan
            saves = max(self.cfg.train.steps - step, 0) * now * gain / (1 + gain)
        if best is None or not gain > self.cfg.tuner.threshold:
            if self.cfg.tuner.prepare and ahead_index >= 0:
                self._next_up = self.candidates[ahead_index]
            return None
        eff = (lambda c: efficiency(c.global_batch, bn, self.b0)) if bn is not None else (lambda c: 1.0)
        reason = (f"predicted {best.global_batch / best_t:,.1f} samples/s x efficiency {eff(best):.3f} vs "
                  f"{self.current.global_batch / now:,.1f} x {eff(self.current):.3f} now; saves "
                  f"~{saves:.1f} s of the remaining {remaining:.1f} s against "
                  f"~{self.switch_cost(best):.1f} s to switch"
                  + (f"; unmeasured layouts priced x{distrust:.2f}, as slow as earlier switches ran "
                     f"against their prediction" if distrust > 1 else ""))
        rule = self.cfg.tuner.lr_scaling
        # Without a noise estimate only the mesh can change (same batch): the AdaScale rules keep
        # their gain.
        new_gain = self.lr_gain if bn is None and rule in NOISE_RULES else lr_gain(
            rule, best.global_batch, self.b0, bn)
        return Decision(step, self.current, best, gain, bn, new_gain, reason, best_t / distrust)

    def accept(self, decision: Decision, cfg: Config, compile_s: float | None = None) -> None:
        """The loop switched to ``decision.after`` (compiling it took ``compile_s``);
        ``cfg`` is the run's new config."""
        if not self._times.get(decision.after) and decision.predicted_s > 0:
            self._promised[decision.after] = decision.predicted_s
        self.cfg, self.current, self.lr_gain = cfg, decision.after, decision.lr_gain
        self.decisions += 1
        self.note = self._noise_note()
        self.restart(decision.step, compile_s)
        self._next_up = None  # decided on the old candidate's times
        if self.cfg.tuner.probe and decision.after not in self._ran:  # a prediction: check it soon
            # (after the first step, whose time is discarded); the same step on every process
            self._probe_at = decision.step + 1 + self.cfg.tuner.probe
        self._ran.add(decision.after)

    def refuse(self, c: Candidate) -> None:
        """The loop could not switch to ``c`` (its step does not fit in memory here): it is
        not weighed again in this run (every process drops it alike: the loop's refusal is
        agreed). Its compile took the loop's time, not the steps' (nothing to discard)."""
        if c != self.current and c in self.candidates:
            self.candidates.remove(c)
        self._ready.discard(c)
        if self._next_up == c:
            self._next_up = None

    def state_dict(self) -> dict:
        """What a checkpoint keeps so ``train.resume=true`` continues as tuned (JSON)."""
        return {"candidate": self.current.to_dict(), "lr_gain": self.lr_gain, "b0": self.b0,
                "initial_batch": self.initial_batch, "noise": self.noise.to_dict(),
                "decisions": self.decisions}

    @classmethod
    def from_state(cls, cfg: Config, current: Candidate, num_devices: int, saved: dict | None, *,
                   lr_gain: float = 1.0, step_model: StepModel | None = None,
                   facts: ModelFacts | None = None) -> OnlineTuner:
        """A tuner for a fresh run (``saved`` empty) or one continuing ``saved``
        (``state_dict`` of a checkpoint); ``lr_gain`` is the gain the run trains with;
        ``facts``: the user's model the run trains (None: ``cfg.model``'s)."""
        saved = saved or {}
        noise = NoiseScale.from_dict({**saved["noise"], "ema": cfg.tuner.ema}) if "noise" in saved else None
        if step_model is None and cfg.tuner.meshes:
            step_model = cost_model_for(cfg, facts)
        return cls(cfg, current, num_devices, step_model=step_model, b0=saved.get("b0", 0),
                   initial_batch=saved.get("initial_batch", 0), lr_gain=lr_gain, noise=noise,
                   decisions=saved.get("decisions", 0), facts=facts)


def cost_model_for(cfg: Config, facts: ModelFacts | None = None):
    """The cost model (tuner/costmodel.py) of the run's model (``facts``: a user's;
    None: ``cfg.model``'s) on this machine: what ``tuner.meshes`` needs, since a mesh
    the run has not measured can only be predicted from FLOPs, links and the schedule.
    Calibrating takes a few seconds."""
    from mindpipe_jax.tuner.costmodel import CostModel, Hardware, ModelCosts

    costs = ModelCosts.measure(cfg, model=None if facts is None else facts.factory())
    return CostModel(costs, Hardware.calibrate(), cfg.model.seq_len)


class EParaTuning:
    """EPara's online tuner as the training loop takes it (``train.tuned.OnlineTuning``)."""

    def resume(self, cfg: Config, saved: dict, model=None) -> tuple[Config, dict]:
        """The run as it was tuned; on another device count, re-planned (tuner/elastic.py)
        for ``model`` (a user's, as ``train`` takes it; None: ``cfg.model``'s)."""
        from mindpipe_jax.tuner.elastic import replan

        candidate, devices = Candidate(**saved["candidate"]), len(jax.devices())
        if candidate.devices != devices:
            plan = replan(cfg, saved, devices, facts_of(model, cfg))
            if jax.process_index() == 0:
                print(plan.line(), flush=True)
            candidate = plan.after
            saved = {**saved, "candidate": candidate.to_dict(), "lr_gain": plan.lr_gain}
        return candidate.apply(cfg), saved

    def initial_gain(self, cfg: Config) -> float:
        return initial_lr_gain(cfg)

    def make(self, cfg: Config, mesh, saved: dict, lr_gain: float, step_model, model=None) -> OnlineTuner:
        return OnlineTuner.from_state(cfg, candidate_of(cfg, mesh), len(jax.devices()), saved,
                                      lr_gain=lr_gain, step_model=step_model, facts=facts_of(model, cfg))

