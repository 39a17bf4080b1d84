"""Prompt sets for grpo_train.py. A sample is a dict with at least "prompt" (the exact text fed to the model)
and "answer" (the gold answer the rewards compare against)."""
import itertools
import random


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


def load_task(name: str, split: str, *, data: str | None = None, seed: int = 0, tokenizer=None) -> list[dict]:
    """split is "train" (sampled for GRPO) or "test" (held out, for evaluation only)."""
    if name == "demo":
        from demo.task import make_samples
        return make_samples(split, seed=seed)
    raise ValueError(f"unknown task {name!r}: expected one of demo")
