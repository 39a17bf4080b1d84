"""How a batch travels from the engines to the loss: their parts merged into one (rank 0), shared with
every rank as JSON, cut into micro-batches, padded and collated into tensors, and the number the loss is
divided by. grpo_train.py uses these; the padding and mask rule is the one the loss depends on."""
import json
import math

import torch
import torch.distributed as dist


# how the engines' batch metrics combine: summed, the slowest (max), the busiest (min), else a mean weighted
# by the samples each engine generated
SUMMED = ("reward/errors", "batch/groups", "gen/samples", "data/prompts_seen")
SLOWEST = ("gen/rounds", "time/gen_s", "time/ref_s", "sync/logp_diff", "ref/step")


def merge_batches(parts, scale_rewards="group"):
    """The engines' batches -> one: sequences and fill in engine order, the metrics of the whole, with
    gen/engines and time/gen_min_s (the fastest engine's time/gen_s; time/gen_s is the slowest's).
    scale_rewards "batch": each advantage (r - its group's mean) is divided by the std of every reward
    sampled for the batch, by every engine in every round (TRL's batch scaling)."""
    if len({p["version"] for p in parts}) > 1:   # each had the same pushes before the same request
        raise RuntimeError(f"the engines sampled with different weight versions {[p['version'] for p in parts]}")
    metrics = [p["metrics"] for p in parts]
    weights = [m["gen/samples"] for m in metrics]
    merged = {}
    for k in metrics[0]:
        values = [m[k] for m in metrics]
        if k in SUMMED:
            merged[k] = sum(values)
        elif k in SLOWEST:
            merged[k] = None if None in values else max(values)
        elif k == "time/gen_idle_s":
            merged[k] = min(values)
        elif k == "reward/std":
            merged[k] = pooled_std(metrics)
        elif k == "samples":   # a few (prompt, completion, reward) rows of each engine
            merged[k] = [row for rows in values for row in rows]
        else:
            merged[k] = sum(w * v for w, v in zip(weights, values)) / sum(weights)
    merged.update({"gen/engines": len(parts), "time/gen_min_s": min(m["time/gen_s"] for m in metrics)})
    seqs = [s for p in parts for s in p["seqs"]]
    if scale_rewards == "batch":
        batch_std = merged["reward/std"] + 1e-4
        for s in seqs:
            s["adv"] /= batch_std
        for row in merged["samples"]:
            row["advantage"] /= batch_std
    return {"version": parts[0]["version"], "seqs": seqs, "fill": [f for p in parts for f in p["fill"]],
            "pos": [p["pos"] for p in parts], "metrics": merged}


def pooled_std(metrics):
    """The unbiased std of the engines' rewards together, from each one's count, mean and unbiased std."""
    counts, means = [m["gen/samples"] for m in metrics], [m["reward/mean"] for m in metrics]
    overall = sum(n * x for n, x in zip(counts, means)) / sum(counts)
    squares = sum((n - 1) * m["reward/std"] ** 2 + n * (x - overall) ** 2
                  for n, x, m in zip(counts, means, metrics))
    return math.sqrt(squares / (sum(counts) - 1))


def broadcast_json(obj, device, src=0):
    """Rank src's obj on every rank, as JSON bytes (no pickle: the batch crosses the network between nodes).
    A single rank keeps its obj: nothing to send."""
    if dist.get_world_size() == 1:
        return obj
    data = torch.tensor(bytearray(json.dumps(obj).encode()), dtype=torch.uint8) if dist.get_rank() == src else None
    n = torch.tensor([0 if data is None else len(data)], device=device)
    dist.broadcast(n, src)
    data = (data if data is not None else torch.empty(int(n), dtype=torch.uint8)).to(device)
    dist.broadcast(data, src)
    return json.loads(data.cpu().numpy().tobytes())


def pad_batch(prompts, completions, pad_id):
    """Left-pad prompts, right-pad completions -> ids, attention mask (B, P+T), completion mask
    (B, T). Masks come from lengths: Qwen's pad is its EOS, and a completion's EOS counts."""
    P, T = max(map(len, prompts)), max(map(len, completions))
    input_ids = torch.full((len(prompts), P + T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, P - len(p):P + len(c)] = torch.tensor(p + c)
        attention_mask[i, P - len(p):P + len(c)] = 1
    return input_ids, attention_mask, attention_mask[:, P:]


def collate(seqs, pad_id, device="cpu", mask_truncated=False):
    """Rollout sequences (+ "ref") -> tensors; mask_truncated: cut-off completions get mask 0."""
    prompts, completions = [s["prompt"] for s in seqs], [s["completion"] for s in seqs]
    ids, attn, mask = pad_batch(prompts, completions, pad_id)
    pad = lambda k: torch.tensor([s[k] + [0.0] * (mask.shape[1] - len(s[k])) for s in seqs])
    truncated = torch.tensor([s["truncated"] for s in seqs])
    if mask_truncated:
        mask = mask * ~truncated.unsqueeze(1)
    out = {"ids": ids, "attn": attn, "mask": mask, "old": pad("old"), "truncated": truncated,
           "adv": torch.tensor([s["adv"] for s in seqs]),
           "ref": pad("ref") if "ref" in seqs[0] else None}
    return {k: None if v is None else v.to(device) for k, v in out.items()}


def normaliser(seqs, fill, agg, mask_truncated):
    """The batch's loss divisor (grpo_train.py's choice 2): sequences, or the tokens in the loss for
    token-mean; fill: (length, truncated) of no-signal sequences that count (--loss-norm sampled)."""
    lengths = [(len(s["completion"]), s["truncated"]) for s in seqs] + fill
    if agg != "token-mean":
        return len(lengths)
    # at least 1: with --mask-truncated, a batch of cut-off completions alone has no token in the loss,
    # and its loss is 0 (each micro-batch's 0 x 0 / 0 was nan)
    return max(1, sum(n for n, cut in lengths if not (mask_truncated and cut)))


def micro_batches(mine, seqs, world, size):
    """This rank's sequences (`mine`, every world-th of the batch `seqs`) in micro-batches, each with its weight.
    Sequences of similar length share a micro-batch, which is padded to its longest prompt and completion:
    the rank's sequences are cut longest first (prompt + completion; ties keep the batch's order), which
    also makes a batch too big for memory fail at its first forward. The update does not depend on the
    cut: a micro-batch's loss is weighted by its share of the batch (tests/test_e2e.py). Every rank runs
    as many as the busiest: ZeRO-2 reduces gradients at every backward, so a rank with none left runs the
    batch's first sequence at weight 0."""
    n_micro = math.ceil(math.ceil(len(seqs) / world) / size)
    mine = sorted(mine, key=lambda s: len(s["prompt"]) + len(s["completion"]), reverse=True)
    chunks = [mine[i * size:(i + 1) * size] for i in range(n_micro)]
    filler = [{**seqs[0], "ref": seqs[0]["old"]}] if seqs else []
    return [(chunk, 1.0) if chunk else (filler, 0.0) for chunk in chunks]
