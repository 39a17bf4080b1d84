"""Reference-model server for GRPO: holds the frozen reference model, answers per-token log-probs.

    python ref_server.py --model Qwen/Qwen2.5-0.5B-Instruct --device cuda:0 --port 59875

GET /health (the model, its fingerprint, the limits), POST /logps (token ids in, log-probs out, in
the wire format below), POST /reload (a checkpoint folder under --checkpoint-dir): each, and each
error (JSON), in docs/reference-server.md. Imports no project file: copy it alone to the machine.
"""
import argparse
import errno
import hashlib
import hmac
import ipaddress
import json
import math
import os
import stat
import threading
import time

import bottle
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as st_load, save as st_save
from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser
from waitress.server import TcpWSGIServer
from waitress.task import ErrorTask
from waitress.utilities import Error

REQUEST_KEYS = ("input_ids", "seq_lens", "prompt_lens")
# below this, logits / T overflow float32 (1e-45 gave -inf, 1e-300 NaN); samplers call it greedy
MIN_TEMPERATURE = 1e-3
# a forward pass's most rows and padded tokens: the token budget is what bounds memory
MICRO_BATCH, MAX_FORWARD_TOKENS = 64, 8192
# the config fields model_fingerprint hashes (a /reload compares the whole config: check_config)
ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads")
# the request line and headers, all that is read before the token is checked (a request's: < 1 KiB)
MAX_HEAD = 2**16

class WireError(ValueError):
    """An invalid request, /reload folder or answer; `status`: the HTTP code it is answered with."""
    def __init__(self, msg, status=400):
        super().__init__(msg)
        self.status = status

# ----------------------------------------------------------------------------- wire format

def read_body(body: bytes) -> tuple[dict, dict]:
    """A safetensors buffer -> (tensors, metadata); any failure is the sender's: WireError."""
    if not body:
        raise WireError("empty body")
    try:
        # checks the header, and that offsets, shapes and dtypes match the bytes
        tensors = st_load(body)
        meta = json.loads(body[8:8 + int.from_bytes(body[:8], "little")]).get("__metadata__")
    # SafetensorError, torch refusing a dtype or shape, json: all mean "bad bytes"
    except Exception as e:
        # torch's C++ errors go on with a backtrace: keep the first line
        raise WireError(f"not a valid safetensors body: {str(e).partition(chr(10))[0][:200]}")
    return tensors, meta or {}

def decode_request(body, *, vocab_size, max_seqs, max_tokens, max_seq_len=None):
    """A /logps body -> (prompts, completions, temperature), or WireError (400, 413). The body: a
    safetensors buffer of int32 `input_ids` (every prompt+completion, concatenated), `seq_lens` and
    `prompt_lens` (B,), metadata {"temperature": "1.0"}. max_seq_len: None, no limit."""
    tensors, meta = read_body(body)
    if extra := set(tensors) - set(REQUEST_KEYS):
        raise WireError(f"unexpected tensors {sorted(extra)}; expected {list(REQUEST_KEYS)}")
    for name in REQUEST_KEYS:
        if name not in tensors:
            raise WireError(f"missing tensor {name!r}")
        if (t := tensors[name]).dtype != torch.int32 or t.dim() != 1:
            raise WireError(f"{name} must be a 1-D int32 tensor, got {t.dtype} {list(t.shape)}")
    ids, seq_lens, prompt_lens = (tensors[k].long() for k in REQUEST_KEYS)
    B = len(seq_lens)
    if B == 0:
        raise WireError("no sequences")
    if len(prompt_lens) != B:
        raise WireError(f"prompt_lens has {len(prompt_lens)} entries but seq_lens has {B}")
    if B > max_seqs or len(ids) > max_tokens:
        raise WireError(f"{B} sequences, {len(ids)} tokens > limit {max_seqs} sequences, "
                        f"{max_tokens} tokens", 413)
    if (seq_lens <= 0).any() or seq_lens.sum().item() != len(ids):
        raise WireError(f"seq_lens must be > 0 and sum to len(input_ids)={len(ids)}, got "
                        f"sum(seq_lens)={seq_lens.sum().item()}")
    # positions the model was never trained on
    if max_seq_len and seq_lens.max() > max_seq_len:
        raise WireError(f"a sequence of {seq_lens.max().item()} tokens > the model's context "
                        f"length {max_seq_len}", 413)
    # at least one completion token to score
    if ((prompt_lens < 1) | (prompt_lens >= seq_lens)).any():
        raise WireError("every prompt_len must be >= 1 and < its seq_len")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise WireError(f"token ids must be in [0, {vocab_size}), "
                        f"got [{ids.min().item()}, {ids.max().item()}]")
    try:
        temperature = float(meta["temperature"])
    except (KeyError, ValueError) as e:
        raise WireError(f"metadata needs a numeric 'temperature', got {meta}") from e
    if not (math.isfinite(temperature) and temperature >= MIN_TEMPERATURE):
        raise WireError(f"temperature must be finite and >= {MIN_TEMPERATURE}, got {temperature}")
    seqs = [s.tolist() for s in ids.split(seq_lens.tolist())]
    return ([s[:p] for s, p in zip(seqs, prompt_lens.tolist())],
            [s[p:] for s, p in zip(seqs, prompt_lens.tolist())], temperature)

def encode_response(logps: list[torch.Tensor]) -> bytes:
    """The /logps answer: one float32 `logps` of every completion token, concatenated."""
    flat = [t.detach().float().flatten().cpu() for t in logps]
    return st_save({"logps": torch.cat(flat).contiguous() if flat else torch.zeros(0)})

# ----------------------------------------------------------------------------- model side

def missing_folder(model) -> str | None:
    """Why --model cannot be loaded: a path (. / ~ first, or two slashes: a hub id is "org/name")
    that names no folder."""
    path = model.startswith((".", "/", "~")) or model.count("/") > 1
    if path and not os.path.isdir(os.path.expanduser(model)):
        return f"--model {model}: no such folder"

def exposure_error(host, token, insecure) -> str | None:
    """Why serving on `host` is refused, or None: a host other than loopback (a host name could
    resolve to anything) needs a token or --insecure."""
    try:
        loopback = host.lower() == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not (token or insecure or loopback):
        return (f"--host {host} is reachable from other machines, but no token is set: set "
                "REF_SERVER_TOKEN (or --token), bind 127.0.0.1, or pass --insecure.")

def model_fingerprint(model, samples=64) -> str:
    """Short hash of the architecture (ARCH_KEYS) and of every weight: per tensor, in name order,
    its name, shape and `samples` values at an even stride, rounded to bfloat16 (so float32 and
    bfloat16 copies agree). The trainer compares it with its policy's before the first update."""
    arch = {k: getattr(model.config, k, None) for k in ARCH_KEYS}
    h = hashlib.sha256(json.dumps(arch, sort_keys=True).encode())
    picked = []
    for name, w in sorted(model.state_dict().items()):
        h.update(f"{name}{list(w.shape)};".encode())
        flat = w.detach().flatten()
        picked.append(flat[::max(1, flat.numel() // samples)][:samples].to(torch.bfloat16))
    # one device-to-host copy on a GPU
    h.update(torch.cat(picked).float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]

def default_dtype(device) -> str:
    """bfloat16 on a GPU that computes in it natively (is_bf16_supported() alone, torch 2.13,
    counts slow emulation too), else float32, as the trainer picks."""
    cuda = str(device).startswith("cuda")
    native = cuda and torch.cuda.is_bf16_supported(including_emulation=False)
    return "bfloat16" if native else "float32"

def load_model(path, device="cpu", dtype="auto", fp32_lm_head=False):
    # here, so importing this module stays light
    from transformers import AutoModelForCausalLM
    dtype = default_dtype(device) if dtype == "auto" else dtype
    # safetensors only: never a format that runs code on load (a hub model without them: refused)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                 use_safetensors=True)
    model = model.to(device).eval().requires_grad_(False)
    if fp32_lm_head:
        # the lm_head in fp32, bf16 input and weight cast up, as grpo_train.py --fp32-lm-head
        # and vLLM 0.32's head_dtype float32 (a /reload copies weights into this same module)
        head = model.get_output_embeddings()
        bias = lambda: None if head.bias is None else head.bias.float()
        head.forward = lambda h: torch.nn.functional.linear(h.float(), head.weight.float(), bias())
    return model

@torch.no_grad()
def forward_logps(model, prompts, completions, temperature, chunk=512):
    """float32 log-probs at `temperature` of the completion tokens (B, T): grpo_train's numbers (a
    test checks). Prompts left-padded, completions right-padded (id 0: the mask marks padding);
    the lm_head runs on `chunk` tokens at a time, so the (B, T, vocab) logits are never held."""
    P, T = max(map(len, prompts)), max(map(len, completions))
    input_ids = torch.zeros(len(prompts), P + T, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, P - len(p):P + len(c)] = torch.tensor(p + c)
        attention_mask[i, P - len(p):P + len(c)] = 1
    device = next(model.parameters()).device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    # left padding: positions start at 0 per row
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    # get_decoder / get_output_embeddings (transformers 5.19): the body and lm_head of any causal LM
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, use_cache=False).last_hidden_state
    hidden = hidden[:, P - 1:-1]
    targets = input_ids[:, P:]
    out = []
    for h, t in zip(hidden.flatten(0, 1).split(chunk), targets.flatten().split(chunk)):
        logits = model.get_output_embeddings()(h).float() / temperature
        out.append(logits.gather(-1, t.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1))
    return torch.cat(out).view(targets.shape)

def micro_batches(lengths, max_seqs, max_tokens) -> list[list[int]]:
    """(prompt_len, completion_len) per sequence -> index lists, one per forward pass, sorted by
    length, each at most `max_seqs` rows and `max_tokens` padded tokens, or one longer sequence
    (unpadded, it needs no attention mask, whose memory grows with width^2)."""
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
    out = [None] * len(prompts)
    for idx in micro_batches([(len(p), len(c)) for p, c in zip(prompts, completions)],
                             micro_batch, max_forward_tokens):
        lp = forward_logps(model, [prompts[i] for i in idx], [completions[i] for i in idx],
                           temperature)
        for row, i in enumerate(idx):
            out[i] = lp[row, :len(completions[i])].float().cpu()
    return out

# ----------------------------------------------------------------------------- /reload's checks

# config.json fields that do not change what the model computes (docs/reference-server.md: why)
CONFIG_KEYS_IGNORED = ("transformers_version", "_name_or_path", "architectures", "dtype",
                       "torch_dtype", "use_cache")
# NONBLOCK: a FIFO never blocks
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

def _open_folder(path, checkpoint_dir, fds) -> str:
    """Folder `path` opened one component at a time from `checkpoint_dir` (which `path` may name
    by its absolute or real path), none a symlink, each descriptor appended to `fds` (the folder's
    last) -> its absolute path."""
    if "\0" in path:
        raise WireError("the path holds a NUL byte")
    # lexical: '..' cannot climb out, and below the root no symlink passes
    folder = os.path.abspath(path)
    roots = (os.path.abspath(checkpoint_dir), os.path.realpath(checkpoint_dir))
    root = next((r for r in roots if os.path.commonpath([folder, r]) == r), None)
    if root is None:
        raise WireError(f"{path!r} is not under the server's --checkpoint-dir", 403)
    for part in [roots[1]] + os.path.relpath(folder, root).split(os.sep):
        parent = fds[-1] if fds else None
        try:
            # O_NOFOLLOW refuses a symlink (swapped in after this lstat too); the lstat says why
            if fds and stat.S_ISLNK(os.stat(part, dir_fd=parent, follow_symlinks=False).st_mode):
                raise WireError(f"{path!r} is not under the server's --checkpoint-dir: "
                                f"{part!r} is a symlink", 403)
            fds.append(os.open(part, OPEN_FLAGS | os.O_DIRECTORY, dir_fd=parent))
        except OSError as e:
            raise WireError(f"{path!r} is not a checkpoint folder ({part!r}: {e.strerror})") from e
    return folder

def _open_file(folder_fd, name, fds, max_bytes=2**62) -> int:
    """Descriptor (appended to `fds`) of regular file `name` in the folder: no symlink, one link
    (a hard link may be a file outside), at most `max_bytes`. Or FileNotFoundError, WireError."""
    if name in (".", "..") or "/" in name or "\0" in name:
        raise WireError(f"{name!r} is not under the server's --checkpoint-dir: not a name", 403)
    try:
        fds.append(os.open(name, OPEN_FLAGS, dir_fd=folder_fd))
    except FileNotFoundError:
        raise
    except OSError as e:
        status, why = (403, "a symlink") if e.errno == errno.ELOOP else (422, e.strerror)
        raise WireError(f"{name} is not under the server's --checkpoint-dir: {why}", status) from e
    # the file opened, not whatever the name points to now
    st = os.fstat(fds[-1])
    if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
        raise WireError(f"{name} is not a regular file of at most {max_bytes} bytes", 422)
    if st.st_nlink > 1:
        raise WireError(f"{name} has {st.st_nlink} hard links: one may lie outside "
                        "--checkpoint-dir; copy the file instead", 422)
    return fds[-1]

def _read_json(folder_fd, name, fds, max_bytes) -> dict:
    fd = _open_file(folder_fd, name, fds, max_bytes)
    try:
        data = json.loads(os.pread(fd, max_bytes, 0))
    # UnicodeDecodeError and JSONDecodeError are ValueErrors
    except (ValueError, RecursionError) as e:
        raise WireError(f"{name} is not readable JSON: {str(e)[:200]}", 422) from e
    if not isinstance(data, dict):
        raise WireError(f"{name} is not a JSON object", 422)
    return data

def check_config(config, served_config):
    """A checkpoint's config.json (a dict), read by the served config's class, must equal the
    served config but for CONFIG_KEYS_IGNORED. Raises WireError 422."""
    if "auto_map" in config:
        raise WireError("config.json names custom code (auto_map): the server never runs a "
                        "checkpoint's code", 422)
    # the served class reads it whatever its model_type says, so model_type is compared as written
    try:
        new = type(served_config).from_dict(config).to_dict()
        new["model_type"] = config.get("model_type")
    # a config class's own checks raise ValueError, TypeError, KeyError...
    except Exception as e:
        raise WireError(f"config.json is not a {served_config.model_type} config: "
                        f"{type(e).__name__}: {str(e)[:200]}", 422) from e
    old = served_config.to_dict()
    if other := {k: new.get(k) for k in sorted(set(new) | set(old), key=str)
                 if k not in CONFIG_KEYS_IGNORED and new.get(k) != old.get(k)}:
        raise WireError("config.json describes another architecture than the served model's: "
                        f"{str(other)[:300]}", 422)

def _checked_shard(fd, shard, state) -> safe_open:
    """Shard `shard` on descriptor `fd`, its header validated by safetensors 0.8.0 (offsets within
    the file, no overlap, no hole), its names, shapes and float dtypes checked against the served
    tensors', before any tensor data is read. Raises WireError 422."""
    try:
        # the magic link reopens the very file the descriptor holds, whatever its name is now
        f = safe_open(f"/proc/self/fd/{fd}", framework="pt")
    except SafetensorError as e:
        raise WireError(f"{shard} is not a readable safetensors file: {str(e)[:200]}", 422) from e
    unexpected = sorted(k for k in f.keys() if k not in state)
    wrong = [f"{k} {s.get_dtype()} {s.get_shape()} (served: {list(state[k].shape)})"
             for k in f.keys() if k in state for s in [f.get_slice(k)]
             if s.get_dtype() not in ("F32", "BF16", "F16") or s.get_shape() != [*state[k].shape]]
    if unexpected or wrong:
        raise WireError(f"{shard} is not a checkpoint of the served architecture: unexpected "
                        f"{unexpected[:5]}, other shapes or float dtypes {wrong[:3]}", 422)
    return f

def read_checkpoint(path, checkpoint_dir, model) -> tuple[str, dict]:
    """Checkpoint folder `path` under `checkpoint_dir` -> (its absolute path, a complete, finite
    state dict for `model`, on the CPU), every check passed before any tensor data is read. Tied
    weights: one is enough; with both, the first in the model's order wins (as transformers 5.19's
    tie_weights). Raises WireError: 400, 403 or 422."""
    state, fds = model.state_dict(), []
    try:
        folder = _open_folder(path, checkpoint_dir, fds)
        folder_fd = fds[-1]
        try:
            check_config(_read_json(folder_fd, "config.json", fds, 2**20), model.config)
        except FileNotFoundError as e:
            raise WireError(f"{path!r} is not a checkpoint folder (no config.json)") from e
        try:
            # ~100 bytes per tensor
            index = _read_json(folder_fd, "model.safetensors.index.json", fds, 2**10 * len(state))
            shards = index.get("weight_map")
            shards = list(shards.values()) if isinstance(shards, dict) else []
            if not (shards and all(isinstance(s, str) for s in shards)
                    and len(set(shards)) <= len(state)):
                raise WireError("model.safetensors.index.json has no weight_map of tensor names "
                                f"to at most {len(state)} file names", 422)
        except FileNotFoundError:
            shards = ["model.safetensors"]
        files = {}
        for shard in sorted(set(shards)):
            try:
                f = _checked_shard(_open_file(folder_fd, shard, fds), shard, state)
            except FileNotFoundError as e:
                raise WireError(f"{path!r} has no {shard}; .bin and .pt checkpoints are never "
                                "loaded: they can run code", 422) from e
            if twice := sorted(files.keys() & set(f.keys())):
                raise WireError(f"{shard} holds tensors another shard holds too: {twice[:5]}", 422)
            files.update(dict.fromkeys(f.keys(), f))
        # tied weights share their storage
        groups = {}
        for key, w in state.items():
            storage = (w.data_ptr(), tuple(w.shape)) if w.data_ptr() else key
            groups.setdefault(storage, []).append(key)
        if missing := [g[0] for g in groups.values() if not any(key in files for key in g)]:
            raise WireError("not a complete checkpoint of the served architecture: missing "
                            f"{missing[:5]}", 422)
        weights = {}
        for group in groups.values():
            source = next(key for key in group if key in files)
            data = files[source].get_tensor(source)
            if not torch.isfinite(data).all():
                raise WireError(f"{source} holds values that are not finite (NaN or inf)", 422)
            weights.update(dict.fromkeys(group, data.to(state[group[0]].dtype)))
        return folder, weights
    finally:
        for fd in fds:
            os.close(fd)

# ----------------------------------------------------------------------------- the server

def authorized(header, token) -> bool:
    """header: Authorization as WSGI and waitress hold it (bytes as latin-1; bottle's get_header
    re-decodes it as UTF-8 and answers non-UTF-8 bytes with a 500)."""
    return not token or hmac.compare_digest(header.encode("latin-1"), f"Bearer {token}".encode())

def make_app(served, *, name, max_seqs, max_tokens, max_body, micro_batch=MICRO_BATCH,
             max_forward_tokens=MAX_FORWARD_TOKENS, token=None, checkpoint_dir=None):
    """The bottle app. checkpoint_dir enables POST /reload (with a token only), which copies a
    checkpoint's weights into `served`: the architecture never changes, no second model is built."""
    app = bottle.Bottle()
    # one forward (or reload) at a time; threads overlap only socket I/O and decoding
    lock = threading.Lock()
    # decode_request's limits, which /health tells the clients
    limits = {"vocab_size": served.get_input_embeddings().num_embeddings, "max_seqs": max_seqs,
              "max_tokens": max_tokens,
              "max_seq_len": getattr(served.config, "max_position_embeddings", None)}
    health = {"status": "ok", "model": name, "fingerprint": model_fingerprint(served),
              "max_body": max_body, **limits}

    # every error, bottle's own 404/405/500 too, as one line of JSON (bounded: some quote requests)
    def json_error(res):
        bottle.response.content_type = "application/json"
        return json.dumps({"error": str(res.body)[:500]})
    app.default_error_handler = json_error
    app.get("/health")(lambda: health)

    def checked_body():
        """The body, after the token check; waitress (serve) has checked its size and syntax."""
        if not authorized(bottle.request.environ.get("HTTP_AUTHORIZATION", ""), token):
            bottle.abort(401, "missing or wrong bearer token")
        if not (length := bottle.request.environ.get("CONTENT_LENGTH", "")):
            bottle.abort(411, "Content-Length required")
        return bottle.request.environ["wsgi.input"].read(min(int(length), max_body))

    @app.post("/logps")
    def _logps():
        try:
            prompts, completions, temperature = decode_request(checked_body(), **limits)
        except WireError as e:
            bottle.abort(e.status, str(e))
        with lock:
            logps = compute_logps(served, prompts, completions, temperature, micro_batch,
                                  max_forward_tokens)
        # the request was valid: the model is at fault
        if not all(torch.isfinite(t).all() for t in logps):
            bottle.abort(500, "the reference model gave non-finite log-probs (weights, dtype?)")
        bottle.response.content_type = "application/octet-stream"
        return encode_response(logps)

    @app.post("/reload")
    def _reload():
        if not (token and checkpoint_dir):
            bottle.abort(403, "reload is off: start the server with --checkpoint-dir and a token")
        try:
            path = json.loads(checked_body())["path"]
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
            # checked: the served names, shapes and float dtypes, so the copy cannot fail
            served.load_state_dict(weights, strict=True)
            health.update(model=folder, fingerprint=model_fingerprint(served))
        return health

    return app

# the answers waitress sends for us, declared as it declares its own (BadRequest, ...)
class Unauthorized(Error):
    code, reason = 401, "Unauthorized"

class RequestTimeout(Error):
    code, reason = 408, "Request Timeout"

class JsonErrorTask(ErrorTask):
    """waitress's own errors (400, 413, 431, ...) and ours as one line of JSON, as the app's."""
    def execute(self):
        e = self.request.error
        body = json.dumps({"error": f"{e.reason}: {e.body}"}).encode()
        self.status, self.content_length = f"{e.code} {e.reason}", len(body)
        self.response_headers.append(("Content-Type", "application/json"))
        self.set_close_on_finish()
        self.write(body)

def serve(app, *, host, port, token, max_connections, max_body, header_timeout, body_timeout):
    """`app` on waitress 3.0.2 -> its server (.run(); .effective_port). waitress bounds connections,
    head (431) and body (413) in bytes; on its channel internals this adds the token checked at the
    head and deadlines for head, body and idling (docs/reference-server.md)."""

    class Parser(HTTPRequestParser):
        def __init__(self, adj):
            super().__init__(adj)
            self.started = time.time()

        # a request with a body needs the token before a byte of its body is read, whatever else
        # (its size) is wrong with it
        def received(self, data):
            n = super().received(data)
            if (self.headers_finished and (self.content_length or self.chunked)
                    and not authorized(self.headers.get("AUTHORIZATION", ""), token)):
                self.error, self.completed = Unauthorized("missing or wrong bearer token"), True
            return n

    class Channel(HTTPChannel):
        parser_class, error_task_class = Parser, JsonErrorTask

    class Server(TcpWSGIServer):
        channel_class = Channel

        # every second (cleanup_interval), on the reading thread, in place of waitress's own (whose
        # channel_timeout counts silence only): idle connections closed, late requests answered 408
        def maintenance(self, now):
            for channel in list(self.active_channels.values()):
                req = channel.request
                if req is None or req.completed:
                    if not channel.requests and now - channel.last_activity > header_timeout:
                        channel.will_close = True
                    continue
                what, limit = (("request", body_timeout) if req.headers_finished
                               else ("request line and headers", header_timeout))
                if now - req.started <= limit:
                    continue
                # as waitress does for its own 431: an answer needs a request line
                if not req.headers_finished:
                    req.parse_header(b"GET / HTTP/1.0\r\n")
                req.error = RequestTimeout(f"{what} not sent within {limit:g}s")
                # as HTTPChannel.received does with a request read whole
                with channel.requests_lock:
                    req.completed, channel.request = True, None
                    channel.requests.append(req)
                    if len(channel.requests) == 1:
                        self.add_task(channel)

    # waitress counts its listening socket and its trigger as connections
    return Server(app, host=host, port=port, threads=4, connection_limit=max_connections + 2,
                  max_request_header_size=MAX_HEAD, max_request_body_size=max_body + 1,
                  cleanup_interval=1)

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--model", required=True, help="HF model id or folder of the reference model")
    add("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    add("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    add("--port", type=int, default=59875, help="TCP port to listen on")
    add("--threads", type=int, default=1, help="torch CPU threads (keep low on shared cores)")
    add("--max-tokens", type=int, default=262144, help="most tokens per request (else 413)")
    add("--max-seqs", type=int, default=1024, help="most sequences per request (else 413)")
    add("--max-body-mb", type=float, default=16.0, help="largest request body, MiB (else 413)")
    add("--micro-batch", type=int, default=MICRO_BATCH, help="most sequences per forward pass")
    add("--max-forward-tokens", type=int, default=MAX_FORWARD_TOKENS, help="bounds a pass's memory")
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
        help="auto: bfloat16 on a GPU that computes in it natively, else float32")
    add("--fp32-lm-head", action="store_true",
        help="bf16: the lm_head in fp32, as grpo_train.py --fp32-lm-head")
    add("--token", default=os.environ.get("REF_SERVER_TOKEN"),
        help="require 'Authorization: Bearer TOKEN' (default: $REF_SERVER_TOKEN, else none)")
    add("--checkpoint-dir", help="allow POST /reload of checkpoints under this folder (+ a token)")
    add("--max-connections", type=int, default=100, help="most connections open (more wait)")
    add("--header-timeout", type=float, default=10.0, help="seconds to send a head, or stay idle")
    add("--body-timeout", type=float, default=60.0, help="seconds to send a request (else 408)")
    add("--insecure", action="store_true", help="allow a non-loopback --host without a token")
    a = p.parse_args(argv)
    # exits with status 2, before loading anything or binding the port
    if err := exposure_error(a.host, a.token, a.insecure) or missing_folder(a.model):
        p.error(err)
    # oversubscribed shared cores make everything 10-100x slower
    torch.set_num_threads(a.threads)
    max_body = int(a.max_body_mb * 2**20)
    model = load_model(a.model, a.device, a.dtype, a.fp32_lm_head)
    app = make_app(model, name=a.model, max_seqs=a.max_seqs,
                   max_tokens=a.max_tokens, max_body=max_body, micro_batch=a.micro_batch,
                   max_forward_tokens=a.max_forward_tokens, token=a.token,
                   checkpoint_dir=a.checkpoint_dir)
    server = serve(app, host=a.host, port=a.port, token=a.token, max_connections=a.max_connections,
                   max_body=max_body, header_timeout=a.header_timeout, body_timeout=a.body_timeout)
    url = f"http://{a.host}:{server.effective_port}"
    print(f"ref_server: {a.model} on {a.device}, listening on {url}", flush=True)
    server.run()

if __name__ == "__main__":
    main()
