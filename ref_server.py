"""Reference-model server for GRPO: holds the frozen reference model, answers per-token log-probs.
    python ref_server.py --model Qwen/Qwen2.5-0.5B-Instruct --device cuda:0 --port 59875
GET /health, POST /logps, POST /reload: docs/reference-server.md. Imports no project file."""
import argparse
import hashlib
import hmac
import ipaddress
import json
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
from waitress.utilities import Error, queue_logger

REQUEST_KEYS = ("input_ids", "seq_lens", "prompt_lens")
# the config fields model_fingerprint hashes (/reload compares every field: check_config)
ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads")
# the request line and headers, all that is read before the token is checked (a request's: < 1 KiB)
MAX_HEAD = 2**16

class WireError(bottle.HTTPError):
    """An invalid request, /reload folder or answer: in a route, answered with `status_code`."""
    __init__ = lambda self, msg, status=400: bottle.HTTPError.__init__(self, status, msg)
    __str__ = lambda self: self.body

def read_body(body: bytes) -> tuple[dict, dict]:
    """A safetensors buffer -> (tensors, metadata); any failure is the sender's: WireError."""
    try:
        tensors = st_load(body)
        meta = json.loads(body[8:8 + int.from_bytes(body[:8], "little")]).get("__metadata__")
    # SafetensorError, torch refusing a dtype or shape (its C++ backtrace cut), json: "bad bytes"
    except Exception as e:
        raise WireError(f"not a valid safetensors body: {str(e).partition(chr(10))[0][:200]}")
    return tensors, meta or {}

def decode_request(body, *, vocab_size, max_seqs, max_tokens, max_seq_len=None):
    """A /logps body: int32 `input_ids` (every prompt+completion, concatenated), `seq_lens` and
    `prompt_lens` (B,), metadata {"temperature": "1.0"} -> (prompts, completions, temperature)."""
    tensors, meta = read_body(body)
    if set(tensors) != set(REQUEST_KEYS):
        raise WireError(f"expected tensors {list(REQUEST_KEYS)}, got {sorted(tensors)}")
    for name, t in tensors.items():
        if t.dtype != torch.int32 or t.dim() != 1:
            raise WireError(f"{name} must be a 1-D int32 tensor, got {t.dtype} {list(t.shape)}")
    ids, seq_lens, prompt_lens = (tensors[k].long() for k in REQUEST_KEYS)
    if (B := len(seq_lens)) == 0 or len(prompt_lens) != B:
        raise WireError(f"one prompt_len per seq_len, at least one: got {len(prompt_lens)}, {B}")
    # one that is < 1 fails the prompt_len check below
    if seq_lens.sum().item() != len(ids):
        raise WireError(f"seq_lens sum to {seq_lens.sum().item()}, not len(input_ids)={len(ids)}")
    # one forward pass, padded: memory is bounded by a budget of padded tokens
    if B > max_seqs or (B > 1 and B * seq_lens.max().item() > max_tokens):
        raise WireError(f"{B} sequences padded to {seq_lens.max().item()} tokens > limit "
                        f"{max_seqs} sequences, {max_tokens} padded tokens", 413)
    if max_seq_len and seq_lens.max() > max_seq_len:
        raise WireError(f"a sequence of {seq_lens.max().item()} tokens > the model's context "
                        f"length {max_seq_len}", 413)
    if ((prompt_lens < 1) | (prompt_lens >= seq_lens)).any():
        raise WireError("every prompt_len must be >= 1 and < its seq_len")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise WireError(f"token ids must be in [0, {vocab_size}), "
                        f"got [{ids.min().item()}, {ids.max().item()}]")
    try:
        temperature = float(meta["temperature"])
    except (KeyError, ValueError) as e:
        raise WireError(f"metadata needs a numeric 'temperature', got {meta}") from e
    # below 0.001, logits / T overflow float32 (1e-45: -inf, 1e-300: NaN); samplers call it greedy
    if not 1e-3 <= temperature < float("inf"):
        raise WireError(f"temperature must be finite and >= 0.001, got {temperature}")
    seqs = list(zip(ids.split(seq_lens.tolist()), prompt_lens.tolist()))
    return [s[:p].tolist() for s, p in seqs], [s[p:].tolist() for s, p in seqs], temperature

def encode_response(logps: list[torch.Tensor]) -> bytes:
    """The /logps answer: one float32 `logps` of every completion token, concatenated."""
    return st_save({"logps": torch.cat([t.detach().float().flatten().cpu() for t in logps])})

def missing_folder(model) -> str | None:
    """Why --model is no model: a folder or path (. / ~ first, two slashes) without config.json."""
    folder, path = os.path.expanduser(model), model[:1] in ".~/" or model.count("/") > 1
    if (path or os.path.isdir(folder)) and not os.path.isfile(f"{folder}/config.json"):
        return f"--model {model}: {'no config.json' if os.path.isdir(folder) else 'no such folder'}"

def exposure_error(host, token, insecure) -> str | None:
    """Why serving on `host` is refused: off loopback (a name may resolve to anything)."""
    try:
        loopback = host.lower() == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not (token or insecure or loopback):
        return (f"--host {host} is reachable from other machines, but no token is set: set "
                "REF_SERVER_TOKEN (or --token), bind 127.0.0.1, or pass --insecure.")

def model_fingerprint(model, samples=64) -> str:
    """Hash of ARCH_KEYS and each tensor's name, shape and `samples` strided values in bfloat16
    (float32 and bfloat16 copies agree): the trainer compares it with its policy's."""
    arch = {k: getattr(model.config, k, None) for k in ARCH_KEYS}
    h = hashlib.sha256(json.dumps(arch, sort_keys=True).encode())
    picked = []
    for name, w in sorted(model.state_dict().items()):
        h.update(f"{name}{list(w.shape)};".encode())
        picked.append(w.detach().flatten()[::max(1, w.numel() // samples)][:samples].bfloat16())
    h.update(torch.cat(picked).float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]

def default_dtype(device) -> str:
    """bfloat16 on a GPU that computes in it natively, else float32, as the trainer picks."""
    native = "cuda" in str(device) and torch.cuda.is_bf16_supported(including_emulation=False)
    return "bfloat16" if native else "float32"

def logit_transform(config) -> str | None:
    """Why log-probs of lm_head alone (compute_logps, the trainer's) are not vLLM's, or None."""
    for key, same in (("final_logit_softcapping", None), ("logits_scaling", 1), ("logit_scale", 1),
                      ("lm_head_multiplier", 1)):
        if (value := getattr(config.get_text_config(), key, None)) not in (None, same):
            return f"its config has {key} {value}; this trainer's log-probs apply lm_head alone"

def load_model(model, device="cpu", dtype="auto", fp32_lm_head=False, **_):
    # here, so importing this module stays light
    from transformers import AutoConfig, AutoModelForCausalLM
    dtype = getattr(torch, default_dtype(device) if dtype == "auto" else dtype)
    try:
        if why := logit_transform(AutoConfig.from_pretrained(model)):
            raise SystemExit(f"ref_server: --model {model}: {why}")
        net = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, use_safetensors=True)
    # safetensors only (no format that runs code on load); OSError: none, not on the hub, offline
    except OSError as e:
        raise SystemExit(f"ref_server: --model {model}: {str(e).splitlines()[0]}") from None
    if fp32_lm_head:
        # as grpo_train.py --fp32-lm-head and vLLM 0.32's head_dtype float32
        head = net.get_output_embeddings()
        bias = lambda: None if head.bias is None else head.bias.float()
        head.forward = lambda h: torch.nn.functional.linear(h.float(), head.weight.float(), bias())
    return net.to(device).eval().requires_grad_(False)

@torch.no_grad()
def compute_logps(model, prompts, completions, temperature, chunk=512) -> list[torch.Tensor]:
    """float32 log-probs at `temperature` of each completion's tokens, in one forward pass, as
    grpo_train's (a test checks); the lm_head on `chunk` tokens at a time."""
    seqs = [torch.tensor(p + c) for p, c in zip(prompts, completions)]
    # right-padded: positions are 0, 1, ... as transformers 5.19 numbers them by default
    pad = lambda rows: torch.nn.utils.rnn.pad_sequence(rows, batch_first=True).to(model.device)
    input_ids, mask = pad(seqs), pad([torch.ones_like(s) for s in seqs])
    # get_decoder / get_output_embeddings (transformers 5.19): the body and lm_head of any causal LM
    hidden = model.get_decoder()(input_ids, attention_mask=mask, use_cache=False).last_hidden_state
    # the state at position i predicts token i + 1: each completion's tokens, and the states before
    spans = [(row, len(p) - 1, len(s) - 1) for row, (p, s) in enumerate(zip(prompts, seqs))]
    states = torch.cat([hidden[row, a:b] for row, a, b in spans])
    targets = torch.cat([input_ids[row, a + 1:b + 1] for row, a, b in spans])
    out = []
    for h, t in zip(states.split(chunk), targets.split(chunk)):
        logits = model.get_output_embeddings()(h).float() / temperature
        out.append(logits.gather(-1, t.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1))
    return list(torch.cat(out).cpu().split([len(c) for c in completions]))

# config.json fields that do not change what the model computes (docs/reference-server.md: why)
CONFIG_KEYS_IGNORED = ("transformers_version", "_name_or_path", "architectures", "dtype",
                       "torch_dtype", "use_cache")
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}

def _open(parent, name, path, fds, flags=0) -> int:
    """`name` in folder `parent` (None: absolute), opened via no symlink, not blocking -> `fds`."""
    # O_NOFOLLOW refuses a symlink, even one swapped in after this lstat; the lstat says why
    if parent and stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
        raise WireError(f"{path!r} is not under the server's --checkpoint-dir: {name!r} is a "
                        "symlink", 403)
    fds.append(os.open(name, OPEN_FLAGS | flags, dir_fd=parent))
    return fds[-1]

def _open_folder(path, checkpoint_dir, fds) -> tuple[str, int]:
    """Folder `path` opened a component at a time from `checkpoint_dir` -> (abspath, its fd)."""
    # lexical: '..' cannot climb out, and below the root no symlink passes
    folder, root = os.path.abspath(path), os.path.abspath(checkpoint_dir)
    if os.path.commonpath([folder, root]) != root:
        raise WireError(f"{path!r} is not under the server's --checkpoint-dir", 403)
    # the root is trusted: its own symlinks, if any, are resolved
    for part in [os.path.realpath(root)] + os.path.relpath(folder, root).split(os.sep):
        try:
            _open(fds[-1] if fds else None, part, path, fds, os.O_DIRECTORY)
        except OSError as e:
            raise WireError(f"{path!r} is not a checkpoint folder ({part!r}: {e.strerror})") from e
    return folder, fds[-1]

def _open_file(folder_fd, name, path, fds, max_bytes) -> int:
    """Regular file `name` in the folder: checked on its descriptor, one link, `max_bytes`."""
    try:
        st = os.fstat(_open(folder_fd, name, path, fds))
    except FileNotFoundError as e:
        raise WireError(f"{path!r} is not a checkpoint folder: it has no {name} (sharded, .bin "
                        "and .pt checkpoints are never loaded)", 422) from e
    # ELOOP: a symlink swapped in after _open's lstat
    except OSError as e:
        raise WireError(f"{name} cannot be opened: {e.strerror}", 422) from e
    if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
        raise WireError(f"{name} is not a regular file of at most {max_bytes} bytes", 422)
    if st.st_nlink > 1:
        raise WireError(f"{name} has {st.st_nlink} hard links: one may lie outside "
                        "--checkpoint-dir; copy the file instead", 422)
    return fds[-1]

def check_config(fd, served_config):
    """config.json on descriptor `fd`, read by the served config's class, must equal the served
    config field by field (`auto_map`, custom code, included) but for CONFIG_KEYS_IGNORED."""
    try:
        config = json.loads(os.pread(fd, 2**20, 0))
    except (ValueError, RecursionError) as e:
        raise WireError(f"config.json is not readable JSON: {str(e)[:200]}", 422) from e
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

def checked_weights(fd, state) -> dict:
    """model.safetensors on `fd`, checked, then read 1 GiB a call (never mapped) -> its tensors."""
    size, head = os.fstat(fd).st_size, os.pread(fd, 8, 0)
    header = os.pread(fd, min(int.from_bytes(head, "little"), 10**8), 8)
    # safetensors 0.8.0 checks the header (100 MB at most) on a memfd: it, then a hole for the data
    with open(os.memfd_create(""), "wb", buffering=0) as copy:
        copy.write(head + header)
        copy.truncate(size)
        try:
            safe_open(f"/proc/self/fd/{copy.fileno()}", framework="pt")
        except SafetensorError as e:
            raise WireError(f"model.safetensors is not a readable safetensors file: "
                            f"{str(e)[:200]}", 422) from e
    table = {k: v for k, v in json.loads(header).items() if k != "__metadata__"}
    wrong = [f"{k} {v['dtype']} {v['shape']} (served: {list(state[k].shape)})"
             for k, v in table.items() if k in state
             and (v["dtype"] not in DTYPES or v["shape"] != [*state[k].shape])]
    if (unexpected := sorted(set(table) - set(state))) or wrong:
        raise WireError(f"model.safetensors does not fit the served model: unexpected "
                        f"{unexpected[:5]}, other shapes or float dtypes {wrong[:3]}", 422)
    n, data = 8 + len(header), memoryview(bytearray(size))
    if sum(os.preadv(fd, [data[i:i + 2**30]], i) for i in range(0, size, 2**30)) < size:
        raise WireError("model.safetensors changed while it was read", 422)
    cut = lambda a, b, dtype: torch.frombuffer(data[n + a:n + b], dtype=DTYPES[dtype])
    return {k: cut(*v["data_offsets"], v["dtype"]).view(v["shape"]) for k, v in table.items()}

def read_checkpoint(path, checkpoint_dir, model) -> tuple[str, dict]:
    """Folder `path` under `checkpoint_dir` (config.json, one model.safetensors) -> (its abspath, a
    complete, finite state dict); of tied weights, one is enough: the first wins, as in HF 5.19."""
    state, fds = model.state_dict(), []
    try:
        folder, folder_fd = _open_folder(path, checkpoint_dir, fds)
        check_config(_open_file(folder_fd, "config.json", path, fds, 2**20), model.config)
        got = checked_weights(_open_file(folder_fd, "model.safetensors", path, fds, 2**62), state)
        groups = {}
        for k, w in state.items():
            groups.setdefault((w.data_ptr(), tuple(w.shape)) if w.data_ptr() else k, []).append(k)
        if missing := [g[0] for g in groups.values() if not got.keys() & set(g)]:
            raise WireError("not a complete checkpoint of the served architecture: missing "
                            f"{missing[:5]}", 422)
        weights = {}
        for group in groups.values():
            data = got[source := next(key for key in group if key in got)]
            if not torch.isfinite(data).all():
                raise WireError(f"{source} holds values that are not finite (NaN or inf)", 422)
            weights.update(dict.fromkeys(group, data.to(state[group[0]].dtype)))
        return folder, weights
    finally:
        for fd in fds:
            os.close(fd)

def authorized(header, token) -> bool:
    """header: as WSGI holds it, bytes as latin-1 (bottle's get_header 500s on non-UTF-8)."""
    return not token or hmac.compare_digest(header.encode("latin-1"), f"Bearer {token}".encode())

def make_app(served, args):
    """The bottle app serving model `served` within the limits in `args` (parse_args)."""
    app = bottle.Bottle()
    # one forward (or reload) at a time; threads overlap only socket I/O and decoding
    lock = threading.Lock()
    limits = {"vocab_size": served.get_input_embeddings().num_embeddings,
              "max_seqs": args.max_seqs, "max_tokens": args.max_tokens,
              "max_seq_len": getattr(served.config, "max_position_embeddings", None)}
    health = {"status": "ok", "model": args.model, "fingerprint": model_fingerprint(served),
              "max_body": args.max_body, **limits}

    # every error, bottle's own 404/405/500 too, as one line of JSON (bounded: some quote requests)
    def json_error(res):
        bottle.response.content_type = "application/json"
        return json.dumps({"error": str(res.body)[:500]})
    app.default_error_handler = json_error
    app.get("/health")(lambda: health)

    def checked_body(media_type):
        """The body, after the token check; waitress (serve) has checked its size and syntax."""
        if not authorized(bottle.request.environ.get("HTTP_AUTHORIZATION", ""), args.token):
            bottle.abort(401, "missing or wrong bearer token")
        if not (length := bottle.request.environ.get("CONTENT_LENGTH", "")):
            bottle.abort(411, "Content-Length required")
        # another type is another format; none is taken as this one, as RFC 9110 (8.3) allows
        if (sent := bottle.request.content_type.partition(";")[0].strip()) not in ("", media_type):
            bottle.abort(415, f"Content-Type must be {media_type}, got {sent[:100]!r}")
        return bottle.request.environ["wsgi.input"].read(min(int(length), args.max_body))

    @app.post("/logps")
    def _logps():
        request = decode_request(checked_body("application/octet-stream"), **limits)
        with lock:
            logps = compute_logps(served, *request)
        if not all(torch.isfinite(t).all() for t in logps):
            bottle.abort(500, "the reference model gave non-finite log-probs (weights, dtype?)")
        bottle.response.content_type = "application/octet-stream"
        return encode_response(logps)

    @app.post("/reload")
    def _reload():
        if not (args.token and args.checkpoint_dir):
            bottle.abort(403, "reload is off: start the server with --checkpoint-dir and a token")
        try:
            path = json.loads(checked_body("application/json"))["path"]
        except (ValueError, KeyError, TypeError, RecursionError):
            path = None
        if not isinstance(path, str) or not path or not path.isprintable():
            bottle.abort(400, 'expected a JSON body {"path": "..."}, the path printable')
        with lock:
            folder, weights = read_checkpoint(path, args.checkpoint_dir, served)
            # checked: the served names, shapes and float dtypes, so the copy cannot fail
            served.load_state_dict(weights, strict=True)
            health.update(model=folder, fingerprint=model_fingerprint(served))
        return health
    return app

class JsonError(Error):
    """An answer waitress sends (our 401, 408; its own 400, 413, 431...) as JSON, as the app's."""
    def __init__(self, code, reason, body):
        self.code, self.reason, self.body = code, reason, body
    def to_response(self, ident=None):
        body = json.dumps({"error": f"{self.reason}: {self.body}"}).encode()
        return f"{self.code} {self.reason}", [("Content-Type", "application/json")], body

def serve(app, args):
    """`app` on waitress 3.0.2, which bounds connections, head (431) and body (413) in bytes; on
    its internals, the token checked at the head and deadlines -> its server (.run())."""
    class Parser(HTTPRequestParser):
        # a body needs the token, and Content-Length: any Transfer-Encoding is a 411 (waitress reads
        # chunked, quadratic on a size line that never ends, and answers others 501), before reading
        def received(self, data):
            # the deadlines run from the first byte (waitress makes a parser for it)
            self.started = getattr(self, "started", time.time())
            n = super().received(data)
            if (self.headers_finished and (self.content_length or self.chunked)
                    and not authorized(self.headers.get("AUTHORIZATION", ""), args.token)):
                self.error = JsonError(401, "Unauthorized", "missing or wrong bearer token")
            elif self.chunked or getattr(self.error, "code", None) == 501:
                self.error = JsonError(411, "Length Required", "send Content-Length")
            elif getattr(self.error, "code", None) == 413:
                self.error.body = f"exceeds max_body of {args.max_body} bytes"
            if error := self.error:
                self.completed, self.error = True, JsonError(error.code, error.reason, error.body)
            return n

    class Server(TcpWSGIServer):
        channel_class = type("Channel", (HTTPChannel,), {"parser_class": Parser})
        # every second (cleanup_interval), on the reading thread, in place of waitress's own (whose
        # channel_timeout counts silence only): idle connections closed, late requests answered 408
        def maintenance(self, now):
            for channel in list(self.active_channels.values()):
                req = channel.request
                if req is None or req.completed:
                    if not channel.requests and now - channel.last_activity > args.header_timeout:
                        channel.will_close = True
                    continue
                what, limit = (("request", args.body_timeout) if req.headers_finished
                               else ("request line and headers", args.header_timeout))
                if now - req.started <= limit:
                    continue
                # as waitress does for its own 431: an answer needs a request line
                if not req.headers_finished:
                    req.parse_header(b"GET / HTTP/1.0\r\n")
                req.error = JsonError(408, "Request Timeout", f"{what} not sent within {limit:g}s")
                # as HTTPChannel.received does with a request read whole
                with channel.requests_lock:
                    req.completed, channel.request = True, None
                    channel.requests.append(req)
                    if len(channel.requests) == 1:
                        self.add_task(channel)

    # one forward at a time (make_app): requests waiting their turn are the design, not news
    queue_logger.setLevel("ERROR")
    # waitress counts its socket and trigger as connections, and refuses a body >= its bound
    return Server(app, host=args.host, port=args.port, threads=4,
                  connection_limit=args.max_connections + 2, max_request_header_size=MAX_HEAD,
                  max_request_body_size=args.max_body + 1, cleanup_interval=1)

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--model", required=True, help="HF model id or folder of the reference model")
    add("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    add("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    add("--port", type=int, default=59875, help="TCP port to listen on (0: any free one)")
    add("--threads", type=int, default=1, help="torch CPU threads (keep low on shared cores)")
    add("--max-tokens", type=int, default=8192, help="most padded tokens a request (else 413)")
    add("--max-seqs", type=int, default=1024, help="most sequences per request (else 413)")
    add("--max-body-mb", type=float, default=16.0, help="largest request body, MiB (else 413)")
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
        help="auto: bfloat16 on a GPU that computes in it natively, else float32")
    add("--fp32-lm-head", action="store_true", help="bf16: the lm_head in fp32, as the trainer's")
    add("--token", default=os.environ.get("REF_SERVER_TOKEN"),
        help="require 'Authorization: Bearer TOKEN' (default: $REF_SERVER_TOKEN, else none)")
    add("--checkpoint-dir", help="allow POST /reload of checkpoints under this folder (+ a token)")
    add("--max-connections", type=int, default=100, help="most connections open (more wait)")
    add("--header-timeout", type=float, default=10.0, help="seconds to send a head, or stay idle")
    add("--body-timeout", type=float, default=60.0, help="seconds to send a request (else 408)")
    add("--insecure", action="store_true", help="allow a non-loopback --host without a token")
    args = p.parse_args(argv)
    bad = [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if type(v) in (int, float)
           and not (0 <= v < 2**16 if k == "port" else 0 < v < float("inf"))]
    # exits with status 2, before loading anything or binding the port
    if err := bad and f"{', '.join(bad)}: out of range" or exposure_error(
            args.host, args.token, args.insecure) or missing_folder(args.model):
        p.error(err)
    args.max_body = int(args.max_body_mb * 2**20)
    return args

def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    # bound first: a port in use is said before the model loads; run() serves the app set below
    try:
        server = serve(bottle.Bottle(), args)
    except OSError as e:
        raise SystemExit(f"ref_server: cannot listen on {args.host}:{args.port}: {e.strerror}")
    server.application = make_app(load_model(**vars(args)), args)
    print(f"ref_server: {args.model} on {args.device}, listening on "
          f"http://{args.host}:{server.effective_port}", flush=True)
    server.run()

if __name__ == "__main__":
    main()
