#!/usr/bin/env bash
# GPT train-step benchmark for one lent H200 (bf16): tokens/s, TFLOP/s, MFU against the
# H200's 989 TFLOP/s bf16 dense peak and against a measured bf16 matmul, with cuDNN flash
# attention and (for the ratio) XLA's attention, and per-layer F/B/W/BW times for the simulator.
# Budget: under 8 minutes in all (the Python part is killed at 470 s).
#
# Through the device tool: ONE `run` call, command `bash benchmarks/gpu/run.sh`
# (timeout_s 540 leaves room for the machine's start; extra arguments go to
# benchmarks/gpu/train_step.py, e.g. `bash benchmarks/gpu/run.sh --layers 8 --remat dots`).
# The results file is written to $OUT, so it comes back; copy it from the reply's
# files_at into benchmarks/results/ (named DATE-h200-gpu.txt) and commit it.
#
# Installs nothing from the network (the machine reaches nothing). The image has jax
# 0.11.2 (CUDA 13), flax, optax, orbax-checkpoint and tqdm but not dacite, grain or
# tensorboardX; train_step.py stands in for those three (it uses none of them). To use
# real ones instead, download wheels here into .whl/ (see /work/.library/device/README.md:
# `echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all:
# --python-version 3.12 ... -d .whl dacite==1.9.2`) and name `.whl` in the run's carry:
# this script then installs them with --no-index into /tmp/site.
#
# Locally (no GPU): `bash benchmarks/gpu/run.sh --smoke` checks the script on the CPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

# shellcheck source=benchmarks/gpu/_setup.sh
source benchmarks/gpu/_setup.sh

PYTHONPATH="$PWD${PYTHONPATH:+:${PYTHONPATH}}" timeout 470 python3 benchmarks/gpu/train_step.py "$@"

if [[ -n "${OUT:-}" ]]; then
  echo "results: \$OUT ($OUT) -> copy into benchmarks/results/"
else
  echo "results: benchmarks/results/ (or not written with --smoke)"
fi
