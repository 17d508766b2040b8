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
from mindpipe_jax.train.memory_fit import check_step_fits, host_free_bytes, peak_bytes

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


def test_a_state_already_in_memory_is_not_counted_twice():
    # Restored from a checkpoint, the state's 1 GiB per device is resident already: 2 GiB more each.
    check_step_fits(_compiled(), _mesh(4), state_resident=True, free_bytes=8 * GIB)
    with pytest.raises(ConfigError, match=r"8\.0 GiB of memory \(4 devices x 2\.00 GiB of activations and "
                                          r"temporaries beside the state"):
        check_step_fits(_compiled(), _mesh(4), state_resident=True, free_bytes=7.9 * GIB)


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
