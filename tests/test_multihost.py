"""Multi-host: ``mindpipe train`` as two processes on 127.0.0.1, one 8-device cluster.

Each child simulates 4 CPU devices and learns the coordinator, its rank and the
process count the way a launcher tells it: ``MINDPIPE_*`` variables, SLURM's
variables, or ``distributed.*`` overrides on the command line. The cluster's
final checkpoint is restored here (8 simulated devices, the same mesh) and
compared with the same config trained in this single process:

* data=4 x tensor=2, preempted (SIGTERM to process 1 only: JAX's preemption
  service makes both stop after the same step), then resumed: bitwise equal to
  an uninterrupted 2-process run (a module fixture the SIGKILL test shares);
* Ctrl-C in the terminal (SIGINT to both processes): both stop after the same
  step with one checkpoint, and exit 0;
* process 1 SIGKILLed after a committed checkpoint (process 0 then dies of the
  lost heartbeat, or is stopped), both restarted with ``train.resume=auto``:
  bitwise equal to an uninterrupted 2-process run;
* a 2-stage 1F1B pipeline across the processes (stage 0 on process 0's
  devices, stage 1 on process 1's), the same comparison;
* deterministic mode on data=8: bitwise equal;
* the online tuner switching the batch mid-run: process 0's decision taken by both
  (the same switch at the same step as one process), then equal to one process; and a
  switch whose step one process cannot fit in memory refused by both;
* a supernet step one process cannot fit in memory: both stop with one line;
* a coordinator port taken by another program: one line and exit 4 on both
  processes, well within the timeout; the coordinator binds the IP address given.

Only process 0 writes logs and metrics; orbax writes the checkpoint from both.
A peer that never starts, or dies mid-run, ends the other process with an
error naming the problem within the configured timeout; every wait here is
bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from cli_procs import Train, cli_env, kill_after_first_commit
from treecheck import assert_bitwise

import mindpipe_jax as mp
from mindpipe_jax.train.checkpoint import COMMIT_MARKER, committed_steps, restore
from mindpipe_jax.train.state import abstract_train_state, make_optimizer, model_spec

# One xdist worker runs this file's tests one after another: each starts two processes,
# and several wait on timeouts of seconds (heartbeats, a peer that never starts).
pytestmark = pytest.mark.xdist_group("multihost")

STEPS = 8
MH = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
      "data.source=synthetic", "data.synthetic_tokens=65536", "train.global_batch=16",
      f"train.steps={STEPS}", "train.log_every=1", "train.checkpoint_every=4", "train.eval_every=0",
      "train.progress=false", "train.tensorboard=false", "optim.warmup_steps=2"]
DATA_TENSOR = ["parallel.data=4", "parallel.tensor=2", "train.steps=12"]  # room to preempt mid-run
PIPELINE = ["parallel.pipe=2", "parallel.data=4", "parallel.tensor=1", "parallel.microbatches=2",
            "parallel.schedule=1f1b"]
DETERMINISTIC = ["parallel.data=8", "parallel.tensor=1", "train.deterministic=true", "train.steps=2"]
CHILD = ["parallel.simulate_cpu_devices=4"]
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: list[str], how: str, *, cache: Path, cwd: Path | tuple[Path, Path], timeout_s: int = 60,
            port: int | None = None, own: tuple[list[str], list[str]] = ([], []),
            command: str = "train", own_env: tuple[dict, dict] = ({}, {})) -> list[Train]:
    """Processes 0 and 1 of a 2-process ``mindpipe <command>``, told the coordinator as
    ``how`` says; ``own``: overrides given to process 0 and to process 1 only (``own_env``:
    environment variables); ``cwd``: one working directory, or one for each."""
    cwds = cwd if isinstance(cwd, tuple) else (cwd, cwd)
    port = port or _free_port()
    procs = []
    for pid in (0, 1):
        extra_args, env = [], {}
        if how == "env":
            env = {"MINDPIPE_COORDINATOR": f"127.0.0.1:{port}", "MINDPIPE_NUM_PROCESSES": "2",
                   "MINDPIPE_PROCESS_ID": str(pid)}
        elif how == "slurm":
            env = {"SLURM_NTASKS": "2", "SLURM_PROCID": str(pid), "SLURM_STEP_NODELIST": "127.0.0.1",
                   "MINDPIPE_COORDINATOR_PORT": str(port)}
        else:
            extra_args = [f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2",
                          f"distributed.process_id={pid}"]
        procs.append(Train([*args, *CHILD, f"distributed.timeout_s={timeout_s}", *extra_args, *own[pid]],
                           env=cli_env(cache, **env, **own_env[pid]), cwd=cwds[pid], command=command))
    return procs


def _finish(procs: list[Train], timeout: float = TIMEOUT_S) -> list[str]:
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            p.kill()
    outputs = [p.output for p in procs]
    assert codes == [0, 0], f"exit codes {codes}\n--- process 0:\n{outputs[0][-3000:]}\n" \
                            f"--- process 1:\n{outputs[1][-3000:]}"
    return outputs


def _state(result_or_dir, overrides: list[str]):
    """Host copy of a final train state: from a TrainResult, or restored from a run's checkpoint."""
    if isinstance(result_or_dir, Path):
        cfg = mp.Config().replace(*MH, *overrides)
        mesh = mp.make_mesh(cfg.parallel)
        spec, _ = model_spec(lambda rngs: mp.GPT(cfg.model, rngs=rngs), mesh, cfg.train.seed)
        tx = make_optimizer(cfg.optim, cfg.train.steps, spec.decay_mask)
        step = committed_steps(result_or_dir / "checkpoints")[-1]
        assert step == cfg.train.steps
        state = restore(result_or_dir / "checkpoints", step, abstract_train_state(spec, tx, mesh))[0]
        return jax.device_get(state)
    return jax.device_get(result_or_dir.state)


def _single_process(tmp_path: Path, overrides: list[str]):
    return mp.train(None, None, mp.Config(), *MH, *overrides, "parallel.simulate_cpu_devices=0",
                    f"train.out_dir={tmp_path / 'single'}")


def _compare(single, cluster, *, bitwise: bool) -> None:
    flat_a = jax.tree_util.tree_flatten_with_path(single["params"])[0]
    flat_b = jax.tree_util.tree_flatten_with_path(cluster["params"])[0]
    assert len(flat_a) == len(flat_b) > 10
    for (path, x), (_, y) in zip(flat_a, flat_b, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        name = jax.tree_util.keystr(path)
        if bitwise:
            assert x.tobytes() == y.tobytes(), f"{name}: max |diff| {np.abs(x - y).max()}"
        else:
            # The all-reduce sums in another order (~1e-7 relative per step); Adam turns
            # that into ~1e-6 on near-zero weights after a few steps. A wrong row or a
            # missed update moves weights by ~lr = 3e-3.
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=2e-5, err_msg=name)


def _check_one_writer(outputs: list[str], out_dir: Path, steps: int = STEPS) -> None:
    first, second = outputs
    assert "mesh {'pipe'" in first and "8 devices" in first
    # Process 1 prints nothing of its own (the runtime's connection lines aside).
    assert not [ln for ln in second.splitlines() if ln.startswith(("step ", "mesh ", "done:", "stopped"))]
    logged = [json.loads(ln)["step"] for ln in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, steps + 1))  # one writer, and each step once after the resume
    assert (out_dir / "config.json").is_file()


@pytest.fixture(scope="module")
def cache(compile_cache):
    return compile_cache  # the run's (conftest.py)


@pytest.fixture(scope="module")
def data_tensor_reference(tmp_path_factory, cache) -> Path:
    """An uninterrupted 2-process data x tensor run (12 steps): what every interrupted
    and resumed run of that layout must equal, bit for bit (same layout, same reductions)."""
    ref = tmp_path_factory.mktemp("data_tensor_reference")
    _finish(_launch([*MH, *DATA_TENSOR, f"train.out_dir={ref}"], "env", cache=cache, cwd=ref))
    return ref


@pytest.mark.slow
def test_data_x_tensor_across_two_processes_preempted_and_resumed(tmp_path, cache, data_tensor_reference):
    out = tmp_path / "cluster"
    args = [*MH, *DATA_TENSOR, f"train.out_dir={out}"]
    first, second = _launch(args, "env", cache=cache, cwd=tmp_path)
    first.wait_for_step(2, TIMEOUT_S)
    second.signal(signal.SIGTERM)  # a preemption notice to one process only
    outputs = _finish([first, second])
    stops = [ln for ln in outputs[0].splitlines() if ln.startswith("stopped by SIGTERM after step ")]
    assert len(stops) == 1, outputs[0][-3000:]
    stopped = int(stops[0].split("after step ")[1].split()[0])
    assert 2 <= stopped < 12 and committed_steps(out / "checkpoints")[-1] == stopped

    outputs = _finish(_launch([*args, "--resume"], "env", cache=cache, cwd=tmp_path))
    assert f"resuming at step {stopped}" in outputs[0]
    _check_one_writer(outputs, out, steps=12)
    assert_bitwise(_state(data_tensor_reference, DATA_TENSOR), _state(out, DATA_TENSOR),
                   f"process 1 sent SIGTERM, both stopped after step {stopped}, resumed")


@pytest.mark.slow
def test_sigkill_of_one_process_then_resume_auto_on_both_is_bitwise_identical(tmp_path, cache,
                                                                             data_tensor_reference):
    # A machine lost mid-run: process 1 is SIGKILLed once a checkpoint is committed;
    # process 0 then fails on its own or is stopped (as a scheduler stops a broken job).
    # The requeued job runs the same command, train.resume=auto, on both processes, and
    # ends with the bits of an uninterrupted 2-process run (same layout, same reductions).
    steps = 12
    ref, out = data_tensor_reference, tmp_path / "cluster"
    args = [*MH, *DATA_TENSOR, f"train.out_dir={out}", "train.resume=auto"]
    first, second = _launch(args, "env", cache=cache, cwd=tmp_path, timeout_s=15)
    try:
        kill_after_first_commit(second, out / "checkpoints", steps)
        try:
            alone = first.proc.wait(timeout=30)  # its own error, or ...
        except subprocess.TimeoutExpired:
            first.kill()  # ... stopped here (-9)
            alone = first.proc.returncode
    finally:
        first.kill()
        second.kill()
    assert alone != 0 and "done:" not in first.output, first.output[-3000:]  # never done without its peer
    last = committed_steps(out / "checkpoints")[-1]
    assert last < steps

    outputs = _finish(_launch(args, "env", cache=cache, cwd=tmp_path))
    assert f"resuming at step {last}" in outputs[0], outputs[0][-3000:]
    _check_one_writer(outputs, out, steps=steps)
    assert_bitwise(_state(ref, DATA_TENSOR), _state(out, DATA_TENSOR),
                   f"process 1 killed after the checkpoint of step {last} (process 0: rc {alone}), resumed")


@pytest.mark.slow
def test_ctrl_c_in_the_terminal_stops_both_processes_after_the_same_step(tmp_path, cache):
    # A terminal's Ctrl-C reaches every process of the job: each hands it to JAX's
    # preemption service, which picks one step for both, so their collective save matches.
    out = tmp_path / "cluster"
    procs = _launch([*MH, *DATA_TENSOR, f"train.out_dir={out}"], "env", cache=cache, cwd=tmp_path)
    procs[0].wait_for_step(2, TIMEOUT_S)
    for p in procs:
        p.signal(signal.SIGINT)
    outputs = _finish(procs)
    stops = [ln for ln in outputs[0].splitlines() if ln.startswith("stopped by SIGINT after step ")]
    assert len(stops) == 1, outputs[0][-3000:]
    stopped = int(stops[0].split("after step ")[1].split()[0])
    assert 2 <= stopped < 12 and committed_steps(out / "checkpoints")[-1] == stopped
    logged = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, stopped + 1))


@pytest.mark.slow
def test_pipeline_across_two_processes_with_slurm_variables(tmp_path, cache):
    """Also the online repartition: process 0 measures and decides, both take its split
    (each measuring its own, timings apart, could run two programs and hang)."""
    out = tmp_path / "cluster"
    layout = [*PIPELINE, "model.n_layers=4", "parallel.stage_layers=[1, 3]", "parallel.repartition_after=2"]
    outputs = _finish(_launch([*MH, *layout, f"train.out_dir={out}"], "slurm", cache=cache, cwd=tmp_path))
    assert "'pipe': 2" in outputs[0]
    _check_one_writer(outputs, out)
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    (event,) = [r["repartition"] for r in records if "repartition" in r]
    assert event["before"] == [1, 3] and sum(event["after"]) == 4, event
    single = _single_process(tmp_path, layout)
    _compare(_state(single, layout), _state(out, layout), bitwise=False)


@pytest.mark.slow
def test_deterministic_mode_is_bitwise_across_processes(tmp_path, cache):
    out = tmp_path / "cluster"
    _finish(_launch([*MH, *DETERMINISTIC, f"train.out_dir={out}"], "flags", cache=cache, cwd=tmp_path))
    single = _single_process(tmp_path, DETERMINISTIC)
    _compare(_state(single, DETERMINISTIC), _state(out, DETERMINISTIC), bitwise=True)


SUPERNET = ["parallel.data=4", "parallel.tensor=1", "parallel.subnet=2", "supernet.subnets_per_step=2",
            "supernet.search_population=4", "supernet.search_generations=1", "supernet.search_top_k=2",
            "train.steps=2"]


def test_a_supernet_trained_then_searched_across_two_processes(tmp_path, cache):
    """The search that ends `mindpipe supernet` stopped both processes with a traceback
    (jit refused its NumPy subnets and validation rows with shardings over both
    processes), as did `mindpipe search`. Now both finish, process 0 alone prints, and
    searching the saved run again as two processes finds what the run's search found."""
    out = tmp_path / "cluster"
    trained = _finish(_launch([*MH, *SUPERNET, f"train.out_dir={out}"], "env", cache=cache, cwd=tmp_path,
                              command="supernet"))
    searched = _finish(_launch([str(out)], "env", cache=cache, cwd=tmp_path, command="search"))
    best = [re.search(r"best subnet (\[[\d, ]+\])", output[0]) for output in (trained, searched)]
    assert all(best) and best[0].group(1) == best[1].group(1), (trained[0][-2000:], searched[0][-2000:])
    assert "done: 2 steps" in trained[0] and "done: searched step 2" in searched[0]
    for output in (trained[1], searched[1]):
        assert not [ln for ln in output.splitlines() if ln.startswith(("step ", "done:", "supernet:"))]


# The online tuner with the default step model: a batch not yet run is predicted from
# the measured one with a fixed overhead share, so the choice depends on the noise
# estimate only (random synthetic tokens: B_noise ~400-650 here, far above the ~290
# where B32 starts to beat B16), never on this machine's timing.
TUNED = ["parallel.data=8", "parallel.tensor=1", "train.grad_accum=2", "tuner.enabled=true",
         "tuner.batch_sizes=[32]", "tuner.ema=0.5", "tuner.warmup=4", "tuner.every=4", "tuner.threshold=0",
         "tuner.amortize=false"]


def test_a_tuner_switch_is_taken_alike_on_both_processes(tmp_path, cache):
    """Process 0 decides and broadcasts (``OnlineTuner.decide``): both processes switch to
    B32 after the same step (a process left at B16 would hang the next collective), and
    the cluster ends where one process making the same decision ends."""
    out = tmp_path / "cluster"
    _finish(_launch([*MH, *TUNED, f"train.out_dir={out}"], "flags", cache=cache, cwd=tmp_path))
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    switched = [(r["step"], r["tuner"]["to"]) for r in records if "tuner" in r]
    single = _single_process(tmp_path, TUNED)
    assert switched and switched == [(h["step"], h["tuner"]["to"]) for h in single.history if "tuner" in h]
    assert switched[0][1].endswith("B32") and records[-1]["tuner/batch"] == 32
    _compare(_state(single, TUNED), _state(out, TUNED), bitwise=False)


# Imported first by process 1 of the next tests (its PYTHONPATH): the first SHORT_AFTER
# memory checks pass, and from then on the host has 1 MiB free, as if another job had
# taken it.
SHORT_OF_MEMORY = """
import importlib, os
memory_fit = importlib.import_module("mindpipe_jax.train.memory_fit")  # (mindpipe_jax.train: the function)
checks = []
def host_free_bytes(meminfo="/proc/meminfo"):
    checks.append(1)
    return float("inf") if len(checks) <= int(os.environ["SHORT_AFTER"]) else 2.0**20
memory_fit.host_free_bytes = host_free_bytes
"""


def _short_of_memory(tmp_path: Path, after: int) -> dict:
    """Process 1's environment for ``SHORT_OF_MEMORY`` after ``after`` checks."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SHORT_OF_MEMORY)
    return {"PYTHONPATH": f"{hook}{os.pathsep}{cli_env()['PYTHONPATH']}", "SHORT_AFTER": str(after)}


def test_a_switch_one_process_cannot_fit_is_refused_on_both(tmp_path, cache):
    """The tuner's B32 compiles on both processes; process 1 finds its step too large for
    its host's memory, and both stay at B16 (process 0 alone switching would leave them in
    different programs: a hang at the next step) and finish the run."""
    out = tmp_path / "cluster"
    outputs = _finish(_launch([*MH, *TUNED, f"train.out_dir={out}"], "flags", cache=cache, cwd=tmp_path,
                              own_env=({}, _short_of_memory(tmp_path, 1))))
    assert re.search(r"step 4 \| tuner: not switching to .*B32: process 1 stopped the tuner's switch: the "
                     r"switch needs [0-9.]+ [KMG]iB more memory", outputs[0]), outputs[0][-3000:]
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "tuner_refused" in r] == [4]
    assert not any("tuner" in r for r in records) and records[-1]["tuner/batch"] == 16
    assert committed_steps(out / "checkpoints")[-1] == STEPS


def test_a_supernet_step_one_process_cannot_fit_stops_both_in_one_line(tmp_path, cache):
    """Checked on process 1 only, a supernet step too large for its host stopped that
    process alone, and process 0 went on into the first step's collectives."""
    out = tmp_path / "cluster"
    procs = _launch([*MH, *SUPERNET, f"train.out_dir={out}"], "env", cache=cache, cwd=tmp_path,
                    command="supernet", own_env=({}, _short_of_memory(tmp_path, 0)))
    codes = [p.wait(TIMEOUT_S) for p in procs]
    assert codes == [2, 2], [p.output[-2000:] for p in procs]
    errors = [[ln for ln in p.output.splitlines() if ln.startswith("mindpipe: error:")] for p in procs]
    assert errors[0] == [f"mindpipe: error: process 1 stopped the supernet run: {errors[1][0][17:]}"], errors
    assert errors[1][0].startswith("mindpipe: error: the train step needs ")
    assert "1.0 MiB free" in errors[1][0], errors
    assert not out.exists()


NO_ROOM_FOR_CHECKPOINTS = """
import shutil
_disk_usage = shutil.disk_usage
def disk_usage(path):
    usage = _disk_usage(path)
    return type(usage)(usage.total, usage.used, 1024) if str(path).endswith("checkpoints") else usage
shutil.disk_usage = disk_usage
"""


def test_a_checkpoint_one_process_has_no_room_for_stops_both_in_one_line(tmp_path, cache):
    """Process 1's disk has 1 KiB free for the first checkpoint. A first save was never
    checked for room, and one whose writes failed on a process left the others in
    orbax's barrier (seen on a full 200 kB tmpfs: both processes hung at the next save,
    past SIGTERM, orbax's barrier gives up after 20 minutes). Now the room is checked
    before writing, and a process without it stops them all, nothing written."""
    out = tmp_path / "cluster"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(NO_ROOM_FOR_CHECKPOINTS)
    env = {"PYTHONPATH": f"{hook}{os.pathsep}{cli_env()['PYTHONPATH']}"}
    procs = _launch([*MH, f"train.out_dir={out}"], "env", cache=cache, cwd=tmp_path, own_env=({}, env))
    codes = [p.wait(TIMEOUT_S) for p in procs]
    assert codes == [2, 2], [p.output[-2000:] for p in procs]
    errors = [[ln for ln in p.output.splitlines() if ln.startswith("mindpipe: error:")] for p in procs]
    assert errors[1][0].startswith(f"mindpipe: error: no space left on the device of "
                                   f"{str(out / 'checkpoints')!r} to save step 4: "), errors
    assert "1024 bytes are free; nothing was written and no checkpoint was committed" in errors[1][0], errors
    theirs = errors[1][0][len("mindpipe: error: "):]
    assert errors[0] == [f"mindpipe: error: process 1 stopped the checkpoint save: {theirs}"], errors
    assert committed_steps(out / "checkpoints") == [] and not list((out / "checkpoints").iterdir())


def test_a_peer_that_never_starts_is_a_clear_error_within_the_timeout(tmp_path, cache):
    # Each process alone, on its own port: process 0 waits for a peer that never
    # comes; process 1 finds no coordinator.
    alone = [
        Train([*MH, *CHILD, f"train.out_dir={tmp_path / f'out{pid}'}", "distributed.timeout_s=5",
               f"distributed.coordinator=127.0.0.1:{_free_port()}", "distributed.num_processes=2",
               f"distributed.process_id={pid}"], env=cli_env(cache), cwd=tmp_path)
        for pid in (0, 1)]
    t0 = time.monotonic()
    codes = [p.wait(90) for p in alone]
    assert codes == [4, 4], [p.output for p in alone]
    assert time.monotonic() - t0 < 60
    for pid, proc in enumerate(alone):
        lines = proc.output.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.output, proc.output
        assert lines[0].startswith("mindpipe: error: distributed start-up failed: ")
        assert "distributed.timeout_s=5 s" in lines[0]
        assert ("not all 2 processes joined" if pid == 0 else "process 1 of 2 could not join") in lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_peer_dying_mid_run_ends_the_other_within_the_heartbeat_timeout(tmp_path, cache):
    # The config of the first test (its compiled programs are in the cache).
    first, second = _launch([*MH, *DATA_TENSOR, f"train.out_dir={tmp_path / 'run'}"],
                            "env", cache=cache, cwd=tmp_path, timeout_s=15)
    try:
        first.wait_for_step(1, TIMEOUT_S)
        second.kill()
        t0 = time.monotonic()
        code = first.wait(120)
    finally:
        first.kill()
        second.kill()
    assert code != 0 and time.monotonic() - t0 < 100, first.output[-3000:]
    # Either our line (a collective failed) or JAX's (the heartbeat stopped): both say a peer died.
    assert ("lost contact with another process" in first.output
            or "another task died" in first.output), first.output[-3000:]
    assert first.last_step < 12


def _stopped_with_errors(procs: list[Train]) -> list[list[str]]:
    """Each process's ``mindpipe: error:`` lines, once both have exited with status 2."""
    try:
        codes = [p.wait(120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [2, 2], [p.output[-2000:] for p in procs]
    return [[line for line in p.output.splitlines() if line.startswith("mindpipe: error:")] for p in procs]


def _two_hosts(tmp_path: Path) -> tuple[Path, Path]:
    """A working directory per process: what a relative path names differs, as on hosts
    that do not share a filesystem."""
    cwds = (tmp_path / "host0", tmp_path / "host1")
    for cwd in cwds:
        cwd.mkdir()
    return cwds


MODELS = str(Path(__file__).parent / "byom_models.py")
DIFFERENT = {
    # Process 0 ended after its last step while process 1 waited in the next step's
    # collectives, for good (the run hung until killed).
    "config": ((["train.steps=8"], ["train.steps=12"]),
               "train.steps=12 on process 1, but train.steps=8 on process 0: every process of a training "
               "run must be given the same config (they would wait on each other at the first step they "
               "differ in)"),
    "model": ((["--model", f"{MODELS}:make_llama", "model.vocab_size=64"],
               ["--model", f"{MODELS}:PlainListNet", "model.vocab_size=64"]),
              "on process 1, but parameter "),
}


@pytest.mark.parametrize("what", sorted(DIFFERENT))
def test_processes_given_different_configs_or_models_stop_in_one_line_instead_of_hanging(what, tmp_path,
                                                                                      cache):
    """Every process checks its config against process 0's before anything runs, and the
    model it built (parameter paths and shapes) before the first step: both stop (exit 2)
    in one line each before anything is written."""
    own, needle = DIFFERENT[what]
    procs = _launch([*MH, *DATA_TENSOR, f"train.out_dir={tmp_path / 'run'}"], "env", cache=cache,
                    cwd=tmp_path, own=own)
    errors = _stopped_with_errors(procs)
    assert len(errors[1]) == 1 and needle in errors[1][0], procs[1].output[-2000:]
    assert errors[0] == [f"mindpipe: error: the {what} of process 1 differs from process 0's (its error line "
                         f"names the difference): every process of a training run must "
                         f"{'be given the same config' if what == 'config' else 'build the same model'}"]
    assert not (tmp_path / "run").exists()


# What only one process sees: a relative path resolved in each process's own working
# directory, as on hosts that do not share a filesystem. Process 1 stopped with its line
# while process 0 went on into the first collective and waited there for good (and
# process 1 aborted with a page of C++ stack as the coordination service saw it go).
ONE_SIDED = {
    "data path": (["data.source=text", "data.path=corpus.txt", "train.out_dir=run"],
                  "data.path 'corpus.txt' does not exist", "training run"),
    "run directory": (["train.out_dir=run"], "/host1/run' exists and is not a directory", "run"),
    "model code": (["--model", "host_model.py:make", "train.out_dir=run"],
                   "raised ModuleNotFoundError: No module named 'a_library_host1_lacks'", "training run"),
}
HOST_MODEL = """
from flax import nnx


def make(rngs):
    {missing}
    return nnx.Sequential(nnx.Embed(256, 16, rngs=rngs), nnx.Linear(16, 256, rngs=rngs))
"""


@pytest.mark.parametrize("what", sorted(ONE_SIDED))
def test_a_mistake_only_one_process_sees_stops_both_in_one_line_instead_of_hanging(what, tmp_path, cache):
    args, message, job = ONE_SIDED[what]
    cwds = _two_hosts(tmp_path)
    if what == "data path":
        (cwds[0] / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    elif what == "run directory":
        (cwds[1] / "run").write_text("a file where host 0 has nothing")
    else:
        for cwd, missing in zip(cwds, ("", "import a_library_host1_lacks"), strict=True):
            (cwd / "host_model.py").write_text(HOST_MODEL.format(missing=missing))
    before = {p.relative_to(tmp_path) for p in tmp_path.rglob("*")}
    own_data = [a for a in MH if not a.startswith("data.")] if what == "data path" else MH
    procs = _launch([*own_data, *DATA_TENSOR, *args], "env", cache=cache, cwd=cwds)
    errors = _stopped_with_errors(procs)
    assert len(errors[1]) == 1 and message in errors[1][0], procs[1].output[-2000:]
    assert errors[0] == [f"mindpipe: error: process 1 stopped the {job}: {errors[1][0].split(': ', 2)[2]}"]
    assert "Check failure stack trace" not in procs[1].output
    assert {p.relative_to(tmp_path) for p in tmp_path.rglob("*")} == before  # process 0 wrote nothing


# Found before the processes connect: process 1 stopped at once while process 0 waited
# out distributed.timeout_s for it and then ended with "not all 2 processes joined"
# (exit 4, 300 s by default). How each process reaches the coordinator alternates
# between the launcher's environment and distributed.* overrides.
BEFORE_CONNECTING = {
    "train config file": ("train", ["--config", "job.toml", *MH], "env",
                          "config file 'job.toml' does not exist", "training run"),
    "supernet config file": ("supernet", ["--config", "job.toml", *MH], "overrides",
                             "config file 'job.toml' does not exist", "supernet run"),
    "search run directory": ("search", ["runs/super"], "env", "/host1/runs/super' does not exist", "search"),
    # Found once process 1 had connected (the module is imported after setup_runtime).
    "model file": ("train", ["--model", "host_model.py:make", *MH], "overrides",
                   "file 'host_model.py' does not exist", "training run"),
}


@pytest.mark.parametrize("what", sorted(BEFORE_CONNECTING))
def test_a_config_only_one_host_has_stops_both_in_one_line_instead_of_a_timeout(what, tmp_path, cache):
    command, args, how, message, job = BEFORE_CONNECTING[what]
    cwds = _two_hosts(tmp_path)
    (cwds[0] / "job.toml").write_text("[train]\nsteps = 2\n")
    (cwds[0] / "host_model.py").write_text(HOST_MODEL.format(missing=""))
    (cwds[0] / "runs" / "super").mkdir(parents=True)
    (cwds[0] / "runs" / "super" / "config.json").write_text(json.dumps(mp.Config().to_dict()))
    before = {p.relative_to(tmp_path) for p in tmp_path.rglob("*")}
    t0 = time.monotonic()
    procs = _launch(args, how, cache=cache, cwd=cwds, command=command, timeout_s=120)
    errors = _stopped_with_errors(procs)
    assert time.monotonic() - t0 < 90  # not the 120 s start-up timeout
    assert len(errors[1]) == 1 and message in errors[1][0], procs[1].output[-2000:]
    assert errors[0] == [f"mindpipe: error: process 1 stopped the {job}: {errors[1][0].split(': ', 2)[2]}"]
    assert "Traceback" not in procs[0].output + procs[1].output
    assert {p.relative_to(tmp_path) for p in tmp_path.rglob("*")} == before


def test_a_run_directory_the_processes_do_not_share_is_refused_before_a_checkpoint_is_read(tmp_path, cache):
    """train.out_dir on each host's own disk: process 0 sees its checkpoints, process 1
    none. Resuming (train.resume=auto), process 0 read them (orbax reads collectively)
    while process 1 started fresh: both crashed on mismatched collectives (gloo: "Received
    data size doesn't match expected size", SIGABRT)."""
    cwds = _two_hosts(tmp_path)
    step = cwds[0] / "run" / "checkpoints" / "4"
    step.mkdir(parents=True)
    (step / COMMIT_MARKER).write_text("")  # what makes a step committed: nothing is read before the check
    before = {p.relative_to(tmp_path) for p in tmp_path.rglob("*")}
    procs = _launch([*MH, *DATA_TENSOR, "train.out_dir=run", "train.resume=auto"], "env", cache=cache,
                    cwd=cwds)
    for cwd, p, errors in zip(cwds, procs, _stopped_with_errors(procs), strict=True):
        assert errors == [f"mindpipe: error: the processes of the training run see different checkpoints "
                          f"in {str(cwd / 'run' / 'checkpoints')!r} (the newest on process 0: step 4, "
                          f"process 1: none): put train.out_dir on a filesystem every process shares (each "
                          f"writes its shards of a checkpoint there)"], p.output[-2000:]
    assert {p.relative_to(tmp_path) for p in tmp_path.rglob("*")} == before


def test_the_coordinator_binds_the_address_given_when_it_is_an_ip_address():
    from mindpipe_jax.config import DistributedConfig
    from mindpipe_jax.parallel.mesh import distributed_settings

    def bind(coordinator: str):
        cfg = DistributedConfig(coordinator=coordinator, num_processes=2, process_id=0)
        return distributed_settings(cfg, {}).get("coordinator_bind_address")

    assert bind("127.0.0.1:1234") == "127.0.0.1:1234"
    assert bind("[::1]:1234") == "[::1]:1234"
    assert bind("node003:1234") is None  # a name: JAX's default, every interface (see README)


def test_a_coordinator_port_in_use_is_one_line_exit_4_on_both_processes(tmp_path, cache):
    # Another program holds the port (listening, never answering). Process 0 finds it
    # taken before starting the coordinator; process 1 finds that what listens there
    # does not answer as a coordinator: both stop long before distributed.timeout_s.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        procs = _launch([*MH, f"train.out_dir={tmp_path / 'run'}"], "flags", cache=cache, cwd=tmp_path,
                        timeout_s=120, port=port)
        t0 = time.monotonic()
        try:
            codes = [p.wait(150) for p in procs]
        finally:
            for p in procs:
                p.kill()
    assert codes == [4, 4], [p.output for p in procs]
    assert time.monotonic() - t0 < 100
    for pid, proc in enumerate(procs):
        lines = proc.output.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.output, proc.output
        assert lines[0].startswith("mindpipe: error: distributed start-up failed: "), lines[0]
        assert (f"port {port} is already in use" if pid == 0 else "is not a JAX coordinator") in lines[0]
    assert list(tmp_path.iterdir()) == []

