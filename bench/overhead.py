"""The overhead figure: how far a steady-state step of the whole system is from its physical limit.

Two runs of the same GRPO from the same model, one after the other:
1. the system: demo/run_demo.py (reference server + deepspeed launcher + grpo_train.py + vLLM process),
   evaluations off; its steady-state wall seconds per step (steps --warm-steps to the step before the last);
2. the pure compute, alone: one process, the same thread setting (1 torch thread), running the same loop
   serially with the project's own functions and nothing between them: vLLM sampling with rewards
   (grpo_train.rollout), the reference forward (ref_server.compute_logps, in this process), the
   training step (grpo_train.train_step on a one-rank DeepSpeed ZeRO-2 engine), then a weight load into
   the same vLLM engine that is not counted. Each phase is timed on its own.

figure = system wall per step / (sampling + reference + training per step, alone). With generation overlapping
training on two cores it can be below 1.0; above 1.0 is overhead that the pipeline does not hide.

    .venv/bin/python bench/overhead.py                                    # the demo model, ~2 min
    .venv/bin/python bench/overhead.py --model runs/trl_compare_512x6/model -- --overlong-buffer 11
"""
import argparse
import json
import os
import sys
import time

from _common import count, end_on_stops, fresh_out_dir, model_given, run_to_end

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def system_run(a, extra, out):
    """-> wall seconds per step of the real system, steps a.warm_steps .. a.steps - 1."""
    cmd = [sys.executable, "-m", "demo.run_demo", "--model", a.model, "--out-dir", out, "--steps", str(a.steps),
           "--eval-every", str(10 * a.steps), "--", *extra]
    run_to_end(cmd, os.path.join(out, "stdout.log"), "overhead.py", "the system run", cwd=ROOT)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        el = {r["step"]: r["time/elapsed_s"] for r in map(json.loads, f) if "time/train_s" in r}
    end = a.steps - 1   # the last step also waits for the final evaluation
    return (el[end] - el[a.warm_steps]) / (end - a.warm_steps)


def alone(a, extra, out):
    """In this process: the same loop serially, each phase timed -> {phase: seconds per step}."""
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    import torch
    torch.set_num_threads(1)   # before vLLM: its CPU worker refuses to change it afterwards
    from vllm import LLM
    import grpo_train as gt
    import ref_server
    from demo.run_demo import TRAIN_FLAGS
    from engine_process import never_pushed
    from transfer_clients import push_in_process
    from weight_transfer import register_gloo
    from batches import micro_batches
    from ranks import init_distributed
    from run_setup import build_engine, load_policy, load_prompts
    from tasks import shuffled_forever
    args = gt.get_args(["--model", a.model, "--out-dir", out, "--steps", str(a.steps), *TRAIN_FLAGS, *extra])
    # vLLM first: it sets up a one-process torch.distributed group, which DeepSpeed then finds and uses
    register_gloo()
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, seed=args.seed,
              max_model_len=args.max_prompt_len + args.max_new_tokens, logprobs_mode="processed_logprobs",
              weight_transfer_config={"backend": "gloo"})
    push = push_in_process(llm, never_pushed(args.model))
    init_distributed(10, 1)
    model, tok = load_policy(args.model, False)
    train_set, _, _ = load_prompts(tok, **{**vars(args), "data": None})
    ref = ref_server.load_model(args.model)
    engine = build_engine(model, args.ds_config, args.lr, args.micro_batch)
    order = shuffled_forever(len(train_set), args.seed)
    next_prompts = lambda: [train_set[next(order)] for _ in range(args.prompts_per_step)]
    spec = gt.rewards.parse_reward_spec(args.rewards)
    # the rollout alone (the engines' reference request is the phase timed below, in this process)
    times = {"sampling, rewards (rollout)": [], "reference forward": [], "training step": []}
    for step in range(1, a.steps):
        t0 = time.perf_counter()
        batch = gt.rollout(llm, next_prompts, args.prompts_per_step, spec, args)
        t1 = time.perf_counter()
        seqs = batch["seqs"]
        got = ref_server.compute_logps(ref, [s["prompt"] for s in seqs], [s["completion"] for s in seqs],
                                       args.temperature)
        for s, r in zip(seqs, got):
            s["ref"] = r.tolist()
        t2 = time.perf_counter()
        total = gt.normaliser(seqs, [], args.agg, args.mask_truncated)
        gt.train_step(engine, micro_batches(seqs, seqs, 1, args.micro_batch), total, tok.pad_token_id, args)
        t3 = time.perf_counter()
        push(engine.module.named_parameters())
        if step >= a.warm_steps:
            for k, t in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[k].append(t)
    return {k: sum(v) / len(v) for k, v in times.items()}


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="runs/demo/model", help="warm-started demo model (make demo builds it)")
    p.add_argument("--steps", type=count, default=60, help="steps of each run")
    p.add_argument("--warm-steps", type=int, default=10, help="steady state starts at this step")
    p.add_argument("--out-dir", default="runs/overhead",
                   help="the system run's folder (emptied first: new, empty, or a bench script's)")
    p.add_argument("--alone", action="store_true", help=argparse.SUPPRESS)   # the child process
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    a.model = os.path.abspath(a.model)
    out = os.path.abspath(a.out_dir)
    model_given(a.model, "overhead.py")
    # the steady state: steps --warm-steps .. --steps - 1 (the last waits for the final evaluation)
    if not 1 <= a.warm_steps < a.steps - 1:
        raise SystemExit(f"overhead.py: --warm-steps {a.warm_steps} leaves no steady state in "
                         f"--steps {a.steps}: give 1 <= --warm-steps < --steps - 1")
    result = os.path.join(out, "alone.json")   # the pure-compute run's phases, from its child
    if a.alone:
        phases = alone(a, extra, os.path.join(out, "alone"))
        with open(result, "w") as f:
            json.dump(phases, f)
        return
    fresh_out_dir(a.out_dir, "overhead.py", keep=[a.model])
    os.makedirs(os.path.join(out, "alone"))
    # SIGTERM and SIGHUP stop the run going as Ctrl-C does (run_to_end)
    end_on_stops()
    wall = system_run(a, extra, out)
    run_to_end([sys.executable, __file__, "--alone", "--model", a.model, "--steps", str(a.steps), "--warm-steps",
                str(a.warm_steps), "--out-dir", out, "--", *extra], os.path.join(out, "alone.log"), "overhead.py",
               "the pure-compute run", cwd=ROOT)
    with open(result) as f:
        phases = json.load(f)
    compute = sum(phases.values())
    print(f"model {a.model}; steps {a.warm_steps}-{a.steps - 1}; extra flags {extra or 'none'}\n")
    print("| what | ms per step |\n| --- | --- |")
    for k, v in phases.items():
        print(f"| alone: {k} | {1000 * v:.1f} |")
    print(f"| alone: sum (the physical limit's serial form) | {1000 * compute:.1f} |")
    print(f"| the system: wall per step | {1000 * wall:.1f} |")
    print(f"\noverhead figure: system wall / pure compute = {wall / compute:.2f}")


if __name__ == "__main__":
    main()
