"""Cost of a weight push: `WeightSync.push` (the trainer copies its weights into the shared buffers the generation
process loads from, under a lock) against a plain copy of the same state dict into preallocated buffers (the
memory-bandwidth floor), and the generation side's `WeightSync.pull` into a live vLLM engine (the CPU build,
in process): `load_weights_into_vllm` alone, and the whole pull (load + the probe's log-prob check).

    python bench/weight_sync.py                      # the demo model and a random Qwen2.5-0.5B-shaped model
    python bench/weight_sync.py --sizes demo --no-pull

Each size runs in a fresh subprocess (its memory is freed before the next). Push and copy alternate, --reps
times each after a warm-up; the table gives medians, GB/s and the ratio to the plain copy (goal: push <= 3x).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from _common import demo_model, machine, n_params, print_table, random_config, timed

QWEN05 = dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936)   # Qwen2.5-0.5B's shape


def measure(size, a):
    """In the child process: -> dict of median seconds."""
    import torch
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM
    from weight_sync import WeightSync, load_weights_into_vllm
    tmp = tempfile.mkdtemp()
    if size == "demo":
        path = demo_model(a.model)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:   # random; saved only if vLLM has to load it
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(random_config(**QWEN05)[0])
        path = os.path.join(tmp, "m")
        if a.pull:
            model.save_pretrained(path)
            random_config(**QWEN05)[1].save_pretrained(path)
    probe_ids = list(range(10, 74))
    from grpo_train import completion_logps   # the trainer's log-probs of the probe, as push_weights sends them
    ids = torch.tensor([probe_ids])
    with torch.no_grad():
        probe = completion_logps(model, ids, torch.ones_like(ids), len(probe_ids) - 1)[0]
    sync = WeightSync(model.named_parameters(), probe_ids)
    floor = {n: torch.empty_like(p) for n, p in model.named_parameters()}

    def copy():
        for n, p in model.named_parameters():
            floor[n].copy_(p.detach())
    push = lambda: sync.push(model.named_parameters(), probe, evaluate=False)
    push(), copy()   # warm-up (first touch of every page)
    t_push, t_copy = [], []
    for _ in range(a.reps):
        t_push.append(timed(push, 1)[0])
        t_copy.append(timed(copy, 1)[0])
    med = lambda xs: sorted(xs)[len(xs) // 2]
    out = {"params": n_params(model), "bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
           "push": med(t_push), "copy": med(t_copy)}
    if a.pull:
        del floor
        os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
        from vllm import LLM
        llm = LLM(path, seed=0, dtype="float32", enforce_eager=True, max_model_len=256)
        version = sync.pull(llm, -1)[0]   # warm-up
        out["load"] = timed(lambda: load_weights_into_vllm(llm, sync.weights), a.reps)[0]

        t_pull = []
        for _ in range(a.reps):
            push()   # a new version to pull (not timed)
            t, (version, _, diff) = timed(lambda: sync.pull(llm, version), 1)
            assert diff < 1e-3, f"the pushed weights did not land in vLLM (probe differs by {diff})"
            t_pull.append(t)
        out["pull"] = med(t_pull)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="demo,qwen2.5-0.5b", help="comma-separated: demo, qwen2.5-0.5b")
    p.add_argument("--model", help="local HF model folder for 'demo' (default: the demo's warm-started model)")
    p.add_argument("--reps", type=int, default=5, help="timed pushes and copies (median)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the trainer's --threads default)")
    p.add_argument("--no-pull", dest="pull", action="store_false", help="skip the vLLM side")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print("RESULT " + json.dumps(measure(a.child, a)))
        return
    rows = []
    for size in a.sizes.split(","):
        cmd = [sys.executable, __file__, "--child", size, "--reps", str(a.reps), "--threads", str(a.threads)]
        cmd += (["--model", a.model] if a.model else []) + ([] if a.pull else ["--no-pull"])
        out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode or not lines:
            raise SystemExit(f"{size} failed:\n{out.stderr[-3000:]}")
        r = json.loads(lines[-1][7:])
        gb = r["bytes"] / 1e9
        label = f"{size} ({r['params'] / 1e6:.1f}M, {gb * 1000:.0f} MB)"
        rows.append([label, "plain copy (floor)", f"{1000 * r['copy']:.2f}", f"{gb / r['copy']:.2f}", "1.00x"])
        rows.append([label, "WeightSync.push", f"{1000 * r['push']:.2f}", f"{gb / r['push']:.2f}",
                     f"{r['push'] / r['copy']:.2f}x"])
        for k, what in [("load", "load_weights_into_vllm"), ("pull", "WeightSync.pull (load + probe)")]:
            if k in r:
                rows.append([label, what, f"{1000 * r[k]:.2f}", f"{gb / r[k]:.2f}", f"{r[k] / r['copy']:.2f}x"])
    print(f"\n{machine()}; {a.threads} torch thread(s); fp32 weights; median of {a.reps}")
    print_table(["model", "operation", "ms", "GB/s", "vs plain copy"], rows)


if __name__ == "__main__":
    main()
