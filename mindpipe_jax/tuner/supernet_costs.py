"""The cost model's supernet side: SPara's masked step priced from its compiled pieces.

A supernet job's candidate (``tuner.supernet.SupernetCandidate``: S subnet groups x D
data devices, K subnets per step, vmap width W, global batch B) runs
``supernet.spara.make_spara_step``; ``SupernetCosts.parts`` turns it into the cost
model's terms (``costmodel.FEATURES``) so the same calibration and the same fitted
coefficients predict dense and supernet layouts alike (``CostModel(supernet=...)``).

Pieces, compiled on one device and read with ``cost_analysis`` as the dense pieces are
(``tuner/pieces.py``):

* ``subnet`` — one subnet's loss and raveled gradient at the supernet's full size, per
  row and per call, with its kernels. Masked execution runs every subnet at that size
  (all blocks, all heads, the full FFN width, every operator candidate's activation), so
  this is every subnet's cost. It is compiled through the sliced path at the largest
  subnet's shape with the block scan unrolled: XLA counts a loop body once, and the
  masked step scans its blocks.
* ``round`` — ``optimizer.reduce_round`` for one slot on a one-device mesh: summing the
  exchanged partial gradients, the per-chunk norms and the clip, over the raveled
  parameters (a round of W slots does W times its work).
* ``update`` — the lazy AdamW (``optimizer.adamw``) over every raveled parameter, and
  ``combine``: the fixed-order sum of two subnets' raveled gradients (K subnets: K - 1
  such adds).

A step, per device (Pp: the raveled parameters; N = S·D devices, each owning Pp/N):

* ``sync``: ceil(K / (S·W)) rounds. A round computes W subnets (``vmap``) on the
  device's B/D rows, cut into V/D virtual shards (``lax.map``: the kernels run once per
  shard); an ``all_to_all`` of its ``[W, Pp]`` partial gradients; ``round`` work.
  Then one AdamW and the sum over K on Pp/N, and one all-gather of the new parameters.
* ``sequential``: K rounds of one subnet each (every subnet reads the shared weights,
  so no two run together); the group holding the subnet computes its W slots, the
  others skip; each round ends with an AdamW on Pp/N and an all-gather of the
  parameters.

Collectives use the calibration's fits over N devices. The ``all_to_all`` is not
calibrated: it is priced as a reduce-scatter of the same bytes (each device sends the
same (N-1)/N of its buffer; the reduce-scatter also adds, so this errs high).
``operator-causal`` (waves that depend on the sampled subnets) and sliced execution
(``supernet.ladder_levels`` > 0: programs by subnet shape) are not priced: ``measure``
refuses them with a one-line ``ConfigError``.
"""

from __future__ import annotations

import dataclasses
import math

from mindpipe_jax.config import Config, ParallelConfig
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.mesh import manual_axis_names
from mindpipe_jax.tuner.pieces import Piece, compiled_piece, fitted_piece

PRICED_SEMANTICS = ("sync", "sequential")


@dataclasses.dataclass(frozen=True)
class SupernetCosts:
    """SPara's compiled pieces (module docstring) and the run's fixed facts."""

    subnet: Piece
    round: Piece
    update: Piece
    combine: Piece
    param_bytes: float  # the raveled (padded) parameters, float32
    semantics: str
    virtual_shards: int

    @classmethod
    def measure(cls, cfg: Config, rows: int = 2, model=None) -> SupernetCosts:
        """Compile the pieces of ``cfg``'s supernet (or ``model``, a supernet factory) on
        one device at 1 and ``rows`` + 1 sequences."""
        import jax

        if cfg.supernet.semantics not in PRICED_SEMANTICS:
            raise ConfigError(f"supernet.semantics={cfg.supernet.semantics!r}: the cost model prices "
                              f"{' and '.join(PRICED_SEMANTICS)} only")
        if cfg.supernet.ladder_levels:
            raise ConfigError(f"supernet.ladder_levels={cfg.supernet.ladder_levels}: the cost model prices "
                              f"masked execution only (supernet.ladder_levels=0)")
        with jax.set_mesh(None):  # one device whatever the caller's context
            return _measure(cfg, max(rows, 1), model)

    def parts(self, c, hw) -> tuple[float, float, int, dict, float]:
        """(compute s, bubble fraction, rounds, {axis: comm s}, update s) of candidate ``c``
        on hardware ``hw``: the cost model's ``_parts`` for a supernet candidate."""
        n, w, k, d = c.subnet * c.data, c.vmap_width, c.subnets_per_step, c.data
        shards = max(self.virtual_shards // d, 1)  # a device's virtual shards (lax.map)
        s, r = self.subnet, self.round
        # vmap: W subnets' work in the same kernels; lax.map: the kernels once per shard
        slots = Piece(s.flops * w, s.bytes * w, s.fixed_flops * w * shards, s.fixed_bytes * w * shards,
                      s.kernels * shards)
        reduce = Piece(0.0, 0.0, r.fixed_flops * w, r.fixed_bytes * w, r.kernels)  # on [W, Pp]
        one_round = hw.piece_time(slots, c.global_batch / d) + hw.piece_time(reduce, 0.0)
        exchange = hw.collective("reduce-scatter", n, w * self.param_bytes)  # the all_to_all
        gather = hw.collective("all-gather", n, self.param_bytes)
        adam = hw.piece_time(self.update, 0.0, split=n)
        if self.semantics == "sync":
            rounds = math.ceil(k / (c.subnet * w))
            update = adam + hw.piece_time(self.combine.scaled(k - 1), 0.0, split=n)
            comm = {"subnet": rounds * exchange + gather}
        else:  # sequential: one subnet per round, each with its own update and gather
            rounds = k
            update = k * adam
            comm = {"subnet": rounds * (exchange + gather)}
        return rounds * one_round, 0.0, rounds, comm, update


def _measure(cfg: Config, rows: int, factory) -> SupernetCosts:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from mindpipe_jax.parallel.mesh import make_mesh
    from mindpipe_jax.supernet.optimizer import adamw, pairwise_sum, reduce_round
    from mindpipe_jax.supernet.plan import AXES
    from mindpipe_jax.supernet.run_setup import supernet_factory
    from mindpipe_jax.supernet.sliced import sliced_loss_and_grad, supports_slicing
    from mindpipe_jax.supernet.spec import supernet_spec

    spec, create = supernet_spec(factory if factory is not None else supernet_factory(cfg), cfg.train.seed)
    if not supports_slicing(spec.module):
        raise ConfigError("the supernet cost model counts a subnet's FLOPs through the sliced path "
                          "(sliced_loss with its block scan unrolled); this supernet does not offer it")
    device = jax.devices()[0]
    params = jax.device_put(jax.jit(create)(), device)
    largest = spec.space.largest()
    shape = spec.module.own_shape(largest)
    subnet = jnp.asarray(largest, jnp.int32)
    rng = np.random.default_rng(0)
    m = cfg.model

    def subnet_at(n_rows: int):
        tokens = jnp.asarray(rng.integers(0, m.vocab_size, (n_rows, m.seq_len + 1)), jnp.int32)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        return compiled_piece(lambda p, b: sliced_loss_and_grad(spec, p, subnet, b, shape, unroll=True),
                              params, batch)

    size = spec.padded_size
    flat = jnp.zeros((size,), jnp.float32)
    one_device = make_mesh(ParallelConfig(subnet=1, fsdp=1, data=1, tensor=1, pipe=1), [device])

    def round_fn(losses, grads):
        grads = jax.lax.pcast(grads, AXES, to="varying")  # as a device's own slots are
        return reduce_round(losses, grads, n_sub=1, n_data=1, virtual_shards=cfg.train.virtual_shards,
                            clip_norm=cfg.optim.clip_norm)

    round_piece = jax.shard_map(round_fn, mesh=one_device, axis_names=manual_axis_names(one_device, AXES),
                                in_specs=(P(), P()), out_specs=P(AXES))  # [R, ...] rows: this device's
    opt = {"mu": flat, "nu": flat, "count": jnp.zeros((spec.num_units + 1,), jnp.int32)}
    units = jnp.ones(spec.unit_grid, bool)

    def update(p, g, o):
        return adamw(spec, p, g, o, units, True, 1e-3, cfg.optim)

    rf, rb, rk = compiled_piece(round_piece, jnp.zeros((1,), jnp.float32), flat[None])
    uf, ub, uk = compiled_piece(update, flat, flat, opt)
    cf, cb, ck = compiled_piece(lambda g: pairwise_sum(g), jnp.zeros((2, size), jnp.float32))
    return SupernetCosts(
        subnet=fitted_piece(subnet_at(1), subnet_at(rows + 1), rows),
        round=Piece(0.0, 0.0, rf, rb, float(rk)),
        update=Piece(0.0, 0.0, uf, ub, float(uk)),
        combine=Piece(0.0, 0.0, cf, cb, float(ck)),
        param_bytes=4.0 * size, semantics=cfg.supernet.semantics,
        virtual_shards=cfg.train.virtual_shards)
