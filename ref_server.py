"""Reference-model server for GRPO: holds the frozen reference model and answers per-token log-probs.

    python ref_server.py --model Qwen/Qwen2.5-0.5B-Instruct --device cuda:0 --port 59875

GET  /health -> {"status": "ok", "model", "vocab_size", "fingerprint"}
POST /logps  -> body and answer in the wire format below (application/octet-stream)
POST /reload -> {"path": "..."}: load that HF checkpoint folder (under --checkpoint-dir) as the reference;
                needs a token; weights never cross the wire (grpo_train.py --ref-sync-every)

Wire format (tested with safetensors 0.8.0): a safetensors buffer, i.e. an 8-byte little-endian header
length, a JSON header (dtype, shape, byte offsets, str->str metadata) and raw little-endian tensor bytes, so
only plain numbers cross the wire. Request: int32 `input_ids` (every sequence's prompt+completion, concatenated), int32
`seq_lens` (B,) and int32 `prompt_lens` (B,), metadata {"temperature": "1.0"}. Answer: float32 `logps`, each
sequence's completion-token log-probs concatenated.

Status codes: 400 malformed request or Content-Length; 401 missing/wrong token (only with --token); 403
/reload off or a path outside --checkpoint-dir; 404 unknown path; 405 wrong method; 411 no Content-Length;
413 body over --max-body-mb, or more than --max-seqs sequences or --max-tokens tokens (split the batch); 500
server bug. Every error body is {"error": "..."}. A --host other than loopback needs a token (--token or
$REF_SERVER_TOKEN), or --insecure.

This module is imported by the trainer for the wire helpers and the client (ref_logps), so importing it
must stay cheap: no model, no server, no grpo_train import at the top.
"""
import argparse
import hashlib
import hmac
import ipaddress
import json
import math
import os
import threading
import time
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import bottle
import requests
import torch
from safetensors.torch import load as st_load, save as st_save

REQUEST_KEYS = ("input_ids", "seq_lens", "prompt_lens")


class WireError(ValueError):
    """An invalid request/answer body. `status` is the HTTP code the server answers it with."""

    def __init__(self, msg, status=400):
        super().__init__(msg)
        self.status = status


class RefServerError(RuntimeError):
    """The reference server could not be reached, or refused the request."""


# ----------------------------------------------------------------------------- wire format

def encode_request(prompts: list[list[int]], completions: list[list[int]], temperature: float) -> bytes:
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
    return st_save({"input_ids": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
                    "seq_lens": torch.tensor([len(s) for s in seqs], dtype=torch.int32),
                    "prompt_lens": torch.tensor([len(p) for p in prompts], dtype=torch.int32)},
                   metadata={"temperature": repr(float(temperature))})


def _load(body: bytes) -> tuple[dict, dict]:
    """Parse a safetensors buffer -> (tensors, metadata); any failure is the sender's fault -> WireError."""
    if not body:
        raise WireError("empty body")
    try:
        tensors = st_load(body)  # checks the header and that offsets, shapes and dtypes match the bytes
        # st_load does not return the metadata, so read it from the header it has just validated
        meta = json.loads(body[8:8 + int.from_bytes(body[:8], "little")]).get("__metadata__") or {}
    except Exception as e:  # SafetensorError, torch refusing a dtype or shape, json: all mean "bad bytes"
        first_line = str(e).partition("\n")[0][:200]  # torch's C++ errors go on with a backtrace: keep it here
        raise WireError(f"not a valid safetensors body: {first_line}") from e
    return tensors, meta


def _check_1d_int32(tensors, name):
    if name not in tensors:
        raise WireError(f"missing tensor {name!r}")
    t = tensors[name]
    if t.dtype != torch.int32 or t.dim() != 1:
        raise WireError(f"{name} must be a 1-D int32 tensor, got {t.dtype} of shape {list(t.shape)}")
    return t.long()


def decode_request(body: bytes, *, vocab_size: int, max_seqs: int, max_tokens: int):
    """Validate a request body -> (prompts, completions, temperature). Raises WireError (status 400/413)."""
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
    if ((prompt_lens < 1) | (prompt_lens >= seq_lens)).any():  # >= 1 completion token to score
        raise WireError("every prompt_len must be >= 1 and < its seq_len")
    if ids.min() < 0 or ids.max() >= vocab_size:  # ids is not empty: B >= 1 and every seq_len > 0
        raise WireError(f"token ids must be in [0, {vocab_size}), got [{ids.min().item()}, {ids.max().item()}]")
    try:
        temperature = float(meta["temperature"])
    except (KeyError, ValueError) as e:
        raise WireError(f"metadata needs a numeric 'temperature', got {meta}") from e
    if not (math.isfinite(temperature) and temperature > 0):
        raise WireError(f"temperature must be finite and > 0, got {temperature}")
    seqs = ids.split(seq_lens.tolist())
    prompts = [s[:p].tolist() for s, p in zip(seqs, prompt_lens.tolist())]
    completions = [s[p:].tolist() for s, p in zip(seqs, prompt_lens.tolist())]
    return prompts, completions, temperature


def encode_response(logps: list[torch.Tensor]) -> bytes:
    flat = torch.cat([t.detach().float().flatten().cpu() for t in logps]) if logps else torch.zeros(0)
    return st_save({"logps": flat.contiguous()})


def decode_response(body: bytes, completion_lens: list[int]) -> list[torch.Tensor]:
    """Answer body -> one float32 tensor of log-probs per completion. Raises WireError."""
    tensors, _ = _load(body)
    t = tensors.get("logps")
    if t is None or set(tensors) != {"logps"} or t.dtype != torch.float32 or t.dim() != 1:
        raise WireError(f"answer must hold exactly one 1-D float32 'logps', got {list(tensors)}")
    if len(t) != sum(completion_lens):
        raise WireError(f"answer has {len(t)} log-probs, expected sum(completion_lens)={sum(completion_lens)}")
    return list(t.split(list(completion_lens)))


# ----------------------------------------------------------------------------- client (used by the trainer)

def _error_text(r) -> str:
    try:
        return r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


def _post(endpoint, body, headers, *, timeout, retry_for, backoff):
    """POST with retries: connection errors and 5xx are retried, sleeping backoff * 1, 2, 4, ... seconds (at most
    30 s each) for up to `retry_for` seconds in all, so a server that restarts is waited for. A 4xx raises at
    once (the request itself is wrong; 413 = split the batch). A read timeout is not retried either: the server
    is alive but slow, and a resend would queue a second copy behind the first."""
    deadline, attempt, last = time.monotonic() + retry_for, 0, None
    while True:
        try:
            r = requests.post(endpoint, data=body, headers=headers, timeout=timeout)
            if r.status_code < 500:
                break
            last = f"HTTP {r.status_code}: {_error_text(r)}"
        except requests.ConnectionError as e:  # includes ConnectTimeout
            last = f"{type(e).__name__}: {e}"
        except requests.Timeout as e:
            raise RefServerError(f"{endpoint}: no answer within {timeout}s ({e})") from e
        pause = min(30.0, backoff * 2 ** attempt)
        if time.monotonic() + pause > deadline:
            raise RefServerError(f"{endpoint} failed after {attempt + 1} attempts in {retry_for:g}s; "
                                 f"last error: {last}")
        time.sleep(pause)
        attempt += 1
    if r.status_code != 200:
        raise RefServerError(f"{endpoint} answered HTTP {r.status_code}: {_error_text(r)}")
    return r


def _auth(token):
    return {"Authorization": f"Bearer {token}"} if token else {}


def ref_logps(url, prompts, completions, temperature, *, timeout=60, retry_for=30.0, backoff=1.0,
              token=os.environ.get("REF_SERVER_TOKEN")):
    """Reference log-probs of each completion token -> list of float32 (len(completion),) tensors.
    Retries as _post says, for up to `retry_for` seconds."""
    r = _post(url.rstrip("/") + "/logps", encode_request(prompts, completions, temperature),
              {"Content-Type": "application/octet-stream", **_auth(token)},
              timeout=timeout, retry_for=retry_for, backoff=backoff)
    return decode_response(r.content, [len(c) for c in completions])


def reload_reference(url, path, *, timeout=600, retry_for=30.0, token=os.environ.get("REF_SERVER_TOKEN")) -> dict:
    """Ask the server to load the HF checkpoint in folder `path` (on the server's file system, under its
    --checkpoint-dir) as the new reference -> its new /health. Only a path crosses the wire, never weights."""
    r = _post(url.rstrip("/") + "/reload", json.dumps({"path": path}),
              {"Content-Type": "application/json", **_auth(token)}, timeout=timeout, retry_for=retry_for, backoff=1.0)
    return r.json()


def wait_for_server(url, timeout=120.0, interval=0.5) -> dict:
    """Poll GET /health until it answers 200 (-> its JSON) or `timeout` seconds pass (-> RefServerError)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            r = requests.get(url.rstrip("/") + "/health", timeout=min(5.0, timeout))
            if r.status_code == 200:
                return r.json()
            last = f"HTTP {r.status_code}"
        except requests.RequestException as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(interval)
    raise RefServerError(f"{url}/health not ready after {timeout}s; last error: {last}")


# ----------------------------------------------------------------------------- model side

def exposure_error(host, token, insecure) -> str | None:
    """Why serving on `host` is refused, or None. A host other machines can reach needs a token or --insecure.

    Loopback is 'localhost', 127.0.0.0/8 and ::1; anything else (0.0.0.0, a LAN address, a host name that
    could resolve to one) is treated as reachable."""
    if token or insecure or host.lower() == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:  # not an IP address: a host name
        pass
    return (f"--host {host} is reachable from other machines, but no token is set: anyone who can reach the "
            "port could use the server. Set REF_SERVER_TOKEN (or --token), bind 127.0.0.1, or pass --insecure.")


def model_fingerprint(model) -> str:
    """Short hash of the architecture + a few embedding values, to check trainer and server hold the same model.

    Only architecture fields are hashed (dtype, use_cache, paths differ harmlessly between the two), and the
    values are rounded to bfloat16 so a float32 copy and a bfloat16 copy agree. On the trainer side call it on
    the policy before its first update (the policy starts as the reference)."""
    c = model.config
    arch = {k: getattr(c, k, None) for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                                             "num_attention_heads", "num_key_value_heads", "intermediate_size")}
    w = model.get_input_embeddings().weight.detach().flatten()
    vals = torch.cat([w[:16], w[-16:]]).to(torch.bfloat16).float().cpu().numpy().tobytes()
    return hashlib.sha256(json.dumps(arch, sort_keys=True).encode() + vals).hexdigest()[:16]


def load_model(path, device="cpu", dtype="auto"):
    from transformers import AutoModelForCausalLM  # here, so importing this module stays light
    if dtype == "auto":
        dtype = "float32" if device == "cpu" else "bfloat16"
    # safetensors only: never a checkpoint format that runs code on load (hub models without safetensors: refused)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), use_safetensors=True)
    model = model.to(device).eval()
    model.requires_grad_(False)
    return model


@torch.no_grad()
def compute_logps(model, prompts, completions, temperature, micro_batch=8) -> list[torch.Tensor]:
    # Imported here, not at the top: grpo_train imports this module at its top (circular import otherwise);
    # main() has loaded it already, so this is a dict lookup.
    from grpo_train import completion_logps
    from plumbing import pad_batch
    device = next(model.parameters()).device
    # Similar lengths share a micro-batch, so little compute goes to padding; answers go back in input order.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(completions[i]))
    out = [None] * len(prompts)
    for s in range(0, len(order), micro_batch):
        idx = order[s:s + micro_batch]
        ps, cs = [prompts[i] for i in idx], [completions[i] for i in idx]
        input_ids, attn, _ = pad_batch(ps, cs, pad_id=0)  # masks come from lengths, so any valid pad id works
        lp = completion_logps(model, input_ids.to(device), attn.to(device), max(map(len, cs)), temperature)
        for row, i in enumerate(idx):
            out[i] = lp[row, :len(completions[i])].float().cpu()
    return out


def make_app(model, *, name, max_seqs, max_tokens, max_body, micro_batch=8, token=None, checkpoint_dir=None,
             load=None) -> bottle.Bottle:
    """checkpoint_dir + load(path) -> model enable POST /reload (with a token only)."""
    app = bottle.Bottle()
    lock = threading.Lock()  # one forward (or reload) at a time; threads overlap only socket I/O and decoding
    vocab = model.get_input_embeddings().num_embeddings
    health = {"status": "ok", "model": name, "vocab_size": vocab, "fingerprint": model_fingerprint(model)}
    served = {"model": model}  # replaced by /reload

    def json_error(res):  # every error, bottle's own 404/405/500 included, as one line of JSON
        bottle.response.content_type = "application/json"
        return json.dumps({"error": str(res.body)[:500]})  # bounded: some messages quote the request
    app.default_error_handler = json_error

    @app.get("/health")
    def _health():
        return health

    def checked_body():
        """The request body, after the token and Content-Length checks (4xx on failure)."""
        auth = bottle.request.get_header("Authorization", "").encode()
        if token and not hmac.compare_digest(auth, f"Bearer {token}".encode()):
            bottle.abort(401, "missing or wrong bearer token")
        length = bottle.request.environ.get("CONTENT_LENGTH", "")
        if not length:
            bottle.abort(411, "Content-Length required")
        if not (length.isascii() and length.isdigit()):  # bottle.request.content_length would raise: a 500
            bottle.abort(400, f"bad Content-Length {length[:20]!r}")
        n = int(length)
        if n > max_body:  # refuse before reading a byte of it
            bottle.abort(413, f"body of {n} bytes > limit {max_body}")
        return bottle.request.environ["wsgi.input"].read(n)  # n <= max_body: bounded read

    @app.post("/logps")
    def _logps():
        body = checked_body()
        try:
            prompts, completions, temperature = decode_request(body, vocab_size=vocab, max_seqs=max_seqs,
                                                               max_tokens=max_tokens)
        except WireError as e:
            bottle.abort(e.status, str(e))
        with lock:
            logps = compute_logps(served["model"], prompts, completions, temperature, micro_batch)
        bottle.response.content_type = "application/octet-stream"
        return encode_response(logps)

    @app.post("/reload")
    def _reload():
        """Load a checkpoint folder under checkpoint_dir as the reference (grpo_train.py --ref-sync-every).
        Only a path is accepted, and only with a token: weights never cross the wire."""
        if not (token and checkpoint_dir):
            bottle.abort(403, "reload is off: start the server with --checkpoint-dir and a token")
        body = checked_body()
        try:
            path = json.loads(body)["path"]
        except (ValueError, KeyError, TypeError):
            path = None
        if not isinstance(path, str) or not path:
            bottle.abort(400, 'expected a JSON body {"path": "..."}')
        real, root = os.path.realpath(path), os.path.realpath(checkpoint_dir)
        if os.path.commonpath([real, root]) != root:  # realpath first: no way out through .. or a symlink
            bottle.abort(403, f"{path!r} is not under the server's --checkpoint-dir")
        if not os.path.isfile(os.path.join(real, "config.json")):
            bottle.abort(400, f"{path!r} is not a checkpoint folder (no config.json)")
        with lock:
            new = load(real)
            if new.get_input_embeddings().num_embeddings != vocab:
                bottle.abort(400, f"{path!r} has another vocabulary than the served model")
            served["model"] = new
            health.update(model=real, fingerprint=model_fingerprint(new))
        return health

    return app


class ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a stuck client never blocks shutdown


class QuietHandler(WSGIRequestHandler):
    timeout = 120  # seconds of socket silence before a half-sent request is dropped (frees its thread)

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
    p.add_argument("--max-tokens", type=int, default=262144, help="most tokens per request (else 413)")
    p.add_argument("--max-seqs", type=int, default=1024, help="most sequences per request (else 413)")
    p.add_argument("--max-body-mb", type=float, default=16.0, help="largest request body in MiB (else 413)")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward pass")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="weights dtype; auto = float32 on cpu, bfloat16 on cuda")
    p.add_argument("--token", default=os.environ.get("REF_SERVER_TOKEN"),
                   help="require 'Authorization: Bearer TOKEN' on /logps (default: $REF_SERVER_TOKEN, else none)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="allow POST /reload of checkpoints under this folder (needs a token; --ref-sync-every)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without a token (only on a network you trust)")
    a = p.parse_args(argv)
    if err := exposure_error(a.host, a.token, a.insecure):
        p.error(err)  # exits with status 2, before loading anything or binding the port
    torch.set_num_threads(a.threads)  # oversubscribed shared cores make everything 10-100x slower
    model = load_model(a.model, a.device, a.dtype)
    # Import grpo_train now rather than on the first request: a broken import fails at startup, not as a 500,
    # and the first request does not pay for the trainer's imports. (When run as a script, grpo_train's own
    # `from ref_server import ...` loads a second, inert copy of this file as `ref_server`: harmless.)
    import grpo_train  # noqa: F401
    app = make_app(model, name=a.model, max_seqs=a.max_seqs, max_tokens=a.max_tokens,
                   max_body=int(a.max_body_mb * 2**20), micro_batch=a.micro_batch, token=a.token,
                   checkpoint_dir=a.checkpoint_dir, load=lambda path: load_model(path, a.device, a.dtype))
    server = make_server(a.host, a.port, app, server_class=ThreadingWSGIServer, handler_class=QuietHandler)
    print(f"ref_server: {a.model} on {a.device}, listening on http://{a.host}:{server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
