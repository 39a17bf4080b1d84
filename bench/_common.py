"""Helpers shared by bench/generation.py, ref_overhead.py, weight_sync.py, overlap.py, gpu_bench.py,
gpu_check.py, trl_compare.py and the scripts that start processes or empty an --out-dir."""
import contextlib
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DEMO_MODEL = os.path.join(ROOT, "runs", "bench", "demo_model")
# in an --out-dir a bench script made: only such a folder (or an empty one) is emptied for a new run
OUT_DIR_MARK = ".bench-out-dir"
# a bigger random model for "not all overhead" measurements: Qwen2 shape, 4 layers of width 1024, head size 64
BIG = dict(hidden=1024, layers=4, heads=16)
# how long a run stopped by run_to_end has to end before it is killed: demo/run_demo.py gives the launcher's
# group 90 s after a stop (the ranks finish the step and save it), then each of its reference servers 30 s
STOP_WAIT = 150


def demo_model(path=None):
    """The demo's warm-started model (built once into runs/bench/demo_model, ~50 s), or `path` as given."""
    if path:
        return path
    if not os.path.exists(os.path.join(DEMO_MODEL, "config.json")):
        subprocess.run([sys.executable, "-m", "demo.tiny_model", "--out", DEMO_MODEL], cwd=ROOT, check=True)
    return DEMO_MODEL


def model_given(path, script):
    """--model `path` if it holds a model (its config.json), else one line: the demo's is built by make demo."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SystemExit(f"{script}: --model {path} holds no model (make demo builds runs/demo/model)")
    return path


def count(text):
    """argparse type of a bench script's counts (--reps, --steps, --seqs, --threads): "3" -> 3. Below 1 is
    argparse's one line naming the flag, where it was a traceback or a table of zeros."""
    if int(text) < 1:
        raise ValueError(text)
    return int(text)


def random_config(hidden, layers, heads, kv_heads=None, intermediate=None, vocab=None, max_len=4096):
    """A Qwen2 config (tied embeddings); vocab defaults to the demo's character tokenizer's."""
    from transformers import Qwen2Config
    from demo.tiny_model import build_tokenizer
    tok = build_tokenizer()
    return Qwen2Config(vocab_size=vocab or len(tok), hidden_size=hidden, intermediate_size=intermediate or 4 * hidden,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
                       max_position_embeddings=max_len, tie_word_embeddings=True, bos_token_id=None,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id), tok


def random_model(out, dtype="float32", seed=0, **shape):
    """Save a randomly initialised Qwen2 model of `shape` (random_config's arguments) with the char tokenizer."""
    import torch
    from transformers import Qwen2ForCausalLM
    config, tok = random_config(**shape)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def n_params(model):
    return sum(p.numel() for p in model.parameters())   # tied embeddings count once


def stop_at_random_lengths(path, eos_id, pad_id, vocab, max_new_tokens):
    """Save a generation config in `path` whose extra stop tokens (the vocabulary's last 2 * vocab /
    max_new_tokens ids) end a random model's completions at random lengths, about half the limit on average."""
    from transformers import GenerationConfig
    n_stop = 2 * vocab // max_new_tokens
    GenerationConfig(eos_token_id=[eos_id] + list(range(vocab - n_stop, vocab)),
                     pad_token_id=pad_id).save_pretrained(path)


def timed(fn, reps):
    """-> (median seconds over `reps` calls of fn(), the last result)."""
    times, out = [], None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def machine():
    import torch
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {gpu}; torch {torch.__version__}, Python {platform.python_version()}"


def print_table(headers, rows):
    """A markdown table (pasteable into bench/README.md)."""
    cells = [[str(h) for h in headers]] + [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    print(line(cells[0]))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells[1:]:
        print(line(r))


def end_on_stops():
    """SIGTERM and SIGHUP (`timeout`, `kill`, a closed terminal or ssh session) end the script as
    Ctrl-C does, by raising, so that its `finally`s stop what it started (as demo/run_demo.py does);
    one left ignored (SIGHUP under nohup) stays ignored. A Ctrl-C then ends it in one line, not in a
    traceback, and still as a Ctrl-C does (exit status 130 in a shell)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) != signal.SIG_IGN:
            signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))

    def one_line(kind, value, tb):
        if issubclass(kind, KeyboardInterrupt):
            print(f"{os.path.basename(sys.argv[0])}: stopped (Ctrl-C)", file=sys.stderr)
        else:
            sys.__excepthook__(kind, value, tb)
    sys.excepthook = one_line


def run_to_end(cmd, log, script, what, stamp=None, **popen_kw):
    """Run `cmd` (demo/run_demo.py, the deepspeed launcher, a script's own child) until it ends, its stdout
    and stderr into the file `log`, each line prefixed with the seconds since `stamp` (a time.time()) as it
    comes, where given. An exit code other than 0 is one line naming `script`, `what` (e.g. "the demo run")
    and the log.
    The run gets a session of its own, so a terminal's Ctrl-C reaches this script alone: anything that ends
    the wait (Ctrl-C; SIGTERM or SIGHUP after end_on_stops; an error) stops the run (stop_run), and the
    exception goes on."""
    copy = None
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f if stamp is None else subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, **popen_kw)
        try:
            if stamp is not None:   # a thread of its own, so the lines of a run that is stopping still come
                copy = threading.Thread(target=stamped, args=(proc.stdout, f, stamp), daemon=True)
                copy.start()
            proc.wait()
        except BaseException:
            stop_run(proc)
            raise
        finally:
            if copy is not None:
                copy.join(timeout=10)   # the last lines; a process still holding the pipe is not waited for
    if proc.returncode:
        raise SystemExit(f"{script}: {what} failed (exit code {proc.returncode}); its log: {log}")


def stop_run(proc):
    """Stop Popen `proc`, started in a session of its own (demo/run_demo.py, the deepspeed launcher): SIGTERM to
    its process group, which both take as a stop of everything they started; a second stop here is passed on
    too (run_demo: stop at once). Waited for until no process of that group runs (the deepspeed runner dies
    at SIGTERM, and its launch.py stops the ranks after it), STOP_WAIT seconds at most; then all of them are
    killed, with every process under `proc` and the process groups they lead (the launcher's)."""
    deadline, asked = time.time() + STOP_WAIT, False
    while proc.poll() is None or left_in_group(proc.pid):
        try:
            if not asked:
                with contextlib.suppress(ProcessLookupError):   # all ended meanwhile
                    os.killpg(proc.pid, signal.SIGTERM)
                asked = True
            if time.time() > deadline:
                kill_all_under(proc)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                return
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.2)
        except BaseException:   # a second stop, passed on
            asked = False


def left_in_group(pgid):
    """The processes of group `pgid` still running (a zombie waiting to be reaped is not)."""
    import psutil
    left = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):   # it ended while we looked
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
    return left


def stamped(pipe, f, stamp):
    """Each line from `pipe` into the file `f`, prefixed with the seconds since `stamp`, until the pipe ends
    (or `f` is closed)."""
    with contextlib.suppress(ValueError):   # f closed
        for raw in pipe:
            f.write(f"[{time.time() - stamp:7.2f}s] {raw.decode(errors='replace').rstrip()}\n")


def kill_all_under(proc):
    """SIGKILL to Popen `proc`, every process under it and every process group one of them leads; then
    collect it."""
    import psutil
    with contextlib.suppress(psutil.Error):   # it ended meanwhile
        top = psutil.Process(proc.pid)
        under = [top, *top.children(recursive=True)]
        for p in under:
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(p.pid) == p.pid:
                    os.killpg(p.pid, signal.SIGKILL)
        for p in under:
            with contextlib.suppress(psutil.Error):
                p.kill()
    proc.wait()


def fresh_out_dir(given, script, keep=()):
    """A script's --out-dir, made or emptied for a fresh run -> its absolute path. Only a
    folder a bench script made (it holds OUT_DIR_MARK) or an empty one is emptied: anything else
    (`--out-dir .`, the repository; runs/demo, the demo's model) is refused in one line, as is an
    --out-dir holding a path in `keep` (the --model the run reads)."""
    out = os.path.abspath(given)
    for path in keep:
        real, folder = os.path.realpath(path), os.path.realpath(out)
        if real == folder or real.startswith(folder + os.sep):
            raise SystemExit(f"{script}: --out-dir {given} holds {path}, which the run reads: give "
                             f"another --out-dir")
    if os.path.islink(out) or os.path.lexists(out) and not os.path.isdir(out):
        what = "a symlink" if os.path.islink(out) else "a file"
        raise SystemExit(f"{script}: --out-dir {given} is {what}, not a folder")
    if os.path.isdir(out) and os.listdir(out):
        if not os.path.exists(os.path.join(out, OUT_DIR_MARK)):
            raise SystemExit(f"{script}: --out-dir {given} holds files no bench script wrote, and "
                             f"a run empties its --out-dir: give a new or empty folder")
        shutil.rmtree(out)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, OUT_DIR_MARK), "w") as f:
        f.write(f"made by {script}: a bench script's next run here empties this folder\n")
    return out
