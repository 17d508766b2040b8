"""SPara's communication per layout, read from the compiled programs (nothing is run).

For one masked ``sync`` step of a small SuperGPT (d_model 64, 2 layers, 4 heads, d_ff
256, byte vocabulary; K = 4 subnets, vmap width 2, 8 virtual shards, batch 16) on 8
simulated CPU devices, the bytes each device sends per step, by collective kind and by
the mesh axes it spans (``parallel/collectives.py``: the compiled HLO, the
partitioner's own collectives included), for subnet x data, subnet x fsdp x data and
subnet x data x tensor layouts. What to read: fsdp costs the parameters' all-gather
going in (the step gathers once), tensor adds the model's Megatron all-reduces, the
partitioner's reshuffle of tensor-split gradient leaves into the raveled vector, and a
gradient exchange repeated on every tensor rank.

Usage: ``python benchmarks/spara_layouts.py [--out FILE]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import jax

jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
from _report import report  # noqa: E402

from mindpipe_jax.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from mindpipe_jax.parallel.collectives import axes_of, collectives, per_device_bytes  # noqa: E402
from mindpipe_jax.parallel.mesh import make_mesh  # noqa: E402
from mindpipe_jax.supernet import (  # noqa: E402
    SuperGPT,
    init_state,
    jit_step,
    make_spara_step,
    plan_step,
    supernet_spec,
)
from mindpipe_jax.supernet.spara import state_shardings  # noqa: E402

CFG = ModelConfig(d_model=64, n_layers=2, n_heads=4, seq_len=32)
SUBNETS = np.array([[1, 1, 1, 3, 0, 1, 3], [1, 0, 0, 1, 2, 0, 0], [0, 2, 1, 2, 0, 0, 0],
                    [1, 1, 0, 0, 1, 1, 2]], np.int32)
LAYOUTS = {"subnet2 x data4": dict(subnet=2, data=4),
           "subnet2 x fsdp2 x data2": dict(subnet=2, fsdp=2, data=2),
           "subnet2 x data2 (4 devices: the next without tensor)": dict(subnet=2, data=2),
           "subnet2 x data2 x tensor2": dict(subnet=2, data=2, tensor=2)}


def per_layout(spec, create, layout: dict) -> dict:
    n = int(np.prod(list(layout.values())))
    mesh = make_mesh(ParallelConfig(**{"tensor": 1, **layout}), devices=jax.devices()[:n])
    step = make_spara_step(spec, mesh, semantics="sync", subnets_per_step=4, vmap_width=2, virtual_shards=8,
                           global_batch=16, optim=OptimConfig(), total_steps=10)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         jax.eval_shape(lambda: init_state(spec, create())), state_shardings(mesh, spec))
    tokens = jax.ShapeDtypeStruct((16, CFG.seq_len), np.int32)
    plan = plan_step(spec, SUBNETS, "sync", 2 * layout["subnet"])
    hlo = jit_step(step, mesh, spec).lower(state, plan.arrays(), {"inputs": tokens, "targets": tokens})
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    rows = defaultdict(float)
    for op in collectives(hlo.compile().as_text()):
        axes = "+".join(a for a in mesh.axis_names if a in axes_of(op, ids, mesh.axis_names)) or "-"
        rows[(op.kind, axes)] += per_device_bytes([op], mesh.size).get(0, 0.0)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="also write the report to this file")
    args = parser.parse_args()
    def make(rngs):
        return SuperGPT(CFG, ops=("gelu", "silu", "tanh"), ffn_widths=(128, 256), depths=(1, 2), rngs=rngs)

    spec, create = supernet_spec(make)
    with report("SPara communication per layout (compiled programs)", args.out):
        mb = spec.num_params * 4 / 1e6
        print(f"SuperGPT d_model {CFG.d_model}, {spec.num_params:,} parameters ({mb:.2f} MB fp32); one "
              f"masked sync step, K=4, vmap width 2; MB sent by device 0 per step")
        for name, layout in LAYOUTS.items():
            rows = per_layout(spec, create, layout)
            print(f"\n{name}: {sum(rows.values()) / 1e6:.2f} MB in all")
            for (kind, axes), sent in sorted(rows.items(), key=lambda kv: -kv[1]):
                print(f"  {kind:<19} over {axes:<22} {sent / 1e6:7.3f} MB")

if __name__ == "__main__":
    main()
