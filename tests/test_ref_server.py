"""ref_server: the wire format in-process, then the real server in a subprocess (started once for the module)."""
import copy
import errno
import gc
import gzip
import http.client
import http.server
import json
import re
import os
import select
import signal
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import requests
import torch
from hypothesis import given, settings
from safetensors.torch import load_file, save as st_save, save_file

import ref_client
import ref_server
from conftest import next_port, rank_zero
from ref_client import (RefServerError, decode_response, encode_request, ref_logps, reload_reference, split_to_fit,
                        wait_for_server)
from ref_server import (MAX_HEAD, WireError, compute_logps, decode_request, encode_response, exposure_error, make_app,
                        model_fingerprint, parse_args, serve)
from test_ref_server_fuzz import any_body

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = 108  # tiny model's vocab
TOKEN = "s3cret"
CONTEXT = 1024  # tiny model's max_position_embeddings
LIMITS = dict(vocab_size=V, max_seqs=16, max_tokens=2000, max_seq_len=CONTEXT)
# ragged: prompts and completions of different lengths, padded in one forward pass
PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
COMPLETIONS = [[20, 21], [22, 23, 24, 25, 26, 27], [28], [29, 30, 31], [0, 0, 107]]


def body(ids, seq_lens, prompt_lens, temperature="1.0", dtype=torch.int32, extra=None, drop=None):
    t = {"input_ids": torch.tensor(ids, dtype=dtype), "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
         "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int32), **(extra or {})}
    t.pop(drop, None)
    return st_save(t, metadata=None if temperature is None else {"temperature": temperature})


def raw(header, data=b""):  # a hand-made safetensors buffer, for what safetensors.torch.save refuses to write
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(h).to_bytes(8, "little") + h + data


def i32(n, start, end):  # a header entry
    return {"dtype": "I32", "shape": [n], "data_offsets": [start, end]}


GOOD = encode_request([[1, 2], [3]], [[4], [5, 6]], 1.0)
# (id, body, expected status, substring of the error)
BAD = [
    ("empty", b"", 400, "not a valid safetensors body"),
    ("garbage", b"hello, this is not safetensors", 400, "safetensors"),
    ("truncated", GOOD[:-3], 400, "safetensors"),
    ("truncated-in-header", GOOD[:20], 400, "safetensors"),
    ("header-length-huge", (2**62).to_bytes(8, "little") + GOOD[8:], 400, "safetensors"),
    ("header-length-past-end", len(GOOD).to_bytes(8, "little") + GOOD[8:], 400, "safetensors"),
    ("header-not-json", raw(b'{"input_ids": {"dtype": "I32", "shape": [2]', bytes(8)), 400, "safetensors"),
    ("header-not-utf8", raw(b'{"\xff": 1}'), 400, "safetensors"),
    ("header-not-object", raw(b"[1, 2]"), 400, "safetensors"),
    ("unknown-dtype", raw({"input_ids": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)), 400,
     "safetensors"),
    ("shape-vs-bytes", raw({"input_ids": i32(3, 0, 8), "seq_lens": i32(1, 8, 12), "prompt_lens": i32(1, 12, 16)},
                           bytes(16)), 400, "safetensors"),
    ("offsets-past-end", raw({"input_ids": i32(2, 0, 8), "seq_lens": i32(1, 8, 12), "prompt_lens": i32(1, 12, 20)},
                             bytes(16)), 400, "safetensors"),
    ("huge-shape", raw({"input_ids": {"dtype": "I32", "shape": [2**40], "data_offsets": [0, 2**42]}}, bytes(8)),
     400, "safetensors"),
    # 0 bytes, so safetensors agrees, but torch refuses the shape with a C++ backtrace: only its first line is sent
    ("huge-empty-shape", raw({"input_ids": {"dtype": "I32", "shape": [2**63, 0], "data_offsets": [0, 0]}}), 400,
     "Overflow"),
    ("int64-ids", body([1, 2], [2], [1], dtype=torch.int64), 400, "int32"),
    ("float-ids", body([1, 2], [2], [1], dtype=torch.float32), 400, "int32"),
    ("2d-ids", body([[1, 2]], [2], [1]), 400, "1-D"),
    ("missing-prompt-lens", body([1, 2], [2], [1], drop="prompt_lens"), 400,
     "expected tensors ['input_ids', 'seq_lens', 'prompt_lens'], got ['input_ids', 'seq_lens']"),
    ("extra-tensor", body([1, 2], [2], [1], extra={"x": torch.zeros(1)}), 400, "got ['input_ids', 'prompt_lens', 'seq_lens', 'x']"),
    ("no-sequences", body([], [], []), 400, "at least one: got 0, 0"),
    ("lens-count-mismatch", body([1, 2, 3], [3], [1, 1]), 400, "one prompt_len per seq_len, at least one: got 2, 1"),
    ("sum-mismatch", body([1, 2, 3], [2], [1]), 400, "seq_lens sum to 2, not len(input_ids)=3"),
    ("zero-seq-len", body([1, 2], [2, 0], [1, 0]), 400, "every prompt_len must be >= 1 and < its seq_len"),
    ("prompt-len-0", body([1, 2], [2], [0]), 400, "prompt_len"),
    ("negative-prompt-len", body([1, 2], [2], [-1]), 400, "prompt_len"),
    ("no-completion", body([1, 2], [2], [2]), 400, "prompt_len"),
    ("prompt-len-too-long", body([1, 2], [2], [3]), 400, "prompt_len"),
    ("negative-seq-len", body([1, 2], [3, -1], [1, 1]), 400, "every prompt_len must be >= 1 and < its seq_len"),
    ("id-too-big", body([1, V], [2], [1]), 400, "token ids"),
    ("id-negative", body([-1, 2], [2], [1]), 400, "token ids"),
    ("temperature-0", body([1, 2], [2], [1], temperature="0"), 400, "temperature"),
    ("temperature-nan", body([1, 2], [2], [1], temperature="nan"), 400, "temperature"),
    ("temperature-text", body([1, 2], [2], [1], temperature="hot"), 400, "temperature"),
    ("temperature-missing", body([1, 2], [2], [1], temperature=None), 400, "temperature"),
    # logits / T overflow: these answered NaN and -inf
    ("temperature-1e-300", body([1, 2], [2], [1], temperature="1e-300"), 400, "temperature"),
    ("temperature-1e-45", body([1, 2], [2], [1], temperature="1e-45"), 400, "temperature"),
    ("temperature-below-floor", body([1, 2], [2], [1], temperature="0.0009"), 400, "temperature"),
    ("longer-than-context", encode_request([[1] * 1000], [[2] * (CONTEXT - 999)], 1.0), 413, "context length"),
    ("too-many-seqs", encode_request([[1]] * 17, [[2]] * 17, 1.0), 413, "sequences"),
    ("too-many-padded-tokens", encode_request([[1] * 600] * 2, [[2] * 401] * 2, 1.0), 413, "2000 padded tokens"),
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
    assert msg in str(e.value) and e.value.status_code == status


# ----------------------------------------------------------------------------- the real server

def env_without_token():
    return {k: v for k, v in os.environ.items() if k != "REF_SERVER_TOKEN"}


def spawn_server(model_path, log_path, *args, env=None, port=None, script=None):
    """Start ref_server.py on `port` (default: conftest.next_port's), not waiting for it -> (proc, url, log).
    `script`: Python code run in its place, ref_server.py's arguments in sys.argv[1:]."""
    port = port or next_port()
    log = open(log_path, "w")
    cmd = [sys.executable, *(["-c", script] if script else [os.path.join(ROOT, "ref_server.py")]), "--model",
           model_path, "--port", str(port), "--threads", "1", *args]
    env = env_without_token() if env is None else env
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return proc, f"http://127.0.0.1:{port}", log


def stop_server(proc, log):
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


def wait_up(proc, url, log, timeout=120):
    """URL of the server once /health answers; fails the test (with the server's log) if it dies or is slow."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"ref_server did not come up (exit {proc.poll()}):\n{server_log(log)}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return url
        except (requests.ConnectionError, requests.Timeout):   # not up yet, or slow on a busy machine
            time.sleep(0.2)


def server_log(log):
    log.flush()
    with open(log.name) as f:  # a second handle: seeking the server's own would move where it writes
        return f.read()


@pytest.fixture(scope="module")
def server_proc(tiny_model, tmp_path_factory):
    """Start the server (not waiting for it, so the slow boot overlaps other setup); kill it at module end."""
    # the token goes through the environment, so it is not visible in `ps`
    proc, url, log = spawn_server(tiny_model, tmp_path_factory.mktemp("ref_server") / "log.txt",
                                  "--max-seqs", "16", "--max-tokens", "2000", "--max-body-mb", "0.05",
                                  env={**os.environ, "REF_SERVER_TOKEN": TOKEN})
    try:
        yield proc, url, log
    finally:
        stop_server(proc, log)


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(server_proc, model):
    """URL of the running server, once /health answers (bounded wait; the server's log on failure)."""
    return wait_up(*server_proc)


def local_logps(model, prompts, completions, temperature):
    """A plain HF forward per sequence, unpadded: all logits at temperature, log_softmax, the completion's."""
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1:-1].float() / temperature
            out.append(logits.log_softmax(-1).gather(-1, torch.tensor(c).unsqueeze(-1)).squeeze(-1))
    return out


def post(url, data, token=TOKEN):
    return requests.post(url + "/logps", data=data, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def assert_json_error(r, status, msg=""):
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    assert msg in r.json()["error"] and "\n" not in r.text


def assert_serves(url, model):
    """A good request after whatever came before: still answered, still right."""
    got = ref_logps(url, [[1, 2], [3]], [[4], [5, 6]], 1.0, token=TOKEN, retry_for=0)
    for g, w in zip(got, local_logps(model, [[1, 2], [3]], [[4], [5, 6]], 1.0)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_client_takes_the_token_from_the_environment(server, model):
    """The trainer calls ref_logps without a token: it comes from REF_SERVER_TOKEN, like the server's."""
    code = ("import sys, ref_client; ref_client.ref_logps(sys.argv[1], [[1, 2]], [[4]], 1.0, retry_for=0); "
            "print('ok')")
    env = env_without_token()
    no = subprocess.run([sys.executable, "-c", code, server], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=60)
    assert no.returncode != 0 and "401" in no.stderr
    yes = subprocess.run([sys.executable, "-c", code, server], cwd=ROOT, env={**env, "REF_SERVER_TOKEN": TOKEN},
                         capture_output=True, text=True, timeout=60)
    assert yes.returncode == 0 and yes.stdout.strip() == "ok", yes.stderr[-2000:]


def test_import_is_light():
    # the trainer imports the client (and so ref_server) at its top: that must not pull in transformers/grpo_train
    # or start anything
    code = "import sys, ref_client; assert not {'transformers', 'grpo_train'} & set(sys.modules), sys.modules.keys()"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_standalone_imports_no_project_module(tmp_path):
    """ref_server.py copied alone to another folder (the reference machine) imports and names no project module."""
    import ast
    project = {f.removesuffix(".py") for f in os.listdir(ROOT) if f.endswith(".py")} | {"demo", "bench", "tests"}
    tree = ast.parse(open(os.path.join(ROOT, "ref_server.py")).read())
    imported = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
                for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert not imported & (project - {"ref_server"}), imported & project
    (tmp_path / "ref_server.py").write_text(open(os.path.join(ROOT, "ref_server.py")).read())
    subprocess.run([sys.executable, "-c", "import ref_server; ref_server.main(['--help'])"], cwd=tmp_path,
                   check=True, timeout=60, capture_output=True, env={**env_without_token(), "PYTHONPATH": ""})


@pytest.mark.parametrize("host,token,insecure,refused", [
    ("127.0.0.1", None, False, False), ("127.4.5.6", None, False, False), ("::1", None, False, False),
    ("localhost", None, False, False), ("LocalHost", None, False, False),
    ("0.0.0.0", None, False, True), ("", None, False, True), ("::", None, False, True),
    ("192.168.1.20", None, False, True), ("10.0.0.1", "", False, True),  # an empty token is no token
    ("gpu-node-3", None, False, True),  # a host name could resolve to anything
    ("0.0.0.0", "t0k", False, False), ("0.0.0.0", None, True, False),
])
def test_exposure_error(host, token, insecure, refused):
    err = exposure_error(host, token, insecure)
    assert (err is not None) == refused
    if refused:
        assert f"--host {host} " in err and "REF_SERVER_TOKEN" in err and "--insecure" in err


def test_refuses_network_host_without_token():
    # exits before loading the model or binding the port: a missing model would fail with a traceback
    r = subprocess.run([sys.executable, os.path.join(ROOT, "ref_server.py"), "--model", "/nonexistent",
                        "--host", "0.0.0.0", "--port", str(next_port())],
                       capture_output=True, text=True, timeout=60, env=env_without_token())
    assert r.returncode == 2 and "--host 0.0.0.0 is reachable from other machines" in r.stderr, r.stderr
    assert "--insecure" in r.stderr and "Traceback" not in r.stderr


def test_a_port_in_use_is_one_line_before_the_model_loads(tmp_path):
    """A port another process listens on: one line naming it, said before the model loads (this --model's
    config.json is not JSON: loaded first, it would end in transformers' traceback)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{not json")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, os.path.join(ROOT, "ref_server.py"), "--model", str(model),
                            "--port", str(port)], capture_output=True, text=True, timeout=60,
                           env=env_without_token())
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines() == [f"ref_server: cannot listen on 127.0.0.1:{port}: Address already in use"]


@pytest.mark.parametrize("flags, said", [
    (["--threads", "0"], "--threads 0"),   # torch.set_num_threads' traceback
    (["--max-body-mb", "inf"], "--max-body-mb inf"),   # int(inf): an OverflowError traceback
    (["--port", "-5"], "--port -5"),   # waitress's ValueError traceback
    (["--port", "65536", "--max-tokens", "0", "--header-timeout", "nan"],   # every request 413 or 408
     "--port 65536, --max-tokens 0, --header-timeout nan")])
def test_a_number_out_of_range_is_one_line_before_the_model_loads(flags, said):
    """Every number above 0 and finite (argparse's float takes nan and inf), --port 0 (any free one) to
    65535: argparse's line naming each flag out of range, exit status 2, before the model loads."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "ref_server.py"), "--model", "/nonexistent",
                        *flags], capture_output=True, text=True, timeout=60, env=env_without_token())
    assert r.returncode == 2 and r.stderr.splitlines()[-1] == f"ref_server.py: error: {said}: out of range", \
        r.stderr


@pytest.mark.parametrize("model", ["runs/no-such-run/model", "./nope", "/nonexistent"])
def test_a_model_folder_that_is_not_there_is_one_line(tmp_path, model):
    """A path (two slashes, or . / ~ first) that names no folder: the flag's error, not transformers'
    traceback from taking it for a hub id."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "ref_server.py"), "--model", model,
                        "--port", str(next_port())],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env_without_token())
    assert r.returncode == 2 and r.stderr.splitlines()[-1].endswith(f"--model {model}: no such folder")
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("model", ["run", "run/", "./run"])
def test_a_folder_without_a_model_is_one_line(tmp_path, model):
    """A folder without config.json (a run's own, whose models are its step_N folders): the flag's error,
    not transformers' traceback from a config it cannot read."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "ref_server.py"), "--model", model,
                        "--port", str(next_port())],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env_without_token())
    assert r.returncode == 2 and r.stderr.splitlines()[-1].endswith(f"--model {model}: no config.json")
    assert "Traceback" not in r.stderr


def test_a_model_transformers_cannot_load_is_one_line(tmp_path, tiny_model):
    """A hub name the hub cannot give (offline here) and a folder without safetensors weights (a .bin
    checkpoint is never loaded): the flag and transformers' first line, not its traceback."""
    (tmp_path / "bin").mkdir()
    shutil.copy(os.path.join(tiny_model, "config.json"), tmp_path / "bin")
    for model, said in (("nobody/no-such-model", "huggingface.co"),
                        (str(tmp_path / "bin"), "model.safetensors")):
        r = subprocess.run([sys.executable, os.path.join(ROOT, "ref_server.py"), "--model", model,
                            "--port", str(next_port())], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path, env={**env_without_token(), "HF_HUB_OFFLINE": "1"})
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
        last = r.stderr.splitlines()[-1]
        assert last.startswith(f"ref_server: --model {model}: ") and said in last, r.stderr


def test_health(server, model, tiny_model):
    h = wait_for_server(server, timeout=10)
    assert h == {"status": "ok", "model": tiny_model, "vocab_size": V, "fingerprint": h["fingerprint"],
                 "max_seqs": 16, "max_tokens": 2000, "max_seq_len": CONTEXT, "max_body": int(0.05 * 2**20)}
    assert h["fingerprint"] == model_fingerprint(model)
    assert model_fingerprint(copy.deepcopy(model).to(torch.bfloat16)) == h["fingerprint"]  # nor does dtype


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logps_match_in_process(server, model, temperature):
    got = ref_logps(server, PROMPTS, COMPLETIONS, temperature, token=TOKEN)
    want = local_logps(model, PROMPTS, COMPLETIONS, temperature)
    for g, w, c in zip(got, want, COMPLETIONS):   # padding changes nothing
        assert g.shape == (len(c),) and g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


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
    assert_serves(server, model)


def raw_request(url, headers, method="POST", path="/logps"):
    """Send headers only (no body), so we can claim any Content-Length, or none -> (status, JSON error)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()
        r = conn.getresponse()
        text = r.read().decode()
        assert r.getheader("Content-Type").startswith("application/json") and "\n" not in text, text
        return r.status, json.loads(text)["error"]
    finally:
        conn.close()


def test_body_limits(server, model):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    limit = int(0.05 * 2**20)
    # over --max-body-mb: refused from the header alone (waitress's max_request_body_size), before any byte of
    # the body is read
    status, err = raw_request(server, {**auth, "Content-Length": str(limit + 1)})
    assert status == 413 and f"exceeds max_body of {limit} bytes" in err
    status, err = raw_request(server, {**auth, "Content-Length": "9" * 40})
    assert status == 413 and "max_body" in err
    # ... and when the client does send it all (the answer still arrives, though the body is never read)
    assert_json_error(post(server, GOOD + bytes(limit)), 413, "max_body")
    status, err = raw_request(server, auth)  # no Content-Length
    assert status == 411 and "Content-Length" in err
    # a chunked body (the client never sends one) is refused from the head: waitress's chunk parser spent 6 s
    # of CPU on an 8 MiB size line that never ends; without the token, the token is what is said
    for encoding in ("chunked", "gzip, chunked", "gzip"):
        status, err = raw_request(server, {**auth, "Transfer-Encoding": encoding})
        assert status == 411 and "Content-Length" in err, (encoding, status, err)
    assert raw_request(server, {"Transfer-Encoding": "chunked"})[0] == 401
    for bad in ("abc", "-5", "+5", "1e3", "0x10", "²"):  # waitress refuses them; bottle would 500
        status, err = raw_request(server, {**auth, "Content-Length": bad})
        assert status == 400 and "Content-Length" in err, (bad, status, err)
    status, _ = raw_request(server, {"Content-Length": str(limit + 1)})  # no token: not even that is said
    assert status == 401
    status, err = raw_request(server, {**auth, "X-Pad": "a" * MAX_HEAD})  # waitress's max_request_header_size
    assert status == 431 and f"max_header of {MAX_HEAD}" in err
    assert_serves(server, model)


def test_the_413_quotes_the_largest_body_accepted(server, model):
    """A body of --max-body-mb (/health's max_body) bytes is read; one byte more is a 413 that quotes that
    limit: waitress refuses a Content-Length at or over its own bound, max_body + 1, and its message
    quoted that bound, one byte above the true limit."""
    limit = requests.get(server + "/health", timeout=10).json()["max_body"]
    assert limit == int(0.05 * 2**20)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    # exactly the limit: read, then refused as a body (the padding is not safetensors), not for its size
    r = requests.post(server + "/logps", data=GOOD + bytes(limit - len(GOOD)), headers=headers, timeout=30)
    assert_json_error(r, 400, "not a valid safetensors body")
    r = requests.post(server + "/logps", data=GOOD + bytes(limit + 1 - len(GOOD)), headers=headers, timeout=30)
    assert_json_error(r, 413, f"Request Entity Too Large: exceeds max_body of {limit} bytes")
    assert_serves(server, model)


def test_requests_waiting_for_the_forward_are_not_a_warning_each(server_proc, server):
    """Twelve requests complete at once on the server's 4 threads, which take turns at the one forward:
    waitress logged "Task queue depth is N" once for each request that waited (8 lines on the console).
    Waiting for the forward is how the server works: the console says nothing of it."""
    body = encode_request([[1] * 200] * 8, [[2] * 50] * 8, 1.0)
    head = (b"POST /logps HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: "
            b"application/octet-stream\r\nContent-Length: %d\r\n\r\n" % (TOKEN.encode(), len(body)))
    clients = [connect(server) for _ in range(12)]
    try:
        for s in clients:
            s.sendall(head + body[:-1])
        # every body's last byte at once: the server's reading thread queues the twelve requests together
        time.sleep(0.5)
        for s in clients:
            s.sendall(body[-1:])
        for s in clients:
            with s.makefile("rb") as answer:
                assert answer.readline() == b"HTTP/1.1 200 OK\r\n"
    finally:
        for s in clients:
            s.close()
    log = server_log(server_proc[2])
    assert "Task queue depth" not in log and "Traceback" not in log, log[-2000:]


@pytest.mark.parametrize("content_type,status", [
    (None, 200), ("application/octet-stream", 200), ("Application/Octet-Stream; x=1", 200),
    ("application/json", 415), ("text/plain", 415), ("application/x-www-form-urlencoded", 415),
    ("multipart/form-data; boundary=x", 415)])
def test_logps_reads_a_safetensors_body_of_no_other_type(server, content_type, status):
    """/logps reads its body as safetensors, whatever the request said it was: a JSON body sent as
    application/json got "header too large", and a body labelled JSON or a form was served. Another
    Content-Type is a 415 naming the one expected; none at all is taken as it (RFC 9110 8.3)."""
    headers = {"Authorization": f"Bearer {TOKEN}", **({"Content-Type": content_type} if content_type else {})}
    for data in (GOOD, json.dumps({"input_ids": [1, 2]}).encode()):
        r = requests.post(server + "/logps", data=data, headers=headers, timeout=30)
        if status == 415:
            assert_json_error(r, 415, "Content-Type must be application/octet-stream, got "
                              f"{content_type.split(';')[0].lower()!r}")
        else:
            assert r.status_code == (200 if data == GOOD else 400), r.text


def test_reload_reads_a_json_body_of_no_other_type(tmp_path, tiny_model):
    """/reload reads its body as JSON, whatever the request said it was: a path sent as text/plain, or as
    application/octet-stream, reloaded the reference. Another Content-Type is a 415 naming the one
    expected, and nothing is reloaded; none at all is taken as JSON; the client sends application/json."""
    new = ref_server.load_model(tiny_model)
    with torch.no_grad():
        new.model.norm.weight.mul_(3)
    new.save_pretrained(tmp_path / "step_1")
    served = ref_server.load_model(tiny_model)
    before = model_fingerprint(served)
    args = in_process_args("--token", TOKEN, "--checkpoint-dir", str(tmp_path))
    with serve_in_thread(make_app(served, args), args) as url:
        body = json.dumps({"path": str(tmp_path / "step_1")})
        for content_type in ("text/plain", "application/octet-stream", "application/x-www-form-urlencoded"):
            r = requests.post(url + "/reload", data=body, timeout=60,
                              headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": content_type})
            assert_json_error(r, 415, f"Content-Type must be application/json, got {content_type!r}")
        assert requests.get(url + "/health", timeout=10).json()["fingerprint"] == before
        for content_type in (None, "application/json; charset=utf-8"):
            headers = {"Authorization": f"Bearer {TOKEN}", **({"Content-Type": content_type} if content_type else {})}
            r = requests.post(url + "/reload", data=body, headers=headers, timeout=60)
            assert r.status_code == 200 and r.json()["fingerprint"] == model_fingerprint(new), r.text
        (health,) = reload_reference(url, str(tmp_path / "step_1"), token=TOKEN, retry_for=0)
        assert health["fingerprint"] == model_fingerprint(new)


def test_auth_paths_and_methods(server, model):
    assert_json_error(post(server, GOOD, token="wrong"), 401, "token")
    assert_json_error(requests.post(server + "/logps", data=GOOD, timeout=10), 401, "token")
    for auth in (f"bearer {TOKEN}", f"Bearer  {TOKEN}", f"Bearer {TOKEN[:-1]}", TOKEN, f"Basic {TOKEN}", "Bearer",
                 f"Bearer {TOKEN}{TOKEN}", "Bearer sécret"):
        r = requests.post(server + "/logps", data=GOOD, headers={"Authorization": auth.encode()}, timeout=10)
        assert_json_error(r, 401, "token")
    assert_json_error(requests.get(server + "/nope", timeout=10), 404)
    assert_json_error(post(server + "/logps", GOOD), 404)  # /logps/logps
    assert_json_error(requests.get(server + "/logps", timeout=10), 405)
    assert_json_error(requests.put(server + "/logps", timeout=10), 405)
    assert_json_error(requests.delete(server + "/logps", timeout=10), 405)
    # a body without the token is refused as soon as the head is in, whatever its method
    assert_json_error(requests.put(server + "/logps", data=GOOD, timeout=10), 401, "token")
    assert_json_error(requests.post(server + "/health", timeout=10), 405)
    assert_serves(server, model)


def test_client_errors(server, capsys):
    with pytest.raises(RefServerError, match="401.*token"):  # 4xx: at once, with the server's message
        ref_logps(server, [[1]], [[2]], 1.0, token="wrong", retry_for=60, backoff=10)
    with pytest.raises(RefServerError, match="401.*token"):
        ref_logps(server, [[1]], [[2]], 1.0, retry_for=60, backoff=10)  # token=None: no Authorization header
    capsys.readouterr()
    dead = f"http://127.0.0.1:{next_port()}"
    # the limits come first (/health), and nothing answers: retried after 0.05, 0.1, ... s while that fits in
    # 0.3 s, each retry said on stderr (how many fit depends on the machine's speed: counted, not assumed)
    with pytest.raises(RefServerError, match=rf"{dead}/health failed after .* attempts in 0\.[0-3]s \(another "
                                             rf"would end past the 0\.3s allowed\)") as e:
        ref_logps(dead, [[1]], [[2]], 1.0, retry_for=0.3, backoff=0.05)
    retries = capsys.readouterr().err.splitlines()
    assert f"after {len(retries) + 1} attempts" in str(e.value) and retries, retries
    # the time it says is the time it took: two attempts 1 s apart, then a pause of 2 s would pass 2.5 s
    t0 = time.monotonic()
    with pytest.raises(RefServerError, match=r"after 2 attempts in (\d+\.\d)s") as e:
        ref_logps(dead, [[1]], [[2]], 1.0, retry_for=2.5, backoff=1.0)
    said = float(re.search(r"in (\d+\.\d)s", str(e.value)).group(1))
    assert 1.0 <= said <= time.monotonic() - t0 + 0.05, (said, str(e.value))
    capsys.readouterr()
    for line, pause in zip(retries, ["0.05s", "0.1s"]):
        assert line.startswith(f"ref_server client: GET {dead}/health failed (ConnectionError"), line
        assert line.endswith(f"retrying in {pause}"), line
    with pytest.raises(RefServerError, match="not ready"):
        wait_for_server(dead, timeout=0.5, interval=0.1)


def test_fuzz_live_server(server_proc, server, model):
    """Random and mutated bodies (see test_ref_server_fuzz.py): the server answers each exactly as
    decode_request does in-process (the status, or 200 with the right number of log-probs), never a 5xx."""
    limits = dict(vocab_size=V, max_seqs=16, max_tokens=2000)  # as the server was started

    @settings(max_examples=50, deadline=None, database=None)
    @given(any_body)
    def one(data):
        r = post(server, data)
        try:
            _, completions, _ = decode_request(data, **limits)
        except WireError as e:
            assert_json_error(r, e.status_code)
        else:
            assert r.status_code == 200, r.text
            assert len(decode_response(r.content, [len(c) for c in completions])) == len(completions)

    one()
    assert_serves(server, model)
    assert "Traceback" not in server_log(server_proc[2])


def raw_safetensors(header):
    """A safetensors file whose header says what it likes, with no data."""
    h = json.dumps(header).encode()
    return len(h).to_bytes(8, "little") + h


def bad_checkpoints(ckpts, good, outside):
    """(name, folder, status, message) for each way a /reload folder is refused. `good` is a complete checkpoint
    under `ckpts`; `outside` one outside it."""
    import shutil

    def variant(name, drop=(), files=None, config=None):
        d = ckpts / name
        shutil.copytree(good, d, ignore=shutil.ignore_patterns(*drop))
        for fname, data in (files or {}).items():
            (d / fname).write_bytes(data) if isinstance(data, bytes) else save_file(data, d / fname)
        if config is not None:
            (d / "config.json").write_bytes(config if isinstance(config, bytes) else config.encode())
        return d

    weights = load_file(good / "model.safetensors")
    embed = {k: v for k, v in weights.items() if "embed_tokens" in k}
    index = lambda weight_map: json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    # an index naming shards outside: never read, as no index is
    sharded = variant("sharded_out_abs", drop=["model.safetensors"],
                      files={"model.safetensors.index.json": index({k: str(outside / "model.safetensors")
                                                                    for k in weights})})
    variant_link = variant("linked_out", drop=["model.safetensors"])
    (variant_link / "model.safetensors").symlink_to(outside / "model.safetensors")
    config_link = variant("config_linked_out", drop=["config.json"])
    (config_link / "config.json").symlink_to(outside / "config.json")
    (ckpts / "link_inside").symlink_to(good)   # inside, but a symlink all the same
    norm = {"dtype": "F32", "shape": [128], "data_offsets": [0, 512]}
    hole = variant("hole")
    with open(hole / "model.safetensors", "wb") as f:   # a sparse file: the data after a 1 TiB hole
        f.write(raw_safetensors({"model.norm.weight": {**norm, "data_offsets": [2**40, 2**40 + 512]}}))
        f.seek(2**40, 1)
        f.write(bytes(512))
    linked = variant("hardlink", drop=["model.safetensors"])
    os.link(outside / "model.safetensors", linked / "model.safetensors")
    fifo = variant("fifo", drop=["model.safetensors"])
    os.mkfifo(fifo / "model.safetensors")   # opening one for reading waited for a writer
    return [
        ("sharded-index-outside", sharded, 422, "it has no model.safetensors (sharded"),
        ("symlinked-weights-outside", variant_link, 403, "not under"),
        ("symlinked-config-outside", config_link, 403, "not under"),
        ("unrelated-tensor-only", variant("unrelated", files={"model.safetensors": {"x": torch.zeros(3)}}), 422,
         "unexpected ['x']"),
        ("embeddings-only", variant("embeddings", files={"model.safetensors": embed}), 422, "missing"),
        ("extra-tensor", variant("extra", files={"model.safetensors": {**weights, "extra.bias": torch.zeros(2)}}),
         422, "unexpected ['extra.bias']"),
        ("other-shape", variant("shape", files={"model.safetensors": {
            **weights, "model.norm.weight": torch.ones(7)}}), 422, "model.norm.weight F32 [7]"),
        ("float64-weights", variant("float64", files={"model.safetensors": {
            k: v.double() for k, v in weights.items()}}), 422, "F64"),
        ("int-weights", variant("int", files={"model.safetensors": {
            **weights, "model.norm.weight": torch.ones(128, dtype=torch.int32)}}), 422, "I32"),
        ("header-claims-huge-tensor", variant("huge", files={"model.safetensors": raw_safetensors(
            {"model.norm.weight": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}})}), 422,
         "not a readable safetensors file: Error while deserializing header"),
        ("header-offsets-past-end", variant("pastend", files={"model.safetensors": raw_safetensors(
            {"model.norm.weight": {"dtype": "F32", "shape": [128], "data_offsets": [0, 512]}})}), 422,
         "not a readable safetensors file: Error while deserializing header"),
        # the safetensors library's own validation: no two tensors in the same bytes, no hole before data
        ("overlapping-offsets", variant("overlap", files={"model.safetensors": raw_safetensors(
            {"model.norm.weight": norm, "model.layers.0.input_layernorm.weight": norm}) + bytes(512)}), 422,
         "invalid offset"),
        ("data-after-a-huge-hole", hole, 422, "invalid offset"),
        ("hard-link-to-outside", linked, 422, "2 hard links"),
        ("nan-weights", variant("nan", files={"model.safetensors": {
            **weights, "model.norm.weight": torch.full((128,), float("nan"))}}), 422,
         "model.norm.weight holds values that are not finite"),
        ("folder-a-symlink-inside", ckpts / "link_inside", 403, "'link_inside' is a symlink"),
        ("weights-a-fifo", fifo, 422, "not a regular file"),
        ("pickle-only", variant("pickle", drop=["model.safetensors"], files={"pytorch_model.bin": b"\x80\x04."}),
         422, "never loaded"),
        ("custom-code", variant("custom", config=json.dumps({**json.loads((good / "config.json").read_text()),
                                                             "auto_map": {"AutoModelForCausalLM": "m.M"}})),
         422, "'auto_map': {'AutoModelForCausalLM': 'm.M'}"),
        ("config-not-json", variant("notjson", config="{not json"), 422, "config.json is not readable JSON"),
        ("config-not-utf8", variant("notutf8", config=b'{"a": "\xff"}'), 422, "config.json is not readable JSON"),
        ("config-a-list", variant("configlist", config="[]"), 422, "config.json is not a qwen2 config"),
        ("config-other-architecture", variant("otherarch", config=json.dumps(
            {**json.loads((good / "config.json").read_text()), "intermediate_size": 999})), 422,
         "another architecture than the served model's: {'intermediate_size': 999}"),
        ("config-unknown-activation", variant("badact", config=json.dumps(
            {**json.loads((good / "config.json").read_text()), "hidden_act": "nope"})), 422,
         "another architecture than the served model's: {'hidden_act': 'nope'}"),
        # fields beyond the fingerprint's: each changed what main d08f4ac served, or left lm_head random
        *[(f"config-{key}", variant(f"cfg_{key}", config=json.dumps(
            {**json.loads((good / "config.json").read_text()), key: value})), 422,
           f"another architecture than the served model's: {{'{key}': {value!r}")
          for key, value in [("rms_norm_eps", 0.5), ("max_position_embeddings", 4096),
                             ("layer_types", ["sliding_attention"] * 2),
                             ("rope_parameters", {"rope_theta": 1.0, "rope_type": "default"}),
                             ("model_type", "llama"), ("attention_bias", True),
                             # last: on main it left lm_head random and every later reload refused
                             ("tie_word_embeddings", False)]],
        ("weights-not-safetensors", variant("garbage", files={"model.safetensors": b"garbage"}), 422, "readable"),
        ("nul-byte", str(good) + "\0x", 400, "the path printable"),
        # JSON's "\ud800", which no file system encodes: a 500 and its traceback, then a client's retries
        ("lone-surrogate", str(good) + "\ud800", 400, "the path printable"),
        ("empty", ckpts / "empty", 422, "not a checkpoint folder: it has no config.json"),
        ("missing", ckpts / "missing", 400, "not a checkpoint"),
    ]


def test_reload_swaps_the_reference_only_from_the_checkpoint_folder(tmp_path, tiny_model, model):
    """POST /reload (--ref-sync-every): only with a token, only folders under --checkpoint-dir, every file it
    reads too (no way out through .., an absolute path or a symlink), only complete safetensors checkpoints of
    the served architecture; every refusal is a 4xx and changes nothing; afterwards the server answers with the
    new weights and its fingerprint is the new model's."""
    import shutil
    from transformers import AutoModelForCausalLM
    ckpts = tmp_path / "run"
    new_dir = ckpts / "step_2"
    new = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        new.model.embed_tokens.weight.mul_(1.5)   # another model (tied lm_head too), same architecture
        new.model.layers[1].mlp.down_proj.weight.mul_(-1)
    new.save_pretrained(new_dir)
    outside = tmp_path / "outside"
    shutil.copytree(new_dir, outside)
    (ckpts / "escape").symlink_to(outside)
    (ckpts / "empty").mkdir()
    bad = bad_checkpoints(ckpts, new_dir, outside)
    proc, url, log = spawn_server(tiny_model, tmp_path / "log.txt", "--checkpoint-dir", str(ckpts),
                                  env={**os.environ, "REF_SERVER_TOKEN": TOKEN})
    try:
        wait_up(proc, url, log)
        before = requests.get(url + "/health", timeout=10).json()["fingerprint"]

        def reload(path, token=TOKEN):
            return requests.post(url + "/reload", data=json.dumps({"path": str(path)}),
                                 headers={"Authorization": f"Bearer {token}"}, timeout=60)
        assert_json_error(reload(new_dir, token="wrong"), 401, "token")
        assert_json_error(reload(outside), 403, "not under")
        assert_json_error(reload(ckpts / ".." / "outside"), 403, "not under")
        assert_json_error(reload(ckpts / "escape"), 403, "not under")
        for name, folder, status, msg in bad:
            r = reload(folder)
            assert r.status_code == status, (name, r.text)
            assert_json_error(r, status, msg)
        for body_ in (b"", b"{", b"[]", b'{"path": 3}', b'{"path": ""}', b"\xff"):
            r = requests.post(url + "/reload", data=body_, headers={"Authorization": f"Bearer {TOKEN}"},
                              timeout=10)
            assert_json_error(r, 400, "expected a JSON body")
        assert requests.get(url + "/health", timeout=10).json()["fingerprint"] == before   # nothing changed yet
        assert_serves(url, model)
        assert "Traceback" not in server_log(log)
        (health,) = reload_reference(url, str(new_dir), token=TOKEN)
        assert health["model"] == str(new_dir.resolve())
        assert health["fingerprint"] == model_fingerprint(new) != before
        got = ref_logps(url, [[1, 2], [3]], [[4], [5, 6]], 1.0, token=TOKEN, retry_for=0)
        for g, w in zip(got, local_logps(new, [[1, 2], [3]], [[4], [5, 6]], 1.0)):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    finally:
        stop_server(proc, log)
    # without a token the endpoint is off, even with --checkpoint-dir
    proc, url, log = spawn_server(tiny_model, tmp_path / "log2.txt", "--checkpoint-dir", str(ckpts))
    try:
        wait_up(proc, url, log)
        r = requests.post(url + "/reload", data=json.dumps({"path": str(new_dir)}), timeout=10)
        assert_json_error(r, 403, "reload is off")
    finally:
        stop_server(proc, log)


# ----------------------------------------------------------------------------- the server's own numbers, limits

def test_logps_equal_the_trainers_and_a_plain_forward(model):
    """The server computes log-probs with its own lines (it imports no project file); they equal the trainer's
    (pad_batch + completion_logps) and a plain HF forward, with ragged lengths, at a temperature other than 1."""
    import grpo_train
    from batches import pad_batch
    prompts = PROMPTS + [[7] * 30, [9, 8]]
    completions = COMPLETIONS + [[3, 4], list(range(40, 80))]
    ids, attn, cmask = pad_batch(prompts, completions, 0)
    with torch.no_grad():
        trainer = grpo_train.completion_logps(model, ids, attn, cmask.shape[1], 0.7, chunk=3)
    plain = local_logps(model, prompts, completions, 0.7)
    got = compute_logps(model, prompts, completions, 0.7, chunk=3)
    for i, c in enumerate(completions):
        assert got[i].dtype == torch.float32 and got[i].shape == (len(c),)
        torch.testing.assert_close(got[i], trainer[i, :len(c)], atol=1e-5, rtol=0)
        torch.testing.assert_close(got[i], plain[i], atol=1e-5, rtol=0)


@pytest.mark.parametrize("max_seqs,max_tokens", [(1, 10**6), (3, 10**6), (100, 40), (4, 64), (100, 10**6)])
def test_requests_are_forward_passes_within_the_limits(max_seqs, max_tokens):
    """The client cuts a batch into requests the server runs as one forward pass each: every sequence once, at
    most max_seqs rows and max_tokens padded tokens, unless it is one sequence longer than that; shortest first,
    so padding is small."""
    import random
    rng = random.Random(0)
    prompts = [[1] * rng.randint(1, 50) for _ in range(40)] + [[1] * 100]
    completions = [[2] * rng.randint(1, 50) for _ in range(40)] + [[2] * 100]
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    parts = split_to_fit(prompts, completions, {"max_seqs": max_seqs, "max_tokens": max_tokens})
    assert sorted(i for part in parts for i in part) == list(range(len(lengths)))
    for part in parts:
        width = max(lengths[i] for i in part)
        assert len(part) <= max_seqs and (len(part) * width <= max_tokens or len(part) == 1), (part, width)
    order = [lengths[i] for part in parts for i in part]
    assert order == sorted(order)


def test_split_to_fit():
    limits = {"max_seqs": 3, "max_tokens": 10, "max_body": 10**6}
    prompts, completions = [[1]] * 6 + [[1] * 20], [[2, 3]] * 6 + [[2]]
    parts = split_to_fit(prompts, completions, limits)
    assert parts == [[0, 1, 2], [3, 4, 5], [6]]   # the 21-token one alone: the server says 413
    tight = split_to_fit(prompts[:6], completions[:6], {**limits, "max_body": 1024 + 4 * 6 + 8 * 2})
    assert tight == [[0, 1], [2, 3], [4, 5]]      # the body limit binds too
    # a demo batch, ~100 sequences of 5 + 4-6 tokens, is one request to a server with the default limits
    defaults = vars(parse_args(["--model", "m"]))
    assert len(split_to_fit([[5] * 5] * 100, [[3] * (4 + i % 3) for i in range(100)], defaults)) == 1
    # mixed lengths: a request per run of similar ones, none of whose forward is over a quarter padding
    lengths = [10] * 8 + [12] * 8 + [40] * 8 + [45] * 4
    parts = split_to_fit([[1]] * len(lengths), [[2] * (n - 1) for n in lengths], defaults)
    assert parts == [list(range(16)), list(range(16, 28))]


def test_client_splits_a_batch_over_the_servers_limits(server, model):
    """50 sequences, 4,000+ tokens, ~17 KB: over the server's --max-seqs 16 and --max-tokens 2000 (and near its
    52 KB body limit): the client splits it and gets every log-prob right, never a 413."""
    import random
    rng = random.Random(1)
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 60))] for _ in range(50)]
    completions = [[rng.randrange(V) for _ in range(rng.randint(1, 100))] for _ in range(50)]
    assert sum(map(len, prompts + completions)) > 4000
    got = ref_logps(server, prompts, completions, 0.9, token=TOKEN, retry_for=0)
    for g, w in zip(got, local_logps(model, prompts, completions, 0.9), strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    with pytest.raises(RefServerError, match="413.*context length"):   # one sequence cannot be split
        ref_logps(server, [[1] * 1000], [[2] * 30], 1.0, token=TOKEN, retry_for=0)


def test_fingerprint_covers_every_weight(model):
    """Changing any one tensor changes the fingerprint (it used to hash 32 embedding values); the dtype does not."""
    base = model_fingerprint(model)
    assert model_fingerprint(copy.deepcopy(model).to(torch.bfloat16)) == base
    names = [n for n, _ in model.named_parameters()]
    assert len(names) > 10
    for name in names:
        other = copy.deepcopy(model)
        with torch.no_grad():
            other.get_parameter(name).add_(0.05)
        assert model_fingerprint(other) != base, name


def test_default_dtype(monkeypatch):
    """bfloat16 only on a GPU that computes in it natively (issue: emulated bf16 on pre-Ampere GPUs), else
    float32; the trainer decides the same way, so both hold the same numbers."""
    asked = []

    def native_bf16(including_emulation=True):
        asked.append(including_emulation)
        return not including_emulation and native
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", native_bf16)
    assert ref_server.default_dtype("cpu") == "float32"
    native = True
    assert ref_server.default_dtype("cuda:0") == "bfloat16"
    native = False
    assert ref_server.default_dtype("cuda:1") == "float32"
    assert asked == [False, False]


def in_process_args(*flags):
    """The server's settings for a test in this process: parse_args, as main() reads them."""
    return parse_args(["--model", "tiny", "--port", "0", "--max-seqs", "16", "--max-tokens", "2000",
                       "--max-body-mb", "1", "--max-connections", "32", "--token", "", *flags])


@contextmanager
def serve_in_thread(app, args):
    """`app` served over loopback as main() serves it (ref_server.serve), in this process (to look inside it)."""
    server, closing = serve(app, args), threading.Event()

    def run():
        try:
            server.run()
        except OSError:
            # close() from this thread can end the loop's select with EBADF: the way it stops (webtest's
            # StopableWSGIServer does the same)
            if not closing.is_set():
                raise
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.effective_port}"
    finally:
        closing.set()
        server.close()
        thread.join(10)


def test_reload_builds_no_second_model(tmp_path, tiny_model):
    """/reload copies the checked weights into the served model: no second model is ever built (two models on
    the reference GPU was a bug), and the one served answers with the new weights."""
    import transformers
    new = ref_server.load_model(tiny_model)
    with torch.no_grad():
        new.model.norm.weight.mul_(3)
    new.save_pretrained(tmp_path / "step_1")
    served = ref_server.load_model(tiny_model)
    args = in_process_args("--token", TOKEN, "--checkpoint-dir", str(tmp_path))
    app = make_app(served, args)
    models = lambda: sum(issubclass(type(o), transformers.PreTrainedModel) for o in gc.get_objects())
    with serve_in_thread(app, args) as url:
        gc.collect()
        before = models()
        (health,) = reload_reference(url, str(tmp_path / "step_1"), token=TOKEN, retry_for=0)
        gc.collect()
        assert models() == before
        assert health["fingerprint"] == model_fingerprint(served) == model_fingerprint(new)
        assert_serves(url, new)


def test_non_finite_log_probs_are_the_servers_fault(tiny_model):
    """A model whose numbers overflow answers 500 with a message (not NaNs to train on); the client raises."""
    broken = ref_server.load_model(tiny_model)
    with torch.no_grad():
        broken.model.norm.weight.fill_(float("inf"))
    args = in_process_args()
    with serve_in_thread(make_app(broken, args), args) as url:
        with pytest.raises(RefServerError, match="HTTP 500: the reference model gave non-finite log-probs"):
            ref_logps(url, [[1, 2]], [[3]], 1.0, retry_for=0)


def test_client_retries_an_answer_cut_short(capsys):
    """A server killed mid-answer leaves a 200 cut short: after its status line (no headers at all), or in
    its body. Either is a failed attempt the client retries and reports, never a body it decodes. The peer
    here is a plain socket that answers so, in turn (the real server dies in that window only by chance)."""
    listener = socket.create_server(("127.0.0.1", 0))
    answers = [b"HTTP/1.0 200 OK\r\n",
               b"HTTP/1.0 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: 80\r\n\r\n0123"]

    def serve():
        for i in range(6):
            conn, _ = listener.accept()
            with conn:
                # the whole request read first: a socket closed with bytes unread resets the connection,
                # and the client may then see that reset before the answer
                request = b""
                while not request.endswith(b"body") and (part := conn.recv(65536)):
                    request += part
                conn.sendall(answers[i % 2])
    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    with pytest.raises(RefServerError, match="failed after [2-6] attempts"):
        ref_client._call("POST", url + "/logps", b"body", None, timeout=10, retry_for=1.0, backoff=0.1)
    err = capsys.readouterr().err
    assert "(HTTP 200 cut short (0 bytes, None announced)); retrying" in err, err
    assert "ChunkedEncodingError" in err, err
    listener.close()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_client_takes_an_answer_a_proxy_gzipped(framing, capsys):
    """A proxy before the server (TLS: docs/reference-server.md) may gzip its answers, which requests asks for
    (Accept-Encoding) and decompresses: their Content-Length counts the gzipped bytes, not the body's. Or it
    sends them chunked, with no Content-Length. Either is a whole answer, taken at the first attempt (it was
    retried until --ref-wait ran out, then 'HTTP 200 cut short'). The proxy here is http.server."""
    logps = [torch.tensor([-0.5]), torch.tensor([-1.25, -2.0])]
    answers = {"/health": json.dumps({"status": "ok"}).encode(), "/logps": encode_response(logps)}

    class Proxy(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            body = gzip.compress(answers[self.path])
            self.send_response(200)
            self.send_header("Content-Encoding", "gzip")
            if framing == "chunked":
                self.send_header("Transfer-Encoding", "chunked")
                body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
            else:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.do_GET()

        def log_message(self, *args):
            pass
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        got = ref_logps(f"http://127.0.0.1:{proxy.server_port}", [[1], [2, 3]], [[4], [5, 6]], 1.0, retry_for=0)
    finally:
        proxy.shutdown()
        proxy.server_close()
    assert [t.tolist() for t in got] == [[-0.5], [-1.25, -2.0]]
    assert "retrying" not in capsys.readouterr().err


# ref_server.py, with the checkpoint file CUT_SHORT cut to half its size once its header has been read: the
# moment another process truncates a file under /reload, made exact. safetensors has just read the header
# (safe_open returned); on main the weights were then read through its map of the file
TRUNCATING = """
import os, sys
import ref_server
victim, opened = os.environ["CUT_SHORT"], ref_server.safe_open
def safe_open(*args, **kwargs):
    handle = opened(*args, **kwargs)
    if os.path.exists(victim) and not os.path.exists(victim + ".cut"):
        os.truncate(victim, os.path.getsize(victim) // 2)
        open(victim + ".cut", "w").close()
    return handle
ref_server.safe_open = safe_open
ref_server.main(sys.argv[1:])
"""


def test_reload_serves_only_the_files_it_checked(tmp_path, tiny_model):
    """A file swapped for a symlink to outside --checkpoint-dir between the checks and the read: main d08f4ac
    checked names, then from_pretrained opened them again, and 3 of about 16 tries served the outside weights.
    Now each file is opened once (no symlink followed) and checked and read on that descriptor: a try either
    serves the inside checkpoint or is refused with 403, never the outside one. And a file cut short after
    its header was read killed the server (its map of the file faulted: SIGBUS); it is a 422 now, and the
    server serves on."""
    from transformers import AutoModelForCausalLM
    ckpts, outside = tmp_path / "run", tmp_path / "outside"
    fingerprints = {}
    for name, folder in (("inside", ckpts / "step_1"), ("outside", outside)):
        m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        with torch.no_grad():
            m.model.norm.weight.mul_(2 if name == "inside" else -5)
        m.save_pretrained(folder)
        fingerprints[name] = model_fingerprint(m)
    weights = ckpts / "step_1" / "model.safetensors"
    os.symlink(outside / "model.safetensors", ckpts / "link")
    stop = threading.Event()

    def swap():   # the file and the symlink take turns under the name (renamed: the file keeps one link)
        while not stop.is_set():
            for away, back in (("real", "link"), ("link", "real")):
                os.rename(weights, ckpts / away)
                os.rename(ckpts / back, weights)
    cut = ckpts / "cut"
    proc, url, log = spawn_server(tiny_model, tmp_path / "log.txt", "--checkpoint-dir", str(ckpts),
                                  env={**os.environ, "REF_SERVER_TOKEN": TOKEN,
                                       "CUT_SHORT": str(cut / "model.safetensors")}, script=TRUNCATING)
    swapper = threading.Thread(target=swap, daemon=True)
    try:
        wait_up(proc, url, log)
        swapper.start()
        served = []
        for _ in range(40):
            r = requests.post(url + "/reload", data=json.dumps({"path": str(ckpts / "step_1")}),
                              headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
            assert r.status_code in (200, 403, 422), r.text
            served.append(requests.get(url + "/health", timeout=10).json()["fingerprint"])
        assert fingerprints["outside"] not in served
        assert fingerprints["inside"] in served   # the swap did not refuse every try
        stop.set()
        swapper.join(10)
        import shutil
        shutil.copytree(outside, cut)
        r = requests.post(url + "/reload", data=json.dumps({"path": str(cut)}),
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        assert_json_error(r, 422, "model.safetensors changed while it was read")
        assert (cut / "model.safetensors.cut").exists() and proc.poll() is None
        assert requests.get(url + "/health", timeout=10).json()["fingerprint"] == served[-1]   # unchanged
        assert "Traceback" not in server_log(log)
    finally:
        stop.set()
        swapper.join(10)
        stop_server(proc, log)


def test_connections_before_the_token_hold_bounded_memory(tmp_path, tiny_model, model):
    """40 connections that send 99 headers of 64 KB each (6 MB) and never finish: a server on http.server
    read them all (100 headers of 64 KiB are its own limits) and held ~250 MiB before any token check. Now
    each connection is read up to MAX_HEAD bytes (waitress's max_request_header_size; more: 431) before its
    token is checked, and 32 more that send 16 MiB bodies without the token are refused once their head is
    in (401), so the server's memory grows by a bounded amount; afterwards a request with the token is
    answered."""
    import psutil
    proc, url, log = spawn_server(tiny_model, tmp_path / "log.txt", env={**os.environ, "REF_SERVER_TOKEN": TOKEN})
    try:
        wait_up(proc, url, log)
        assert_serves(url, model)
        server = psutil.Process(proc.pid)
        before = server.memory_info().rss
        held = []
        for n in range(40 + 32):
            s = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=60)
            held.append(s)
            try:
                if n < 40:
                    s.sendall(b"POST /logps HTTP/1.0\r\n")
                    for i in range(99):
                        s.sendall(b"X-Pad-%d: %s\r\n" % (i, b"a" * 64000))
                else:
                    s.sendall(b"POST /logps HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % 2**24)
                    s.sendall(bytes(2**24))
            except OSError:   # refused: answered 431 or 401 and closed
                pass
        grown = []
        for _ in range(10):   # samples while the connections are held, for the threads to read what is sent
            grown.append(server.memory_info().rss - before)
            time.sleep(0.3)
        # each connection its head and buffers: well under 1 MiB apiece
        bound = 72 * (MAX_HEAD + 2**20)
        assert max(grown) < bound, (max(grown), bound)
        for s in held:
            s.close()
        assert_serves(url, model)
        assert "Traceback" not in server_log(log)
    finally:
        stop_server(proc, log)


# ----------------------------------------------------------------------------- waitress's bounds, and ours, on a socket

def connect(url, timeout=30):
    return socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=timeout)


def answer_of(s):
    """The status line and JSON error of the answer on socket `s` (read until the server closes it)."""
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0].decode(), json.loads(body)["error"]


@pytest.fixture(scope="module")
def strict_server(tiny_model, tmp_path_factory):
    """A server with short deadlines and few connections, to reach each bound quickly."""
    proc, url, log = spawn_server(tiny_model, tmp_path_factory.mktemp("strict") / "log.txt", "--max-connections",
                                  "4", "--header-timeout", "2", "--body-timeout", "3",
                                  env={**os.environ, "REF_SERVER_TOKEN": TOKEN})
    try:
        yield wait_up(proc, url, log), log
    finally:
        stop_server(proc, log)


def test_the_token_is_checked_as_soon_as_the_head_is_in(strict_server):
    """A 16 MiB body without the token: the 401 comes back before a byte of the body is sent."""
    url, _ = strict_server
    with connect(url) as s:
        s.sendall(b"POST /logps HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % 2**24)
        assert answer_of(s) == ("HTTP/1.1 401 Unauthorized", "Unauthorized: missing or wrong bearer token")


def test_a_body_must_arrive_by_a_deadline(strict_server):
    """With the token, a body trickled a byte at a time is answered 408 at --body-timeout (3 s), not read
    forever (waitress alone waits as long as bytes keep coming)."""
    url, _ = strict_server
    with connect(url) as s:
        s.sendall(b"POST /logps HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Length: 1000\r\n\r\n"
                  % TOKEN.encode())
        for _ in range(40):
            if select.select([s], [], [], 0.5)[0]:
                break
            s.sendall(b"a")
        assert answer_of(s) == ("HTTP/1.1 408 Request Timeout", "Request Timeout: request not sent within 3s")


def test_headers_must_arrive_by_a_deadline(strict_server):
    """A byte every 0.25 s kept a half-sent request open forever on a server whose timeout counts silence
    only (waitress's channel_timeout does); now the request line and headers must all arrive within
    --header-timeout: 408."""
    url, _ = strict_server
    with connect(url) as s:
        for byte in b"GET /health HTTP/1.0\r\nX-Slow: " + b"a" * 400:
            if select.select([s], [], [], 0.25)[0]:
                break
            s.sendall(bytes([byte]))
        assert answer_of(s) == ("HTTP/1.0 408 Request Timeout",
                                "Request Timeout: request line and headers not sent within 2s")


def test_idle_and_trickling_clients_do_not_lock_out_a_serving_client(strict_server, model):
    """Every slot (--max-connections 4) held: three idle connections and one trickling its head. A fifth
    waits in the listen queue (waitress accepts no more), so the client's request is answered once the
    deadlines free a slot, within its retry window; the trickler got its 408, the idle ones were closed."""
    url, log = strict_server
    idle = [connect(url) for _ in range(3)]
    trickler = connect(url)
    trickler.sendall(b"GET /health HTTP/1.1\r\nX: ")
    try:
        got = ref_logps(url, [[1, 2]], [[3]], 1.0, token=TOKEN, timeout=30, retry_for=30)
        torch.testing.assert_close(got[0], local_logps(model, [[1, 2]], [[3]], 1.0)[0], atol=1e-5, rtol=0)
        assert [s.recv(100) for s in idle] == [b""] * 3
        assert answer_of(trickler)[0] == "HTTP/1.0 408 Request Timeout"
    finally:
        for s in idle + [trickler]:
            s.close()
    assert "Traceback" not in server_log(log)


def test_idle_connections_hold_no_slot_of_the_default_server(tmp_path, tiny_model):
    """31 idle connections and one body trickled at a byte every 3 s held all 32 slots of the thread-per-
    connection server: /health answered 0 times in 40 s. On the default server (waitress: an idle connection
    holds no thread) /health is answered while they are held."""
    proc, url, log = spawn_server(tiny_model, tmp_path / "log.txt")
    held = []
    try:
        wait_up(proc, url, log)
        held = [connect(url) for _ in range(31)] + [connect(url)]
        held[-1].sendall(b"POST /logps HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\na")
        assert sum(requests.get(url + "/health", timeout=10).status_code == 200 for _ in range(5)) == 5
        for s in held:
            s.close()
        # without a token (this, the documented loopback start), a chunked body waited for its chunks: one
        # whose size line never ends cost 6 s of CPU per 8 MiB. It is refused from its head now
        with connect(url, timeout=20) as s:
            s.sendall(b"POST /logps HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            assert answer_of(s) == ("HTTP/1.1 411 Length Required",
                                    "Length Required: send Content-Length")
    finally:
        for s in held:
            s.close()
        stop_server(proc, log)


# ----------------------------------------------------------------------------- what the trainer says about its server

def test_the_trainer_says_what_it_waits_for_and_what_to_do(tmp_path, tiny_model):
    """Side by side, each rank 0 as the launcher starts it: --ref-url naming no server says at once what it waits for
    and how long, then after --ref-wait one line saying what to do; a server holding another model is one line
    naming both. No traceback. (A --ref-url without http:// is one line of check_config, at start:
    tests/test_faults.py.)"""
    from demo.tiny_model import build_model, build_tokenizer, save
    other = save(build_model(build_tokenizer(), seed=1), build_tokenizer(), str(tmp_path / "other_model"))
    server, other_url, server_log_file = spawn_server(other, tmp_path / "server.log")
    cases = {"nothing": ["--ref-url", "http://127.0.0.1:9", "--ref-wait", "5"],
             "other": ["--ref-url", other_url, "--ref-wait", "120"]}
    runs = {}
    try:
        wait_up(server, other_url, server_log_file)
        for name, flags in cases.items():
            os.makedirs(tmp_path / name)
            log = open(tmp_path / name / "run.log", "w")
            cmd, env = rank_zero("--model", tiny_model, "--out-dir", str(tmp_path / name), "--beta", "0.04",
                                 "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "8",
                                 "--max-prompt-len", "16", "--eval-size", "8", *flags, port=next_port())
            runs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        out = {}
        for name, proc in runs.items():
            assert proc.wait(timeout=600) != 0
            out[name] = (tmp_path / name / "run.log").read_text()
            assert "Traceback" not in out[name] and "[rank" not in out[name], out[name][-3000:]
        lines = out["nothing"].splitlines()
        waiting = lines.index("grpo_train.py: waiting up to 5s (--ref-wait) for the reference server at "
                              "http://127.0.0.1:9")
        assert lines.index(f"grpo_train.py: http://127.0.0.1:9/health not ready after 5s (--ref-wait): start the "
                           f"reference server (python ref_server.py --model {tiny_model} --port 9), or train "
                           "without one (--beta 0)") > waiting
        assert (f"grpo_train.py: {other_url} serves another model than --model {tiny_model}: it serves {other}; "
                f"restart it (python ref_server.py --model {tiny_model} --port {other_url.rsplit(':', 1)[1]})"
                in out["other"].splitlines())
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        stop_server(server, server_log_file)


def test_the_server_a_run_starts_holds_its_port_from_the_start(tmp_path, tiny_model, monkeypatch):
    """The reference server a run starts (placement.start_reference_server) has its port from the moment it
    is started, not only once it has loaded its model and bound it: meanwhile no other process can bind
    the port, and the server then listens there."""
    from placement import start_reference_server
    # the run's token, which it sets in this process's environment, is undone after the test
    monkeypatch.setenv("REF_SERVER_TOKEN", "")
    proc, url = start_reference_server(tiny_model, "cpu", str(tmp_path), 1)
    try:
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        assert taken.value.errno == errno.EADDRINUSE
        assert wait_for_server(url, timeout=120)["status"] == "ok"
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(30)
