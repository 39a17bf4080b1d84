"""Faults during a run, through the real deepspeed launcher: each is noticed, named, and ends the run cleanly."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")


def launch(out_dir, model, *flags, port=29700):
    cmd = [DEEPSPEED, "--num_gpus", "1", "--master_port", str(port), "grpo_train.py", "--model", model,
           "--out-dir", str(out_dir), "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "8",
           "--max-prompt-len", "16", "--eval-size", "8", *flags]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(proc, timeout=300):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def test_bad_configuration_is_refused_with_a_message(tmp_path, tiny_model):
    rc, out = finish(launch(tmp_path, tiny_model, "--beta", "0", "--group-size", "1"))
    assert rc != 0 and "--group-size must be >= 2" in out
    rc, out = finish(launch(tmp_path, str(tmp_path / "no-such-model"), "--beta", "0"))
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
        assert proc.poll() is None, proc.stdout.read()[-3000:]
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
