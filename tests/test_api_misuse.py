"""The Python API's entry points given a wrong kind of argument: one ConfigError line
naming it, where each used to raise an AttributeError/TypeError from deep inside, or
(a string where a list goes) read the string a character at a time."""

from __future__ import annotations

import pytest
from jax.sharding import PartitionSpec as P

import mindpipe_jax as mp
from mindpipe_jax.errors import ConfigError

CASES = [
    # A string iterated as entries: "entry 'm' must be ..." named no entry the user wrote.
    (lambda: mp.use_rules("mlp=tensor").__enter__(),
     "parallel.rules 'mlp=tensor' is one string; give a list of them, ['mlp=tensor']"),
    (lambda: mp.use_rules(5).__enter__(),
     "parallel.rules must be a list of 'logical_name=mesh_axis' strings"),
    (lambda: mp.use_rules({"mlp": 5}).__enter__(), "parallel.rules row 'mlp': 5 must be mesh axis names"),
    # Accepted before: a row no logical name could ever look up.
    (lambda: mp.use_rules({5: ("tensor",)}).__enter__(), "parallel.rules entry 5 must be 'logical_name="),
    (lambda: mp.spec_for("mlp"), "spec_for names='mlp': give a tuple of logical names"),
    # Accepted before, as "compute".
    (lambda: mp.spec_for(("mlp",), "stored"),
     "spec_for kind='stored': valid kinds are 'storage' and 'compute'"),
    (lambda: mp.load_config(None, "model.d_model=64"),
     "load_config overrides='model.d_model=64' is one string; give a list"),
    (lambda: mp.load_config(5), "load_config path must be a TOML file's path or None, got int"),
    (lambda: mp.make_mesh(None), "make_mesh takes a ParallelConfig (a Config's .parallel), got NoneType"),
    (lambda: mp.build_model(mp.Config(), None),
     "build_model takes a ModelConfig (a Config's .model), got Config"),
    (lambda: mp.flops_per_token(mp.Config()), "flops_per_token takes a ModelConfig"),
    (lambda: mp.search_checkpoint(5),
     "run_dir must be the path of a `mindpipe supernet` run directory, got int"),
    # Equal to step 2, it was looked for in a directory "2.0" and called a damaged checkpoint.
    (lambda: mp.search_checkpoint(".", step=2.0), "step=2.0 must be a checkpoint's step number (an int)"),
    (lambda: mp.search_checkpoint(".", step=True), "step=True must be a checkpoint's step number"),
    (lambda: mp.search_checkpoint(".", log=5), "log=5 must be a callable taking one line"),
    # checkpoint=5 saved into runs/default; log=5 failed at the first line, after compiling.
    (lambda: mp.train_supernet(None, None, None, "train.steps=1", checkpoint=5),
     "train_supernet checkpoint=5 must be True or False"),
    (lambda: mp.train_supernet(None, None, None, "train.steps=1", log=5),
     "train_supernet log=5 must be a callable taking one line"),
    # Without checkpoint=True nothing is saved: the directory was silently left empty.
    (lambda: mp.train_supernet(None, None, None, "train.out_dir=/tmp/x"),
     'train.out_dir="/tmp/x" has no effect: train_supernet(..., checkpoint=False) saves nothing'),
    (lambda: mp.train_supernet(None, None, None, "train.checkpoint_every=2"),
     "train.checkpoint_every=2 has no effect"),
]


@pytest.mark.parametrize("call, message", CASES, ids=[m.split(" ")[0] for _, m in CASES])
def test_a_wrong_kind_of_argument_is_one_line(call, message):
    with pytest.raises(ConfigError) as err:
        call()
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("override, message", [
    ("parallel.rules=[5]", "config key parallel.rules=[5] has the wrong type; expected a list of str"),
    # The example was '[{'mlp': 'tensor'}]', itself refused.
    ('parallel.rules={mlp="tensor"}', """parallel.rules={'mlp': 'tensor'} must be a list (a TOML array), """
                                      """e.g. parallel.rules='["mlp=tensor"]' on the command line"""),
    ("supernet.heads={a=1}", "config key supernet.heads={'a': 1} must be a list (a TOML array)"),
])
def test_a_list_key_given_the_wrong_kind_of_list_says_what_it_takes(override, message):
    with pytest.raises(ConfigError) as err:
        mp.load_config(None, [override])
    assert str(err.value).endswith(message), str(err.value)


def test_rules_given_in_each_accepted_form_are_the_same_rows():
    forms = [["mlp=fsdp,tensor", "kv="], {"mlp": "fsdp,tensor", "kv": ()},
             {"mlp": ("fsdp", "tensor"), "kv": []}]
    specs = []
    for form in forms:
        with mp.use_rules(form):
            specs.append((mp.spec_for(("length", "mlp"), "storage"), mp.spec_for(("heads", "kv"))))
    assert specs[0] == specs[1] == specs[2] == ((P(None, ("fsdp", "tensor")), P("tensor", None)))
