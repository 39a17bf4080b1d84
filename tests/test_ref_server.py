"""ref_server: the wire format in-process, then the real server in a subprocess (started once for the module)."""
import copy
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from safetensors.torch import save as st_save

from grpo_train import completion_logps, pad_batch
from ref_server import (RefServerError, WireError, decode_request, decode_response, encode_request,
                        encode_response, model_fingerprint, ref_logps, wait_for_server)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = 108  # tiny model's vocab
TOKEN = "s3cret"
LIMITS = dict(vocab_size=V, max_seqs=16, max_tokens=2000)
# ragged: prompts and completions of different lengths, more rows than the server's --micro-batch 2
PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
COMPLETIONS = [[20, 21], [22, 23, 24, 25, 26, 27], [28], [29, 30, 31], [0, 0, 107]]


def body(ids, seq_lens, prompt_lens, temperature="1.0", dtype=torch.int32, extra=None, drop=None):
    t = {"input_ids": torch.tensor(ids, dtype=dtype), "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
         "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int32), **(extra or {})}
    t.pop(drop, None)
    return st_save(t, metadata=None if temperature is None else {"temperature": temperature})


def raw(header, data):  # a hand-made safetensors buffer, for what safetensors.torch.save refuses to write
    h = json.dumps(header).encode()
    return len(h).to_bytes(8, "little") + h + data


GOOD = encode_request([[1, 2], [3]], [[4], [5, 6]], 1.0)
# (id, body, expected status, substring of the error)
BAD = [
    ("empty", b"", 400, "empty"),
    ("garbage", b"hello, this is not safetensors", 400, "safetensors"),
    ("truncated", GOOD[:-3], 400, "safetensors"),
    ("unknown-dtype", raw({"input_ids": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)), 400,
     "safetensors"),
    ("int64-ids", body([1, 2], [2], [1], dtype=torch.int64), 400, "int32"),
    ("float-ids", body([1, 2], [2], [1], dtype=torch.float32), 400, "int32"),
    ("2d-ids", body([[1, 2]], [2], [1]), 400, "1-D"),
    ("missing-prompt-lens", body([1, 2], [2], [1], drop="prompt_lens"), 400, "missing tensor 'prompt_lens'"),
    ("extra-tensor", body([1, 2], [2], [1], extra={"x": torch.zeros(1)}), 400, "unexpected"),
    ("no-sequences", body([], [], []), 400, "no sequences"),
    ("lens-count-mismatch", body([1, 2, 3], [3], [1, 1]), 400, "prompt_lens has 2"),
    ("sum-mismatch", body([1, 2, 3], [2], [1]), 400, "sum(seq_lens)"),
    ("zero-seq-len", body([1, 2], [2, 0], [1, 0]), 400, "seq_lens must be > 0"),
    ("prompt-len-0", body([1, 2], [2], [0]), 400, "prompt_len"),
    ("negative-prompt-len", body([1, 2], [2], [-1]), 400, "prompt_len"),
    ("no-completion", body([1, 2], [2], [2]), 400, "prompt_len"),
    ("id-too-big", body([1, V], [2], [1]), 400, "token ids"),
    ("id-negative", body([-1, 2], [2], [1]), 400, "token ids"),
    ("temperature-0", body([1, 2], [2], [1], temperature="0"), 400, "temperature"),
    ("temperature-nan", body([1, 2], [2], [1], temperature="nan"), 400, "temperature"),
    ("temperature-text", body([1, 2], [2], [1], temperature="hot"), 400, "temperature"),
    ("temperature-missing", body([1, 2], [2], [1], temperature=None), 400, "temperature"),
    ("too-many-seqs", encode_request([[1]] * 17, [[2]] * 17, 1.0), 413, "sequences"),
    ("too-many-tokens", encode_request([[1] * 1500], [[2] * 501], 1.0), 413, "tokens"),
]


# ----------------------------------------------------------------------------- wire format, in-process

def test_request_round_trip():
    prompts, completions, temperature = decode_request(encode_request(PROMPTS, COMPLETIONS, 0.7), **LIMITS)
    assert (prompts, completions, temperature) == (PROMPTS, COMPLETIONS, 0.7)


def test_response_round_trip():
    logps = [torch.randn(len(c)) for c in COMPLETIONS]
    out = decode_response(encode_response(logps), [len(c) for c in COMPLETIONS])
    assert all(torch.equal(a, b) and b.dtype == torch.float32 for a, b in zip(logps, out))
    with pytest.raises(WireError, match="expected"):
        decode_response(encode_response(logps), [len(c) + 1 for c in COMPLETIONS])
    with pytest.raises(WireError, match="float32"):
        decode_response(st_save({"logps": torch.zeros(3, dtype=torch.float64)}), [3])
    with pytest.raises(WireError):
        decode_response(b"<html>502 Bad Gateway</html>", [3])


@pytest.mark.parametrize("name,data,status,msg", BAD, ids=[b[0] for b in BAD])
def test_decode_request_rejects(name, data, status, msg):
    with pytest.raises(WireError) as e:
        decode_request(data, **LIMITS)
    assert msg in str(e.value) and e.value.status == status


# ----------------------------------------------------------------------------- the real server

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_proc(tiny_model, tmp_path_factory):
    """Start the server (not waiting for it, so the slow boot overlaps other setup); kill it at module end."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("ref_server") / "log.txt", "w+")
    cmd = [sys.executable, os.path.join(ROOT, "ref_server.py"), "--model", tiny_model, "--port", str(port),
           "--threads", "1", "--micro-batch", "2", "--max-seqs", "16", "--max-tokens", "2000",
           "--max-body-mb", "0.05"]
    # the token goes through the environment, so it is not visible in `ps`
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "REF_SERVER_TOKEN": TOKEN})
    try:
        yield proc, f"http://127.0.0.1:{port}", log
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(server_proc, model):
    """URL of the running server, once /health answers (bounded wait; the server's log on failure)."""
    proc, url, log = server_proc
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            pytest.fail(f"ref_server did not come up (exit {proc.poll()}):\n{log.read()}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return url
        except requests.ConnectionError:
            time.sleep(0.2)


def local_logps(model, prompts, completions, temperature):
    ids, attn, _ = pad_batch(prompts, completions, pad_id=0)
    with torch.no_grad():
        lp = completion_logps(model, ids, attn, max(map(len, completions)), temperature)
    return [lp[i, :len(c)] for i, c in enumerate(completions)]


def post(url, data, token=TOKEN):
    return requests.post(url + "/logps", data=data, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def assert_json_error(r, status, msg=""):
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    assert msg in r.json()["error"] and "\n" not in r.text


def test_import_is_light(server_proc):  # server_proc: runs while the server boots
    # the trainer imports ref_server at its top: that must not pull in transformers/grpo_train or start anything
    code = "import sys, ref_server; assert not {'transformers', 'grpo_train'} & set(sys.modules), sys.modules.keys()"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_health(server, model, tiny_model):
    h = wait_for_server(server, timeout=10)
    assert h == {"status": "ok", "model": tiny_model, "vocab_size": V, "fingerprint": h["fingerprint"]}
    assert h["fingerprint"] == model_fingerprint(model)
    assert model_fingerprint(copy.deepcopy(model).to(torch.bfloat16)) == h["fingerprint"]  # nor does dtype


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logps_match_in_process(server, model, temperature):
    got = ref_logps(server, PROMPTS, COMPLETIONS, temperature, token=TOKEN)
    want = local_logps(model, PROMPTS, COMPLETIONS, temperature)
    for g, w, c in zip(got, want, COMPLETIONS):
        assert g.shape == (len(c),) and g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    # and each row equals its own unpadded forward: padding and micro-batching change nothing
    for g, p, c in zip(got, PROMPTS, COMPLETIONS):
        torch.testing.assert_close(g, local_logps(model, [p], [c], temperature)[0], atol=1e-4, rtol=0)


def test_concurrent_requests(server, model):
    want = local_logps(model, PROMPTS, COMPLETIONS, 1.0)
    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(lambda _: ref_logps(server, PROMPTS, COMPLETIONS, 1.0, token=TOKEN), range(4)))
    for got in results:
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name,data,status,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_then_good(server, model, name, data, status, msg):
    assert_json_error(post(server, data), status, msg)
    got = ref_logps(server, [[1, 2], [3]], [[4], [5, 6]], 1.0, token=TOKEN)  # still serving, still right
    for g, w in zip(got, local_logps(model, [[1, 2], [3]], [[4], [5, 6]], 1.0)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def raw_post(url, headers):
    """POST headers only (no body), so we can claim any Content-Length, or none."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.putrequest("POST", "/logps")
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_body_limits(server):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    # over --max-body-mb: refused from the header alone, before any byte of the body is read
    status, err = raw_post(server, {**auth, "Content-Length": str(int(0.05 * 2**20) + 1)})
    assert status == 413 and "limit" in err["error"]
    status, err = raw_post(server, auth)  # no Content-Length
    assert status == 411 and "Content-Length" in err["error"]
    assert post(server, GOOD).status_code == 200


def test_auth_paths_and_methods(server):
    assert_json_error(post(server, GOOD, token="wrong"), 401, "token")
    assert_json_error(requests.post(server + "/logps", data=GOOD, timeout=10), 401, "token")
    assert_json_error(requests.get(server + "/nope", timeout=10), 404)
    assert_json_error(requests.get(server + "/logps", timeout=10), 405)
    assert_json_error(requests.post(server + "/health", timeout=10), 405)


def test_client_errors(server):
    with pytest.raises(RefServerError, match="401.*token"):  # 4xx: at once, with the server's message
        ref_logps(server, [[1]], [[2]], 1.0, token="wrong", retries=3, backoff=10)
    dead = f"http://127.0.0.1:{free_port()}"
    t = time.monotonic()
    with pytest.raises(RefServerError, match=f"{dead}/logps failed after 3 attempts"):
        ref_logps(dead, [[1]], [[2]], 1.0, retries=2, backoff=0.05)
    assert 0.15 <= time.monotonic() - t < 10  # slept 0.05 + 0.1
    with pytest.raises(RefServerError, match="not ready"):
        wait_for_server(dead, timeout=0.5, interval=0.1)
