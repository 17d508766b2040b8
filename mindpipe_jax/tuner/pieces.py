"""The model's side of the cost model: ``Piece`` (one compiled piece's FLOPs, bytes
accessed and kernels) and ``ModelCosts`` (the reference model's pieces, measured by
compiling one block, the embedding, the head and the optimizer update on one
device), with the HLO kernel count they are read with. Re-exported by
``tuner/costmodel.py``, whose docstring describes how the pieces are used.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from functools import partial

import numpy as np

from mindpipe_jax.config import Config
from mindpipe_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Piece:
    """One compiled piece: FLOPs and bytes accessed per row and per call, kernels per call;
    and per row squared where the work grows with the rows a call sees together (an MoE
    block's one-hot dispatch and combine: ``[tokens, experts, capacity]`` with the capacity
    proportional to the tokens of the dispatch group, one device's rows)."""

    flops: float = 0.0  # per row
    bytes: float = 0.0  # per row
    fixed_flops: float = 0.0  # per call (e.g. the optimizer, or weight reads)
    fixed_bytes: float = 0.0
    kernels: float = 0.0
    flops_sq: float = 0.0  # per row squared
    bytes_sq: float = 0.0

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
    # Remat policy -> bytes one block's forward leaves in the pipeline's residual buffer per
    # sequence ("full" keeps only the stage input, in another buffer: absent, 0).
    residual_bytes_per_row: dict | None = None
    # Why the model cannot be cut into stages (the pipeline contract's one-line refusal):
    # it is then measured whole (``rest_F``/``rest_BW`` are the whole loss, no layers), and
    # the tuner rejects its pipeline layouts with this reason. None: it can be.
    unsplit: str | None = None

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
        device, at 1 and ``rows`` + 1 sequences (and 2 ``rows`` + 1 for an MoE block: its
        dispatch is quadratic in the rows), and read FLOPs, bytes accessed and
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


def compiled_piece(fn, *args) -> tuple[float, float, int]:
    """(FLOPs, bytes accessed, kernels) of ``fn(*args)`` compiled."""
    import jax

    compiled = jax.jit(fn).lower(*args).compile()
    analysis = compiled.cost_analysis()
    if isinstance(analysis, Sequence):
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}
    return (float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0)),
            count_kernels(compiled.as_text()))


def fitted_piece(at_one: tuple, at_more: tuple, rows: int, at_most: tuple | None = None) -> Piece:
    """A piece from its (FLOPs, bytes, kernels) compiled at 1 and ``rows`` + 1 rows: per
    row from the difference, per call from the rest, kernels as at one row. With
    ``at_most`` (compiled at 2 ``rows`` + 1) the FLOPs and bytes are fitted as a quadratic
    in the rows through the three sizes (an MoE block's dispatch)."""
    (f1, b1, k1), (f2, b2, _) = at_one, at_more
    if at_most is None:
        per_f, per_b = (f2 - f1) / rows, (b2 - b1) / rows
        return Piece(per_f, per_b, max(f1 - per_f, 0.0), max(b1 - per_b, 0.0), float(k1))
    sizes = np.array([1.0, rows + 1.0, 2.0 * rows + 1.0])
    basis = np.stack([np.ones(3), sizes, sizes ** 2], axis=1)
    (cf, lf, qf), (cb, lb, qb) = (np.linalg.solve(basis, np.array(v, float))
                                  for v in ((f1, f2, at_most[0]), (b1, b2, at_most[1])))
    return Piece(float(lf), float(lb), max(float(cf), 0.0), max(float(cb), 0.0), float(k1),
                 max(float(qf), 0.0), max(float(qb), 0.0))


def _measure_pieces(cfg: Config, rows: int, factory) -> ModelCosts:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mindpipe_jax.models.gpt import GPT
    from mindpipe_jax.parallel.pipeline.contract import PipelineModel
    from mindpipe_jax.parallel.pipeline.parts import merged, model_loss
    from mindpipe_jax.parallel.pipeline.plan.profile import residual_bytes
    from mindpipe_jax.train.state import make_optimizer

    m = cfg.model
    experts = m.n_experts if factory is None else 0
    # An MoE block is measured as it is, its rows routed as one dispatch group (one
    # device's rows, as a step routes them): its dispatch grows with the square of the
    # rows, so it is compiled at a third size and fitted as a quadratic. (Measured as its
    # dense twin scaled by the active parameters, a 4-expert top-2 GPT at 16 rows was
    # priced at about 1/2.4 of its compiled FLOPs, and its step 2.6x faster than it ran
    # where the dense GPT's was 1.9x: the same machine, the same run.)
    with nnx.use_eager_sharding(False):
        if factory is not None:
            model = factory(nnx.Rngs(0))
        elif experts:
            from mindpipe_jax.models.moe import MoEGPT

            model = MoEGPT(m, rngs=nnx.Rngs(0), dispatch_groups=1)
        else:
            model = GPT(m, rngs=nnx.Rngs(0))
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    params = jax.device_put(nnx.to_pure_dict(state), jax.devices()[0])
    rng = np.random.default_rng(0)
    sizes = (1, rows + 1, 2 * rows + 1) if experts else (1, rows + 1)

    def pieces_at(n_rows: int) -> tuple[dict, int, float, dict]:
        """Each piece's (FLOPs, bytes, kernels) at ``n_rows`` rows; units; hidden bytes per
        row; per remat policy, what one block keeps in the pipeline's residual buffer per
        row, as the runtime's ``ResidualStore`` sizes it ("full": its input, elsewhere)."""
        tokens = jnp.asarray(rng.integers(0, m.vocab_size, (n_rows, m.seq_len)), jnp.int32)
        split = PipelineModel(model, params, partial(merged, graphdef, rest=rest), tokens)
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
            return compiled_piece(lambda f, c: f(c), vjp_fn, ct)

        dots = jax.checkpoint(fns.layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
        full = jax.checkpoint(fns.layer)  # keeps only the inputs: the backward re-runs the forward
        found = {
            "layer_F": compiled_piece(fns.layer, block, hidden),
            # the forward a step runs: it also writes the residuals its policy keeps
            **{f"layer_F:{name}": compiled_piece(lambda w, x, f=f: jax.vjp(f, w, x), block, hidden)
               for name, f in (("none", fns.layer), ("dots", dots), ("full", full))},
            "layer_BW:none": backward(fns.layer, block, hidden, dy),
            "layer_BW:dots": backward(dots, block, hidden, dy),
            "layer_BW:full": backward(full, block, hidden, dy),
            "embed_F": compiled_piece(fns.embed, embed_p, tokens),
            "embed_BW": compiled_piece(embed_bw, embed_p, dy),
            "head_F": compiled_piece(head, head_p, hidden),
            "head_BW": backward(head, head_p, hidden, jnp.ones((), jnp.float32)),
        }
        residual = {"none": residual_bytes(fns.layer, block, hidden) / n_rows,
                    "dots": residual_bytes(dots, block, hidden) / n_rows, "full": 0.0}
        return found, split.num_units, hidden.size * hidden.dtype.itemsize / n_rows, residual

    def whole_at(n_rows: int) -> dict:
        """The whole loss's forward and backward (a model the contract cannot cut)."""
        tokens = jnp.asarray(rng.integers(0, m.vocab_size, (n_rows, m.seq_len)), jnp.int32)

        def loss(p):
            return model_loss(merged(graphdef, p, rest), tokens, tokens)
        vjp_fn = jax.jit(lambda p: jax.vjp(loss, p)[1])(params)
        return {"rest_F": compiled_piece(loss, params),
                "rest_BW": compiled_piece(lambda f, c: f(c), vjp_fn, jnp.ones((), jnp.float32))}

    measured: dict[str, list[tuple[float, float, int]]] = {}
    unsplit = None
    for n_rows in sizes:
        try:
            found, n_units, hidden_bytes, residual = pieces_at(n_rows)
        except ConfigError as err:  # the contract cannot cut it: measured whole
            unsplit = str(err)
            break
        for k, v in found.items():
            measured.setdefault(k, []).append(v)
    if unsplit is not None:
        measured = {}
        for n_rows in sizes:
            for k, v in whole_at(n_rows).items():
                measured.setdefault(k, []).append(v)
        n_units, hidden_bytes, residual = 0, 0.0, None

    def fitted(name) -> Piece:
        return fitted_piece(*measured[name][:2], rows, *measured[name][2:])

    if unsplit is None:
        pieces = {k: fitted(k) for k in measured if not k.startswith(("embed", "head"))}
        pieces["rest_F"] = fitted("embed_F") + fitted("head_F")
        pieces["rest_BW"] = fitted("embed_BW") + fitted("head_BW")
    else:  # no layers: "rest" is the whole loss
        pieces = {k: fitted(k) for k in measured}

    tx = make_optimizer(cfg.optim, cfg.train.steps, None)
    opt_state = jax.jit(tx.init)(params)

    def update(g, s, p):
        import optax

        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    uf, ub, uk = compiled_piece(update, params, opt_state, params)
    pieces["update"] = Piece(0.0, 0.0, uf, ub, float(uk))

    param_bytes = float(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)))
    factor = m.top_k * m.capacity_factor if experts else 0.0
    p = pieces
    bwd = {r: p[f"layer_BW:{r}"].flops if unsplit is None else 0.0 for r in ("none", "dots", "full")}
    return ModelCosts(n_units, p["layer_F"].flops if unsplit is None else 0.0, bwd, p["rest_F"].flops,
                      p["rest_BW"].flops, param_bytes, hidden_bytes, factor, pieces, residual, unsplit)

