"""The memory check before a train step's first run (train/memory_fit.py), on the
compiler's own counts: what it compares on CPUs, where the devices share the host's
RAM, and on accelerators, where each has its own limit."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.train.memory_fit import (
    check_programs_fit,
    check_step_fits,
    fit_problem,
    host_free_bytes,
    peak_bytes,
    room_now,
    state_bytes,
)

GIB = 2**30


def _compiled(arg=1.0, temp=2.0, out=1.0, alias=1.0):
    stats = types.SimpleNamespace(argument_size_in_bytes=arg * GIB, temp_size_in_bytes=temp * GIB,
                                  output_size_in_bytes=out * GIB, alias_size_in_bytes=alias * GIB)
    return types.SimpleNamespace(memory_analysis=lambda: stats)


def _mesh(n: int):
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def test_peak_is_arguments_temporaries_and_outputs_less_what_the_donation_aliases():
    assert peak_bytes(_compiled().memory_analysis()) == 3 * GIB


def test_on_cpus_every_device_of_the_process_counts_against_the_host():
    # 4 devices x 3 GiB = 12 GiB: fits in 12, not in 11.9.
    check_step_fits(_compiled(), _mesh(4), state_resident=False, free_bytes=12 * GIB)
    with pytest.raises(ConfigError, match=r"needs 12\.0 GiB of memory \(4 devices x 3\.00 GiB of state, "
                                          r"activations and temporaries.*11\.9 GiB free: it would be killed"):
        check_step_fits(_compiled(), _mesh(4), state_resident=False, free_bytes=11.9 * GIB)


def test_the_advice_names_the_remat_key_of_the_layout():
    with pytest.raises(ConfigError, match=r"set model\.remat=full"):
        check_step_fits(_compiled(), _mesh(4), state_resident=False, free_bytes=0.0)
    piped = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("pipe", "data"))
    with pytest.raises(ConfigError, match=r"set parallel\.stage_remat=full"):
        check_step_fits(_compiled(), piped, state_resident=False, free_bytes=0.0)


def test_a_state_already_in_memory_is_not_counted_twice():
    # Restored from a checkpoint, the state's 1 GiB per device is resident already: 2 GiB more each.
    check_step_fits(_compiled(), _mesh(4), state_resident=True, free_bytes=8 * GIB)
    with pytest.raises(ConfigError, match=r"8\.0 GiB of memory \(4 devices x 2\.00 GiB of activations and "
                                          r"temporaries beside the state"):
        check_step_fits(_compiled(), _mesh(4), state_resident=True, free_bytes=7.9 * GIB)


def test_a_switch_counts_the_state_it_replaces_and_the_copy_beside_it():
    # The tuner's switch: the current state (2 GiB on this process) stays until the copy is
    # made. The step's 4 x 3 GiB less the 2 GiB freed before it runs: 10 GiB more; the copy
    # alone 4 x 1 GiB.
    assert fit_problem(_compiled(), _mesh(4), state_resident=False, replacing_bytes=2 * GIB,
                       free_bytes=10 * GIB) is None
    problem = fit_problem(_compiled(), _mesh(4), state_resident=False, replacing_bytes=2 * GIB,
                          free_bytes=9.9 * GIB)
    assert problem.startswith("the switch needs 10.0 GiB more memory than the run holds now"), problem
    # A state that shrinks a lot (the new layout shards it more): the copy binds.
    big = _compiled(arg=3.0, temp=0.5, out=3.0, alias=3.0)
    problem = fit_problem(big, _mesh(4), state_resident=False, replacing_bytes=40 * GIB,
                          free_bytes=11.9 * GIB)
    assert "needs 12.0 GiB" in problem and "copy 12.00 GiB" in problem


def test_a_chain_of_programs_counts_what_each_holds_beside_the_state(monkeypatch):
    # start: takes the state (2 GiB per device, resident), donates 1 GiB of it into its carry
    # (3 GiB out), 1 GiB of temporaries: 3 GiB beside the state. A round: the carry in and
    # out (donated) and 4 GiB of temporaries: 3 + 4 + 3 - 3 = 7, less the 1 GiB the carry
    # took over from the state: 6. The finish: the carry in, the new state out: 3 + 0.5 + 2 - 1.
    from mindpipe_jax.train import memory_fit

    chain = [_compiled(arg=2.0, temp=1.0, out=3.0, alias=1.0),
             _compiled(arg=3.0, temp=4.0, out=3.0, alias=3.0),
             _compiled(arg=3.0, temp=0.5, out=2.0, alias=1.0)]
    monkeypatch.setattr(memory_fit, "host_free_bytes", lambda: 24 * GIB)
    check_programs_fit(chain, _mesh(4))
    monkeypatch.setattr(memory_fit, "host_free_bytes", lambda: 23.9 * GIB)
    with pytest.raises(ConfigError, match=r"needs 24\.0 GiB of memory \(4 devices x 6\.00 GiB of "
                                          r"activations and temporaries beside the state.*; "
                                          r"lower train\.global_batch, X$"):
        check_programs_fit(chain, _mesh(4), advice="lower train.global_batch, X")


def test_state_bytes_counts_this_process_shards():
    mesh = _mesh(4)
    sharded = jax.device_put(np.zeros((8, 4), np.float32), jax.NamedSharding(mesh, jax.P("data")))
    replicated = jax.device_put(np.zeros((8,), np.float32), jax.NamedSharding(mesh, jax.P()))
    assert state_bytes({"a": sharded, "b": [replicated]}) == 8 * 4 * 4 + 4 * 8 * 4


def test_an_accelerator_is_judged_by_its_own_limit():
    class Gpu:
        platform, device_kind, process_index = "gpu", "NVIDIA H100", 0

        def __init__(self, limit):
            self.limit = limit

        def memory_stats(self):
            return {"bytes_limit": self.limit}

    def mesh(limit):
        return types.SimpleNamespace(devices=np.array([Gpu(limit), Gpu(limit)]))

    check_step_fits(_compiled(), mesh(3 * GIB), state_resident=False, free_bytes=0.0)  # host RAM is not it
    with pytest.raises(ConfigError, match=r"3\.00 GiB per device .* a NVIDIA H100 holds 2\.50 GiB"):
        check_step_fits(_compiled(), mesh(2.5 * GIB), state_resident=False)
    # A switch: the copy (1 GiB) beside the current state (6 GiB over the two: 3 each) is 4 GiB.
    problem = fit_problem(_compiled(), mesh(3.5 * GIB), state_resident=False, replacing_bytes=6 * GIB)
    assert "4.00 GiB per device (state, activations and temporaries, and the current state while it is " \
           "copied" in problem, problem


def test_room_now_is_the_hosts_free_memory_shared_or_the_least_an_accelerator_has_left(monkeypatch):
    from mindpipe_jax.train import memory_fit

    monkeypatch.setattr(memory_fit, "host_free_bytes", lambda: 8 * GIB)
    assert room_now(jax.devices()[:4]) == 2 * GIB

    class Gpu:
        platform, device_kind, process_index = "gpu", "NVIDIA H100", 0

        def __init__(self, used):
            self.used = used

        def memory_stats(self):
            return {"bytes_limit": 10 * GIB, "bytes_in_use": self.used}

    assert room_now([Gpu(1 * GIB), Gpu(4 * GIB)]) == 6 * GIB


def test_a_backend_without_the_analysis_is_not_checked():
    def refuses():
        raise NotImplementedError("no memory analysis here")

    for compiled in (types.SimpleNamespace(memory_analysis=lambda: None),
                     types.SimpleNamespace(memory_analysis=refuses)):
        check_step_fits(compiled, _mesh(2), state_resident=False, free_bytes=0.0)


def test_host_free_bytes_reads_available_memory_and_free_swap(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  32000000 kB\nMemAvailable:  1000 kB\nSwapFree:  24 kB\n")
    assert host_free_bytes(str(meminfo)) == 1024 * 1024
    meminfo.write_text("MemTotal:  32000000 kB\n")
    assert host_free_bytes(str(meminfo)) is None
    assert host_free_bytes(str(tmp_path / "absent")) is None
