"""How well generation and training overlap: runs the demo (demo/run_demo.py on the demo's warm-started model, built
once) or reads a run's metrics.jsonl, and reports the fraction of wall time the trainer waits for batches
(`time/wait_s`) and the time the generation process is blocked handing a finished batch to a busy trainer
(`time/gen_idle_s`). Goal: trainer idle < 20% in the demo.

    python bench/overlap.py                              # a fresh 60-step demo run into runs/bench/overlap
    python bench/overlap.py --gen-devices 0,1            # the same with two vLLM engines (1 vs 2 engines)
    python bench/overlap.py --metrics runs/demo/metrics.jsonl

Scopes: "all steps" is the trainer's whole life (time/elapsed_s of the last step), start-up included: step 1
waits for vLLM to start and to evaluate the starting weights. "steady" leaves step 1 out; "steady, no eval" also
leaves out the steps whose wait took in a held-out evaluation (the generation process evaluates between batches).
The per-step means below the table say where a step's time goes.
"""
import argparse
import os
import sys
from statistics import fmean

from _common import ROOT, count, demo_model, end_on_stops, machine, print_table, run_to_end
from plot import BadLine, step_lines


def run_demo(a):
    out = os.path.join(ROOT, "runs", "bench", "overlap")
    cmd = [sys.executable, "-m", "demo.run_demo", "--model", demo_model(a.model), "--out-dir", out,
           "--steps", str(a.steps), "--eval-every", str(a.eval_every), "--ref-servers", str(a.ref_servers)]
    if a.gen_devices:
        cmd += ["--", "--gen-devices", a.gen_devices]
    os.makedirs(out, exist_ok=True)   # with --model nothing else made runs/bench
    if os.path.exists(os.path.join(out, "metrics.jsonl")):
        os.remove(os.path.join(out, "metrics.jsonl"))   # a fresh run, not a continuation
    print(f"running {' '.join(cmd)} (log: runs/bench/overlap.log)", flush=True)
    run_to_end(cmd, os.path.join(ROOT, "runs", "bench", "overlap.log"), "overlap.py", "the demo run", cwd=ROOT)
    return os.path.join(out, "metrics.jsonl")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--metrics", help="read this metrics.jsonl instead of running the demo")
    p.add_argument("--model", help="warm-started model for the demo run (default: built once into runs/bench)")
    p.add_argument("--steps", type=count, default=60, help="demo steps (the demo's default)")
    p.add_argument("--eval-every", type=int, default=10, help="demo held-out evaluation every N steps (0: none)")
    p.add_argument("--gen-devices", help="grpo_train.py --gen-devices for the demo run, e.g. 0,1 (two engines)")
    p.add_argument("--ref-servers", type=count, default=1, help="reference servers of the demo run")
    a = p.parse_args()
    # SIGTERM and SIGHUP stop the demo run as Ctrl-C does (run_to_end)
    end_on_stops()
    path = a.metrics or run_demo(a)
    try:
        rows = step_lines(path)
    except OSError as e:
        raise SystemExit(f"overlap.py: {path}: {e.strerror}") from None
    except BadLine as e:
        raise SystemExit(f"overlap.py: {e}") from None
    # the steady state starts at step 2
    if len(rows) < 2:
        raise SystemExit(f"overlap.py: {path} holds {len(rows)} step line(s): it needs 2 or more")
    missing = [k for k in ("time/wait_s", "time/gen_idle_s", "time/elapsed_s") if k not in rows[-1]]
    if "time/wait_s" in missing or "time/elapsed_s" in missing:
        raise SystemExit(f"{path} has no {missing}: written by an older grpo_train.py")
    prev = {r["step"]: rows[i - 1]["time/elapsed_s"] if i else 0.0 for i, r in enumerate(rows)}
    dur = lambda r: r["time/elapsed_s"] - prev[r["step"]]   # wall time of a step, from the trainer's clock
    idle = lambda r: r.get("time/gen_idle_s", float("nan"))
    scopes = [("all steps (start-up included)", rows), ("steady (step 2 on)", rows[1:]),
              ("steady, no eval", [r for r in rows[1:] if "eval/accuracy" not in r])]
    table = []
    for name, rs in scopes:
        if not rs:   # every step took in an evaluation (--eval-every 1)
            table.append([name, 0, *["-"] * 5])
            continue
        wall, wait, gen_idle = sum(map(dur, rs)), sum(r["time/wait_s"] for r in rs), sum(map(idle, rs))
        table.append([name, len(rs), f"{wall:.1f}", f"{wait:.1f}", f"{100 * wait / wall:.1f}%",
                      f"{gen_idle:.2f}", f"{100 * gen_idle / wall:.1f}%"])
    steady = rows[1:]
    means = {k: fmean(r[f"time/{k}_s"] for r in steady) for k in ("gen", "wait", "ref", "train", "sync")}
    engines = rows[-1].get("gen/engines", 1)
    print(f"\n{machine()}; {path}: {len(rows)} steps, {engines} generation engine(s)")
    fastest = f", fastest engine's gen {fmean(r['time/gen_min_s'] for r in steady):.3f}" if engines > 1 else ""
    print("steady-state means per step (s): " + ", ".join(f"{k} {v:.3f}" for k, v in means.items()) + fastest
          + f", step {fmean(map(dur, steady)):.3f} (gen and ref overlap the rest: the trainer's own work is train + "
            f"sync = {means['train'] + means['sync']:.3f}; rows before the reference moved into the rollout "
            f"counted ref there too)")
    if missing:
        print(f"note: {path} has no {missing}: the generation side's blocked time is unknown (nan)")
    print_table(["scope", "steps", "wall s", "trainer waits s", "trainer idle", "gen blocked s", "gen blocked"],
                table)


if __name__ == "__main__":
    main()
