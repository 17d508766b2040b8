# XLA:GPU flags that let tensor-parallel collectives run underneath compute.
#
#   source benchmarks/gpu/xla_flags.sh            # then: mindpipe train model.collective_matmul=true ...
#   bash benchmarks/gpu/xla_flags.sh --check      # ask the installed jaxlib whether it knows every flag
#
# Sourcing adds these flags to XLA_FLAGS and exports it; a flag XLA_FLAGS already
# sets keeps the caller's value and is not repeated. XLA reads XLA_FLAGS once, when
# the first JAX backend starts, so source this before starting Python.
#
# model.collective_matmul=true splits each tensor-parallel projection into p ring
# steps: a collective-permute of one row chunk and a partial matmul that does not
# depend on it (mindpipe_jax/parallel/overlap.py). Whether the two actually overlap
# is the scheduler's decision; these flags are what lets it decide so on a GPU.
#
# Every flag below is named in the JAX or NVIDIA JAX-Toolbox GPU performance guides
# (docs.jax.dev/en/latest/gpu_performance_tips.html,
# docs.nvidia.com/jax-toolbox/performance-profiling/gpu-performance) and was accepted
# by jaxlib 0.10.2's flag parser (XLA aborts on an unknown flag, so `--check` is a
# real test). Flag names change between releases: run `--check` after upgrading.
#
# Not set, on purpose:
# * --xla_gpu_enable_async_collective_permute / _all_gather / ... : older guides
#   list these, but collectives are asynchronous by default in current XLA:GPU and
#   jaxlib 0.10.2 rejects these names. The remaining switch is the opposite one,
#   --xla_gpu_disable_async_collectives=<kinds>; this file refuses to add to an
#   XLA_FLAGS that disables collectivepermute, the op the rings are made of.
# * combine thresholds (--xla_gpu_all_reduce_combine_threshold_bytes, ...): they
#   batch many small gradient reductions, a data-parallel matter, not this one.

_mindpipe_xla_flags=(
  # The scheduler that moves each async collective's start early and its done late,
  # around independent compute: the ring's ppermute of step s+1 under step s's matmul.
  --xla_gpu_enable_latency_hiding_scheduler=true
  # Run collectives on the highest-priority stream, so a ring transfer is not queued
  # behind the very matmul it is meant to hide under.
  --xla_gpu_enable_highest_priority_async_stream=true
  # Unroll the scan over layers by two, so one layer's collectives can overlap the
  # neighbouring layer's compute instead of waiting at the loop boundary.
  --xla_gpu_enable_while_loop_double_buffering=true
  # Move the FSDP all-gathers and the gradient reduce-scatters / all-reduces of the
  # layer scan into the previous / next iteration (the data-parallel side of AFAPAB).
  --xla_gpu_enable_pipelined_all_gather=true
  --xla_gpu_enable_pipelined_reduce_scatter=true
  --xla_gpu_enable_pipelined_all_reduce=true
  # cuBLAS rather than Triton-generated GEMMs, as NVIDIA's JAX images set it: a ring
  # makes p GEMMs p times smaller, and Triton autotunes every new shape at compile
  # time. Measure both on your model; drop this line to let XLA choose.
  --xla_gpu_enable_triton_gemm=false
)

_mindpipe_apply_xla_flags() {
  local flag name
  case " ${XLA_FLAGS:-} " in
    *--xla_gpu_disable_async_collectives=*collectivepermute*)
      echo "xla_flags.sh: XLA_FLAGS disables async collective-permutes, which the collective" \
           "matmul needs to overlap; remove --xla_gpu_disable_async_collectives first" >&2
      return 1 ;;
  esac
  for flag in "${_mindpipe_xla_flags[@]}"; do
    name="${flag%%=*}"
    case " ${XLA_FLAGS:-} " in
      *" ${name}="*) ;;  # the caller already chose a value: keep it
      *) XLA_FLAGS="${XLA_FLAGS:+${XLA_FLAGS} }${flag}" ;;
    esac
  done
  export XLA_FLAGS
  # Hopper and older (NVIDIA's guide): one hardware queue keeps launches in the order
  # the latency-hiding scheduler chose. The same guide says not to set it on Blackwell.
  export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
}

if [[ "${BASH_SOURCE[0]}" != "${0}" ]]; then
  _mindpipe_apply_xla_flags && echo "XLA_FLAGS=${XLA_FLAGS}"
elif [[ "${1:-}" == "--check" ]]; then
  _mindpipe_apply_xla_flags || exit 1
  echo "XLA_FLAGS=${XLA_FLAGS}"
  python - <<'EOF'
import jax, jax.numpy as jnp
# An unknown flag aborts the process here, when the first backend parses XLA_FLAGS.
print(jax.__version__, jax.default_backend(), jax.devices())
print("flags accepted; a jitted op ran:", float(jax.jit(lambda x: (x @ x).sum())(jnp.ones((8, 8)))))
EOF
else
  echo "usage: source benchmarks/gpu/xla_flags.sh | bash benchmarks/gpu/xla_flags.sh --check" >&2
  exit 2
fi
