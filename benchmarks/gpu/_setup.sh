# Shared by run.sh and loop.sh (sourced from the repository root): show the GPU,
# install carried wheels, set the XLA flags (dropped if this XLA rejects one) and
# the memory fraction.
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi || true
fi

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:${PYTHONPATH}}"
fi

# shellcheck source=benchmarks/gpu/xla_flags.sh
source benchmarks/gpu/xla_flags.sh
# XLA aborts on a flag its release does not know, and flag names change between
# releases: check them in a few seconds rather than lose the whole run.
if ! err=$(python3 -c "import jax; jax.devices()" 2>&1); then
  echo "XLA_FLAGS rejected (${err##*$'\n'}); running with XLA's defaults instead"
  unset XLA_FLAGS
fi
export PYTHONUNBUFFERED=1
# Let XLA take most of the GPU up front (JAX's default is 75%); the batch is sized from it.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}"

