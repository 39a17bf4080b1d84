"""The benchmarks stay runnable: the GPU bench's tiny CPU mode end to end (real vLLM, real DeepSpeed), the overlap
report's arithmetic on a metrics file whose answer is known, and every bench script's --help."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
SCRIPTS = sorted(f for f in os.listdir(BENCH) if f.endswith(".py") and not f.startswith("_"))


def run(*args, timeout=600):   # gpu_bench.py gives its phases TORCH_EXTENSIONS_DIR itself, as the demo does
    p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def table_rows(out):
    """The data rows of the markdown table a bench prints last, as lists of cells."""
    lines = [line for line in out.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_bench_has_help(script):
    out = run(os.path.join("bench", script), "--help", timeout=120)
    assert "usage: " + script in out   # (deepspeed may print a warning first)


def test_gpu_bench_tiny_mode_runs_on_cpu():
    out = run("bench/gpu_bench.py", "--tiny", "--peak-tflops", "0.1")
    (row,) = table_rows(out)
    model, params, gen_tok_s, train_tok_s, mfu, gen_peak, train_peak = row
    assert model == "tiny" and 9 < float(params) < 11   # 151,936 x 64 embedding (tied) + two small layers
    assert float(gen_tok_s) > 0 and float(train_tok_s) > 0 and float(mfu) > 0
    assert float(gen_peak) > 100 and float(train_peak) > 100   # MiB: a process with torch loaded


def test_overlap_report_from_a_known_metrics_file(tmp_path):
    # 4 steps of 1 s each after a 10 s first step; the trainer waits 9 s in step 1, then 0.25 s per step
    rows = [{"step": 1, "time/elapsed_s": 10.0, "time/wait_s": 9.0, "time/gen_idle_s": 0.0, "eval/accuracy": 0.3}]
    rows += [{"step": s, "time/elapsed_s": 10.0 + s - 1, "time/wait_s": 0.25, "time/gen_idle_s": 0.5}
             for s in range(2, 6)]
    for r in rows:
        r.update({"time/gen_s": 0.5, "time/ref_s": 0.2, "time/train_s": 0.5, "time/sync_s": 0.05})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = run("bench/overlap.py", "--metrics", str(path), timeout=120)
    table = {r[0]: r[1:] for r in table_rows(out)}
    assert table["all steps (start-up included)"] == ["5", "14.0", "10.0", "71.4%", "2.00", "14.3%"]
    assert table["steady (step 2 on)"] == ["4", "4.0", "1.0", "25.0%", "2.00", "50.0%"]
    assert re.search(r"step 1\.000", out)


def test_trl_compare_uses_the_demo_settings():
    """The TRL comparison copies the demo's GRPO settings; it refuses to run if the demo's flags moved on."""
    sys.path.insert(0, BENCH)
    from trl_compare import check_our_flags
    check_our_flags()
