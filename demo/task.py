"""Synthetic arithmetic task for the offline demo: "a+b=" -> "<answer>{a+b}</answer>", a in 10..99, b in 5..9.

There are 450 problems. A fixed 20% of them (a seed-independent permutation) is the held-out "test" split (90
problems); the other 80% are "train" (360). Every digit-level fact a held-out problem needs (the ones-digit sum,
the carry, the tens digit) also occurs in train problems, so a model generalises rather than memorises.

With b >= 5 about 70% of the problems need a carry. The warm start imitates a *sloppy teacher*
(`teacher_samples`) who forgets the carry (writes a+b-10) in 3 of every 4 demonstrations of a carry problem. A
model fitted to that data answers in the right format, gets the no-carry problems right and, greedily, the carry
problems wrong (held-out greedy accuracy 29/90 = 32%, exactly the problems without a carry), while it still gives
the right answer about 1 time in 4 when sampled: what GRPO with the exact-match reward amplifies.
"""
import random

A_MIN, A_MAX = 10, 99  # two-digit a: one-digit a were rare and the tiny model learnt them poorly
B_MIN, B_MAX = 5, 9
TEST_FRACTION = 0.2
_SPLIT_SEED = 1234  # the train/test partition never depends on the caller's seed, so the splits stay disjoint


def _partition() -> dict[str, list[tuple[int, int]]]:
    problems = [(a, b) for a in range(A_MIN, A_MAX + 1) for b in range(B_MIN, B_MAX + 1)]
    random.Random(_SPLIT_SEED).shuffle(problems)
    n_test = int(len(problems) * TEST_FRACTION)
    return {"test": sorted(problems[:n_test]), "train": sorted(problems[n_test:])}


def format_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def parse_prompt(prompt: str) -> tuple[int, int]:
    a, b = prompt.rstrip("=").split("+")
    return int(a), int(b)


def format_completion(answer: str) -> str:
    """The target completion text, without the EOS token."""
    return f"<answer>{answer}</answer>"


def needs_carry(a: int, b: int) -> bool:
    return a % 10 + b >= 10


def make_samples(split: str, n: int | None = None, seed: int = 0) -> list[dict]:
    """Samples {"prompt": "37+5=", "answer": "42"} of one split ("train": 360, "test": 90), shuffled by seed.

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


def teacher_samples(samples: list[dict], copies: int = 4, correct: int = 1) -> list[dict]:
    """Warm-start demonstrations from a sloppy teacher: `copies` demonstrations per problem; for a problem that
    needs a carry, `correct` of them are right and the rest forget the carry (answer a+b-10). Problems without
    a carry are always demonstrated correctly."""
    out = []
    for s in samples:
        a, b = parse_prompt(s["prompt"])
        for k in range(copies):
            wrong = needs_carry(a, b) and k >= correct
            out.append({"prompt": s["prompt"], "answer": str(a + b - 10) if wrong else s["answer"]})
    return out
