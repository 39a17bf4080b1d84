"""What the reference server costs: per-token log-probs through ref_server.py over loopback (the real server, started
as a subprocess on a free port; the trainer's client `ref_client.ref_logps`) against the same forward in this
process (`ref_server.compute_logps`, the function the server runs), on the same model, batch and thread count,
and a POST /reload of the served model's own folder.

    python bench/ref_overhead.py                      # demo model, 64 sequences of 16 prompt + 12 completion tokens
    python bench/ref_overhead.py --size big --seqs 16 --prompt-len 64 --completion-len 128   # ~67M random model
    python bench/ref_overhead.py --size long --seqs 2 --prompt-len 4096 --completion-len 4096   # 2 x 8,192 tokens
    git show OLD:ref_server.py > /tmp/old_ref_server.py
    python bench/ref_overhead.py --baseline /tmp/old_ref_server.py   # another version's server, side by side

The two sides alternate, --reps times each after two warm-up calls; the table gives medians, their ratio (goal
<= 1.15x) and where the difference goes: the wire format (encode/decode of request and answer, timed here in
process) and the rest (HTTP, sockets, the server's threads), and the smallest request's time both ways (the fixed
cost of a request). Both answers are checked to be equal.
"""
import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile

from _common import BIG, ROOT, count, demo_model, end_on_stops, machine, print_table, random_model, timed

TOKEN = "bench"


def start_server(server, path, a, log, procs):
    """`server` (a ref_server.py) on `path`, /reload on for the folder holding `path`, put in
    `procs` once started (the caller stops it, however this ends) -> its url, once up."""
    from placement import free_port   # here: placement imports torch, which --help need not wait for
    from ref_client import RefServerError, wait_for_server
    url = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, server, "--model", path, "--port", url.rsplit(":", 1)[1],
                             "--threads", str(a.threads), "--checkpoint-dir", os.path.dirname(path)],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "REF_SERVER_TOKEN": TOKEN})
    procs.append(proc)
    for _ in range(240):
        if proc.poll() is not None:
            failed(f"{server} exited with code {proc.returncode}", log)
        try:
            wait_for_server(url, timeout=1)
            return url
        except RefServerError:
            pass
    failed(f"{server} did not come up in 240 s", log)


def failed(what, log):
    """The servers' log's end, then one line: the log is in a folder removed on the way out."""
    with open(log.name) as f:
        print(f.read()[-3000:], file=sys.stderr)
    raise SystemExit(f"ref_overhead.py: {what} (the end of its log is above)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local HF model folder (default: the demo's warm-started model)")
    p.add_argument("--size", choices=["demo", "big", "long"], default="demo",
                   help="big: a random ~67M-parameter model; long: the demo's shape with an 8,192-token context")
    p.add_argument("--baseline", help="another version's ref_server.py, timed side by side")
    p.add_argument("--seqs", type=count, default=64, help="sequences per request")
    p.add_argument("--prompt-len", type=count, default=16)
    p.add_argument("--completion-len", type=count, default=12)
    p.add_argument("--threads", type=count, default=1, help="torch threads, both sides (the demo's server runs 1)")
    p.add_argument("--reps", type=count, default=20, help="timed calls per side (median)")
    a = p.parse_args()
    # a stop ends the servers started, as an error does (the `finally` below)
    end_on_stops()
    import torch
    torch.set_num_threads(a.threads)
    from ref_client import ref_logps, reload_reference
    from ref_client import decode_response, encode_request, in_requests, split_to_fit
    from ref_server import compute_logps, decode_request, encode_response, load_model, parse_args
    shapes = {"big": BIG, "long": dict(hidden=128, layers=2, heads=4, max_len=8192)}
    servers = {"ref_server over loopback": "ref_server.py", "baseline over loopback": a.baseline}
    servers = {name: file for name, file in servers.items() if file}
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "server.log"), "w+") as log:
        path = (random_model(os.path.join(tmp, "m"), **shapes[a.size]) if a.size in shapes and not a.model
                else demo_model(a.model))
        procs = []
        try:
            urls = [start_server(file, path, a, log, procs) for file in servers.values()]
            model = load_model(path)
            rng, V = random.Random(0), model.config.vocab_size
            prompts = [[rng.randrange(V) for _ in range(a.prompt_len)] for _ in range(a.seqs)]
            completions = [[rng.randrange(V) for _ in range(a.completion_len)] for _ in range(a.seqs)]
            # the forward passes the server runs: the client's requests, at the server's default limits
            limits = vars(parse_args(["--model", path]))
            parts = split_to_fit(prompts, completions, limits)
            local = lambda: in_requests(prompts, completions, limits,
                                        lambda ps, cs: compute_logps(model, ps, cs, 1.0))
            remote = {url: lambda url=url: ref_logps(url, prompts, completions, 1.0, retry_for=0, token=TOKEN)
                      for url in urls}
            for _ in range(2):
                want = local()
                for url, call in remote.items():
                    diff = max((g - w).abs().max().item() for g, w in zip(call(), want))
                    assert diff < 1e-4, f"{url}'s answer differs from the in-process forward by {diff}"
            t_local, t_remote, t_tiny, t_reload = [], *({u: [] for u in urls} for _ in range(3))
            for _ in range(a.reps):   # alternate, so a noisy neighbour hits every side alike
                t_local.append(timed(local, 1)[0])
                for url in urls:
                    t_remote[url].append(timed(remote[url], 1)[0])
                    # the fixed cost of a request: the smallest one (1 sequence, 1 prompt + 1 completion token)
                    tiny = lambda: ref_logps(url, [[1]], [[2]], 1.0, retry_for=0, token=TOKEN)
                    t_tiny[url].append(timed(tiny, 1)[0])
                    t_reload[url].append(timed(lambda: reload_reference(url, path, retry_for=0, token=TOKEN), 1)[0])
            tiny_loc = timed(lambda: compute_logps(model, [[1]], [[2]], 1.0), a.reps)[0]
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=30)
    # the wire format's share, timed in process: what the client and the server each encode and decode
    req = encode_request(prompts, completions, 1.0)
    ans = encode_response(want)
    lens = [len(c) for c in completions]
    wire = {"encode request (client)": timed(lambda: encode_request(prompts, completions, 1.0), 50)[0],
            "decode request (server)": timed(lambda: decode_request(req, vocab_size=V, max_seqs=1024,
                                                                    max_tokens=10**9), 50)[0],
            "encode answer (server)": timed(lambda: encode_response(want), 50)[0],
            "decode answer (client)": timed(lambda: decode_response(ans, lens), 50)[0]}
    med = statistics.median
    loc = med(t_local)
    n_par = sum(p.numel() for p in model.parameters())
    print(f"\n{machine()}; model {a.model or a.size} ({n_par / 1e6:.2f}M parameters); {a.seqs} sequences x "
          f"({a.prompt_len} prompt + {a.completion_len} completion) tokens, {len(parts)} forward pass(es), "
          f"{a.threads} torch thread(s) each side; request {len(req)} B, answer {len(ans)} B; median of {a.reps}")
    rows = [["in-process compute_logps", f"{1000 * loc:.1f}", "1.00x"]]
    rows += [[f"  of which {k}", f"{1000 * v:.2f}", f"{v / loc:.3f}x"] for k, v in wire.items()]
    rows += [["smallest request (1+1 tokens), in-process", f"{1000 * tiny_loc:.1f}", ""]]
    for name, url in zip(servers, urls):
        rem = med(t_remote[url])
        rows += [[name, f"{1000 * rem:.1f}", f"{rem / loc:.2f}x"],
                 ["  of which HTTP, sockets, threads (rest)", f"{1000 * (rem - loc - sum(wire.values())):.1f}", ""],
                 ["  smallest request (1+1 tokens)", f"{1000 * med(t_tiny[url]):.1f}", ""],
                 ["  POST /reload of the served folder", f"{1000 * med(t_reload[url]):.1f}", ""]]
    print_table(["path", "ms per request", "vs in-process"], rows)


if __name__ == "__main__":
    main()
