"""The benchmarks stay runnable: the GPU check's tiny CPU mode end to end (gpu_bench.py with real vLLM and
real DeepSpeed, then a short GRPO run), the MFU formula's arithmetic, the overlap report's arithmetic on a
metrics file whose answer is known, the padding count on GSM8K lengths, the step-time model's arithmetic,
every bench and tools script's --help, printed before torch is imported, and a bench script stopped with
Ctrl-C stopping the demo run it started."""
import contextlib
import json
import os
import re
import runpy
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
SCRIPTS = sorted(f for f in os.listdir(BENCH) if f.endswith(".py") and not f.startswith("_"))
TOOLS = sorted(f for f in os.listdir(os.path.join(ROOT, "tools")) if f.endswith(".py"))


def run(*args, timeout=900):   # gpu_bench.py sets TORCH_EXTENSIONS_DIR for its children; the trainer its own
    p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def table_rows(out):
    """The data rows of the markdown table a bench prints last, as lists of cells."""
    lines = [line for line in out.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


@pytest.mark.parametrize("script", [f"bench/{s}" for s in SCRIPTS] + [f"tools/{s}" for s in TOOLS])
def test_every_script_prints_its_help_before_importing_torch(script):
    """`--help` at once: torch, vLLM and DeepSpeed (seconds to import) come after the parse. Five bench scripts
    imported torch or deepspeed first; tools/script_figures.py read --help as a file's name (a traceback)."""
    p = subprocess.run([sys.executable, "-X", "importtime", script, "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and "usage: " + os.path.basename(script) in p.stdout, p.stderr[-3000:]
    # -X importtime writes a line per module imported, its name last
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in p.stderr.splitlines()
                if line.startswith("import time:")}
    assert not imported & {"torch", "vllm", "deepspeed"}, sorted(imported & {"torch", "vllm", "deepspeed"})


@pytest.mark.parametrize("script", [s for s in SCRIPTS if "type=count" in open(os.path.join(BENCH, s)).read()])
def test_every_count_flag_at_zero_is_refused_before_anything_runs(script):
    """A count flag of each bench script that has them (type=count: --reps, --steps, --seqs, --threads, ...)
    at 0 is argparse's line naming it, before anything runs. `reward_workers.py --reps 0` was a KeyError,
    `padding.py --steps 0` an UnboundLocalError, `step_model.py --seqs 0` a table of zeros."""
    flags = re.findall(r'add_argument\("(--[\w-]+)", type=count', open(os.path.join(BENCH, script)).read())
    p = subprocess.run([sys.executable, f"bench/{script}", flags[-1], "0"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.splitlines()[-1] == \
        f"{script}: error: argument {flags[-1]}: invalid count value: '0'", p.stderr[-3000:]


def test_gpu_check_tiny_mode_runs_on_cpu(tmp_path):
    """The GPU check end to end on CPU: gpu_bench.py's tiny mode (real vLLM, real DeepSpeed), then 3 GRPO
    steps with ref_server.py and the deepspeed launcher, whose metrics the check reads. Its task is countdown:
    the run is also countdown's end-to-end test (chat-template prompts, its reward and the format reward, the
    held-out evaluation; a random model scores about 0, so this proves the plumbing, not learning)."""
    out = run("bench/gpu_check.py", "--tiny", "--grad-ckpt", "--out-dir", str(tmp_path))
    # the trainer is launched with gradient checkpointing, as docs/gpu.md advises for 1.5B on one 80 GB GPU
    assert re.search(r"^gpu_check: \S*deepspeed .* grpo_train\.py .* --grad-ckpt", out, re.M)
    (row,) = table_rows(out)
    model, params, body, gen_tok_s, ours_tok_s, ours_pct, train_tok_s, tflops, mfu, gen_peak, train_peak = row
    assert model == "tiny" and float(params) == 0.1   # 1,024 x 64 embedding (tied) + two small layers
    assert float(body) == 0.1   # the two layers and the final norm: 82,624 parameters
    ours, gen = float(ours_tok_s), float(gen_tok_s)
    # the table rounds each to 0.05: the ratio of the rounded values can be off by this much, plus the 0.05
    # of the percentage's own rounding
    assert float(ours_pct) == pytest.approx(100 * ours / gen, abs=5 * (1 / gen + ours / gen**2) + 0.05)
    assert min(map(float, (gen_tok_s, ours_tok_s, train_tok_s, tflops, mfu))) > 0
    assert float(gen_peak) > 100 and float(train_peak) > 100   # MiB: a process with torch loaded
    assert re.search(r"gpu_check phases \(mean of steps 2\.\.3\): step \S+ s = time/wait_s \S+ \+ "
                     r"time/train_s \S+ \+ time/sync_s \S+; push share \S+%; engine: time/gen_s", out)
    assert re.search(r"gpu_check OK: 3 steps; sync/logp_diff max \S+ \(tol 0\.1\)", out)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["grad_norm"] > 0 for r in rows)   # the length-dependent reward gave some group a signal
    assert all("reward/countdown" in r and "reward/format" in r and r["reward/errors"] == 0 for r in rows)
    assert rows[-1]["eval/step"] == 3 and 0 <= rows[-1]["eval/accuracy"] <= 1


def test_train_flops_counts_the_lm_head_on_completion_tokens_only(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    from gpu_bench import body_params, train_flops
    # 6 x (body x all tokens + lm_head on completion tokens), per sequence: 6 x (100 x 9 + 2 x 10 x 5) = 6,000
    assert train_flops(100, 2, 10, seqs=3, prompt_len=4, new_tokens=5) == 3 * 6000
    # a prompt token adds the body's 6 x 100 FLOPs per sequence, and no lm_head FLOPs
    assert train_flops(100, 2, 10, 3, 5, 5) - train_flops(100, 2, 10, 3, 4, 5) == 3 * 600
    from transformers import Qwen2Config, Qwen2ForCausalLM
    for tied in (True, False):   # neither the embedding nor an untied lm_head counts as body
        config = Qwen2Config(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied)
        model = Qwen2ForCausalLM(config)
        total = sum(p.numel() for p in model.parameters())
        assert body_params(model) == total - (1 if tied else 2) * 1000 * 32


def test_overlap_report_from_a_known_metrics_file(tmp_path):
    # 4 steps of 1 s each after a 10 s first step; the trainer waits 9 s in step 1, then 0.25 s per step
    rows = [{"step": 1, "time/elapsed_s": 10.0, "time/wait_s": 9.0, "time/gen_idle_s": 0.0,
             "eval/accuracy": 0.3}]
    rows += [{"step": s, "time/elapsed_s": 10.0 + s - 1, "time/wait_s": 0.25, "time/gen_idle_s": 0.5}
             for s in range(2, 6)]
    for r in rows:
        r.update({"loss": 0.0, "time/gen_s": 0.5, "time/ref_s": 0.2, "time/train_s": 0.5, "time/sync_s": 0.05})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = run("bench/overlap.py", "--metrics", str(path), timeout=120)
    table = {r[0]: r[1:] for r in table_rows(out)}
    assert table["all steps (start-up included)"] == ["5", "14.0", "10.0", "71.4%", "2.00", "14.3%"]
    assert table["steady (step 2 on)"] == ["4", "4.0", "1.0", "25.0%", "2.00", "50.0%"]
    assert re.search(r"step 1\.000", out)


def test_trl_compare_uses_the_demo_settings(monkeypatch):
    """The TRL comparison copies the demo's GRPO settings; it refuses to run if the demo's flags moved on."""
    monkeypatch.syspath_prepend(BENCH)
    from trl_compare import check_our_flags
    check_our_flags()


GSM8K = os.path.join(ROOT, "..", "shared", "data", "gsm8k")


def test_padding_bench_counts_less_padding_longest_first():
    """bench/padding.py on real GSM8K lengths, tiny: 3 batches; the grouped cut pads less at 1 and 2 ranks,
    over the same real tokens."""
    if not os.path.isdir(GSM8K):
        pytest.skip("the GSM8K files are not on this machine")
    out = run("bench/padding.py", "--data", GSM8K, "--steps", "3", "--ranks", "1", "2", timeout=300)
    rows = table_rows(out)
    assert [(r[0], r[1]) for r in rows] == [("1", "in order (before)"), ("1", "longest first (after)"),
                                            ("2", "in order (before)"), ("2", "longest first (after)")]
    for before, after in (rows[0:2], rows[2:4]):
        assert before[2] == after[2] and before[3] == after[3]   # micro-batches per rank, real tokens
        assert float(after[4].rstrip("%")) < float(before[4].rstrip("%"))


def test_padding_bench_data_mistakes_are_one_line(tmp_path):
    """--data is required (its default was a folder of the machine it was written on), and may be GSM8K's
    folder or its training file; a place without a training split, or a file of other records, is one
    line naming it (a record without 'question' was a KeyError)."""
    (tmp_path / "sums.jsonl").write_text('{"prompt": "37+5=", "answer": "42"}\n')
    p = subprocess.run([sys.executable, "bench/padding.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.splitlines()[-1].endswith("the following arguments are required: --data")
    assert refusal("bench/padding.py", "--data", str(tmp_path / "nope")) == \
        f"padding.py: --data {tmp_path / 'nope'}: no such file or folder"
    assert refusal("bench/padding.py", "--data", str(tmp_path)).startswith(f"padding.py: --data {tmp_path}: no train split")
    assert refusal("bench/padding.py", "--data", str(tmp_path / "sums.jsonl"), "--steps", "1") == \
        f"padding.py: {tmp_path / 'sums.jsonl'}:1: a GSM8K record needs a 'question' and an 'answer' (text)"


def test_step_model_arithmetic_on_known_figures():
    """bench/step_model.py on round figures: 4 GPUs, 1000 tokens a step (500 generated), 1 reference server.
    1 engine: gen 5 s + push 1 s is the longest stage; 2 engines: the reference's 5 s is, and on main's
    path (ref + train + push on the trainer) the step is 8 s."""
    out = run("bench/step_model.py", "--gpus", "4", "--engines", "1", "2", "--seqs", "10",
              "--prompt-len", "50", "--completion-len", "50", "--gen-tok-s", "100", "--train-tok-s", "500",
              "--ref-tok-s", "200", "--push-gb-s", "3.09", timeout=120)
    assert table_rows(out) == [["1", "2", "5.00", "5.00", "1.00", "1.000", "7.00", "6.00", "generation"],
                               ["2", "1", "2.50", "5.00", "2.00", "1.000", "8.00", "5.00", "reference"]]
    # the recipe's defaults: 6, 5 and 4 training ranks beside 1, 2 and 3 engines and one reference server
    assert [r[:2] for r in table_rows(run("bench/step_model.py", timeout=120))] == [["1", "6"], ["2", "5"],
                                                                                  ["3", "4"]]


def refusal(*args):
    """A bench script's one-line refusal of a mistake in its flags -> that line."""
    p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1 and p.stdout == "" and p.stderr.count("\n") == 1, \
        p.stdout + p.stderr[-3000:]
    return p.stderr.strip()


def test_an_out_dir_is_emptied_only_where_a_bench_script_made_it(tmp_path):
    """overhead.py, profile_step.py and gpu_check.py start afresh in their --out-dir: they empty a
    folder one of them made, and refuse any other that holds files (`--out-dir .` was `rm -rf` of
    the repository), a file, and a folder holding the --model the run reads."""
    # run, not imported: a later test's import of _common must still put the root before bench/,
    # whose generation.py would hide the trainer's
    fresh_out_dir = runpy.run_path(os.path.join(BENCH, "_common.py"))["fresh_out_dir"]
    out = tmp_path / "out"
    assert fresh_out_dir(str(out), "bench") == str(out)
    (out / "old.log").write_text("a previous run's")
    fresh_out_dir(str(out), "bench")
    assert os.listdir(out) == [".bench-out-dir"]
    (tmp_path / "mine.txt").write_text("not a bench script's")
    model = tmp_path / "model"
    model.mkdir()
    for given, keep, said in ((tmp_path, [], "holds files no bench script wrote"),
                              (tmp_path / "mine.txt", [], "is a file, not a folder"),
                              (tmp_path, [str(model)], f"holds {model}, which the run reads")):
        with pytest.raises(SystemExit, match=re.escape(f"bench: --out-dir {given} {said}")):
            fresh_out_dir(str(given), "bench", keep=keep)
    assert (tmp_path / "mine.txt").read_text() == "not a bench script's"
    (model / "config.json").write_text("{}")
    assert refusal("bench/overhead.py", "--model", str(model), "--out-dir", str(tmp_path)) == (
        f"overhead.py: --out-dir {tmp_path} holds {model}, which the run reads: give another "
        f"--out-dir")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "notes.txt").write_text("")
    said = refusal("bench/profile_step.py", "--model", str(model), "--out-dir",
                   str(tmp_path / "runs"))
    assert said == (f"profile_step.py: --out-dir {tmp_path / 'runs'} holds files no bench script "
                    f"wrote, and a run empties its --out-dir: give a new or empty folder")
    assert sorted(os.listdir(tmp_path)) == ["mine.txt", "model", "out", "runs"]
    assert os.listdir(tmp_path / "runs") == ["notes.txt"]


def test_bench_flags_that_cannot_work_are_one_line_before_anything_runs(tmp_path, monkeypatch):
    """A model gpu_bench.py has no config for (a KeyError after the models before it had run), no
    reference server or no training GPU in the step model and the memory table (ZeroDivisionError),
    generation.py's --model and weight_sync.py's --sizes, and trl_compare.py's --micro-batches, --size and
    --baseline, said before the TRL venv's install."""
    assert refusal("bench/gpu_bench.py", "--models", "qwen2.5-0.5b,qwen2.5-7b") == (
        "gpu_bench: --models qwen2.5-0.5b,qwen2.5-7b: no config named qwen2.5-7b (known: "
        "qwen2.5-0.5b, qwen2.5-1.5b, tiny)")
    assert refusal("bench/step_model.py", "--ref-servers", "0") == \
        "step_model.py: --ref-servers 0: the model needs 1 or more"
    assert refusal("bench/memory_table.py", "--gpus", "0", "2") == \
        "memory_table.py: --gpus 0 2: each must be 1 or more"
    # a folder without a model was transformers' traceback; an unknown size ran as the 100M model
    assert refusal("bench/generation.py", "--model", str(tmp_path)) == \
        f"generation.py: --model {tmp_path} holds no model (make demo builds runs/demo/model)"
    assert refusal("bench/weight_sync.py", "--sizes", "demo,7b") == \
        "weight_sync.py: --sizes demo,7b: no model named 7b (known: demo, 100m)"
    out = tmp_path / "trl_compare"
    divide = "must divide a step's 128 completions"
    for flags, said in ((["--micro-batches", "0"], f"--micro-batches 0: {divide}"),
                        (["--micro-batches", "3"], f"--micro-batches 3: {divide}"),
                        (["--size", "foo"], "--size foo: 'demo', or HIDDENxLAYERS"),
                        (["--size", "100x2"], "--size 100x2: 'demo', or HIDDENxLAYERS")):
        said_now = refusal("bench/trl_compare.py", "--out-dir", str(out), *flags)
        assert said_now.startswith(f"trl_compare.py: {said}"), said_now
    assert not out.exists()
    # in front for this test alone: bench/generation.py would hide the trainer's in later tests
    monkeypatch.syspath_prepend(BENCH)
    from trl_compare import export_commit
    with pytest.raises(SystemExit, match=r"--baseline no-such-commit: not a commit here \(git: "):
        export_commit("no-such-commit", str(tmp_path / "baseline"))
    assert os.listdir(tmp_path) == []


def test_trl_compare_time_to_target_counts_the_runs_that_missed_it(monkeypatch):
    """The median row's time to the target: a run that never reached it counts as later than any
    that did, so there is a median only where more than half the runs reached it (it was the median
    of those that did); a run with no evaluation (TRL at --eval-every 0) has no accuracy, where its
    row was an IndexError."""
    # in front for this test alone: bench/generation.py would hide the trainer's in later tests
    monkeypatch.syspath_prepend(BENCH)
    from trl_compare import last_accuracy, median_time_to
    assert median_time_to([3.0, 1.0, 2.0]) == 2.0
    assert median_time_to([3.0, None, 1.0]) == 3.0
    assert median_time_to([1.0, None, None]) is None
    assert median_time_to([1.0, 2.0, None, 4.0]) == 3.0
    assert median_time_to([1.0, 2.0, None, None]) is None
    assert last_accuracy({"evals": []}) is None
    assert last_accuracy({"evals": [{"eval/accuracy": 0.1}, {"eval/accuracy": 0.5}]}) == 0.5


def test_overlap_report_on_a_metrics_file_it_cannot_read_is_one_line(tmp_path):
    """A --metrics file that is not there (FileNotFoundError), an empty one (IndexError) and one
    step (ZeroDivisionError: the steady state starts at step 2)."""
    (tmp_path / "empty.jsonl").write_text("")
    row = {"step": 1, "loss": 0.0, "time/elapsed_s": 1.0, "time/wait_s": 0.5,
           "time/gen_idle_s": 0.0}
    (tmp_path / "one.jsonl").write_text(json.dumps(row) + "\n")
    for name, said in (("none.jsonl", ": No such file or directory"),
                       ("empty.jsonl", " holds 0 step line(s): it needs 2 or more"),
                       ("one.jsonl", " holds 1 step line(s): it needs 2 or more")):
        assert refusal("bench/overlap.py", "--metrics", str(tmp_path / name)) == \
            f"overlap.py: {tmp_path / name}{said}"


def test_ctrl_c_to_a_bench_script_alone_stops_the_demo_it_started(tmp_path, tiny_model):
    """Ctrl-C to overhead.py alone (`kill -INT`, not to its terminal's group) once its demo run has started
    the trainer: the script passes the stop on to demo/run_demo.py, which stops every process it started,
    the deepspeed launcher's session included, and the script exits in one line. subprocess.run SIGKILLed run_demo
    0.25 s after a Ctrl-C, before it had stopped anything, and the launch ran on."""
    import psutil
    from conftest import running, sigkill_group
    out = tmp_path / "out"
    log = open(tmp_path / "bench.log", "w")
    proc = subprocess.Popen([sys.executable, "bench/overhead.py", "--model", tiny_model, "--out-dir", str(out),
                             "--steps", "100000", "--warm-steps", "1"], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    groups = {proc.pid}   # the script's, and the group of each process under it (the launcher's session)

    def under_it():
        """The processes under the script, each with its command line (those that end meanwhile left out)."""
        found = []
        for p in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                found.append((p, " ".join(p.cmdline())))
        return found

    def left():
        found = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError):   # it ended while we looked
                if os.getpgid(p.pid) in groups and running(p):
                    found.append(" ".join(p.cmdline())[:100])
        return found
    try:
        deadline = time.time() + 300
        while not any("grpo_train.py --local_rank" in cmd and f" {out} " in cmd for _, cmd in under_it()):
            assert proc.poll() is None and time.time() < deadline, open(log.name).read()[-3000:]
            time.sleep(0.2)
        for p, _ in under_it():
            with contextlib.suppress(ProcessLookupError):
                groups.add(os.getpgid(p.pid))
        assert len(groups) >= 2   # the launcher runs in a session of its own
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == -signal.SIGINT, open(log.name).read()[-3000:]
        deadline = time.time() + 60
        while (running_now := left()) and time.time() < deadline:
            time.sleep(0.5)
        assert not running_now
        said = open(log.name).read()
        assert said.endswith("overhead.py: stopped (Ctrl-C)\n") and "Traceback" not in said, said[-3000:]
    finally:
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                sigkill_group(group)
        proc.wait()


def test_a_run_that_outlives_its_stop_is_killed_with_what_it_started(tmp_path):
    """_common.run_to_end, with plain processes: a run that ignores the SIGTERM a Ctrl-C is passed on as is
    killed STOP_WAIT seconds later, with the process it started in a session of its own, and the Ctrl-C goes
    on; a run that fails is one line naming the script, its exit code and its log."""
    import psutil
    from conftest import running
    pids = tmp_path / "pids"
    driver = ("import sys; sys.path.insert(0, 'bench'); import _common; _common.STOP_WAIT = 2; "
              "_common.run_to_end(sys.argv[2:], sys.argv[1], 'bench', 'the run')")
    log = str(tmp_path / "run.log")
    ignores = f'trap "" TERM; setsid sleep 1000 & echo $! > {pids}; sleep 1000 & echo $! >> {pids}; wait'
    proc = subprocess.Popen([sys.executable, "-c", driver, log, "sh", "-c", ignores], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not pids.exists() or len(pids.read_text().split()) < 2:
        assert time.time() < deadline
        time.sleep(0.05)
    run = psutil.Process(proc.pid).children() + [psutil.Process(int(pid)) for pid in pids.read_text().split()]
    asked = time.time()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == -signal.SIGINT and "KeyboardInterrupt" in proc.stderr.read()
    assert time.time() - asked >= 2 and len(run) == 3
    assert not [p for p in run if running(p)]
    failed = subprocess.run([sys.executable, "-c", driver, log, "sh", "-c", "exit 3"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert (failed.returncode, failed.stderr) == (1, f"bench: the run failed (exit code 3); its log: {log}\n")


def test_a_stop_waits_for_every_process_of_the_runs_group(tmp_path):
    """As with the deepspeed runner started by remote_engines.py: the run's own process dies at the SIGTERM
    a Ctrl-C is passed on as, while another process of its group takes a while to stop (launch.py stopping
    the ranks). run_to_end goes on with the Ctrl-C only once that one has ended too."""
    stopped, ready = tmp_path / "stopped", tmp_path / "ready"
    slow = ("import signal, sys, time\n"
            "def stop(*_):\n    time.sleep(1.5)\n    open(sys.argv[1], 'w').write('stopped')\n    sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, stop)\nopen(sys.argv[2], 'w').write('ready')\ntime.sleep(1000)\n")
    driver = ("import sys; sys.path.insert(0, 'bench'); import _common; "
              "_common.run_to_end(sys.argv[2:], sys.argv[1], 'bench', 'the run')")
    run = f'{sys.executable} -c "$0" {stopped} {ready} & wait'
    proc = subprocess.Popen([sys.executable, "-c", driver, str(tmp_path / "run.log"), "sh", "-c", run, slow],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not ready.exists():
        assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == -signal.SIGINT
    assert stopped.exists()
