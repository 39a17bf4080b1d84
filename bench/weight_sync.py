"""Cost of a weight push, trainer -> generation process, on this machine (CPU, gloo):

- plain copy: the state dict copied into preallocated buffers in the same process (the memory floor);
- shared-memory copy: the previous version's push, a copy into shared CPU buffers (`share_memory_()`) that
  the generation process then loaded from (a second copy, not timed here);
- broadcast: today's push, `generation.send_weights` over the two-member gloo group into a second process
  that receives it in flat buckets (`generation.receive_weights`), the same code a GPU run executes with NCCL;
- with --pull (default): the broadcast received straight into a live vLLM engine's loader
  (`generation.load_weights_into_vllm`) plus the probe check, i.e. the whole push as the trainer waits for it.

    python bench/weight_sync.py                      # the demo model and a random Qwen2.5-0.5B-shaped model
    python bench/weight_sync.py --sizes demo --no-pull

Each size runs in a fresh subprocess (its memory is freed before the next). Median of --reps after a warm-up.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

from _common import demo_model, machine, n_params, print_table, random_config, timed

QWEN05 = dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936)   # Qwen2.5-0.5B's shape


def receiver(port, specs, reps, model_path, probe_ids, threads):
    """The generation process's side: joins the weight group and receives every push (into vLLM if given)."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    from generation import load_weights_into_vllm, receive_weights, vllm_probe_logps, weight_group
    llm = None
    if model_path:
        os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
        from vllm import LLM
        llm = LLM(model_path, seed=0, dtype="float32", enforce_eager=True, max_model_len=256)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(minutes=10))
    group = weight_group(store, 1, 2, "gloo")[0]
    store.set("ready", "1")

    def received():
        return receive_weights(group, [(name, shape, "float32") for name, shape in specs], torch.device("cpu"),
                               lambda: None)
    for _ in range(reps + 1):
        if llm is None:
            for _ in received():
                pass
        else:
            load_weights_into_vllm(llm, received())
            got = vllm_probe_logps(llm, probe_ids)
            store.set("probe", json.dumps(got.tolist()))
        group.barrier().wait()


def measure(size, a):
    """In the child process: -> dict of median seconds."""
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM
    from generation import send_weights, weight_group
    from grpo_train import completion_logps
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
    params = [(n, p.detach()) for n, p in model.named_parameters()]
    med = lambda xs: sorted(xs)[len(xs) // 2]
    floor = {n: torch.empty_like(p) for n, p in params}
    shared = {n: torch.empty_like(p).share_memory_() for n, p in params}

    def copy_into(buffers):
        for n, p in params:
            buffers[n].copy_(p)
    copy_into(floor), copy_into(shared)   # warm-up (first touch of every page)
    out = {"params": n_params(model), "bytes": sum(p.numel() * p.element_size() for _, p in params)}
    out["copy"], out["shm"] = (timed(lambda: copy_into(buffers), a.reps)[0] for buffers in (floor, shared))
    floor.clear(), shared.clear()   # their memory, before the receivers start

    probe_ids = list(range(10, 74))
    ids = torch.tensor([probe_ids])
    with torch.no_grad():
        probe = completion_logps(model, ids, torch.ones_like(ids), len(probe_ids) - 1)[0]
    for key, model_path in [("broadcast", None)] + ([("pull", path)] if a.pull else []):
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(minutes=10))
        proc = mp.get_context("spawn").Process(target=receiver, args=(
            store.port, [(n, list(p.shape)) for n, p in params], a.reps, model_path, probe_ids, a.threads))
        proc.start()
        group = weight_group(store, 0, 2, "gloo")[0]
        store.wait(["ready"])
        check = lambda: None if proc.is_alive() else sys.exit("the receiver died")
        times = []
        for rep in range(a.reps + 1):   # the first is a warm-up
            push = lambda: send_weights(group, [p for _, p in params], torch.device("cpu"), check)
            t = timed(lambda: (push(), group.barrier().wait()), 1)[0]
            times.append(t)
            if model_path:
                got = torch.tensor(json.loads(store.get("probe")))
                diff = (got - probe).abs().mean().item()
                assert diff < 1e-3, f"the pushed weights did not land in vLLM (probe differs by {diff})"
        proc.join(timeout=120)
        out[key] = med(times[1:])
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="demo,qwen2.5-0.5b", help="comma-separated: demo, qwen2.5-0.5b")
    p.add_argument("--model", help="local HF model folder for 'demo' (default: the demo's warm-started model)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions of each (median)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the trainer's --threads default)")
    p.add_argument("--no-pull", dest="pull", action="store_false", help="skip the vLLM side")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print("RESULT " + json.dumps(measure(a.child, a)))
        return
    rows = []
    what = {"copy": "plain copy (floor)", "shm": "shared-memory copy (the previous push, first half)",
            "broadcast": "gloo broadcast to a second process (today's push)",
            "pull": "broadcast into vLLM's loader + probe (today's whole push)"}
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
        for k, name in what.items():
            if k in r:
                rows.append([label, name, f"{1000 * r[k]:.2f}", f"{gb / r[k]:.2f}", f"{r[k] / r['copy']:.2f}x"])
    print(f"\n{machine()}; {a.threads} torch thread(s); fp32 weights; median of {a.reps}")
    print_table(["model", "operation", "ms", "GB/s", "vs plain copy"], rows)


if __name__ == "__main__":
    main()
