"""Padded tokens of the training step's micro-batches, cut in the batch's order (before) and longest
first (batches.micro_batches, after), on GSM8K-length sequences. CPU only, no model: the count is what
run_setup.pad_batch would build.

The stand-in batch: --seqs // --group-size random GSM8K training questions, each in the task's chat prompt
(tasks.chat_prompt), each with --group-size completions whose lengths are those of randomly drawn
reference solutions ("answer": the worked solution, + 1 EOS token). A policy's completions differ from
the reference solutions, and a completion's length here does not depend on its question: a stand-in for
the mix of lengths, not a model of it. Sequences come in the order a rollout returns them (a group's
completions together) and are dealt to ranks as grpo_train.main deals them (seqs[rank::world]).

Tokenizer: the demo's character tokenizer by default (one token per character: the only one available
offline here), or --tokenizer (a folder or hub id, e.g. Qwen/Qwen2.5-1.5B-Instruct where it is cached).

Padded-token fraction: padding / every position computed, over all ranks' micro-batches of all steps (a
weight-0 filler micro-batch counts as padding). "With waits": the ranks meet at every backward (ZeRO-2),
so each micro-batch's cost is the widest one of that round on any rank; the fraction of that cost that
is not real tokens.

    python bench/padding.py --data /path/to/gsm8k [--steps 200] [--ranks 1 4]

--data: GSM8K's folder (train.jsonl, as the release lays it out) or a file of its training records.
"""
import argparse
import math
import random

from _common import count, print_table
from data_files import DataError, data_file, read_records
from tasks import chat_prompt


def in_order(mine, seqs, world, size):
    """The cut before this change (main at d08f4ac): a rank's sequences in the batch's order."""
    n_micro = math.ceil(math.ceil(len(seqs) / world) / size)
    chunks = [mine[i * size:(i + 1) * size] for i in range(n_micro)]
    return [(chunk, 1.0) if chunk else (seqs[:1], 0.0) for chunk in chunks]


def stand_in_lengths(data, tokenizer):
    """-> (prompt token counts, completion token counts) over GSM8K's training split."""
    records = []
    for where, r in read_records(data_file(data, "train")):
        if not (isinstance(r, dict) and isinstance(r.get("question"), str) and isinstance(r.get("answer"), str)):
            raise DataError(f"{where}: a GSM8K record needs a 'question' and an 'answer' (text)")
        records.append(r)
    encode = lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)
    return ([encode(chat_prompt(tokenizer, r["question"])) for r in records],
            [encode(r["answer"]) + 1 for r in records])


def token_counts(plan):
    """plan: each rank's [(micro-batch, weight)] -> (real tokens, padded positions, positions with waits)."""
    # imported here and in main: batches imports torch, which --help need not wait for
    from batches import pad_batch
    real = padded = waits = 0
    for round_ in zip(*plan):
        positions = []
        for chunk, weight in round_:
            _, attn, _ = pad_batch([s["prompt"] for s in chunk], [s["completion"] for s in chunk], 0)
            real += int(attn.sum()) if weight else 0
            positions.append(attn.numel())
        padded += sum(positions)
        waits += max(positions) * len(round_)
    return real, padded, waits


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="GSM8K's folder (train.jsonl) or training file")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer (default: the demo's char tokenizer)")
    p.add_argument("--seqs", type=count, default=64, help="sequences per step")
    p.add_argument("--group-size", type=count, default=8, help="completions per prompt")
    p.add_argument("--micro-batch", type=count, default=8, help="sequences per micro-batch")
    p.add_argument("--ranks", type=count, nargs="+", default=[1, 4], help="training ranks to show")
    p.add_argument("--steps", type=count, default=200, help="random batches averaged over")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    try:
        data_file(a.data, "train")
    except DataError as e:
        raise SystemExit(f"padding.py: {e}") from None
    if a.seqs % a.group_size:
        raise SystemExit("padding.py: --seqs must be a multiple of --group-size")
    if a.tokenizer:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(a.tokenizer)
    else:
        from demo.tiny_model import build_tokenizer
        tokenizer = build_tokenizer()
    from batches import micro_batches
    try:
        prompt_lens, completion_lens = stand_in_lengths(a.data, tokenizer)
    except DataError as e:
        raise SystemExit(f"padding.py: {e}") from None
    rng = random.Random(a.seed)
    batches = []
    for _ in range(a.steps):
        questions = rng.sample(range(len(prompt_lens)), a.seqs // a.group_size)
        # token values do not matter here; "old" is read by micro_batches' weight-0 filler
        batches.append([{"prompt": [1] * prompt_lens[q], "completion": [1] * rng.choice(completion_lens),
                         "old": []} for q in questions for _ in range(a.group_size)])
    print(f"{a.steps} batches of {a.seqs} sequences ({a.group_size} per prompt), "
          f"micro-batch {a.micro_batch}; tokenizer: {a.tokenizer or 'the demo character tokenizer'}; {a.data}")
    rows = []
    for world in a.ranks:
        for name, cut in (("in order (before)", in_order), ("longest first (after)", micro_batches)):
            totals = [0, 0, 0]
            for seqs in batches:
                plan = [cut(seqs[rank::world], seqs, world, a.micro_batch) for rank in range(world)]
                totals = [t + c for t, c in zip(totals, token_counts(plan))]
            real, padded, waits = totals
            rows.append([world, name, len(plan[0]), f"{real / a.steps:,.0f}", f"{1 - real / padded:.1%}",
                         f"{1 - real / waits:.1%}"])
    print_table(["ranks", "cut", "micro-batches per rank", "real tokens per step", "padded-token fraction",
                 "with waits"], rows)


if __name__ == "__main__":
    main()
