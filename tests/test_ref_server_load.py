"""ref_server under load: 8 client threads send 200 realistic requests to the real server (one forward at a time);
every answer must equal the in-process forward. Throughput and latency are printed (`pytest -s`), not asserted."""
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import pytest
import torch

from ref_server import compute_logps, ref_logps
from test_ref_server import model, server_log, spawn_server, stop_server, wait_up  # noqa: F401 (fixture)

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
