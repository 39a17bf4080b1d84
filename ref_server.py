"""Reference-model server for GRPO: holds the frozen reference model, answers per-token log-probs.

    python ref_server.py --model Qwen/Qwen2.5-0.5B-Instruct --device cuda:0 --port 59875

GET  /health -> {"status": "ok", "model", "vocab_size", "fingerprint", "max_seqs",
                 "max_tokens", "max_seq_len", "max_body"}: the limits let a client split a
                 batch to fit (ref_logps does)
POST /logps  -> body and answer in the wire format below (application/octet-stream)
POST /reload -> {"path": "..."}: read the weights of that HF checkpoint folder (under
                --checkpoint-dir) into the served model; needs a token; weights never cross
                the wire (grpo_train.py --ref-sync-every)

Wire format (tested with safetensors 0.8.0): a safetensors buffer, i.e. an 8-byte little-endian
header length, a JSON header (dtype, shape, byte offsets, str->str metadata) and raw
little-endian tensor bytes, so only plain numbers cross the wire. Request: int32 `input_ids`
(every sequence's prompt+completion, concatenated), int32 `seq_lens` (B,) and int32
`prompt_lens` (B,), metadata {"temperature": "1.0"}. Answer: float32 `logps`, each sequence's
completion-token log-probs concatenated.

Status codes: 400 malformed request, Content-Length or path, or a temperature below 1e-3; 401
missing/wrong token (only with --token); 403 /reload off, or a folder or file it would read
outside --checkpoint-dir or through a symlink; 404 unknown path; 405 wrong method; 408 request
line and headers not sent within --header-timeout; 411 no Content-Length; 413 body over
--max-body-mb, more than --max-seqs sequences or --max-tokens tokens (split the batch), or a
sequence longer than the model's context; 422 a /reload folder that is not a complete
safetensors checkpoint of the served model (its config, tensor names, shapes, float dtypes);
431 request line and headers over 64 KiB; 500 the server's own fault (a bug, or a model whose
log-probs are not finite); 503 more than --max-connections connections at once. Every error
body is {"error": "..."}. A --host other than loopback needs a token (--token or
$REF_SERVER_TOKEN), or --insecure.

This file imports no other file of the project: copy it alone to the reference machine. The
trainer imports it for the client (ref_logps, reload_reference, wait_for_server) and
model_fingerprint, so importing it must stay cheap: no transformers, no model, no server at the
top.
"""
import argparse
import errno
import functools
import hashlib
import hmac
import io
import ipaddress
import json
import math
import os
import stat
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import bottle
import requests
import torch
from safetensors.torch import load as st_load, save as st_save

REQUEST_KEYS = ("input_ids", "seq_lens", "prompt_lens")
# below this, logits / T overflow float32 (1e-45 gave -inf, 1e-300 NaN); samplers treat
# T < 1e-3 as greedy
MIN_TEMPERATURE = 1e-3
# one forward pass's bounds (--micro-batch, --max-forward-tokens): the token budget bounds memory;
# the row limit keeps short sequences in few passes (a demo batch: 2, docs/reference-server.md)
MICRO_BATCH, MAX_FORWARD_TOKENS = 64, 8192
# the config fields model_fingerprint hashes (a /reload compares the whole config: check_config)
ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads")


class WireError(ValueError):
    """An invalid request (a /logps body, a /reload path or folder) or answer body. `status` is the
    HTTP code the server answers it with."""

    def __init__(self, msg, status=400):
        super().__init__(msg)
        self.status = status


class RefServerError(RuntimeError):
    """The reference server could not be reached, refused the request (`status`: its HTTP code), or
    answered log-probs that are not finite."""

    def __init__(self, msg, status=None):
        super().__init__(msg)
        self.status = status


# ----------------------------------------------------------------------------- wire format

def encode_request(prompts: list[list[int]], completions: list[list[int]],
                   temperature: float) -> bytes:
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
    return st_save({"input_ids": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
                    "seq_lens": torch.tensor([len(s) for s in seqs], dtype=torch.int32),
                    "prompt_lens": torch.tensor([len(p) for p in prompts], dtype=torch.int32)},
                   metadata={"temperature": repr(float(temperature))})


def _load(body: bytes) -> tuple[dict, dict]:
    """Parse a safetensors buffer -> (tensors, metadata); any failure is the sender's fault:
    WireError."""
    if not body:
        raise WireError("empty body")
    try:
        # checks the header and that offsets, shapes and dtypes match the bytes
        tensors = st_load(body)
        # st_load does not return the metadata, so read it from the header it has just validated
        meta = json.loads(body[8:8 + int.from_bytes(body[:8], "little")]).get("__metadata__") or {}
    # SafetensorError, torch refusing a dtype or shape, json: all mean "bad bytes"
    except Exception as e:
        # torch's C++ errors go on with a backtrace: keep the first line
        first_line = str(e).partition("\n")[0][:200]
        raise WireError(f"not a valid safetensors body: {first_line}") from e
    return tensors, meta


def _check_1d_int32(tensors, name):
    if name not in tensors:
        raise WireError(f"missing tensor {name!r}")
    t = tensors[name]
    if t.dtype != torch.int32 or t.dim() != 1:
        raise WireError(f"{name} must be a 1-D int32 tensor, "
                        f"got {t.dtype} of shape {list(t.shape)}")
    return t.long()


def decode_request(body: bytes, *, vocab_size: int, max_seqs: int, max_tokens: int,
                   max_seq_len=None):
    """Validate a request body -> (prompts, completions, temperature). Raises WireError (status
    400/413). max_seq_len: the model's context length (None: no limit)."""
    tensors, meta = _load(body)
    extra = set(tensors) - set(REQUEST_KEYS)
    if extra:
        raise WireError(f"unexpected tensors {sorted(extra)}; expected {list(REQUEST_KEYS)}")
    ids, seq_lens, prompt_lens = (_check_1d_int32(tensors, k) for k in REQUEST_KEYS)
    B = len(seq_lens)
    if B == 0:
        raise WireError("no sequences")
    if len(prompt_lens) != B:
        raise WireError(f"prompt_lens has {len(prompt_lens)} entries but seq_lens has {B}")
    if B > max_seqs:
        raise WireError(f"{B} sequences > limit {max_seqs}", status=413)
    if len(ids) > max_tokens:
        raise WireError(f"{len(ids)} tokens > limit {max_tokens}", status=413)
    if (seq_lens <= 0).any():
        raise WireError("seq_lens must be > 0")
    if seq_lens.sum().item() != len(ids):
        raise WireError(f"sum(seq_lens)={seq_lens.sum().item()} != len(input_ids)={len(ids)}")
    if max_seq_len and seq_lens.max() > max_seq_len:  # positions the model was never trained on
        raise WireError(f"a sequence of {seq_lens.max().item()} tokens > the model's context "
                        f"length {max_seq_len}", status=413)
    if ((prompt_lens < 1) | (prompt_lens >= seq_lens)).any():  # >= 1 completion token to score
        raise WireError("every prompt_len must be >= 1 and < its seq_len")
    if ids.min() < 0 or ids.max() >= vocab_size:  # ids is not empty: B >= 1 and every seq_len > 0
        raise WireError(f"token ids must be in [0, {vocab_size}), "
                        f"got [{ids.min().item()}, {ids.max().item()}]")
    try:
        temperature = float(meta["temperature"])
    except (KeyError, ValueError) as e:
        raise WireError(f"metadata needs a numeric 'temperature', got {meta}") from e
    if not (math.isfinite(temperature) and temperature >= MIN_TEMPERATURE):
        raise WireError(f"temperature must be finite and >= {MIN_TEMPERATURE}, got {temperature}")
    seqs = ids.split(seq_lens.tolist())
    prompts = [s[:p].tolist() for s, p in zip(seqs, prompt_lens.tolist())]
    completions = [s[p:].tolist() for s, p in zip(seqs, prompt_lens.tolist())]
    return prompts, completions, temperature


def encode_response(logps: list[torch.Tensor]) -> bytes:
    flat = [t.detach().float().flatten().cpu() for t in logps]
    return st_save({"logps": torch.cat(flat).contiguous() if flat else torch.zeros(0)})


def decode_response(body: bytes, completion_lens: list[int]) -> list[torch.Tensor]:
    """Answer body -> one float32 tensor of log-probs per completion. Raises WireError."""
    tensors, _ = _load(body)
    t = tensors.get("logps")
    if t is None or set(tensors) != {"logps"} or t.dtype != torch.float32 or t.dim() != 1:
        raise WireError(f"answer must hold exactly one 1-D float32 'logps', got {list(tensors)}")
    if len(t) != sum(completion_lens):
        raise WireError(f"answer has {len(t)} log-probs, "
                        f"expected sum(completion_lens)={sum(completion_lens)}")
    return list(t.split(list(completion_lens)))


# ------------------------------------------------------------------ client (used by the trainer)

_local = threading.local()
_limits = {}  # url -> the server's limits from its /health, read on the first request


def _session() -> requests.Session:
    """This thread's persistent Session (requests 2.34: a Session is not documented as thread-safe),
    so a server that keeps connections open is not connected to anew for every request. This one
    (wsgiref) answers HTTP/1.0 and closes each connection, so here it saves only building a Session
    per request: measured, the smallest request's round trip stays at about 3 ms either way."""
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
    request itself is wrong; 413 = split the batch). A read timeout is not retried either: the
    server is alive but slow, and a resend would queue a second copy."""
    deadline, attempt, last = time.monotonic() + retry_for, 0, None
    while True:
        try:
            r = _session().request(method, endpoint, data=body, headers=headers, timeout=timeout)
            # a server killed mid-answer can leave a 200 cut short, even before its Content-Length
            # header
            announced = r.headers.get("Content-Length")
            if r.status_code == 200 and announced != str(len(r.content)):
                last = f"HTTP 200 cut short ({len(r.content)} bytes, {announced} announced)"
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
        if time.monotonic() + pause > deadline:
            raise RefServerError(f"{endpoint} failed after {attempt + 1} attempts in "
                                 f"{retry_for:g}s; last error: {last}")
        # the event, not a duration, is what tells a reader (and the fault tests) that the server
        # was away
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


def _fits(limits, n_seqs, n_tokens):
    # a body is 4 bytes per token id, 8 per sequence (its two lengths) and a header well under
    # 1 KiB; a server older than the limits in /health gets the batch whole, as before
    return (n_seqs <= limits.get("max_seqs", math.inf)
            and n_tokens <= limits.get("max_tokens", math.inf)
            and 4 * n_tokens + 8 * n_seqs + 1024 <= limits.get("max_body", math.inf))


def split_to_fit(prompts, completions, limits) -> list[range]:
    """Consecutive index ranges, each a request within the server's limits (/health). A sequence
    that alone exceeds them gets a range of its own, and the server's 413 says why."""
    ranges, start, tokens = [], 0, 0
    for i, (p, c) in enumerate(zip(prompts, completions)):
        n = len(p) + len(c)
        if i > start and not _fits(limits, i - start + 1, tokens + n):
            ranges.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    return ranges + [range(start, len(prompts))]


def even_shares(n, parts) -> list[range]:
    """range(n) cut into `parts` consecutive ranges whose sizes differ by at most one, the first
    ones the larger: a batch's sequences split across servers (and prompts across engines)."""
    size, extra = divmod(n, parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def server_urls(urls) -> list[str]:
    """--ref-url "http://a:1,http://b:2" -> the servers' URLs, in order."""
    return [u.strip().rstrip("/") for u in urls.split(",") if u.strip()]


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
    """One server's share: sent in as many requests as its limits need (read from /health once per
    URL, and again after a 413 from a server restarted with smaller ones). Retries as _call says,
    for up to `retry_for` seconds per request."""
    headers = {"Content-Type": "application/octet-stream", **_auth(token)}
    for attempt in range(2):
        if url not in _limits:
            _limits[url] = _call("GET", url + "/health", **retry).json()
        out = []
        try:
            for part in split_to_fit(prompts, completions, _limits[url]):
                ps, cs = prompts[part.start:part.stop], completions[part.start:part.stop]
                body = encode_request(ps, cs, temperature)
                r = _call("POST", url + "/logps", body, headers, **retry)
                out += decode_response(r.content, [len(c) for c in cs])
            break
        except RefServerError as e:
            if e.status != 413 or attempt:
                raise
            del _limits[url]
    bad = [i for i, t in enumerate(out) if not torch.isfinite(t).all()]
    if bad:
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


def wait_for_server(url, timeout=120.0, interval=0.5) -> dict:
    """Poll GET /health until it answers 200 (-> its JSON) or `timeout` seconds pass (then
    RefServerError)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            r = _session().get(url.rstrip("/") + "/health", timeout=min(5.0, timeout))
            if r.status_code == 200:
                return r.json()
            last = f"HTTP {r.status_code}"
        except requests.RequestException as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(interval)
    raise RefServerError(f"{url}/health not ready after {timeout}s; last error: {last}")


# ----------------------------------------------------------------------------- model side

def missing_folder(model) -> str | None:
    """Why --model cannot be loaded, or None: it is meant as a local folder (a hub id is "org/name";
    anything else with a slash, or starting with . / ~, is a path) and there is none."""
    local = model.startswith((".", "/", "~")) or model.count("/") > 1
    if local and not os.path.isdir(os.path.expanduser(model)):
        return f"--model {model}: no such folder"
    return None


def exposure_error(host, token, insecure) -> str | None:
    """Why serving on `host` is refused, or None. A host other machines can reach needs a token or
    --insecure.

    Loopback is 'localhost', 127.0.0.0/8 and ::1; anything else (0.0.0.0, a LAN address, a host name
    that could resolve to one) is treated as reachable."""
    if token or insecure or host.lower() == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:  # not an IP address: a host name
        pass
    return (f"--host {host} is reachable from other machines, but no token is set: anyone who "
            "can reach the port could use the server. Set REF_SERVER_TOKEN (or --token), bind "
            "127.0.0.1, or pass --insecure.")


def model_fingerprint(model, samples=64) -> str:
    """Short hash of the architecture and of every weight, to check trainer and server hold the same
    model.

    Per tensor (in name order): its name, shape and `samples` values taken at an even stride through
    it, so any checkpoint that differs from another in more than a few values is told apart at the
    cost of a few thousand numbers. Of the config only ARCH_KEYS are hashed, and the values are
    rounded to bfloat16 so a float32 and a bfloat16 copy agree. The trainer calls it on the policy
    before its first update (the policy starts as the reference)."""
    arch = {k: getattr(model.config, k, None) for k in ARCH_KEYS}
    h = hashlib.sha256(json.dumps(arch, sort_keys=True).encode())
    picked = []
    for name, w in sorted(model.state_dict().items()):
        h.update(f"{name}{list(w.shape)};".encode())
        flat = w.detach().flatten()
        picked.append(flat[::max(1, flat.numel() // samples)][:samples].to(torch.bfloat16))
    h.update(torch.cat(picked).float().cpu().numpy().tobytes())  # one device-to-host copy on a GPU
    return h.hexdigest()[:16]


def default_dtype(device) -> str:
    """float32 on CPU; on CUDA bfloat16 only where the GPU computes in it natively (Ampere and
    later), else float32. torch.cuda.is_bf16_supported() alone (torch 2.13) also counts emulation,
    which on older GPUs is slow and where vLLM's "auto" picks float16; the trainer is to pick the
    same way (issue 15)."""
    cuda = str(device).startswith("cuda")
    native = cuda and torch.cuda.is_bf16_supported(including_emulation=False)
    return "bfloat16" if native else "float32"


def load_model(path, device="cpu", dtype="auto", fp32_lm_head=False):
    from transformers import AutoModelForCausalLM  # here, so importing this module stays light
    dtype = default_dtype(device) if dtype == "auto" else dtype
    # safetensors only: never a checkpoint format that runs code on load (a hub model without them:
    # refused)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                 use_safetensors=True)
    model = model.to(device).eval()
    model.requires_grad_(False)
    if fp32_lm_head:
        # the lm_head in fp32, bf16 input and weight cast up, as grpo_train.py --fp32-lm-head
        # and vLLM 0.32's head_dtype float32 (a /reload copies weights into this same module)
        head = model.get_output_embeddings()
        bias = lambda: None if head.bias is None else head.bias.float()
        head.forward = lambda h: torch.nn.functional.linear(h.float(), head.weight.float(), bias())
    return model


def pad(prompts, completions):
    """Left-pad the prompts and right-pad the completions, so every completion starts at the same
    column P -> input_ids (B, P+T), attention_mask (B, P+T). Pad id 0: the mask, not the id, marks
    padding."""
    P, T = max(map(len, prompts)), max(map(len, completions))
    input_ids = torch.zeros(len(prompts), P + T, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, P - len(p):P + len(c)] = torch.tensor(p + c)
        attention_mask[i, P - len(p):P + len(c)] = 1
    return input_ids, attention_mask


@torch.no_grad()
def forward_logps(model, input_ids, attention_mask, n_completion, temperature, chunk=512):
    """float32 log-prob at `temperature` of each of the last `n_completion` tokens of every row (B,
    T): the numbers grpo_train.completion_logps computes (tests/test_ref_server.py checks), with no
    graph to keep. The lm_head runs on `chunk` tokens at a time, so the (B, T, vocab) logits are
    never all held."""
    # left padding: positions start at 0 per row
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    # get_decoder / get_output_embeddings (transformers 5.19): the body and lm_head of any causal LM
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, use_cache=False).last_hidden_state
    hidden = hidden[:, -n_completion - 1:-1]
    targets = input_ids[:, -n_completion:]
    out = []
    for h, t in zip(hidden.flatten(0, 1).split(chunk), targets.flatten().split(chunk)):
        logits = model.get_output_embeddings()(h).float() / temperature
        out.append(logits.gather(-1, t.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1))
    return torch.cat(out).view(targets.shape)


def micro_batches(lengths, max_seqs, max_tokens) -> list[list[int]]:
    """(prompt_len, completion_len) per sequence -> index lists, one per forward pass. Sorted by
    length, so rows of one pass are padded little; each pass holds at most `max_seqs` rows and
    `max_tokens` padded tokens. A sequence longer than that goes alone: unpadded, it needs no
    attention mask, so its memory grows linearly with its length (a padded pass's mask grows with
    rows x width^2, bounded by max_tokens^2 / 2)."""
    batches, cur, P, T = [], [], 0, 0
    for i in sorted(range(len(lengths)), key=lambda i: sum(lengths[i])):
        p, t = max(P, lengths[i][0]), max(T, lengths[i][1])
        if cur and (len(cur) == max_seqs or (len(cur) + 1) * (p + t) > max_tokens):
            batches.append(cur)
            cur, (p, t) = [], lengths[i]
        cur.append(i)
        P, T = p, t
    return batches + [cur]


def compute_logps(model, prompts, completions, temperature, micro_batch=MICRO_BATCH,
                  max_forward_tokens=MAX_FORWARD_TOKENS):
    """Each completion's float32 log-probs, in input order, a bounded micro-batch at a time."""
    device, out = next(model.parameters()).device, [None] * len(prompts)
    for idx in micro_batches([(len(prompts[i]), len(completions[i])) for i in range(len(prompts))],
                             micro_batch, max_forward_tokens):
        input_ids, attention_mask = pad([prompts[i] for i in idx], [completions[i] for i in idx])
        lp = forward_logps(model, input_ids.to(device), attention_mask.to(device),
                           max(len(completions[i]) for i in idx), temperature)
        for row, i in enumerate(idx):
            out[i] = lp[row, :len(completions[i])].float().cpu()
    return out


# ----------------------------------------------------------------------------- /reload's checks

# config.json fields in which a checkpoint may differ from the served config: none changes what the
# served model computes. Every other field (to_dict(), so defaults included) must be equal, else
# 422.
CONFIG_KEYS_IGNORED = (
    "transformers_version",  # the version that wrote the file
    "_name_or_path",  # where the model was loaded from
    "architectures",  # a class name: the served class runs, whatever the file names
    "dtype", "torch_dtype",  # the server's --dtype decides: the weights are converted to it
    "use_cache",  # forward_logps passes use_cache=False
)
# safetensors dtype names (the format's spec) of the float types a checkpoint's weights may come in
ST_FLOATS = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# NONBLOCK: a FIFO never blocks
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _open_folder(path, checkpoint_dir) -> tuple[str, int]:
    """(absolute path, descriptor) of folder `path`, opened one component at a time from the folder
    of `checkpoint_dir` (which `path` may name by its absolute or its real path), no component a
    symlink."""
    if "\0" in path:
        raise WireError("the path holds a NUL byte")
    # lexical: '..' cannot climb out, and below the root no symlink passes
    folder = os.path.abspath(path)
    roots = (os.path.abspath(checkpoint_dir), os.path.realpath(checkpoint_dir))
    root = next((r for r in roots if os.path.commonpath([folder, r]) == r), None)
    if root is None:
        raise WireError(f"{path!r} is not under the server's --checkpoint-dir", 403)
    try:
        fd = os.open(roots[1], OPEN_FLAGS | os.O_DIRECTORY)
    except OSError as e:
        raise WireError(f"{path!r} is not a checkpoint folder "
                        f"(--checkpoint-dir: {e.strerror})") from e
    for part in os.path.relpath(folder, root).split(os.sep):
        if part == ".":
            continue
        parent = fd
        try:
            # O_NOFOLLOW refuses a symlink (swapped in after this lstat too); the lstat names the
            # reason
            if stat.S_ISLNK(os.stat(part, dir_fd=parent, follow_symlinks=False).st_mode):
                raise WireError(f"{path!r} is not under the server's --checkpoint-dir: "
                                f"{part!r} is a symlink", 403)
            fd = os.open(part, OPEN_FLAGS | os.O_DIRECTORY, dir_fd=parent)
        except OSError as e:
            raise WireError(f"{path!r} is not a checkpoint folder ({part!r}: {e.strerror})") from e
        finally:
            os.close(parent)
    return folder, fd


def _open_file(folder_fd, name, max_bytes) -> tuple[int, int]:
    """(descriptor, size) of regular file `name` in the folder, not a symlink, at most `max_bytes`
    long. Raises FileNotFoundError or WireError."""
    if name in (".", "..") or "/" in name or "\0" in name:
        raise WireError(f"{name!r} is not under the server's --checkpoint-dir: not a file name",
                        403)
    try:
        fd = os.open(name, OPEN_FLAGS, dir_fd=folder_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise WireError(f"{name} is not under the server's --checkpoint-dir: a symlink",
                            403) from e
        raise WireError(f"{name} is not readable: {e.strerror}", 422) from e
    st = os.fstat(fd)  # the file opened, not whatever the name points to now
    if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
        os.close(fd)
        raise WireError(f"{name} is not a regular file of at most {max_bytes} bytes", 422)
    return fd, st.st_size


def _pread(fd, n, offset, name) -> bytearray:
    """Exactly n bytes at offset; a file shorter than its own header says (changed since) is
    refused."""
    buf, got = bytearray(n), 0
    while got < n:
        k = os.preadv(fd, [memoryview(buf)[got:]], offset + got)
        if k == 0:
            raise WireError(f"{name} is shorter than its header says", 422)
        got += k
    return buf


def _json_object(fd, n, offset, name) -> dict:
    try:
        data = json.loads(_pread(fd, n, offset, name))
    # UnicodeDecodeError and JSONDecodeError are ValueErrors
    except (ValueError, RecursionError) as e:
        raise WireError(f"{name} is not readable JSON: {str(e)[:200]}", 422) from e
    if not isinstance(data, dict):
        raise WireError(f"{name} is not a JSON object", 422)
    return data


def check_config(config, served_config):
    """A checkpoint's config.json (a dict) must compute what the served config (a PretrainedConfig)
    does: read by the served config's class, it must equal it but for CONFIG_KEYS_IGNORED. Raises
    WireError 422."""
    if "auto_map" in config:
        raise WireError("config.json names custom code (auto_map): the server never runs a "
                        "checkpoint's code", 422)
    # the served class reads it whatever its model_type says, so model_type is compared as written
    try:
        new = type(served_config).from_dict(config).to_dict()
        new["model_type"] = config.get("model_type")
    except Exception as e:  # a config class's own checks raise ValueError, TypeError, KeyError...
        raise WireError(f"config.json is not a {served_config.model_type} config: "
                        f"{type(e).__name__}: {str(e)[:200]}", 422) from e
    old = served_config.to_dict()
    other = {k: new.get(k) for k in sorted(set(new) | set(old), key=str)
             if k not in CONFIG_KEYS_IGNORED and new.get(k) != old.get(k)}
    if other:
        raise WireError("config.json describes another architecture than the served model's: "
                        f"{str(other)[:300]}", 422)


def _planned_reads(fd, size, name, want, max_header) -> dict:
    """Check shard `name`'s safetensors header against `want` (tensor name -> served tensor) before
    any data is read -> {tensor name: (dtype, shape, offset, nbytes)}. Raises WireError 422."""
    n = int.from_bytes(_pread(fd, 8, 0, name), "little") if size >= 8 else -1
    if not 0 <= n <= min(size - 8, max_header):
        raise WireError(f"{name} is not a readable safetensors file: bad header length", 422)
    header = _json_object(fd, n, 8, name)
    header.pop("__metadata__", None)
    plan, unexpected, wrong = {}, [], []
    for key, entry in header.items():
        if key not in want:
            unexpected.append(key)
            continue
        try:
            dtype, shape = ST_FLOATS[entry["dtype"]], entry["shape"]
            begin, end = entry["data_offsets"]
            ok = (shape == list(want[key].shape) and type(begin) is int and type(end) is int
                  and 0 <= begin and end - begin == want[key].numel() * dtype.itemsize
                  and end <= size - 8 - n)
        except (KeyError, TypeError, ValueError):  # not a dict, an unknown or non-float dtype, ...
            ok = False
        if not ok:
            got = f"{entry.get('dtype')} {entry.get('shape')}" if isinstance(entry, dict) else entry
            wrong.append(f"{key} {str(got)[:60]} (served: {list(want[key].shape)})")
            continue
        plan[key] = (dtype, shape, 8 + n + begin, end - begin)
    if unexpected or wrong:
        raise WireError(f"{name} is not a checkpoint of the served architecture: unexpected "
                        f"{sorted(unexpected)[:5]}, other shapes, float dtypes or offsets "
                        f"{wrong[:3]}", 422)
    return plan


def read_checkpoint(path, checkpoint_dir, model) -> tuple[str, dict]:
    """Read checkpoint folder `path` (under `checkpoint_dir`) for the served `model` -> (its
    absolute path, a complete state dict for model.load_state_dict, on the CPU in the model's
    dtypes).

    Each file is opened once, without following a symlink, and checked on its descriptor; its
    config.json must compute what the served config does (check_config); every safetensors header is
    checked against the served tensors' names and shapes before a byte of data is read, so at most
    one copy of the served weights is allocated, and only then. Of weights tied to each other (an
    lm_head tied to the embeddings) one is enough, as save_pretrained writes one; with both, the
    first in the model's order (the input embeddings) is used for all, as transformers 5.19's
    tie_weights does. Raises WireError: 400 not a folder, 403 outside `checkpoint_dir` or a symlink,
    422 not a checkpoint of the served model."""
    state = model.state_dict()
    max_header = 2**16 + 2**10 * len(state)  # a safetensors header or index: ~100 bytes per tensor
    folder, folder_fd = _open_folder(path, checkpoint_dir)
    fds = [folder_fd]
    try:
        try:
            fds.append(_open_file(folder_fd, "config.json", 2**20))
        except FileNotFoundError as e:
            raise WireError(f"{path!r} is not a checkpoint folder (no config.json)") from e
        check_config(_json_object(*fds[-1], 0, "config.json"), model.config)
        try:
            fds.append(_open_file(folder_fd, "model.safetensors.index.json", max_header))
            index = _json_object(*fds[-1], 0, "model.safetensors.index.json")
            shards = index.get("weight_map")
            if not (isinstance(shards, dict) and 0 < len(set(shards.values())) <= len(state)
                    and all(isinstance(v, str) for v in shards.values())):
                raise WireError("model.safetensors.index.json has no weight_map of tensor names "
                                f"to at most {len(state)} file names", 422)
            shards = sorted(set(shards.values()))
        except FileNotFoundError:
            shards = ["model.safetensors"]
        plans = {}
        for shard in shards:
            try:
                fds.append(_open_file(folder_fd, shard, 2**62))
            except FileNotFoundError as e:
                raise WireError(f"{path!r} has no {shard} (model.safetensors or the shards its "
                                "index names); .bin and .pt checkpoints are never loaded: they can "
                                "run code", 422) from e
            plan = _planned_reads(*fds[-1], shard, state, max_header)
            if twice := sorted(plan.keys() & plans.keys()):
                raise WireError(f"{shard} holds tensors another shard holds too: {twice[:5]}", 422)
            plans.update({key: (fds[-1][0], shard, *p) for key, p in plan.items()})
        groups = {}  # tied weights share their storage
        for key, w in state.items():
            storage = (w.data_ptr(), tuple(w.shape)) if w.data_ptr() else key
            groups.setdefault(storage, []).append(key)
        if missing := [g[0] for g in groups.values() if not any(key in plans for key in g)]:
            raise WireError("not a complete checkpoint of the served architecture: missing "
                            f"{missing[:5]}", 422)
        weights = {}
        for group in groups.values():
            source = next(key for key in group if key in plans)
            fd, shard, dtype, shape, offset, nbytes = plans[source]
            # frombuffer refuses an empty buffer
            data = torch.frombuffer(_pread(fd, nbytes, offset, shard), dtype=dtype) if nbytes else (
                torch.empty(0, dtype=dtype))
            weights.update(dict.fromkeys(group, data.reshape(shape).to(state[group[0]].dtype)))
        return folder, weights
    finally:
        for fd in fds:
            os.close(fd if isinstance(fd, int) else fd[0])


# ----------------------------------------------------------------------------- the server

def make_app(served, *, name, max_seqs, max_tokens, max_body, micro_batch=MICRO_BATCH,
             max_forward_tokens=MAX_FORWARD_TOKENS, token=None,
             checkpoint_dir=None) -> bottle.Bottle:
    """checkpoint_dir enables POST /reload (with a token only), which copies a checkpoint's weights
    into `served`: the architecture served never changes, and no second model is built."""
    app = bottle.Bottle()
    # one forward (or reload) at a time; threads overlap only socket I/O and decoding
    lock = threading.Lock()
    vocab = served.get_input_embeddings().num_embeddings
    max_seq_len = getattr(served.config, "max_position_embeddings", None)
    health = {"status": "ok", "model": name, "vocab_size": vocab,
              "fingerprint": model_fingerprint(served), "max_seqs": max_seqs,
              "max_tokens": max_tokens, "max_seq_len": max_seq_len, "max_body": max_body}

    def json_error(res):  # every error, bottle's own 404/405/500 included, as one line of JSON
        bottle.response.content_type = "application/json"
        # bounded: some messages quote the request
        return json.dumps({"error": str(res.body)[:500]})
    app.default_error_handler = json_error

    @app.get("/health")
    def _health():
        return health

    def checked_body():
        """The request body, after the token and Content-Length checks (4xx on failure)."""
        # the raw WSGI value (PEP 3333: bytes as latin-1): bottle's get_header re-decodes it as
        # UTF-8 and answers non-UTF-8 bytes with a 500
        auth = bottle.request.environ.get("HTTP_AUTHORIZATION", "").encode("latin-1")
        if token and not hmac.compare_digest(auth, f"Bearer {token}".encode()):
            bottle.abort(401, "missing or wrong bearer token")
        length = bottle.request.environ.get("CONTENT_LENGTH", "")
        if not length:
            bottle.abort(411, "Content-Length required")
        # bottle.request.content_length would raise: a 500
        if not (length.isascii() and length.isdigit()):
            bottle.abort(400, f"bad Content-Length {length[:20]!r}")
        n = int(length)
        if n > max_body:  # refuse before reading a byte of it
            bottle.abort(413, f"body of {n} bytes > limit {max_body}")
        return bottle.request.environ["wsgi.input"].read(n)  # n <= max_body: bounded read

    @app.post("/logps")
    def _logps():
        body = checked_body()
        try:
            prompts, completions, temperature = decode_request(
                body, vocab_size=vocab, max_seqs=max_seqs, max_tokens=max_tokens,
                max_seq_len=max_seq_len)
        except WireError as e:
            bottle.abort(e.status, str(e))
        with lock:
            logps = compute_logps(served, prompts, completions, temperature, micro_batch,
                                  max_forward_tokens)
        # the request was valid: the model is at fault
        if not all(torch.isfinite(t).all() for t in logps):
            bottle.abort(500, "the reference model gave non-finite log-probs (overflowing "
                              "weights or dtype?)")
        bottle.response.content_type = "application/octet-stream"
        return encode_response(logps)

    @app.post("/reload")
    def _reload():
        """Load a checkpoint folder under checkpoint_dir as the reference (grpo_train.py
        --ref-sync-every). Only a path is accepted, and only with a token: weights never cross the
        wire."""
        if not (token and checkpoint_dir):
            bottle.abort(403, "reload is off: start the server with --checkpoint-dir and a token")
        body = checked_body()
        try:
            path = json.loads(body)["path"]
        # RecursionError: deeply nested JSON
        except (ValueError, KeyError, TypeError, RecursionError):
            path = None
        if not isinstance(path, str) or not path:
            bottle.abort(400, 'expected a JSON body {"path": "..."}')
        with lock:
            try:
                folder, weights = read_checkpoint(path, checkpoint_dir, served)
            except WireError as e:
                bottle.abort(e.status, str(e))
            # checked: same names, shapes and float dtypes as the served model's, so the copy cannot
            # fail
            served.load_state_dict(weights, strict=True)
            health.update(model=folder, fingerprint=model_fingerprint(served))
        return health

    return app


class ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most `max_connections` at once: one more is answered 503 and
    closed, so connections that never finish hold a bounded number of threads (each with
    QuietHandler's bounds)."""
    daemon_threads = True  # a stuck client never blocks shutdown

    def __init__(self, *args, max_connections=32, header_timeout=30.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.slots = threading.BoundedSemaphore(max_connections)
        self.max_connections, self.header_timeout = max_connections, header_timeout

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            error = json.dumps({"error": f"more than {self.max_connections} connections at once "
                                         "(--max-connections)"})
            try:  # a fresh socket's send buffer takes these few bytes at once
                request.sendall(b"HTTP/1.0 503 Service Unavailable\r\n"
                                b"Content-Type: application/json\r\n"
                                + f"Content-Length: {len(error)}\r\n\r\n{error}".encode())
            except OSError:  # the client is gone already
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the thread
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class HeadTooLarge(Exception):
    pass


class RequestHead(io.RawIOBase):
    """The connection's bytes as the handler's rfile reads them. Until `end()` (the request line and
    headers parsed) at most `limit` bytes are read, by `deadline`: http.server alone reads up to 100
    headers of 64 KiB each, a byte every `timeout` seconds keeping it waiting, all before the token
    is checked. Raises HeadTooLarge or TimeoutError."""

    def __init__(self, sock, limit, seconds):
        self.sock, self.left, self.deadline = sock, limit, time.monotonic() + seconds
        self.timeout = sock.gettimeout()

    def readable(self):
        return True

    def readinto(self, buf):
        if self.left is not None:
            if self.left == 0:
                raise HeadTooLarge
            wait = self.deadline - time.monotonic()
            if wait <= 0:
                raise TimeoutError
            self.sock.settimeout(min(wait, self.timeout))
            buf = memoryview(buf)[:self.left]  # never buffered beyond the limit
        n = self.sock.recv_into(buf)
        if self.left is not None:
            self.left -= n
        return n

    def end(self):
        self.left = None
        self.sock.settimeout(self.timeout)


class QuietHandler(WSGIRequestHandler):
    # seconds of socket silence before a half-sent request is dropped (frees its thread)
    timeout = 120
    # the request line and headers, all that is read before the token is checked (a request's are <
    # 1 KiB)
    max_head = 2**16
    # wsgiref writes the status line, headers and body separately: with Nagle's algorithm each small
    # write waits for the ACK of the one before (TCP_NODELAY: 14-17 ms -> 5-8 ms on a demo-sized
    # request)
    disable_nagle_algorithm = True
    # http.server's own errors (a bad request line, 408, 431) as one line of JSON, as the app's are
    error_message_format = '{"error": "%(message)s"}'
    error_content_type = "application/json"

    def setup(self):
        super().setup()
        self.rfile.close()  # the buffered file setup() made: replaced, reading through RequestHead
        self.head = RequestHead(self.connection, self.max_head, self.server.header_timeout)
        self.rfile = io.BufferedReader(self.head)

    def handle(self):
        try:
            super().handle()
        except (HeadTooLarge, TimeoutError) as e:
            # as wsgiref's handle() does
            self.requestline = self.request_version = self.command = ""
            self.close_connection = True
            if isinstance(e, HeadTooLarge):
                self.send_error(431, f"request line and headers over {self.max_head} bytes")
            else:
                self.send_error(408, f"request line and headers not sent within "
                                     f"{self.server.header_timeout:g}s")

    def send_error(self, code, message=None, explain=None):
        # http.server's messages quote the request line: escaped for error_message_format's JSON
        super().send_error(code, message and json.dumps(message)[1:-1], explain)

    def parse_request(self):
        parsed = super().parse_request()
        self.head.end()  # the body is read after the token check, within --max-body-mb
        return parsed

    def log_request(self, code="-", size="-"):  # no line per request; errors are still logged
        if not str(code).startswith("2"):
            super().log_request(code, size)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF model id or folder of the reference model")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=59875, help="TCP port to listen on")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads; keep low when sharing cores with the trainer and vLLM")
    p.add_argument("--max-tokens", type=int, default=262144,
                   help="most tokens per request (else 413)")
    p.add_argument("--max-seqs", type=int, default=1024,
                   help="most sequences per request (else 413)")
    p.add_argument("--max-body-mb", type=float, default=16.0,
                   help="largest request body in MiB (else 413)")
    p.add_argument("--micro-batch", type=int, default=MICRO_BATCH,
                   help="most sequences per forward pass")
    p.add_argument("--max-forward-tokens", type=int, default=MAX_FORWARD_TOKENS,
                   help="most padded tokens per forward pass (a longer sequence goes alone): "
                   "bounds memory")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="weights dtype; auto = bfloat16 on a GPU that computes in it natively, "
                   "else float32")
    p.add_argument("--fp32-lm-head", action="store_true",
                   help="bf16: the lm_head in fp32, as grpo_train.py --fp32-lm-head")
    p.add_argument("--token", default=os.environ.get("REF_SERVER_TOKEN"),
                   help="require 'Authorization: Bearer TOKEN' "
                   "(default: $REF_SERVER_TOKEN, else none)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="allow POST /reload of checkpoints under this folder (needs a token)")
    p.add_argument("--max-connections", type=int, default=32,
                   help="most connections served at once (one more: 503); bounds memory "
                   "before the token")
    p.add_argument("--header-timeout", type=float, default=30.0,
                   help="seconds a client has to send its request line and headers (else 408)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without a token (only on a network you trust)")
    a = p.parse_args(argv)
    if err := exposure_error(a.host, a.token, a.insecure) or missing_folder(a.model):
        p.error(err)  # exits with status 2, before loading anything or binding the port
    torch.set_num_threads(a.threads)  # oversubscribed shared cores make everything 10-100x slower
    model = load_model(a.model, a.device, a.dtype, a.fp32_lm_head)
    app = make_app(model, name=a.model, max_seqs=a.max_seqs,
                   max_tokens=a.max_tokens, max_body=int(a.max_body_mb * 2**20),
                   micro_batch=a.micro_batch, max_forward_tokens=a.max_forward_tokens,
                   token=a.token, checkpoint_dir=a.checkpoint_dir)
    server_class = functools.partial(ThreadingWSGIServer, max_connections=a.max_connections,
                                     header_timeout=a.header_timeout)
    server = make_server(a.host, a.port, app, server_class=server_class, handler_class=QuietHandler)
    print(f"ref_server: {a.model} on {a.device}, listening on http://{a.host}:{server.server_port}",
          flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
