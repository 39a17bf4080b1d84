"""Build a tiny Qwen2 model and a character-level tokenizer locally (no download), for tests and the demo.

The CPU attention of vLLM 0.32 accepts head_dim in {32, 64, 80, ...} only, so hidden/heads is 32 here.
"""
import argparse
import string
import sys

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Single tokens but NOT special: vLLM decodes with skip_special_tokens=True, which would erase special tags.
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]
# Qwen-style chat template, so the chat-template code path runs on the tiny model too.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# The demo recipe (see demo/task.py): model size and warm start, the CLI's defaults.
DEMO = dict(hidden=128, layers=2, heads=4, steps=1200, lr=2e-3, batch_size=32)


def build_tokenizer(size=None) -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus the special tokens as single tokens; `size`: filler
    tokens up to that many entries (so vLLM can detokenize any id a bigger model samples; encoding never
    yields one)."""
    words = SPECIAL_TOKENS + TAG_TOKENS + ["<unk>"] + list(string.printable)
    words += [f"<x{i}>" for i in range((size or 0) - len(words))]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens(TAG_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", chat_template=CHAT_TEMPLATE)


def build_model(tokenizer, *, hidden=128, layers=2, heads=4, intermediate=None, seed=0,
                tie_word_embeddings=True) -> Qwen2ForCausalLM:
    """intermediate: MLP width (4 * hidden when None); tie_word_embeddings=False: an lm_head of its own."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate or 4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=1024, tie_word_embeddings=tie_word_embeddings,
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return Qwen2ForCausalLM(config).float()


def warm_start(model, tokenizer, samples, *, steps=200, lr=3e-3, batch_size=32, seed=0, clip=0.0, log_every=0):
    """Brief supervised training on prompt + "<answer>N</answer>" + EOS, loss on the completion tokens only.

    samples: dicts with "prompt" and "answer" (demo.task.make_samples). Batches are drawn with replacement by a
    generator seeded with seed; AdamW with linear warm-up (10% of steps) and linear decay. Returns the model
    (trained in place, left in eval mode).
    """
    from demo.task import format_completion
    g = torch.Generator().manual_seed(seed)
    rows = []
    for s in samples:
        p = tokenizer(s["prompt"], add_special_tokens=False).input_ids
        c = tokenizer(format_completion(s["answer"]), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append((p + c, [-100] * len(p) + c))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        ids[i, :len(x)], labels[i, :len(y)], mask[i, :len(x)] = torch.tensor(x), torch.tensor(y), 1
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min((k + 1) / warm, max(0.0, (steps - k) / max(1, steps - warm))))
    model.train()
    for step in range(steps):
        idx = torch.randint(len(rows), (batch_size,), generator=g)
        loss = model(input_ids=ids[idx], attention_mask=mask[idx], labels=labels[idx]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        if log_every and (step + 1) % log_every == 0:
            print(f"warm-start step {step + 1}/{steps} loss {loss.item():.4f}", flush=True)
    model.eval()
    return model


def save(model, tokenizer, out_dir):
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv=None):
    p = argparse.ArgumentParser(description="Build a tiny Qwen2 model + char tokenizer, warm-start it on the demo "
                                "task's sloppy-teacher demonstrations, and save it (float32, HF format).")
    p.add_argument("--out", required=True, help="folder to write the HF-format model and tokenizer to")
    p.add_argument("--seed", type=int, default=0, help="initialisation and warm-start seed")
    p.add_argument("--hidden", type=int, default=DEMO["hidden"])
    p.add_argument("--layers", type=int, default=DEMO["layers"])
    p.add_argument("--heads", type=int, default=DEMO["heads"], help="hidden/heads must be a head size vLLM's CPU "
                   "attention accepts (32, 64, 80, 96, 112, 128, ...)")
    p.add_argument("--warm-start-steps", type=int, default=DEMO["steps"], help="0: save the untrained model")
    p.add_argument("--lr", type=float, default=DEMO["lr"])
    p.add_argument("--batch-size", type=int, default=DEMO["batch_size"])
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (fixed, so that runs are repeatable)")
    p.add_argument("--eval", action="store_true", help="print the held-out greedy accuracy after the warm start")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    tok = build_tokenizer()
    model = build_model(tok, hidden=a.hidden, layers=a.layers, heads=a.heads, seed=a.seed)
    if a.warm_start_steps > 0:
        import time
        from demo.task import make_samples, teacher_samples
        t = time.time()
        warm_start(model, tok, teacher_samples(make_samples("train")), steps=a.warm_start_steps, lr=a.lr,
                   batch_size=a.batch_size, seed=a.seed, log_every=max(1, a.warm_start_steps // 5))
        print(f"warm start: {a.warm_start_steps} steps in {time.time() - t:.1f}s", flush=True)
        if a.eval:
            from demo.evaluate import accuracy
            acc, d = accuracy(model, tok, make_samples("test"), return_details=True)
            print(f"held-out greedy accuracy {acc:.3f}, format {d['format']:.3f}", flush=True)
    save(model, tok, a.out)
    print(a.out)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:   # Ctrl-C: nothing saved, nothing to say
        sys.exit(130)
