"""A run that checks itself: at step 1 the policy is the reference and sampled the batch, so the KL to the
reference and the trainer/vLLM log-prob gap are rounding, or one warning line names the likely causes; a
resumed run samples its first batch from the checkpoint's weights. Real launches (deepspeed, vLLM, the
reference server) on the demo model."""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from metrics import FIRST_STEP_GAP, FIRST_STEP_KL, first_step_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")
WARNING = "self-check at step 1 failed:"


def rows_of(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_demo(out_dir, *args):
    p = subprocess.run([sys.executable, "-m", "demo.run_demo", "--out-dir", str(out_dir), *args], cwd=ROOT,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p.stdout + p.stderr, rows_of(out_dir)


def probe_logp(model_dir, flags):
    """The mean log-prob of the weight-sync probe (the first 64 tokens of the first training prompt) under
    the HF model in model_dir: what the engine reports as sync/probe_logp once it holds those weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from grpo_train import completion_logps, get_args
    from run_setup import load_prompts
    args = get_args(["--model", model_dir, *flags])
    ids = load_prompts(AutoTokenizer.from_pretrained(model_dir), **vars(args))[0][0]["prompt_ids"][:64]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ids = torch.tensor([ids])
        return completion_logps(model, ids, torch.ones_like(ids), ids.shape[1] - 1).mean().item()


def test_first_step_check_names_the_causes_of_what_is_off():
    """One line; the reference's causes when the KL is off, vLLM's when the gap is, both when both are."""
    ok = {"kl": 1e-9, "sampling/logp_diff_mean": 1e-6}
    assert first_step_check(ok) is None
    assert first_step_check({"kl": FIRST_STEP_KL, "sampling/logp_diff_mean": FIRST_STEP_GAP}) is None
    kl = first_step_check({**ok, "kl": 0.2})
    assert kl.startswith(WARNING) and "another checkpoint" in kl and "top-p" not in kl and "\n" not in kl
    gap = first_step_check({**ok, "sampling/logp_diff_mean": 0.5})
    assert "another checkpoint" not in gap and "dtype" in gap and "chat template" in gap and "top-p" in gap
    both = first_step_check({"kl": 0.2, "sampling/logp_diff_mean": 0.5})
    assert "another checkpoint" in both and "top-p" in both and "\n" not in both


def test_normal_run_passes_the_self_check_and_resume_samples_from_the_checkpoint(tmp_path, demo_model):
    """Two steps, then --resume to a third. Step 1: kl ~0 and the gap at fp32 rounding, no warning. The
    resumed run's first batch comes with the probe the engine measured on the weights it sampled it with:
    the checkpoint's (step_2, scored here by transformers), not the starting model's."""
    flags = ["--", "--eval-size", "200"]
    out, rows = run_demo(tmp_path, "--model", demo_model, "--steps", "2", "--eval-every", "0", *flags)
    assert WARNING not in out
    assert rows[0]["kl"] < 1e-9 and rows[0]["sampling/logp_diff_mean"] < 1e-4 and rows[0]["policy_lag"] == 0
    start = probe_logp(demo_model, ["--task", "demo"])
    assert rows[0]["sync/probe_logp"] == pytest.approx(start, abs=1e-4)
    out, rows = run_demo(tmp_path, "--model", demo_model, "--steps", "3", "--eval-every", "0", *flags,
                         "--resume")
    assert [r["step"] for r in rows] == [1, 2, 3] and WARNING not in out
    trained = probe_logp(str(tmp_path / "step_2"), ["--task", "demo"])
    assert abs(trained - start) > 1e-2   # two steps moved the probe: the comparison tells them apart
    assert rows[2]["sync/probe_logp"] == pytest.approx(trained, abs=1e-4)


def test_a_reference_that_computes_another_model_is_said_at_step_1(tmp_path, demo_model):
    """The reference server serves the demo model's weights under another config (rotary base 1 for 10000): the
    fingerprint, which hashes the weights and the architecture's sizes, passes it, but its log-probs are
    another model's. Step 1's KL is far from 0 and the run says so in one line, naming the reference."""
    other = tmp_path / "other"
    shutil.copytree(demo_model, other)
    config = json.loads((other / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 1.0
    (other / "config.json").write_text(json.dumps(config))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "ref_server.py", "--model", str(other), "--port", str(port)],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        cmd = [DEEPSPEED, "--num_gpus", "1", "--master_port", "29621", "grpo_train.py", "--model", demo_model,
               "--out-dir", str(tmp_path / "run"), "--steps", "1", "--task", "demo", "--rewards", "demo",
               "--prompts-per-step", "8", "--group-size", "8", "--max-new-tokens", "12",
               "--max-prompt-len", "16", "--eval-size", "20", "--ref-url", f"http://127.0.0.1:{port}"]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    (row,) = rows_of(tmp_path / "run")
    warnings = [line for line in (p.stdout + p.stderr).splitlines() if WARNING in line]
    assert row["kl"] > FIRST_STEP_KL, row["kl"]
    assert row["sampling/logp_diff_mean"] < 1e-4, row["sampling/logp_diff_mean"]   # vLLM is the policy
    assert len(warnings) == 1 and "another checkpoint" in warnings[0] and "top-p" not in warnings[0]
