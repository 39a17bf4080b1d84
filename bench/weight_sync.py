"""Cost of a weight push, trainer -> a vLLM engine in a second process, on this machine (CPU, gloo), before
and after the push moved onto vLLM's own weight-transfer API, in one run:

- before: the previous push, kept below as it was (16 MiB flat buckets over a two-member gloo group, 1 ms
  sleep-polling, one bucket in flight on the receiver, streamed into vLLM's reload_weights, the CPU lm_head
  repack, the prefix-cache reset);
- after: today's push, weight_transfer.py: vLLM's init / start / update / finish(weight_version) calls,
  the project's gloo engine, 256 MiB buckets, the coverage check, a thread in place of the polling.

Each push is timed from the trainer's first call until the engine has answered (the whole push as rank 0
waits for it), and vLLM's probe log-probs are checked against the trainer's after each one.

With --profile, where one push's time goes instead, as the trainer pushes today (a snapshot, the probe
forward, the pipelined calls on a thread of their own): on the engine, vLLM's layerwise start and finish,
the receive and the load itself, the lm_head repack, the coverage check, the prefix-cache reset, the probe
as a request of its own and riding a batch; on rank 0, the snapshot, the probe forward, the push until every
engine has answered with the engine idle and right behind a batch (the wait for the engine's current batch).

    python bench/weight_sync.py                      # the demo model and a random ~100M-parameter Qwen2
    python bench/weight_sync.py --sizes demo --reps 3
    python bench/weight_sync.py --profile

Each size runs in a fresh subprocess (its memory is freed before the next). Median of --reps after a warm-up.
"""
import argparse
import collections
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from statistics import median

from _common import count, demo_model, machine, model_given, n_params, print_table, random_config

# the models --sizes may name
SIZES = ("demo", "100m")
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

def timer(push, owner, name, label):
    """owner.name, its calls' time added up in push[label] (the profile's wrapper: the trainer has none)."""
    fn = getattr(owner, name)

    def timed(*args, **kw):
        t = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            push[label] += time.perf_counter() - t
    setattr(owner, name, timed)


def engine(model_path, control, answers, threads, profile=False):
    """A vLLM engine that takes pushes both ways, as the generation process does; with `profile`, the parts
    of the push timed, and demo-sized batches generated on request."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    from vllm import LLM, SamplingParams
    import weight_transfer as wt
    from engine_process import ProbeAlong, never_pushed, vllm_probe_logps
    wt.register_gloo()
    llm = LLM(model_path, seed=0, dtype="float32", enforce_eager=True, max_model_len=256,
              weight_transfer_config={"backend": "gloo"})
    skipped, old_group, times = never_pushed(model_path), None, collections.defaultdict(list)
    # per push, each part's time (a part called per bucket adds up)
    push = collections.defaultdict(float)
    if profile:
        from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
        for owner, name, label in [
                (wt.GlooWeightTransferEngine, "start_weight_update", "engine: vLLM's layerwise start"),
                (Qwen2ForCausalLM, "load_weights", "engine:   of which vLLM's load_weights"),
                (wt, "unloaded_layers", "engine: coverage check"),
                (wt.GlooWeightTransferEngine, "finish_weight_update", "engine: vLLM's layerwise finish + repack"),
                (wt, "repack_cpu_lm_head", "engine:   of which the CPU lm_head repack"),
                (LLM, "reset_prefix_cache", "engine: prefix-cache reset")]:
            timer(push, owner, name, label)
    # a demo-sized batch: 16 prompts x 8 completions of 12 tokens
    batch = [{"prompt_token_ids": list(range(10, 30))}] * 16
    sampling = SamplingParams(n=8, max_tokens=12, temperature=1.0, logprobs=0, detokenize=False)
    while (msg := control.get())["kind"] != "stop":
        if msg["kind"] == "transfer":
            t = time.perf_counter()
            wt.apply_transfer(llm, msg, skipped)
            push[f"engine: {msg['method']} call, in all"] += time.perf_counter() - t
            if msg["method"] == "finish":
                for label, seconds in push.items():
                    times[label].append(seconds)
                push.clear()
            answers.put(msg["method"])
        elif msg["kind"] == "old":
            if old_group is None:
                store = dist.TCPStore("127.0.0.1", msg["port"], is_master=False,
                                      timeout=datetime.timedelta(minutes=10))
                old_group = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(minutes=10))
            old_load(llm, old_receive(old_group, msg["specs"]))
            answers.put("old")
        elif msg["kind"] == "probe":
            t = time.perf_counter()
            got = vllm_probe_logps(llm, msg["ids"])
            times["engine: probe, a request of its own"].append(time.perf_counter() - t)
            answers.put(got.tolist())
        elif msg["kind"] == "batch":
            along = ProbeAlong(llm, msg["ids"]) if msg["ids"] else llm
            t = time.perf_counter()
            along.generate(batch, sampling, use_tqdm=False)
            times["engine: batch" + (" with the probe riding it" if msg["ids"] else "")].append(
                time.perf_counter() - t)
            if msg["ids"]:
                answers.put(along.got.tolist())
        elif msg["kind"] == "times":
            answers.put(dict(times))


def start(size, a):
    """In the child process: the model (the demo's, or a random one of MODEL_100M's shape) and an engine
    process on it -> model, path, control queue, answers queue, engine process."""
    import torch
    import torch.multiprocessing as mp
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM
    if size == "demo":
        path = demo_model(a.model)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        torch.manual_seed(0)
        config, tok = random_config(**MODEL_100M)
        model = Qwen2ForCausalLM(config)
        path = os.path.join(a.tmp, "m")
        model.save_pretrained(path)
        tok.save_pretrained(path)
    ctx = mp.get_context("spawn")
    control, answers = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=engine, args=(path, control, answers, a.threads, a.profile), daemon=True)
    proc.start()
    return model, path, control, answers, proc


def a_step_of_change(params):
    """Each push has something to land: every parameter moved a little, as by an optimizer step."""
    import torch
    with torch.no_grad():
        for _, p in params:
            p.add_(torch.randn_like(p) * 1e-3)


def check_landed(got, expected, what):
    diff = (got - expected).abs().mean().item()
    assert diff < 1e-3, f"the {what} push did not land in vLLM (probe differs by {diff})"


def measure(size, a):
    """In the child process: -> dict of median seconds for each push."""
    import torch
    import torch.distributed as dist
    from grpo_train import completion_logps
    from transfer_clients import EngineClient, Snapshot
    from weight_transfer import open_transfer
    model, path, control, answers, proc = start(size, a)
    params = [(n, p.detach()) for n, p in model.named_parameters()]
    # detached: sent as they are, no copy (the previous push, "before", had none)
    client, snapshot = EngineClient([control], [answers]), Snapshot(lambda: params)
    snapshot.take()
    transfer = open_transfer("gloo", client, snapshot, 1)
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
            a_step_of_change(params)
            with torch.no_grad():
                probe = completion_logps(model, ids, torch.ones_like(ids), len(probe_ids) - 1)[0]
            t = time.perf_counter()
            push()
            times[key].append(time.perf_counter() - t)
            control.put({"kind": "probe", "ids": probe_ids})
            check_landed(torch.tensor(answers.get()), probe, key)
    control.put({"kind": "stop"})
    proc.join(timeout=60)
    out.update({k: median(v[1:]) for k, v in times.items()})
    return out


def profile(size, a):
    """In the child process: -> {phase: median seconds}, each push as push_weights makes it (a snapshot, the
    probe forward, the pipelined calls), once with the engine idle and once right behind a batch."""
    import torch
    from grpo_train import completion_logps
    from transfer_clients import EngineClient, Snapshot
    from weight_transfer import open_transfer, run_on_thread
    model, path, control, answers, proc = start(size, a)
    params = [(n, p) for n, p in model.named_parameters()]
    client, snapshot = EngineClient([control], [answers]), Snapshot(lambda: params)
    snapshot.take()
    transfer = open_transfer("gloo", client, snapshot, 1)
    probe_ids = list(range(10, 74))
    ids = torch.tensor([probe_ids])
    times = collections.defaultdict(list)

    def timed(label, fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        times[label].append(time.perf_counter() - t)
        return out

    for rep in range(a.reps + 1):
        for behind_a_batch in (False, True):
            a_step_of_change(params)
            if behind_a_batch:
                control.put({"kind": "batch", "ids": None})
            timed("rank 0: snapshot copy", snapshot.take)
            with torch.no_grad():
                probe = timed("rank 0: probe forward", completion_logps, model, ids, torch.ones_like(ids),
                              len(probe_ids) - 1)[0]
            client.finish = {"version": rep}
            label = "rank 0: the push, " + ("right behind a batch" if behind_a_batch else "engine idle")
            timed(label, lambda: run_on_thread(transfer.send_weights).join())
            # the probe, once alone and once riding the next batch
            control.put({"kind": "batch" if behind_a_batch else "probe", "ids": probe_ids})
            check_landed(torch.tensor(answers.get()), probe, label)
    control.put({"kind": "times"})
    engine_times = answers.get()
    control.put({"kind": "stop"})
    proc.join(timeout=60)
    # the first repetition's share of each is the warm-up
    out = {k: median(v[len(v) // (a.reps + 1):]) for k, v in {**times, **engine_times}.items()}
    out["engine: the probe riding a batch"] = (out.pop("engine: batch with the probe riding it")
                                               - out["engine: batch"])
    return {"params": n_params(model), "bytes": sum(p.numel() * p.element_size() for _, p in params), **out}


# the profile's rows, in the order a push goes
PHASES = ["rank 0: snapshot copy", "rank 0: probe forward", "rank 0: the push, engine idle",
          "rank 0: the push, right behind a batch", "engine: start call, in all", "engine: vLLM's layerwise start",
          "engine: update call, in all", "engine:   of which vLLM's load_weights", "engine: finish call, in all",
          "engine: coverage check", "engine: vLLM's layerwise finish + repack",
          "engine:   of which the CPU lm_head repack", "engine: prefix-cache reset",
          "engine: probe, a request of its own", "engine: the probe riding a batch", "engine: batch"]


def run_child(size, a):
    cmd = [sys.executable, __file__, "--child", size, "--reps", str(a.reps), "--threads", str(a.threads)]
    cmd += (["--model", a.model] if a.model else []) + (["--profile"] if a.profile else [])
    out = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{size} failed:\n{out.stderr[-3000:]}")
    r = json.loads(lines[-1][7:])
    return f"{size} ({r['params'] / 1e6:.1f}M, {r['bytes'] / 1e6:.0f} MB)", r


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated: {', '.join(SIZES)}")
    p.add_argument("--model", help="local HF model folder for 'demo' (default: the demo's warm-started model)")
    p.add_argument("--reps", type=count, default=5, help="timed repetitions of each (median)")
    p.add_argument("--threads", type=count, default=1, help="torch threads (the trainer's --threads default)")
    p.add_argument("--profile", action="store_true", help="where a push's time goes, phase by phase")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        # the random model's folder (~400 MB at 100m), removed when the child ends (errors too)
        with tempfile.TemporaryDirectory() as a.tmp:
            print("RESULT " + json.dumps((profile if a.profile else measure)(a.child, a)))
        return
    if unknown := [size for size in a.sizes.split(",") if size not in SIZES]:
        raise SystemExit(f"weight_sync.py: --sizes {a.sizes}: no model named {', '.join(unknown)} "
                         f"(known: {', '.join(SIZES)})")
    if a.model:
        model_given(a.model, "weight_sync.py")
    results = [run_child(size, a) for size in a.sizes.split(",")]
    print(f"\n{machine()}; {a.threads} torch thread(s); fp32 weights; median of {a.reps}")
    if a.profile:
        print_table(["ms", *[label for label, _ in results]],
                    [[k, *[f"{1000 * r[k]:.1f}" for _, r in results]] for k in PHASES])
        return
    print_table(["model", "before: ms a push", "after: ms a push", "after / before"],
                [[label, f"{1000 * r['old']:.1f}", f"{1000 * r['new']:.1f}", f"{r['new'] / r['old']:.2f}x"]
                 for label, r in results])


if __name__ == "__main__":
    main()
