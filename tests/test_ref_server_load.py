"""ref_server under load: 8 client threads send 200 realistic requests to the real server (one forward at a time);
every answer must equal the in-process forward. Throughput and latency are printed (`pytest -s`), not asserted.
And its memory: the peak stays flat as a request grows in sequences and in length."""
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import pytest
import torch

from ref_client import ref_logps
from ref_server import compute_logps
from test_ref_server import (env_without_token, model, server_log, spawn_server, stop_server,  # noqa: F401
                             wait_up)

V = 108  # tiny model's vocab
CLIENTS, REQUESTS = 8, 200
LOAD_TIMEOUT = 240  # seconds for all of them; the test fails (and stops its clients) past it


def make_requests(n, seed=0):
    """GRPO-like batches: 4-8 sequences of 10-60 tokens (prompt + completion), various temperatures."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        lens = [rng.randint(10, 60) for _ in range(rng.randint(4, 8))]
        prompt_lens = [rng.randint(1, length - 1) for length in lens]
        seqs = [[rng.randrange(V) for _ in range(length)] for length in lens]
        out.append(([s[:p] for s, p in zip(seqs, prompt_lens)], [s[p:] for s, p in zip(seqs, prompt_lens)],
                    rng.choice([1.0, 1.0, 0.7, 1.3])))
    return out


@pytest.fixture(scope="module")
def load_server(tiny_model, tmp_path_factory):
    """The server as a user starts it: loopback, no token (allowed there), default limits, 1 torch thread."""
    proc, url, log = spawn_server(tiny_model, tmp_path_factory.mktemp("ref_server_load") / "log.txt")
    try:
        yield wait_up(proc, url, log), log
    finally:
        stop_server(proc, log)


def test_load(load_server, model):
    url, log = load_server
    requests_ = make_requests(REQUESTS)

    def send(i):
        prompts, completions, temperature = requests_[i]
        t = time.perf_counter()
        got = ref_logps(url, prompts, completions, temperature, timeout=60, retry_for=0)
        return i, got, time.perf_counter() - t

    answers, latencies = {}, []
    t0 = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as ex:
        futures = [ex.submit(send, i) for i in range(REQUESTS)]
        try:
            for f in as_completed(futures, timeout=LOAD_TIMEOUT):
                i, got, latency = f.result()
                answers[i] = got
                latencies.append(latency)
        finally:  # on a failure or the timeout: queued requests are dropped, running ones end (timeout=60)
            ex.shutdown(wait=True, cancel_futures=True)
    wall = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=100)
    print(f"\nref_server load: {REQUESTS} requests, {CLIENTS} clients, {wall:.2f} s: "
          f"{REQUESTS / wall:.1f} requests/s, latency p50 {1000 * q[49]:.1f} ms, p99 {1000 * q[98]:.1f} ms, "
          f"{sum(len(c) for _, cs, _ in requests_ for c in cs) / wall:.0f} completion tokens/s")

    assert sorted(answers) == list(range(REQUESTS)) and "Traceback" not in server_log(log)
    for i, (prompts, completions, temperature) in enumerate(requests_):  # after the timing: not competing for CPU
        want = compute_logps(model, prompts, completions, temperature)
        for g, w, c in zip(answers[i], want, completions, strict=True):
            assert g.shape == (len(c),)
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def peak_rss_mb(pid, send):
    """The process's peak resident memory (MB) while `send()` runs. Writing 5 to clear_refs resets the peak
    (VmHWM) to the current size (Linux >= 4.0), so each measurement starts from where the process is."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    send()
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def test_peak_memory_stays_flat_as_the_request_grows(tmp_path):
    """A forward's memory grows with rows x width^2 where rows are padded (the attention mask): on the old
    server two sequences of 4,096 and 4,095 tokens cost 130 MB more than one, eight 540 MB. A request is one
    forward pass of at most --max-tokens padded tokens, or one longer sequence, unpadded and without a mask (the
    client splits a batch so), so the peak of any batch is that of one sequence at the model's context length
    (the longest the server accepts), whatever the number and lengths of its sequences."""
    from demo.tiny_model import build_model, build_tokenizer, save
    tok = build_tokenizer()
    model = build_model(tok)
    model.config.max_position_embeddings = 4096   # the tiny model's 1,024 is too short to show the growth
    path = save(model, tok, str(tmp_path / "model"))
    # glibc raises its mmap threshold after a big free, so a later request's tensors may come from memory the
    # heap kept, uncounted by a peak reset to the current size: 1 run in 3 compared the requests unevenly.
    # A fixed threshold maps and unmaps every big tensor, and each peak is the request's own.
    env = {**env_without_token(), "MALLOC_MMAP_THRESHOLD_": str(2**16)}
    proc, url, log = spawn_server(path, tmp_path / "log.txt", "--max-tokens", "1024", env=env)
    try:
        wait_up(proc, url, log)

        def request(n, length):   # n sequences of about `length` tokens, each one shorter: all padded
            lens = [length - i for i in range(n)]
            return lambda: ref_logps(url, [[5] * (k // 2) for k in lens], [[6] * (k - k // 2) for k in lens],
                                     1.0, timeout=300, retry_for=0)
        request(2, 64)()   # the first forward's one-off allocations (thread pools, kernels)
        small = peak_rss_mb(proc.pid, request(1, 64))
        peaks = {(n, length): round(peak_rss_mb(proc.pid, request(n, length)) - small, 1)
                 for n, length in [(1, 4096), (2, 1024), (2, 4096), (8, 4096), (64, 512)]}
        print(f"\nref_server peak RSS, MB over one 64-token sequence ({small:.0f} MB): {peaks}")
        one = peaks.pop((1, 4096))
        assert max(peaks.values()) < one + 16, (one, peaks)
        assert "Traceback" not in server_log(log)
    finally:
        stop_server(proc, log)
