"""``mindpipe_jax.train``: the training loop with EPara's online tuner plugged in.

The loop (train/loop.py) runs everything but the tuner's decisions and takes an
``OnlineTuning`` for them; the tuner (tuner/epara.py) implements one. Neither knows
the other's module: imports point from tuner to train, never back, and the tuner
never imports this module. This is the only module that imports both, so a reader
looking for the public ``train`` finds the loop's arguments documented at
``train.loop.train`` and the composition here.
"""

from __future__ import annotations

from mindpipe_jax.config import Config
from mindpipe_jax.train.loop import train as train_loop
from mindpipe_jax.tuner.epara import EParaTuning, StepModel


def train(model=None, data=None, config: Config | None = None, *overrides: str,
          step_model: StepModel | None = None):
    """``mindpipe_jax.train``: the training loop (``train.loop.train``, same arguments) with
    EPara's online tuner plugged in for ``tuner.enabled`` and for resuming tuned runs."""
    return train_loop(model, data, config, *overrides, step_model=step_model, tuning=EParaTuning())
