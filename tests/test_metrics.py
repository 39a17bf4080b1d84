"""metrics.py: the "no learning signal" warning, the step line, the progress display, step 1's self-check,
the closing line, the completions files and the saved config."""
import io
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys

import pytest

from conftest import ROOT
from metrics import FIRST_STEP_GAP, FIRST_STEP_KL, MetricsLog, NoSignalWatch, first_step_check
from progress import Progress

# the self-check's line, as first_step_check begins it
WARNING = "self-check at step 1 failed:"


def step(frac_zero_std=1.0, truncated=0.0, **rewards):
    rewards = rewards or {"demo": 0.0}
    parts = {f"reward/{k}": v for k, v in rewards.items()}
    return {"frac_zero_std": frac_zero_std, "completion_len/truncated": truncated, "completion_len/mean": 12.0,
            "reward/mean": sum(rewards.values()), "reward/std": 0.0, "reward/errors": 0, "reward/overlong": 0.0,
            **parts}


def warnings(rows, patience=3):
    watch = NoSignalWatch(patience)
    return [watch.check(r) for r in rows]


def test_no_signal_is_said_once_after_several_steps_in_a_row():
    said = warnings([step(), step(), step(0.5), step(), step(), step(), step(), step()])
    # the streak broken at step 3; then the third step in a row says it, once
    assert [w is not None for w in said] == [False, False, False, False, False, True, False, False]
    assert said[5].startswith("no learning signal: for 3 steps in a row")
    assert warnings([step(0.99)] * 5) == [None] * 5   # one group with signal is enough to learn from


def test_no_signal_names_what_the_batches_show():
    cut = warnings([step(truncated=0.98)] * 3)[-1]
    assert "98% of the completions were cut at --max-new-tokens: raise it" in cut
    fmt = warnings([step(gsm8k=0.0, format=0.0)] * 3)[-1]
    assert "the format reward is 0" in fmt and "--chat-template" in fmt
    solved = warnings([step(demo=1.0, format=1.0)] * 3)[-1]
    assert "the task is solved" in solved and "cut at" not in solved
    zero = warnings([step(demo=0.0)] * 3)[-1]
    assert "every completion scores 0" in zero
    alike = warnings([step(demo=0.5)] * 3)[-1]
    assert "score alike (mean reward 0.500)" in alike


def test_step_lines_start_at_column_zero_and_carry_the_warning(tmp_path, capsys):
    log = MetricsLog(0, out_dir=str(tmp_path), steps=100)
    for i in range(1, 4):
        log.write({"step": i, **step(truncated=1.0), "loss": 0.0, "kl": 0.0, "entropy": 2.5,
                   **({"eval/accuracy": 0.25, "eval/step": 0} if i == 1 else {})})
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" [")[0] for line in lines[:3]] == ["step    1/100", "step    2/100", "step    3/100"]
    assert "entropy 2.500" in lines[0] and "eval 0.250 (step 0)" in lines[0]
    assert len(lines) == 4 and lines[3].startswith("no learning signal:")


def test_no_signal_shows_two_completions_and_names_the_chat_template():
    rows = [{"prompt": "<|im_start|>user\n6*7?<|im_end|>\n", "completion": "I think 41", "reward": 0.0}] * 4
    watch = NoSignalWatch(3, template=lambda: "my/model's chat template")
    said = [watch.check(step(demo=0.0), rows) for _ in range(3)][-1]
    assert "the prompts went through my/model's chat template (--chat-template none: as written)" in said
    assert said.count("-> 'I think 41' (reward 0.000)") == 2 and "<|im_start|>" in said


def test_first_step_check_names_the_causes_of_what_is_off():
    """One line; the reference's causes when the KL is off, vLLM's when the gap is, both when both are."""
    ok = {"kl": 1e-9, "sampling/logp_diff_mean": 1e-6}
    assert first_step_check(ok) is None
    assert first_step_check({"kl": FIRST_STEP_KL, "sampling/logp_diff_mean": FIRST_STEP_GAP}) is None
    kl = first_step_check({**ok, "kl": 0.2})
    assert kl.startswith(WARNING) and "another checkpoint" in kl and "top-p" not in kl and "\n" not in kl
    gap = first_step_check({**ok, "sampling/logp_diff_mean": 0.5})
    assert "another checkpoint" not in gap and "dtype" in gap and "chat template" in gap and "top-p" in gap
    both = first_step_check({"kl": 0.2, "sampling/logp_diff_mean": 0.5})
    assert "another checkpoint" in both and "top-p" in both and "\n" not in both


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_shows_step_total_elapsed_and_eta_and_spares_a_log_file():
    """tqdm's format: step/total [elapsed<remaining, s/step], the remaining time from this launch's mean
    step after its first. Not a terminal: a line every N steps (and the first, the last, and asked-for
    ones), nothing between; a terminal rewrites one line in place between the kept ones."""
    log = io.StringIO()
    progress = Progress(11, 1000, 0, stream=log, started=0.0)   # resumed after step 10
    assert progress.every == 10   # about 100 lines for 1000 steps
    assert progress.prefix(11, now=30.0) == "step   11/1000 [00:30<?, ? s/step]"
    assert progress.prefix(21, now=50.0) == "step   21/1000 [00:50<32:38, 2.00 s/step]"
    assert progress.prefix(511, now=1030.0) == "step  511/1000 [17:10<16:18, 2.00 s/step]"
    assert progress.prefix(1000, now=3600 * 2.0) == "step 1000/1000 [2:00:00<00:00, 7.25 s/step]"
    for step in range(11, 36):
        progress.show(step, f"step {step}", keep=step == 13)
    assert log.getvalue().splitlines() == ["step 11", "step 13", "step 20", "step 30"]
    screen = Terminal()
    progress = Progress(1, 3, 0, stream=screen)
    assert progress.every == 1
    progress = Progress(1, 500, 100, stream=screen)
    for step in (1, 2, 3, 100):
        progress.show(step, f"step {step}")
    progress.say("a warning")
    assert screen.getvalue() == "step 1\nstep 2\r\x1b[Kstep 3\r\x1b[Kstep 100\na warning\n"


# a process whose terminal then closes, as a rank's does when the demo's terminal closes (the rank is in the
# launcher's session, so no SIGHUP reaches it): it waits for the hang-up, then writes a line and a warning
AFTER_THE_TERMINAL = """
import os, sys, time
from progress import Progress
progress = Progress(1, 10)
progress.show(1, "step 1", keep=True)
deadline = time.time() + 60
while os.isatty(1) and time.time() < deadline:
    time.sleep(0.01)
progress.show(2, "step 2", keep=True)
progress.say("the run stops after this step")
print("and a print", flush=True)
with open(sys.argv[1], "w") as f:
    f.write(os.path.realpath("/proc/self/fd/1") + " " + os.path.realpath("/proc/self/fd/2"))
"""


def test_a_closed_terminal_leaves_the_process_going_unheard(tmp_path):
    """Once its terminal has closed (hung up), every write to it fails with EIO: Progress's next line, which
    ended a rank before it could save the step it was finishing, goes to no one, and so does every write
    after it (stdout and stderr are /dev/null); the process goes on to its end."""
    master, terminal = pty.openpty()
    done = tmp_path / "done"
    proc = subprocess.Popen([sys.executable, "-c", AFTER_THE_TERMINAL, str(done)], cwd=ROOT, stdout=terminal,
                            stderr=terminal, env={**os.environ, "PYTHONPATH": ROOT})
    os.close(terminal)
    seen = b""
    while b"step 1" not in seen:
        assert select.select([master], [], [], 60)[0], seen
        seen += os.read(master, 1024)
    os.close(master)
    assert proc.wait(timeout=60) == 0 and done.read_text() == "/dev/null /dev/null"


def test_the_closing_line_completions_and_held_out_outputs(tmp_path, capsys):
    """The closing line (close(), after the last checkpoint and the shut-down): accuracy before -> after,
    the steps, the time since the launch, the last checkpoint; a stopped run adds the line that continues
    it. --log-completions 2 --log-completions-every 2: two training rows every second step, with the gold
    answer, each reward and the advantage; each evaluation's held-out outputs in eval_completions.jsonl."""
    from run_config import NOT_IN_CONFIG
    log = MetricsLog(0, out_dir=str(tmp_path), steps=4, log_completions=2, log_completions_every=2,
                     model="m/m", task="custom", data="my.jsonl", lr=0.5, config="x.yaml", resume=True)
    samples = [{"prompt": f"{i}+1=", "answer": str(i + 1), "completion": "<answer>2</answer>", "reward": 0.5,
                "rewards": {"demo": 0.5}, "advantage": 0.1 * i} for i in range(4)]
    outputs = [{"prompt": "9+1=", "answer": "10", "completion": "<answer>10</answer>", "accuracy": 1.0,
                "format": 0.0}]
    row = {"reward/mean": 0.5, "loss": 0.1, "kl": 0.0, "entropy": 1.0, "completion_len/mean": 5.0,
           "frac_zero_std": 0.5}
    for step in (1, 2, 3):
        evals = {"eval/accuracy": 0.25 * step, "eval/step": step - 1, "eval/rows": outputs} if step != 2 else {}
        log.write({"step": step, **row, **evals, "samples": samples})
    log.close(3, stopped=("Ctrl-C", "deepspeed grpo_train.py --model m/m --resume"))
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(rf"stopped after step 3 of 4 \(Ctrl-C\): held-out accuracy 0.250 \(step 0\) -> 0.750 "
                        rf"\(step 2\); steps 1-3 in \d+ (min \d+ )?s; last checkpoint {tmp_path}/step_3; to "
                        rf"continue:", lines[-2]), lines[-2]
    assert lines[-1] == "deepspeed grpo_train.py --model m/m --resume"
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert rows == [{"step": 2, **samples[0]}, {"step": 2, **samples[1]}]
    held_out = [json.loads(line) for line in (tmp_path / "eval_completions.jsonl").read_text().splitlines()]
    assert held_out == [{"eval/step": 0, **outputs[0]}, {"eval/step": 2, **outputs[0]}]
    metrics = (tmp_path / "metrics.jsonl").read_text()
    assert "samples" not in metrics and "eval/rows" not in metrics
    # the plot at the end (not at an evaluation within a minute of the start), titled with the run's model
    # and task
    assert (tmp_path / "metrics.png").stat().st_size > 10_000
    import yaml
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["lr"] == 0.5 and saved["data"] == "my.jsonl" and not set(NOT_IN_CONFIG) & set(saved)


def test_a_stopped_run_keeps_the_evaluations_that_arrived_after_its_last_line(tmp_path, capsys):
    """Ctrl-C after step 2: the evaluations of steps 1 and 2 had arrived, in take_evals' form (the
    newest, the older in eval/earlier), after step 2's line. Each gets a line of its own after it, its
    held-out outputs and a console line, and the closing line's "after" is the newest."""
    log = MetricsLog(0, out_dir=str(tmp_path), steps=10, log_completions=1)
    row = {"reward/mean": 0.5, "loss": 0.1, "kl": 0.0, "entropy": 1.0, "completion_len/mean": 5.0,
           "frac_zero_std": 0.5}
    outputs = [{"prompt": "9+1=", "completion": "<answer>10</answer>", "accuracy": 1.0}]
    log.write({"step": 1, **row, "eval/accuracy": 0.25, "eval/step": 0, "eval/rows": outputs})
    log.write({"step": 2, **row})
    arrived = {"eval/accuracy": 0.75, "eval/step": 2, "eval/rows": outputs,
               "eval/earlier": [{"eval/accuracy": 0.5, "eval/step": 1, "eval/rows": outputs}]}
    log.close(2, stopped=("Ctrl-C", "deepspeed grpo_train.py --model m/m --resume"), evals=arrived)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], "loss" in r, r.get("eval/step")) for r in lines] == [
        (1, True, 0), (2, True, None), (2, False, 1), (2, False, 2)]
    assert [r["eval/accuracy"] for r in lines[2:]] == [0.5, 0.75]
    held_out = [json.loads(line) for line in (tmp_path / "eval_completions.jsonl").read_text().splitlines()]
    assert [r["eval/step"] for r in held_out] == [0, 1, 2]
    said = capsys.readouterr().out.splitlines()
    assert said[-4:-2] == ["eval 0.500 (step 1)", "eval 0.750 (step 2)"], said
    assert said[-2].startswith("stopped after step 2 of 10 (Ctrl-C): held-out accuracy 0.250 (step 0) -> "
                               "0.750 (step 2); steps 1-2 in "), said


def wandb_history(out_dir):
    """The history rows of the offline W&B run in out_dir, from its run-*.wandb file (wandb 0.31 has no
    reader of it in Python): a 7-byte header (":W&B", magic, version), then leveldb's log format, blocks
    of 32 KiB of records each with a 7-byte header (crc, length, kind: 1 whole, 2-3-4 first-middle-last
    piece; 0 the padding to the block's end), whose payloads are protobuf Records."""
    from wandb.proto.wandb_internal_pb2 import Record
    (path,) = out_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, block, record, rows = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if block - pos % block < 7 or kind == 0:
            pos += block - pos % block
            continue
        record, pos = record + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            row = Record.FromString(record)
            if row.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in row.history.item})
            record = b""
    return rows


def test_w_and_b_keeps_every_line_even_several_at_one_step(tmp_path, monkeypatch):
    """--wandb (offline): a W&B row for each line of metrics.jsonl, with its step and values, though the
    last three share step 2 (the evaluations that arrived after a stopped run's last line). W&B merges
    what is logged at one step=, keeping one value a key: two of the evaluations were lost."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    log = MetricsLog(0, out_dir=str(tmp_path), steps=10, wandb=True)
    row = {"reward/mean": 0.5, "loss": 0.1, "kl": 0.0, "entropy": 1.0, "completion_len/mean": 5.0,
           "frac_zero_std": 0.5}
    log.write({"step": 1, **row, "eval/accuracy": 0.25, "eval/step": 0})
    log.write({"step": 2, **row})
    arrived = {"eval/accuracy": 0.75, "eval/step": 2,
               "eval/earlier": [{"eval/accuracy": 0.5, "eval/step": 1}]}
    log.close(2, stopped=("Ctrl-C", "deepspeed grpo_train.py --model m/m --resume"), evals=arrived)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    history = wandb_history(tmp_path)
    keys = ("step", "loss", "eval/step", "eval/accuracy")
    assert [[r.get(k) for k in keys] for r in history] == [[r.get(k) for k in keys] for r in lines], history
    assert [r.get("eval/accuracy") for r in history] == [0.25, None, 0.5, 0.75]


def test_the_plot_at_most_once_a_minute_during_a_run(tmp_path):
    """metrics.png during a run: at an evaluation a minute or more after the start or the last drawing,
    never at one sooner (each drawing holds rank 0's loop), and at the end."""
    log = MetricsLog(0, out_dir=str(tmp_path), steps=4)
    row = {"reward/mean": 0.5, "loss": 0.1, "kl": 0.0, "entropy": 1.0, "completion_len/mean": 5.0,
           "frac_zero_std": 0.5}
    plot = tmp_path / "metrics.png"
    log.write({"step": 1, **row, "eval/accuracy": 0.5, "eval/step": 0})
    assert not plot.exists()
    log.plotted -= log.plot_every_s
    log.write({"step": 2, **row})
    assert not plot.exists()
    log.write({"step": 3, **row, "eval/accuracy": 0.6, "eval/step": 2})
    drawn = plot.stat().st_mtime_ns
    log.write({"step": 4, **row, "eval/accuracy": 0.7, "eval/step": 3})
    assert plot.stat().st_mtime_ns == drawn
    plot.unlink()
    log.close(4)
    assert plot.stat().st_size > 10_000


def test_the_plots_time_axis_never_repeats_a_label():
    """The top axis of a short run (steps under a second apart) read 8, 9, 9, 10, 11: a decimal then; whole
    seconds otherwise, and minutes from 10 on."""
    from plot import time_ticks
    short = [{"step": s, "time/elapsed_s": 8.0 + 0.2 * s} for s in range(1, 21)]
    assert time_ticks(short) == ([1, 5, 9, 13, 17], ["8.2", "9.0", "9.8", "10.6", "11.4"], "seconds")
    slow = [{"step": s, "time/elapsed_s": 20.0 * s} for s in range(1, 11)]
    assert time_ticks(slow) == ([1, 3, 5, 7, 9], ["20", "60", "100", "140", "180"], "seconds")
    long = [{"step": s, "time/elapsed_s": 300.0 * s} for s in range(1, 11)]
    assert time_ticks(long)[1:] == (["5", "15", "25", "35", "45"], "minutes")


def test_plotting_a_killed_runs_metrics_and_the_mistakes_of_plot_py(tmp_path):
    """python plot.py METRICS OUT: a killed run's torn last line is left out of the plot; a metrics file
    that is not there, an output name no image format has, and a line before the last that is not JSON are
    one line each and exit status 1."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    row = {"reward/mean": 0.5, "loss": 0.1, "kl": 0.0, "entropy": 1.0, "completion_len/mean": 5.0}
    steps = "".join(json.dumps({"step": s, **row}) + "\n" for s in (1, 2, 3))
    (tmp_path / "killed.jsonl").write_text(steps + '{"step": 4, "rew')
    (tmp_path / "middle.jsonl").write_text(steps + '{"step": 4, "rew\n' + json.dumps({"step": 5, **row}) + "\n")

    def plot(*argv):
        p = subprocess.run([sys.executable, "plot.py", *map(str, argv)], cwd=root, capture_output=True, text=True,
                           timeout=120)
        return p.returncode, p.stdout, p.stderr

    from plot import read_metrics
    assert [r["step"] for r in read_metrics(tmp_path / "killed.jsonl")] == [1, 2, 3]
    assert plot(tmp_path / "killed.jsonl", tmp_path / "killed.png") == (0, f"{tmp_path / 'killed.png'}\n", "")
    assert (tmp_path / "killed.png").stat().st_size > 10_000
    # a name without an extension: matplotlib adds .png, and the line names that file
    curve = tmp_path / "curve"
    assert plot(tmp_path / "killed.jsonl", curve) == (0, f"{tmp_path / 'curve.png'}\n", "")
    assert (tmp_path / "curve.png").exists()
    for argv, said in (((tmp_path / "none.jsonl", tmp_path / "x.png"), f"{tmp_path / 'none.jsonl'}: No such file "
                        "or directory"),
                       ((tmp_path / "killed.jsonl", tmp_path / "x.txt"), f"{tmp_path / 'x.txt'}: no image format "
                        "is named .txt: end the name with one of "),
                       ((tmp_path / "middle.jsonl", tmp_path / "x.png"), f"{tmp_path / 'middle.jsonl'}:4: not a "
                        "JSON line (Unterminated string starting at, column 13)")):
        rc, out, err = plot(*argv)
        assert rc == 1 and out == "" and err.startswith(f"plot.py: {said}") and err.count("\n") == 1, err
    assert not (tmp_path / "x.png").exists()
    rc, out, err = plot("--help")   # the usage, exit status 0; no arguments: the usage as the mistake
    assert rc == 0 and "python plot.py runs/demo/metrics.jsonl runs/demo/curve.png" in out and err == "", err
    assert plot() == (1, "", "usage: python plot.py METRICS_JSONL OUT_PNG\n")


def test_plot_py_on_a_file_that_is_not_text_or_a_line_that_is_no_object_is_one_line(tmp_path):
    """python plot.py run.png out.png (the image given as the metrics file) was a UnicodeDecodeError, and a
    line that is JSON but no object (7) a TypeError; each is one line naming the file and line, as a line
    that is not JSON is. As the last line, which a killed run leaves torn, either is left out."""
    import subprocess
    import sys
    from plot import read_metrics
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    steps = "".join(json.dumps({"step": s, "loss": 0.1}) + "\n" for s in (1, 2))
    (tmp_path / "run.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    (tmp_path / "seven.jsonl").write_text(steps + "7\n" + steps)
    (tmp_path / "list.jsonl").write_text(steps + "[1, 2]\n" + steps)
    for name, said in (("run.png", "1: not a JSON line (not UTF-8 text: byte 0x89, column 1)"),
                       ("seven.jsonl", "3: not a JSON object (7)"),
                       ("list.jsonl", "3: not a JSON object ([1, 2])")):
        p = subprocess.run([sys.executable, "plot.py", str(tmp_path / name), str(tmp_path / "x.png")], cwd=root,
                           capture_output=True, text=True, timeout=120)
        assert (p.returncode, p.stdout, p.stderr) == (1, "", f"plot.py: {tmp_path / name}:{said}\n"), p.stderr
    # a last line cut inside a character, or one that is JSON but no object: left out as torn
    (tmp_path / "torn.jsonl").write_bytes(steps.encode() + '{"note": "\u00e9'.encode()[:-1])
    (tmp_path / "last.jsonl").write_text(steps + "7\n")
    assert [r["step"] for r in read_metrics(tmp_path / "torn.jsonl")] == [1, 2]
    assert [r["step"] for r in read_metrics(tmp_path / "last.jsonl")] == [1, 2]


def test_a_config_file_under_the_command_line(tmp_path, capsys):
    """--config run.yaml: its keys under the command line's flags (which win, --no-FLAG for a switch it
    sets), a switch as true, a list
    for --gen-devices, YAML's own numbers (3e-4 is a string to YAML 1.1: argparse reads it); the resolved
    config.yaml a run saves gives back the same flags."""
    from grpo_train import get_args
    from metrics import MetricsLog
    (tmp_path / "run.yaml").write_text("model: m/m\nmax-new-tokens: 64\nlr: 3e-4\ngrad_ckpt: true\n"
                                       "gen_devices: [0, 1]\nbeta: 0.1\n")
    args = get_args(["--config", str(tmp_path / "run.yaml"), "--beta", "0.2"])
    assert (args.model, args.max_new_tokens, args.lr, args.grad_ckpt, args.gen_devices, args.beta) == (
        "m/m", 64, 3e-4, True, [0, 1], 0.2)
    MetricsLog(0, **{**vars(args), "out_dir": str(tmp_path / "run")}).open()
    again = get_args(["--config", str(tmp_path / "run" / "config.yaml")])
    assert vars(again) == {**vars(args), "config": str(tmp_path / "run" / "config.yaml"),
                           "out_dir": str(tmp_path / "run")}
    # a switch the file sets, turned off after it (a switch had no other word: the file's won)
    off = get_args(["--config", str(tmp_path / "run.yaml"), "--no-grad-ckpt"])
    assert off.grad_ckpt is False and vars(off) == {**vars(args), "grad_ckpt": False, "beta": 0.1}
    assert get_args(["--no-grad-ckpt", "--config", str(tmp_path / "run.yaml")]).grad_ckpt is False
