"""The XLA flags the test processes compile with, and the ones that keep XLA's defaults.

The tests' models are tiny: compiling dominates their time, not running.

* ``FAST`` (every test process, set in ``conftest.py``): LLVM at -O0 (a vPipe step
  compiles 7.8 -> 5.2 s) and XLA:CPU's elemental fusion emitter instead of its MLIR
  fusion emitters (another ~40%: the full suite 1453 -> 1026 s on 2 cores). Values stay
  within every test's tolerance, and a program run twice gives the same bits.
* ``DEFAULT_EMITTERS``: -O0 only (and ``PATIENT``), XLA's default fusion emitters. Under ``FAST``, two
  *different* programs that deterministic mode makes bitwise equal (data=1 vs data=2,
  fsdp vs data, a SPara step on 1 vs 8 devices) differ in the last bits, and one
  compiled tick loop gains a copy: fusion decisions differ. Users compile with XLA's
  defaults, so what the project promises about them is tested with them: determinism
  workers get this in their environment, and a test marked ``xla_default_emitters``
  runs in a child pytest with it (``conftest.py``).
"""

# XLA:CPU aborts the process when a collective's participants have not all arrived
# 20 + 40 s after the first. On a loaded 2-core CI machine (two test workers, 8 device
# threads each) a late thread is not a deadlock, and XLA's own log then says "Perhaps
# the timeout is too short": the tests wait 20 + 300 s. A real deadlock still aborts,
# and tests/xdist_requeue.py keeps the rest of the run going.
PATIENT = "--xla_cpu_collective_call_terminate_timeout_seconds=300"
DEFAULT_EMITTERS = "--xla_backend_optimization_level=0 " + PATIENT
FAST = DEFAULT_EMITTERS + " --xla_cpu_use_fusion_emitters=false"
# Set in the child pytest that runs a test marked xla_default_emitters: run it in place.
CHILD = "MINDPIPE_TEST_IN_DEFAULT_EMITTERS_CHILD"
