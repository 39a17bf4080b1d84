"""Throughput and memory at real model sizes, for a machine with a CUDA GPU: vLLM sampling tokens/s (standalone,
and with what grpo_train.py's generation process adds: `ours %` is the second as a share of the first), and
tokens/s and MFU of the GRPO training step (grpo_train.completion_logps + grpo_train.grpo_loss, forward +
backward + step through DeepSpeed ZeRO-2 built by run_setup.build_engine with --ds-config, world size 1), with
each phase's peak memory.

    python bench/gpu_bench.py                                   # Qwen2.5-0.5B and 1.5B shapes, on GPU 0
    python bench/gpu_bench.py --models qwen2.5-1.5b --grad-ckpt
    python bench/gpu_bench.py --no-gen                          # training only (a machine without vLLM)
    python bench/gpu_bench.py --tiny --peak-tflops 0.1         # a smoke run on CPU (tests/test_bench.py)

The models are randomly initialised from hardcoded Qwen2.5 configs (no download; Qwen2.5's vocabulary of
151,936, --tiny's 1,024, the demo's character tokenizer), saved to a temporary folder. Each phase (generate,
generate as ours, train) runs in a subprocess of its own, one after the other (--tiny: all at once, a smoke
run), so its peak memory is its own: torch.cuda.max_memory_allocated on GPU (vLLM's KV cache included: it takes
--gen-mem of the GPU), the process's ru_maxrss on CPU. Generation ignores EOS (a random model), so every
completion is --new-tokens long. MFU = the step's model FLOPs (train_flops) per second / peak FLOP/s
(--peak-tflops, default 989 = H100 SXM dense bf16; n/a on CPU unless given). --no-gen skips the generation
phases (their columns read n/a).
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from functools import partial

from _common import ROOT, count, end_on_stops, machine, n_params, print_table, random_model

VOCAB = 151936
CONFIGS = {"qwen2.5-0.5b": dict(hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, vocab=VOCAB),
           "qwen2.5-1.5b": dict(hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2, vocab=VOCAB),
           # head size 32: the least vLLM's CPU attention takes; a vocabulary of 1,024, not Qwen's (the char
           # tokenizer's 100 tokens and fillers): at 151,936 its logits, sampler and tokenizer made the CPU
           # smoke run (gpu_check.py --tiny) take 177 s of CPU, 152 s at 1,024
           "tiny": dict(hidden=64, intermediate=128, layers=2, heads=2, kv_heads=2, vocab=1024)}
# --tiny's workload: small enough for CPU, large enough that every number is measured, not rounded to 0
TINY = dict(prompts=2, group_size=2, prompt_len=8, new_tokens=8, batch=4, micro_batch=2, steps=2)


def vocab_of(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["vocab_size"]


def peak_mib(torch):
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux


def train_flops(body_params, hidden, vocab, seqs, prompt_len, new_tokens):
    """Model FLOPs of one optimizer step over `seqs` sequences of prompt_len + new_tokens tokens:

        6 x body_params x seqs x (prompt_len + new_tokens)  +  6 x hidden x vocab x seqs x new_tokens

    body_params: the parameters other than the embedding (and an untied lm_head). 6 = 2 (forward) + 4
    (backward: gradients of activations and of weights) FLOPs per parameter per token. The body runs forward
    and backward on every token, prompt tokens included: the completion attends to the prompt's keys and
    values at every layer, so the loss's gradient reaches the weights through the prompt positions too. The
    embedding is a lookup (no FLOPs). The lm_head (hidden x vocab) runs only on the positions that predict a
    completion token (completion_logps), so only completion tokens count it. Not counted: the attention
    scores (QK^T and AV; about 4% more at 0.5B shape and 768 tokens), and the lm_head's second forward under
    activation checkpointing (recomputation is hardware FLOPs, not model FLOPs)."""
    return 6 * seqs * (body_params * (prompt_len + new_tokens) + hidden * vocab * new_tokens)


def body_params(model):
    """Parameters other than the input embedding and the lm_head (tied or not): what runs per token."""
    emb = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return sum(p.numel() for p in model.parameters() if id(p) not in emb)


def generate(a, path, ours=False):
    """vLLM's sampling tokens/s: standalone (plain LLM(), no log-probs), or `ours`: the engine with what
    grpo_train.py's generation process adds, processed log-probs (generation.GenerationProcess) and every
    sampled token's log-prob (grpo_train.rollout's logprobs=0). Same prompts, seed, memory and lengths."""
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    import torch
    from vllm import LLM, SamplingParams
    cpu = not torch.cuda.is_available()
    extra = dict(logprobs_mode="processed_logprobs") if ours else {}
    llm = LLM(path, seed=0, dtype="float32" if cpu else "bfloat16", enforce_eager=cpu,
              skip_tokenizer_init=True, gpu_memory_utilization=a.gen_mem,
              max_model_len=a.prompt_len + a.new_tokens, **extra)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, vocab_of(path), (a.prompt_len,), generator=g).tolist()}
               for _ in range(a.prompts)]
    params = lambda n: SamplingParams(n=a.group_size, temperature=1.0, max_tokens=n, ignore_eos=True,
                                      detokenize=False, logprobs=0 if ours else None)
    llm.generate(prompts, params(2), use_tqdm=False)   # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params(a.new_tokens), use_tqdm=False)
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    key = "ours_tok_s" if ours else "gen_tok_s"
    return {key: tokens / (time.perf_counter() - t), "gen_peak_mib": peak_mib(torch)}


def train(a, path):
    from placement import free_port   # a single-process "launch" of world size 1
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    import deepspeed
    import torch
    from grpo_train import completion_logps, grpo_loss
    from ranks import skip_shm_allreduce_op
    from run_setup import build_engine, load_policy
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    skip_shm_allreduce_op()
    deepspeed.init_distributed()
    model = load_policy(path, a.grad_ckpt)[0]
    engine = build_engine(model, os.path.join(ROOT, a.ds_config), lr=1e-6, micro_batch=a.micro_batch)
    dev, B, mb, T = engine.device, a.batch, a.micro_batch, a.new_tokens
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_of(path), (B, a.prompt_len + T), generator=g).to(dev)
    attn, mask, adv = torch.ones_like(ids), torch.ones(B, T, device=dev), torch.randn(B, generator=g).to(dev)
    with torch.no_grad():   # the batch's "old" log-probs: what the policy gives before the first timed step
        old = torch.cat([completion_logps(engine.module, ids[i:i + mb], attn[i:i + mb], T)
                         for i in range(0, B, mb)])

    def step():   # one GRPO optimizer step over the batch, micro-batches accumulated, as grpo_train.main does
        n_micro = (B + mb - 1) // mb
        for k, i in enumerate(range(0, B, mb)):
            engine.set_gradient_accumulation_boundary(k == n_micro - 1)
            logps = completion_logps(engine.module, ids[i:i + mb], attn[i:i + mb], T)
            loss, count, _ = grpo_loss(logps, old[i:i + mb], old[i:i + mb], adv[i:i + mb], mask[i:i + mb],
                                       beta=0.04, eps_low=0.2, eps_high=0.2, agg="seq-mean-token-mean",
                                       max_len=T)
            engine.backward(loss * count / B)
        engine.step()
    step()   # warm-up
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(a.steps):
        step()
    sync()
    elapsed = time.perf_counter() - t
    m = engine.module
    flops = train_flops(body_params(m), m.config.hidden_size, m.config.vocab_size, B, a.prompt_len, T)
    return {"params": n_params(m), "body_params": body_params(m),
            "train_tok_s": a.steps * B * (a.prompt_len + T) / elapsed,
            "train_tflop_s": a.steps * flops / elapsed / 1e12, "train_peak_mib": peak_mib(torch),
            "dtypes": [str(d).removeprefix("torch.") for d in engine.get_data_types()]}


def start_phase(a, phase, path):
    cmd = [sys.executable, __file__, "--phase", phase, "--path", path] + a.passthrough
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                                os.path.join(sys.prefix, "torch_extensions"))}
    # files, not pipes: two children never block on a pipe
    log = open(os.path.join(path, f"{phase}.log"), "w+")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), log


def result(started, what):
    proc, log = started
    proc.wait()
    log.seek(0)
    out = log.read()
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"gpu_bench: {what} failed (exit code {proc.returncode}):\n{out[-4000:]}")
    return json.loads(lines[-1][7:])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b",
                   help=f"comma-separated, of {list(CONFIGS)}")
    p.add_argument("--tiny", action="store_true", help="the tiny config and workload (CPU, for the test)")
    p.add_argument("--prompts", type=count, default=64, help="generation: prompts per call")
    p.add_argument("--group-size", type=count, default=8, help="generation: completions per prompt")
    p.add_argument("--prompt-len", type=count, default=256, help="prompt tokens (generation and training)")
    p.add_argument("--new-tokens", type=count, default=512, help="completion tokens (generation and training)")
    p.add_argument("--gen-mem", type=float, default=0.5, help="vLLM gpu_memory_utilization")
    p.add_argument("--batch", type=count, default=64, help="training: sequences per optimizer step")
    p.add_argument("--micro-batch", type=count, default=8, help="training: sequences per forward/backward")
    p.add_argument("--steps", type=count, default=3, help="training: timed optimizer steps (after one warm-up)")
    p.add_argument("--grad-ckpt", action="store_true", help="training: gradient checkpointing")
    p.add_argument("--ds-config", default="ds_config.json",
                   help="training: DeepSpeed config (relative to the repository root)")
    p.add_argument("--no-gen", action="store_true", help="skip the generation phase (a machine without vLLM)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s for MFU (default: 989 on GPU)")
    p.add_argument("--phase", choices=["gen", "ours", "train"], help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.tiny:
        a.models = "tiny"
        vars(a).update(TINY)
    # said before any model runs, not after the ones before it
    if unknown := [m for m in a.models.split(",") if m not in CONFIGS]:
        raise SystemExit(f"gpu_bench: --models {a.models}: no config named {', '.join(unknown)} "
                         f"(known: {', '.join(CONFIGS)})")
    if a.phase:
        run = {"gen": generate, "ours": partial(generate, ours=True), "train": train}[a.phase]
        print("RESULT " + json.dumps(run(a, a.path)))
        return
    a.passthrough = [f"--{k.replace('_', '-')}={getattr(a, k)}"
                     for k in ("prompts", "group_size", "prompt_len", "new_tokens", "gen_mem", "batch",
                               "micro_batch", "steps", "ds_config")] + ["--grad-ckpt"] * a.grad_ckpt
    # a stop ends the phases running (the `finally` below) before their model's folder goes
    end_on_stops()
    import torch
    peak = a.peak_tflops or (989.0 if torch.cuda.is_available() else None)
    rows = []
    for config in a.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:   # bf16 on GPU (what vLLM and the trainer use there)
            random_model(tmp, dtype="bfloat16" if torch.cuda.is_available() else "float32",
                         max_len=a.prompt_len + a.new_tokens, **CONFIGS[config])
            r = {"gen_tok_s": "n/a", "ours_tok_s": "n/a", "gen_peak_mib": "n/a"}
            started = []

            def start(phase):   # each one is stopped in the `finally` below if it is still running
                started.append(start_phase(a, phase, tmp))
                return started[-1]
            try:
                # a smoke run: all phases at once, so that the test stays short
                if a.tiny and not a.no_gen:
                    gen, ours, trn = (start(phase) for phase in ("gen", "ours", "train"))
                    r.update({**result(gen, f"generation ({config})"),
                              **result(ours, f"our generation ({config})"),
                              **result(trn, f"training ({config})")})
                else:        # one after the other: each has the GPU to itself
                    if not a.no_gen:
                        r.update(result(start("gen"), f"generation ({config})"))
                        r.update(result(start("ours"), f"our generation ({config})"))
                    r.update(result(start("train"), f"training ({config})"))
            finally:
                # one phase failed, or a stop: the others do not run on in a deleted model folder
                for proc, log in started:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
                    log.close()
        mfu = f"{100 * r['train_tflop_s'] / peak:.3g}" if peak else "n/a"
        print(f"{config}: DeepSpeed's model and gradient-accumulation dtypes: {r['dtypes']}", flush=True)
        num = lambda v, fmt: v if isinstance(v, str) else format(v, fmt)
        share = lambda r: ("n/a" if isinstance(r["ours_tok_s"], str)
                           else f"{100 * r['ours_tok_s'] / r['gen_tok_s']:.1f}")
        rows.append([config, f"{r['params'] / 1e6:.1f}", f"{r['body_params'] / 1e6:.1f}",
                     num(r["gen_tok_s"], ".1f"), num(r["ours_tok_s"], ".1f"), share(r),
                     f"{r['train_tok_s']:.1f}", f"{r['train_tflop_s']:.4g}", mfu,
                     num(r["gen_peak_mib"], ".0f"), f"{r['train_peak_mib']:.0f}"])
    print(f"\n{machine()}; generation: {a.prompts} prompts x {a.group_size} completions, {a.prompt_len} + "
          f"{a.new_tokens} tokens; training: {a.batch} sequences of {a.prompt_len} + {a.new_tokens} tokens, "
          f"micro-batch {a.micro_batch}, grad-ckpt {a.grad_ckpt}, mean of {a.steps} steps; MFU against "
          f"{peak or 'n/a'} TFLOP/s")
    print_table(["model", "params M", "non-emb. M", "gen tok/s", "ours tok/s", "ours %", "train tok/s",
                 "train TFLOP/s", "MFU %",
                 "gen peak MiB", "train peak MiB"], rows)


if __name__ == "__main__":
    main()
