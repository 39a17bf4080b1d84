import math
import os
import threading

import pytest

import rewards
from rewards import REWARDS, parse_reward_spec, score

GOOD = "<think>6*7 is 42</think>\n<answer>42</answer>"


@pytest.mark.parametrize("text,expected", [
    (GOOD, 1.0),
    ("<think>x</think><answer>1</answer>", 1.0),
    ("  \n<think>\nmulti\nline\n</think>  \n\n <answer> 1 </answer>\n ", 1.0),
    ("<think></think><answer></answer>", 1.0),                          # empty sections still have the shape
    ("<answer>42</answer>", 0.0),                                       # no think
    ("<think>x</think>", 0.0),                                          # no answer
    ("<answer>42</answer><think>x</think>", 0.0),                       # wrong order
    ("so <think>x</think><answer>1</answer>", 0.0),                     # text before
    ("<think>x</think><answer>1</answer> and more", 0.0),               # text after
    ("<think>x</think> hmm <answer>1</answer>", 0.0),                   # text between
    ("<think>x</think><answer>1</answer><answer>2</answer>", 0.0),      # two answers
    ("<think>a<think>b</think><answer>1</answer>", 0.0),                # nested think
    ("<think>x</think><answer>1", 0.0),                                 # unclosed
    ("", 0.0),
])
def test_format(text, expected):
    assert REWARDS["format"](text, {}) == expected


@pytest.mark.parametrize("pred,gold,expected", [
    ("42", "42", 1.0),
    ("43", "42", 0.0),
    ("1,000", "1000", 1.0),
    ("1000", "1,000", 1.0),
    ("-7", "-7", 1.0),
    ("7", "-7", 0.0),
    ("3.50", "3.5", 1.0),
    ("$18", "18", 1.0),
    ("The answer is 18.", "18", 1.0),
    ("", "18", 0.0),
    ("banana", "18", 0.0),
    ("42", "Natalia sold 48/2 = 24 clips in May.\n#### 42", 1.0),  # raw GSM8K solution as the gold
])
def test_gsm8k(pred, gold, expected):
    assert REWARDS["gsm8k"](f"<think>t</think><answer>{pred}</answer>", {"answer": gold}) == expected


@pytest.mark.parametrize("text,sample", [
    ("42", {"answer": "42"}),                                           # no tags at all
    ("<answer>42", {"answer": "42"}),                                   # unclosed
    ("<answer>42</answer>", {}),                                        # no gold
    ("<answer>" + "1" * 1000 + "</answer>", {"answer": "1"}),           # overlong answer
    (None, {"answer": "42"}),                                           # not even a string
    ("<answer>42</answer>", None),
])
def test_gsm8k_malformed_is_zero(text, sample):
    assert REWARDS["gsm8k"](text, sample) == 0.0
    assert REWARDS["demo"](text, sample) == 0.0


def test_gsm8k_last_answer_counts():
    assert REWARDS["gsm8k"]("<answer>1</answer> no wait <answer>2</answer>", {"answer": "2"}) == 1.0
    assert REWARDS["gsm8k"]("<answer>2</answer> no wait <answer>1</answer>", {"answer": "2"}) == 0.0


def test_gsm8k_off_main_thread():
    # math-verify's signal.alarm timeout raises off the main thread; the reward must still grade correctly
    out = []
    score_it = lambda: out.append(REWARDS["gsm8k"]("<answer>1,000</answer>", {"answer": "1000"}))
    th = threading.Thread(target=score_it)
    th.start()
    th.join(30)
    assert out == [1.0]


@pytest.mark.parametrize("text,gold,expected", [
    ("<think>x</think><answer>42</answer>", "42", 1.0),
    ("<answer> -3 \n</answer>", "-3", 1.0),
    ("<answer>42</answer>", 42, 1.0),                                   # int gold
    ("<answer>43</answer>", "42", 0.0),
    ("<answer>42.0</answer>", "42", 0.0),                               # exact string, not math
    ("<answer>1</answer><answer>42</answer>", "42", 1.0),               # last answer
])
def test_demo(text, gold, expected):
    assert REWARDS["demo"](text, {"answer": gold}) == expected


def test_parse_reward_spec():
    assert parse_reward_spec("gsm8k,format:0.5") == [("gsm8k", 1.0), ("format", 0.5)]
    assert parse_reward_spec(" demo : 2 , format:-1") == [("demo", 2.0), ("format", -1.0)]
    for bad in ["nope", "gsm8k,nope:1", "format:abc", "format:nan", "format:inf", "", "format,format"]:
        with pytest.raises(ValueError) as e:
            parse_reward_spec(bad)
        if "nope" in bad or bad == "":
            assert "gsm8k" in str(e.value) and "format" in str(e.value)    # names the valid rewards
    # every advantage would be 0: the run learned nothing, and said nothing
    with pytest.raises(ValueError, match=r"^every weight in 'demo:0,format:0' is 0: no reward to learn from$"):
        parse_reward_spec("demo:0,format:0")
    assert parse_reward_spec("demo:0,format:1") == [("demo", 0.0), ("format", 1.0)]


def test_score(monkeypatch, capsys):
    total, comps, errors = score(GOOD, {"answer": "42"}, parse_reward_spec("demo,format:0.5"))
    assert (total, comps, errors) == (1.5, {"demo": 1.0, "format": 1.0}, 0)

    def boom(completion, sample):
        raise RuntimeError("bug in a reward")
    monkeypatch.setitem(REWARDS, "boom", boom)
    monkeypatch.setitem(REWARDS, "nan", lambda c, s: math.nan)
    total, comps, errors = score(GOOD, {"answer": "42"}, [("boom", 1.0), ("nan", 1.0), ("format", 2.0)])
    assert (total, comps, errors) == (2.0, {"boom": 0.0, "nan": 0.0, "format": 1.0}, 2)
    assert "bug in a reward" in capsys.readouterr().err   # the first traceback is shown...
    assert score(GOOD, {"answer": "42"}, [("boom", 1.0)])[2] == 1
    assert capsys.readouterr().err == ""                    # ...once


def test_last_answer():
    assert rewards.last_answer("<answer>a</answer><answer>b</answer>") == "b"
    assert rewards.last_answer("<answer>a<answer>b</answer>") == "b"
    assert rewards.last_answer("</answer><answer>") is None
    assert rewards.last_answer("<answer>a</answer> then <answer>unclosed") == "a"
    assert rewards.last_answer("no tags") is None


@pytest.mark.parametrize("text,inside", [
    ("<answer>41</answer> wait, no: 42</answer>", "41"),   # a stray </answer> closes nothing
    ("<answer>x<answer>42</answer>y</answer>", "42"),       # nested: the innermost
])
def test_only_text_inside_the_answer_tags_is_graded(text, inside):
    """A stray </answer> after the answer made everything up to it the answer: text outside the tags was
    graded, and "42" after "<answer>41</answer>" scored as the answer 42."""
    assert rewards.last_answer(text) == inside
    assert REWARDS["gsm8k"](text, {"answer": "42"}) == (1.0 if inside == "42" else 0.0)


CODE_ANSWERS = ["def add(a, b):\n    return a + b", "def add(a, b):\n    return a + b if a > 0 else 1",
                "def add(a, b):\n    return 3", "import os\nos._exit(0)", "while True:\n    pass", "def add(a, b) return"]


def test_reward_workers_run_jails_at_once_with_the_serial_scores(monkeypatch):
    """--reward-workers N: the code reward's jails run N at a time (bounded by the cores and the memory),
    and every completion gets the score it gets alone, in order. The overlap is counted, not timed."""
    tests = {"tests": ["assert add(1, 2) == 3", "assert add(-5, 5) == 0", "assert add(10, 32) == 42"]}
    items = [(f"<think>.</think><answer>{code}</answer>", tests, i) for i, code in enumerate(CODE_ANSWERS * 2)]
    items.append(("no answer", tests, len(items)))
    spec = parse_reward_spec("code,format:0.5")
    serial = rewards.score_all(items, spec, workers=1)
    assert [item for item, _ in serial] == items
    assert [s[1] for s in serial] == [score(text, sample, spec) for text, sample, _ in items]
    assert [s[1]["code"] for _, s in serial[:6]] == [1.0, 2 / 3, 1 / 3, 0.0, 0.0, 0.0]

    active, most, lock, run_tests = [0], [0], threading.Lock(), rewards.sandbox.run_tests

    def counted(*args, **kwargs):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            return run_tests(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1
    monkeypatch.setattr(rewards.sandbox, "run_tests", counted)
    assert rewards.score_all(items, spec, workers=8) == serial
    bound = rewards.reward_workers(8)
    assert 1 <= bound <= min(8, len(os.sched_getaffinity(0))) and most[0] == bound
    assert rewards.reward_workers(10 ** 6) <= len(os.sched_getaffinity(0))


def test_the_reward_workers_flag(capsys):
    from grpo_train import get_args
    assert get_args(["--model", "m", "--reward-workers", "4"]).reward_workers == 4
    assert get_args(["--model", "m"]).reward_workers == 1   # one jail at a time unless asked
    with pytest.raises(SystemExit):
        get_args(["--model", "m", "--reward-workers", "0"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--reward-workers" in err


def test_a_countdown_answer_stored_as_a_json_float_counts():
    """An answer stored as the JSON number 0.2 was read as the double nearest it (3602879701896397 /
    18014398509481984), which no expression of integers equals: every completion scored 0. A float is now
    the decimal the file wrote."""
    for numbers, gold, expression in [([1, 5], 0.2, "1 / 5"), ([3, 10], 0.3, "3 / 10"), ([5, 2], 2.5, "5 / 2")]:
        sample = {"numbers": numbers, "answer": gold}
        assert REWARDS["countdown"](f"<answer>{expression}</answer>", sample) == 1.0, gold
        assert REWARDS["countdown"](f"<answer>{expression} + 0</answer>", sample) == 0.0
    assert REWARDS["countdown"]("<answer>1 / 5</answer>", {"numbers": [1, 5], "answer": 0.21}) == 0.0
    assert REWARDS["countdown"]("<answer>1 / 3</answer>", {"numbers": [1, 3], "answer": 1 / 3}) == 0.0


def test_the_code_reward_never_raises_on_tests_that_are_no_text():
    """tests=[1] raised TypeError out of the code reward: a sample without a test string has no tests, 0."""
    answer = "<answer>def f():\n    return 1</answer>"
    for tests in ([1], [None], ["assert f() == 1", 2], [["assert f() == 1"]]):
        assert REWARDS["code"](answer, {"tests": tests}) == 0.0, tests
