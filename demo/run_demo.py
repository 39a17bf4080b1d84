"""The offline demo: the whole architecture for real, on a tiny model, on a 2-core CPU with no internet.

1. build a tiny Qwen2 model locally and warm-start it on the demo task (format right, answers mostly wrong),
2. (with --ref-servers 2+: start them on loopback and, at the same time) 3. run grpo_train.py through the
deepspeed launcher, one launch: rank 0 starts the reference server and the vLLM generation process,
4. print held-out accuracy before -> after (the trainer plots the metrics as it goes).

    python -m demo.run_demo [--steps N] [--world-size 2] [-- extra grpo_train.py flags]
"""
import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time

import psutil
import torch

from placement import alive, held_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The demo's GRPO settings (passed to grpo_train.py; anything after `--` on our command line overrides them).
TRAIN_FLAGS = ["--task", "demo", "--rewards", "demo", "--lr", "3e-4", "--beta", "0.04",
               "--prompts-per-step", "16", "--group-size", "8", "--max-new-tokens", "12",
               "--max-prompt-len", "16", "--temperature", "1.0", "--micro-batch", "64", "--eval-size", "200"]
# What ends the demo: Ctrl-C, SIGTERM, and SIGHUP (its terminal closed; left ignored under nohup). Each stops
# every process it started.
STOPS = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN
                                           else [])
# deepspeed's launcher, started with Ctrl-C ignored (as nohup starts a command with SIGHUP ignored), which the
# processes it starts inherit: its runner (bin/deepspeed) never takes one, where it printed a KeyboardInterrupt
# traceback (deepspeed 0.19.8, runner.py); its launch.py takes one once it has started the ranks (and passes
# it on to them as SIGTERM), and each rank once in its loop (checkpoints.StopAfterStep)
IGNORING_CTRL_C = ["sh", "-c", 'trap "" INT; exec "$0" "$@"']


def group_ended(group, timeout):
    """Wait until no process of process group `group` runs (an ended one its parent has not collected yet
    counts as ended), at most `timeout` seconds -> whether none does."""
    def running(p):
        with contextlib.suppress(ProcessLookupError):   # it ended while we looked
            return os.getpgid(p.pid) == group and alive(p)
    deadline = time.time() + timeout
    while any(running(p) for p in psutil.process_iter()):
        if time.time() > deadline:
            return False
        time.sleep(0.2)
    return True


def catches(pid, signum):
    """Whether process `pid` has a handler of its own for signal `signum` (Linux: SigCgt of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(line.split()[1] for line in f if line.startswith("SigCgt:"))
    return bool(int(caught, 16) >> (signum - 1) & 1)


def pass_on(run, again):
    """Pass a stop of the demo's on to the launch `run` (the launcher, in a process group of its own): as a
    Ctrl-C once its launch.py takes one, as a terminal passes one to a launch by hand (docs/checkpoints.md: the
    ranks finish the step, save it and print the line that continues the run; a second stops them at once,
    where a second SIGTERM would not: a rank's second may be the launcher's own).
    Before that no rank has reached its loop, so there is nothing to save: SIGTERM (SIGKILL for a second stop),
    which ends each process of the group where it is, the launcher's own start-up included."""
    try:
        launch = [p for p in psutil.Process(run.pid).children() if "deepspeed.launcher.launch" in p.cmdline()]
        heard = any(catches(p.pid, signal.SIGINT) for p in launch)
    except (psutil.Error, OSError):   # it ended while we looked
        heard = False
    with contextlib.suppress(ProcessLookupError):   # the run has ended
        os.killpg(run.pid, signal.SIGINT if heard else signal.SIGKILL if again else signal.SIGTERM)


def given(extra, flag):
    """The value of `flag` that grpo_train.py gets from the flags after `--` (the last one wins, as
    TRAIN_FLAGS' goes before them, and before a --config file's), or None where they give none."""
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    p.add_argument(flag)
    # a flag without its value is grpo_train.py's to refuse, in its own words
    with contextlib.suppress(argparse.ArgumentError):
        return getattr(p.parse_known_args(extra)[0], flag[2:].replace("-", "_"))
    return None


def given_beta(extra):
    """The --beta given after `--`, or None where none is (or not a number)."""
    with contextlib.suppress(TypeError, ValueError):
        return float(given(extra, "--beta"))
    return None


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="runs/demo", help="model, metrics.jsonl and plot go here")
    p.add_argument("--steps", type=int, default=60, help="GRPO optimizer steps")
    p.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every N steps")
    p.add_argument("--world-size", type=int, default=1, help="training processes (deepspeed --num_gpus)")
    p.add_argument("--model", default=None, help="folder of a warm-started model to use instead of building one")
    p.add_argument("--seed", type=int, default=0, help="seed for the model, warm start and run")
    p.add_argument("--ref-servers", type=int, default=1,
                   help="reference servers (each on a port of its own; the batch is split across them)")
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if a.world_size < 1:
        raise SystemExit(f"run_demo: --world-size {a.world_size}: the demo needs 1 or more training processes")
    if a.model and not os.path.isfile(os.path.join(a.model, "config.json")):
        raise SystemExit(f"run_demo: --model {a.model} holds no model (no config.json; without --model the demo "
                         f"builds one)")
    if a.ref_servers > 1 and given_beta(extra) == 0:
        raise SystemExit(f"run_demo: --ref-servers {a.ref_servers} starts reference servers, but --beta 0 trains "
                         f"without a reference: drop --ref-servers, or give --beta > 0")
    # the demo reads the metrics where it told the trainer to write them
    if given(extra, "--out-dir") is not None:
        raise SystemExit(f"run_demo: --out-dir after `--` would move the trainer's folder away "
                         f"from the demo's own ({a.out_dir}): give --out-dir before `--`")
    t_start = time.time()
    # until the launch, SIGTERM and SIGHUP end the demo the way Ctrl-C does, by raising, so the `finally`s
    # below stop what it started
    for sig in STOPS[1:]:
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    # Ctrl-C raises here, and the model's build and the reference servers started below take its default
    # action, even where this one was started with it ignored (a background job of a shell script)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    out = os.path.abspath(a.out_dir)
    model_dir = a.model or os.path.join(out, "model")
    try:
        os.makedirs(out, exist_ok=True)
    except FileExistsError:
        raise SystemExit(f"run_demo: --out-dir {a.out_dir} is a file, not a folder") from None
    except OSError as e:
        raise SystemExit(f"run_demo: --out-dir {a.out_dir}: {e.strerror}") from None
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           # the bars of loading and saving the model would only cut into the step lines
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    if not torch.cuda.is_available():
        # DeepSpeed warns, in each of its 3 processes, that it found no GPU and uses the CPU: what we expect
        env.setdefault("DS_ACCELERATOR", "cpu")

    # 1. the tiny model, warm-started
    if not a.model:
        subprocess.run([sys.executable, "-m", "demo.tiny_model", "--out", model_dir, "--seed", str(a.seed)],
                       cwd=ROOT, env=env, check=True)

    # 2. the reference server: one (the default) rank 0 starts itself, as it starts vLLM (loopback, a token
    # of its own, the run's folder for --ref-sync-every); several are started here, on loopback (one thread
    # each: the two cores belong to the trainer and vLLM) with a token only this run knows. 3. GRPO through
    # the deepspeed launcher, started at the same time: the trainer waits for the servers (--ref-wait), so
    # their start-ups overlap. The launcher gets a process group of its own: deepspeed's runner does not
    # pass signals on, so the group gets them.
    # Their ports and the launcher's are held from now to the end (placement.held_port): the servers and the
    # trainer's rendezvous bind them seconds from now, once their imports are done.
    holds = [held_port() for _ in range(a.ref_servers if a.ref_servers > 1 else 0)] + [held_port()]
    *server_ports, master_port = [port for _, port in holds]
    urls = [f"http://127.0.0.1:{port}" for port in server_ports]
    env["REF_SERVER_TOKEN"] = secrets.token_hex(16)
    # the demo rebuilds its model, so the previous demo's run in --out-dir is replaced unless resumed
    fresh = [] if "--resume" in extra else ["--overwrite"]
    servers, run, stopped = [], None, []
    # from here on a stop is only recorded, and the loops below pass it on: one that comes at any moment,
    # a server's start or the launch's own included, reaches what was started
    for sig in STOPS:
        signal.signal(sig, lambda signum, frame: stopped.append(signum))
    try:
        for url in urls:
            servers.append(subprocess.Popen([sys.executable, "ref_server.py", "--model", model_dir, "--port",
                                             url.rsplit(":", 1)[1], "--threads", "1", "--checkpoint-dir", out],
                                            cwd=ROOT, env=env))
        if stopped:
            raise SystemExit(128 + stopped[0])
        deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
        # the launcher at --log_level critical, as README.md launches: its lines (its environment, each rank's
        # command, "no hostfile", the exit report after a rank's one-line error) are for debugging the
        # launcher; a failed run still ends in this script's line with its exit code
        run = subprocess.Popen([*IGNORING_CTRL_C, deepspeed, "--log_level", "critical",
                                "--num_gpus", str(a.world_size), "--master_port", str(master_port),
                                "grpo_train.py", "--model", model_dir, "--out-dir", out,
                                *(["--ref-url", ",".join(urls)] if urls else []),
                                "--steps", str(a.steps), "--eval-every", str(a.eval_every), "--seed", str(a.seed),
                                *TRAIN_FLAGS, *fresh, *extra], cwd=ROOT, env=env, start_new_session=True)
        # a server that dies stops the run now, not after --ref-wait (once stopping, the servers in this
        # process's group may end at the same signal)
        while run.poll() is None and not stopped:
            for server in servers:
                if server.poll() is not None and not stopped:
                    raise SystemExit(f"run_demo: ref_server.py exited with code {server.returncode} (its error "
                                     f"is above)")
            time.sleep(0.2)
        # the ranks save after a stop: wait for the launcher's whole group, from the signal on, passing each
        # stop on as it comes (a second stops the ranks at once)
        passed, deadline = 0, time.time() + 90
        while passed < len(stopped) or stopped and not group_ended(run.pid, timeout=0.2):
            if passed < len(stopped):
                pass_on(run, again=passed > 0)
                passed += 1
            elif time.time() > deadline:
                with contextlib.suppress(ProcessLookupError):   # it ended meanwhile
                    os.killpg(run.pid, signal.SIGKILL)
                break
        if stopped:
            raise SystemExit(128 + stopped[0])
        if run.returncode != 0:
            raise SystemExit(f"run_demo: grpo_train.py failed (exit code {run.returncode})")
    finally:
        if run is not None and not group_ended(run.pid, timeout=0):
            with contextlib.suppress(ProcessLookupError):   # it ended meanwhile
                os.killpg(run.pid, signal.SIGTERM)
            if not group_ended(run.pid, timeout=60):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.pid, signal.SIGKILL)
        for server in servers:
            server.terminate()
            server.wait(timeout=30)
        for hold, _ in holds:
            hold.close()

    # 4. before -> after, and the plot the trainer drew
    with open(os.path.join(out, "metrics.jsonl")) as f:
        evals = [r["eval/accuracy"] for r in map(json.loads, f) if "eval/accuracy" in r]
    print(f"plot: {os.path.join(out, 'metrics.png')}; wall time {time.time() - t_start:.0f} s")
    print(f"held-out accuracy: {100 * evals[0]:.1f}% -> {100 * evals[-1]:.1f}%")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:   # Ctrl-C before the launch (the model's build): nothing to save
        sys.exit(128 + signal.SIGINT)
