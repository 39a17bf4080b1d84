"""Faults during a run, through the real deepspeed launcher: each is noticed, named, and ends the run cleanly."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")


RUNS = []


@pytest.fixture(autouse=True)
def kill_leftover_runs():
    """Whatever a failing test leaves running is killed, whole process group and all."""
    yield
    while RUNS:
        proc = RUNS.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def launch(out_dir, model, *flags, port=29700):
    cmd = [DEEPSPEED, "--num_gpus", "1", "--master_port", str(port), "grpo_train.py", "--model", model,
           "--out-dir", str(out_dir), "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "8",
           "--max-prompt-len", "16", "--eval-size", "8", *flags]
    log = open(os.path.join(out_dir, "run.log"), "w")   # a file, not a pipe: a full pipe would stall the run
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log = log.name
    RUNS.append(proc)
    return proc


def finish(proc, timeout=300):
    proc.wait(timeout=timeout)
    with open(proc.log) as f:
        return proc.returncode, f.read()


def test_bad_configuration_is_refused_with_a_message(tmp_path, tiny_model):
    rc, out = finish(launch(tmp_path, tiny_model, "--beta", "0", "--group-size", "1"))
    assert rc != 0 and "--group-size must be >= 2" in out
    rc, out = finish(launch(tmp_path, str(tmp_path / "no-such-model"), "--beta", "0", port=29701))
    assert rc != 0 and "no such folder" in out


def test_reference_server_not_up_is_a_clear_error_naming_the_url(tmp_path, tiny_model):
    url = "http://127.0.0.1:9"   # nothing listens on the discard port
    t0 = time.time()
    rc, out = finish(launch(tmp_path, tiny_model, "--beta", "0.04", "--ref-url", url, "--ref-wait", "3"))
    assert rc != 0 and f"{url}/health not ready after 3" in out
    assert time.time() - t0 < 240


def test_killed_generation_process_stops_the_run_quickly_with_no_orphans(tmp_path, tiny_model):
    proc = launch(tmp_path, tiny_model, "--beta", "0", "--steps", "100000", "--lr", "1e-6")
    launcher = psutil.Process(proc.pid)
    deadline, gen = time.time() + 240, None
    while time.time() < deadline and gen is None:   # the vLLM child: a spawned grandchild of a rank
        time.sleep(1)
        assert proc.poll() is None, open(proc.log).read()[-3000:]
        metrics = tmp_path / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            gen = next(p for p in launcher.children(recursive=True) if "spawn_main" in " ".join(p.cmdline())
                       and "resource_tracker" not in " ".join(p.cmdline()))
    assert gen is not None, "the run never logged two steps"
    family = launcher.children(recursive=True)
    t0 = time.time()
    gen.send_signal(signal.SIGKILL)
    rc, out = finish(proc, timeout=120)
    assert rc != 0 and "the generation process died (exit code -9)" in out
    assert time.time() - t0 < 60   # noticed within seconds, not waited on forever
    time.sleep(2)
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))   # what was logged is intact


def _hold_lock_forever(lock):
    lock.acquire()
    time.sleep(600)


def test_weight_push_does_not_hang_on_a_lock_held_by_a_dead_generation_process():
    """A generation process killed while loading weights never releases the sync lock: the push must notice."""
    import torch
    import torch.multiprocessing as mp
    from weight_sync import WeightSync
    layer = torch.nn.Linear(2, 2)
    sync = WeightSync(layer.named_parameters(), [1, 2, 3])
    holder = mp.get_context("spawn").Process(target=_hold_lock_forever, args=(sync.lock,), daemon=True)
    holder.start()
    deadline = time.time() + 60
    while sync.lock.acquire(timeout=0.1):   # until the holder has taken it
        sync.lock.release()
        time.sleep(0.1)
        assert time.time() < deadline
    holder.kill()
    holder.join()

    def check_alive():
        if not holder.is_alive():
            raise RuntimeError("generation process died")
    t0 = time.time()
    with pytest.raises(RuntimeError, match="died"):
        sync.push(layer.named_parameters(), torch.zeros(2), evaluate=False, while_waiting=check_alive)
    assert time.time() - t0 < 5
