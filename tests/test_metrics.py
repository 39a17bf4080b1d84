"""metrics.py: the "no learning signal" warning, the step line and step 1's self-check."""
from metrics import FIRST_STEP_GAP, FIRST_STEP_KL, MetricsLog, NoSignalWatch, first_step_check

# the self-check's line, as first_step_check begins it
WARNING = "self-check at step 1 failed:"


def step(frac_zero_std=1.0, truncated=0.0, **rewards):
    rewards = rewards or {"demo": 0.0}
    parts = {f"reward/{k}": v for k, v in rewards.items()}
    return {"frac_zero_std": frac_zero_std, "completion_len/truncated": truncated, "completion_len/mean": 12.0,
            "reward/mean": sum(rewards.values()), "reward/errors": 0, "reward/overlong": 0.0, **parts}


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
    assert [line.split("|")[0] for line in lines[:3]] == ["step    1 ", "step    2 ", "step    3 "]
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
