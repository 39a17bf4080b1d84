"""Prompt sets (tasks.py) and the Countdown checker: local GSM8K files, chat-template prompts, Countdown
generation, the `ast` checker against hostile input, prompt-length skipping."""
import hashlib
import json
import os
import re

import pytest

import data_files
import rewards
import tasks
from demo.tiny_model import build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K = os.path.join(ROOT, "..", "shared", "data", "gsm8k")
TOK = build_tokenizer()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


GSM = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
       {"question": "A shirt costs $1,200. Two cost?", "answer": "2*1200=2400\n#### 2,400"}]


def test_gsm8k_from_a_local_folder_or_file_through_the_chat_template(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", GSM)
    write_jsonl(tmp_path / "test.jsonl", GSM[:1])
    samples = tasks.load_task("gsm8k", "train", data=str(tmp_path), tokenizer=TOK)
    assert [s["answer"] for s in samples] == ["7", "2400"]   # after the last ####, commas dropped
    assert samples[0]["prompt"] == ("<|im_start|>system\n" + tasks.SYSTEM_PROMPT
                                    + "<|im_end|>\n<|im_start|>user\n" + GSM[0]["question"]
                                    + "<|im_end|>\n<|im_start|>assistant\n")
    # one file: the other split is found by swapping train/test in its name
    assert len(tasks.load_task("gsm8k", "test", data=str(tmp_path / "train.jsonl"), tokenizer=TOK)) == 1
    assert rewards.gsm8k_reward("<think>x</think><answer>2400</answer>", samples[1]) == 1.0


def test_gsm8k_bad_data_is_a_clear_error(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", GSM)
    # a folder without a test split: None, and run_setup.load_prompts holds rows of train out
    assert tasks.load_task("gsm8k", "test", data=str(tmp_path), tokenizer=TOK) is None
    (tmp_path / "test.jsonl").write_text(json.dumps(GSM[0]) + "\n{not json\n")
    with pytest.raises(tasks.DataError, match=r"test.jsonl:2: not a JSON line"):
        tasks.load_task("gsm8k", "test", data=str(tmp_path), tokenizer=TOK)
    (tmp_path / "test.jsonl").write_text(json.dumps(GSM[0]) + "\n\n"
                                         + json.dumps({"question": "q", "answer": "5"}))
    # the line, blank lines counted
    with pytest.raises(tasks.DataError, match=r"test.jsonl:3: a GSM8K record needs"):
        tasks.load_task("gsm8k", "test", data=str(tmp_path), tokenizer=TOK)
    with pytest.raises(tasks.DataError, match=r"--data .*other.jsonl: no such file or folder"):
        tasks.load_task("gsm8k", "test", data=str(tmp_path / "other.jsonl"), tokenizer=TOK)
    write_jsonl(tmp_path / "gsm_train_v2.jsonl", GSM)
    assert tasks.load_task("gsm8k", "test", data=str(tmp_path / "gsm_train_v2.jsonl"), tokenizer=TOK) is None
    with pytest.raises(ValueError, match="tokenizer"):
        tasks.load_task("gsm8k", "train", data=str(tmp_path), tokenizer=None)


def test_any_file_name_is_data_and_the_other_split_is_found_by_its_word(tmp_path):
    """A file whose name has neither "train" nor "test" is the train split alone (never refused);
    one with either word finds the other split by swapping the word, a word alone ("contest" is no test)."""
    rows = lambda tag: [{"prompt": f"{tag} {i}", "answer": str(i)} for i in range(3)]
    load = lambda path, split: tasks.load_task("custom", split, data=str(path), tokenizer=TOK)
    write_jsonl(tmp_path / "my.jsonl", rows("mine"))
    assert [s["answer"] for s in load(tmp_path / "my.jsonl", "train")] == ["0", "1", "2"]
    assert load(tmp_path / "my.jsonl", "test") is None
    write_jsonl(tmp_path / "contest.jsonl", rows("contest"))
    assert len(load(tmp_path / "contest.jsonl", "train")) == 3
    assert load(tmp_path / "contest.jsonl", "test") is None
    write_jsonl(tmp_path / "q_train_v2.jsonl", rows("train"))
    write_jsonl(tmp_path / "q_test_v2.jsonl", rows("test")[:1])
    for given in ("q_train_v2.jsonl", "q_test_v2.jsonl"):   # either file names both splits
        assert load(tmp_path / given, "train")[0]["prompt"].endswith("train 0<|im_end|>\n<|im_start|>assistant\n")
        assert len(load(tmp_path / given, "test")) == 1
    write_jsonl(tmp_path / "only_test.jsonl", rows("test"))
    with pytest.raises(tasks.DataError, match=r"--data .*only_test.jsonl: no train split \(looked for "
                                              r".*only_train.jsonl\)"):
        load(tmp_path / "only_test.jsonl", "train")
    (tmp_path / "my.csv").write_text("prompt,answer\nx,1\n")
    with pytest.raises(tasks.DataError, match=r"--data .*my.csv: not a JSONL or Parquet file"):
        load(tmp_path / "my.csv", "train")
    # a file name that is not there is a typo, never a hub dataset to look up
    with pytest.raises(tasks.DataError, match=r"--data data/mine.jsonl: no such file or folder"):
        load("data/mine.jsonl", "train")


def test_chat_template_none_keeps_the_prompts_as_they_are(tmp_path):
    write_jsonl(tmp_path / "my.jsonl", [{"prompt": "12+34=", "answer": "46"}])
    (s,) = tasks.load_task("custom", "train", data=str(tmp_path / "my.jsonl"), tokenizer=TOK, chat_template="none")
    assert s["prompt"] == "12+34="   # a completion-style prompt, exactly as written
    write_jsonl(tmp_path / "train.jsonl", GSM[:1])
    (g,) = tasks.load_task("gsm8k", "train", data=str(tmp_path), tokenizer=TOK, chat_template="none")
    # a built-in task: the plain-text form
    assert g["prompt"] == tasks.SYSTEM_PROMPT + "\n\n" + GSM[0]["question"] + "\n\n"


def test_gsm8k_from_parquet(tmp_path):
    import datasets
    datasets.Dataset.from_list(GSM).to_parquet(str(tmp_path / "train.parquet"))
    samples = tasks.load_task("gsm8k", "train", data=str(tmp_path), tokenizer=TOK)
    assert [s["answer"] for s in samples] == ["7", "2400"]


def test_a_tokenizer_without_chat_template_gets_plain_text(tmp_path):
    tok = build_tokenizer()
    tok.chat_template = None   # a base model's tokenizer
    write_jsonl(tmp_path / "train.jsonl", GSM[:1])
    (s,) = tasks.load_task("gsm8k", "train", data=str(tmp_path), tokenizer=tok)
    assert s["prompt"] == tasks.SYSTEM_PROMPT + "\n\n" + GSM[0]["question"] + "\n\n"


def test_real_gsm8k_files():
    if not os.path.isdir(GSM8K):
        pytest.skip("the GSM8K files are not on this machine")
    train = tasks.load_task("gsm8k", "train", data=GSM8K, tokenizer=TOK)
    test = tasks.load_task("gsm8k", "test", data=GSM8K, tokenizer=TOK)
    assert (len(train), len(test)) == (7473, 1319)
    assert all(float(s["answer"]) == float(s["answer"]) for s in train + test)   # every gold is a number


def test_countdown_problems_are_seeded_solvable_and_held_out():
    # the held-out problems are the same in every version, so that runs compare: the first three, and all 500
    assert tasks.countdown_problems(3, tasks.COUNTDOWN_TEST_SEED) == [
        {"numbers": [7, 10, 76], "target": 228, "solution": "(10 - 7) * 76"},
        {"numbers": [29, 65, 12], "target": 106, "solution": "12 + (65 + 29)"},
        {"numbers": [69, 20, 64, 99], "target": 84, "solution": "((99 - 20) + 69) - 64"}]
    held_out = json.dumps(tasks.countdown_problems(500, tasks.COUNTDOWN_TEST_SEED)).encode()
    assert hashlib.sha256(held_out).hexdigest() == "fc7f0130179ecfe2e6958bfdc251b825a8894a8af62dd2e85c28bde20ee505ac"
    a = tasks.countdown_problems(300, seed=7)
    assert a == tasks.countdown_problems(300, seed=7) and a != tasks.countdown_problems(300, seed=8)
    test = tasks.load_task("countdown", "test", tokenizer=TOK)
    train = tasks.load_task("countdown", "train", tokenizer=TOK, seed=3)
    assert (len(train), len(test)) == (10000, 500)
    assert test == tasks.load_task("countdown", "test", tokenizer=TOK, seed=4)   # held-out set: fixed seed
    key = lambda s: (tuple(sorted(s["numbers"])), s["answer"])
    assert not {key(s) for s in train} & {key(s) for s in test}   # disjoint splits
    for s in train[:2000] + test:   # the expression that made each problem solves it
        assert 3 <= len(s["numbers"]) <= 4 and 1 <= s["answer"] <= 999
        assert rewards.countdown_reward(f"<think>.</think><answer>{s['solution']}</answer>", s) == 1.0


def test_countdown_from_a_file(tmp_path):
    write_jsonl(tmp_path / "countdown_test.jsonl", [{"numbers": [3, 5, 7], "target": 22}])
    (s,) = tasks.load_task("countdown", "test", data=str(tmp_path / "countdown_test.jsonl"), tokenizer=TOK)
    assert s["answer"] == 22 and "[3, 5, 7]" in s["prompt"] and "22" in s["prompt"]
    assert s["prompt"].startswith("<|im_start|>system\n" + tasks.SYSTEM_PROMPT)
    assert rewards.countdown_reward("<answer>3 * 5 + 7</answer>", s) == 1.0
    for bad in [{"numbers": [3, 5, 7]}, {"numbers": [3, 5, 7], "target": 22.0},
                {"numbers": "3 5 7", "target": 22},
                {"numbers": [3, "5", 7], "target": 22}, {"numbers": [], "target": 22}, [3, 5, 7]]:
        write_jsonl(tmp_path / "countdown_train.jsonl", [{"numbers": [1, 2, 3], "target": 6}, bad])
        with pytest.raises(ValueError, match=r"countdown_train.jsonl:2: a Countdown record needs"):
            tasks.load_task("countdown", "train", data=str(tmp_path / "countdown_test.jsonl"), tokenizer=TOK)


SAMPLE = {"numbers": [3, 5, 7], "answer": 22}


@pytest.mark.parametrize("answer,expected", [
    ("3 * 5 + 7", 1.0), ("(7 + 5 * 3)", 1.0), (" 7+3*5 = 22", 1.0),   # any order; a trailing "= 22" is fine
    ("3 * 5 + 6", 0.0),                       # wrong numbers
    ("3 * 5 - 7", 0.0),                       # wrong value
    ("3 * 5 + 7 + 3 - 3", 0.0),               # a number used twice
    ("3 * 5 + 7 * 1", 0.0),                   # a number not given
    ("3 * 5", 0.0),                           # a number missing
    ("(3 + 5 + 7) / (5 - 5)", 0.0),           # division by zero
    ("3 ** 5 + 7", 0.0), ("9 ** 9 ** 9", 0.0),   # no powers (and no huge numbers)
    ("-3 + 5 * 7", 0.0), ("-(-3 * 5) + 7", 0.0),   # no unary minus (the second is worth 22)
    ("3.0 * 5 + 7", 0.0),                     # integers only
    ("__import__('os').system('touch /tmp/pwned') or 22", 0.0),
    ("(lambda: 22)()", 0.0), ("[3, 5, 7][0]", 0.0), ("().__class__", 0.0), ("x", 0.0), ("'22'", 0.0),
    ("(" * 500 + "3" + ")" * 500, 0.0),        # over the length limit, never parsed
    ("", 0.0), ("3 * (5 + 7", 0.0),
])
def test_countdown_checker(answer, expected):
    assert rewards.countdown_reward(f"<think>.</think><answer>{answer}</answer>", SAMPLE) == expected
    assert not os.path.exists("/tmp/pwned")


def test_countdown_checker_refuses_powers_even_when_right():
    sample = {"numbers": [2, 3, 7], "answer": 15}
    assert rewards.countdown_reward("<answer>2 ** 3 + 7</answer>", sample) == 0.0
    four = {**sample, "numbers": [2, 2, 3, 7]}
    assert rewards.countdown_reward("<answer>2 * 3 + 7 + 2</answer>", four) == 1.0


def test_countdown_answers_stored_as_text_count(tmp_path):
    """--task custom keeps the answer column as the file has it, and JSONL files store answers as text
    ("24"): the countdown reward compared its exact value with the string, and every sample scored 0."""
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "Make 24 from 2, 3, 4.", "numbers": [2, 3, 4],
                                            "answer": "24"}])
    (s,) = tasks.load_task("custom", "train", data=str(tmp_path / "train.jsonl"), tokenizer=TOK)
    assert rewards.countdown_reward("<answer>2 * 3 * 4</answer>", s) == 1.0
    assert rewards.countdown_reward("<answer>2 * 3 + 4</answer>", s) == 0.0
    for gold, expected in [(" 22 ", 1.0), ("22.0", 1.0), (22.0, 1.0), ("44/2", 1.0), ("21", 0.0),
                           ("twenty-two", 0.0), ("1/0", 0.0), ("", 0.0), (None, 0.0), (True, 0.0),
                           ([22], 0.0), (float("nan"), 0.0)]:
        assert rewards.countdown_reward("<answer>3 * 5 + 7</answer>", {**SAMPLE, "answer": gold}) == expected, gold


def test_countdown_checker_never_raises():
    for completion, sample in [(None, SAMPLE), ("no answer", SAMPLE), ("<answer>1</answer>", None),
                               ("<answer>1</answer>", {}), ("<answer>" + "1+" * 5000 + "1</answer>", SAMPLE),
                               ("<answer>3 * 5 + 7</answer>", {**SAMPLE, "numbers": None}),
                               ("<answer>3 * 5 + 7</answer>", {**SAMPLE, "numbers": [3, "5", 7]})]:
        assert rewards.countdown_reward(completion, sample) == 0.0


def test_long_prompts_are_skipped_and_counted_never_truncated():
    samples = [{"prompt": "x" * n, "answer": "1"} for n in (3, 10, 4, 5, 11)]   # one token per character
    kept, skipped = tasks.drop_long_prompts(samples, TOK, max_len=4)
    ids = lambda s: TOK(s["prompt"], add_special_tokens=False)["input_ids"]
    # untouched, not truncated, with the token ids that were measured
    assert kept == [{**s, "prompt_ids": ids(s)} for s in (samples[0], samples[2])] and skipped == 3


# ------------------------------------------------------------------------ --task custom: the user's own data

MINE = [{"prompt": "What is 6 times 7?", "answer": "42", "source": "mine"},
        {"prompt": "Name the capital of France.", "answer": "Paris", "source": "mine"}]


def test_custom_task_from_a_folder_through_the_chat_template(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", MINE)
    write_jsonl(tmp_path / "test.jsonl", MINE[:1])
    train = tasks.load_task("custom", "train", data=str(tmp_path), tokenizer=TOK)
    assert train[0]["prompt"] == ("<|im_start|>system\n" + tasks.SYSTEM_PROMPT
                                  + "<|im_end|>\n<|im_start|>user\n" + MINE[0]["prompt"]
                                  + "<|im_end|>\n<|im_start|>assistant\n")
    assert [(s["answer"], s["source"]) for s in train] == [("42", "mine"), ("Paris", "mine")]   # columns kept
    assert len(tasks.load_task("custom", "test", data=str(tmp_path), tokenizer=TOK)) == 1
    spec = rewards.parse_reward_spec("demo,format:0.5")   # any reward of rewards.py scores it
    assert rewards.score("<think>6*7</think><answer>42</answer>", train[0], spec)[0] == 1.5
    assert rewards.score("<think>hm</think><answer>Lyon</answer>", train[1], spec)[0] == 0.5


def test_custom_task_with_other_column_names_parquet_and_no_chat_template(tmp_path):
    import datasets
    rows = [{"question": r["prompt"], "solution": r["answer"]} for r in MINE]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "my_train.parquet"))
    tok = build_tokenizer()
    tok.chat_template = None   # a base model's tokenizer: plain text
    (s, _) = tasks.load_task("custom", "train", data=str(tmp_path / "my_train.parquet"), tokenizer=tok,
                             prompt_key="question", answer_key="solution")
    assert s["prompt"] == tasks.SYSTEM_PROMPT + "\n\n" + MINE[0]["prompt"] + "\n\n" and s["answer"] == "42"
    assert rewards.gsm8k_reward("<think>.</think><answer>42</answer>", s) == 1.0


def test_custom_task_scored_by_the_code_reward(tmp_path):
    # a "tests" column travels with the sample to the code reward, which runs the completion in its jail
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "Write double(x).", "answer": "",
                                            "tests": ["assert double(2) == 4", "assert double(-1) == -2"]}])
    (s,) = tasks.load_task("custom", "train", data=str(tmp_path / "train.jsonl"), tokenizer=TOK)
    assert rewards.code_reward("<answer>def double(x):\n    return 2 * x</answer>", s) == 1.0
    assert rewards.code_reward("<answer>def double(x):\n    return 4</answer>", s) == 0.5


def test_custom_task_errors_name_the_file_and_the_column(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [MINE[0], {"question": "q", "answer": "a"}])
    with pytest.raises(ValueError, match=r"train.jsonl:2: no 'prompt' column \(--prompt-key\); this record has "
                                         r"'question', 'answer'"):
        tasks.load_task("custom", "train", data=str(tmp_path), tokenizer=TOK)
    with pytest.raises(ValueError, match=r"train.jsonl:1: no 'label' column \(--answer-key\)"):
        tasks.load_task("custom", "train", data=str(tmp_path), tokenizer=TOK, answer_key="label")
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": [{"role": "user", "content": "hi"}], "answer": "a"}])
    with pytest.raises(ValueError, match=r"train.jsonl:1: the 'prompt' column must be text, not list"):
        tasks.load_task("custom", "train", data=str(tmp_path), tokenizer=TOK)
    # it said "no 'answer' column", then named it among the record's
    write_jsonl(tmp_path / "train.jsonl", [MINE[0], {"prompt": "q", "answer": None}])
    with pytest.raises(ValueError, match=r"train.jsonl:2: the 'answer' column is null$"):
        tasks.load_task("custom", "train", data=str(tmp_path), tokenizer=TOK)
    # vLLM refused it in the generation process, with its traceback, at the first batch
    write_jsonl(tmp_path / "train.jsonl", [MINE[0], {"prompt": " ", "answer": "a"}])
    with pytest.raises(ValueError, match=r"train.jsonl:2: the 'prompt' column is empty$"):
        tasks.load_task("custom", "train", data=str(tmp_path), tokenizer=TOK, chat_template="none")
    with pytest.raises(ValueError, match="--task custom reads --data"):
        tasks.load_task("custom", "train", tokenizer=TOK)
    with pytest.raises(tasks.DataError, match="--task nope: unknown.*custom"):
        tasks.load_task("nope", "train", tokenizer=TOK)


# ------------------------------------------------------------- run_setup.load_prompts: held out, one-line errors

def load_prompts(path, **kw):
    from run_setup import load_prompts
    flags = {"task": "custom", "data": str(path), "seed": 0, "max_prompt_len": 512, "eval_size": 10,
             "prompt_key": "prompt", "answer_key": "answer", "chat_template": "auto", **kw}
    return load_prompts(TOK, **flags)


def test_data_without_a_test_split_holds_out_eval_size_rows_never_trained_on(tmp_path, capsys):
    write_jsonl(tmp_path / "my.jsonl", [{"prompt": f"question {i}", "answer": str(i)} for i in range(50)])
    train, held_out, too_long = load_prompts(tmp_path / "my.jsonl")
    assert (len(train), len(held_out), too_long) == (40, 10, 0)
    answers = lambda samples: {s["answer"] for s in samples}
    assert not answers(train) & answers(held_out) and answers(train) | answers(held_out) == answers(
        [{"answer": str(i)} for i in range(50)])
    # the same rows whatever --seed (runs compare), and not simply the first or last ones
    assert answers(load_prompts(tmp_path / "my.jsonl", seed=7)[1]) == answers(held_out)
    assert answers(held_out) not in ({str(i) for i in range(10)}, {str(i) for i in range(40, 50)})
    out = capsys.readouterr().out
    assert "40 prompts to train on" in out and "no test split: 10 of its rows" in out
    assert "never trained on)" in out
    with pytest.raises(SystemExit) as stop:   # nothing left to train on: one line, no traceback
        load_prompts(tmp_path / "my.jsonl", eval_size=50)
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.count("\n") == 1 and "--eval-size 50" in err and "no test split" in err
    # one distinct prompt, however many rows: no --eval-size helps (it advised a smaller one)
    write_jsonl(tmp_path / "one.jsonl", [{"prompt": "question", "answer": "1"}] * 3)
    with pytest.raises(SystemExit):
        load_prompts(tmp_path / "one.jsonl", eval_size=1)
    assert capsys.readouterr().err.endswith("has no test split and 1 distinct prompt: --eval-size 1 held out of "
                                            "them would leave none to train on (add prompts, or a test split)\n")


def test_data_mistakes_stop_the_run_with_one_line(tmp_path, capsys):
    write_jsonl(tmp_path / "my.jsonl", [{"prompt": "q", "answer": "a"}, {"question": "q", "answer": "a"}])
    (tmp_path / "bad.jsonl").write_text('{"prompt": "q", "answer": "a"}\n{"prompt": "q", \n')
    for path, expected in [(tmp_path / "nope.jsonl", "--data .*nope.jsonl: no such file or folder"),
                           (tmp_path / "my.jsonl", r".*my.jsonl:2: no 'prompt' column \(--prompt-key\)"),
                           (tmp_path / "bad.jsonl", r".*bad.jsonl:2: not a JSON line")]:
        with pytest.raises(SystemExit) as stop:
            load_prompts(path)
        err = capsys.readouterr().err
        assert stop.value.code == 1 and err.count("\n") == 1 and "Traceback" not in err
        assert re.match("grpo_train.py: " + expected, err), err


def test_malformed_records_stop_the_run_with_one_line_naming_the_file_and_line(tmp_path, capsys):
    """Each was a traceback: a GSM8K answer that is no text (an AttributeError), a custom line that is no
    JSON object (a TypeError, even before the check for one), a unit test nested thousands deep (a
    RecursionError). Now each stops the run in one line naming the file, the line and the column."""
    good = {"prompt": "p", "answer": "a"}
    write_jsonl(tmp_path / "gsm.jsonl", [GSM[0], {"question": "q", "answer": ["#### 5"]}])
    cases = [("gsm.jsonl", "gsm8k", "gsm.jsonl:2: a GSM8K record needs a 'question' and an 'answer' ending in "
                                    "'#### <number>'")]
    for i, line in enumerate(["5", "null", '"my tests"', "[1, 2]"]):
        (tmp_path / f"mine{i}.jsonl").write_text(json.dumps(good) + "\n" + line + "\n")
        cases.append((f"mine{i}.jsonl", "custom", f'mine{i}.jsonl:2: a record must be a JSON object ({{"prompt": '
                                                  f'..., "answer": ...}}), not {line}'))
    write_jsonl(tmp_path / "deep.jsonl", [good, {**good, "tests": ["assert f(1) == " + "+".join(["1"] * 3000)]}])
    cases.append(("deep.jsonl", "custom", "deep.jsonl:2: the 'tests' column: nested more than 100 deep: the "
                                          "trainer cannot judge 'assert f(1) == 1+1+1"))
    for name, task, line in cases:
        with pytest.raises(SystemExit) as stop:
            load_prompts(tmp_path / name, task=task)
        err = capsys.readouterr().err
        assert stop.value.code == 1 and err.count("\n") == 1, err
        assert err.startswith(f"grpo_train.py: {tmp_path}/{line}"), err


def test_a_name_that_is_no_file_a_lone_surrogate_or_a_test_it_cannot_judge_is_one_line(tmp_path, monkeypatch, capsys):
    """Each was a traceback: a --data name existing only as a broken link, and a name that is neither file
    nor folder while the hub cannot be reached, were looked for on the hub (35 s of retries here,
    then a ConnectionError), as --task gsm8k without --data read openai/gsm8k; a prompt holding a lone
    surrogate (\\ud800 in the JSON) was a tokenizer's TypeError. A test the code reward cannot judge went
    unnoticed until every completion scored nan. Now each stops the run, at once, in one line naming the
    flag, or the file and line."""
    import huggingface_hub
    # a hub that cannot be reached, wherever the tests run: nothing listens on port 9
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.chdir(tmp_path)
    os.symlink(tmp_path / "moved" / "train.jsonl", "mydata")
    write_jsonl(tmp_path / "surrogate.jsonl", [{"prompt": "a", "answer": "x"}, {"prompt": "b\ud800", "answer": "y"}])
    write_jsonl(tmp_path / "tests.jsonl", [{"prompt": "p", "answer": "", "tests": ["assert sorted([2, 1]) == [1]"]}])
    (tmp_path / "surrogate.json").write_text('[{"prompt": "a", "answer": "x"}, {"prompt": "b\\ud800", "answer": "y"}]')
    for data, line in [("mydata", f"--data mydata: a broken symbolic link (to {tmp_path}/moved/train.jsonl)"),
                       # the network error's name is the HTTP library's
                       ("otherdata", "--data otherdata: no such file or folder, and the hub cannot be reached to "
                                     "look for a dataset of that name (*); HF_HUB_OFFLINE=1 reads one from "
                                     "datasets' cache"),
                       ("surrogate.jsonl", r"surrogate.jsonl:2: holds a lone surrogate ('\ud800', half of a UTF-16 "
                                           "pair), which is no text"),
                       ("surrogate.json", r"surrogate.json row 2: holds a lone surrogate ('\ud800', half of a "
                                          "UTF-16 pair), which is no text"),
                       ("tests.jsonl", "tests.jsonl:1: the 'tests' column: it names nothing of the completion's")]:
        with pytest.raises(SystemExit) as stop:
            load_prompts(data)
        err = capsys.readouterr().err
        said = re.escape(f"grpo_train.py: {line}").replace(r"\*", r"\w+")
        assert stop.value.code == 1 and err.count("\n") == 1 and re.match(said, err), err
    # --task gsm8k without --data reads the hub's openai/gsm8k: 25 s of retries, then a traceback, before
    with pytest.raises(SystemExit) as stop:
        load_prompts(None, task="gsm8k", data=None)
    err = capsys.readouterr().err
    said = re.escape("grpo_train.py: --task gsm8k without --data reads openai/gsm8k from the hub (--data: a "
                     "local copy), and the hub cannot be reached to look for a dataset of that name (*); "
                     "HF_HUB_OFFLINE=1 reads one from datasets' cache").replace(r"\*", r"\w+")
    assert stop.value.code == 1 and err.count("\n") == 1 and re.match(said, err), err
    # a real dataset name is still the hub's to answer: an unknown one is one line too
    with pytest.raises(tasks.DataError, match="no such file or folder, nor a dataset on the hub"):
        tasks.load_task("custom", "train", data="not a dataset name!", tokenizer=TOK)


def test_prompts_too_long_through_the_chat_template_say_why(tmp_path, capsys):
    """A 6-token prompt became longer than --max-prompt-len 16 with the chat template, and the run
    stopped without saying why; --chat-template none trains on the prompts as they are."""
    sums = [{"prompt": f"{i}+34=", "answer": str(i + 34)} for i in range(10, 22)]
    write_jsonl(tmp_path / "my.jsonl", sums)
    with pytest.raises(SystemExit):
        load_prompts(tmp_path / "my.jsonl", max_prompt_len=16, eval_size=2)
    err = capsys.readouterr().err
    assert "all 10 are longer than --max-prompt-len 16 tokens" in err and "--chat-template none" in err
    train, held_out, _ = load_prompts(tmp_path / "my.jsonl", max_prompt_len=16, eval_size=2, chat_template="none")
    assert len(train) == 10 and all(s["prompt"].endswith("+34=") for s in train) and len(held_out) == 2


def test_duplicated_prompts_never_leak_into_the_held_out_split(tmp_path, capsys):
    """With each prompt twice in a file, the rows were held out one by one: every held-out prompt was also
    trained on, and nothing was said. The split is by distinct prompt; the line says how many rows repeat a
    held-out prompt (it said 50: every repeat in the file, the 40 left to training too)."""
    rows = [{"prompt": f"question {i}", "answer": str(i)} for i in range(50)]
    write_jsonl(tmp_path / "twice.jsonl", rows + rows[::-1])
    train, held_out, _ = load_prompts(tmp_path / "twice.jsonl", eval_size=10)
    prompts = lambda samples: [s["prompt"] for s in samples]
    assert len(held_out) == len(set(prompts(held_out))) == 10
    assert not set(prompts(train)) & set(prompts(held_out)) and len(train) == 80
    line = [x for x in capsys.readouterr().out.splitlines() if "held out" in x]
    assert len(line) == 1 and line[0].endswith(
        "never trained on; split by prompt: 10 rows repeating a prompt folded into it)")


def test_unreadable_files_are_one_line_naming_the_file(tmp_path, capsys):
    """A Latin-1 file raised UnicodeDecodeError, a corrupt Parquet file ArrowInvalid: tracebacks."""
    latin = '{"prompt": "q", "answer": "a"}\n{"prompt": "café", "answer": "b"}\n'.encode("latin-1")
    (tmp_path / "latin.jsonl").write_bytes(latin)
    with pytest.raises(tasks.DataError, match=r"latin.jsonl:2: not UTF-8 text \(byte 0xe9 at column 16\)"):
        tasks.load_task("custom", "train", data=str(tmp_path / "latin.jsonl"), tokenizer=TOK)
    (tmp_path / "train.parquet").write_bytes(b"PAR1" + os.urandom(2000))
    with pytest.raises(tasks.DataError, match=r"train.parquet: not a readable Parquet file \(.+\)$"):
        tasks.load_task("gsm8k", "train", data=str(tmp_path / "train.parquet"), tokenizer=TOK)
    for path in (tmp_path / "latin.jsonl", tmp_path / "train.parquet"):
        with pytest.raises(SystemExit):
            load_prompts(path)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and path.name in err


# ------------------------------------------------- what loaded but scored 0 forever, or ended in a traceback

def test_countdown_numbers_below_0_are_refused_when_the_file_loads(tmp_path):
    """An answer has no unary minus (-3 is one), so a problem with a negative number loaded and scored 0
    on every completion. It stops the run at load, as other malformed Countdown records do; 0 is a number."""
    write_jsonl(tmp_path / "countdown_train.jsonl", [{"numbers": [1, 2, 3], "target": 6},
                                                     {"numbers": [-3, 5, 7], "target": 9}])
    with pytest.raises(tasks.DataError, match=r"countdown_train.jsonl:2: a Countdown record needs 'numbers' \(a "
                                              r"list of integers of 0 or more\) and an integer 'target'$"):
        tasks.load_task("countdown", "train", data=str(tmp_path / "countdown_train.jsonl"), tokenizer=TOK)
    write_jsonl(tmp_path / "zero.jsonl", [{"numbers": [0, 5, 7], "target": 12}])
    (s,) = tasks.load_task("countdown", "train", data=str(tmp_path / "zero.jsonl"), tokenizer=TOK)
    assert rewards.countdown_reward("<answer>0 + 5 + 7</answer>", s) == 1.0


def test_a_column_a_reward_reads_missing_or_of_the_wrong_type_is_one_line(tmp_path, capsys):
    """MBPP's tests are in 'test_list', not 'tests': --rewards code scored 0 on every row, and said nothing;
    so did custom Countdown rows whose numbers were strings, and a built-in task scored by a reward that
    reads a column it lacks. Each reward says which columns it reads (rewards.COLUMNS): a row without one, or
    with what the reward cannot use, stops the run at load in one line naming the reward, file and column."""
    mbpp = {"prompt": "Write double(x).", "answer": "", "test_list": ["assert double(2) == 4"]}
    write_jsonl(tmp_path / "mbpp.jsonl", [mbpp])
    write_jsonl(tmp_path / "cd.jsonl", [{"prompt": "Make 22.", "numbers": [3, 5, 7], "answer": 22},
                                        {"prompt": "Make 22 again.", "numbers": ["3", "5", "7"], "answer": 22}])
    write_jsonl(tmp_path / "cd_key.jsonl", [{"prompt": "Make 22.", "numbers": [3, 5, 7], "target": "twenty-two"}])
    write_jsonl(tmp_path / "gsm.jsonl", GSM)
    for path, flags, line in [
            ("mbpp.jsonl", {"rewards": "code"}, "mbpp.jsonl:1: no 'tests' column, which reward 'code' reads; this "
                                                "record has 'prompt', 'answer', 'test_list'"),
            ("cd.jsonl", {"rewards": "countdown,format:0.5"},
             """cd.jsonl:2: reward 'countdown' needs the 'numbers' column to be a list of integers of 0 or more, """
             """not ["3", "5", "7"]"""),
            ("cd_key.jsonl", {"rewards": "countdown", "answer_key": "target"},
             """cd_key.jsonl:1: reward 'countdown' needs the 'target' column to be a number or a string of one, """
             """not "twenty-two\""""),
            ("gsm.jsonl", {"rewards": "countdown", "task": "gsm8k"},
             "--task gsm8k: no 'numbers' column, which reward 'countdown' reads; this record has 'prompt', "
             "'answer'")]:
        with pytest.raises(SystemExit) as stop:
            load_prompts(tmp_path / path, eval_size=1, **flags)
        err = capsys.readouterr().err
        assert stop.value.code == 1 and err.count("\n") == 1, err
        assert err == f"grpo_train.py: {'' if line.startswith('--') else f'{tmp_path}/'}{line}\n", err
    # the rows the rewards can score load as before
    write_jsonl(tmp_path / "mbpp.jsonl", [{**mbpp, "prompt": p, "tests": mbpp["test_list"]} for p in "ab"])
    assert len(load_prompts(tmp_path / "mbpp.jsonl", eval_size=1, rewards="code,format:0.5")[0]) == 1
    train, _, _ = load_prompts(tmp_path / "cd.jsonl", eval_size=1, rewards="gsm8k")
    assert len(train) == 1
    assert load_prompts(None, task="code", data=None, eval_size=1, rewards="code")[1]


def test_json_that_python_stops_at_and_a_file_that_cannot_be_read_are_one_line(tmp_path, monkeypatch, capsys):
    """An integer of more than 4,300 digits (a ValueError of Python's, no JSONDecodeError), 100,000 `[` in a
    line (a RecursionError), a file that cannot be read (PermissionError, EIO): each was a traceback."""
    good = json.dumps({"prompt": "q", "answer": "a"})
    (tmp_path / "big.jsonl").write_text(good + "\n" + '{"prompt": "q", "answer": ' + "9" * 5000 + "}\n")
    (tmp_path / "deep.jsonl").write_text(good + "\n\n" + "[" * 100_000 + "\n")
    os.symlink("/proc/self/mem", tmp_path / "mem.jsonl")
    (tmp_path / "locked.jsonl").write_text(good + "\n")
    for name, line in [("big.jsonl", "big.jsonl:2: not a JSON line that can be read (Exceeds the limit (4300 "
                                     "digits) for integer string conversion)"),
                       ("deep.jsonl", "deep.jsonl:3: not a JSON line that can be read (nested too deep)"),
                       ("mem.jsonl", "mem.jsonl: cannot be read (Input/output error)")]:
        with pytest.raises(SystemExit) as stop:
            load_prompts(tmp_path / name)
        err = capsys.readouterr().err
        assert stop.value.code == 1 and err == f"grpo_train.py: {tmp_path}/{line}\n", err

    # root reads any file: the refusal an unreadable file gets elsewhere
    def refused(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(data_files, "open", refused, raising=False)
    with pytest.raises(tasks.DataError, match=r"locked.jsonl: cannot be read \(Permission denied\)$"):
        tasks.load_task("custom", "train", data=str(tmp_path / "locked.jsonl"), tokenizer=TOK)


def test_hub_names_offline_a_nested_path_and_a_dataset_of_several_configs_are_one_line(tmp_path, monkeypatch):
    """Offline, a mistyped nested path (data/sub/my_set) reached datasets as a hub name and ended in its
    FileNotFoundError; a hub dataset of several configs (openai/gsm8k) in datasets' ValueError. Each is one
    line; the configs are named, and --data name:config picks one."""
    import datasets
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(tasks.DataError, match=r"^--data data/sub/my_set: no such file or folder, nor a dataset on "
                                              r"the hub$"):
        tasks.load_task("custom", "train", data="data/sub/my_set", tokenizer=TOK)
    # a dataset of two configs, as the hub's openai/gsm8k has (main, socratic), read by datasets itself
    (tmp_path / "gsm").mkdir()
    (tmp_path / "gsm" / "README.md").write_text(
        "---\nconfigs:\n" + "".join(f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}.jsonl\n"
                                    for c in ("main", "socratic")) + "---\n")
    for c in ("main", "socratic"):
        write_jsonl(tmp_path / "gsm" / f"{c}.jsonl", [{"prompt": f"a {c} question", "answer": "1"}])
    load_dataset = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config=None: load_dataset(
        str(tmp_path / "gsm"), config, cache_dir=str(tmp_path / "cache")) if name == "openai/gsm8k" else 1 / 0)
    for data in ("openai/gsm8k", "openai/gsm8k:nope"):
        with pytest.raises(tasks.DataError, match=rf"^--data {data}: the hub dataset's configs are main, socratic: "
                                                  r"name one, as --data openai/gsm8k:main$"):
            tasks.load_task("custom", "train", data=data, tokenizer=TOK)
    (s,) = tasks.load_task("custom", "train", data="openai/gsm8k:socratic", tokenizer=TOK, chat_template="none")
    assert s["prompt"] == "a socratic question"


def test_a_json_file_holding_one_array_is_read_and_a_folder_finds_train_json(tmp_path):
    """A .json file was read as JSON lines: json.dump's layout (one array, over many lines) stopped at
    `arr.json:1: not a JSON line`, and a folder holding train.json had no train split. A .json file that
    starts with `[` is one array of records; any other .json is JSON lines, as before."""
    (tmp_path / "arr.json").write_text(json.dumps(MINE, indent=2))
    train = tasks.load_task("custom", "train", data=str(tmp_path / "arr.json"), tokenizer=TOK, chat_template="none")
    assert [(s["prompt"], s["answer"]) for s in train] == [(r["prompt"], r["answer"]) for r in MINE]
    write_jsonl(tmp_path / "lines.json", MINE)
    assert len(tasks.load_task("custom", "train", data=str(tmp_path / "lines.json"), tokenizer=TOK)) == 2
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "train.json").write_text(json.dumps(GSM, indent=2))
    (tmp_path / "folder" / "test.json").write_text(json.dumps(GSM[:1], indent=2))
    assert [len(tasks.load_task("gsm8k", split, data=str(tmp_path / "folder"), tokenizer=TOK))
            for split in ("train", "test")] == [2, 1]
    # its mistakes name the row, or the line and column
    (tmp_path / "arr.json").write_text(json.dumps([MINE[0], 5], indent=2))
    with pytest.raises(tasks.DataError, match=r"arr.json row 2: a record must be a JSON object .*not 5$"):
        tasks.load_task("custom", "train", data=str(tmp_path / "arr.json"), tokenizer=TOK)
    (tmp_path / "arr.json").write_text('[\n  {"prompt": "q", "answer": "a"},\n  {"prompt": "q" "answer": "a"}\n]')
    with pytest.raises(tasks.DataError, match=r"arr.json:3: not JSON \(Expecting ',' delimiter, column 18\)$"):
        tasks.load_task("custom", "train", data=str(tmp_path / "arr.json"), tokenizer=TOK)
    (tmp_path / "obj.json").write_text(json.dumps(MINE[0], indent=2))
    with pytest.raises(tasks.DataError, match=r"obj.json:1: not a JSON line \(.*\); a .json file holds one JSON "
                                              r"array of records, or one record a line$"):
        tasks.load_task("custom", "train", data=str(tmp_path / "obj.json"), tokenizer=TOK)


def test_a_path_from_the_home_folder_is_read(tmp_path, monkeypatch):
    """--data '~/x.jsonl' (quoted, or in a --config file: no shell expands it) was "no such file or folder"."""
    monkeypatch.setenv("HOME", str(tmp_path))
    write_jsonl(tmp_path / "x.jsonl", MINE)
    write_jsonl(tmp_path / "gsm_train.jsonl", GSM)
    assert len(tasks.load_task("custom", "train", data="~/x.jsonl", tokenizer=TOK)) == 2
    assert len(tasks.load_task("gsm8k", "train", data="~/gsm_train.jsonl", tokenizer=TOK)) == 2
