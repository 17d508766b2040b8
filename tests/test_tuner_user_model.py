"""EPara on a user's model: layouts are judged on the model being trained (its
parameters' logical names and shapes, its stack's depth), never on ``cfg.model``, which
describes only the built-in GPT. Before: the online tuner switched a run to tensor=4
for a model whose MLP width (38) tensor=4 cannot split, and the run died mid-training
with the rules table's error; layouts the model supports were refused by the GPT's sizes."""

import dataclasses

import numpy as np
from byom_models import Llama

import mindpipe_jax as mp
from mindpipe_jax.config import Config
from mindpipe_jax.tuner.facts import ModelFacts
from mindpipe_jax.tuner.space import Candidate, check_candidate, enumerate_space

# model.* keeps the GPT defaults (4 heads, 4 layers, d_ff 512): what the user models differ from.
CFG = Config().replace("model.seq_len=8", "model.vocab_size=64", "train.global_batch=16")


def _cand(**axes) -> Candidate:
    return Candidate(**{"data": 1, "fsdp": 1, "tensor": 1, "pipe": 1, "subnet": 1, "expert": 1, **axes},
                     microbatches=2 if axes.get("pipe", 1) > 1 else 1, schedule="1f1b", virtual_stages=1,
                     remat="none", global_batch=16)


def test_candidates_are_judged_on_the_users_model():
    wide = ModelFacts.of(lambda rngs: Llama(d=64, heads=8, kv_heads=8, ff=64, layers=6, rngs=rngs), CFG)
    eight_heads = _cand(tensor=8)
    # The GPT's 4 heads refuse tensor=8; the model's 8 heads (and every dimension) split.
    assert "model.n_heads=4" in check_candidate(CFG, eight_heads, 8)
    assert check_candidate(CFG, eight_heads, 8, wide) is None
    # The model's 6 layers, not model.n_layers=4, decide the pipeline's depth.
    assert check_candidate(CFG, _cand(pipe=4, data=2), 8) is None
    why = check_candidate(CFG, _cand(pipe=4, data=2), 8, wide)
    assert "the layer stack of model Llama has 6 units" in why, why
    assert check_candidate(CFG, _cand(pipe=2, data=4), 8, wide) is None
    # A dimension the mesh cannot split is named, as train would name it.
    narrow = ModelFacts.of(lambda rngs: Llama(d=32, heads=2, kv_heads=1, ff=38, rngs=rngs), CFG)
    assert check_candidate(CFG, _cand(tensor=4, data=2), 8) is None
    why = check_candidate(CFG, _cand(tensor=4, data=2), 8, narrow)
    assert "(mlp=38) is not divisible by mesh axes tensor=4" in why, why
    space = enumerate_space(CFG, 8, axes=("data", "tensor"), microbatches=(1,), remats=("none",),
                            facts=narrow)
    assert {c.tensor for c in space.valid} == {1, 2}  # 38 = 2 x 19
    assert {c.tensor for c, _ in space.rejected} == {4, 8}
    assert all("(mlp=38) is not divisible" in why for _, why in space.rejected)


def test_remat_without_a_pipeline_is_refused_for_a_users_model():
    """model.remat builds the reference GPT's blocks: a user's layers decide their own, so
    without a pipeline a "full" candidate would run the "none" program under another price.
    Through a pipeline, parallel.stage_remat remats the user's stages: kept."""
    facts = ModelFacts.of(lambda rngs: Llama(rngs=rngs), CFG)
    full = dataclasses.replace(_cand(data=8), remat="full")
    assert check_candidate(CFG, full, 8) is None  # the GPT
    assert check_candidate(CFG, full, 8, facts) == (
        "remat full applies to the model's layers only through a pipeline (pipe > 1)")
    assert check_candidate(CFG, dataclasses.replace(_cand(pipe=2, data=4), remat="full"), 8, facts) is None
    space = enumerate_space(CFG, 8, axes=("data", "pipe"), microbatches=(2,), remats=("none", "full"),
                            facts=facts)
    assert {(c.pipe, c.remat) for c in space.valid} == {(p, r) for p in (1, 2, 4) for r in ("none", "full")
                                                         if p > 1 or r == "none"}


class PreferTensor4:
    """A step model that finds every tensor=4 layout 100x faster: the tuner switches to
    one as soon as it may."""

    def step_time(self, c):
        return 0.001 if c.tensor == 4 else 0.1

    def observe(self, c, seconds):
        pass


def test_the_online_tuner_never_switches_to_a_layout_the_model_cannot_take(tmp_path):
    run = mp.train(lambda rngs: Llama(d=32, heads=2, kv_heads=1, ff=38, rngs=rngs), None, mp.Config(),
                   "model.seq_len=8", "model.vocab_size=64", "data.source=synthetic", "train.steps=6",
                   "train.global_batch=16", "train.log_every=2", "train.progress=false", "train.eval_every=0",
                   "train.tensorboard=false", "parallel.data=8", "parallel.tensor=1", "tuner.enabled=true",
                   "tuner.meshes=true", "tuner.warmup=2", "tuner.every=2", "tuner.threshold=0",
                   "tuner.amortize=false", "tuner.batch_sizes=[16]", "tuner.prepare=false",
                   f"train.out_dir={tmp_path}", step_model=PreferTensor4())
    assert run.step == 6 and np.isfinite(run.history[-1]["loss"])
    assert not [h["tuner"] for h in run.history if "tuner" in h and h["tuner"]["candidate"]["tensor"] == 4]


def test_a_linen_model_is_tuned_as_train_builds_it():
    """``tune(model=<a Linen module>)`` (and ``mindpipe tune --model``) crashed with Flax's
    CallCompactUnboundModuleError: the module was called as a factory. Now it goes through
    the bridge as ``train`` takes it, its layouts judged on its own shapes."""
    from byom_models import linen_transformer

    from mindpipe_jax.tuner.tune import tune

    cfg = CFG.replace("data.source=synthetic")
    result = tune(cfg, axes=("data", "tensor"), microbatches=(1,), remats=("none",), max_compile=1, measure=1,
                  trial_steps=2, rounds=1, model=linen_transformer(), log=lambda _: None)
    assert result.best.measured_s is not None
    # Its 2 heads split over tensor=2 only (the GPT config's 4 heads would have let tensor=4 in).
    assert {r.candidate.tensor for r in result.rows} == {1, 2}
    assert {c.tensor for c, why in result.space.rejected if "(heads=2) is not divisible" in why} == {4, 8}
