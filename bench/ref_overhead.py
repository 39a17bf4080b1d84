"""What the reference server costs: per-token log-probs through ref_server.py over loopback (the real server, started
as a subprocess on a free port; the trainer's client `ref_server.ref_logps`) against the same forward in this
process (`ref_server.compute_logps`, the function the server runs), on the same model, batch and thread count.

    python bench/ref_overhead.py                      # demo model, 64 sequences of 16 prompt + 12 completion tokens
    python bench/ref_overhead.py --size big --seqs 16 --prompt-len 64 --completion-len 128   # ~67M random model

The two sides alternate, --reps times each after two warm-up calls; the table gives medians, their ratio (goal
<= 1.15x) and where the difference goes: the wire format (encode/decode of request and answer, timed here in
process) and the rest (HTTP, sockets, the server's threads), and the smallest request's time both ways (the fixed
cost of a request). Both answers are checked to be equal.
"""
import argparse
import os
import random
import subprocess
import sys
import tempfile

from _common import BIG, ROOT, demo_model, machine, print_table, random_model, timed
from demo.run_demo import free_port
from ref_server import MICRO_BATCH


def start_server(path, a, log):
    from ref_server import RefServerError, wait_for_server
    url = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "ref_server.py", "--model", path, "--port", url.rsplit(":", 1)[1],
                             "--threads", str(a.threads), "--micro-batch", str(a.micro_batch)],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(240):
        if proc.poll() is not None:
            raise SystemExit(f"ref_server.py exited with code {proc.returncode}; its log: {log.name}")
        try:
            wait_for_server(url, timeout=1)
            return proc, url
        except RefServerError:
            pass
    proc.terminate()
    raise SystemExit("ref_server.py did not come up in 240 s")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local HF model folder (default: the demo's warm-started model)")
    p.add_argument("--size", choices=["demo", "big"], default="demo", help="big: a random ~67M-parameter model")
    p.add_argument("--seqs", type=int, default=64, help="sequences per request")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--completion-len", type=int, default=12)
    p.add_argument("--micro-batch", type=int, default=MICRO_BATCH,
                   help="sequences per forward, both sides (server default)")
    p.add_argument("--threads", type=int, default=1, help="torch threads, both sides (the demo's server runs 1)")
    p.add_argument("--reps", type=int, default=20, help="timed calls per side (median)")
    a = p.parse_args()
    import torch
    torch.set_num_threads(a.threads)
    from ref_server import (compute_logps, decode_request, decode_response, encode_request, encode_response,
                            load_model, ref_logps)
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "server.log"), "w+") as log:
        path = random_model(os.path.join(tmp, "m"), **BIG) if a.size == "big" and not a.model else demo_model(a.model)
        proc, url = start_server(path, a, log)
        try:
            model = load_model(path)
            rng, V = random.Random(0), model.config.vocab_size
            prompts = [[rng.randrange(V) for _ in range(a.prompt_len)] for _ in range(a.seqs)]
            completions = [[rng.randrange(V) for _ in range(a.completion_len)] for _ in range(a.seqs)]
            local = lambda: compute_logps(model, prompts, completions, 1.0, a.micro_batch)
            remote = lambda: ref_logps(url, prompts, completions, 1.0, retry_for=0)
            for _ in range(2):
                want, got = local(), remote()
            diff = max((g - w).abs().max().item() for g, w in zip(got, want))
            assert diff < 1e-4, f"the server's answer differs from the in-process forward by {diff}"
            t_local, t_remote = [], []
            for _ in range(a.reps):   # alternate, so a noisy neighbour hits both sides alike
                t_local.append(timed(local, 1)[0])
                t_remote.append(timed(remote, 1)[0])
            # the fixed cost of a request: the smallest one (1 sequence, 1 prompt + 1 completion token), both ways
            tiny_loc = timed(lambda: compute_logps(model, [[1]], [[2]], 1.0), a.reps)[0]
            tiny_rem = timed(lambda: ref_logps(url, [[1]], [[2]], 1.0, retry_for=0), a.reps)[0]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    # the wire format's share, timed in process: what the client and the server each encode and decode
    req = encode_request(prompts, completions, 1.0)
    ans = encode_response(want)
    lens = [len(c) for c in completions]
    wire = {"encode request (client)": timed(lambda: encode_request(prompts, completions, 1.0), 50)[0],
            "decode request (server)": timed(lambda: decode_request(req, vocab_size=V, max_seqs=1024,
                                                                    max_tokens=262144), 50)[0],
            "encode answer (server)": timed(lambda: encode_response(want), 50)[0],
            "decode answer (client)": timed(lambda: decode_response(ans, lens), 50)[0]}
    med = lambda xs: sorted(xs)[len(xs) // 2]
    loc, rem = med(t_local), med(t_remote)
    n_par = sum(p.numel() for p in model.parameters())
    print(f"\n{machine()}; model {a.model or a.size} ({n_par / 1e6:.2f}M parameters); {a.seqs} sequences x "
          f"({a.prompt_len} prompt + {a.completion_len} completion) tokens, micro-batch {a.micro_batch}, "
          f"{a.threads} torch thread(s) each side; request {len(req)} B, answer {len(ans)} B; median of {a.reps}")
    rows = [["in-process compute_logps", f"{1000 * loc:.1f}", "1.00x"],
            ["ref_server over loopback", f"{1000 * rem:.1f}", f"{rem / loc:.2f}x"]]
    rows += [[f"  of which {k}", f"{1000 * v:.2f}", f"{v / loc:.3f}x"] for k, v in wire.items()]
    rest = rem - loc - sum(wire.values())
    rows += [["  of which HTTP, sockets, threads (rest)", f"{1000 * rest:.1f}", f"{rest / loc:.3f}x"]]
    rows += [["smallest request (1+1 tokens), in-process", f"{1000 * tiny_loc:.1f}", ""],
             ["smallest request (1+1 tokens), over loopback", f"{1000 * tiny_rem:.1f}", ""]]
    print_table(["path", "ms per request", "vs in-process"], rows)


if __name__ == "__main__":
    main()
