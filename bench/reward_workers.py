"""What --reward-workers saves on a code task: the code reward of one step's batch (--prompts x --group
completions, 16 x 8 by default: each a jail, sandbox.run_tests) scored one jail at a time and N at a time
(rewards.score_all), alternating, --reps times each after one warm-up. The completions answer the code
task's own problems: each group holds the reference solution, a wrong one and one that raises (none loops
until its timeout, which would measure only the timeout). The scores both ways are checked equal.

    python bench/reward_workers.py                 # N = every core this process may use
    python bench/reward_workers.py --workers 2 --reps 5

The table gives the median seconds of reward per step each way and their ratio; the rest of a step (sampling,
the reference, the trainer's step) does not change with N.
"""
import argparse
import os
import statistics

from _common import count, machine, print_table, timed
import rewards
import tasks


def batch(n_prompts, group):
    """n_prompts x group (answer, sample) pairs of the code task: right, wrong and crashing answers."""
    items = []
    for i in range(n_prompts):
        signature, _, solution, tests = tasks.PROBLEMS[i % len(tasks.PROBLEMS)]
        name = signature.split("(")[0]
        answers = [solution, f"def {name}(*args):\n    return 0", f"def {name}(*args):\n    raise ValueError"]
        for k in range(group):
            items.append((f"<think>.</think><answer>{answers[k % len(answers)]}</answer>", {"tests": tests}))
    return items


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=count, default=len(os.sched_getaffinity(0)),
                   help="jails at a time, N (default: the cores this process may use)")
    p.add_argument("--prompts", type=count, default=16, help="prompts of the batch")
    p.add_argument("--group", type=count, default=8, help="completions per prompt")
    p.add_argument("--reps", type=count, default=3, help="timed batches each way (median)")
    a = p.parse_args()
    items, spec = batch(a.prompts, a.group), rewards.parse_reward_spec("code")
    workers = rewards.reward_workers(a.workers)
    scores, times = {}, {1: [], workers: []}
    for n in (1, workers):   # warm-up: the interpreter's files in the page cache
        rewards.score_all(items[:4], spec, n)
    for _ in range(a.reps):
        for n in (1, workers):
            seconds, out = timed(lambda: rewards.score_all(items, spec, n), 1)
            times[n].append(seconds)
            scores[n] = [s for _, s in out]
    assert scores[1] == scores[workers], "the parallel scores differ from the serial ones"
    median = {n: statistics.median(t) for n, t in times.items()}
    print(machine())
    print_table(["completions", "--reward-workers 1 (s)", f"--reward-workers {workers} (s)", "ratio"],
                [[len(items), f"{median[1]:.2f}", f"{median[workers]:.2f}",
                  f"{median[workers] / median[1]:.2f}x"]])


if __name__ == "__main__":
    main()
