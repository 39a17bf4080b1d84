"""Synthetic arithmetic task for the offline demo: "a+b=" -> "<answer>{a+b}</answer>".

a is in 0..99 and b in 0..9, so there are 1000 problems. A fixed 20% of them (chosen by a seed-independent
permutation) is the held-out "test" split; the other 80% are "train". Every digit-level fact a held-out problem
needs (the ones-digit sum, the carry, the tens digit) also occurs in train problems, so a model can generalise
to the held-out ones instead of memorising.
"""
import random

A_MAX, B_MAX = 99, 9
TEST_FRACTION = 0.2
_SPLIT_SEED = 1234  # the train/test partition never depends on the caller's seed, so the splits stay disjoint


def _all_problems() -> list[tuple[int, int]]:
    return [(a, b) for a in range(A_MAX + 1) for b in range(B_MAX + 1)]


def _partition() -> dict[str, list[tuple[int, int]]]:
    problems = _all_problems()
    random.Random(_SPLIT_SEED).shuffle(problems)
    n_test = int(len(problems) * TEST_FRACTION)
    return {"test": sorted(problems[:n_test]), "train": sorted(problems[n_test:])}


def format_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def format_completion(answer: str) -> str:
    """The target completion text, without the EOS token."""
    return f"<answer>{answer}</answer>"


def make_samples(split: str, n: int | None = None, seed: int = 0) -> list[dict]:
    """Samples {"prompt": "37+5=", "answer": "42"} of one split ("train": 800, "test": 200), shuffled by seed.

    n: take the first n after shuffling (all of the split when None; n larger than the split is an error).
    """
    parts = _partition()
    if split not in parts:
        raise ValueError(f"unknown split {split!r}: expected 'train' or 'test'")
    problems = list(parts[split])
    random.Random(seed).shuffle(problems)
    if n is not None:
        if n > len(problems):
            raise ValueError(f"n={n} exceeds the {len(problems)} problems of split {split!r}")
        problems = problems[:n]
    return [{"prompt": format_prompt(a, b), "answer": str(a + b)} for a, b in problems]
