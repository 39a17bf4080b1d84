import contextlib
import fcntl
import glob
import itertools
import os
import signal
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


def rank_zero(*args, port):
    """-> (command, environment) of grpo_train.py with `args` started as rank 0 of a one-rank launch on this
    machine, as deepspeed's launcher starts it (its launch.py: the same command and variables, the device
    it names included), but without the launcher's two processes, which cost ~8 s of CPU a launch. For the
    tests whose subject is not the launcher: those of the launcher's signals, its exit report, its
    --log_level, several ranks or nodes, and the documented lines go through it."""
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1", "CROSS_RANK": "0",
           "CROSS_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CUDA_VISIBLE_DEVICES": "0"}
    return [sys.executable, "-u", "grpo_train.py", "--local_rank=0", *args], env


def demo_settings(out_dir, model, *flags):
    """-> (command, environment) of grpo_train.py with the demo's settings (demo.run_demo.TRAIN_FLAGS, seed
    0) and then `flags`, as rank 0 alone (rank_zero), writing to out_dir."""
    from demo.run_demo import TRAIN_FLAGS
    return rank_zero("--model", model, "--out-dir", str(out_dir), "--seed", "0", *TRAIN_FLAGS, *flags,
                     port=next_port())


def running(process):
    """Whether a psutil.Process still runs: not ended, and not a zombie waiting for its parent to reap it."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:   # it ended between the two questions
        return False


def no_allreduce_buffer_left(port):
    """No DeepSpeed CPU all-reduce buffer (one per rank in /dev/shm, named after the launch's port) is there:
    the trainer does not build the op that makes them (ranks.skip_shm_allreduce_op)."""
    return not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")


def sigkill_group(group):
    """SIGKILL to every process of process group `group`, as a job killed without warning, then the named
    semaphores they held removed from /dev/shm -> those semaphores' paths. Rank 0's queues to its engines
    (generation.py: multiprocessing's spawn context) are named, /dev/shm/sem.mp-*; Python's resource tracker
    removes them once their processes end, but it is rank 0's child, in the group, and dies with it. A file is
    matched by its inode among the group's memory maps (which show the file glibc created before linking it
    under its name), so another process's semaphores are never touched."""
    held = set()
    for pid in psutil.pids():
        with contextlib.suppress(OSError):   # a process that ended meanwhile
            if os.getpgid(pid) == group:
                with open(f"/proc/{pid}/maps") as maps:
                    held |= {int(line.split()[4]) for line in maps if " /dev/shm/sem." in line}
    os.killpg(group, signal.SIGKILL)
    removed = []
    for path in glob.glob("/dev/shm/sem.mp-*"):
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino in held:
                os.unlink(path)
                removed.append(path)
    return removed


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
