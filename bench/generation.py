"""Sampling throughput: vLLM (the CPU build, as grpo_train.py's generation process runs it) against transformers'
`model.generate`, on the same model, prompts and sampling settings, in one process, one after the other.

    python bench/generation.py                  # the demo's warm-started model (built once, ~50 s)
    python bench/generation.py --size big       # a random Qwen2 model of ~67M parameters (_common.BIG)
    python bench/generation.py --model PATH     # any local HF model

Settings on both sides: temperature 1, no top-k/top-p, n completions per prompt, --max-new-tokens, stop at EOS.
Neither side decodes text: `generate` returns token ids, and vLLM is asked for ids alone (detokenize=False), as
grpo_train.py asks it (the rollout decodes each completion itself, for the rewards); vLLM's default decoding
costs 2-4 ms a call on the demo model, 18-20 ms with log-probs (bench/README.md section 23). A third row: vLLM as
grpo_train.py calls it, also returning each sampled token's log-prob (logprobs=0).
Generated tokens are counted the same way on both sides: up to and including the first EOS, else the limit.
Each row gets one warm-up call (2 new tokens), then --reps calls are timed: tokens/s is all their
tokens over all their time (the table's tokens and seconds a call are means). Threads:
OMP_NUM_THREADS and torch.set_num_threads(--threads) before either side runs; vLLM runs in this
process (VLLM_ENABLE_V1_MULTIPROCESSING=0) on the same thread pool (the table's header says how many
threads it saw).
"""
import argparse
import os
import tempfile
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
from _common import BIG, count, demo_model, machine, model_given, print_table, random_model  # noqa: E402


def hf_side(path, prompts, a):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    P = batch["input_ids"].shape[1]

    def run(max_new_tokens=a.max_new_tokens):
        with torch.no_grad():
            out = model.generate(**batch, do_sample=True, temperature=a.temperature, top_k=0, top_p=1.0,
                                 num_return_sequences=a.n, max_new_tokens=max_new_tokens,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, P:]
        is_eos = out == tok.eos_token_id      # the pad is the EOS here: the first one ends the completion
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, out.shape[1])
        return int(first.sum())
    run(2)   # warm-up
    return rate(run, a.reps)


def vllm_side(path, prompts, a):
    import torch
    from vllm import LLM, SamplingParams
    cpu = not torch.cuda.is_available()
    llm = LLM(path, seed=0, dtype="float32" if cpu else "auto", enforce_eager=cpu, max_model_len=1024)
    tok = llm.get_tokenizer()
    ids = [{"prompt_token_ids": tok(p, add_special_tokens=False)["input_ids"]} for p in prompts]
    params = SamplingParams(n=a.n, temperature=a.temperature, max_tokens=a.max_new_tokens, detokenize=False)
    # what grpo_train.py asks for: also the log-prob of each sampled token (the PPO ratio's "old" side)
    with_logps = SamplingParams(n=a.n, temperature=a.temperature, max_tokens=a.max_new_tokens, logprobs=0,
                                detokenize=False)

    outs = []

    def run(params=params):   # token_ids include the EOS that stopped a completion (checked below)
        outs[:] = llm.generate(ids, params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)
    run(SamplingParams(n=a.n, temperature=a.temperature, max_tokens=2))   # warm-up
    t, n_tok = rate(run, a.reps)
    ends = [c.token_ids[-1] for o in outs for c in o.outputs if c.finish_reason == "stop"]
    assert all(e == tok.eos_token_id for e in ends), "vLLM's token_ids should end with the EOS"
    # the log-probs' own warm-up: their first call compiles the sampled token's rank (3.6 s on 2 cores)
    run(SamplingParams(n=a.n, temperature=a.temperature, max_tokens=2, logprobs=0, detokenize=False))
    t_lp, n_tok_lp = rate(lambda: run(with_logps), a.reps)
    return t, n_tok, t_lp, n_tok_lp, torch.get_num_threads()


def rate(run, reps):
    """run() -> tokens generated, called `reps` times -> (mean seconds, mean tokens) a call.
    Means, not the median time and the last call's tokens: each call samples anew, so its length
    varies with its time, and tokens/s is all the calls' tokens over all their time."""
    times, tokens = [], []
    for _ in range(reps):
        t = time.perf_counter()
        tokens.append(run())
        times.append(time.perf_counter() - t)
    return sum(times) / reps, sum(tokens) / reps


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local HF model folder (default: the demo's warm-started model)")
    p.add_argument("--size", choices=["demo", "big"], default="demo", help="big: a random ~67M-parameter model")
    p.add_argument("--prompts", type=count, default=16, help="prompts per call (the demo's prompts)")
    p.add_argument("--n", type=count, default=8, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=count, default=None, help="default: 12 (demo), 32 (big)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--reps", type=count, default=3, help="timed calls per side (their mean)")
    p.add_argument("--threads", type=count, default=2, help="torch threads for both sides")
    a = p.parse_args()
    if a.model:
        model_given(a.model, "generation.py")
    a.max_new_tokens = a.max_new_tokens or (32 if a.size == "big" else 12)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)   # else vLLM may drop torch to 1 thread for serving
    import torch
    torch.set_num_threads(a.threads)   # before vLLM: its CPU worker turns set_num_threads into a no-op
    from demo.task import make_samples
    prompts = [s["prompt"] for s in make_samples("train")[:a.prompts]]
    with tempfile.TemporaryDirectory() as tmp:
        path = random_model(tmp, **BIG) if a.size == "big" and not a.model else demo_model(a.model)
        hf_t, hf_tok = hf_side(path, prompts, a)
        v_t, v_tok, lp_t, lp_tok, v_threads = vllm_side(path, prompts, a)
    print(f"\n{machine()}; threads {a.threads} (vLLM saw {v_threads}); model {a.model or a.size}; {a.prompts} prompts "
          f"x {a.n} completions, max {a.max_new_tokens} new tokens, temperature {a.temperature}, "
          f"mean of {a.reps}")
    print_table(["engine", "tokens/call", "s/call", "tokens/s", "vs transformers"],
                [["transformers generate", hf_tok, hf_t, hf_tok / hf_t, 1.0],
                 ["vLLM (CPU build)", v_tok, v_t, v_tok / v_t, (v_tok / v_t) / (hf_tok / hf_t)],
                 ["vLLM, logprobs=0 (as grpo_train.py)", lp_tok, lp_t, lp_tok / lp_t,
                  (lp_tok / lp_t) / (hf_tok / hf_t)]])


if __name__ == "__main__":
    main()
