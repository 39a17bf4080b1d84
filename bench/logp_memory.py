"""Peak memory of per-token log-probs at Qwen2.5's vocabulary (151,936), forward + backward, on CPU.

    python bench/logp_memory.py [--batch 4] [--length 512] [--temperature 1.0]

Compares grpo_train.completion_logps (the lm_head a chunk of tokens at a time, under activation checkpointing)
with the naive `log_softmax(logits.float() / T).gather(...)`, on a real transformers Qwen2 model (hidden 64,
one layer, random weights, Qwen2.5's vocabulary). Each variant runs in a fresh process: the peak is the growth
of the process's maximum resident set (ru_maxrss) from a baseline taken once the model and inputs exist, over
one forward + backward; the table gives it in MiB and as a ratio to the size of the float32 logits tensor
(batch x length x vocabulary x 4 bytes). The target is a ratio of at most 1.5.
"""
import argparse
import json
import os
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 151936


def measure(variant, batch, length, temperature):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    sys.path.insert(0, ROOT)
    from grpo_train import completion_logps
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).float()
    ids = torch.randint(0, VOCAB, (batch, length + 16))
    attn = torch.ones_like(ids)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB on Linux
    if variant == "naive":
        logits = model(input_ids=ids, attention_mask=attn).logits[:, 15:-1]              # (B, T, V)
        logps = torch.log_softmax(logits.float() / temperature, -1).gather(-1, ids[:, 16:, None]).squeeze(-1)
    else:
        logps = completion_logps(model, ids, attn, length, temperature)
    logps.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    return {"peak_mib": peak / 1024, "logits_mib": batch * length * VOCAB * 4 / 2**20}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4, help="sequences")
    p.add_argument("--length", type=int, default=512, help="completion tokens per sequence")
    p.add_argument("--temperature", type=float, default=1.0, help="log-probs at this temperature")
    p.add_argument("--variant", choices=["naive", "chunked"], help=argparse.SUPPRESS)   # the child's side
    a = p.parse_args()
    if a.variant:
        print(json.dumps(measure(a.variant, a.batch, a.length, a.temperature)))
        return
    rows = []
    for variant in ("naive", "chunked"):
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--batch", str(a.batch), "--length",
                              str(a.length), "--temperature", str(a.temperature)], capture_output=True, text=True,
                             check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        rows.append((variant, json.loads(out.stdout.strip().splitlines()[-1])))
    print(f"vocab {VOCAB}, batch {a.batch} x {a.length} tokens, temperature {a.temperature}: "
          f"float32 logits = {rows[0][1]['logits_mib']:.0f} MiB")
    print(f"{'variant':<10} {'peak MiB':>9} {'x logits':>9}")
    for variant, r in rows:
        print(f"{variant:<10} {r['peak_mib']:>9.0f} {r['peak_mib'] / r['logits_mib']:>9.2f}")


if __name__ == "__main__":
    main()
