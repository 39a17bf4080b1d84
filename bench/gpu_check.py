"""What a GPU machine should prove, in one command (the aim: under 10 minutes on one H100-class GPU; --quick:
5 minutes from a cold start, for a short GPU lease):

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

After every run, one line each (the first thing to read on a new GPU machine): vLLM's version and how the
weights crossed (the run's start-up line), the push's seconds, the engine's sampled tokens/s in the run against
a standalone vLLM's on step 1's prompts (same model, memory share and sampling, no log-probs), the step's time
split, the training step's MFU (model FLOPs of the sequences trained per time/train_s, against 989 TFLOP/s) and
the GPU's peak memory in use (every process on it, read with nvidia-smi each second).

    python bench/gpu_check.py            # GPU; exits non-zero naming what failed
    python bench/gpu_check.py --quick    # GPU, <= 5 min: 0.5B shape, 5 steps, no gpu_bench.py
    python bench/gpu_check.py --shape qwen2.5-1.5b --steps 50    # the README recipe's shape at 1.5B
    python bench/gpu_check.py --quick --shape qwen2.5-1.5b --grad-ckpt   # 1.5B on one 80 GB GPU
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
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from _common import (ROOT, count, end_on_stops, fresh_out_dir, random_model, stop_at_random_lengths,
                     stop_run)
from gpu_bench import CONFIGS, train_flops
from plot import step_lines

# The GPU recipe's shape (docs/gpu.md); --tiny: small enough for a CPU, with every stage still run.
RECIPE = dict(steps=20, prompts_per_step=32, group_size=8, max_new_tokens=512, max_prompt_len=512,
              micro_batch=4, eval_size=100)
TINY = dict(steps=3, prompts_per_step=2, group_size=2, max_new_tokens=16, max_prompt_len=512, micro_batch=2,
            eval_size=4)
# --quick: 5 steps with a push each, small enough that a cold start and all fit 5 minutes on one H100
QUICK = dict(steps=5, prompts_per_step=16, group_size=8, max_new_tokens=256, max_prompt_len=512, micro_batch=8,
             eval_size=16)
H100_TFLOPS = 989.0   # H100 SXM, dense bf16


def build_model(path, config, s, gpu):
    """A random model of `config`'s shape with a tokenizer of its vocabulary, whose generation stops with
    probability about 2 / max_new_tokens per token (the module docstring says why)."""
    from demo.tiny_model import build_tokenizer
    vocab = CONFIGS[config]["vocab"]
    random_model(path, dtype="bfloat16" if gpu else "float32",
                 max_len=s["max_prompt_len"] + s["max_new_tokens"], **CONFIGS[config])
    tok = build_tokenizer(size=vocab)
    tok.save_pretrained(path)
    stop_at_random_lengths(path, tok.eos_token_id, tok.pad_token_id, vocab, s["max_new_tokens"])


def layout(gpus):
    """-> (generation GPU, reference GPU, training GPUs), as the machine counts them."""
    if gpus >= 3:
        return 0, 1, list(range(2, gpus))
    return 0, 0, [0]


def gen_mem(gpus):
    return "0.85" if gpus >= 3 else "0.3"


def run_grpo(a, s, model, out, gpus):
    """The run, one launch as docs/gpu.md's layouts start it: rank 0 starts the vLLM engine and the reference
    server, and every push goes through vLLM's weight-transfer API (NCCL with 3+ GPUs, CUDA IPC on one,
    gloo on CPU); its output goes on to the console -> (seconds taken, its start-up line's "vLLM V engine(s)
    on ..., weights by B")."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    deepspeed = shutil.which("deepspeed", path=os.path.dirname(sys.executable)) or "deepspeed"
    # the launcher's port, held until the run ends: the trainer's rendezvous binds it once it has started
    from placement import held_port   # here: placement imports torch, which --help need not wait for
    hold, port = held_port()
    train_cmd = [deepspeed, "--master_port", str(port), "grpo_train.py", "--model", model,
                 "--task", "countdown", "--rewards", "countdown,format:0.5", "--out-dir", out,
                 "--lr", str(a.lr), "--beta", "0.04", "--eval-every", "25",
                 "--save-every", "50", "--sync-tol", str(a.sync_tol),
                 "--overlong-buffer", str(s["max_new_tokens"] - 1)]
    train_cmd += [arg for k, v in s.items() for arg in (f"--{k.replace('_', '-')}", str(v))]
    train_cmd += ["--grad-ckpt"] * a.grad_ckpt
    if gpus:
        gen, ref, train = layout(gpus)
        train_cmd[1:1] = ["--include", "localhost:" + ",".join(map(str, train))]
        train_cmd += ["--gen-device", str(gen), "--ref-device", str(ref), "--gen-mem", gen_mem(gpus)]
    else:   # the launcher needs --num_gpus on a CPU machine; one thread per process on shared cores
        train_cmd[1:1] = ["--num_gpus", "1"]
        train_cmd += ["--threads", "1", "--ref-device", "cpu"]
    print("gpu_check:", " ".join(train_cmd), flush=True)
    t, said = time.time(), None
    run = subprocess.Popen(train_cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        for line in run.stdout:
            print(line, end="", flush=True)
            said = said or re.search(r"vLLM \S+ engines? on [^;]*, weights by \w+", line)
        run.wait()
    finally:
        # a stop or an error here: the launcher's whole group, waited for (deepspeed's runner ends at
        # once, its launch.py stops the ranks after it)
        stop_run(run)
        hold.close()
    if run.returncode:
        raise SystemExit(f"gpu_check: grpo_train.py failed (exit code {run.returncode}); its output is above")
    return time.time() - t, said.group(0) if said else "vLLM ? (no start-up line seen)"


class PeakMemory(threading.Thread):
    """The most memory in use on GPU 0 (every process on it), read with nvidia-smi every second."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.total, self.done = None, None, threading.Event()
        if shutil.which("nvidia-smi"):
            self.start()

    def run(self):
        query = ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits", "-i", "0"]
        while not self.done.wait(1.0):
            try:
                used, total = map(float, subprocess.run(query, capture_output=True, text=True, timeout=10,
                                                        check=True).stdout.split(","))
            except (subprocess.SubprocessError, ValueError):
                continue
            self.peak, self.total = max(self.peak or 0, used), total

    def line(self):
        self.done.set()
        if self.peak is None:
            return "n/a (no GPU, or no nvidia-smi)"
        return f"{self.peak / 1024:.1f} GiB of {self.total / 1024:.1f} GiB in use on GPU 0 (every process on it)"


def step_one_prompts(train_cmd_flags, model):
    """Step 1's prompts, as the run drew them (run_setup.load_prompts, engine_process.shares_of_blocks)."""
    from transformers import AutoTokenizer
    from engine_process import shares_of_blocks
    from grpo_train import get_args
    from run_setup import load_prompts
    args = get_args(["--model", model, *train_cmd_flags])
    train_set = load_prompts(AutoTokenizer.from_pretrained(model), **vars(args))[0]
    first = next(shares_of_blocks(len(train_set), args.seed, 0, args.prompts_per_step,
                                  list(range(args.prompts_per_step))))
    return [train_set[i]["prompt_ids"] for i in first], args


def standalone_tok_s(model, prompts, args, gpus):
    """A standalone vLLM (a plain LLM(): no log-probs) sampling `prompts` as the run's engine does, in this
    process once the run has ended -> sampled tokens/s of one call (after a warm-up call)."""
    import torch
    from engine_process import engine_environment, quiet_vllm_console
    cpu = not torch.cuda.is_available()
    # the environment the run's engine on GPU 0 (or the CPU) was spawned with, set before vLLM is imported
    os.environ.update(engine_environment(0, 1, 1, cpu))
    from vllm import LLM, SamplingParams
    if cpu:   # as the run's engine (--threads 1)
        torch.set_num_threads(1)
    llm = LLM(model, seed=args.seed, dtype="float32" if cpu else "bfloat16", enforce_eager=cpu,
              max_model_len=args.max_prompt_len + args.max_new_tokens,
              gpu_memory_utilization=float(gen_mem(gpus)) if gpus else 0.9, **quiet_vllm_console(model))
    params = lambda n: SamplingParams(n=args.group_size, temperature=args.temperature, max_tokens=n,
                                      detokenize=False)
    batch = [{"prompt_token_ids": ids} for ids in prompts]
    llm.generate(batch[:2], params(2), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(batch, params(args.max_new_tokens), use_tqdm=False)
    tok_s = sum(len(c.token_ids) for o in outs for c in o.outputs) / (time.perf_counter() - t)
    # vLLM's teardown of the process group it made in this process: else, on a GPU, torch warns at exit
    # that it was never destroyed (seen on one H200), after the check's last line
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    del llm
    cleanup_dist_env_and_memory()
    return tok_s


def mfu_line(rows, model, prompts, group_size, gpus):
    """The training step's model FLOPs (gpu_bench.train_flops: the sequences trained, batch/groups x group size,
    of the mean prompt length of step 1's prompts and the step's mean completion length) per time/train_s."""
    from safetensors import safe_open
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    with safe_open(os.path.join(model, "model.safetensors"), "pt") as f:
        body = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if "embed_tokens" not in k
                   and "lm_head" not in k)
    prompt_len = sum(map(len, prompts)) / len(prompts)
    rest = rows[1:] or rows
    flops = sum(train_flops(body, config["hidden_size"], config["vocab_size"], r["batch/groups"] * group_size,
                            prompt_len, r["completion_len/mean"]) for r in rest)
    tflop_s = flops / sum(r["time/train_s"] for r in rest) / 1e12
    mfu = f"{100 * tflop_s / H100_TFLOPS:.1f}% of {H100_TFLOPS:g} TFLOP/s" if gpus else "n/a on CPU"
    return f"{mfu} ({tflop_s:.4g} TFLOP/s: model FLOPs of the sequences trained, steps {rest[0]['step']}.., " \
           f"per time/train_s)"


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
    rows = step_lines(os.path.join(out, "metrics.jsonl"))
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
    return rows, (f"{len(rows)} steps; sync/logp_diff max {max(r['sync/logp_diff'] for r in rows):.3g} "
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
    p.add_argument("--quick", action="store_true",
                   help="at most 5 minutes on one GPU from a cold start: 5 smaller steps, no gpu_bench.py")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "gpu_check"),
                   help="model, run and logs (emptied first: new, empty, or a bench script's)")
    p.add_argument("--lr", type=float, default=1e-6, help="the recipe's learning rate")
    p.add_argument("--sync-tol", type=float, default=0.1,
                   help="largest sync/logp_diff allowed (the trainer's default)")
    p.add_argument("--no-bench", action="store_true", help="skip bench/gpu_bench.py")
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b", "qwen2.5-1.5b"],
                   help="the random model's shape (GPU)")
    p.add_argument("--steps", type=count, help="GRPO steps (default: 20; --tiny: 3; --quick: 5)")
    p.add_argument("--grad-ckpt", action="store_true",
                   help="train with gradient checkpointing (docs/gpu.md: the 1.5B shape on one 80 GB GPU)")
    a = p.parse_args()
    # `timeout`, `kill` or a closed ssh session end the check through the `finally`s below, which
    # stop the GRPO run (its launcher has a session of its own: no signal to this one reaches it)
    # and the bench
    end_on_stops()
    try:
        import torch
    except ImportError:   # make gpu-check runs the python of the shell, which may lack the requirements
        raise SystemExit(f"gpu_check: this python ({sys.executable}) has no torch: install the GPU requirements "
                         f"into it (pip install -r requirements.txt), or activate the environment that has them"
                         ) from None
    # on a machine without a GPU: one line, not minutes of a 0.5B model on the CPU
    if not a.tiny and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no GPU here (torch sees none): this check is for a GPU machine; on a CPU "
                         "machine, python bench/gpu_check.py --tiny runs its stages at tiny shapes, and make "
                         "test runs the tests")
    gpus = torch.cuda.device_count()
    s, config = (dict(TINY), "tiny") if a.tiny else (dict(QUICK if a.quick else RECIPE), a.shape)
    s["steps"] = a.steps or s["steps"]
    t0 = time.time()
    # a fresh run: the checks read this run's metrics only (a foreign folder: refused at once)
    out = fresh_out_dir(a.out_dir, "gpu_check")
    model = os.path.join(out, "model")
    bench = None
    try:
        if not (a.no_bench or a.quick):
            cmd = [sys.executable, "bench/gpu_bench.py"]
            cmd += ["--tiny", "--peak-tflops", "0.1"] if a.tiny else ["--models", config]
            print("gpu_check:", " ".join(cmd), flush=True)
            # on a GPU it runs first and alone (its numbers are measurements); --tiny, a smoke run
            # on CPU, beside the GRPO run (both mostly wait on imports there), its output held until
            # it ends
            held = tempfile.TemporaryFile("w+") if a.tiny else None
            bench = subprocess.Popen(cmd, cwd=ROOT, stdout=held), held
            if not a.tiny:
                finish_bench(*bench)
                bench = None
        memory = PeakMemory()
        build_model(model, config, s, gpus > 0)
        took, engines = run_grpo(a, s, model, os.path.join(out, "run"), gpus)
        peak = memory.line()
        if bench is not None:
            finish_bench(*bench)
    finally:
        # a failed run or a stop does not leave the bench running (SIGTERM: it stops its own phases)
        if bench is not None and bench[0].poll() is None:
            bench[0].terminate()
            bench[0].wait()
    rows, summary = check_run(os.path.join(out, "run"), model, s["steps"], a.sync_tol)
    flags = [arg for k, v in s.items() for arg in (f"--{k.replace('_', '-')}", str(v))]
    prompts, args = step_one_prompts(["--task", "countdown", *flags], model)
    alone = standalone_tok_s(model, prompts, args, gpus)
    rest = rows[1:] or rows
    in_run = sum(r["gen/samples"] * r["completion_len/mean"] for r in rest) / sum(r["time/gen_s"] for r in rest)
    import vllm
    print(f"gpu_check vLLM: {vllm.__version__}, torch {torch.__version__}; the run's {engines}", flush=True)
    pushes = [r["time/push_s"] for r in rest if r.get("time/push_s") is not None]
    print(f"gpu_check push: {sum(pushes) / max(1, len(pushes)):.3f} s a push on its thread (time/push_s), "
          f"{sum(r['time/sync_s'] for r in rest) / len(rest):.3f} s of it on the trainer's path (time/sync_s), "
          f"means of steps {rest[0]['step']}..{rest[-1]['step']}", flush=True)
    print(f"gpu_check generation: {in_run:.0f} sampled tok/s in the run, {alone:.0f} standalone on step 1's "
          f"{len(prompts)} prompts x {args.group_size} ({100 * in_run / alone:.0f}%)", flush=True)
    print(f"gpu_check training MFU: {mfu_line(rows, model, prompts, args.group_size, gpus)}", flush=True)
    print(f"gpu_check peak memory: {peak}", flush=True)
    print(f"gpu_check OK: {summary}; GRPO run {took:.0f} s, all {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
