#!/usr/bin/env bash
# What the open issues ask of a lent GPU, as ONE device call (about 9 minutes):
#
#   1. SPara vs one by one, sliced, on the GPU (issue 17: goal >= 3x wall time at
#      per-subnet batch 4, K = 8): benchmarks/spara.py on one device, every K subnets
#      of a shape group in one vmapped program.
#   2. AFAPAB's gradient sync under backward compute in XLA:GPU's schedule (issue 16):
#      benchmarks/gpu/hlo_checks.py --part afapab, a mock topology of 8 GPUs.
#   3. One pipeline step of the 2.8B GPT compiled for 8 GPUs (issue 15): per-device
#      memory and no collective inside a per-device branch (hlo_checks.py --part pipeline).
#   4. SPara bitwise equal across two fresh processes on the GPU (determinism.py).
#   5. What a pipeline stage's split backward costs on the GPU (issue 15: whether a
#      zero-bubble table should split every backward or only its tail, parallel.split_last):
#      benchmarks/split_cost.py on a 2-layer chunk of d 2048, bf16.
#
# Through the device tool: `run` with command `bash benchmarks/gpu/issues.sh`, carry
# [".whl"] (dacite, grain, tensorboardX, array_record and portpicker as
# wheels: see run.sh), timeout_s 600. Each part has its own time limit and the next
# part runs whatever the last one did; each writes $OUT/<part>.txt (here: /tmp/gpu-issues/).
# Locally (no GPU): `bash benchmarks/gpu/issues.sh --smoke` runs every part small on the CPU.
#
# Seen on 2026-12-04 (benchmarks/results/2026-12-04-h200-*.txt): parts 1 and 4 ran (with
# --no-flops; the FLOP count's compiles do not fit the limit); parts 2 and 3 did not: the
# full-size programs did not finish compiling within their limits, and the small AFAPAB
# step (hlo_checks.py --small) segfaults in XLA's compile-and-load under the mock topology.
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

if [[ ${#smoke[@]} -gt 0 ]]; then
  part spara 400 python3 benchmarks/spara.py --quick --devices 1
else
  part spara 170 python3 benchmarks/spara.py --devices 1 --batches 4 --d-model 256 --seq 128 --steps 3 \
    --repeats 5 --no-flops
fi
# The mock topology's 8 devices are one GPU: no preallocation (nothing is run there).
XLA_PYTHON_CLIENT_PREALLOCATE=false part afapab_hlo 130 python3 benchmarks/gpu/hlo_checks.py --part afapab \
  "${smoke[@]}"
XLA_PYTHON_CLIENT_PREALLOCATE=false part pipeline_hlo 110 python3 benchmarks/gpu/hlo_checks.py \
  --part pipeline "${smoke[@]}"
part determinism 45 python3 benchmarks/gpu/determinism.py --write /tmp/spara-bits.json "${smoke[@]}"
part determinism 45 python3 benchmarks/gpu/determinism.py --compare /tmp/spara-bits.json "${smoke[@]}"
if [[ ${#smoke[@]} -gt 0 ]]; then
  part split_cost 120 python3 benchmarks/split_cost.py --rounds 3 --d-model 64 --seq 32 --rows 2
else
  part split_cost 60 python3 benchmarks/split_cost.py --layers 2 --d-model 2048 --heads 16 --seq 1024 \
    --rows 4 --dtype bfloat16 --rounds 20
fi
echo "all parts done in $((SECONDS - t0))s; results in $out"
