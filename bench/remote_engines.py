"""Local engines against the same number of vLLM servers (grpo_train.py --gen-devices against --gen-urls), in one
run on CPU: seconds a step, push time, generation time, on the demo's model and settings.

    python bench/remote_engines.py                         # 2 engines, 20 steps a run, 2 rounds
    python bench/remote_engines.py --engines 1 --rounds 3
    python bench/remote_engines.py --worker-process        # each server's worker in a process of its own

It starts --engines vLLM servers by docs/gpu.md's CPU line (python -m vllm.entrypoints.openai.api_server, the worker
in the engine's process, a 1 GiB KV cache, --threads threads), then runs the demo's GRPO run (the deepspeed launcher,
--beta 0.04, the same seed) on local engines and on the servers, alternating, --rounds times each, and reads each
run's metrics.jsonl: medians over steps 2.. of the step (time/wait_s + time/train_s + time/sync_s), the push
(time/sync_s), an engine's share of a batch (time/gen_s: the slowest engine's sampling and scoring), and the
held-out accuracy at the last step. Then, with no run going, one engine's share alone, in this process: rollout's
generate call (8 prompts x 8 completions of exactly 1, then 12 tokens) --reps times on a local vLLM engine (in this
process, as an engine process runs it) and through remote_engine.ServerLLM on a server, alternating: what a
share costs once, and what each decoded token adds.
"""
import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# vLLM's sampler helpers eager, in this process's engine and the servers, as in docs/gpu.md's CPU line and a
# CPU engine's process (engine_process.engine_environment)
os.environ["TORCHDYNAMO_DISABLE"] = "1"
from _common import ROOT, count, demo_model, end_on_stops, machine, print_table, run_to_end  # noqa: E402

OUT = os.path.join(ROOT, "runs", "bench", "remote_engines")
SERVER_FLAGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "64", "--logprobs-mode",
                "processed_logprobs", "--weight-transfer-config", '{"backend": "gloo"}', "--worker-extension-cls",
                "vllm_extension.TrainerExtension"]


def start_servers(model, n, threads, worker_process, procs):
    """n vLLM servers on loopback, each in a process group of its own, put in `procs` as each starts
    (the caller stops them, however this ends) -> their URLs, once up."""
    import requests
    from placement import free_port
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": str(int(worker_process)),
           "PYTHONPATH": ROOT, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": "1"}
    urls = []
    for i in range(n):
        port = free_port()
        log = open(os.path.join(OUT, f"server{i}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                       "--port", str(port), *SERVER_FLAGS], cwd=ROOT, env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
        urls.append(f"http://127.0.0.1:{port}")
    for proc, url in zip(procs, urls):
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the vLLM server at {url} exited: runs/bench/remote_engines/server*.log")
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
    return urls


def run(model, name, steps, engines_flags):
    """The demo's run through the deepspeed launcher -> its metrics rows."""
    from demo.run_demo import TRAIN_FLAGS
    from placement import free_port
    from plot import step_lines
    out = os.path.join(OUT, name)
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [deepspeed, "--num_gpus", "1", "--master_port", str(free_port()), "grpo_train.py", "--model", model,
           "--out-dir", out, "--steps", str(steps), "--eval-every", str(steps), "--seed", "0", "--overwrite",
           *TRAIN_FLAGS, *engines_flags]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    print(f"running {name}: {' '.join(cmd[5:])}", flush=True)
    run_to_end(cmd, os.path.join(OUT, f"{name}.log"), "remote_engines.py", f"the {name} run", cwd=ROOT,
               env={**env, "DS_ACCELERATOR": "cpu"})
    return step_lines(os.path.join(out, "metrics.jsonl"))


def lost(line):
    raise SystemExit(f"bench: {line}")


def share_alone(model, url, reps):
    """rollout's generate call for one engine's share of a demo batch (8 prompts x 8 completions of exactly
    1 and 12 tokens), alternating a local engine and the server -> {(side, tokens): median s}."""
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from remote_engine import ServerLLM
    from tasks import drop_long_prompts, load_task
    torch.set_num_threads(1)
    samples = drop_long_prompts(load_task("demo", "train")[:8], AutoTokenizer.from_pretrained(model), 16)[0]
    prompts = [{"prompt_token_ids": s["prompt_ids"]} for s in samples]
    sides = {"local": LLM(model, dtype="float32", enforce_eager=True, seed=0, max_model_len=64,
                          logprobs_mode="processed_logprobs"), "server": ServerLLM(url, 1, model, 60, 0, lost)}
    times = {}
    for tokens in (1, 12):
        params = SamplingParams(n=8, temperature=1.0, max_tokens=tokens, ignore_eos=True, logprobs=0,
                                detokenize=False)
        for rep in range(reps + 1):
            for side, llm in sides.items():
                t = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                if rep:   # the first of each is a warm-up
                    times.setdefault((side, tokens), []).append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="warm-started model (default: the demo's, built once into runs/bench)")
    p.add_argument("--engines", type=count, default=2, help="engines on each side: local ones, then servers")
    p.add_argument("--steps", type=count, default=20, help="steps of each run")
    p.add_argument("--rounds", type=count, default=2, help="runs on each side, alternating local and servers")
    p.add_argument("--reps", type=count, default=30, help="generate calls timed on each side (share of a batch)")
    p.add_argument("--threads", type=count, default=1, help="torch threads of each engine and each server")
    p.add_argument("--worker-process", action="store_true",
                   help="servers with their worker in a process of its own (vLLM's CPU default), not in the engine's")
    a = p.parse_args()
    model = os.path.abspath(demo_model(a.model))
    os.makedirs(OUT, exist_ok=True)
    load = os.getloadavg()[0]
    # a stop (SIGTERM, Ctrl-C) or a server dying at its start ends the servers (the `finally`) and the run going
    # (run_to_end)
    end_on_stops()
    procs = []
    try:
        urls = start_servers(model, a.engines, a.threads, a.worker_process, procs)
        sides = {"local": ["--gen-devices", ",".join(map(str, range(a.engines)))],
                 "servers": ["--gen-urls", ",".join(urls)]}
        rows = {side: [] for side in sides}
        accuracy = {side: [] for side in sides}
        for r in range(a.rounds):
            for side, flags in sides.items():
                got = run(model, f"{side}{r}", a.steps, [*flags, "--threads", str(a.threads)])
                rows[side] += got[1:]
                accuracy[side].append(got[-1]["eval/accuracy"])
        alone = share_alone(model, urls[0], a.reps)
    finally:
        for proc in procs:
            # a server that died at its start was collected, its group maybe gone
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    median = lambda side, key: statistics.median(key(row) for row in rows[side])
    metrics = [("step (wait + train + sync), s", lambda r: r["time/wait_s"] + r["time/train_s"] + r["time/sync_s"]),
               ("push (time/sync_s), s", lambda r: r["time/sync_s"]),
               ("share of a batch (time/gen_s), s", lambda r: r["time/gen_s"]),
               ("reference (time/ref_s), s", lambda r: r["time/ref_s"])]
    table = [[name, f"{median('local', key):.3f}", f"{median('servers', key):.3f}",
              f"{median('servers', key) / median('local', key):.2f}x"] for name, key in metrics]
    table.append(["held-out accuracy at the last step", " ".join(f"{x:.3f}" for x in accuracy["local"]),
                  " ".join(f"{x:.3f}" for x in accuracy["servers"]), ""])
    for tokens in (1, 12):
        local, server = alone["local", tokens], alone["server", tokens]
        table.append([f"share alone, 8 x 8 completions of {tokens} token{'s' * (tokens > 1)}, s", f"{local:.4f}",
                      f"{server:.4f}", f"{server / local:.2f}x"])
    per_token = {side: (alone[side, 12] - alone[side, 1]) / 11 for side in ("local", "server")}
    table.append(["share alone, each decoded token after the first, s", f"{per_token['local']:.4f}",
                  f"{per_token['server']:.4f}", f"{per_token['server'] / per_token['local']:.2f}x"])
    worker = "in a process of its own" if a.worker_process else "in the engine's process"
    print(f"\n{machine()}; load average {load:.2f} before; {a.engines} engine(s) a side (the servers' worker "
          f"{worker}), {a.rounds} run(s) of {a.steps} steps each, medians over steps 2..{a.steps} of all runs; "
          f"alone: median of {a.reps}")
    print_table(["", "local engines", "vLLM servers", "servers / local"], table)


if __name__ == "__main__":
    main()
