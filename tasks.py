"""Prompt sets for grpo_train.py. A sample is a dict with at least "prompt" (the exact text fed to the model)
and "answer" (the gold answer the rewards compare against)."""
import random


def shuffled_forever(n: int, seed: int):
    """Indices 0..n-1, a fresh shuffle each pass over the data."""
    rng = random.Random(seed)
    while True:
        yield from rng.sample(range(n), n)



def load_task(name: str, split: str, *, data: str | None = None, seed: int = 0) -> list[dict]:
    """split is "train" (sampled for GRPO) or "test" (held out, for evaluation only)."""
    if name == "demo":
        from demo.task import make_samples
        return make_samples(split, seed=seed)
    raise ValueError(f"unknown task {name!r}: expected one of demo")
