"""Faults during a run: each is noticed, named, and ends the run cleanly. Through the real deepspeed launcher
where it takes part (its signals, its exit report, what it leaves running), else rank 0 alone, as the launcher
starts it (conftest.rank_zero)."""
import contextlib
import datetime
import errno
import fcntl
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import threading
import time

import psutil
import pytest
import torch

from conftest import next_port, no_allreduce_buffer_left, rank_zero, running, sigkill_group
from test_metrics import WARNING

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")


RUNS = []


@pytest.fixture(autouse=True)
def kill_leftover_runs():
    """Whatever a failing test leaves running is killed, whole process groups and all (the demo starts its
    launcher in a group of its own)."""
    yield
    while RUNS:
        proc = RUNS.pop()
        if proc.poll() is None:
            groups = {proc.pid}
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                groups |= {os.getpgid(p.pid) for p in family_of(proc.pid)}
            for group in groups:
                with contextlib.suppress(ProcessLookupError):
                    sigkill_group(group)
            proc.wait()


def launch(out_dir, model, *flags, port=None, launcher=False, ranks=1):
    """A small run in a process group of its own: through deepspeed's launcher (with `ranks` training ranks),
    or (where the launcher is not what the test is about) rank 0 alone, as the launcher would start it
    (conftest.rank_zero)."""
    port = port or next_port()
    args = ["--model", model, "--out-dir", str(out_dir), "--prompts-per-step", "4", "--group-size", "4",
            "--max-new-tokens", "8", "--max-prompt-len", "16", "--eval-size", "8", *flags]
    if launcher:
        cmd, env = [DEEPSPEED, "--num_gpus", str(ranks), "--master_port", str(port), "grpo_train.py", *args], None
    else:
        cmd, env = rank_zero(*args, port=port)
    log = open(os.path.join(out_dir, "run.log"), "w")   # a file, not a pipe: a full pipe would stall the run
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log = log.name
    RUNS.append(proc)
    return proc


def finish(proc, timeout=300):
    proc.wait(timeout=timeout)
    with open(proc.log) as f:
        return proc.returncode, f.read()


def command_of(p):
    """A process's command line; "" once it has ended (a zombie's cannot be read)."""
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def engine_of(top):
    """The vLLM generation process under `top`, the launcher or rank 0 (a process rank 0 spawned), or None."""
    commands = ((p, command_of(p)) for p in top.children(recursive=True))
    return next((p for p, cmd in commands if "spawn_main" in cmd and "resource_tracker" not in cmd), None)


def listening(processes):
    """(pid, address, port) of each TCP socket the processes listen on (gone ones left out)."""
    found = set()
    for p in processes:
        try:
            found |= {(p.pid, c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            pass
    return found


def test_killed_generation_process_stops_the_run_quickly_with_no_orphans(tmp_path, tiny_model, capsys):
    """And while it runs: every socket the run listens on is on loopback (rank 0's rendezvous on the
    launcher's --master_port, the generation process's store, the weight group's: torch's servers
    listened on every interface); and its rank 0 holds --out-dir, so that a second run there, through a
    symlink, stops in one line naming it."""
    port = next_port()
    proc = launch(tmp_path, tiny_model, "--beta", "0", "--steps", "100000", "--lr", "1e-6", port=port, launcher=True)
    launcher = psutil.Process(proc.pid)
    deadline, gen = time.time() + 240, None
    while time.time() < deadline and gen is None:   # the vLLM child: a spawned grandchild of a rank
        time.sleep(1)
        assert proc.poll() is None, open(proc.log).read()[-3000:]
        metrics = tmp_path / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            gen = engine_of(launcher)
    assert gen is not None, "the run never logged two steps"
    family = launcher.children(recursive=True)
    rank_0, listeners = gen.parent(), listening([launcher, *family])
    assert {ip for _, ip, _ in listeners} == {"127.0.0.1"}, listeners
    assert (rank_0.pid, "127.0.0.1", port) in listeners and sum(pid == rank_0.pid for pid, _, _ in listeners) >= 3
    from checkpoints import read_state
    (tmp_path.parent / f"{tmp_path.name}-link").symlink_to(tmp_path)
    with pytest.raises(SystemExit):
        read_state(True, out_dir=f"{tmp_path}-link", resume=False, steps=100000, overwrite=True)
    assert capsys.readouterr().err == (f"grpo_train.py: --out-dir {tmp_path}-link is in use by another run (pid "
                                       f"{rank_0.pid}): wait for it to end, or pass another --out-dir\n")
    t0 = time.time()
    gen.send_signal(signal.SIGKILL)
    rc, out = finish(proc, timeout=120)
    assert rc != 0 and "the generation process died (exit code -9)" in out
    assert time.time() - t0 < 60   # noticed within seconds, not waited on forever
    time.sleep(2)
    assert not [p for p in family if running(p)]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))   # what was logged is intact


def test_weights_go_over_nccl_between_gpus_ipc_on_the_one_training_gpu_and_gloo_otherwise(monkeypatch):
    """The backend rule, on a pretend GPU machine (torch.cuda.is_available is the one thing patched): vLLM's
    NCCL engine when no engine shares a training GPU, its CUDA IPC engine when the one engine shares the one
    training GPU, gloo over CPU tensors when an engine shares a GPU beside other training ranks (vLLM's IPC
    engine all-gathers over every training rank; only rank 0 pushes), and on CPU."""
    import torch
    from weight_transfer import transfer_backend
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,4")
    assert (transfer_backend([3], 1), transfer_backend([3, 4], 1), transfer_backend([2], 1)) == \
        ("nccl", "nccl", "ipc")
    assert (transfer_backend([4], 2), transfer_backend([3], 2), transfer_backend([2, 3], 1)) == \
        ("nccl", "gloo", "gloo")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")   # every GPU visible: ranks 0 and 1 train on GPUs 0 and 1
    assert (transfer_backend([2], 2), transfer_backend([1], 2), transfer_backend([0], 1)) == \
        ("nccl", "gloo", "ipc")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert transfer_backend([0], 1) == "gloo"


def rows_of(out_dir):
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def wait_until(proc, ready, log, timeout=120, every=0.2):
    """Poll ready() until it holds, proc alive meanwhile (else the end of its log says why)."""
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None and time.time() < deadline, open(log).read()[-3000:]
        time.sleep(every)


def wait_for_step(proc, out_dir, step, timeout=300):
    wait_until(proc, lambda: any(r["step"] >= step for r in rows_of(out_dir)), proc.log, timeout, every=0.5)


def start_ref_server(model, port, log_path):
    log = open(log_path, "a")
    proc = subprocess.Popen([sys.executable, "ref_server.py", "--model", model, "--port", str(port)], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    RUNS.append(proc)
    from ref_client import wait_for_server
    wait_for_server(f"http://127.0.0.1:{port}", timeout=120)
    return proc


def probe_logp(model_dir):
    """The mean log-prob of the weight-sync probe (the first 64 tokens of the first training prompt of the
    demo task) under the HF model in model_dir: what the engine reports as sync/probe_logp once it holds those
    weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from grpo_train import completion_logps, get_args
    from run_setup import load_prompts
    args = get_args(["--model", model_dir, "--task", "demo"])
    ids = load_prompts(AutoTokenizer.from_pretrained(model_dir), **vars(args))[0][0]["prompt_ids"][:64]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ids = torch.tensor([ids])
        return completion_logps(model, ids, torch.ones_like(ids), ids.shape[1] - 1).mean().item()


def assert_each_batch_trained_once(rows, prompts_per_step):
    """Steps 1..N, each once; the data position moves by one batch per step, plus one per batch dropped as
    stale: no batch was trained twice and none was skipped."""
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    prev_seen, prev_dropped = 0, 0
    for r in rows:
        assert r["data/prompts_seen"] - prev_seen == prompts_per_step * (1 + r["stale_dropped"] - prev_dropped), r
        prev_seen, prev_dropped = r["data/prompts_seen"], r["stale_dropped"]


def test_reference_server_killed_and_restarted_mid_run(tmp_path, demo_model):
    """The trainer meets the dead server (its client says so on stderr each time it retries), retries the same
    batch until the server is back, then goes on: no gap, nothing twice. The server stays down until that line
    is in the log, so the test waits for the event itself, not for a time in which it probably happened."""
    port = next_port()
    url = f"http://127.0.0.1:{port}"
    server = start_ref_server(demo_model, port, tmp_path / "server.log")
    # 16 steps: after step 2 many reference requests are still to come, one per step
    proc = launch(tmp_path, demo_model, "--beta", "0.04", "--ref-url", url, "--steps", "16", "--lr", "1e-4")
    wait_for_step(proc, tmp_path, 2)
    server.send_signal(signal.SIGKILL)
    server.wait()
    met = f"ref_server client: POST {url}/logps failed"
    deadline = time.time() + 240
    while met not in open(proc.log).read():
        assert proc.poll() is None, "the run ended without meeting the dead server:\n" + open(proc.log).read()[-3000:]
        assert time.time() < deadline, "the trainer never met the dead server"
        time.sleep(0.5)
    start_ref_server(demo_model, port, tmp_path / "server.log")
    rc, out = finish(proc)
    assert rc == 0, out[-3000:]
    rows = rows_of(tmp_path)
    assert len(rows) == 16
    assert_each_batch_trained_once(rows, prompts_per_step=4)


def test_non_finite_gradients_are_skipped_then_the_run_stops(tmp_path, demo_model):
    """A learning rate of 1e30 makes the weights overflow after the first step: every later gradient norm is
    NaN. Those steps are skipped (DeepSpeed leaves the weights alone) and counted; 3 in a row stop the run."""
    proc = launch(tmp_path, demo_model, "--beta", "0", "--steps", "20", "--lr", "1e30", "--max-skips", "3",
                  "--sync-every", "1000")
    rc, out = finish(proc)
    assert rc != 0 and "stopping at step 4: the gradient norm was not finite 3 times in a row" in out, out[-3000:]
    rows = rows_of(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]   # step 4 stopped the run before its log line
    assert [r["skipped_steps"] for r in rows] == [0, 1, 2]
    assert rows[0]["grad_norm"] > 0 and all(r["grad_norm"] == float("inf") for r in rows[1:])


def family_of(pid):
    top = psutil.Process(pid)
    return [top] + top.children(recursive=True)


def assert_all_gone(family, timeout=90):
    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = [p for p in family if running(p)]
        if not alive:
            return
        time.sleep(1)
    raise AssertionError(f"still running: {[(p.pid, command_of(p)[:100]) for p in alive]}")


@pytest.mark.parametrize("to", ["the launcher", "its process group", "its process group at start-up"])
def test_sigterm_to_the_deepspeed_launcher_stops_every_process(tmp_path, tiny_model, to):
    """SIGTERM to deepspeed's single-node runner alone: it dies without passing it on; rank 0 notices its
    launcher is gone and stops, taking the generation process with it: nothing is left behind.
    SIGTERM to the launch's whole process group, as a job scheduler stops a job: each rank gets it from the
    sender and again from launch.py passing it on, one request: the run finishes the step, saves it and prints
    the line that continues it, naming SIGTERM. There the reference server rank 0 started, which the signal
    ends too, reloads a checkpoint after every step (--ref-sync-every 1): the stop meets a reload, which is
    the stop, not an error. Before the loop (while vLLM starts): the rank exits once, and its exit handlers
    run to the end. No process aborts, no traceback."""
    reference = ["--beta", "0.04", "--ref-sync-every", "1"] if to == "its process group" else ["--beta", "0"]
    proc = launch(tmp_path, tiny_model, *reference, "--steps", "100000", launcher=True)
    if to.endswith("start-up"):
        wait_until(proc, lambda: "grpo_train.py: model" in open(proc.log).read(), proc.log)
    else:
        wait_for_step(proc, tmp_path, 1)
    family = family_of(proc.pid)
    assert len(family) >= 3   # runner, launch.py, rank 0 (and, in the loop, the vLLM generation process)
    if to == "the launcher":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGTERM)
    assert_all_gone(family)
    said = open(proc.log).read()
    if to == "its process group":
        assert "SIGTERM: the run stops after this step, with a checkpoint\n" in said, said[-3000:]
        stopped = re.search(r"^stopped after step (\d+) of 100000 \(SIGTERM\): .* last checkpoint "
                            rf"{tmp_path}/step_\d+; to continue:$", said, re.M)
        assert stopped and (tmp_path / "latest").read_text() == f"step_{stopped.group(1)}", said[-3000:]
    if to.endswith("start-up"):
        assert not rows_of(tmp_path), said[-3000:]
    if to.startswith("its process group"):
        for sign in ("terminate called", "Traceback", "Exception ignored"):
            assert sign not in said, said[-3000:]


TRACEBACKS = ("Traceback", "terminate called", "Exception ignored")


def copy_terminal(master, log, hang_up):
    """What the terminal whose other end is `master` shows, into `log` (lines ending in \n), until
    `hang_up` is set (then the terminal closes) or nothing holds the terminal any more."""
    while not hang_up.is_set():
        if select.select([master], [], [], 0.1)[0]:
            try:
                data = os.read(master, 65536)
            except OSError:   # EIO: no process has the terminal open
                break
            log.write(data.decode(errors="replace").replace("\r\n", "\n"))
            log.flush()
    os.close(master)


@pytest.mark.parametrize("how", ["SIGTERM", "terminal closed", "Ctrl-C twice", "ref server dies"])
def test_stopping_the_demo_stops_every_process_it_started(tmp_path, demo_model, how):
    """SIGTERM to run_demo's process group (with two reference servers of the demo's own, which end at it),
    the demo's terminal closed (the kernel hangs up its session: SIGHUP, and every later write to that
    terminal fails), or the reference server (which rank 0 started) killed: the reference servers, the
    launcher, the ranks and vLLM all end (the last within seconds, not after --ref-wait). run_demo passes a
    SIGTERM or a SIGHUP on to the launcher's group as a Ctrl-C, so the run stops as a launch by hand does:
    the ranks finish the step, save it and print the line that continues the run (after a hang-up, to no one:
    the step saved is the last one logged). Ctrl-C twice (to the demo's group, as a terminal sends it), the
    second once the first's checkpoint is saved, while the ranks shut down: the demo exits with code 130. However it stops, no process prints a
    traceback (the launcher's runner printed one at each Ctrl-C) or is reported to have leaked a semaphore."""
    # with SIGTERM and the terminal closed, two reference servers of the demo's own: in its process group,
    # they end at the signal too
    servers = ["--ref-servers", "2"] if how in ("SIGTERM", "terminal closed") else []
    log = open(tmp_path / "run.log", "w")
    io = {"stdout": log, "stderr": subprocess.STDOUT}
    if how == "terminal closed":
        # a terminal of its own: the controlling terminal of the session it starts
        master, terminal = pty.openpty()
        io = {"stdin": terminal, "stdout": terminal, "stderr": terminal,
              "preexec_fn": lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0)}
    proc = subprocess.Popen([sys.executable, "-m", "demo.run_demo", "--model", demo_model, "--out-dir", str(tmp_path),
                             "--steps", "100000", *servers], cwd=ROOT, start_new_session=True, **io)
    proc.log = log.name
    if how == "terminal closed":
        os.close(terminal)
        hang_up = threading.Event()
        threading.Thread(target=copy_terminal, args=(master, log, hang_up), daemon=True).start()
    RUNS.append(proc)
    wait_for_step(proc, tmp_path, 1)
    family = family_of(proc.pid)
    assert any("ref_server.py" in command_of(p) for p in family) and len(family) >= 6
    if how == "SIGTERM":
        os.killpg(proc.pid, signal.SIGTERM)
    elif how == "terminal closed":
        hang_up.set()
    elif how == "Ctrl-C twice":
        asked = time.time()
        os.killpg(proc.pid, signal.SIGINT)
        latest = tmp_path / "latest"
        wait_until(proc, lambda: latest.exists() and latest.stat().st_mtime >= asked, proc.log, every=0.05)
        os.killpg(proc.pid, signal.SIGINT)
    else:
        next(p for p in family if "ref_server.py" in command_of(p)).kill()
    assert_all_gone(family)
    assert proc.wait() != 0
    said = open(proc.log).read()
    assert "resource_tracker" not in said and not [sign for sign in TRACEBACKS if sign in said], said[-3000:]
    if how == "SIGTERM":
        stopped = re.search(r"^stopped after step (\d+) of 100000 \(Ctrl-C\): .* last checkpoint "
                            rf"{tmp_path}/step_\d+; to continue:$", said, re.M)
        assert stopped and (tmp_path / "latest").read_text() == f"step_{stopped.group(1)}", said[-3000:]
        assert proc.returncode == 128 + signal.SIGTERM
    if how == "terminal closed":
        last = rows_of(tmp_path)[-1]["step"]
        assert (tmp_path / "latest").read_text() == f"step_{last}", said[-3000:]
        assert proc.returncode == 128 + signal.SIGHUP
    if how == "Ctrl-C twice":
        assert proc.returncode == 130 and re.fullmatch(r"step_\d+", (tmp_path / "latest").read_text()), said
    if how == "ref server dies":
        # the demo's one launch: rank 0 started the server, and notices its death
        assert "grpo_train.py: the reference server this run started died (exit code -9)" in said, said[-3000:]


def in_groups(groups):
    """The processes that run in any of the process groups `groups`."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(ProcessLookupError, psutil.Error):   # it ended while we looked
            if os.getpgid(p.pid) in groups and running(p):
                found.append(p)
    return found


@pytest.mark.parametrize("sig", ["SIGHUP", "SIGINT", "SIGTERM"])
def test_a_stop_as_the_demo_launches_ends_every_process_without_a_traceback(tmp_path, tiny_model, sig):
    """SIGHUP (the demo's terminal closed), Ctrl-C or SIGTERM to the demo alone the moment it has started
    deepspeed's launcher, in a session of its own, beside two reference servers of its own: the demo exits
    with code 128 + the signal and no process is left in its process group or the launcher's, shown by the
    process table; none prints a traceback (no rank has started: there is nothing to save)."""
    log = tmp_path / "run.log"
    proc = subprocess.Popen([sys.executable, "-m", "demo.run_demo", "--model", tiny_model, "--out-dir", str(tmp_path),
                             "--steps", "100000", "--ref-servers", "2"], cwd=ROOT, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    RUNS.append(proc)
    launcher = []

    def launched():
        launcher[:] = [p for p in psutil.Process(proc.pid).children() if "deepspeed" in command_of(p)]
        return launcher
    wait_until(proc, launched, log, every=0.01)
    groups = {proc.pid, launcher[0].pid}   # the launcher's session: a process group of its own
    assert len(in_groups(groups)) >= 4   # the demo, its two servers, the launcher
    proc.send_signal(getattr(signal, sig))
    assert proc.wait(timeout=120) == 128 + getattr(signal, sig), log.read_text()[-3000:]
    deadline = time.time() + 90
    while (left := in_groups(groups)) and time.time() < deadline:
        time.sleep(0.5)
    assert not left, [(p.pid, command_of(p)[:100]) for p in left]
    said = log.read_text()
    assert not [sign for sign in TRACEBACKS if sign in said] and not rows_of(tmp_path), said[-3000:]


def test_the_demo_names_its_own_flag_when_beta_0_leaves_its_servers_nothing_to_do(tmp_path, tiny_model):
    """--ref-servers 2 with --beta 0 after `--`: one line naming the two flags the user gave (the --ref-url
    the demo passes the trainer is its own), before anything starts."""
    p = subprocess.run([sys.executable, "-m", "demo.run_demo", "--model", tiny_model, "--out-dir", str(tmp_path),
                        "--ref-servers", "2", "--", "--beta", "0"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1 and p.stderr == (
        "run_demo: --ref-servers 2 starts reference servers, but --beta 0 trains without a reference: drop "
        "--ref-servers, or give --beta > 0\n"), p.stdout[-2000:] + p.stderr[-3000:]
    assert not os.listdir(tmp_path)


def test_a_mistake_the_trainer_finds_ends_the_demo_in_its_line_and_the_demos(tmp_path, tiny_model):
    """A trainer flag after `--` that the trainer refuses (`--lr -1`): the trainer's one line, then the
    demo's line with the exit code, and no line of the launcher's (its "no hostfile" warning, its error line
    repeating the rank's whole command), as at README.md's --log_level critical."""
    p = subprocess.run([sys.executable, "-m", "demo.run_demo", "--model", tiny_model, "--out-dir", str(tmp_path),
                        "--", "--lr", "-1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 1 and p.stderr.splitlines()[-2:] == [
        "grpo_train.py: --lr must be > 0", "run_demo: grpo_train.py failed (exit code 1)"], out[-3000:]
    assert not [line for line in out.splitlines() if LAUNCHER_LINE.match(line)], out[-3000:]


def test_the_demo_refuses_a_file_as_its_folder_and_a_trainers_folder_of_its_own(tmp_path):
    """--out-dir naming a file (a FileExistsError traceback), and --out-dir after `--`, which sent
    the trainer's metrics where the demo did not read them; --world-size 0 (which ran one rank) and a
    --model without a model (the trainer's line, then the launcher's report of the rank's exit): one line
    each, before anything starts."""
    notes, demo = tmp_path / "notes.txt", tmp_path / "demo"
    notes.write_text("")
    for argv, said in ((["--out-dir", str(notes)], f"--out-dir {notes} is a file, not a folder"),
                       (["--out-dir", str(demo), "--", "--out-dir", str(tmp_path / "x")],
                        f"--out-dir after `--` would move the trainer's folder away from the "
                        f"demo's own ({demo}): give --out-dir before `--`"),
                       (["--out-dir", str(demo), "--world-size", "0"],
                        "--world-size 0: the demo needs 1 or more training processes"),
                       (["--out-dir", str(demo), "--model", str(tmp_path)],
                        f"--model {tmp_path} holds no model (no config.json; without --model the demo builds one)")):
        p = subprocess.run([sys.executable, "-m", "demo.run_demo", *argv], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert (p.returncode, p.stderr) == (1, f"run_demo: {said}\n"), \
            p.stdout[-2000:] + p.stderr[-3000:]
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_sigterm_to_another_rank_stops_the_run_as_at_rank_0(tmp_path, tiny_model):
    """A 2-rank launch, SIGTERM to rank 1 alone in the loop: rank 1 passes it on to rank 0, which makes the
    stop: the run finishes the step, saves it, prints the line that continues it (naming SIGTERM) and every
    process ends, none with a traceback. (Rank 1 alone went on, and the run with it, saying nothing.)"""
    proc = launch(tmp_path, tiny_model, "--beta", "0", "--steps", "100000", launcher=True, ranks=2)
    wait_for_step(proc, tmp_path, 1)
    family = family_of(proc.pid)
    (rank_1,) = [p for p in family if "--local_rank=1" in command_of(p)]
    rank_1.send_signal(signal.SIGTERM)
    assert_all_gone(family)
    rc, said = finish(proc, timeout=30)
    assert "SIGTERM: the run stops after this step, with a checkpoint\n" in said, said[-3000:]
    stopped = re.search(r"^stopped after step (\d+) of 100000 \(SIGTERM\): .* last checkpoint "
                        rf"{tmp_path}/step_\d+; to continue:$", said, re.M)
    assert stopped and (tmp_path / "latest").read_text() == f"step_{stopped.group(1)}", said[-3000:]
    assert rc == 0 and not [sign for sign in TRACEBACKS if sign in said], said[-3000:]


def test_ctrl_c_while_the_demo_builds_its_model_ends_it_without_a_traceback(tmp_path):
    """Ctrl-C (SIGINT to the demo's process group, as a terminal sends it) during the warm start of the
    model the demo builds: the demo and its build end, exit code 130, and no traceback is printed."""
    log = tmp_path / "run.log"
    proc = subprocess.Popen([sys.executable, "-m", "demo.run_demo", "--out-dir", str(tmp_path)], cwd=ROOT,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    RUNS.append(proc)
    wait_until(proc, lambda: "warm-start step" in log.read_text(), log)
    family = family_of(proc.pid)
    assert any("demo.tiny_model" in command_of(p) for p in family)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    assert_all_gone(family)
    said = log.read_text()
    assert "Traceback" not in said and not (tmp_path / "model").exists(), said[-3000:]


def test_sigterm_while_a_background_demo_starts_its_launcher_ends_it(tmp_path, demo_model):
    """The demo started with SIGINT ignored, as a shell script's background job is, and sent SIGTERM as soon
    as deepspeed's launch.py exists (it takes seconds to import before it handles signals): the demo passes
    the stop on as SIGTERM, since launch.py does not take a Ctrl-C yet, every process ends, exit code 143."""
    log = tmp_path / "run.log"
    proc = subprocess.Popen([sys.executable, "-m", "demo.run_demo", "--model", demo_model, "--out-dir",
                             str(tmp_path), "--steps", "100000"], cwd=ROOT, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    RUNS.append(proc)
    wait_until(proc, lambda: any("deepspeed.launcher.launch" in command_of(p) for p in family_of(proc.pid)),
               log, every=0.1)
    family = family_of(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    assert_all_gone(family)
    assert not rows_of(tmp_path), log.read_text()[-3000:]


def test_resume_after_sigkill_continues_the_run_and_samples_from_the_checkpoint(tmp_path, demo_model):
    """SIGKILL to every process after step 5 (checkpoints every 2 steps), the semaphores that leaves removed
    (conftest.sigkill_group); --resume continues after the latest checkpoint with its data position,
    counters and metrics, and ends with steps 1..20, each once. (20 steps: the run is still far from its end
    when the test sees step 5 and kills it.) Both runs check themselves and say nothing: at step 1 the policy
    is the reference (the server rank 0 started) and sampled the batch, so the KL and the trainer/vLLM gap are
    rounding. The resumed run's first batch comes with the probe the engine measured on the weights it
    sampled it with: the checkpoint's (scored here by transformers), not the starting model's."""
    flags = ["--beta", "0.04", "--steps", "20", "--save-every", "2", "--lr", "1e-3"]
    port = next_port()
    proc = launch(tmp_path, demo_model, *flags, port=port)
    wait_for_step(proc, tmp_path, 5)
    # the whole process group: a job killed without warning. Rank 0's 3 queues to its engine (3 named
    # semaphores each) outlive it in /dev/shm, as its resource tracker dies with it: removed
    assert len(sigkill_group(proc.pid)) >= 9
    proc.wait()
    # no rank made DeepSpeed's CPU all-reduce buffer (66 MB in /dev/shm, for its inference op), or left it
    assert no_allreduce_buffer_left(port)
    assert WARNING not in open(proc.log).read()
    rows = rows_of(tmp_path)
    assert rows[0]["kl"] < 1e-9 and rows[0]["sampling/logp_diff_mean"] < 1e-4 and rows[0]["policy_lag"] == 0
    start = probe_logp(demo_model)
    assert rows[0]["sync/probe_logp"] == pytest.approx(start, abs=1e-4)
    latest = (tmp_path / "latest").read_text()
    k = int(latest.removeprefix("step_"))
    assert 4 <= k < 20 and k % 2 == 0
    trained = probe_logp(str(tmp_path / latest))
    # the steps moved the probe well past the comparison's tolerance: it tells the two weights apart
    assert abs(trained - start) > 10 * 1e-4
    rc, out = finish(launch(tmp_path, demo_model, *flags, "--resume"))
    assert rc == 0 and f"resuming after step {k}" in out and WARNING not in out, out[-3000:]
    rows = rows_of(tmp_path)
    assert_each_batch_trained_once(rows, prompts_per_step=4)
    assert len(rows) == 20 and all(r["stale_dropped"] == 0 for r in rows)
    assert rows[k]["step"] == k + 1 and rows[k]["sync/probe_logp"] == pytest.approx(trained, abs=1e-4)
    assert (tmp_path / "latest").read_text() == "step_20" and (tmp_path / "step_20" / "model.safetensors").exists()
    assert not list(tmp_path.glob("*.tmp"))


def test_check_config_names_every_bad_flag(capsys):
    from deepspeed.accelerator import get_accelerator
    from grpo_train import get_args
    from run_setup import check_config
    get_accelerator()   # DeepSpeed's one-time "Setting accelerator to CPU" line, here when this test runs alone
    capsys.readouterr()
    ok = get_args(["--model", "Qwen/Qwen2.5-0.5B-Instruct"])   # a hub id is not checked for a local folder
    check_config(2, **vars(ok))
    bad = get_args(["--model", "./no/such/folder", "--group-size", "1", "--prompts-per-step", "0",
                    "--rewards", "gsm8k,nope", "--temperature", "0", "--overlong-buffer", "600",
                    "--ref-sync-every", "2", "--beta", "0", "--max-staleness", "-1", "--lora-rank", "-1"])
    assert capsys.readouterr().out.startswith("grpo_train.py: model Qwen/Qwen2.5-0.5B-Instruct; 2 training ranks")
    with pytest.raises(SystemExit) as e:
        check_config(2, **vars(bad))
    err = capsys.readouterr().err   # one line, naming every flag
    assert e.value.code == 1 and err.count("\n") == 1
    for flag in ("--group-size", "--prompts-per-step", "--rewards", "--temperature", "--overlong-buffer",
                 "--ref-sync-every", "--max-staleness", "--lora-rank", "--model ./no/such/folder: no such folder"):
        assert flag in err, flag
    with pytest.raises(SystemExit):
        check_config(4, **vars(get_args(["--model", "m/m", "--prompts-per-step", "1", "--group-size", "2"])))
    assert "must be >= the number of training ranks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        check_config(1, **vars(get_args(["--model", "m/m", "--ref-url", "127.0.0.1:59875"])))
    assert capsys.readouterr().err == ("grpo_train.py: --ref-url 127.0.0.1:59875: a server's URL starts with "
                                       "http:// (e.g. http://127.0.0.1:59875)\n")
    # argparse's own refusals, one line each (the process's, with an invalid int: the test below)
    with pytest.raises(SystemExit):
        get_args(["--model", "m/m", "--agg", "mean"])
    err = capsys.readouterr().err   # the choices quoted or not, as Python's version has them
    assert re.fullmatch(r"grpo_train.py: argument --agg: invalid choice: 'mean' \(choose from "
                        r"'?seq-mean-token-mean'?, '?token-mean'?, '?seq-mean-token-sum-norm'?\) "
                        r"\(--help lists the flags\)\n", err), err


SEED_RANGE = "--seed must be in [0, 2147483647]: each vLLM engine's seed is it plus its place in the data, below 2**32"
# a value out of its flag's range -> the one line that refuses it, before anything loads or starts
OUT_OF_RANGE = [
    (["--beta", "-0.04"], "--beta must be >= 0"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--eps-low", "-0.2"], "--eps-low must be >= 0"),
    (["--eps-high", "-0.2"], "--eps-high must be >= 0"),
    (["--std-floor", "-1"], "--std-floor must be >= 0"),
    (["--std-floor", "0.3", "--scale-rewards", "batch"],
     "--std-floor needs --scale-rewards group: it spares a group the division by its own std"),
    (["--std-floor", "0.3", "--scale-rewards", "none"],
     "--std-floor needs --scale-rewards group: it spares a group the division by its own std"),
    (["--sync-tol", "-0.1"], "--sync-tol must be >= 0"),
    (["--ref-wait", "-1"], "--ref-wait must be >= 0"),
    (["--dist-timeout", "0"], "--dist-timeout must be > 0"),
    (["--gen-device", "-1"], "--gen-device must be >= 0"),
    (["--gen-kv-gb", "0"], "--gen-kv-gb must be >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--eval-every", "-5", "--save-every", "-5"], "--eval-every, --save-every must be >= 0"),
    (["--beta", "-1", "--lr", "-1", "--eps-high", "-1"], "--beta, --eps-high must be >= 0; --lr must be > 0"),
    # numpy's "Seed must be between 0 and 2**32 - 1" killed the vLLM engine, after the start-up
    (["--seed", "-1"], SEED_RANGE),
    (["--seed", str(2**31)], SEED_RANGE),
    # vLLM sampled at 0.01, the trainer and the reference took their log-probs at 0.001
    (["--temperature", "0.005"], "--temperature must be >= 0.01: vLLM samples at 0.01 at least"),
    # each was taken: the reference reloaded every step, no completion was logged
    (["--ref-sync-every", "-1", "--log-every", "-1", "--log-completions", "-2"],
     "--ref-sync-every, --log-every, --log-completions must be >= 0"),
    # each was said in the start-up line and did nothing
    (["--beta", "0", "--kl-is-weight"], "--kl-is-weight weights the KL term, which --beta 0 leaves out"),
    (["--lora-alpha", "16"], "--lora-alpha scales LoRA adapters: give --lora-rank too"),
    (["--steps", "6", "--sync-every", "2", "--eval-every", "3"],
     "--eval-every 3: evaluations come with the weight pushes, every --sync-every 2 steps: give a multiple "
     "of 2 (2, 4, ...)"),
]


@pytest.mark.parametrize("flags, said", OUT_OF_RANGE, ids=[" ".join(f) for f, _ in OUT_OF_RANGE])
def test_a_value_out_of_its_flags_range_is_one_line(flags, said, capsys):
    from grpo_train import get_args
    from run_setup import check_config
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        check_config(1, **vars(get_args(["--model", "m/m", *flags])))
    assert e.value.code == 1 and capsys.readouterr().err == f"grpo_train.py: {said}\n"


def test_the_edges_of_each_flags_range_pass(capsys):
    """0 where 0 means something (no reference, no clip, no wait, no tolerance), and an --eval-every that
    falls on weight pushes (or one --eval-only never uses)."""
    from grpo_train import get_args
    from run_setup import check_config
    for flags in (["--beta", "0", "--eps-low", "0", "--eps-high", "0", "--std-floor", "0", "--sync-tol", "0",
                   "--ref-wait", "0", "--gen-kv-gb", "1", "--max-new-tokens", "1"],
                  ["--sync-every", "2", "--eval-every", "4"], ["--sync-every", "3", "--eval-every", "0"],
                  ["--std-floor", "0.3", "--scale-rewards", "group"], ["--scale-rewards", "batch"],
                  ["--seed", str(2**31 - 1)], ["--temperature", "0.01", "--kl-is-weight"],
                  ["--lora-rank", "4", "--lora-alpha", "16"],
                  ["--sync-every", "2", "--eval-every", "3", "--eval-only"]):
        check_config(1, **vars(get_args(["--model", "m/m", *flags])))
        assert "grpo_train.py: " in capsys.readouterr().out, flags


def test_a_ds_config_that_is_not_a_json_object_is_one_line(tmp_path, capsys):
    """Said before vLLM starts, where DeepSpeed reads it after: a JSONDecodeError's traceback; and settings
    that would make the update another one."""
    from grpo_train import get_args
    from run_setup import check_config
    (tmp_path / "comma.json").write_text('{\n  "zero_optimization": {"stage": 2},\n}\n')
    (tmp_path / "list.json").write_text("[1, 2]\n")
    # an accumulation of DeepSpeed's own divided every gradient by it again: the clip saw a norm 4x smaller
    (tmp_path / "accumulate.json").write_text('{"gradient_accumulation_steps": 4}\n')
    (tmp_path / "batch.json").write_text('{"train_batch_size": 64}\n')
    accumulation = ("keep gradient_accumulation_steps 1 and leave out train_batch_size: a step accumulates all "
                    "its micro-batches itself (--micro-batch sets their size)")
    for name, said in (("accumulate.json", accumulation), ("batch.json", accumulation),
                       ("comma.json", "not JSON (Expecting property name enclosed in double quotes, line 3, "
                                      "column 1)"),
                       ("list.json", "a JSON object of DeepSpeed's settings is expected, not a list"),
                       ("none.json", "no such file"), (".", "a folder, not a file")):
        with pytest.raises(SystemExit) as e:
            check_config(1, **vars(get_args(["--model", "m/m", "--ds-config", str(tmp_path / name)])))
        err = capsys.readouterr().err
        assert e.value.code == 1 and err == f"grpo_train.py: --ds-config {tmp_path / name}: {said}\n", err


# a --ds-config file's settings the trainer fills in or relies on, wrong -> its one line (each was a
# traceback once vLLM and the reference server had started, or a stage the trainer cannot run)
STAGES = "this trainer runs ZeRO stage 2 (ds_config.json) or 1; stage 3 splits the weights, which it reads " \
         "whole, and 0 is no ZeRO"
BAD_DS_SETTINGS = [
    ({"zero_optimization": "2"}, 'zero_optimization must be a JSON object of settings, not "2"'),
    ({"zero_optimization": {"stage": 2}, "optimizer": "adam"},
     'optimizer must be a JSON object of settings, not "adam"'),
    ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": [0.9]}},
     "optimizer.params must be a JSON object of settings, not [0.9]"),
    ({"zero_optimization": {"stage": "two"}}, f'zero_optimization.stage is "two": {STAGES}'),
    ({"zero_optimization": {"stage": 3}}, f"zero_optimization.stage is 3: {STAGES}"),
    ({"zero_optimization": {"stage": 0}}, f"zero_optimization.stage is 0: {STAGES}"),
    ({"gradient_clipping": 1.0}, f"zero_optimization.stage is missing: {STAGES}"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
     "zero_optimization.offload_optimizer.device: Input should be 'none', 'cpu' or 'nvme'"),
    ({"zero_optimization": {"stage": 2, "overlap_com": True}},
     "zero_optimization.overlap_com: Extra inputs are not permitted"),
]


def test_a_ds_config_whose_settings_deepspeed_or_the_trainer_refuse_is_one_line(tmp_path, capsys):
    """Said before vLLM starts; the shipped files and a ZeRO-1 one pass."""
    from grpo_train import get_args
    from run_setup import check_config
    path = tmp_path / "ds.json"
    capsys.readouterr()
    for settings, said in BAD_DS_SETTINGS:
        path.write_text(json.dumps(settings))
        with pytest.raises(SystemExit) as e:
            check_config(1, **vars(get_args(["--model", "m/m", "--ds-config", str(path)])))
        err = capsys.readouterr().err
        assert e.value.code == 1 and err == f"grpo_train.py: --ds-config {path}: {said}\n", err
    (tmp_path / "zero1.json").write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    for good in ("ds_config.json", "ds_config_offload.json", str(tmp_path / "zero1.json")):
        check_config(1, **vars(get_args(["--model", "m/m", "--ds-config", good])))
        assert "grpo_train.py: model m/m" in capsys.readouterr().out, good


def test_long_prompts_are_skipped_and_a_task_with_none_left_is_refused(capsys):
    from demo.tiny_model import build_tokenizer
    from run_setup import load_prompts
    tok = build_tokenizer()
    kw = dict(task="demo", data=None, seed=0, eval_size=200, prompt_key="prompt", answer_key="answer",
              chat_template="auto")
    # the demo's prompts ("37+5=") are 5 tokens: a limit of 5 keeps all 360, a limit of 4 skips every one
    train, held_out, too_long = load_prompts(tok, max_prompt_len=5, **kw)
    assert (len(train), len(held_out), too_long) == (360, 90, 0)
    assert train[0]["prompt_ids"] == tok(train[0]["prompt"], add_special_tokens=False)["input_ids"]
    with pytest.raises(SystemExit):
        load_prompts(tok, max_prompt_len=4, **kw)
    assert "--task demo: no prompt to train on: all 360 are longer than --max-prompt-len 4 tokens (the " \
        "shortest has 5)" in capsys.readouterr().err


def test_a_held_out_split_with_no_prompt_short_enough_is_refused(tmp_path, capsys):
    """Every run evaluates at its start and end: with no held-out prompt left it would report an
    accuracy of 0.000 it never measured."""
    from demo.tiny_model import build_tokenizer
    from run_setup import load_prompts
    (tmp_path / "qa_train.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    (tmp_path / "qa_test.jsonl").write_text("".join(json.dumps({"prompt": q, "answer": "4"}) + "\n"
                                                    for q in ("what is 2+2?", "and 1+3?")))
    kw = dict(task="custom", data=str(tmp_path / "qa_train.jsonl"), seed=0, eval_size=200, prompt_key="prompt",
              answer_key="answer", chat_template="none")
    train, held_out, _ = load_prompts(build_tokenizer(), max_prompt_len=8, **kw)
    assert (len(train), len(held_out)) == (1, 1)
    with pytest.raises(SystemExit) as e:
        load_prompts(build_tokenizer(), max_prompt_len=7, **kw)
    assert e.value.code == 1 and capsys.readouterr().err == (
        f"grpo_train.py: --task custom --data {tmp_path / 'qa_train.jsonl'}: no prompt to evaluate: all 2 held-out "
        f"prompts are longer than --max-prompt-len 7 tokens (the shortest has 8)\n")


def test_buckets_are_consecutive_one_dtype_and_bounded():
    import torch
    from weight_transfer import buckets
    f32, bf16 = torch.float32, torch.bfloat16
    # 4-byte floats, limit 40 bytes: 3+5 fit, 8 would pass it, a 20-float weight goes alone, a dtype change cuts
    weights = [(3, f32), (5, f32), (8, f32), (20, f32), (1, f32), (2, bf16), (2, bf16), (1, f32)]
    assert buckets(weights, 40) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5), range(5, 7), range(7, 8)]
    assert buckets(weights, 10**9) == [range(0, 5), range(5, 7), range(7, 8)]
    assert buckets([], 40) == []


# ---------------------------------------------------------------- a user's mistake: one line, no traceback

# the launcher's own log lines ("[2026-11-24 00:33:10,549] [INFO] [launch.py:253:sigkill_handler] ...")
LAUNCHER_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[(INFO|WARNING|ERROR)\] \[(\w+)\.py:")


# rank 0's start-up lines, said before the data is read
START_UP = ("grpo_train.py: model ", "trainable parameters:")


def said(out):
    """(the lines the ranks wrote, the launcher's lines after the first rank line that names an error)."""
    ours = [(i, line) for i, line in enumerate(out.splitlines()) if line.strip() and not LAUNCHER_LINE.match(line)]
    errors = [i for i, line in ours if not line.startswith(START_UP)]
    after = [line for line in out.splitlines()[errors[0]:] if LAUNCHER_LINE.match(line)] if errors else []
    return [line for _, line in ours], after


def test_each_kind_of_mistake_ends_in_one_line_through_the_launcher(tmp_path, tiny_model):
    """A mistake of each phase of the start-up: a flag check (check_config), an --out-dir that holds another
    run (read_state; tests/test_checkpoint.py has --resume and --overwrite) and a malformed data record
    (load_prompts; tests/test_tasks.py has the message of each kind of data mistake) each end the run with
    one line naming the flag, folder, file, line and column, and a non-zero exit status; no rank prints a
    traceback, and the launcher adds only its report of the exit (before: ~30 lines, a traceback per rank),
    and not even that at --log_level critical, as README.md launches (the out-dir case, which leaves the
    folder as it was). The flag check runs at world size 2, where both ranks find it and one says it.
    Launched side by side. (A bad flag value, argparse's, is one line without the launcher: the next test.)"""
    (tmp_path / "broken.jsonl").write_text(json.dumps({"prompt": "q", "answer": "a"}) + '\n{"prompt": "q",\n')
    cases = {"record": (["--task", "custom", "--beta", "0", "--data", str(tmp_path / "broken.jsonl")], 1,
                        r".*broken.jsonl:2: not a JSON line \(Expecting property name enclosed in double quotes, "
                        r"column 16\)"),
             "flag": (["--beta", "0", "--eval-size", "0"], 2, r".*--eval-size must be >= 1"),
             "out-dir": (["--beta", "0"], 1, rf"--out-dir {re.escape(str(tmp_path))}/out-dir holds another run "
                         r"\(its checkpoint step_3\): --resume continues it, --overwrite replaces it, or pass "
                         r"another --out-dir")}
    runs = {}
    for name, (flags, world, _) in cases.items():
        os.makedirs(tmp_path / name)
        if name == "out-dir":   # what a run that saved step 3 leaves
            (tmp_path / name / "latest").write_text("step_3")
        quiet = ["--log_level", "critical"] if name == "out-dir" else []
        cmd = [DEEPSPEED, *quiet, "--num_gpus", str(world), "--master_port", str(next_port()), "grpo_train.py",
               "--model", tiny_model, "--out-dir", str(tmp_path / name), "--max-prompt-len", "64", *flags]
        log = open(tmp_path / name / "run.log", "w")
        runs[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        runs[name].log = log.name
        RUNS.append(runs[name])
    for name, (_, world, expected) in cases.items():
        rc, out = finish(runs[name])
        lines, launcher = said(out)
        assert rc != 0 and "Traceback" not in out and "[rank" not in out, out[-3000:]
        (error,) = [line for line in lines if not line.startswith(START_UP)]
        assert re.fullmatch("grpo_train.py: " + expected, error), (name, error)
        # the start-up lines (once the flags are right), then the mistake: nothing else from any rank
        assert len(lines) <= len(START_UP) + 1, (name, lines)
        assert all("Killing subprocess" in line or "exits with return code" in line for line in launcher), launcher
    # at --log_level critical, no line of the launcher's; the rank's exit status is the launch's
    rc, out = finish(runs["out-dir"])
    assert rc == 1 and not said(out)[1] and (tmp_path / "out-dir" / "latest").read_text() == "step_3", out


def test_a_value_vllm_refuses_as_it_starts_is_one_line_naming_the_flag(tmp_path, tiny_model):
    """A completion length the model has no positions for, and a KV cache larger than the free memory: vLLM
    refuses them as the engine starts, where its traceback named its own settings (VLLM_ALLOW_LONG_MAX_MODEL_LEN,
    --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE). The run ends in one line naming this trainer's flags,
    exit status 1. Launched side by side."""
    import psutil
    huge = psutil.virtual_memory().total // 2**30 * 4
    runs = {}
    for name, flags in (("length", ["--max-new-tokens", "100000"]), ("kv", ["--gen-kv-gb", str(huge)])):
        os.makedirs(tmp_path / name)
        runs[name] = launch(tmp_path / name, tiny_model, "--beta", "0", *flags)
    for name, expected in (("length", rf"--max-prompt-len \+ --max-new-tokens: 100016 tokens, more than "
                                      rf"{re.escape(tiny_model)} holds \(max_position_embeddings=\d+"),
                           ("kv", rf"--gen-kv-gb {huge}: more than this machine has free for vLLM's KV cache")):
        rc, out = finish(runs[name])
        assert rc == 1 and not [sign for sign in TRACEBACKS if sign in out], out[-3000:]
        assert re.match("grpo_train.py: " + expected, out.splitlines()[-1]), out[-3000:]


def test_a_bad_flag_without_the_launcher_is_one_line(tiny_model):
    p = subprocess.run([sys.executable, "grpo_train.py", "--model", tiny_model, "--steps", "ten"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    # stdout: at most DeepSpeed's own note, at import, that it found no GPU
    assert p.returncode != 0 and all(LAUNCHER_LINE.match(line) for line in p.stdout.splitlines())
    assert p.stderr == "grpo_train.py: argument --steps: invalid int value: 'ten' (--help lists the flags)\n"


def test_a_model_that_is_no_models_folder_nor_on_the_hub_is_one_line(tmp_path, capsys):
    """--model naming a run's folder (no config.json: its models are its step_N folders), or a name the hub
    cannot give (offline here), is one line naming the flag; both ended in transformers' traceback (a
    tokenizer it could not build; the hub's OSError)."""
    from grpo_train import get_args
    from run_setup import check_config
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit):
        check_config(1, **vars(get_args(["--model", str(tmp_path)])))
    assert capsys.readouterr().err == f"grpo_train.py: --model {tmp_path}: no config.json\n"
    cmd, env = rank_zero("--model", "nobody/no-such-model", "--out-dir", str(tmp_path / "out"), port=next_port())
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**env, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.splitlines()[-1].startswith("grpo_train.py: --model nobody/no-such-model: "), p.stderr


# ---------------------------------------------------------------- a first GPU run's failures, on CPU

def test_gen_mem_is_checked_against_what_shares_the_engines_gpu(capsys, monkeypatch):
    """On a pretend GPU machine (torch.cuda.is_available is the one thing patched): an engine on a training GPU
    may take at most half of it. Beside the reference server rank 0 starts (the 2-GPU layout: by default on
    the engine's GPU), at most 0.8, and 0.7 by default: vLLM takes --gen-mem of the whole GPU and refuses to
    start with less free (v1/worker/utils.py, request_memory), and the server's model and the push's receive
    buffers sit outside that share. On a GPU of its own, any --gen-mem."""
    import torch
    from grpo_train import get_args
    from run_setup import check_config
    import run_setup
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # a machine with the GPUs named here, whatever this one has (the GPU check runs on one)
    monkeypatch.setattr(run_setup, "machine_gpus", lambda: 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for flags, said in ((["--gen-device", "0"], "a vLLM engine on a training GPU may take at most 0.5 of it"),
                        (["--gen-device", "1"], "the reference server this run starts shares a GPU with a vLLM "
                                                "engine, which may then take at most 0.8 of it")):
        with pytest.raises(SystemExit) as e:
            check_config(1, **vars(get_args(["--model", "m/m", *flags, "--gen-mem", "0.9"])))
        err = capsys.readouterr().err
        assert e.value.code == 1 and err.count("\n") == 1 and f"--gen-mem 0.9: {said}" in err
    # the default on a shared GPU, a small one, beside the reference at 0.8, and a GPU of its own at 0.9 (the
    # reference server elsewhere, none, or started by hand) pass
    for flags, world in ((["--gen-device", "0"], 1), (["--gen-devices", "1", "--gen-mem", "0.4"], 2),
                         (["--gen-device", "1", "--gen-mem", "0.8"], 1),
                         (["--gen-device", "2", "--gen-mem", "0.9", "--ref-device", "3"], 2),
                         (["--gen-device", "1", "--gen-mem", "1", "--beta", "0"], 1),
                         (["--gen-device", "1", "--gen-mem", "0.9", "--ref-url", "http://127.0.0.1:9"], 1)):
        check_config(world, **vars(get_args(["--model", "m/m", *flags])))
    assert "grpo_train.py: model m/m" in capsys.readouterr().out
    from placement import default_gen_mem
    assert [default_gen_mem(*where) for where in ((False, True), (False, False), (True, True))] == [0.7, 0.9, 0.3]


def test_a_gpu_the_machine_lacks_is_one_line_naming_its_flag(capsys, monkeypatch):
    """--gen-device(s) and --ref-device index the machine's GPUs, as NVML counts them (the launcher's
    CUDA_VISIBLE_DEVICES hides the others from torch.cuda.device_count()). One beyond them was vLLM's or the
    reference server's traceback, then "the generation process died ... device 7"; it is one line naming the
    flag. The rule (placement.missing_gpu), then check_config on a machine without CUDA (a --ref-device GPU
    there) and on a pretend 2-GPU machine whose launcher made one visible (torch.cuda.is_available and NVML's
    count are the things patched)."""
    from grpo_train import get_args
    from placement import machine_gpus, missing_gpu
    from run_setup import check_config
    lacks = lambda flag, given, gpu, gpus: (f"{flag} {given}: this machine has no GPU {gpu} (it has {gpus}, "
                                            f"numbered from 0)")
    assert missing_gpu(4, 3, None, "2") is None and missing_gpu(4, 0, [0, 1, 2, 3], "cpu") is None
    assert missing_gpu(4, 7, None, None) == lacks("--gen-device", 7, 7, 4)
    assert missing_gpu(4, 0, [1, 5, 2], "cpu") == lacks("--gen-devices", "1,5,2", 5, 4)
    assert missing_gpu(2, 0, None, "2") == lacks("--ref-device", 2, 2, 2)
    assert missing_gpu(2, 0, [0, 3], "4") == f"{lacks('--gen-devices', '0,3', 3, 2)}; {lacks('--ref-device', 4, 4, 2)}"
    # --gen-device unused (beside --gen-devices; None: with --gen-urls), and a count not known: nothing to say
    assert missing_gpu(2, 9, [1], None) is None and missing_gpu(2, None, None, None) is None
    assert missing_gpu(None, 9, [9], "9") is None
    # here: no CUDA (or no NVML) is a count not known
    assert machine_gpus() is None if not torch.cuda.is_available() else machine_gpus() >= torch.cuda.device_count()
    # a machine without CUDA: the reference server a --ref-device GPU names ended in torch's traceback
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        check_config(1, **vars(get_args(["--model", "m/m", "--ref-device", "3"])))
    assert e.value.code == 1 and capsys.readouterr().err == (
        "grpo_train.py: --ref-device 3: torch sees no GPU here; leave it out (the server runs on CPU)\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    capsys.readouterr()
    for flags, said in ((["--gen-device", "2"], lacks("--gen-device", 2, 2, 2)),
                        (["--gen-devices", "1,7"], lacks("--gen-devices", "1,7", 7, 2)),
                        (["--gen-device", "1", "--ref-device", "3"], lacks("--ref-device", 3, 3, 2))):
        with pytest.raises(SystemExit) as e:
            check_config(1, **vars(get_args(["--model", "m/m", *flags])))
        assert e.value.code == 1 and capsys.readouterr().err == f"grpo_train.py: {said}\n"
    # the 2-GPU layout (GPU 1 visible to no rank) and both GPUs as engines pass
    for flags in (["--gen-device", "1"], ["--gen-devices", "0,1", "--ref-device", "cpu"]):
        check_config(1, **vars(get_args(["--model", "m/m", *flags])))


def test_overlap_comm_is_on_where_more_than_one_rank_trains(tmp_path):
    """ZeRO-2 overlaps its gradient reduction with the backward on 2+ ranks, not on one (only its buffers
    there); a value written in the --ds-config file wins."""
    from run_setup import deepspeed_config
    for name in ("ds_config.json", "ds_config_offload.json"):
        path = os.path.join(ROOT, name)
        assert deepspeed_config(path, 8, False, 2)["zero_optimization"]["overlap_comm"] is True
        assert deepspeed_config(path, 8, False, 1)["zero_optimization"]["overlap_comm"] is False
    mine = tmp_path / "ds.json"
    mine.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": False}}))
    assert deepspeed_config(str(mine), 8, False, 4)["zero_optimization"]["overlap_comm"] is False


def test_an_engine_dead_before_the_first_push_never_blocks_opening_the_weight_group():
    """Rank 0 opens the weight group (vLLM's init handshake) for an engine that died before it joined: the
    rendezvous would wait GROUP_TIMEOUT (30 minutes); the liveness check ends it in one line within
    seconds, and nothing is left open."""
    import multiprocessing
    from generation import GenerationProcess
    from transfer_clients import EngineClient, Snapshot
    from weight_transfer import open_transfer
    ctx = multiprocessing.get_context("spawn")
    dead = ctx.Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    gen = GenerationProcess.__new__(GenerationProcess)
    gen.procs, gen.devices, gen.launcher, gen.transfer = [dead], [0], None, None
    gen.store = torch.distributed.HashStore()
    client = EngineClient([ctx.Queue()], [ctx.Queue()])
    t0 = time.time()
    with pytest.raises(SystemExit) as e:
        gen._watched(open_transfer, "gloo", client, Snapshot(lambda: []), 1)
    assert time.time() - t0 < 10
    # the one line the run ends with (an uncaught SystemExit prints its message, no traceback)
    said = str(e.value.code)
    assert "\n" not in said and "the generation process died (exit code 0): engine 0, device 0" in said


def _start_and_find(tmp_path, tiny_model):
    """A run whose engine has just been spawned (vLLM still starting: no push yet) -> (run, rank 0, engine)."""
    proc = launch(tmp_path, tiny_model, "--beta", "0", "--steps", "100000")
    rank_0 = psutil.Process(proc.pid)
    deadline, engine = time.time() + 240, None
    while engine is None:
        assert proc.poll() is None, open(proc.log).read()[-3000:]
        assert time.time() < deadline, "the engine never started"
        time.sleep(0.2)
        engine = engine_of(rank_0)
    metrics = tmp_path / "metrics.jsonl"
    assert not (metrics.exists() and metrics.read_text())   # no step yet
    return proc, engine.parent(), engine


def test_an_engine_killed_before_its_first_push_ends_the_run_in_one_line(tmp_path, tiny_model):
    proc, _, engine = _start_and_find(tmp_path, tiny_model)
    t0 = time.time()
    engine.send_signal(signal.SIGKILL)
    rc, out = finish(proc, timeout=120)
    assert time.time() - t0 < 60
    assert rc != 0 and "grpo_train.py: the generation process died (exit code -9): engine 0" in out
    assert "Traceback" not in out, out[-3000:]


def test_a_trainer_killed_before_its_first_push_leaves_no_engine(tmp_path, tiny_model):
    proc, rank0, engine = _start_and_find(tmp_path, tiny_model)
    rank0.send_signal(signal.SIGKILL)
    t0 = time.time()
    while running(engine):
        assert time.time() - t0 < 60, "the engine outlived its trainer by a minute"
        time.sleep(0.2)
    finish(proc, timeout=120)


def test_mistakes_of_the_config_file_and_the_logging_flags_are_one_line(tmp_path, capsys, monkeypatch):
    """--config: an unknown key (help among them: it printed the help and exited 0), a file that is not
    YAML, one that is not text (a UnicodeDecodeError traceback), a switch given a word; a float flag given
    nan or inf, on the command line or in the file (argparse takes them: --dist-timeout inf overflowed the
    rendezvous' timeout, --temperature inf failed in the generation process); --beta 0 with a --ref-url that
    it would ignore; --wandb or --tensorboard without their package (refused before anything starts, naming
    what to install); an empty data file. Each: one line, exit status 1."""
    from grpo_train import get_args
    from run_setup import load_prompts
    from demo.tiny_model import build_tokenizer
    (tmp_path / "typo.yaml").write_text("model: m/m\nlearning_rate: 1e-6\n")
    (tmp_path / "help.yaml").write_text("model: m/m\nhelp: true\n")
    (tmp_path / "broken.yaml").write_text("model: [m/m\n")
    (tmp_path / "switch.yaml").write_text("model: m/m\ngrad_ckpt: yes please\n")
    (tmp_path / "binary.yaml").write_bytes(b"model: m/m\n\xff\xfe")
    (tmp_path / "inf.yaml").write_text("model: m/m\nlr: .inf\n")
    (tmp_path / "empty.jsonl").write_text("")
    monkeypatch.setitem(sys.modules, "wandb", None)   # as if not installed: find_spec says None
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    cases = [(["--config", str(tmp_path / "typo.yaml")], "--config .*typo.yaml: unknown key 'learning_rate' "
              r"\(the keys are the flags' names: --help lists them"),
             (["--config", str(tmp_path / "help.yaml")], "--config .*help.yaml: unknown key 'help'"),
             (["--config", str(tmp_path / "broken.yaml")], r"--config .*broken.yaml: not YAML \(line 2, column 1\)"),
             (["--config", str(tmp_path / "switch.yaml")], "--config .*switch.yaml: grad_ckpt: true or false"),
             (["--config", str(tmp_path / "binary.yaml")],
              r"--config .*binary.yaml: not a text file \(byte 11 is not UTF-8\)$"),
             (["--config", str(tmp_path / "inf.yaml")], "--lr must be a finite number$"),
             (["--model", "m/m", "--temperature", "inf", "--dist-timeout", "nan", "--is-max", "inf"],
              "--temperature, --is-max, --dist-timeout must be a finite number$"),
             (["--model", "m/m", "--beta", "0", "--ref-url", "http://127.0.0.1:9"],
              "--ref-url names reference servers, but --beta 0 trains without a reference"),
             (["--model", "m/m", "--wandb"], r"--wandb needs the wandb package, which is not installed: pip "
              r"install -r requirements.txt \(or requirements-cpu.txt\) installs it, or pip install wandb==0.31.0"),
             (["--model", "m/m", "--tensorboard"], "--tensorboard needs the tensorboard package")]
    for argv, expected in cases:
        with pytest.raises(SystemExit) as e:
            get_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 1 and err.count("\n") == 1 and re.match("grpo_train.py: " + expected, err), err
    with pytest.raises(SystemExit):
        load_prompts(build_tokenizer(), task="custom", data=str(tmp_path / "empty.jsonl"), seed=0,
                     max_prompt_len=16, eval_size=200, prompt_key="prompt", answer_key="answer",
                     chat_template="none")
    err = capsys.readouterr().err
    assert err == f"grpo_train.py: --data {tmp_path / 'empty.jsonl'}: no records (an empty file)\n", err
    # the pins the refusals name are the ones the requirements files install
    from run_config import PACKAGES
    for name in ("requirements.txt", "requirements-cpu.txt"):
        lines = open(os.path.join(ROOT, name)).read().splitlines()
        assert all(pin in lines for _, pin in PACKAGES.values()), name


def test_a_port_held_for_the_rendezvous_is_no_one_elses_and_rank_0_listens_on_it(monkeypatch):
    """demo/run_demo.py and bench/gpu_check.py hold the launcher's --master_port from the moment they choose
    it (placement.held_port) until the run ends, where a port chosen free and released could be given to
    another process before rank 0 binds it, seconds later. While held, no other socket can bind it, and
    rank 0's rendezvous server (placement.master_store) binds and listens on it beside the held socket."""
    import socket
    import torch.distributed as dist
    from placement import held_port, master_store
    hold, port = held_port()
    with hold:
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port)}.items():
            monkeypatch.setenv(name, value)
        store = master_store(datetime.timedelta(seconds=30))
        assert store is not None
        client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))
        client.set("rank 1", "here")
        assert store.get("rank 1") == b"here"


def test_a_port_another_run_holds_is_one_line_naming_master_port(tmp_path, tiny_model):
    """The ranks meet on the launcher's --master_port (default 29500): a second run on one machine found it
    taken and printed 35 lines (DistNetworkError ... EADDRINUSE). Rank 0, as the launcher starts it, with
    its port held by another process: one line naming --master_port, exit status 1."""
    import socket
    with socket.socket() as taken:
        taken.bind(("", 0))   # a port of this test's, held
        taken.listen()
        port = taken.getsockname()[1]
        cmd, env = rank_zero("--model", tiny_model, "--out-dir", str(tmp_path), port=port)
        p = subprocess.run(cmd, cwd=ROOT, env={**env, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True,
                           timeout=300)
    lines, _ = said(p.stdout + p.stderr)
    assert p.returncode == 1 and "Traceback" not in p.stderr and len(lines) == 1, p.stdout + p.stderr
    assert re.fullmatch(rf"grpo_train.py: port {port} on 127.0.0.1, where the ranks meet, is taken \(another run "
                        r"on this machine\?\): give this run another with the launcher's --master_port, e\.g\. "
                        r"deepspeed --master_port \d+ \.\.\.", lines[0]), lines
