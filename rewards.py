"""Reward functions for GRPO. Each is `fn(completion: str, sample: dict) -> float`, pure, and never raises.

    format  1.0 if the completion is <think>...</think> then <answer>...</answer>, with only whitespace
            around and between them (no nested tags), else 0.0
    gsm8k   1.0 if the last <answer>...</answer> equals sample["answer"] according to math-verify
            (so "1,000" == "1000", "3.50" == "3.5"), else 0.0
    demo    1.0 if the last <answer>...</answer>, stripped, is exactly the string sample["answer"]
            ("42", "-3")
    countdown  1.0 if the last <answer>...</answer> is an expression of + - * / and parentheses (parsed
            with `ast`, never eval'ed) using each of sample["numbers"] (integers of 0 or more) exactly once,
            whose value is sample["answer"]: a number (a float as written: 0.2 is 1/5), or a string of one
            ("24", "-3", "7/2": JSONL data stores answers as text)
    code    fraction of sample["tests"] that pass after the code in the last <answer>...</answer> has run,
            in a bubblewrap jail (sandbox.py), judged by the trainer (judge.py: check_tests refuses, when the
            task loads, a test it cannot judge); nan (counted in reward/errors) when the jail could not run it

Pick and weight them with --rewards "gsm8k,format:0.5" (parse_reward_spec) and combine them with score(), or
score_all() for a batch (the code reward's jails --reward-workers at a time). COLUMNS says which sample
columns a reward reads: a task that lacks them stops when it loads.
"""
import ast
import math
import operator
import os
import re
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from functools import partial

import sandbox

_BODY = r"(?:(?!</?(?:think|answer)>).)*"  # any text without a think/answer tag in it
FORMAT_RE = re.compile(rf"\s*<think>{_BODY}</think>\s*<answer>{_BODY}</answer>\s*", re.DOTALL)
MAX_ANSWER_CHARS = 200  # a final answer is short; this also bounds sympy's time when no timeout can be set
_REPORTED = set()   # reward names whose first failure has been shown


def last_answer(completion: str) -> str | None:
    """Content of the last well-formed <answer>...</answer>, or None: an <answer> and the first </answer>
    after it, with no answer tag between them. So the innermost where they nest
    ("<answer>x<answer>42</answer>y</answer>" -> "42"), and a stray </answer> after the pair closes nothing
    ("<answer>41</answer> wait, no: 42</answer>" -> "41"): text outside the tags is never the answer."""
    # the last <answer> before the last </answer>: every <answer> after it has no </answer> to close it
    start = completion.rfind("<answer>", 0, max(completion.rfind("</answer>"), 0))
    if start < 0:
        return None
    start += len("<answer>")
    return completion[start:completion.find("</answer>", start)]


def format_reward(completion, sample):
    return 1.0 if isinstance(completion, str) and FORMAT_RE.fullmatch(completion) else 0.0


def gsm8k_reward(completion, sample):
    pred = last_answer(completion) if isinstance(completion, str) else None
    gold = sample.get("answer") if isinstance(sample, dict) else None
    if pred is None or gold is None or len(pred) > MAX_ANSWER_CHARS:
        return 0.0
    gold = str(gold).split("####")[-1]  # also accept a raw GSM8K solution ending in "#### 42"
    # math-verify's timeouts use signal.alarm, which only works in the main thread (elsewhere it raises
    # ValueError, which would silently score everything 0); off the main thread run without a timeout.
    t = 5 if threading.current_thread() is threading.main_thread() else None
    # imported at the first use: 0.4 s (with sympy) at the start of every run, on tasks that never use it
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException
    try:
        g, p = parse(gold, parsing_timeout=t), parse(pred, parsing_timeout=t)
        return 1.0 if g and p and verify(g, p, timeout_seconds=t) else 0.0
    except (Exception, TimeoutException):  # TimeoutException is a BaseException; never let it escape
        return 0.0


def demo_reward(completion, sample):
    pred = last_answer(completion) if isinstance(completion, str) else None
    gold = sample.get("answer") if isinstance(sample, dict) else None
    return 1.0 if pred is not None and gold is not None and pred.strip() == str(gold).strip() else 0.0


def overlong_penalty(n_tokens: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment, added to the reward by grpo_train.py --overlong-buffer: 0 up to
    max_tokens - buffer tokens, then falling linearly to -1 at max_tokens (0 when buffer is 0)."""
    if buffer <= 0:
        return 0.0
    return max(-1.0, min(0.0, (max_tokens - buffer - n_tokens) / buffer))


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def countdown_value(expr: str, used: list | None = None) -> Fraction | None:
    """Exact value of an expression of integers, + - * / and parentheses, or None for anything else (names,
    calls, powers, unary minus, floats, division by zero, over MAX_ANSWER_CHARS). Parsed with `ast` and
    evaluated node by node: model output is never eval'ed. The integers met are appended to `used`."""
    def value(node):
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            if used is not None:
                used.append(node.value)
            return Fraction(node.value)
        raise ValueError(f"{type(node).__name__} is not allowed")
    if len(expr) > MAX_ANSWER_CHARS:
        return None
    try:
        return value(ast.parse(expr.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None


def exact_number(value) -> Fraction | None:
    """An answer column as an exact number: an int or a float, or a string of one ("24", " -3", "2.5",
    "7/2"), or None (a bool, other text, another type)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        # a float as its shortest decimal, the number the file wrote: Fraction(0.2) is the binary double
        # 3602879701896397/18014398509481984, which no expression of integers equals
        return Fraction(repr(value) if isinstance(value, float) else value)
    except (ValueError, ZeroDivisionError, OverflowError):   # "abc", "1/0", a float's inf or nan
        return None


def countdown_numbers(numbers) -> bool:
    """Whether a sample's "numbers" can all be used by an answer: a non-empty list of integers of 0 or more
    (not bool, not float: the answer's integers are compared exactly; and an answer has no unary minus, so
    a -3 could never be used)."""
    return isinstance(numbers, list) and bool(numbers) and all(type(x) is int and x >= 0 for x in numbers)


def countdown_reward(completion, sample):
    pred = last_answer(completion) if isinstance(completion, str) else None
    if pred is None or not isinstance(sample, dict):
        return 0.0
    used, numbers = [], sample.get("numbers")
    got = countdown_value(pred.split("=")[0], used)   # "(1 + 2) * 3 = 9" counts as its left side
    if got is None or not isinstance(numbers, (list, tuple)) or not all(type(x) is int for x in numbers):
        return 0.0   # also a malformed sample: sorting mixed or missing numbers would raise
    return 1.0 if sorted(used) == sorted(numbers) and got == exact_number(sample.get("answer")) else 0.0


def extract_code(completion: str) -> str | None:
    """The last <answer>...</answer>, without a ```python fence around it."""
    code = last_answer(completion) if isinstance(completion, str) else None
    if code is None:
        return None
    code = code.strip()
    if code.startswith("```"):
        code = code.split("\n", 1)[1] if "\n" in code else ""
        code = code.rsplit("```", 1)[0]
    return code


def are_tests(tests) -> bool:
    """Whether a sample's "tests" are tests at all: a non-empty list of strings."""
    return isinstance(tests, list) and bool(tests) and all(isinstance(t, str) for t in tests)


def check_tests(tests) -> None:
    """A sample's "tests", checked when the task loads: a list of `assert ...` lines, each one the trainer
    can judge (judge.split_test). ValueError naming the first that is not."""
    if not are_tests(tests):
        raise ValueError(f"expected a list of `assert ...` lines, got {str(tests)[:100]}")
    for test in tests:
        try:
            sandbox.split_test(test)
        except SyntaxError as e:
            raise ValueError(f"{test!r} is not Python ({e.msg})") from None


def code_reward(completion, sample):
    """Fraction of the sample's unit tests that pass (sandbox.run_tests); 0 without an answer or tests (a
    non-empty list of strings)."""
    code = extract_code(completion)
    tests = sample.get("tests") if isinstance(sample, dict) else None
    if not code or not are_tests(tests):
        return 0.0
    try:
        return sandbox.run_tests(code, tests) / len(tests)
    except (OSError, RuntimeError, SyntaxError, ValueError) as e:
        # the jail did not start (or a test is malformed): not the completion's doing, so not a silent 0
        # but nan, which score() counts in reward/errors; the first cause is shown
        if "code" not in _REPORTED:
            _REPORTED.add("code")
            print(f"reward 'code' could not judge a completion (shown once): {e}", file=sys.stderr,
                  flush=True)
        return math.nan


# rewards whose work is a subprocess per completion, run --reward-workers at a time (score_all)
PARALLEL = {"code"}
REWARDS = {"format": format_reward, "gsm8k": gsm8k_reward, "demo": demo_reward, "countdown": countdown_reward,
           "code": code_reward}
# the sample columns a reward reads, each with what it must hold and a test of it: tasks.load_task refuses
# data without them in one line, where every row would score 0 and nothing would say why
COLUMNS = {
    "countdown": {"numbers": ("a list of integers of 0 or more", countdown_numbers),
                  "answer": ("a number or a string of one", lambda v: exact_number(v) is not None)},
    "code": {"tests": ("a list of `assert ...` lines", are_tests)},
}


def parse_reward_spec(spec: str, jail: bool = True) -> list[tuple[str, float]]:
    """'gsm8k,format:0.5' -> [('gsm8k', 1.0), ('format', 0.5)]. ValueError on an unknown name or bad weight,
    or for "code" where its jail cannot run (sandbox.check_jail): the run refuses to start, not score 0.
    jail=False leaves the jail untried (tasks.load_task reads the names alone)."""
    out = []
    for part in spec.split(","):
        name, _, weight = (x.strip() for x in part.partition(":"))
        if name not in REWARDS:
            raise ValueError(f"unknown reward {name!r} in {spec!r}; valid: {', '.join(REWARDS)}")
        if name in dict(out):
            raise ValueError(f"reward {name!r} listed twice in {spec!r}")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            w = math.nan
        if not math.isfinite(w):
            raise ValueError(f"bad weight {weight!r} for reward {name!r}; use name[:weight], valid names: "
                             f"{', '.join(REWARDS)}")
        out.append((name, w))
    # every reward 0: every advantage 0, nothing to learn from
    if not any(w for _, w in out):
        raise ValueError(f"every weight in {spec!r} is 0: no reward to learn from")
    if jail and "code" in dict(out):
        try:
            sandbox.check_jail()
        except RuntimeError as e:
            raise ValueError(f"reward 'code': {e}") from None
    return out


def reward_workers(wanted: int) -> int:
    """--reward-workers, bounded by the machine: at most one jail per core this process may use, and one
    per sandbox.jail_mb() of the memory available (what a jail may hold: its address space, its /tmp, and
    the pipes and memfds it may hold outside both)."""
    with open("/proc/meminfo") as f:
        available_kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    by_memory = (available_kb >> 10) // sandbox.jail_mb()
    return max(1, min(wanted, len(os.sched_getaffinity(0)), by_memory))


def judged(fn, name: str, completion: str, sample: dict) -> float:
    """fn(completion, sample) as a float; nan where it raised (its first traceback shown): a buggy reward
    must not kill the run."""
    try:
        return float(fn(completion, sample))
    except Exception:
        if name not in _REPORTED:
            _REPORTED.add(name)
            print(f"reward {name!r} raised (scored 0, counted in reward/errors; shown once):\n"
                  f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        return math.nan


def score_all(items: list, spec_list: list[tuple[str, float]], workers: int = 1) -> list:
    """[(completion, sample, ...)] -> [(item, (total, components, n_errors))] in order, each as score()
    gives it. The rewards of PARALLEL (each completion a subprocess: the code reward's jail) run `workers`
    completions at a time on threads (--reward-workers, bounded by reward_workers), the same scores as one
    at a time; the others run here, one at a time (gsm8k's timeout needs the main thread)."""
    items, columns = list(items), {}
    threads = reward_workers(workers) if any(name in PARALLEL for name, _ in spec_list) else 1
    completions, samples = [item[0] for item in items], [item[1] for item in items]
    with ThreadPoolExecutor(threads) as pool:
        for name, _ in spec_list:
            fn = partial(judged, REWARDS[name], name)   # an unknown name is a programming error: KeyError
            run = pool.map if name in PARALLEL and threads > 1 else map
            columns[name] = list(run(fn, completions, samples))
    out = []
    for i, item in enumerate(items):
        total, components, n_errors = 0.0, {}, 0
        for name, weight in spec_list:
            r = columns[name][i]
            if not math.isfinite(r):
                r, n_errors = 0.0, n_errors + 1
            components[name] = r
            total += weight * r
        out.append((item, (total, components, n_errors)))
    return out


def score(completion: str, sample: dict, spec_list: list[tuple[str, float]]) -> tuple[float, dict, int]:
    """-> (total, components, n_errors).

    total is the weighted sum; components maps each reward name to its unweighted value (logged as
    reward/<name>). A reward that raises or returns a non-finite value counts as 0.0 and adds 1 to
    n_errors."""
    return score_all([(completion, sample)], spec_list)[0][1]
