#!/usr/bin/env bash
# What the open issues ask of a lent GPU, as ONE device call (about 7 minutes):
#
#   1. AFAPAB's gradient sync under backward compute in XLA:GPU's schedule (issue 16):
#      benchmarks/gpu/hlo_checks.py --part afapab, a mock topology of 8 GPUs, the small
#      step (d 512, 4 layers), each sync's program read from XLA's dump.
#   2. One 1F1B pipe4 x data2 step of the 2.8B GPT compiled for 8 GPUs (issue 15): no
#      collective inside a per-device branch, transfers under compute, per-device memory.
#   3. What a pipeline stage's split backward costs on the GPU (issue 15: whether a
#      zero-bubble table should split every backward or only its tail, parallel.split_last):
#      benchmarks/split_cost.py on a 2-layer chunk of d 2048, bf16.
#   4. SPara vs one by one, sliced, on the GPU (issue 17: goal >= 3x wall time at
#      per-subnet batch 4, K = 8) at d_model 1024.
#   (SPara's bits across two fresh processes on the GPU: benchmarks/gpu/determinism.py,
#   run and EQUAL on 2026-12-04; not repeated, nothing in supernet/ changed since.)
#
# Through the device tool: `run` with command `bash benchmarks/gpu/issues.sh`, carry
# [".whl"] (dacite, grain, tensorboardX, array_record and portpicker as
# wheels: see run.sh), timeout_s 540. Each part has its own time limit and the next
# part runs whatever the last one did; each writes $OUT/<part>.txt (here: /tmp/gpu-issues/),
# and the scheduled programs are kept there too (hlo_checks.py --read reads them again).
# Locally (no GPU): `bash benchmarks/gpu/issues.sh --smoke` runs every part small on the CPU.
#
# Seen on 2026-12-04 (benchmarks/results/2026-12-04-h200-*.txt): with autotuning off the
# programs compile in 7-15 s, the 2.8B step included (on: not within 107-127 s);
# AFAPAB with grad_sync="chunk" (its ring in the tick loop) segfaults in XLA:GPU's SPMD
# partitioner (bisected with benchmarks/gpu/compile_variants.py); split_cost ran; SPara at
# d 1024 did not finish its compiles in 130 s (now 230 s).
# The device image's flax (0.12.10) must be used: a carried flax 0.12.8 fails on jax 0.11.2.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
smoke=()
[[ "${1:-}" == "--smoke" ]] && smoke=(--smoke)

# shellcheck source=benchmarks/gpu/_setup.sh
source benchmarks/gpu/_setup.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:${PYTHONPATH}}"
out="${OUT:-/tmp/gpu-issues}"
mkdir -p "$out"
t0=$SECONDS

part() {  # part NAME SECONDS COMMAND...: run with a time limit, log to $out/NAME.txt
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s, at ${SECONDS}s) ==="
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee -a "$out/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0))s ===" | tee -a "$out/$name.txt"
}

# The mock topology's 8 devices are one GPU: no preallocation (nothing is run there).
# Each program compiles in a child process and is read from XLA's dump (hlo_checks.py).
XLA_PYTHON_CLIENT_PREALLOCATE=false part afapab_hlo 100 python3 benchmarks/gpu/hlo_checks.py --part afapab \
  --small --timeout 30 --keep "$out" "${smoke[@]}"
# overlap's per-chunk all-reduces with the combiner off: does XLA:GPU then run the early
# chunk's reduce behind the ticks after it? (combined, it was one reduce after the loop)
XLA_PYTHON_CLIENT_PREALLOCATE=false part afapab_hlo 40 python3 benchmarks/gpu/hlo_checks.py --part afapab \
  --small --syncs overlap --no-combine --timeout 30 --keep "$out" "${smoke[@]}"
XLA_PYTHON_CLIENT_PREALLOCATE=false part pipeline_hlo 70 python3 benchmarks/gpu/hlo_checks.py \
  --part pipeline --timeout 60 --keep "$out" "${smoke[@]}"
if [[ ${#smoke[@]} -gt 0 ]]; then
  part split_cost 120 python3 benchmarks/split_cost.py --rounds 3 --d-model 64 --seq 32 --rows 2
  part spara 400 python3 benchmarks/spara.py --quick --devices 1
else
  part split_cost 60 python3 benchmarks/split_cost.py --layers 2 --d-model 2048 --heads 16 --seq 1024 \
    --rows 4 --dtype bfloat16 --rounds 20
  # d_model 1024 (the 2026-12-04 run was d 256): is SPara's vectorized step still
  # dispatch-bound when each subnet's matmuls are 16x larger?
  part spara 230 python3 benchmarks/spara.py --devices 1 --batches 4 --d-model 1024 --seq 128 --steps 3 \
    --repeats 5 --no-flops
fi
echo "all parts done in $((SECONDS - t0))s; results in $out"
