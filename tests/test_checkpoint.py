"""Resumable checkpoints (checkpoints.save_checkpoint / load_checkpoint) with the real DeepSpeed ZeRO-2 engine, one
gloo rank in a child process: a resumed run takes exactly the step the uninterrupted run took, because the
optimizer state came back too; a save killed halfway never becomes `latest`."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import next_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import os, sys
base, out, phases, port, lora_rank = sys.argv[1:]
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
import deepspeed, torch
from safetensors.torch import save_file
from checkpoints import load_checkpoint, read_state, save_checkpoint
from ranks import skip_shm_allreduce_op
from run_setup import build_engine, load_policy

skip_shm_allreduce_op()
deepspeed.init_distributed()

def train_step(engine, seed):   # any loss will do: the optimizer's state is what is tested
    ids = torch.randint(10, 60, (4, 12), generator=torch.Generator().manual_seed(seed))
    engine.backward(engine.module(input_ids=ids, labels=ids).loss)
    engine.step()

for phase in phases.split(","):
    # "weights-only": step 2's weights with a fresh optimizer: the HF model inside the checkpoint, or with
    # LoRA the base model and step 2's adapters, without their optimizer state
    start = os.path.join(out, "step_2") if phase == "weights-only" and not int(lora_rank) else base
    model, tok = load_policy(start, grad_ckpt=False, lora_rank=int(lora_rank))
    engine = build_engine(model, "ds_config.json", lr=1e-2, micro_batch=4)
    if phase == "first":
        train_step(engine, 0)
        train_step(engine, 1)
        save_checkpoint(engine, tok, out, {"step": 2, "data_pos": 7, "ref": None}, keep=0)
        os.makedirs(os.path.join(out, "step_3.tmp"))   # what a save killed halfway leaves
        open(os.path.join(out, "step_3.tmp", "junk"), "w").write("x")
        # Adam's moments: as many numbers as the weights that train; the policy's logits
        moments = sum(s["exp_avg"].numel() for s in engine.optimizer.optimizer.state.values())
        print("moments", moments, sum(p.numel() for p in model.parameters() if p.requires_grad),
              sum(p.numel() for p in model.parameters()))
        with torch.no_grad():
            logits = engine.module(input_ids=torch.arange(10, 30)[None]).logits
        save_file({"logits": logits}, os.path.join(out, "logits.safetensors"))
    elif phase == "resumed":
        # before the engine loads it, as grpo_train.main does (with the flags that bound its data position)
        state = read_state(True, out_dir=out, resume=True, steps=3, prompts_per_step=4, max_gen_rounds=1)
        load_checkpoint(engine, out, state["step"])
        assert (state["step"], state["data_pos"], state["counts"]["stale_dropped"]) == (2, 7, 0), state
    elif int(lora_rank):
        engine.load_checkpoint(out, tag="step_2", load_module_strict=False, load_optimizer_states=False)
    train_step(engine, 2)
    if phase == "resumed":
        save_checkpoint(engine, tok, out, {"step": 3, "ref": None}, keep=0)
    save_file({k: v.clone() for k, v in engine.module.state_dict().items()}, os.path.join(out, phase + ".safetensors"))
"""


def run(phases, model, out, lora_rank=0):
    """The phases, one after the other in one process: "first" (two steps, saved), or "resumed" (from that
    checkpoint) then "weights-only" -> ({phase: the weights after the third step}, its output)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-c", SCRIPT, model, str(out), ",".join(phases), str(next_port()),
                        str(lora_rank)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return {phase: load_file(os.path.join(out, phase + ".safetensors")) for phase in phases}, p.stdout


def test_resume_restores_model_and_optimizer_exactly(tmp_path, tiny_model):
    first = run(["first"], tiny_model, tmp_path)[0]["first"]
    assert (tmp_path / "latest").read_text() == "step_2"   # not the half-written step_3.tmp
    assert (tmp_path / "step_2" / "model.safetensors").exists() and (tmp_path / "step_2" / "tokenizer.json").exists()
    third, out = run(["resumed", "weights-only"], tiny_model, tmp_path)
    assert "resuming after step 2" in out
    for k in first:
        torch.testing.assert_close(third["resumed"][k], first[k], rtol=0, atol=0)   # the same third step, bit for bit
    # the same weights with a fresh Adam take another step: the test would see a lost optimizer state
    assert max((third["weights-only"][k] - first[k]).abs().max().item() for k in first) > 1e-4
    assert (tmp_path / "latest").read_text() == "step_3" and not (tmp_path / "step_3.tmp").exists()


def test_lora_resume_is_exact_and_keeps_the_adapters_and_their_optimizer_alone(tmp_path, tiny_model):
    """--lora-rank 4: the checkpoint holds the adapters (peft's folder, which loads onto the base model as the
    trained policy), their optimizer state, Adam's moments the adapters' size, and the merged model, which
    from_pretrained loads as the trained policy (so --eval-only --model step_N evaluates it); a resumed run
    takes the uninterrupted run's third step bit for bit, and the same adapters without their optimizer state
    do not."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    weights, out = run(["first"], tiny_model, tmp_path, lora_rank=4)
    first = weights["first"]
    moments, trainable, total = (int(w) for w in re.search(r"^moments (\d+) (\d+) (\d+)$", out, re.M).groups())
    assert moments == trainable and 0 < trainable < total / 10, out
    ckpt = tmp_path / "step_2"
    assert (ckpt / "adapter" / "adapter_model.safetensors").exists() and (ckpt / "config.json").exists()
    # DeepSpeed's files: the adapters and 3 fp32 copies of them (master, 2 moments), not the base model
    ds_bytes = sum(f.stat().st_size for f in ckpt.glob("*.pt"))
    assert ds_bytes < 4 * 4 * trainable + 2**20 < 4 * total, ds_bytes
    third, out = run(["resumed", "weights-only"], tiny_model, tmp_path, lora_rank=4)
    assert "resuming after step 2" in out
    for k in first:
        torch.testing.assert_close(third["resumed"][k], first[k], rtol=0, atol=0)
    assert max((third["weights-only"][k] - first[k]).abs().max().item() for k in first) > 1e-4
    # the saved adapters on the base model (peft's own loader) are the policy after step 2, not the base model
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(ckpt / "adapter"))
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    ids, trained = torch.arange(10, 30)[None], load_file(tmp_path / "logits.safetensors")["logits"]
    with torch.no_grad():
        torch.testing.assert_close(policy(ids).logits, trained, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(base(ids).logits, trained, atol=1e-3)
        merged = AutoModelForCausalLM.from_pretrained(ckpt)
        torch.testing.assert_close(merged(ids).logits, trained, rtol=1e-5, atol=1e-5)


def test_pruning_keeps_the_newest_and_the_reference_and_leaves_later_ones(tmp_path):
    """--keep-checkpoints 2 after saving step 50: step 40 and 50 stay, and step 10, which the reference
    server serves; step 60, left by a run that was resumed from step 40, stays until its save replaces it."""
    from checkpoints import prune_checkpoints
    for n in (10, 20, 30, 40, 50, 60):
        (tmp_path / f"step_{n}").mkdir()
    (tmp_path / "step_70.tmp").mkdir()
    prune_checkpoints(str(tmp_path), 50, keep=2, ref=str(tmp_path / "step_10"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10", "step_40", "step_50", "step_60",
                                                          "step_70.tmp"]
    prune_checkpoints(str(tmp_path), 60, keep=1, ref=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_60", "step_70.tmp"]


def test_vllm_is_told_the_trainers_dtype(tiny_model):
    """The trainer picks its dtype by the reference server's rule (bf16 only where native: tested with
    ref_server.default_dtype), and vLLM is given exactly that dtype, never its own "auto" (which picks fp16
    on pre-Ampere GPUs)."""
    from engine_process import vllm_dtype
    from run_setup import load_policy
    model, _ = load_policy(tiny_model, grad_ckpt=False)
    assert model.dtype == torch.float32 and vllm_dtype(model.dtype) == "float32"   # no GPU here
    assert vllm_dtype(torch.bfloat16) == "bfloat16"


def flags(*argv):
    """grpo_train.py's flags as read_state gets them (vars of the parsed arguments)."""
    from grpo_train import get_args
    return vars(get_args(["--model", "m/base", *argv]))


def a_run(out_dir, *argv):
    """What a run with these flags leaves: metrics.jsonl and checkpoint step_10 naming its configuration."""
    from checkpoints import fresh_state
    config = {k: v for k, v in flags(*argv).items() if k not in ("out_dir", "resume")}
    state = {**fresh_state(), "step": 10, "config": read_config(config)}
    (out_dir / "step_10").mkdir(parents=True)
    (out_dir / "step_10" / "grpo_state.json").write_text(json.dumps(state))
    (out_dir / "latest").write_text("step_10")
    (out_dir / "metrics.jsonl").write_text('{"step": 1}\n')


def read_config(config):
    from checkpoints import FREE_ON_RESUME
    return {k: v for k, v in config.items() if k not in FREE_ON_RESUME}


def refusal(capsys, out_dir, *argv):
    """read_state's one line for these flags (it exits with status 1), or None if it takes them."""
    from checkpoints import read_state
    try:
        read_state(True, **{**flags(*argv), "out_dir": str(out_dir)})
    except SystemExit as e:
        assert e.code == 1
        (line,) = capsys.readouterr().err.splitlines()
        return line
    return None


def test_an_out_dir_holding_a_run_is_refused_unless_resumed_or_overwritten(tmp_path, capsys):
    a_run(tmp_path, "--lr", "3e-4")
    line = refusal(capsys, tmp_path, "--lr", "3e-4")
    assert line.startswith(f"grpo_train.py: --out-dir {tmp_path} holds another run (its checkpoint step_10)")
    assert "--resume continues it, --overwrite replaces it" in line
    assert refusal(capsys, tmp_path, "--lr", "3e-4", "--resume") is None
    assert refusal(capsys, tmp_path, "--lr", "3e-4", "--eval-only") is None   # it writes eval.json only
    assert refusal(capsys, tmp_path, "--overwrite") is None


def test_a_checkpoint_of_the_out_dir_as_model_is_refused(tmp_path, capsys):
    """--model runs/x/step_2 --out-dir runs/x --overwrite removed the folder the run had loaded its policy and
    reference from, then saved other weights under its name; a resume then loaded those as its reference."""
    a_run(tmp_path, "--lr", "3e-4")
    (tmp_path / "step_10" / "model").mkdir()
    (tmp_path.parent / "link").symlink_to(tmp_path / "step_10")
    for model in (tmp_path / "step_10", tmp_path / "step_10" / "model", tmp_path.parent / "link"):
        line = refusal(capsys, tmp_path, "--model", str(model), "--overwrite")
        assert f"--model {model} is a checkpoint in --out-dir {tmp_path}" in line, line
        assert "copy it out first, or pass another --out-dir" in line
    assert refusal(capsys, tmp_path, "--model", str(tmp_path / "step_10"), "--eval-only") is None
    assert refusal(capsys, tmp_path / "step_10" / "model", "--model", str(tmp_path / "step_10")) is None


def test_an_out_dir_that_cannot_be_a_folder_is_one_line(tmp_path, capsys):
    """An --out-dir that is a file, lies under a file, or cannot be made (/proc/nope) was a traceback from
    os.makedirs; each is one line naming --out-dir and why, before anything starts."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "unmounted").symlink_to(tmp_path / "scratch" / "runs")
    for out_dir, why in [(tmp_path / "file", "a file is there"),
                         (tmp_path / "unmounted", f"a broken symbolic link, to {tmp_path / 'scratch' / 'runs'}"),
                         (tmp_path / "file" / "run", f"{tmp_path / 'file' / 'run'}: Not a directory"),
                         ("/proc/nope", "/proc/nope: No such file or directory")]:
        line = refusal(capsys, out_dir)
        assert line == (f"grpo_train.py: --out-dir {out_dir}: cannot make that folder ({why}): pass another "
                        f"--out-dir"), line
    # a folder this user may not write in (root may: there the run goes on)
    (tmp_path / "locked").mkdir(mode=0o555)
    line = refusal(capsys, tmp_path / "locked")
    assert line == (None if os.geteuid() == 0 else f"grpo_train.py: --out-dir {tmp_path / 'locked'}: cannot write "
                    f"in that folder (no permission, or a read-only file system): pass another --out-dir"), line


def test_a_resume_into_checkpoints_that_no_latest_names_is_refused(tmp_path, capsys):
    """--resume where latest was lost (deleted by hand) but step_N folders stay started afresh, saying only
    "no checkpoint": its first row emptied metrics.jsonl and its saves pruned and replaced those folders.
    It is one line naming the folder now, touching nothing; a new or empty folder still starts afresh."""
    a_run(tmp_path / "run", "--lr", "3e-4")
    (tmp_path / "run" / "step_20").mkdir()
    (tmp_path / "run" / "step_30.tmp").mkdir()
    (tmp_path / "run" / "latest").unlink()
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    line = refusal(capsys, tmp_path / "run", "--lr", "3e-4", "--resume")
    assert line == (f"grpo_train.py: --resume: {tmp_path / 'run'} holds checkpoints (step_10, step_20) but no file "
                    f"latest naming the one to resume: write its name into it (the newest: echo step_20 > "
                    f"{tmp_path / 'run' / 'latest'}), or start afresh with --overwrite"), line
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before
    assert refusal(capsys, tmp_path / "run", "--lr", "3e-4", "--resume", "--overwrite") is None
    # which starts afresh: at its first row, the old checkpoints go, as with --overwrite alone (they stayed)
    import shutil
    from metrics import MetricsLog
    shutil.copytree(tmp_path / "run", tmp_path / "again")
    argv = ("--lr", "3e-4", "--resume", "--overwrite")
    MetricsLog(0, **{**flags(*argv), "out_dir": str(tmp_path / "again")}).write({"step": 1, **ROW})
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["config.yaml", "metrics.jsonl"]
    # nor does a new run take them over (its saves pruned or replaced them) unless --overwrite
    (tmp_path / "run" / "metrics.jsonl").unlink()
    line = refusal(capsys, tmp_path / "run", "--lr", "3e-4")
    assert "holds another run (its checkpoints step_10, step_20): --resume continues it" in line, line
    for n in (30, 40):
        (tmp_path / "run" / f"step_{n}").mkdir()
    line = refusal(capsys, tmp_path / "run", "--lr", "3e-4", "--resume")
    assert "holds checkpoints (4 of them, step_10 to step_40) but" in line, line
    for folder in (tmp_path / "new", tmp_path / "empty"):
        if folder.name == "empty":
            folder.mkdir()
        assert refusal(capsys, folder, "--resume") is None
        assert capsys.readouterr().out == f"--resume: no checkpoint in {folder}, starting from --model\n"


# a step's metrics, as the step line needs them
ROW = {"reward/mean": 0.5, "loss": 0.1, "kl": 0.0, "entropy": 1.0, "completion_len/mean": 5.0, "frac_zero_std": 0.5}


def jsonl(path, rows, torn=False):
    """A JSON-lines file of these rows; torn: with the half line a killed run leaves last."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + ('{"step": 4' if torn else ""))


def steps_in(path, key="step"):
    return [json.loads(line)[key] for line in path.read_text().splitlines()]


def test_overwrite_deletes_the_old_run_only_at_the_new_runs_first_row(tmp_path):
    """--overwrite deleted the old run's checkpoints as the run started, before it read its model and data: a
    typo in the new run's --data left neither run. The old run now stays whole until the new run writes its
    first row (its checkpoint loaded, vLLM started, a step trained); then its checkpoints go, so no stale
    step_10 stays beside the new run's, its metrics and completions files start empty, and its config.yaml
    (which --eval-only of its checkpoints reads) gives way to the new run's."""
    from checkpoints import read_state
    from metrics import MetricsLog
    a_run(tmp_path, "--lr", "3e-4")
    (tmp_path / "model").mkdir()
    jsonl(tmp_path / "completions.jsonl", [{"step": s, "completion": "old"} for s in (1, 2)])
    jsonl(tmp_path / "eval_completions.jsonl", [{"eval/step": 0, "completion": "old"}])
    (tmp_path / "config.yaml").write_text("lr: 0.0003\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = ("--overwrite", "--log-completions", "1")
    read_state(True, **{**flags(*argv), "out_dir": str(tmp_path)})
    log = MetricsLog(0, **{**flags(*argv), "out_dir": str(tmp_path)})
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "config.yaml").read_text() == "lr: 0.0003\n"
    assert (tmp_path / "latest").read_text() == "step_10" and steps_in(tmp_path / "completions.jsonl") == [1, 2]
    log.write({"step": 1, **ROW, "samples": [{"prompt": "1+1=", "completion": "new"}]})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["completions.jsonl", "config.yaml",
                                                          "eval_completions.jsonl", "metrics.jsonl", "model"]
    assert steps_in(tmp_path / "metrics.jsonl") == [1]
    assert [json.loads(line)["completion"] for line in (tmp_path / "completions.jsonl").open()] == ["new"]
    assert (tmp_path / "eval_completions.jsonl").read_text() == ""
    assert "log_completions: 1" in (tmp_path / "config.yaml").read_text().splitlines()


def test_a_resume_that_changes_the_run_says_which_flags_and_needs_consent(tmp_path, capsys):
    a_run(tmp_path, "--lr", "3e-4")
    # more steps, another evaluation cadence or device: the same run, continued
    assert refusal(capsys, tmp_path, "--lr", "3e-4", "--resume", "--steps", "500", "--eval-every", "5",
                   "--micro-batch", "2", "--gen-device", "1") is None
    assert "resuming after step 10 from" in capsys.readouterr().out
    line = refusal(capsys, tmp_path, "--lr", "1e-6", "--group-size", "4", "--resume")
    assert "--group-size 4 (was 8), --lr 1e-06 (was 0.0003)" in line, line
    # without a test split, the held-out prompts come out of the training set: another --eval-size trains
    # on another set (it was taken as free)
    line = refusal(capsys, tmp_path, "--lr", "3e-4", "--eval-size", "40", "--resume")
    assert "--eval-size 40 (was 200)" in line, line
    assert "--resume-with-changes" in line
    assert refusal(capsys, tmp_path, "--lr", "1e-6", "--resume", "--resume-with-changes") is None
    assert "resuming after step 10 from" in capsys.readouterr().out
    # alone, as the refusal and --help word it (it was refused as a fresh run into a run's folder)
    assert refusal(capsys, tmp_path, "--lr", "1e-6", "--resume-with-changes") is None
    assert "resuming after step 10 from" in capsys.readouterr().out
    # another base model or LoRA shape cannot continue these weights: refused even with consent
    for argv, named in [(["--lora-rank", "8"], "--lora-rank 0; it cannot continue with --lora-rank 8"),
                        (["--model", "m/other"], "--model m/base; it cannot continue with --model m/other")]:
        line = refusal(capsys, tmp_path, "--lr", "3e-4", "--resume", "--resume-with-changes", *argv)
        assert named in line, line


def test_a_resume_may_change_logging_devices_servers_and_the_config_file(tmp_path, capsys):
    """docs/checkpoints.md: a resume's logging, devices and servers may change freely. --log-every,
    --log-completions-every, --wandb, --ref-device, --gen-urls, --gen-timeout and --reward-workers were
    refused as changes to the run, and so was --config with the run's own config.yaml ("(was None)"). The
    checkpoint here is one the previous version saved: its state records those flags."""
    from metrics import MetricsLog
    a_run(tmp_path, "--lr", "3e-4")
    state_file = tmp_path / "step_10" / "grpo_state.json"
    every_flag = {k: v for k, v in flags("--lr", "3e-4").items() if k not in ("out_dir", "resume")}
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "config": every_flag}))
    assert refusal(capsys, tmp_path, "--lr", "3e-4", "--resume", "--log-every", "5", "--log-completions-every",
                   "2", "--wandb", "--ref-device", "cpu", "--gen-urls", "http://10.0.0.2:8000", "--gen-timeout",
                   "30", "--reward-workers", "4") is None
    MetricsLog(0, **{**flags("--lr", "3e-4"), "out_dir": str(tmp_path)}).open()
    assert refusal(capsys, tmp_path, "--config", str(tmp_path / "config.yaml"), "--resume") is None
    assert "resuming after step 10 from" in capsys.readouterr().out


def test_a_resume_with_no_step_left_is_one_line_before_anything_starts(tmp_path, capsys):
    """--resume --steps 10 from a checkpoint at step 10 (or past it) started vLLM and the reference server,
    took no step and ended with status 0, saying nothing."""
    a_run(tmp_path, "--lr", "3e-4")
    for steps in ("10", "5"):
        line = refusal(capsys, tmp_path, "--lr", "3e-4", "--resume", "--steps", steps)
        assert line == (f"grpo_train.py: --steps {steps}: the checkpoint in {tmp_path} is at step 10 already; "
                        f"pass a larger --steps"), line
    assert refusal(capsys, tmp_path, "--lr", "3e-4", "--resume", "--steps", "11") is None
    # --eval-only evaluates --model: with --resume it waited forever for an evaluation nothing asked for
    line = refusal(capsys, tmp_path, "--lr", "3e-4", "--resume", "--steps", "5", "--eval-only")
    assert line == (f"grpo_train.py: --eval-only evaluates --model; it takes no --resume: name the checkpoint "
                    f"(--model {tmp_path}/step_N)"), line


def test_eval_only_of_a_checkpoint_whose_state_or_config_is_broken_is_one_line(tmp_path, capsys):
    """--eval-only --model runs/x/step_10 read grpo_state.json and the run's config.yaml beside it on
    trust: broken JSON or YAML was a traceback. Each is one line naming the file, exit status 1."""
    from grpo_train import get_args
    a_run(tmp_path, "--lr", "3e-4", "--task", "gsm8k")
    state_file, config = tmp_path / "step_10" / "grpo_state.json", tmp_path / "config.yaml"
    good = json.loads(state_file.read_text())
    # a checkpoint of an earlier version, which did not record --eval-size: config.yaml beside it is read
    older = json.dumps({**good, "config": {k: v for k, v in good["config"].items() if k != "eval_size"}})
    for state, yaml_text, said in [('{"step": 10, ', None, f"{state_file} cannot be read (Expecting"),
                                   ("[10]", None, f"{state_file} is not a JSON object: mend it, or move it away"),
                                   (older, "task: [gsm8k\n", f"{config}: not YAML (line 2, column 1): expected"),
                                   (older, "- gsm8k\n", f"{config}: not a mapping of flag: value; it holds the "
                                                        f"flags of {tmp_path / 'step_10'}'s run")]:
        state_file.write_text(state)
        if yaml_text is not None:
            config.write_text(yaml_text)
        with pytest.raises(SystemExit) as stop:
            get_args(["--model", str(tmp_path / "step_10"), "--eval-only"])
        (line,) = capsys.readouterr().err.splitlines()
        assert stop.value.code == 1 and line.startswith(f"grpo_train.py: --eval-only: {said}"), line
    config.unlink()
    args = get_args(["--model", str(tmp_path / "step_10"), "--eval-only"])
    assert (args.eval_step, args.task) == (10, "gsm8k")


def test_eval_only_of_a_checkpoint_takes_the_flags_that_checkpoint_was_trained_with(tmp_path, capsys):
    """--eval-only --model runs/x/step_10 took its run's flags from runs/x/config.yaml, which each launch
    rewrites: after a --resume-with-changes --data b.jsonl, step_10 (trained on a.jsonl) was evaluated on
    b.jsonl's held-out set. The flags the step's grpo_state.json records win now, --eval-size among them (a
    resume may change it); config.yaml only fills in what a checkpoint of an earlier version did not record."""
    from checkpoints import read_state
    from grpo_train import get_args
    trained = ("--task", "custom", "--data", "a.jsonl", "--eval-size", "50", "--max-new-tokens", "32")
    state = {**read_state(True, **{**flags(*trained), "out_dir": str(tmp_path)}), "step": 10}
    (tmp_path / "step_10").mkdir()
    state_file = tmp_path / "step_10" / "grpo_state.json"
    state_file.write_text(json.dumps(state))
    # the later launch's flags
    (tmp_path / "config.yaml").write_text("task: custom\ndata: b.jsonl\neval_size: 30\nmax_new_tokens: 64\n")
    args = get_args(["--model", str(tmp_path / "step_10"), "--eval-only"])
    assert (args.eval_step, args.data, args.eval_size, args.max_new_tokens) == (10, "a.jsonl", 50, 32)
    assert "--data a.jsonl --max-new-tokens 32 --eval-size 50 (flags given here win)" in capsys.readouterr().out
    # a checkpoint that does not record --eval-size: that one from config.yaml, the rest its own
    del state["config"]["eval_size"]
    state_file.write_text(json.dumps(state))
    args = get_args(["--model", str(tmp_path / "step_10"), "--eval-only"])
    assert (args.data, args.eval_size, args.max_new_tokens) == ("a.jsonl", 30, 32)


def test_eval_only_leaves_a_training_runs_files_alone(tmp_path, capsys):
    """--eval-only --model <a hub model> without --out-dir writes into runs/grpo, the training's default
    folder too (and --out-dir may name a run's folder): it replaced that run's eval_completions.jsonl with its
    own outputs. It writes eval.json and eval_outputs.jsonl, names no training run writes, and every file of
    the run stays as it was."""
    from metrics import MetricsLog
    a_run(tmp_path, "--lr", "3e-4")
    jsonl(tmp_path / "eval_completions.jsonl", [{"eval/step": s, "completion": "the run's"} for s in (0, 10)])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    log = MetricsLog(0, **flags("--model", "m/hub", "--eval-only", "--out-dir", str(tmp_path)))
    log.write_eval(20, {"eval/accuracy": 0.5, "eval/format": 0.0, "eval/step": 0,
                        "eval/rows": [{"prompt": "1+1=", "completion": "2", "accuracy": 1.0}]})
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name not in before) == ["eval.json",
                                                                                  "eval_outputs.jsonl", "step_10"]
    result = json.loads((tmp_path / "eval.json").read_text())
    assert (result["model"], result["eval/size"], result["eval/accuracy"]) == ("m/hub", 20, 0.5)
    assert capsys.readouterr().out.splitlines()[-1] == json.dumps(result)
    assert [json.loads(line)["completion"] for line in (tmp_path / "eval_outputs.jsonl").open()] == ["2"]


LACKING = r"""
import os, shutil, sys
base, out, port = sys.argv[1:]
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
import deepspeed
from checkpoints import load_checkpoint, save_checkpoint
from ranks import skip_shm_allreduce_op
from run_setup import build_engine, load_policy

skip_shm_allreduce_op()
deepspeed.init_distributed()
model, tok = load_policy(base, grad_ckpt=False)
engine = build_engine(model, "ds_config.json", lr=1e-2, micro_batch=4)
save_checkpoint(engine, tok, out, {"step": 2, "ref": None}, keep=0)
folder = os.path.join(out, "step_2")
# each of DeepSpeed's files away in turn, as a user saving space would delete it
for name in sorted(n for n in os.listdir(folder) if n.endswith(".pt")):
    shutil.move(os.path.join(folder, name), out)
    try:
        load_checkpoint(engine, out, 2)
    except SystemExit as e:
        print("probe: exit", e.code, flush=True)
    shutil.move(os.path.join(out, name), folder)
# each cut to half its length in turn, as a copy that did not finish leaves it
for name in sorted(n for n in os.listdir(folder) if n.endswith(".pt")):
    path = os.path.join(folder, name)
    whole = open(path, "rb").read()
    open(path, "wb").write(whole[:len(whole) // 2])
    try:
        load_checkpoint(engine, out, 2)
    except SystemExit as e:
        print("probe: exit", e.code, flush=True)
    open(path, "wb").write(whole)
load_checkpoint(engine, out, 2)
print("probe: loaded", flush=True)
"""


def test_a_checkpoint_lacking_deepspeeds_files_stops_the_resume_in_one_line(tmp_path, tiny_model):
    """A step folder without DeepSpeed's model file or its optimizer shard (deleted to save space), or with
    one cut short (a copy that did not finish), ended --resume in a traceback (an AssertionError without a
    message, a FileNotFoundError, torch.load's RuntimeError). Each is one line naming the folder (and the
    missing file), exit status 1, before the run writes anything (metrics.jsonl stays)."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    p = subprocess.run([sys.executable, "-c", LACKING, tiny_model, str(tmp_path), str(next_port())], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    folder = tmp_path / "step_2"
    files = sorted(f.name for f in folder.glob("*.pt"))
    assert files == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"], files
    said = [line for line in p.stderr.splitlines() if line.startswith("grpo_train.py")]
    restart = (f"resume from another checkpoint (write its name into {tmp_path}/latest), or start a new run "
               f"from its weights (--model {folder}) in another --out-dir")
    assert said[:2] == [f"grpo_train.py: --resume: {folder} has no {name}, which DeepSpeed reads to resume: "
                        f"{restart}" for name in files], p.stderr[-3000:]
    assert len(said) == 4 and all(line.startswith(f"grpo_train.py: --resume: DeepSpeed could not load the "
                                                  f"checkpoint {folder} (") and line.endswith(f"): {restart}")
                                  for line in said[2:]), said
    probed = [line for line in p.stdout.splitlines() if line.startswith("probe: ")]
    assert "Traceback" not in p.stderr and probed == ["probe: exit 1"] * 4 + ["probe: loaded"], p.stdout
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_the_summary_line_and_completions_file(tmp_path, capsys):
    """The end of the run prints one line: held-out accuracy before -> after, the steps, the wall time and
    the last checkpoint; --log-completions 3 writes 3 sampled rows at each step."""
    from metrics import MetricsLog
    log = MetricsLog(0, **{**flags("--steps", "2", "--log-completions", "3"), "out_dir": str(tmp_path)})
    samples = [{"prompt": f"{i}+1=", "completion": "<answer>2</answer>", "reward": 0.5} for i in range(4)]
    row = {"reward/mean": 0.5, "loss": 0.1, "kl": 0.0, "entropy": 1.0, "completion_len/mean": 5.0,
           "frac_zero_std": 0.5, "clip/low": 0.25, "clip/high": 0.5}
    log.write({"step": 1, **row, "eval/accuracy": 0.25, "eval/step": 0, "samples": samples})
    log.write({"step": 2, **row, "eval/accuracy": 0.75, "eval/step": 2, "samples": samples})
    log.close(2)
    lines = capsys.readouterr().out.splitlines()
    assert "| clip 0.75 |" in lines[0]
    assert re.fullmatch(rf"done: held-out accuracy 0.250 \(step 0\) -> 0.750 \(step 2\); steps 1-2 in (\d+ min )?\d+ s; "
                        rf"last checkpoint {tmp_path}/step_2", lines[-1]), lines[-1]
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2] and rows[0] == {"step": 1, **samples[0]}
    assert "samples" not in (tmp_path / "metrics.jsonl").read_text()


def test_a_state_that_is_not_its_checkpoints_stops_the_resume_in_one_line_touching_nothing(tmp_path, capsys):
    """--resume took grpo_state.json on trust: step -3 was accepted, and metrics.jsonl went from 41 rows to 0;
    broken JSON was a traceback; a data position past what the run could have drawn was accepted (the
    shuffle then skipped towards it forever). Each is one line now, before anything is touched."""
    a_run(tmp_path, "--lr", "3e-4")
    rows = "".join(json.dumps({"step": s}) + "\n" for s in range(1, 42))
    (tmp_path / "metrics.jsonl").write_text(rows)
    state_file = tmp_path / "step_10" / "grpo_state.json"
    good = json.loads(state_file.read_text())
    # 10 steps of --prompts-per-step 8, one round each: at most 80 prompts drawn
    for state, said in [({**good, "step": -3}, "its step -3 is not the folder's (step_10)"),
                        ({**good, "step": 7}, "its step 7 is not the folder's (step_10)"),
                        ({**good, "data_pos": 10 ** 12}, "its data position 1000000000000 is not one a run "
                                                         "reaches by then (0 to 80)"),
                        ({**good, "data_pos": [3, -1]}, "its data position [3, -1] is not one"),
                        ({**good, "counts": {"skipped_steps": "2"}}, "its counts {'skipped_steps': '2'} are"),
                        ({**good, "ref": "/elsewhere/model"}, "its reference checkpoint '/elsewhere/model' is"),
                        ("{\"step\": 10, ", "grpo_state.json cannot be read (Expecting")]:
        state_file.write_text(state if isinstance(state, str) else json.dumps(state))
        line = refusal(capsys, tmp_path, "--lr", "3e-4", "--resume")
        assert line.startswith(f"grpo_train.py: --resume: {state_file}") and said in line, line
        assert (tmp_path / "metrics.jsonl").read_text() == rows
    (tmp_path / "latest").write_text("step_99")
    line = refusal(capsys, tmp_path, "--lr", "3e-4", "--resume")
    assert f"{tmp_path}/latest names 'step_99', no checkpoint folder step_N there" in line, line
    state_file.write_text(json.dumps({**good, "data_pos": 80}))
    (tmp_path / "latest").write_text("step_10")
    assert refusal(capsys, tmp_path, "--lr", "3e-4", "--resume") is None


def test_metrics_and_completions_are_cut_to_the_checkpoint_only_once_it_has_loaded(tmp_path):
    """On resume from step 10, metrics.jsonl, completions.jsonl and eval_completions.jsonl keep the rows up
    to step 10 (the completions files kept the later steps too, which the resumed run then wrote twice), and
    drop the torn line a killed run left last: the rewrite waits for the first row, which a run writes after
    its checkpoint has loaded (a checkpoint that fails to load leaves them all). A line that is JSON but no
    row of the file's (no step: a note added by hand) is dropped too, where it was a traceback."""
    from metrics import MetricsLog
    jsonl(tmp_path / "metrics.jsonl", [{"step": s} for s in range(1, 21)] + [{"note": "lr 3e-4"}, 7]
          + [{"step": s} for s in range(21, 42)], torn=True)
    jsonl(tmp_path / "completions.jsonl", [{"step": s} for s in range(1, 42)], torn=True)
    # an evaluation's rows name the step it scored
    jsonl(tmp_path / "eval_completions.jsonl", [{"eval/step": s} for s in range(0, 42, 5)], torn=True)
    files = ("metrics.jsonl", "completions.jsonl", "eval_completions.jsonl")
    before = [(tmp_path / name).read_text() for name in files]
    log = MetricsLog(10, **{**flags("--steps", "20", "--log-completions", "1"), "out_dir": str(tmp_path)})
    assert [(tmp_path / name).read_text() for name in files] == before
    log.write({"step": 11, **ROW, "samples": [{"prompt": "1+1=", "completion": "2"}]})
    assert steps_in(tmp_path / "metrics.jsonl") == list(range(1, 12))
    assert steps_in(tmp_path / "completions.jsonl") == list(range(1, 12))
    assert steps_in(tmp_path / "eval_completions.jsonl", "eval/step") == [0, 5, 10]


def test_a_resumed_runs_clock_and_tensorboard_charts_go_on_from_its_checkpoint(tmp_path):
    """time/elapsed_s started again at 0 on each resume (the plot's time axis ran back), and tensorboard kept
    the old run's points past the checkpoint beside the new ones (two values at each of steps 11-41)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from metrics import MetricsLog
    argv = ("--steps", "41", "--tensorboard")
    old = MetricsLog(0, **{**flags(*argv), "out_dir": str(tmp_path)})
    for step in range(1, 42):
        # the evaluation of step 10 arrives on step 12's line: carried back to step 10, and drawn there
        scored = {"eval/accuracy": 0.5, "eval/format": 1.0, "eval/step": 10} if step == 12 else {}
        old.write({"step": step, **ROW, **scored})
    old.tb.close()
    old.file.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({**r, "time/elapsed_s": 1000.0 + r["step"]})
                                                    + "\n" for r in rows))
    log = MetricsLog(10, **{**flags(*argv, "--resume"), "out_dir": str(tmp_path)})
    log.write({"step": 11, **ROW, "loss": 7.0})
    log.tb.close()
    # the kept rows say the run had gone 1010 s at step 10
    elapsed = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["time/elapsed_s"]
    assert 1010 <= elapsed < 1010 + 60
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == list(range(1, 12))
    assert [e.value for e in loss] == pytest.approx([0.1] * 10 + [7.0])
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(10, 0.5)]


def test_a_resume_keeps_the_evaluations_of_its_steps_that_arrived_on_later_rows(tmp_path, capsys):
    """An evaluation arrives a step or two after the step it scores (step 2's on step 4's line): a resume from
    step 2 kept the rows up to step 2 and lost it, while eval_completions.jsonl kept its outputs; nor did the
    resumed run evaluate step 2 again. It stays now, as a line of its own at step 2 (its eval/* keys and
    time), and the closing line counts it; the evaluation of step 4 goes with the steps after 2. A resumed run
    evaluates its checkpoint first only where --eval-every names that step and no line holds its evaluation
    (the run was killed before it arrived)."""
    from metrics import MetricsLog
    evaluation = lambda step, accuracy: {"eval/accuracy": accuracy, "eval/format": 0.5, "eval/step": step}
    jsonl(tmp_path / "metrics.jsonl", [{"step": 1, **ROW}, {"step": 2, **ROW, **evaluation(0, 0.25)},
                                       {"step": 3, **ROW}, {"step": 4, **ROW, **evaluation(2, 0.5),
                                                            "time/elapsed_s": 9.0},
                                       {"step": 4, **evaluation(4, 0.75)}])
    jsonl(tmp_path / "eval_completions.jsonl", [{"eval/step": s} for s in (0, 2, 4)])
    argv = ("--steps", "3", "--log-completions", "1", "--eval-every", "2")
    log = MetricsLog(2, **{**flags(*argv), "out_dir": str(tmp_path)})
    log.write({"step": 3, **ROW})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("eval/step")) for r in rows] == [(1, None), (2, 0), (2, 2), (3, None)]
    assert rows[2] == {"step": 2, **evaluation(2, 0.5), "time/elapsed_s": 9.0}
    assert steps_in(tmp_path / "eval_completions.jsonl", "eval/step") == [0, 2]
    assert log.evaluate_first is False
    log.close(3)
    assert "held-out accuracy 0.250 (step 0) -> 0.500 (step 2); steps 3-3" in capsys.readouterr().out
    # a kill after step 2's checkpoint, before its evaluation arrived: the resumed run evaluates it first
    jsonl(tmp_path / "metrics.jsonl", [{"step": 1, **ROW}, {"step": 2, **ROW, **evaluation(0, 0.25)}])
    assert MetricsLog(2, **{**flags(*argv), "out_dir": str(tmp_path)}).evaluate_first is True
    # a step --eval-every does not name; a new run, always
    assert MetricsLog(2, **{**flags("--eval-every", "3"), "out_dir": str(tmp_path)}).evaluate_first is False
    assert MetricsLog(0, **{**flags(), "out_dir": str(tmp_path)}).evaluate_first is True


def test_a_symlinked_step_folder_is_removed_never_followed(tmp_path):
    """Pruning and --overwrite met a step_N (or step_N.tmp) that is a symlink: a traceback (rmtree refuses
    links). The link is removed now, and what it points to stays whole."""
    from checkpoints import prune_checkpoints
    from metrics import MetricsLog
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    run = tmp_path / "run"
    for n in (10, 30):
        (run / f"step_{n}").mkdir(parents=True)
    (run / "step_20").symlink_to(outside)
    prune_checkpoints(str(run), 30, keep=1, ref=None)
    assert sorted(p.name for p in run.iterdir()) == ["step_30"]
    again = tmp_path / "again"
    a_run(again, "--lr", "3e-4")
    (again / "step_5").symlink_to(outside)
    (again / "step_11.tmp").symlink_to(outside)
    MetricsLog(0, **{**flags("--overwrite"), "out_dir": str(again)}).write({"step": 1, **ROW})
    assert sorted(p.name for p in again.iterdir()) == ["config.yaml", "metrics.jsonl"]
    assert (outside / "keep.txt").read_text() == "keep"


def test_zero_where_a_count_is_needed_is_one_line(capsys):
    """--sync-every 0 was a ZeroDivisionError at step 1, --threads 0 a traceback at start."""
    from grpo_train import get_args
    for flag in ("--sync-every", "--threads"):
        with pytest.raises(SystemExit) as stop:
            get_args(["--model", "m", flag, "0"])
        (line,) = capsys.readouterr().err.splitlines()
        assert stop.value.code == 1 and line == (f"grpo_train.py: argument {flag}: invalid at_least_one value: "
                                                 f"'0' (--help lists the flags)")


STOP_PROBE = """
import signal
import torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
from checkpoints import StopAfterStep, StopNow
def outcome(stop, signum):
    try:
        stop.on_signal(signum, None)
        return "asked"
    except StopNow as e:
        return f"now {e.code}"
stop = StopAfterStep()
print(stop.ending())
# a SIGTERM to the launch's whole group, then the launcher's own, and another later: all one request
print(outcome(stop, signal.SIGTERM), outcome(stop, signal.SIGTERM), stop.ending()[0])
# a terminal's Ctrl-C asks too; a second stops at once; SIGTERM still only asks
print(outcome(stop, signal.SIGINT), outcome(stop, signal.SIGINT), outcome(stop, signal.SIGTERM))
stop = StopAfterStep()
print(outcome(stop, signal.SIGINT), outcome(stop, signal.SIGTERM), stop.ending()[0])
"""


def test_stop_requests_only_a_second_ctrl_c_stops_at_once():
    """StopAfterStep, the handler of Ctrl-C and SIGTERM in the loop: each asks for the stop after the step;
    a second Ctrl-C stops at once (StopNow), a second SIGTERM never does (deepspeed's launcher passes on one
    that reached its whole process group). ending() names what asked first, with the line that continues
    the run; only the first request is announced, on rank 0."""
    out = subprocess.run([sys.executable, "-c", STOP_PROBE % next_port()], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    said = "the run stops after this step, with a checkpoint"
    assert [line for line in out.stdout.splitlines() if line] == [
        "None", f"SIGTERM: {said}", "asked asked SIGTERM", "asked now 130 asked",
        f"Ctrl-C: {said} (Ctrl-C again: at once)", "asked asked Ctrl-C"], out.stdout
