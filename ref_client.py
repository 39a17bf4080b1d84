"""The reference server's client, as the trainer's engines call it: ref_logps (split across servers
and within each one's limits), reload_reference, wait_for_server. The wire format is ref_server.py's
(its REQUEST_KEYS, read_body, decode_request): encode_request and decode_response build on it. check_reference
is the trainer's start-up check that every server serves the model it starts from."""
import json
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import requests
import torch
from safetensors.torch import save as st_save

from lora import base_model_view
from ref_server import REQUEST_KEYS, WireError, model_fingerprint, read_body


def encode_request(prompts, completions, temperature) -> bytes:
    """The /logps body that ref_server.decode_request reads: REQUEST_KEYS as int32, temperature."""
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
    columns = ([t for s in seqs for t in s], [len(s) for s in seqs], [len(p) for p in prompts])
    return st_save({k: torch.tensor(v, dtype=torch.int32) for k, v in zip(REQUEST_KEYS, columns)},
                   metadata={"temperature": repr(float(temperature))})


def decode_response(body: bytes, completion_lens: list[int]) -> list[torch.Tensor]:
    """Answer body (ref_server.encode_response) -> one float32 tensor of log-probs per completion.
    Raises WireError."""
    tensors, _ = read_body(body)
    t = tensors.get("logps")
    if t is None or set(tensors) != {"logps"} or t.dtype != torch.float32 or t.dim() != 1:
        raise WireError(f"answer must hold exactly one 1-D float32 'logps', got {list(tensors)}")
    if len(t) != sum(completion_lens):
        raise WireError(f"answer has {len(t)} log-probs, expected {sum(completion_lens)}")
    return list(t.split(list(completion_lens)))



class RefServerError(RuntimeError):
    """The reference server could not be reached, refused the request (`status`: its HTTP code), or
    answered log-probs that are not finite."""

    def __init__(self, msg, status=None):
        super().__init__(msg)
        self.status = status


_local = threading.local()
# url -> the server's limits from its /health, read on the first request
_limits = {}


def _session() -> requests.Session:
    """This thread's Session (requests 2.34: not documented thread-safe): it keeps connections."""
    if not hasattr(_local, "session"):
        _local.session = requests.Session()
    return _local.session


def _error_text(r) -> str:
    try:
        return r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


def _call(method, endpoint, body=None, headers=None, *, timeout, retry_for, backoff):
    """One request with retries: connection errors, answers cut short and 5xx are retried, sleeping
    backoff * 1, 2, 4, ... seconds (at most 30 s each) for up to `retry_for` seconds in all, so a
    server that restarts is waited for; each retry says so on stderr. A 4xx raises at once (the
    request itself is wrong; 413: split the batch), and so does a read timeout (the server is alive
    but slow: a resend would queue a second copy). urllib3's Retry is not used: it retries before
    the body is read (a 200 cut short passes), counts attempts, not seconds, and says nothing."""
    start, attempt, last = time.monotonic(), 0, None
    while True:
        try:
            r = _session().request(method, endpoint, data=body, headers=headers, timeout=timeout)
            # a server killed mid-answer can leave a 200 cut short, even before its headers. Content-Length
            # counts the bytes on the wire, which a proxy may have gzipped (requests asks for it and
            # decompresses): those are compared. A chunked answer (none) ends in a last chunk urllib3 checks
            announced, received = r.headers.get("Content-Length"), r.raw.tell()
            if r.status_code == 200 and not r.raw.chunked and announced != str(received):
                last = f"HTTP 200 cut short ({received} bytes, {announced} announced)"
            elif r.status_code < 500:
                break
            else:
                last = f"HTTP {r.status_code}: {_error_text(r)}"
        # ConnectionError covers ConnectTimeout too
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
            last = f"{type(e).__name__}: {e}"
        except requests.Timeout as e:
            raise RefServerError(f"{endpoint}: no answer within {timeout}s ({e})") from e
        pause = min(30.0, backoff * 2 ** attempt)
        # given up as soon as the next pause would end past the window: said in the time it took
        if (spent := time.monotonic() - start) + pause > retry_for:
            raise RefServerError(f"{endpoint} failed after {attempt + 1} attempts in {spent:.1f}s (another "
                                 f"would end past the {retry_for:g}s allowed); last error: {last}")
        # the event, not a duration, tells a reader (and the tests) that the server was away
        print(f"ref_server client: {method} {endpoint} failed ({last}); retrying in {pause:g}s",
              file=sys.stderr, flush=True)
        time.sleep(pause)
        attempt += 1
    if r.status_code != 200:
        raise RefServerError(f"{endpoint} answered HTTP {r.status_code}: {_error_text(r)}",
                             r.status_code)
    return r


def _auth(token):
    return {"Authorization": f"Bearer {token}"} if token else {}


def _fits(limits, n_seqs, width, n_tokens):
    # max_tokens: padded, the server's one forward pass; a body is 4 bytes per token id, 8 per
    # sequence (its two lengths) and a header well under 1 KiB
    return (n_seqs <= limits.get("max_seqs", math.inf)
            and n_seqs * width <= limits.get("max_tokens", math.inf)
            and 4 * n_tokens + 8 * n_seqs + 1024 <= limits.get("max_body", math.inf))


def split_to_fit(prompts, completions, limits) -> list[list[int]]:
    """Index lists, shortest sequences first, each a request within the server's limits (/health)
    whose forward pass is at most a quarter padding: a batch of mixed lengths goes as a request per
    run of similar ones (25M parameters, 48 new tokens: a step's reference call 5.5 -> 2.9 s,
    bench/README.md section 13). A sequence that alone exceeds the limits goes alone, and the
    server's 413 says why."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    parts, tokens = [[]], 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        # sorted: this sequence is the longest yet, its length the padded width
        n, width = len(parts[-1]) + 1, lengths[i]
        padded = 3 * n * width > 4 * (tokens + width)
        if parts[-1] and (padded or not _fits(limits, n, width, tokens + width)):
            parts, tokens = parts + [[]], 0
        parts[-1].append(i)
        tokens += lengths[i]
    return parts


def in_requests(prompts, completions, limits, answer) -> list:
    """answer(prompts, completions) -> one result per sequence, called on each request split_to_fit
    cuts -> the results, back in input order."""
    out = [None] * len(prompts)
    for part in split_to_fit(prompts, completions, limits):
        results = answer([prompts[i] for i in part], [completions[i] for i in part])
        for i, result in zip(part, results, strict=True):
            out[i] = result
    return out


def even_shares(n, parts) -> list[range]:
    """range(n) cut into `parts` consecutive ranges whose sizes differ by at most one, the first
    ones the larger: a batch's sequences split across servers (and prompts across engines)."""
    size, extra = divmod(n, parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def server_urls(urls) -> list[str]:
    """--ref-url "http://a:1,http://b:2" -> the servers' URLs, in order."""
    return [u.strip().rstrip("/") for u in urls.split(",") if u.strip()]


def url_error(urls, flag="--ref-url") -> str | None:
    """Why `flag` (--ref-url, or --gen-urls) names no server it can reach, or None."""
    servers = server_urls(urls)
    if bad := [u for u in servers if not u.startswith(("http://", "https://"))]:
        return f"{flag} {bad[0]}: a server's URL starts with http:// (e.g. http://{bad[0]})"
    return None if servers else f"{flag} must name at least one server"


def _on_each(fn, items):
    """fn(item) for every item, each in a thread of its own (the servers work at once) -> the
    results, in order; the first error raises once all are done."""
    if len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def ref_logps(urls, prompts, completions, temperature, *, timeout=60, retry_for=30.0, backoff=1.0,
              token=os.environ.get("REF_SERVER_TOKEN")):
    """Reference log-probs of each completion token -> list of float32 (len(completion),) tensors.

    urls: one server, or several comma-separated: the sequences are cut into one consecutive share
    per server (even_shares), requested in parallel and put back in order. Raises RefServerError,
    also when a log-prob is not finite."""
    servers = server_urls(urls)
    parts = even_shares(len(prompts), len(servers))
    shares = [(url, part) for url, part in zip(servers, parts) if part]
    one = lambda share: _server_logps(share[0], prompts[share[1].start:share[1].stop],
                                      completions[share[1].start:share[1].stop], temperature, token,
                                      dict(timeout=timeout, retry_for=retry_for, backoff=backoff))
    return [t for part in _on_each(one, shares) for t in part]


def _server_logps(url, prompts, completions, temperature, token, retry):
    """One server's share: sent in as many requests (forward passes) as its limits need (read from
    /health once per URL, and again after a 413 from a server restarted with smaller ones)."""
    headers = {"Content-Type": "application/octet-stream", **_auth(token)}

    def answer(ps, cs):
        r = _call("POST", url + "/logps", encode_request(ps, cs, temperature), headers, **retry)
        return decode_response(r.content, [len(c) for c in cs])
    for attempt in range(2):
        if url not in _limits:
            _limits[url] = _call("GET", url + "/health", **retry).json()
        try:
            out = in_requests(prompts, completions, _limits[url], answer)
            break
        except RefServerError as e:
            if e.status != 413 or attempt:
                raise
            del _limits[url]
    if bad := [i for i, t in enumerate(out) if not torch.isfinite(t).all()]:
        raise RefServerError(f"{url}/logps answered non-finite log-probs for sequences {bad[:10]}")
    return out


def reload_reference(urls, path, *, timeout=600, retry_for=30.0,
                     token=os.environ.get("REF_SERVER_TOKEN")) -> list[dict]:
    """Ask every server in `urls` (comma-separated), at once, to load the HF checkpoint in folder
    `path` (on each server's file system, under its --checkpoint-dir) as the new reference -> their
    new /health. Only a path crosses the wire, never weights."""
    headers = {"Content-Type": "application/json", **_auth(token)}
    reload = lambda url: _call("POST", url + "/reload", json.dumps({"path": path}), headers,
                               timeout=timeout, retry_for=retry_for, backoff=1.0).json()
    return _on_each(reload, server_urls(urls))


def wait_for_server(url, timeout=120.0, interval=0.5, note=None) -> dict:
    """Poll GET /health until it answers 200 (-> its JSON) or `timeout` seconds pass (then
    RefServerError). `note`: said on stderr, once, if the first try fails."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            r = _session().get(url.rstrip("/") + "/health", timeout=min(5.0, timeout))
            if r.status_code == 200:
                return r.json()
            last = f"HTTP {r.status_code}"
        except requests.RequestException as e:
            last = f"{type(e).__name__}: {e}"
        if note:
            print(note, file=sys.stderr, flush=True)
            note = None
        time.sleep(interval)
    raise RefServerError(f"{url}/health not ready after {timeout:g}s; last error: {last}")


def check_reference(urls, wait_s, policy, refreshed, model_name):
    """Wait for every reference server; each must serve the model we start from (else, or if none answers,
    one line says what to do), or, on a run resumed after a reference refresh, loads that checkpoint again."""
    fingerprint = None if refreshed else model_fingerprint(base_model_view(policy))
    for url in server_urls(urls):
        start = f"python ref_server.py --model {model_name} --port {urlsplit(url).port}"
        try:
            served = wait_for_server(url, timeout=wait_s, note=f"grpo_train.py: waiting up to {wait_s:g}s "
                                     f"(--ref-wait) for the reference server at {url}")
        except RefServerError:
            raise SystemExit(f"grpo_train.py: {url}/health not ready after {wait_s:g}s (--ref-wait): start "
                             f"the reference server ({start}), or train without one (--beta 0)") from None
        if fingerprint and served["fingerprint"] != fingerprint:
            raise SystemExit(f"grpo_train.py: {url} serves another model than --model {model_name}: it serves "
                             f"{served['model']}; restart it ({start})")
    if refreshed:
        reload_reference(urls, refreshed, token=os.environ.get("REF_SERVER_TOKEN"))
