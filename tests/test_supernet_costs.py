"""The cost model's supernet side (tuner/supernet_costs.py): SPara's rounds, updates and
collectives priced as the step runs them, and the subnet piece counting every block."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_costmodel import _calibration, _costs

from mindpipe_jax.config import Config
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.tuner.costmodel import CostModel, Hardware, Piece
from mindpipe_jax.tuner.supernet import SupernetCandidate
from mindpipe_jax.tuner.supernet_costs import SupernetCosts

SC = SupernetCandidate
HAND = SupernetCosts(subnet=Piece(1e6, 1e3, 2e5, 0.0, 40), round=Piece(0.0, 0.0, 0.0, 8e6, 10),
                     update=Piece(0.0, 0.0, 0.0, 4.8e7, 11), combine=Piece(0.0, 0.0, 0.0, 6e6, 1),
                     param_bytes=2e6, semantics="sync", virtual_shards=8)


def _hw() -> Hardware:
    return Hardware.from_calibration(_calibration())


def _by_hand(costs: SupernetCosts, c: SupernetCandidate) -> float:
    """A step of ``c`` counted from the pieces the way spara.make_spara_step runs it
    (the calibration: 1e9 FLOP/s and 1e9 B/s busy, 1e-5 s per kernel, every collective
    1e-4 s + 1e-9 s per byte)."""
    n, d, w, k = c.subnet * c.data, c.data, c.vmap_width, c.subnets_per_step
    shards = costs.virtual_shards // d
    s = costs.subnet
    rows = c.global_batch / d
    # W subnets on B/D rows; the per-call work and the kernels once per virtual shard
    flops = w * (s.flops * rows + s.fixed_flops * shards)
    compute = max(flops, w * (s.bytes * rows + s.fixed_bytes * shards)) / 1e9
    compute += s.kernels * shards * 1e-5
    compute += w * costs.round.fixed_bytes / 1e9 + costs.round.kernels * 1e-5
    exchange = 1e-4 + 1e-9 * w * costs.param_bytes
    gather = 1e-4 + 1e-9 * costs.param_bytes
    adam = costs.update.fixed_bytes / n / 1e9 + costs.update.kernels * 1e-5
    if costs.semantics == "sync":
        rounds = -(-k // (c.subnet * w))
        combine = (k - 1) * costs.combine.fixed_bytes / n / 1e9 + (k - 1) * costs.combine.kernels * 1e-5
        return rounds * (compute + exchange) + gather + adam + combine
    return k * (compute + exchange + gather + adam)


@pytest.mark.parametrize("semantics", ["sync", "sequential"])
@pytest.mark.parametrize("cand", [SC(1, 8, 4, 1, 16), SC(2, 4, 4, 1, 16), SC(4, 2, 8, 2, 32),
                                  SC(2, 4, 8, 1, 64)], ids=lambda c: c.label().replace(" ", ""))
def test_a_supernet_step_is_priced_as_spara_runs_it(semantics, cand):
    costs = dataclasses.replace(HAND, semantics=semantics)
    model = CostModel(_costs(), _hw(), seq_len=16, supernet=costs)
    b = model.breakdown(cand)
    priced = b.compute_s + b.comm_total + b.update_s
    assert priced == pytest.approx(_by_hand(costs, cand), rel=1e-9)
    rounds = -(-cand.subnets_per_step // (cand.subnet * cand.vmap_width)) if semantics == "sync" \
        else cand.subnets_per_step
    assert b.iterations == rounds
    # The prior's step: the priced terms plus the calibrated launch (no pipeline ticks).
    assert b.step_s == pytest.approx(priced + _calibration().launch_s, rel=1e-9)


def test_the_subnet_axis_shortens_a_sync_step_and_not_a_sequential_one():
    """sync: subnet groups compute different subnets at once (fewer rounds); sequential:
    one subnet at a time whatever the split, so more subnet groups only shrink the rows
    each subnet's data devices share."""
    sync = CostModel(_costs(), _hw(), 16, supernet=HAND)
    seq = CostModel(_costs(), _hw(), 16, supernet=dataclasses.replace(HAND, semantics="sequential"))
    one, two = SC(1, 8, 4, 1, 64), SC(2, 4, 4, 1, 64)
    assert sync.breakdown(two).iterations == 2 and sync.breakdown(one).iterations == 4
    assert seq.breakdown(one).iterations == seq.breakdown(two).iterations == 4
    assert seq.breakdown(two).compute_s > seq.breakdown(one).compute_s  # B/4 rows per round, not B/8
    assert seq.step_time(one) > sync.step_time(one)  # K updates and gathers, not one


def test_dense_and_supernet_candidates_share_one_fit():
    model = CostModel(_costs(), _hw(), 16, supernet=HAND)
    cand = SC(2, 4, 4, 1, 16)
    before = model.step_time(cand)
    from mindpipe_jax.tuner.space import Candidate

    model.observe(Candidate(data=8, global_batch=16), 2 * model.step_time(Candidate(data=8, global_batch=16)))
    model.observe(cand, 2 * before)
    assert model.step_time(cand) > 1.5 * before  # the fit moved it towards what was measured
    with pytest.raises(ValueError, match="SupernetCosts.measure"):
        CostModel(_costs(), _hw(), 16).step_time(cand)


SMALL = ("model.d_model=32", "model.n_heads=2", "model.seq_len=16", "supernet.ladder_levels=0")


def test_the_subnet_piece_counts_every_block():
    """XLA counts a loop body once: the masked step scans its blocks, so the piece is
    compiled with the scan unrolled. Four blocks then cost about twice two blocks (the
    embedding and head are the rest), and the per-row FLOPs match a count of the
    block's matmuls: attention's qkv and out, its scores and values, and the FFN's two
    candidates' matmuls after the one-hot select, forward and twice backward."""
    two = SupernetCosts.measure(Config().replace(*SMALL, "model.n_layers=2"))
    four = SupernetCosts.measure(Config().replace(*SMALL, "model.n_layers=4"))
    block = (four.subnet.flops - two.subnet.flops) / 2
    d, t, f = 32, 16, 4 * 32
    matmuls = 2 * t * (d * 3 * d + d * d + 2 * t * d + 2 * d * f)  # one row's forward matmul FLOPs
    assert 3 * matmuls <= block <= 3 * matmuls * 1.3, (block, 3 * matmuls)
    rest = two.subnet.flops - 2 * block
    assert 0 < rest < block * 2
    assert four.param_bytes > two.param_bytes and four.update.fixed_bytes > two.update.fixed_bytes
    # Sequential: the same pieces; operator-causal is refused in one line.
    assert SupernetCosts.measure(Config().replace(*SMALL, "model.n_layers=2", "supernet.semantics=sequential")
                                 ).subnet == two.subnet
    with pytest.raises(ConfigError, match="prices sync and sequential only"):
        SupernetCosts.measure(Config().replace(*SMALL, "supernet.semantics=operator-causal"))
    assert np.isfinite(CostModel(None, _hw(), 16, supernet=four).step_time(SC(2, 4, 4, 1, 16)))
