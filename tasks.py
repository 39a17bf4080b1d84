"""Prompt sets for grpo_train.py. A sample is a dict with at least "prompt" (the exact text fed to the model)
and "answer" (the gold answer the rewards compare against).

    demo       the offline demo's arithmetic (demo/task.py), plain-text prompts
    gsm8k      grade-school math: the hub's openai/gsm8k "main", or local files (--data); gold = the number
               after "####" in the solution
    countdown  reach a target from 3 or 4 numbers with + - * /, each number once: generated from a seed
               (held-out problems from a fixed seed), or read from files with "numbers" and "target"
    code       small Python functions checked by unit tests in a sandbox (sandbox.py)

Prompts of the real tasks go through the tokenizer's chat template with SYSTEM_PROMPT.
"""
import itertools
import json
import os
import random

import rewards

SYSTEM_PROMPT = ("You are a careful problem solver. First think step by step inside <think> </think>, then give "
                 "only the final answer inside <answer> </answer>.")
COUNTDOWN_SIZES = {"train": 10000, "test": 500}
COUNTDOWN_TEST_SEED = 1234   # the held-out problems never depend on --seed, so runs compare


def shuffled_forever(n: int, seed: int, skip: int = 0):
    """Indices 0..n-1, a fresh shuffle each pass over the data; the first `skip` are left out (a resumed run
    continues where the checkpoint stopped)."""
    rng = random.Random(seed)
    order = itertools.chain.from_iterable(rng.sample(range(n), n) for _ in itertools.count())
    yield from itertools.islice(order, skip, None)


def drop_long_prompts(samples: list[dict], tokenizer, max_len: int) -> tuple[list[dict], int]:
    """-> (samples whose prompt is at most max_len tokens, number skipped). Never truncates: a cut prompt
    would ask another question."""
    kept = [s for s in samples if len(tokenizer(s["prompt"], add_special_tokens=False)["input_ids"]) <= max_len]
    return kept, len(samples) - len(kept)


def chat_prompt(tokenizer, user: str) -> str:
    """System prompt + user turn + the start of the assistant's turn, as the tokenizer's chat template writes
    them; a tokenizer without a template (a base model's) gets the same text as plain paragraphs."""
    if tokenizer is None:
        raise ValueError("this task builds its prompts with the tokenizer's chat template: pass tokenizer=")
    if not getattr(tokenizer, "chat_template", None):
        return f"{SYSTEM_PROMPT}\n\n{user}\n\n"
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def data_file(data: str, split: str) -> str:
    """--data is a folder holding {train,test}.{jsonl,parquet} (the layout of the GSM8K release), or one such
    file whose name contains "train" or "test": the other split is the file with that word swapped."""
    if os.path.isdir(data):
        candidates = [os.path.join(data, f"{split}.{ext}") for ext in ("jsonl", "parquet")]
    else:
        name, other = os.path.basename(data), "test" if split == "train" else "train"
        if split not in name and other not in name:
            raise ValueError(f"--data {data}: a file's name must contain 'train' or 'test' (or pass a folder)")
        candidates = [data if split in name else os.path.join(os.path.dirname(data), name.replace(other, split))]
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise ValueError(f"--data {data}: no {split} split (looked for {' and '.join(candidates)})")


def read_records(path: str) -> list[tuple[str, dict]]:
    """(where, record) for each record of a JSONL or Parquet file, where = "path:line" (or "path row i"), so
    that an error names the place; a bad line is a ValueError naming the file and line."""
    if path.endswith(".parquet"):
        import datasets
        return [(f"{path} row {i}", r) for i, r in enumerate(datasets.load_dataset("parquet", data_files=path,
                                                                                   split="train"), 1)]
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append((f"{path}:{i}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not a JSON line ({e})") from None
    return out


def gsm8k_samples(split: str, data: str | None, tokenizer) -> list[dict]:
    if data is None:   # from the hub (needs the internet once; cached by datasets afterwards)
        import datasets
        records = [(f"openai/gsm8k {split} row {i}", r)
                   for i, r in enumerate(datasets.load_dataset("openai/gsm8k", "main", split=split), 1)]
    else:
        records = read_records(data_file(data, split))
    out = []
    for where, r in records:
        if not (isinstance(r, dict) and isinstance(r.get("question"), str) and "####" in str(r.get("answer"))):
            raise ValueError(f"{where}: a GSM8K record needs a 'question' and an 'answer' ending in '#### <number>'")
        gold = r["answer"].split("####")[-1].strip().replace(",", "")
        out.append({"prompt": chat_prompt(tokenizer, r["question"]), "answer": gold})
    return out


def countdown_problems(n: int, seed: int, exclude=frozenset()) -> list[dict]:
    """n distinct solvable problems: 3 or 4 numbers in 1..99 combined by a random expression (kept as
    "solution") whose value, an integer in 1..999, is the target."""
    rng, out, seen = random.Random(seed), [], set(exclude)
    while len(out) < n:
        numbers = [rng.randint(1, 99) for _ in range(rng.choice((3, 4)))]
        terms = [str(x) for x in rng.sample(numbers, len(numbers))]
        while len(terms) > 1:   # join two random neighbours with a random operator
            i = rng.randrange(len(terms) - 1)
            terms[i:i + 2] = [f"({terms[i]} {rng.choice('+-*/')} {terms[i + 1]})"]
        solution = terms[0][1:-1]
        value = rewards.countdown_value(solution)
        key = (tuple(sorted(numbers)), value)
        if value is not None and value.denominator == 1 and 1 <= value <= 999 and key not in seen:
            seen.add(key)
            out.append({"numbers": numbers, "target": int(value), "solution": solution})
    return out


def countdown_record(where: str, r) -> dict:
    """r if it has "numbers" (a list of integers) and an integer "target", else a ValueError naming `where`: a
    malformed problem would otherwise score 0 forever, silently."""
    is_int = lambda x: type(x) is int   # not bool, not float: the reward compares exact integers
    if not (isinstance(r, dict) and isinstance(r.get("numbers"), list) and r["numbers"]
            and all(map(is_int, r["numbers"])) and is_int(r.get("target"))):
        raise ValueError(f"{where}: a Countdown record needs 'numbers' (a list of integers) and an integer 'target'")
    return r


def countdown_samples(split: str, data: str | None, seed: int, tokenizer) -> list[dict]:
    if data is not None:
        problems = [countdown_record(where, r) for where, r in read_records(data_file(data, split))]
    else:
        test = countdown_problems(COUNTDOWN_SIZES["test"], COUNTDOWN_TEST_SEED)
        problems = test if split == "test" else countdown_problems(
            COUNTDOWN_SIZES["train"], seed, exclude={(tuple(sorted(p["numbers"])), p["target"]) for p in test})
    out = []
    for p in problems:
        user = (f"Using the numbers {p['numbers']}, write an equation that equals {p['target']}. Use + - * / and "
                f"parentheses; use each number exactly once. Put only the expression, like (1 + 2) * 3, in "
                f"<answer> </answer>.")
        out.append({**p, "prompt": chat_prompt(tokenizer, user), "answer": p["target"]})
    return out


def load_task(name: str, split: str, *, data: str | None = None, seed: int = 0, tokenizer=None) -> list[dict]:
    """split is "train" (sampled for GRPO) or "test" (held out, for evaluation only)."""
    if name == "demo":
        from demo.task import make_samples
        return make_samples(split, seed=seed)
    if name == "gsm8k":
        return gsm8k_samples(split, data, tokenizer)
    if name == "countdown":
        return countdown_samples(split, data, seed, tokenizer)
    if name == "code":
        import sandbox
        return sandbox.code_samples(split, tokenizer)
    raise ValueError(f"unknown task {name!r}: expected one of demo, gsm8k, countdown, code")
