"""Prompt sets for grpo_train.py. A sample is a dict with at least "prompt" (the exact text fed to the model)
and "answer" (the gold answer the rewards compare against).

    demo       the offline demo's arithmetic (demo/task.py), plain-text prompts
    gsm8k      grade-school math: the hub's openai/gsm8k "main", or local files (--data); gold = the number
               after "####" in the solution
    countdown  reach a target from 3 or 4 numbers with + - * /, each number once: generated from a seed
               (held-out problems from a fixed seed), or read from files with "numbers" and "target"
    code       small Python functions (PROBLEMS) checked by unit tests in a jail (sandbox.py)
    custom     the user's own prompts: a JSONL/JSON/Parquet file, a folder with train/test files, or a hub
               dataset (--data, "name:config" for one of several configs), with a prompt column and an
               answer column (prompt_key, answer_key); every other column stays in the sample for the
               rewards (e.g. "tests" for the code reward)

Prompts of the real tasks go through the tokenizer's chat template with SYSTEM_PROMPT (chat_template "auto");
with chat_template "none" a custom prompt is the column's text exactly, a built-in task's the plain text.
A task read from files that has no test split returns None for it: run_setup.load_prompts then holds out rows
of the train split. data_files.py reads --data; a problem with the user's data is a DataError naming the
file, line and column; so is a column that a reward of --rewards reads (rewards.COLUMNS) missing or of the
wrong type.
"""
import itertools
import json
import operator
import os
import random
from fractions import Fraction

import rewards
from data_files import DATA_SUFFIXES, DataError, hub_records, local_records

SYSTEM_PROMPT = ("You are a careful problem solver. First think step by step inside <think> </think>, then "
                 "give only the final answer inside <answer> </answer>.")
COUNTDOWN_SIZES = {"train": 10000, "test": 500}
COUNTDOWN_TEST_SEED = 1234   # the held-out problems never depend on --seed, so runs compare
ARITHMETIC = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def shuffled_forever(n: int, seed: int, skip: int = 0):
    """Indices 0..n-1, a fresh shuffle each pass over the data; the first `skip` are left out (a resumed run
    continues where the checkpoint stopped)."""
    rng = random.Random(seed)
    order = itertools.chain.from_iterable(rng.sample(range(n), n) for _ in itertools.count())
    yield from itertools.islice(order, skip, None)


def drop_long_prompts(samples: list[dict], tokenizer, max_len: int) -> tuple[list[dict], int]:
    """-> (samples whose prompt is at most max_len tokens, each with its token ids as "prompt_ids", which vLLM
    is given; number skipped). Never truncates: a cut prompt would ask another question."""
    tokenized = [{**s, "prompt_ids": tokenizer(s["prompt"], add_special_tokens=False)["input_ids"]}
                 for s in samples]
    kept = [s for s in tokenized if len(s["prompt_ids"]) <= max_len]
    return kept, len(samples) - len(kept)


def chat_prompt(tokenizer, user: str, chat_template: str = "auto") -> str:
    """System prompt + user turn + the start of the assistant's turn, as the tokenizer's chat template writes
    them; with chat_template "none", or a tokenizer without a template (a base model's), the same text as
    plain paragraphs."""
    if tokenizer is None:
        raise ValueError("this task builds its prompts with the tokenizer's chat template: pass tokenizer=")
    if chat_template == "none" or not getattr(tokenizer, "chat_template", None):
        return f"{SYSTEM_PROMPT}\n\n{user}\n\n"
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def gsm8k_samples(split: str, data: str | None, tokenizer, chat_template: str) -> list[dict] | None:
    if data is None:   # from the hub (needs the internet once; cached by datasets afterwards)
        records = hub_records("openai/gsm8k", split, config="main", lead="--task gsm8k without --data "
                              "reads openai/gsm8k from the hub (--data: a local copy)")
    elif (records := local_records(data, split)) is None:
        return None
    out = []
    for where, r in records:
        if not (isinstance(r, dict) and isinstance(r.get("question"), str)
                and isinstance(r.get("answer"), str) and "####" in r["answer"]):
            raise DataError(f"{where}: a GSM8K record needs a 'question' and an 'answer' ending in "
                            f"'#### <number>'")
        gold = r["answer"].split("####")[-1].strip().replace(",", "")
        out.append({"prompt": chat_prompt(tokenizer, r["question"], chat_template), "answer": gold})
    return out


def countdown_problems(n: int, seed: int, exclude=frozenset()) -> list[dict]:
    """n distinct solvable problems: 3 or 4 numbers in 1..99 combined by a random expression (kept as
    "solution") whose value, an integer in 1..999, is the target. The value is worked out exactly as the
    expression is built (None once it divides by zero), not parsed back from its text: that took 40% of the
    time to draw the 10,500 problems of a run (about 54,000 drafts)."""
    rng, out, seen = random.Random(seed), [], set(exclude)
    while len(out) < n:
        numbers = [rng.randint(1, 99) for _ in range(rng.choice((3, 4)))]
        terms = [(str(x), Fraction(x)) for x in rng.sample(numbers, len(numbers))]
        while len(terms) > 1:   # join two random neighbours with a random operator
            i = rng.randrange(len(terms) - 1)
            (left, x), (right, y), op = terms[i], terms[i + 1], rng.choice("+-*/")
            value = None if x is None or y is None or (op == "/" and y == 0) else ARITHMETIC[op](x, y)
            terms[i:i + 2] = [(f"({left} {op} {right})", value)]
        (solution, value), = terms
        key = (tuple(sorted(numbers)), value)
        if value is not None and value.denominator == 1 and 1 <= value <= 999 and key not in seen:
            seen.add(key)
            out.append({"numbers": numbers, "target": int(value), "solution": solution[1:-1]})
    return out


def countdown_record(where: str, r) -> dict:
    """r if it has "numbers" (a list of integers of 0 or more: rewards.countdown_numbers) and an integer
    "target", else a DataError naming `where`: a malformed problem would score 0 forever, silently."""
    # not bool, not float: the reward compares exact integers
    if not (isinstance(r, dict) and rewards.countdown_numbers(r.get("numbers"))
            and type(r.get("target")) is int):
        raise DataError(f"{where}: a Countdown record needs 'numbers' (a list of integers of 0 or more) and "
                        f"an integer 'target'")
    return r


def countdown_samples(split: str, data: str | None, seed: int, tokenizer,
                      chat_template: str) -> list[dict] | None:
    if data is not None:
        if (records := local_records(data, split)) is None:
            return None
        problems = [countdown_record(where, r) for where, r in records]
    else:
        test = countdown_problems(COUNTDOWN_SIZES["test"], COUNTDOWN_TEST_SEED)
        held_out = {(tuple(sorted(p["numbers"])), p["target"]) for p in test}
        problems = test if split == "test" else countdown_problems(COUNTDOWN_SIZES["train"], seed, held_out)
    out = []
    for p in problems:
        user = (f"Using the numbers {p['numbers']}, write an equation that equals {p['target']}. Use + - * / "
                f"and parentheses; use each number exactly once. Put only the expression, like (1 + 2) * 3, "
                f"in <answer> </answer>.")
        out.append({**p, "prompt": chat_prompt(tokenizer, user, chat_template), "answer": p["target"]})
    return out


# (function, what it must do, a reference solution, unit tests): written for this project
PROBLEMS = [
    ("add(a, b)", "returns the sum of a and b", "def add(a, b):\n    return a + b",
     ["assert add(1, 2) == 3", "assert add(-5, 5) == 0", "assert add(10, 32) == 42"]),
    ("is_even(n)", "returns True if the integer n is even", "def is_even(n):\n    return n % 2 == 0",
     ["assert is_even(4)", "assert not is_even(7)", "assert is_even(0)", "assert not is_even(-3)"]),
    ("reverse(s)", "returns the string s reversed", "def reverse(s):\n    return s[::-1]",
     ["assert reverse('abc') == 'cba'", "assert reverse('') == ''",
      "assert reverse('racecar') == 'racecar'"]),
    ("maximum(xs)", "returns the largest number of the non-empty list xs without using max()",
     "def maximum(xs):\n    m = xs[0]\n    for x in xs:\n        if x > m:\n            m = x\n    return m",
     ["assert maximum([1, 5, 3]) == 5", "assert maximum([-2, -9]) == -2", "assert maximum([7]) == 7"]),
    ("count_vowels(s)", "returns how many characters of s are vowels (a, e, i, o, u, either case)",
     "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)",
     ["assert count_vowels('hello') == 2", "assert count_vowels('xyz') == 0",
      "assert count_vowels('AEiou') == 5"]),
    ("factorial(n)", "returns n! for an integer n >= 0",
     "def factorial(n):\n    r = 1\n    for i in range(2, n + 1):\n        r *= i\n    return r",
     ["assert factorial(0) == 1", "assert factorial(5) == 120", "assert factorial(10) == 3628800"]),
    ("fib(n)", "returns the n-th Fibonacci number, fib(0) = 0 and fib(1) = 1",
     "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
     ["assert fib(0) == 0", "assert fib(1) == 1", "assert fib(10) == 55", "assert fib(30) == 832040"]),
    ("is_palindrome(s)", "returns True if s reads the same backwards, ignoring case",
     "def is_palindrome(s):\n    return s.lower() == s.lower()[::-1]",
     ["assert is_palindrome('Level')", "assert not is_palindrome('abc')", "assert is_palindrome('')"]),
    ("sum_digits(n)", "returns the sum of the decimal digits of the integer n >= 0",
     "def sum_digits(n):\n    return sum(int(d) for d in str(n))",
     ["assert sum_digits(0) == 0", "assert sum_digits(123) == 6", "assert sum_digits(9999) == 36"]),
    ("unique(xs)", "returns the elements of xs without repeats, in the order they first appear",
     "def unique(xs):\n    out = []\n    for x in xs:\n        if x not in out:\n"
     "            out.append(x)\n    return out",
     ["assert unique([1, 2, 1, 3, 2]) == [1, 2, 3]", "assert unique([]) == []",
      "assert unique(['a', 'a']) == ['a']"]),
    ("gcd(a, b)", "returns the greatest common divisor of two positive integers",
     "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a",
     ["assert gcd(12, 18) == 6", "assert gcd(7, 13) == 1", "assert gcd(100, 10) == 10"]),
    ("is_prime(n)", "returns True if the integer n is a prime number",
     "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))",
     ["assert is_prime(2)", "assert not is_prime(1)", "assert is_prime(97)", "assert not is_prime(91)"]),
    ("word_count(s)", "returns the number of words of s, words being separated by whitespace",
     "def word_count(s):\n    return len(s.split())",
     ["assert word_count('a b  c') == 3", "assert word_count('') == 0", "assert word_count(' one ') == 1"]),
    ("flatten(xss)", "returns one list with the elements of the lists in xss, in order",
     "def flatten(xss):\n    return [x for xs in xss for x in xs]",
     ["assert flatten([[1], [2, 3], []]) == [1, 2, 3]", "assert flatten([]) == []"]),
    ("clamp(x, lo, hi)", "returns x limited to the range lo..hi",
     "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))",
     ["assert clamp(5, 0, 10) == 5", "assert clamp(-1, 0, 10) == 0", "assert clamp(11, 0, 10) == 10"]),
    ("second_largest(xs)", "returns the second largest distinct value of xs (which has at least two)",
     "def second_largest(xs):\n    return sorted(set(xs))[-2]",
     ["assert second_largest([1, 3, 2]) == 2", "assert second_largest([5, 5, 4]) == 4"]),
]


def code_samples(split: str, tokenizer, chat_template: str) -> list[dict]:
    """Every fourth problem is held out ("test")."""
    out = []
    for i, (signature, what, solution, tests) in enumerate(PROBLEMS):
        if (i % 4 == 3) == (split == "test"):
            user = (f"Write a Python function `{signature}` that {what}. Put only the code of the function "
                    f"in <answer> </answer>.")
            prompt = chat_prompt(tokenizer, user, chat_template)
            out.append({"prompt": prompt, "answer": solution, "tests": tests})
    return out


def check_columns(where: str, r: dict, names, answer_key: str = "answer") -> None:
    """A DataError naming `where` if record r lacks a column that a reward of `names` reads (rewards.COLUMNS;
    its "answer" is r's answer_key), or holds in it what the reward cannot use: every row would score 0."""
    for name in names:
        for column, (what, ok) in rewards.COLUMNS.get(name, {}).items():
            key = answer_key if column == "answer" else column
            if key not in r:
                raise DataError(f"{where}: no {key!r} column, which reward {name!r} reads; this record has "
                                f"{', '.join(map(repr, r))}")
            if not ok(r[key]):
                raise DataError(f"{where}: reward {name!r} needs the {key!r} column to be {what}, not "
                                f"{json.dumps(r[key], default=repr)[:60]}")


def custom_samples(split: str, data: str | None, tokenizer, prompt_key: str, answer_key: str,
                   chat_template: str, names=()) -> list[dict] | None:
    """Records of --data (local files as data_file finds them, else a hub dataset's split, "name:config" for
    one of its configs; None for a test split it lacks): the prompt column through chat_prompt (with
    chat_template "none", as it is), the answer column as "answer", the other columns as they are."""
    if data is None:
        raise DataError("--task custom reads --data: a JSONL, JSON or Parquet file, a folder with train/test "
                        "files, or a hub dataset name")
    # a file's name (or a path) that is not there is a typo, not a hub dataset to look for; nor is a link
    if os.path.lexists(data) or data.endswith(DATA_SUFFIXES) or data.startswith((".", "/", "~")):
        records = local_records(data, split)
    else:
        name, _, config = data.partition(":")
        records = hub_records(name, split, config or None, f"--data {data}: no such file or folder")
    if records is None:
        return None
    out = []
    for where, r in records:
        # a JSONL line may hold any JSON value: `5`, `null`, a string
        if not isinstance(r, dict):
            raise DataError(f"{where}: a record must be a JSON object ({{\"{prompt_key}\": ..., "
                            f"\"{answer_key}\": ...}}), not {json.dumps(r)[:60]}")
        # the code reward's tests: each one the trainer can judge, or the run stops here
        if "tests" in r:
            try:
                rewards.check_tests(r["tests"])
            except ValueError as e:
                raise DataError(f"{where}: the 'tests' column: {e}") from None
        for key, flag in ((prompt_key, "--prompt-key"), (answer_key, "--answer-key")):
            if key not in r:
                raise DataError(f"{where}: no {key!r} column ({flag}); this record has "
                                f"{', '.join(map(repr, r))}")
            if r[key] is None:
                raise DataError(f"{where}: the {key!r} column is null")
        if not isinstance(r[prompt_key], str):
            raise DataError(f"{where}: the {prompt_key!r} column must be text, "
                            f"not {type(r[prompt_key]).__name__}")
        # a blank prompt asks nothing (vLLM refuses an empty one: its error ended the run at the first batch)
        if not r[prompt_key].strip():
            raise DataError(f"{where}: the {prompt_key!r} column is empty")
        check_columns(where, r, names, answer_key)
        prompt = r[prompt_key] if chat_template == "none" else chat_prompt(tokenizer, r[prompt_key])
        out.append({**r, "prompt": prompt, "answer": r[answer_key]})
    return out


def load_task(name: str, split: str, *, data: str | None = None, seed: int = 0, tokenizer=None,
              prompt_key: str = "prompt", answer_key: str = "answer", chat_template: str = "auto",
              reward_spec: str | None = None) -> list[dict] | None:
    """split is "train" (sampled for GRPO) or "test" (held out, for evaluation only; None when --data has no
    test split); prompt_key and answer_key name the columns of --task custom; chat_template "auto" applies
    the tokenizer's, "none" leaves the prompts as text (the demo's are plain text either way). reward_spec
    (--rewards): the samples must have the columns its rewards read (check_columns)."""
    names = [n for n, _ in rewards.parse_reward_spec(reward_spec, jail=False)] if reward_spec else []
    # a path from the user's home (~/x.jsonl, as a shell would expand it unquoted, and a --config file not)
    data = os.path.expanduser(data) if data else data
    if name == "custom":
        return custom_samples(split, data, tokenizer, prompt_key, answer_key, chat_template, names)
    if name == "demo":
        from demo.task import make_samples
        samples = make_samples(split, seed=seed)
    elif name == "gsm8k":
        samples = gsm8k_samples(split, data, tokenizer, chat_template)
    elif name == "countdown":
        samples = countdown_samples(split, data, seed, tokenizer, chat_template)
    elif name == "code":
        samples = code_samples(split, tokenizer, chat_template)
    else:
        raise DataError(f"--task {name}: unknown: expected one of demo, gsm8k, countdown, code, custom")
    # a task's samples are all alike: the first says whether the rewards can score any
    if samples:
        check_columns(f"--task {name}", samples[0], names)
    return samples
