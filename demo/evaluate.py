"""Greedy held-out accuracy of a (tiny) model on demo.task samples, with plain HF generation (for tuning)."""
import torch

from rewards import demo_reward, last_answer


@torch.no_grad()
def generate(model, tokenizer, prompts, *, max_new_tokens=16, batch_size=256, do_sample=False, temperature=1.0,
             num_return_sequences=1):
    """Completions (text with special tokens kept, stopped at EOS, EOS itself dropped) and whether each ended in EOS.

    Returns (texts, ended) with len(prompts) * num_return_sequences entries, grouped per prompt.
    """
    was_training = model.training
    model.eval()
    eos = tokenizer.eos_token_id
    texts, ended = [], []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        enc = [tokenizer(p, add_special_tokens=False).input_ids for p in chunk]
        width = max(map(len, enc))
        ids = torch.full((len(enc), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, x in enumerate(enc):  # left padding
            ids[j, width - len(x):], mask[j, width - len(x):] = torch.tensor(x), 1
        kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             num_return_sequences=num_return_sequences, eos_token_id=eos, pad_token_id=eos, **kw)
        for row in out[:, width:].tolist():
            stop = row.index(eos) if eos in row else len(row)
            texts.append(tokenizer.decode(row[:stop], skip_special_tokens=False))
            ended.append(stop < len(row))
    model.train(was_training)
    return texts, ended


def accuracy(model_dir_or_model, tok=None, samples=None, *, max_new_tokens=16, return_details=False):
    """Greedy exact-match accuracy: the text inside <answer>...</answer> equals sample["answer"].

    model_dir_or_model: a folder in HF format (its tokenizer is loaded when tok is None) or a loaded model.
    samples: dicts with "prompt" and "answer"; the demo's held-out test split when None.
    return_details: also return {"format": fraction with answer tags and EOS, "completions": [...]}.
    """
    if isinstance(model_dir_or_model, str):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained(model_dir_or_model, dtype=torch.float32)
        tok = tok or AutoTokenizer.from_pretrained(model_dir_or_model)
    else:
        model = model_dir_or_model
    if samples is None:
        from demo.task import make_samples
        samples = make_samples("test")
    texts, ended = generate(model, tok, [s["prompt"] for s in samples], max_new_tokens=max_new_tokens)
    correct = [demo_reward(t, s) == 1.0 for t, s in zip(texts, samples)]   # the reward GRPO trains on
    acc = sum(correct) / len(samples)
    if not return_details:
        return acc
    fmt = sum(e and last_answer(t) is not None for t, e in zip(texts, ended)) / len(samples)
    return acc, {"format": fmt, "completions": texts}
