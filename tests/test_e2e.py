"""End to end: the real scripts through the real deepspeed launcher on CPU (vLLM child, ref server on
loopback, DeepSpeed ZeRO-2 with gloo), at world size 1 and 2, on the warm-started demo model."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REQUIRED = ["step", "reward/mean", "reward/demo", "kl", "loss", "clip_frac", "completion_len/mean", "frac_zero_std",
            "stale_dropped", "policy_lag", "sync/logp_diff", "time/gen_s", "time/train_s"]


def run_demo(out_dir, *args, timeout=600):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.run([sys.executable, "-m", "demo.run_demo", "--out-dir", str(out_dir), *args], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return p.stdout, [json.loads(line) for line in f]


@pytest.mark.parametrize("world_size", [1, 2])
def test_short_run_finishes_logs_checkpoints_and_learns(tmp_path, demo_model, world_size):
    steps = 30
    stdout, rows = run_demo(tmp_path, "--model", demo_model, "--steps", str(steps), "--eval-every", "10",
                            "--world-size", str(world_size))
    assert [r["step"] for r in rows] == list(range(1, steps + 1))   # one line per optimizer step
    for r in rows:
        assert all(k in r for k in REQUIRED), sorted(set(REQUIRED) - set(r))
        assert r["sync/logp_diff"] < 1e-3   # every push landed in vLLM
        assert 0 <= r["policy_lag"] <= 1
    evals = [(r["eval/step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    assert evals[0][0] == 0 and evals[-1][0] == steps
    reward = [r["reward/mean"] for r in rows]
    assert sum(reward[-10:]) / 10 > sum(reward[:10]) / 10 + 0.05, reward   # the reward goes up
    assert "held-out accuracy:" in stdout.splitlines()[-1]
    ckpt = tmp_path / f"step_{steps}"
    assert (ckpt / "config.json").exists() and (ckpt / "model.safetensors").exists()
    assert (ckpt / "tokenizer.json").exists()
    assert (tmp_path / "metrics.png").stat().st_size > 1000
