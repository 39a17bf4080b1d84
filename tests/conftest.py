import fcntl
import glob
import itertools
import os
import subprocess
import sys
import tempfile

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# `make test` runs the tests several at a time (pytest-xdist): each worker is a process of its own, "gw0", "gw1", ...
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
# this process's ports, counted up from its block (port_block) once a test asks for the first
_PORTS = None


def port_block():
    """The ports of the first of eleven 1000-port blocks (21000-21999, ..., 31000-31999) that no other test
    process holds, held until this one ends: a lock on a file named for the block, whose descriptor is never
    closed. So a run's workers, and two test runs on one machine, never hand out the same port. Below the
    kernel's ephemeral ports (32768 and up), where bind(0) never lands."""
    for block in range(11):
        # read-only: a lock file another user's test run made is locked all the same
        path = os.path.join(tempfile.gettempdir(), f"grpo-test-ports-{block}.lock")
        held = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:   # another test process holds it
            os.close(held)
            continue
        return itertools.count(21000 + 1000 * block)
    raise RuntimeError("every port block of the tests is held: more than 11 test processes at once")


def next_port():
    """A loopback port for a launch or a server of this test process that no other takes: counted up in the
    process's own block (port_block), claimed at the first call. So a port handed out now and bound seconds
    later (deepspeed's --master_port, ref_server.py's --port) is still free then, with any number of tests
    running beside it."""
    global _PORTS
    if _PORTS is None:
        _PORTS = port_block()
    return next(_PORTS)


# The slowest tests, slowest first (seconds of one test in a full `make test` on 2 cores). None shares a
# module-scoped fixture with a test left behind (test_remote_engines' `servers` serves its one test alone):
# moved away from it, it would start that fixture a second time.
SLOWEST = [
    "test_the_documented_lines_as_written_two_at_once_eval_only_and_ctrl_c",   # 173
    "test_a_run_on_two_vllm_servers_learns_as_on_local_engines_and_ends_in_one_line_if_one_dies",   # 160
    "test_resume_after_sigkill_continues_the_run_and_samples_from_the_checkpoint",   # 137
    "test_update_does_not_depend_on_world_size_micro_batches_or_nodes",   # 133
    "test_gpu_check_tiny_mode_runs_on_cpu",   # 127
    "test_lora_resume_is_exact_and_keeps_the_adapters_and_their_optimizer_alone",   # 122
    "test_short_run_on_two_ranks_two_engines_and_two_reference_servers",   # 115
    "test_stopping_the_demo_stops_every_process_it_started[ref server dies]",   # 111
    "test_lora_with_gspo_learns_pushes_merged_weights_and_evaluates",   # 100
    "test_variants_ppo_epochs_tis_overlong_truncation_dynamic_sampling",   # 93
    "test_reference_server_killed_and_restarted_mid_run",   # 91
    "test_stopping_the_demo_stops_every_process_it_started[SIGTERM]",   # 84
    "test_a_run_says_what_matters_and_its_out_dir_is_not_reused_by_mistake",   # 79
    "test_killed_generation_process_stops_the_run_quickly_with_no_orphans",   # 76
    "test_each_kind_of_mistake_ends_in_one_line_through_the_launcher",   # 69
    "test_non_finite_gradients_are_skipped_then_the_run_stops",   # 67
    "test_resume_restores_model_and_optimizer_exactly",   # 64
    "test_sigterm_to_the_deepspeed_launcher_stops_every_process[its process group]",   # 62
    "test_real_task_plumbing_end_to_end[code-code]",   # 60
    "test_a_trainer_killed_before_its_first_push_leaves_no_engine",   # 51
    "test_a_cpu_engine_runs_vllms_compiled_sampler_helpers_eagerly",   # 49
    "test_real_task_plumbing_end_to_end[gsm8k-gsm8k,format:0.5]",   # 47
    "test_sigterm_to_the_deepspeed_launcher_stops_every_process[the launcher]",   # 45
    "test_the_trainer_says_what_it_waits_for_and_what_to_do",   # 43
    "test_ctrl_c_while_the_demo_builds_its_model_ends_it_without_a_traceback",   # 42
    "test_padding_bench_counts_less_padding_longest_first",   # 42
    "test_peak_memory_stays_flat_as_the_request_grows",   # 41
    "test_a_trainer_killed_mid_push_leaves_no_engine_behind",   # 39
    "test_reload_serves_only_the_files_it_checked",   # 39
    "test_a_short_run_pushes_every_step_into_the_installed_vllm_and_stops_cleanly",   # 38
    "test_own_data_in_one_file_and_no_learning_signal_said_aloud",   # 36
    "test_sigterm_to_the_deepspeed_launcher_stops_every_process[its process group at start-up]",   # 32
    "test_reward_workers_run_jails_at_once_with_the_serial_scores",   # 31
    "test_an_engine_slower_to_start_than_the_rendezvous_store_waits_still_joins",   # 25
    "test_an_engine_killed_before_its_first_push_ends_the_run_in_one_line",   # 24
]


@pytest.hookimpl(trylast=True)   # after -k's deselection: the runs are of the tests that run
def pytest_collection_modifyitems(config, items):
    """Slowest first on every worker. xdist (--dist worksteal) gives each of n workers a run of the collected
    tests, n runs back to back, and a worker that runs out takes the back half of the longest queue left. So
    the SLOWEST are dealt in turn to the front of the n runs, and the other tests follow in their own order
    (a module's tests together, as its fixtures expect): what is left to take at the end is short tests, and
    no worker runs a long one alone at the end. The demo model is built once, by the first worker to need
    it (built_once), so every run but the first starts with a test that does not need it, not waiting.
    (A worker sees --dist as "no": only the worker count says it is one of several.)"""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    rank = {name: i for i, name in enumerate(SLOWEST)}
    slow = sorted((item for item in items if item.name in rank), key=lambda item: rank[item.name])
    if workers < 2 or not slow:
        return
    rest = [item for item in items if item.name not in rank]
    # the lengths of the runs xdist deals out: the tests left, split evenly over the workers left
    lengths, left = [], len(items)
    for i in range(workers):
        lengths.append(left // (workers - i))
        left -= lengths[-1]
    runs = [slow[i::workers] for i in range(workers)]
    for run in runs[1:]:
        first = next((item for item in run if "demo_model" not in item.fixturenames), None)
        if first is not None:
            run.remove(first)
            run.insert(0, first)
    for run, length in zip(runs, lengths):
        take = max(0, length - len(run))
        run += rest[:take]
        rest = rest[take:]
    items[:] = [item for run in runs for item in run] + rest


def running(process):
    """Whether a psutil.Process still runs: not ended, and not a zombie waiting for its parent to reap it."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:   # it ended between the two questions
        return False


def no_allreduce_buffer_left(port):
    """No DeepSpeed CPU all-reduce buffer (one per rank in /dev/shm, named after the launch's port) is there:
    the trainer does not build the op that makes them (run_setup.skip_shm_allreduce_op)."""
    return not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A randomly initialised tiny Qwen2 model + char tokenizer in HF format (built locally, no download)."""
    from demo.tiny_model import build_model, build_tokenizer, save
    tok = build_tokenizer()
    return save(build_model(tok, seed=0), tok, str(tmp_path_factory.mktemp("tiny")))


def built_once(tmp_path_factory, name, build):
    """The path of `name` in the run's own temporary folder, which build(path) makes once per test run, not
    once per worker: the first worker to need it builds it under a lock, and a finished build is renamed
    into place, so the others wait for it and never see half of one."""
    base = tmp_path_factory.getbasetemp()
    # a worker's folder is popen-gwN inside the run's own: the run's is the one they share
    shared = base.parent if "PYTEST_XDIST_WORKER" in os.environ else base
    out = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            building = shared / f"{name}.{WORKER}"
            build(building)
            os.rename(building, out)
    return out


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """The demo's model: built and warm-started by the demo's own builder (~30 s), once per test run."""
    def build(path):
        subprocess.run([sys.executable, "-m", "demo.tiny_model", "--out", str(path)], cwd=ROOT, check=True,
                       capture_output=True, timeout=600)
    return str(built_once(tmp_path_factory, "demo_model", build))
