"""What a GPU machine should prove, in one command (the aim: under 10 minutes on one H100-class GPU):

1. bench/gpu_bench.py at the model's shape (vLLM sampling standalone and as the generation process runs
   it, and the ZeRO-2 training step: tokens/s, MFU, peak memory);
2. --steps (20) GRPO steps of the GPU recipe's shape (docs/gpu.md: 32 prompts x 8 completions, 512 + 512
   tokens, micro-batch 4, beta 0.04, lr 1e-6, a checkpoint at the end; 100 held-out prompts, not 500) on a
   randomly initialised model of --shape (Qwen2.5-0.5B's unless given; no download), one launch as the
   recipe's (rank 0 starts the vLLM engine and the reference server; every push through vLLM's
   weight-transfer API: NCCL with 3+ GPUs, CUDA IPC on one), then checks on the trainer's metrics.jsonl:
   every step's `sync/logp_diff` (vLLM's probe log-probs against the trainer's after the weight push) is at
   most --sync-tol, every loss and gradient norm is finite, at least one step trained, and the saved weights differ from the starting ones. (At lr 1e-6 a
   step moves the weights too little for an engine left with the old ones to fail the probe:
   tests/test_vllm.py shows that a stale engine fails.) Then `gpu_check phases`: the step's time/* split, the
   push's share of it, the engine's times and its sampled tokens/s inside the run.

    python bench/gpu_check.py            # GPU; exits non-zero naming what failed
    python bench/gpu_check.py --shape qwen2.5-1.5b --steps 50    # the README recipe's shape at 1.5B
    python bench/gpu_check.py --tiny     # CPU, tiny shapes, 3 steps (tests/test_bench.py)

GPUs: with 3 or more, GPU 0 generates, GPU 1 holds the reference model and the rest train (the recipe's
layout); with fewer, everything shares GPU 0 (--gen-mem 0.3 leaves room for the other two; the push goes
by CUDA IPC).

The task is countdown (generated offline; prompts through the chat template). A random model never earns a
task reward, so every group would have equal rewards and no step would train; instead its generation config
lists enough extra stop tokens that completions end at random lengths (about half the limit on average), and
DAPO's overlong penalty over the whole length (--overlong-buffer = --max-new-tokens - 1) makes each
completion's reward depend on its length: every group has signal and every step trains.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

from _common import ROOT, random_model, stop_at_random_lengths
from gpu_bench import CONFIGS, VOCAB
from placement import free_port

# The GPU recipe's shape (docs/gpu.md); --tiny: small enough for a CPU, with every stage still run.
RECIPE = dict(steps=20, prompts_per_step=32, group_size=8, max_new_tokens=512, max_prompt_len=512,
              micro_batch=4, eval_size=100)
TINY = dict(steps=3, prompts_per_step=2, group_size=2, max_new_tokens=16, max_prompt_len=512, micro_batch=2,
            eval_size=4)


def build_model(path, config, s, gpu):
    """A random model of `config`'s shape with a tokenizer of its vocabulary, whose generation stops with
    probability about 2 / max_new_tokens per token (the module docstring says why)."""
    from demo.tiny_model import build_tokenizer
    random_model(path, dtype="bfloat16" if gpu else "float32", vocab=VOCAB,
                 max_len=s["max_prompt_len"] + s["max_new_tokens"], **CONFIGS[config])
    tok = build_tokenizer(size=VOCAB)
    tok.save_pretrained(path)
    stop_at_random_lengths(path, tok.eos_token_id, tok.pad_token_id, VOCAB, s["max_new_tokens"])


def layout(gpus):
    """-> (generation GPU, reference GPU, training GPUs), as the machine counts them."""
    if gpus >= 3:
        return 0, 1, list(range(2, gpus))
    return 0, 0, [0]


def run_grpo(a, s, model, out, gpus):
    """The run, one launch as docs/gpu.md's layouts start it: rank 0 starts the vLLM engine and the reference
    server, and every push goes through vLLM's weight-transfer API (NCCL with 3+ GPUs, CUDA IPC on one,
    gloo on CPU); -> seconds taken."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                  os.path.join(sys.prefix, "torch_extensions"))}
    deepspeed = shutil.which("deepspeed", path=os.path.dirname(sys.executable)) or "deepspeed"
    train_cmd = [deepspeed, "--master_port", str(free_port()), "grpo_train.py", "--model", model,
                 "--task", "countdown", "--rewards", "countdown,format:0.5", "--out-dir", out,
                 "--lr", str(a.lr), "--beta", "0.04", "--eval-every", "25",
                 "--save-every", "50", "--sync-tol", str(a.sync_tol),
                 "--overlong-buffer", str(s["max_new_tokens"] - 1)]
    train_cmd += [arg for k, v in s.items() for arg in (f"--{k.replace('_', '-')}", str(v))]
    if gpus:
        gen, ref, train = layout(gpus)
        train_cmd[1:1] = ["--include", "localhost:" + ",".join(map(str, train))]
        train_cmd += ["--gen-device", str(gen), "--ref-device", str(ref), "--gen-mem", "0.85" if gpus >= 3 else "0.3"]
    else:   # the launcher needs --num_gpus on a CPU machine; one thread per process on shared cores
        train_cmd[1:1] = ["--num_gpus", "1"]
        train_cmd += ["--threads", "1", "--ref-device", "cpu"]
    print("gpu_check:", " ".join(train_cmd), flush=True)
    t = time.time()
    run = subprocess.Popen(train_cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        run.wait()
    finally:
        if run.poll() is None:   # the launcher's whole group: deepspeed's runner does not pass signals on
            os.killpg(run.pid, 15)
            run.wait(timeout=60)
    if run.returncode:
        raise SystemExit(f"gpu_check: grpo_train.py failed (exit code {run.returncode}); its output is above")
    return time.time() - t


def phases(rows):
    """The run's step phases (time/*, the mean over steps 2.., the first holds compilation), the weight push's
    share of the step, and the engine's sampling tokens/s inside the run."""
    rest = rows[1:] or rows
    mean = lambda k: sum(r.get(k) or 0 for r in rest) / len(rest)
    step = mean("time/wait_s") + mean("time/train_s") + mean("time/sync_s")
    tokens = sum(r["gen/samples"] * r["completion_len/mean"] for r in rest)
    gen_s = sum(r["time/gen_s"] for r in rest)
    return (f"gpu_check phases (mean of steps {rest[0]['step']}..{rest[-1]['step']}): step {step:.3f} s = "
            + " + ".join(f"{k} {mean(k):.3f}" for k in ("time/wait_s", "time/train_s", "time/sync_s"))
            + f"; push share {100 * mean('time/sync_s') / step:.1f}%; engine: "
            + ", ".join(f"{k} {mean(k):.3f}" for k in ("time/gen_s", "time/gen_idle_s", "time/ref_s"))
            + f", {tokens / gen_s:.0f} sampled tok/s in the run")


def check_run(out, model, steps, tol):
    """-> the summary line; raises SystemExit naming the first thing that is wrong."""
    from safetensors.torch import load_file
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    problems = []
    if [r["step"] for r in rows] != list(range(1, steps + 1)):
        problems.append(f"metrics.jsonl has steps {[r['step'] for r in rows]}, not 1..{steps}")
    for r in rows:
        if not r["sync/logp_diff"] <= tol:   # `not <=`: a NaN fails too
            problems.append(f"step {r['step']}: sync/logp_diff {r['sync/logp_diff']} > {tol}: "
                            f"the weights did not land")
        if not (math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])):
            problems.append(f"step {r['step']}: loss {r['loss']}, grad_norm {r['grad_norm']}")
    if not any(r["grad_norm"] > 0 for r in rows):
        problems.append("no step trained (every gradient norm is 0: no group had reward signal)")
    start, end = load_file(os.path.join(model, "model.safetensors")), load_file(
        os.path.join(out, f"step_{steps}", "model.safetensors"))
    moved = max((end[k].float() - start[k].float()).abs().max().item() for k in start)
    if not moved > 0:
        problems.append(f"the checkpoint of step {steps} holds the starting weights")
    if problems:
        raise SystemExit("gpu_check FAILED: " + "; ".join(problems))
    losses = [r["loss"] for r in rows]
    print(phases(rows), flush=True)
    return (f"{len(rows)} steps; sync/logp_diff max {max(r['sync/logp_diff'] for r in rows):.3g} "
            f"(tol {tol}); loss {min(losses):+.4g} .. {max(losses):+.4g}; steps that trained "
            f"{sum(r['grad_norm'] > 0 for r in rows)}; largest weight change {moved:.3g}")


def finish_bench(proc, held):
    """Wait for bench/gpu_bench.py, print its output `held` back in a file (if any), stop if it failed."""
    proc.wait()
    if held is not None:
        held.seek(0)
        print(held.read(), end="", flush=True)
    if proc.returncode:
        raise SystemExit("gpu_check FAILED: bench/gpu_bench.py (its output is above)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes and 3 steps, on CPU (the test suite)")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "gpu_check"), help="model, run and logs")
    p.add_argument("--lr", type=float, default=1e-6, help="the recipe's learning rate")
    p.add_argument("--sync-tol", type=float, default=0.1,
                   help="largest sync/logp_diff allowed (the trainer's default)")
    p.add_argument("--no-bench", action="store_true", help="skip bench/gpu_bench.py")
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b", "qwen2.5-1.5b"],
                   help="the random model's shape (GPU)")
    p.add_argument("--steps", type=int, help="GRPO steps (default: 20; --tiny: 3)")
    a = p.parse_args()
    import torch
    # on a machine without a GPU: one line, not minutes of a 0.5B model on the CPU
    if not a.tiny and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no GPU here (torch sees none): this check is for a GPU machine; on a CPU "
                         "machine, python bench/gpu_check.py --tiny runs its stages at tiny shapes, and make "
                         "test runs the tests")
    gpus = torch.cuda.device_count()
    s, config = (dict(TINY), "tiny") if a.tiny else (dict(RECIPE), a.shape)
    s["steps"] = a.steps or s["steps"]
    t0 = time.time()
    bench = None
    if not a.no_bench:
        cmd = [sys.executable, "bench/gpu_bench.py"] + (["--tiny", "--peak-tflops", "0.1"] if a.tiny else
                                                        ["--models", config])
        print("gpu_check:", " ".join(cmd), flush=True)
        # on a GPU it runs first and alone (its numbers are measurements); --tiny, a smoke run on CPU, beside
        # the GRPO run (both mostly wait on imports there), its output held until it ends
        held = tempfile.TemporaryFile("w+") if a.tiny else None
        bench = subprocess.Popen(cmd, cwd=ROOT, stdout=held), held
        if not a.tiny:
            finish_bench(*bench)
            bench = None
    out = os.path.abspath(a.out_dir)
    shutil.rmtree(out, ignore_errors=True)   # a fresh run: the checks read this run's metrics only
    model = os.path.join(out, "model")
    try:
        build_model(model, config, s, gpus > 0)
        took = run_grpo(a, s, model, os.path.join(out, "run"), gpus)
    except BaseException:   # --tiny: a failed run does not leave the bench running behind it
        if bench is not None:
            bench[0].kill()
        raise
    if bench is not None:
        finish_bench(*bench)
    print(f"gpu_check OK: {check_run(os.path.join(out, 'run'), model, s['steps'], a.sync_tol)}; "
          f"GRPO run {took:.0f} s, all {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
