#!/usr/bin/env bash
# The whole mindpipe_jax.train loop on one lent H200 against the bare train step
# (benchmarks/gpu/train_loop.py): the framework's overhead on a GPU. About 3 minutes.
#
# The H200 image lacks the framework's dacite, grain and tensorboardX (and grain's
# array-record and portpicker), and reaches no registry, so carry their wheels:
# here, once, in the repository root,
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl dacite grain tensorboardX array-record portpicker
# then ONE device `run`: command `bash benchmarks/gpu/loop.sh`, carry [".whl"], timeout_s 400.
# Extra arguments go to train_loop.py. Locally: `bash benchmarks/gpu/loop.sh --smoke`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

# shellcheck source=benchmarks/gpu/_setup.sh
source benchmarks/gpu/_setup.sh

PYTHONPATH="$PWD${PYTHONPATH:+:${PYTHONPATH}}" timeout 330 python3 benchmarks/gpu/train_loop.py "$@"
