import fcntl
import glob
import itertools
import os
import subprocess
import sys

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# `make test` runs the tests several at a time (pytest-xdist): each worker is a process of its own, "gw0", "gw1", ...
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
_PORTS = itertools.count(21000 + 1000 * int(WORKER.removeprefix("gw")))


def next_port():
    """A loopback port for a launch or a server of this test run that no other test takes: each worker counts
    up in a range of its own (gw0 from 21000, gw1 from 22000, ...), below the kernel's ephemeral ports (32768
    and up), where bind(0) never lands. So a port handed out now and bound seconds later (deepspeed's
    --master_port, ref_server.py's --port) is still free then, with any number of tests running beside it."""
    return next(_PORTS)


def running(process):
    """Whether a psutil.Process still runs: not ended, and not a zombie waiting for its parent to reap it."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:   # it ended between the two questions
        return False


def no_allreduce_buffer_left(port):
    """DeepSpeed's CPU allreduce buffers (one per rank in /dev/shm, named after the launch's port) are gone."""
    return not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A randomly initialised tiny Qwen2 model + char tokenizer in HF format (built locally, no download)."""
    from demo.tiny_model import build_model, build_tokenizer, save
    tok = build_tokenizer()
    return save(build_model(tok, seed=0), tok, str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """The demo's model: built and warm-started by the demo's own builder (~30 s), once per test run. The
    workers share it: the first to need it builds it under a lock, and a finished build is renamed into place,
    so the others wait for it and never see half of one."""
    base = tmp_path_factory.getbasetemp()
    # a worker's folder is popen-gwN inside the run's own: the run's is the one they share
    shared = base.parent if "PYTEST_XDIST_WORKER" in os.environ else base
    out = shared / "demo_model"
    with open(shared / "demo_model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            building = shared / f"demo_model.{WORKER}"
            subprocess.run([sys.executable, "-m", "demo.tiny_model", "--out", str(building)], cwd=ROOT,
                           check=True, capture_output=True, timeout=600)
            os.rename(building, out)
    return str(out)
