"""Where one steady-state step of the demo goes, in each of its three processes: the trainer rank, the vLLM
generation process and the reference server.

It runs demo/run_demo.py (no evaluation until the last step), waits until the run is past --warm-steps, then
samples all three processes at once with py-spy (wall-clock samples, idle ones included, without pausing
them) for --seconds. Every sample of a thread that does the process's work is put in the first category
whose frames all appear in its stack; a category's share of the samples times the window's wall time,
divided by the steps the trainer finished in the window, is its milliseconds per step. So each process's
rows sum to the wall time of one step, waits included: what a process waits on is a row of its own.

    .venv/bin/python bench/profile_step.py                    # ~2 min: 400 steps, a 20 s window
    .venv/bin/python bench/profile_step.py -- --max-staleness 2   # extra grpo_train.py flags after --
    .venv/bin/python bench/profile_step.py --rate 0 --steps 60 --warm-steps 2 --seconds 2   # CPU alone

It also prints each process's CPU time per step over the window (psutil, threads included) and their sum
against what the machine's cores could give in that time. py-spy itself takes CPU from the processes it
samples (on two cores, a share that shows): --rate 0 leaves it out, for the CPU line alone.

py-spy (requirements-dev.txt) reads the processes' memory from outside; as root it needs no set-up.
"""
import argparse
import collections
import json
import math
import os
import subprocess
import sys
import time

import psutil

from _common import count, end_on_stops, fresh_out_dir, model_given, stop_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (row, frames that must all be in the stack): first match wins, so the specific rows come first.
TRAINER = [
    ("push: trainer's probe forward", ["push_weights", "completion_logps"]),
    ("push: vLLM's weight transfer, watched", ["push_weights", "_watched"]),
    ("push: opening the transfer, probe message", ["push_weights"]),
    ("batch: waiting for it, unpickling it", ["next_batch"]),
    ("batch: JSON broadcast to the ranks", ["broadcast_json"]),
    ("reference: HTTP round trip (encode, server, decode)", ["ref_logps"]),
    ("train: collate (pad, tensors)", ["collate"]),
    ("train: forward (log-probs)", ["train_step", "completion_logps"]),
    ("train: loss", ["grpo_loss"]),
    ("train: backward", ["train_step", "backward"]),
    ("train: optimizer step", ["train_step", "DeepSpeedEngine.step"]),
    ("train: other (grad norm, stats)", ["train_step"]),
    ("train: stats all-reduce", ["reduce_stats"]),
    ("train: micro-batches, normaliser", ["main (grpo_train.py"]),
]
GENERATION = [
    ("weights: receive (broadcast)", ["receive_weights"]),
    ("weights: CPU lm_head repack", ["repack_cpu_lm_head"]),
    ("weights: prefix cache reset", ["reset_prefix_cache"]),
    ("weights: vLLM weight-transfer calls", ["apply_transfer"]),
    ("weights: probe, vLLM prompt log-probs", ["vllm_probe_logps"]),
    ("weights: probe check", ["check_probe"]),
    ("eval", ["held_out_eval"]),
    ("rollout: sampling (vLLM generate)", ["rollout", "LLM.generate"]),
    ("rollout: rewards", ["rollout", "score"]),
    ("rollout: overlong penalty", ["rollout", "overlong_penalty"]),
    ("rollout: advantages", ["rollout", "advantages"]),
    ("rollout: metrics", ["rollout", "rollout_metrics"]),
    ("rollout: old log-probs, batch lists", ["rollout"]),
    ("results: queue put", ["_serve", "Queue.put"]),
    ("idle: waiting for a request", ["_serve", "Queue.get"]),
    ("loop: other", ["_serve"]),
]
REFERENCE = [
    ("request: decode", ["decode_request"]),
    ("forward: padding, log-probs", ["compute_logps"]),
    ("response: encode", ["encode_response"]),
    ("request: HTTP, WSGI (waitress's task threads)", ["handler_thread"]),
    ("idle: waiting for a connection", ["loop"]),
]
# threads whose samples are work on the process's behalf (others, like tqdm's monitor, only sleep)
FEEDER = ("queue feeder thread: pickling, pipe write", ["Queue._feed", "send_bytes"])


def classify(stack, rows):
    unwound = "unattributed (py-spy lost the stack)"
    return next((name for name, frames in rows if all(f in stack for f in frames)), unwound)


def profile(raw_path, rows, threads):
    """py-spy raw output -> {row: samples}, for the threads whose names start with one of `threads`."""
    counts = collections.Counter()
    with open(raw_path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            thread = stack.split(";", 1)[0].partition(": ")[2]   # "thread (TID): NAME;frames..."
            if stack and thread.startswith("MainThread") and "MainThread" in threads:
                counts[classify(stack, rows)] += int(n)
            elif "QueueFeederThread" in thread and "feeder" in threads and all(f in stack for f in FEEDER[1]):
                counts[FEEDER[0]] += int(n)
            elif "handler_thread" in stack and "handler" in threads:
                counts[classify(stack, rows)] += int(n)
    return counts


def find(what, pred, demo, log, timeout=300):
    """The process `pred` picks, once the demo has started it; one line if the demo ends first (a
    failed start-up) or after `timeout` seconds."""
    t = time.time()
    while time.time() - t < timeout:
        if demo.poll() is not None:
            raise SystemExit(f"profile_step.py: the demo exited (code {demo.returncode}) before "
                             f"its {what} started: {log}")
        for p in psutil.process_iter(["pid", "cmdline"]):
            if pred(" ".join(p.info["cmdline"] or []), p):
                return p
        time.sleep(0.5)
    raise SystemExit(f"profile_step.py: no {what} process after {timeout} s: {log}")


def cpu_seconds(procs):
    """{name: pid} -> {name: user + system CPU seconds so far, all of its threads}."""
    return {name: sum(psutil.Process(pid).cpu_times()[:2]) for name, pid in procs.items()}


def last_step(path):
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        steps = [r["step"] for r in map(json.loads, f) if "time/train_s" in r]
    return steps[-1] if steps else 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=count, default=400, help="demo steps (the window must end before the run)")
    p.add_argument("--warm-steps", type=int, default=30, help="start sampling after this step")
    p.add_argument("--seconds", type=float, default=20, help="sampling window")
    p.add_argument("--rate", type=int, default=200,
                   help="py-spy samples per second per process (0: no py-spy, the CPU line alone)")
    p.add_argument("--model", default="runs/demo/model", help="warm-started demo model (make demo builds it)")
    p.add_argument("--out-dir", default="runs/profile_step",
                   help="the run and the raw py-spy files (emptied first: new, empty, or a bench "
                        "script's)")
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    model_given(a.model, "profile_step.py")
    out = fresh_out_dir(a.out_dir, "profile_step.py", keep=[a.model])
    end_on_stops()
    metrics = os.path.join(out, "metrics.jsonl")
    cmd = [sys.executable, "-m", "demo.run_demo", "--model", a.model, "--out-dir", out, "--steps", str(a.steps),
           "--eval-every", str(10 * a.steps), "--", *extra]
    # this run's processes, not another run's: their command lines name its folder
    ours = lambda c: f" {out} " in f" {c} "
    with open(os.path.join(out, "stdout.log"), "w") as log:
        # a session of its own: a terminal's Ctrl-C reaches this script, which stops the demo once
        demo, spies = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True), {}
        try:
            rank = lambda c, _: "grpo_train.py --local_rank" in c and ours(c)
            trainer = find("trainer", rank, demo, log.name)
            served = lambda c, _: "ref_server.py" in c and ours(c)
            ref = find("reference server", served, demo, log.name)
            while last_step(metrics) < a.warm_steps:
                if demo.poll() is not None:
                    raise SystemExit(f"profile_step.py: the demo exited early: {log.name}")
                time.sleep(0.2)
            gen = next(c for c in trainer.children() if "spawn_main" in " ".join(c.cmdline()))
            procs = {"trainer": trainer.pid, "generation": gen.pid, "reference": ref.pid}
            py_spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
            spies = {name: subprocess.Popen(
                [py_spy, "record", "--pid", str(pid), "--duration", str(math.ceil(a.seconds)),
                 "--rate", str(a.rate), "--nonblocking", "--idle", "--threads", "--format", "raw",
                 "-o", os.path.join(out, f"{name}.raw")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for name, pid in procs.items() if a.rate}
            cpu0, step0, t0 = cpu_seconds(procs), last_step(metrics), time.time()
            time.sleep(a.seconds)
            cpu1, step1, t1 = cpu_seconds(procs), last_step(metrics), time.time()
            for s in spies.values():
                s.wait()
            if demo.wait() != 0:
                raise SystemExit(f"profile_step.py: the demo failed: {log.name}")
        finally:
            # an error or a stop here ends the demo (which stops what it started), then the samplers
            try:
                stop_run(demo)
            finally:
                for spy in spies.values():
                    if spy.poll() is None:
                        spy.terminate()
                        spy.wait()
    steps = step1 - step0
    if steps < 5:
        raise SystemExit(f"only {steps} steps in the window: raise --seconds or --steps")
    ms_per_step = 1000 * (t1 - t0) / steps
    cpu = {name: 1000 * (cpu1[name] - cpu0[name]) / steps for name in procs}
    print(f"steps {step0}-{step1} in {t1 - t0:.1f} s: {ms_per_step:.1f} ms per step (wall); CPU per step: " +
          ", ".join(f"{name} {ms:.0f} ms" for name, ms in cpu.items()) +
          f"; together {sum(cpu.values()):.0f} ms, {sum(cpu.values()) / (ms_per_step * os.cpu_count()):.0%} of "
          f"{os.cpu_count()} cores")
    if not a.rate:
        return
    tables = {}
    for name, rows, threads in (("trainer", TRAINER, ("MainThread",)),
                                ("generation", GENERATION, ("MainThread", "feeder")),
                                ("reference", REFERENCE, ("handler", "MainThread"))):
        counts = profile(os.path.join(out, f"{name}.raw"), rows, threads)
        if name == "reference":   # its main thread reads sockets; waitress's task threads run the requests
            wall = counts.pop("idle: waiting for a connection")
            counts["idle: waiting for a connection"] = wall - sum(counts.values())
        else:                     # the main thread's samples are the wall time; the feeder's run beside it
            wall = sum(n for k, n in counts.items() if k != FEEDER[0])
        tables[name] = {k: n / wall * ms_per_step for k, n in counts.most_common()}
    print("\n| process | where | ms per step | share of the step |\n| --- | --- | --- | --- |")
    for name, rows in tables.items():
        for k, ms in rows.items():
            print(f"| {name} | {k} | {ms:.1f} | {ms / ms_per_step:.0%} |")
    with open(os.path.join(out, "profile.json"), "w") as f:
        json.dump({"ms_per_step": ms_per_step, "steps": steps, "extra": extra, "tables": tables}, f, indent=1)


if __name__ == "__main__":
    main()
