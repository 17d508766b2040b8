"""The sections of MindPipe's two methods: ``supernet`` (SPara) and ``tuner``
(EPara), frozen dataclasses with their defaults, each checking its own keys in
``__post_init__``, and the SPara semantics with the message for a value that is not
one (the loader names it too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mindpipe_jax.config_values import _check, _check_numbers, _positive

SUPERNET_SEMANTICS = ("sync", "sequential", "operator-causal")
_RENAMED_SEMANTICS = {"causal": "operator-causal"}  # old name -> new, refused naming the new one


def semantics_error(semantics) -> str | None:
    """The one-line reason ``semantics`` is not a SPara semantics (``supernet.semantics``), or None."""
    if semantics in SUPERNET_SEMANTICS:
        return None
    valid = ", ".join(repr(s) for s in SUPERNET_SEMANTICS)
    if isinstance(semantics, str) and semantics in _RENAMED_SEMANTICS:  # a list is unhashable
        return (f"supernet.semantics={semantics!r} is now called {_RENAMED_SEMANTICS[semantics]!r} "
                f"(its shared weights take one averaged update per step; 'sequential' trains the "
                f"subnets one after another); valid: {valid}")
    return f"supernet.semantics={semantics!r} is not valid; valid: {valid}"


@dataclass(frozen=True)
class SupernetConfig:
    """SPara (``mindpipe_jax.supernet``): the search space, how subnets are sampled and
    trained together over shared weights, and the search afterwards.

    ``semantics``: ``sync`` (the K subnets of a step read the same weights, their
    gradients are averaged: one update per step), ``sequential`` (equal to training
    them one after another, each with its own update of every weight it touches) or
    ``operator-causal`` (sequential for the operator candidates, while the shared
    layers take one averaged update per step). ``vmap_width``
    subnets are vectorized per device: it changes the bits of a subnet's gradient,
    the device count never does, so keep it fixed to compare runs. The ``subnet``
    mesh axis (``parallel.subnet``) splits the K subnets of a step.

    ``ladder_levels``: subnets run sliced, at their own depth and with FFN widths and
    head counts rounded up to at most this many sizes each (one compiled program per
    shape); 0 runs every subnet masked at the supernet's full size (one program).
    """

    semantics: Literal["sync", "sequential", "operator-causal"] = "sync"
    subnets_per_step: int = 4  # K
    strategy: Literal["uniform", "sandwich"] = "sandwich"
    vmap_width: int = 1
    ladder_levels: int = 4  # sliced execution: sizes per ladder; 0 = masked (full size)
    ops: tuple[str, ...] = ("gelu", "relu", "silu")  # FFN candidates (their activations)
    ffn_ratios: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)  # hidden widths, fractions of d_ff
    heads: tuple[int, ...] = ()  # attention head counts; empty = 1..model.n_heads
    min_depth: int = 1  # blocks: min_depth..model.n_layers
    search_population: int = 16
    search_generations: int = 4
    search_top_k: int = 5
    search_max_params: int = 0  # only subnets with at most this many parameters; 0 = no limit
    search_eval_batches: int = 2  # validation batches of train.global_batch rows per subnet

    def __post_init__(self):
        _check_numbers(self, "supernet")
        _check(semantics_error(self.semantics) is None, semantics_error(self.semantics))
        _check(self.strategy in ("uniform", "sandwich"),
               f"supernet.strategy={self.strategy!r} is not valid; valid: 'uniform', 'sandwich'")
        _positive("supernet", subnets_per_step=self.subnets_per_step, vmap_width=self.vmap_width,
                  min_depth=self.min_depth, search_population=self.search_population,
                  search_top_k=self.search_top_k, search_eval_batches=self.search_eval_batches)
        _check(self.ladder_levels >= 0,
               f"supernet.ladder_levels={self.ladder_levels} must be >= 0 (sizes each FFN width and head "
               f"count is rounded up to; 0 = masked, every subnet at full size)")
        _check(self.search_generations >= 0,
               f"supernet.search_generations={self.search_generations} must be >= 0")
        _check(self.search_max_params >= 0,
               f"supernet.search_max_params={self.search_max_params} must be >= 0 (0 = no limit)")
        _check(self.strategy != "sandwich" or self.subnets_per_step >= 2,
               f"supernet.subnets_per_step={self.subnets_per_step}: the sandwich strategy needs >= 2 "
               f"(largest + smallest [+ random]); use strategy='uniform' for 1")
        _check(bool(self.ops), "supernet.ops must name at least one FFN candidate")
        _check(bool(self.ffn_ratios) and all(0 < r <= 1 for r in self.ffn_ratios),
               f"supernet.ffn_ratios={list(self.ffn_ratios)} must be non-empty fractions in (0, 1]")
        _check(all(h >= 1 for h in self.heads), f"supernet.heads={list(self.heads)} must be >= 1")
        # Checked here, not only by the search: it was refused after the whole supernet trained.
        _check(self.search_population >= 2,
               f"supernet.search_population={self.search_population} must be >= 2 (the search breeds "
               f"its population; 2 is the least it can cross)")
        for key in ("ops", "ffn_ratios", "heads"):
            values = list(getattr(self, key))
            twice = sorted({v for v in values if values.count(v) > 1}, key=values.index)
            # A repeated candidate is the same subnet under two codes: sampled twice as often
            # and searched twice, silently.
            _check(not twice, f"supernet.{key}={values} names {', '.join(map(repr, twice))} more than "
                              f"once; give each candidate once")


@dataclass(frozen=True)
class TunerConfig:
    """EPara's online tuner (``mindpipe_jax.tuner.epara``): while training, every
    ``every`` steps, estimate the gradient noise scale, predict each candidate's
    entropyput = samples/s x statistical efficiency, and switch the run in place to
    the best candidate when it beats the current one by more than ``threshold``.

    Candidates are the global batches ``batch_sizes`` (empty = min_batch, 2*min_batch,
    4*min_batch, ... up to max_batch; 0 = the initial train.global_batch for
    min_batch and 8x it for max_batch), and with ``meshes`` also every data x fsdp x
    tensor mesh shape of the devices. ``base_batch`` is the b0 efficiency and the
    learning-rate gain are relative to (0 = the initial train.global_batch).
    ``lr_scaling``: how the learning rate follows the batch (tuner/noise.py):
    ``sqrt_adascale`` (default, the square-root rule for Adam-family optimizers such
    as this project's AdamW) = sqrt((B/b0) x efficiency(B)), ``adascale`` (SGD's) =
    (B/b0) x efficiency(B), ``sqrt`` = sqrt(B/b0), ``linear`` = B/b0, ``none`` = 1.
    ``ema`` smooths the noise estimate per step; ``warmup`` steps pass
    before the first decision. ``amortize``: a switch must also pay back its
    recompile (the last compile time; nothing for a candidate the run has already
    run, whose compiled step the loop keeps) within the remaining ``train.steps``;
    false switches on the predicted gain alone (demos, tests of switching).
    ``probe``: steps after a switch to a candidate the run had not measured before
    the tuner decides again, on the times it has now measured (a prediction that was
    wrong is undone then, not ``every`` steps later; the way back compiles nothing);
    0 = at the next regular decision.
    ``prepare``: at a decision that keeps the run as it is, compile in a background
    thread the candidate not yet run with the best positive predicted gain (one that
    does not yet clear ``threshold`` or pay back its compile), so that when it does, the
    switch costs no compile; step times measured while it compiles are not used.
    ``noise_every``: the train step computes the noise statistics on every
    ``noise_every``-th step only (the others report NaN, which the estimate skips):
    they cost a few passes over the gradients, which on a small model is a
    noticeable share of the step. ``ema`` weighs the past per measured step, so its
    window spans ``noise_every`` times as many steps and follows a B_noise that rises
    during training later (seen on the online benchmark's run: 12 at step 200 with 4,
    29 with 1).
    """

    enabled: bool = False
    every: int = 50
    threshold: float = 0.05
    batch_sizes: tuple[int, ...] = ()
    min_batch: int = 0
    max_batch: int = 0
    base_batch: int = 0
    lr_scaling: Literal["sqrt_adascale", "adascale", "sqrt", "linear", "none"] = "sqrt_adascale"
    ema: float = 0.9
    meshes: bool = False
    warmup: int = 50
    amortize: bool = True
    noise_every: int = 1
    probe: int = 20
    prepare: bool = True

    def __post_init__(self):
        _check_numbers(self, "tuner")
        _positive("tuner", every=self.every, noise_every=self.noise_every)
        _check(self.threshold >= 0, f"tuner.threshold={self.threshold} must be >= 0")
        _check(all(b > 0 for b in self.batch_sizes),
               f"tuner.batch_sizes={list(self.batch_sizes)} must all be > 0")
        for key in ("min_batch", "max_batch", "base_batch", "warmup", "probe"):
            value = getattr(self, key)
            _check(value >= 0, f"tuner.{key}={value} must be >= 0"
                   + ("" if key in ("warmup", "probe") else " (0 = from train.global_batch)"))
        ranged = [f"tuner.{k}={getattr(self, k)}" for k in ("min_batch", "max_batch") if getattr(self, k)]
        _check(not (self.batch_sizes and ranged),
               f"{' and '.join(ranged)} {'has' if len(ranged) == 1 else 'have'} no effect with "
               f"tuner.batch_sizes={list(self.batch_sizes)} (the candidates listed); drop one or the other")
        _check(not (self.min_batch and self.max_batch) or self.min_batch <= self.max_batch,
               f"tuner.min_batch={self.min_batch} must be <= tuner.max_batch={self.max_batch}")
        _check(0.0 <= self.ema < 1.0, f"tuner.ema={self.ema} must be in [0, 1)")
