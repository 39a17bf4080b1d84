"""What moving tensors costs on a GPU machine, at Qwen2.5 sizes (random weights, bf16 on GPU, no download):

  --part ref   ref_server.py on --device (started as the GPU recipe in docs/gpu.md starts it, on a random
               model saved to disk): one POST /logps of --seqs sequences of --prompt-len + --completion-len
               tokens through the trainer's client, against the same compute_logps in this process,
               same device, in the same forward passes (the client cuts a batch past the server's
               --max-tokens into requests: 4 at the defaults).
  --part sync  the weight paths from the trainer to the generation process, per state dict (tied embeddings
               once): the previous path was GPU -> shared CPU memory (unpinned, the old weight_sync.py) and
               shared memory -> the engine's GPU on load; today's process-group path broadcasts each tensor from
               the trainer's rank 0 to the generation process. NCCL refuses two ranks on one GPU, so on a
               one-GPU machine that path is estimated from its parts: pinned vs unpinned GPU <-> CPU copies,
               a gloo broadcast of the CPU state dict between two processes, and a device-to-device copy.

    python bench/gpu_transfer.py                                   # both parts, Qwen2.5-0.5B and 1.5B shapes
    python bench/gpu_transfer.py --part sync --models qwen2.5-1.5b

Medians of --reps timed repetitions after a warm-up.
"""
import argparse
import contextlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from _common import ROOT, count, end_on_stops, machine, print_table, random_config, random_model, timed
from gpu_bench import CONFIGS


def shapes(config):
    """-> {name: shape} of the Qwen2.5-shaped model's parameters (built on the meta device: no memory)."""
    import torch
    from transformers import Qwen2ForCausalLM
    with torch.device("meta"):
        model = Qwen2ForCausalLM(random_config(**CONFIGS[config])[0])
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def part_ref(a, config, device):
    import torch
    from placement import free_port
    from ref_client import RefServerError, in_requests, ref_logps, split_to_fit, wait_for_server
    from ref_server import compute_logps, load_model
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "server.log"), "w+") as log:
        path = random_model(os.path.join(tmp, "m"), dtype="bfloat16" if device != "cpu" else "float32",
                            max_len=a.prompt_len + a.completion_len, **CONFIGS[config])
        url = f"http://127.0.0.1:{free_port()}"
        proc = subprocess.Popen([sys.executable, "ref_server.py", "--model", path, "--device", device,
                                 "--port", url.rsplit(":", 1)[1]], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            # the server's /health: its limits, which cut the batch into requests below
            for _ in range(300):
                if proc.poll() is not None:
                    raise SystemExit(f"gpu_transfer: ref_server.py exited with code "
                                     f"{proc.returncode} (its log is above)")
                with contextlib.suppress(RefServerError):
                    limits = wait_for_server(url, timeout=1)
                    break
            else:
                raise SystemExit("gpu_transfer: ref_server.py did not come up in 300 s (its log is "
                                 "above)")
            rng = random.Random(0)
            vocab = CONFIGS[config]["vocab"]
            prompts = [[rng.randrange(vocab) for _ in range(a.prompt_len)] for _ in range(a.seqs)]
            completions = [[rng.randrange(vocab) for _ in range(a.completion_len)] for _ in range(a.seqs)]
            remote = lambda: ref_logps(url, prompts, completions, 1.0, retry_for=0, timeout=600)
            remote()   # warm-up: CUDA kernels load on first use
            t_remote = timed(remote, a.reps)[0]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            log.seek(0)
            print(log.read()[-2000:])
        model = load_model(path, device)
        sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
        # the server's forward passes: the client's requests, cut to fit its --max-tokens
        parts = len(split_to_fit(prompts, completions, limits))
        local = lambda: (in_requests(prompts, completions, limits,
                                     lambda ps, cs: compute_logps(model, ps, cs, 1.0)), sync())
        local()
        t_local = timed(local, a.reps)[0]
    tokens = a.seqs * (a.prompt_len + a.completion_len)
    return [[config, f"ref_server.py --device {device}, POST /logps ({parts} request(s))",
             f"{1000 * t_remote:.0f}", f"{tokens / t_remote:.0f} tok/s"],
            [config, f"compute_logps in process on {device} ({parts} forward pass(es))",
             f"{1000 * t_local:.0f}", f"{tokens / t_local:.0f} tok/s"]]


def broadcast_child(rank, port, shp, reps, out):
    """One of two gloo ranks: rank 0 broadcasts every tensor of the state dict, rank 1 receives.
    -> out[rank]: median seconds per whole state dict."""
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    # byte views of the bf16 tensors: a broadcast moves bytes, and gloo refuses some dtypes (int16, for one)
    ts = [torch.empty(s, dtype=torch.bfloat16).flatten().view(torch.uint8) for s in shp.values()]
    times = []
    for _ in range(reps + 1):   # the first is a warm-up (gloo's connections and buffers)
        dist.barrier()
        t = time.perf_counter()
        for x in ts:
            dist.broadcast(x, 0)
        dist.barrier()
        times.append(time.perf_counter() - t)
    out[rank] = statistics.median(times[1:])
    dist.destroy_process_group()


def part_sync(a, config):
    import torch
    import torch.multiprocessing as mp
    from placement import free_port
    shp = shapes(config)
    gpu = torch.cuda.is_available()
    nbytes = sum(torch.Size(s).numel() for s in shp.values()) * 2
    rows, gb = [], nbytes / 1e9
    row = lambda what, s: rows.append([config, what, f"{1000 * s:.1f}", f"{gb / s:.1f} GB/s"])
    if gpu:
        src = {n: torch.randn(s, dtype=torch.bfloat16, device="cuda") for n, s in shp.items()}
        dst = {"unpinned shared CPU memory (the previous WeightSync buffers)":
               {n: torch.empty(s, dtype=torch.bfloat16).share_memory_() for n, s in shp.items()},
               "pinned CPU memory":
               {n: torch.empty(s, dtype=torch.bfloat16).pin_memory() for n, s in shp.items()}}
        for what, buf in dst.items():
            def down():
                for n, t in src.items():
                    # non_blocking: asynchronous into pinned memory only; unpinned copies stay synchronous
                    buf[n].copy_(t, non_blocking=True)
                torch.cuda.synchronize()

            def up():
                for n, t in buf.items():
                    src[n].copy_(t, non_blocking=True)
                torch.cuda.synchronize()
            down(), up()
            row(f"GPU -> {what}", timed(down, a.reps)[0])
            row(f"{what} -> GPU", timed(up, a.reps)[0])
        twin = {n: torch.empty_like(t) for n, t in src.items()}

        def d2d():
            for n, t in src.items():
                twin[n].copy_(t)
            torch.cuda.synchronize()
        d2d()
        row("GPU -> GPU, same device (what an NCCL broadcast moves; a floor)", timed(d2d, a.reps)[0])
        del src, dst, twin
    out = mp.get_context("spawn").Manager().dict()
    mp.start_processes(broadcast_child, args=(free_port(), shp, a.reps, out), nprocs=2, start_method="spawn")
    row("gloo broadcast of the CPU state dict, 2 processes, tensor by tensor", max(out.values()))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["ref", "sync", "both"], default="both")
    p.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b",
                   help=f"comma-separated, of {list(CONFIGS)}")
    p.add_argument("--device", default=None,
                   help="ref_server.py's --device (default: cuda:0 if there is a GPU)")
    p.add_argument("--seqs", type=count, default=32, help="ref: sequences per request")
    p.add_argument("--prompt-len", type=count, default=256, help="ref: prompt tokens per sequence")
    p.add_argument("--completion-len", type=count, default=512, help="ref: completion tokens per sequence")
    p.add_argument("--reps", type=count, default=5, help="timed repetitions (median)")
    a = p.parse_args()
    if unknown := [m for m in a.models.split(",") if m not in CONFIGS]:
        raise SystemExit(f"gpu_transfer: --models {a.models}: no config named {', '.join(unknown)} "
                         f"(known: {', '.join(CONFIGS)})")
    # `kill` or a closed ssh session stop the reference server it starts, as Ctrl-C does (its finally)
    end_on_stops()
    import torch
    device = a.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    rows = []
    for config in a.models.split(","):
        if a.part in ("ref", "both"):
            rows += part_ref(a, config, device)
        if a.part in ("sync", "both"):
            rows += part_sync(a, config)
    print(f"\n{machine()}; ref: {a.seqs} sequences x ({a.prompt_len} + {a.completion_len}) tokens; "
          f"median of {a.reps}")
    print_table(["model", "what", "ms", "rate"], rows)


if __name__ == "__main__":
    main()
