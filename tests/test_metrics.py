"""metrics.py: the "no learning signal" warning and the step line."""
from metrics import MetricsLog, NoSignalWatch


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
