"""
GRPO in one file: a vLLM generation process, a reference-model server and a DeepSpeed ZeRO-2 trainer.

Launch (the offline CPU demo does all of this for you: `make demo`):
    python ref_server.py --model runs/demo/model --device cpu &
    deepspeed --num_gpus 1 grpo_train.py --model runs/demo/model --task demo --rewards demo
On GPUs (GPU 0 generates with vLLM, GPU 1 serves the reference model, GPUs 2-7 train):
    CUDA_VISIBLE_DEVICES=1 python ref_server.py --model Qwen/Qwen2.5-1.5B-Instruct --device cuda:0 &
    CUDA_VISIBLE_DEVICES=2,3,4,5,6,7 deepspeed grpo_train.py --model Qwen/Qwen2.5-1.5B-Instruct \
        --task gsm8k --rewards gsm8k,format:0.5 --gen-device 0

The choices this script makes, in the order a step meets them:
 1. Sampling: G completions per prompt from vLLM at --temperature; vLLM's log-probs of the sampled tokens
    (at the same temperature) are the behaviour ("old") log-probs of the PPO ratio.
 2. Advantages: (r - mean) / (std + 1e-4) within each group of G, given to every token of the completion.
 3. Groups whose G rewards are all equal carry no signal: they are dropped, and counted (frac_zero_std).
 4. Loss per token: -(min(r*A, clip(r, 1-eps_low, 1+eps_high)*A) - beta*KL), r = exp(logp - old_logp),
    KL = k3 = exp(ref - logp) - (ref - logp) - 1 against the frozen reference model (in the loss, not
    the reward). Aggregation --agg: seq-mean-token-mean (GRPO, default), token-mean (DAPO) or
    seq-mean-token-sum-norm (Dr. GRPO); micro-batches are weighted so the split does not change it.
 5. Asynchrony: vLLM generates the next batch while the trainer trains on this one, so a batch is
    usually one policy version old (policy_lag); batches older than --max-staleness are dropped.
 6. Weight sync in memory every --sync-every steps (shared CPU buffers, never disk), checked by comparing
    vLLM's and the trainer's log-probs of a fixed probe sequence.
"""
import argparse
import json
import math
import os
import queue
import time
from statistics import fmean as mean

import deepspeed
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

import rewards
from ref_server import model_fingerprint, ref_logps, wait_for_server
from tasks import load_task, shuffled_forever
from weight_sync import WeightSync


def get_args(argv=None):
    p = argparse.ArgumentParser(description="GRPO trainer; launch it with the deepspeed launcher")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", required=True, help="HF hub name or local folder: the policy, and the reference")
    g.add_argument("--task", default="demo", help="prompt set (tasks.py): demo")
    g.add_argument("--data", default=None, help="local data file for the task, instead of the hub")
    g.add_argument("--rewards", default="demo", help="name[:weight],... of rewards.REWARDS; eval reports the first")
    g.add_argument("--out-dir", default="runs/grpo", help="metrics.jsonl and checkpoints go here")
    g.add_argument("--seed", type=int, default=0, help="seed for the prompt order and sampling")
    g = p.add_argument_group("GRPO")
    g.add_argument("--steps", type=int, default=100, help="optimizer steps")
    g.add_argument("--prompts-per-step", type=int, default=8, help="prompts sampled per step")
    g.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    g.add_argument("--max-new-tokens", type=int, default=512, help="completion length limit (tokens)")
    g.add_argument("--max-prompt-len", type=int, default=512, help="prompt length limit (tokens)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, for log-probs too")
    g.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
    g.add_argument("--beta", type=float, default=0.04, help="KL penalty weight; 0 needs no reference server")
    g.add_argument("--eps-low", type=float, default=0.2, help="ratio clip below: 1 - eps_low")
    g.add_argument("--eps-high", type=float, default=0.2, help="ratio clip above: 1 + eps_high (DAPO: 0.28)")
    g.add_argument("--agg", default="seq-mean-token-mean", help="loss aggregation (choice 4 above)",
                   choices=["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
    g.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward on each rank")
    g = p.add_argument_group("system")
    g.add_argument("--ds-config", default="ds_config.json", help="DeepSpeed config (ZeRO-2)")
    g.add_argument("--gen-device", type=int, default=0, help="GPU index (as the machine counts) for vLLM")
    g.add_argument("--gen-mem", type=float, default=0.9, help="vLLM gpu_memory_utilization")
    g.add_argument("--gen-kv-gb", type=int, default=1, help="vLLM KV cache size in GiB on CPU")
    g.add_argument("--ref-url", default="http://127.0.0.1:59875", help="reference server (ref_server.py)")
    g.add_argument("--ref-wait", type=float, default=300, help="seconds to wait for the reference server")
    g.add_argument("--sync-every", type=int, default=1, help="push weights to vLLM every N steps")
    g.add_argument("--sync-tol", type=float, default=0.1, help="fail if vLLM's probe log-probs differ more")
    g.add_argument("--max-staleness", type=int, default=1, help="drop batches more versions old than this")
    g.add_argument("--threads", type=int, default=1, help="torch threads per training rank (CPU)")
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--eval-every", type=int, default=0, help="held-out eval every N steps (and first and last)")
    g.add_argument("--eval-size", type=int, default=200, help="held-out samples per evaluation")
    g.add_argument("--save-every", type=int, default=0, help="HF checkpoint every N steps (and at the end)")
    g.add_argument("--tensorboard", action="store_true", help="also log to tensorboard in --out-dir")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- the loss and log-probs

def grpo_loss(logps, old_logps, ref_logps, advantages, mask, *, beta, eps_low, eps_high, agg, max_len):
    """Clipped per-token GRPO objective with a k3 KL penalty, as a loss to minimise.

    Returns (loss, count, stats): `loss` is an average over `count` units (sequences, or tokens for
    token-mean), so a micro-batch's share of a bigger batch is loss * count / total_count."""
    mask = mask.to(logps.dtype)                                                   # (B, T)
    ratio = torch.exp(logps - old_logps)                                          # (B, T)
    adv = advantages.unsqueeze(1)                                                 # (B, 1)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)                              # (B, T)
    surrogate = torch.min(ratio * adv, clipped * adv)                             # (B, T)
    d = ref_logps - logps if beta > 0 else torch.zeros_like(logps)               # (B, T)
    kl = torch.exp(d) - d - 1                                                     # (B, T) k3 >= 0, 0 if d == 0
    token_loss = -(surrogate - beta * kl) * mask                                  # (B, T)
    n_tokens = mask.sum()
    if agg == "seq-mean-token-mean":
        loss, count = (token_loss.sum(1) / mask.sum(1).clamp(min=1)).mean(), len(logps)
    elif agg == "token-mean":
        loss, count = token_loss.sum() / n_tokens.clamp(min=1), n_tokens.item()
    elif agg == "seq-mean-token-sum-norm":
        loss, count = token_loss.sum() / (len(logps) * max_len), len(logps)
    else:
        raise ValueError(f"unknown agg {agg!r}")
    with torch.no_grad():
        is_clipped = (ratio * adv != surrogate).to(mask.dtype)                    # (B, T)
        stats = {"kl_sum": (kl * mask).sum(), "clip_sum": (is_clipped * mask).sum(), "tokens": n_tokens}
    return loss, count, stats


def pad_batch(prompts, completions, pad_id):
    """Left-pad the prompts and right-pad the completions, so every completion starts at the same column.

    prompts, completions: lists of token-id lists. Returns input_ids (B, P+T), attention_mask (B, P+T) and
    completion_mask (B, T); T = longest completion. Masks come from lengths, never from pad_id (Qwen's pad is
    its EOS, and the EOS that ends a completion must count)."""
    P, T = max(map(len, prompts)), max(map(len, completions))
    input_ids = torch.full((len(prompts), P + T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, P - len(p):P + len(c)] = torch.tensor(p + c)
        attention_mask[i, P - len(p):P + len(c)] = 1
    return input_ids, attention_mask, attention_mask[:, P:]


def completion_logps(model, input_ids, attention_mask, n_completion, temperature=1.0, chunk=8):
    """Log-prob of each of the last `n_completion` tokens of every row (B, T), at `temperature`.

    Gathers the chosen token's logit minus logsumexp a few rows at a time, so no float32 (B, T, vocab)
    log-softmax copy is ever made; the model's own logits are cut to the completion with logits_to_keep."""
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)                        # (B, L) left padding
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=n_completion + 1).logits[:, :-1]                   # (B, T, V)
    targets = input_ids[:, -n_completion:]                                            # (B, T)
    out = []
    for lg, tg in zip(logits.split(chunk), targets.split(chunk)):
        lg = lg.float() / temperature                                                 # (b, T, V)
        out.append(lg.gather(-1, tg.unsqueeze(-1)).squeeze(-1) - lg.logsumexp(-1))    # (b, T)
    return torch.cat(out)                                                             # (B, T)


# ----------------------------------------------------------------------------- the generation process

def group_advantages(rewards):
    """Rewards of one group (G,) -> advantages (r - mean) / (std + 1e-4), or None when all are equal (choice 3)."""
    r = torch.tensor(rewards, dtype=torch.float64)                                    # (G,)
    return None if r.std() == 0 else ((r - r.mean()) / (r.std() + 1e-4)).tolist()   # unbiased std, as TRL


def generation_process(args, train_set, eval_set, sync, batches):
    """Owns vLLM on its own device: sample -> score -> advantages -> hand the batch to the trainer.
    On any error it dies with a traceback on stderr; the trainer notices and stops the run."""
    os.environ["CUDA_VISIBLE_DEVICES"] = str(args.gen_device)   # GPU: a device of its own; CPU: no effect
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"            # engine in this process: 3 s start, not 20
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.gen_kv_gb))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    cpu = not torch.cuda.is_available()
    # fp32 on CPU: vLLM's bf16 CPU log-probs differ from the trainer's by up to 3 nats; torch.compile gains
    # nothing for small CPU models and costs 20 s at start (enforce_eager)
    llm = LLM(args.model, seed=args.seed, dtype="float32" if cpu else "auto", enforce_eager=cpu,
              gpu_memory_utilization=args.gen_mem, logprobs_mode="processed_logprobs",   # log-probs at temperature
              max_model_len=args.max_prompt_len + args.max_new_tokens)
    tok = llm.get_tokenizer()
    sampling = SamplingParams(n=args.group_size, temperature=args.temperature,
                              max_tokens=args.max_new_tokens, logprobs=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    spec = rewards.parse_reward_spec(args.rewards)
    encode = lambda s: TokensPrompt(prompt_token_ids=tok(s["prompt"], add_special_tokens=False)["input_ids"])
    order, version, evaluated, parent = shuffled_forever(len(train_set), args.seed), -1, -1, os.getppid()
    while True:
        # the newest weights the trainer pushed (version 0: the ones it started with), checked on a probe
        if pulled := sync.pull(llm, version):
            version, eval_version, probe_diff = pulled
            if probe_diff > args.sync_tol:
                raise RuntimeError(f"weight sync failed: vLLM's probe log-probs differ from the trainer's by "
                                   f"{probe_diff:.4f} on average (--sync-tol {args.sync_tol}), version {version}")
            if eval_version > evaluated:   # held-out accuracy: greedy, first reward of --rewards
                outs = llm.generate([encode(s) for s in eval_set], greedy, use_tqdm=False)
                acc = [rewards.score(o.outputs[0].text, s, spec[:1])[1][spec[0][0]] for o, s in zip(outs, eval_set)]
                batches.put({"kind": "eval", "version": version, "eval/accuracy": sum(acc) / len(acc)})
                evaluated = eval_version

        # --- sample: the next prompts of a shuffled pass over the data, G completions each
        t0 = time.time()
        picked = [train_set[next(order)] for _ in range(args.prompts_per_step)]
        outs = llm.generate([encode(s) for s in picked], sampling, use_tqdm=False)
        completions = [c for o in outs for c in o.outputs]

        # --- score: every completion with every reward; each component is logged as reward/<name>
        scores = [rewards.score(c.text, s, spec) for s, o in zip(picked, outs) for c in o.outputs]
        totals = [total for total, _, _ in scores]
        metrics = {f"reward/{name}": mean([parts[name] for _, parts, _ in scores]) for name, _ in spec}
        metrics.update({"reward/mean": mean(totals), "reward/errors": sum(e for _, _, e in scores),
                        "completion_len/mean": mean([len(c.token_ids) for c in completions])})

        # --- advantages: one per completion, within its group; equal-reward groups are dropped
        seqs, G = [], args.group_size
        for i, o in enumerate(outs):
            adv = group_advantages(totals[i * G:(i + 1) * G])
            if adv is not None:
                seqs += [(o.prompt_token_ids, list(c.token_ids),
                          [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)], a)
                         for c, a in zip(o.outputs, adv)]
        metrics.update({"frac_zero_std": 1 - len(seqs) / len(completions), "time/gen_s": time.time() - t0,
                        "sync/logp_diff": probe_diff})
        batch = {"kind": "batch", "version": version, "seqs": seqs, "metrics": metrics}
        while True:   # the queue is bounded: generation runs at most one batch ahead of training
            try:
                batches.put(batch, timeout=5)
                break
            except queue.Full:
                if os.getppid() != parent:   # the trainer died without stopping us
                    return


# ----------------------------------------------------------------------------- the trainer

def collate(seqs, pad_id, device="cpu"):
    """(prompt ids, completion ids, old logps, advantage, ref logps) tuples -> a micro-batch's tensors."""
    input_ids, attention_mask, completion_mask = pad_batch([s[0] for s in seqs], [s[1] for s in seqs], pad_id)
    T = completion_mask.shape[1]
    pad = lambda rows: torch.stack([torch.nn.functional.pad(torch.as_tensor(r, dtype=torch.float32),
                                                            (0, T - len(r))) for r in rows])   # (B, T)
    ref = pad([s[4] for s in seqs]) if seqs[0][4] is not None else None
    out = input_ids, attention_mask, completion_mask, pad([s[2] for s in seqs]), ref, torch.tensor([s[3] for s in seqs])
    return [None if t is None else t.to(device) for t in out]


def main(args):
    if torch.cuda.is_available():   # GPU only: one device per rank, before any collective
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    master_process = rank == 0
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)   # the CPU is shared with vLLM and the reference server
    problems = [msg for bad, msg in [
        (args.group_size < max(2, world), "--group-size must be >= 2 and >= the number of training ranks"),
        (min(args.micro_batch, args.prompts_per_step, args.steps) < 1, "sizes and --steps must be >= 1"),
        (os.sep in args.model and not os.path.isdir(args.model), f"--model {args.model}: no such folder")] if bad]
    if problems:
        raise SystemExit("grpo_train.py: " + "; ".join(problems))
    rewards.parse_reward_spec(args.rewards)   # a bad --rewards fails here, not in the generation process

    bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if bf16 else torch.float32)
    with open(args.ds_config) as f:
        ds_config = json.load(f)
    # gradient_accumulation_steps stays 1: micro-batches per step vary, so the loop marks the boundary itself
    ds_config.update({"train_micro_batch_size_per_gpu": args.micro_batch, "bf16": {"enabled": bf16}})
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0,
                                  fused=torch.cuda.is_available())   # torch's AdamW: no JIT build on CPU
    if args.beta > 0:   # the reference server must be up, and serve the model we start from
        if wait_for_server(args.ref_url, timeout=args.ref_wait)["fingerprint"] != model_fingerprint(model):
            raise RuntimeError(f"{args.ref_url} serves another model than --model {args.model}")
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

    train_set = load_task(args.task, "train", data=args.data, seed=args.seed)
    eval_set = load_task(args.task, "test", data=args.data, seed=args.seed)[:args.eval_size]
    probe_ids = tok(train_set[0]["prompt"] + str(train_set[0]["answer"]), add_special_tokens=False)["input_ids"]

    version, stale_dropped, pending_eval, pushed_at_step = -1, 0, {}, {}
    if master_process:
        os.makedirs(args.out_dir, exist_ok=True)
        metrics_file = open(os.path.join(args.out_dir, "metrics.jsonl"), "w")
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            tb = SummaryWriter(args.out_dir)
        sync, batches = WeightSync(engine.module.named_parameters(), probe_ids), mp.get_context("spawn").Queue(1)

    def push_weights(step, evaluate):
        """Rank 0: hand the weights to the generation process, with our log-probs of the probe (choice 6)."""
        nonlocal version
        ids = torch.tensor([probe_ids], device=engine.device)
        with torch.no_grad():
            probe = completion_logps(engine.module, ids, torch.ones_like(ids), len(probe_ids) - 1)[0]
        version = sync.push(engine.module.named_parameters(), probe, evaluate, while_waiting=check_alive)
        pushed_at_step[version] = step

    def check_alive():   # rank 0
        if not gen.is_alive():
            raise RuntimeError(f"the generation process died (exit code {gen.exitcode}); its traceback is above")

    def next_message():
        """Rank 0: the generation process's next message; notices within seconds when it has died."""
        while True:
            try:
                return batches.get(timeout=2)
            except queue.Empty:
                check_alive()

    if master_process:   # version 0 is the starting weights; the generation process evaluates them first
        push_weights(0, evaluate=True)
        gen = mp.get_context("spawn").Process(target=generation_process, daemon=True,
                                              args=(args, train_set, eval_set, sync, batches))
        gen.start()
    for step in tqdm(range(1, args.steps + 1), disable=not master_process, desc="grpo"):
        # --- sample, score, advantages: done by the generation process; rank 0 takes its next fresh batch
        t0 = time.time()
        batch = None
        while master_process and batch is None:
            msg = next_message()
            if msg["kind"] == "eval":
                pending_eval = {"eval/accuracy": msg["eval/accuracy"], "eval/step": pushed_at_step[msg["version"]]}
            elif version - msg["version"] > args.max_staleness:
                stale_dropped += 1
            else:
                batch = msg
                batch["metrics"]["policy_lag"] = version - batch["version"]
        box = [batch]
        dist.broadcast_object_list(box, src=0)
        batch, wait_s = box[0], time.time() - t0
        seqs = batch["seqs"]
        mine = seqs[rank::world]   # this rank's share

        # --- reference log-probs over HTTP (none needed when beta == 0)
        t0 = time.time()
        ref = ref_logps(args.ref_url, [s[0] for s in mine], [s[1] for s in mine], args.temperature) \
            if args.beta > 0 and seqs else [None] * len(mine)
        mine = [(*s, r) for s, r in zip(mine, ref)]
        ref_s = time.time() - t0

        # --- loss and step: micro-batches accumulate into one optimizer step
        t0 = time.time()
        total = sum(len(s[1]) for s in seqs) if args.agg == "token-mean" else len(seqs)
        n_micro = math.ceil(math.ceil(len(seqs) / world) / args.micro_batch)   # the same on every rank
        sums = torch.zeros(4, device=engine.device)   # loss, KL, clipped tokens, tokens
        for i in range(n_micro):
            chunk = mine[i * args.micro_batch:(i + 1) * args.micro_batch]
            # ZeRO-2 reduces gradients at every backward: a rank out of sequences runs a zero-weight pass
            weight = 1.0 if chunk else 0.0
            ids, attn, cmask, old, ref_lp, adv = collate(chunk or mine[:1], tok.pad_token_id, engine.device)
            engine.set_gradient_accumulation_boundary(i == n_micro - 1)
            logps = completion_logps(engine, ids, attn, cmask.shape[1], args.temperature)   # float32
            loss, count, st = grpo_loss(logps, old, ref_lp, adv, cmask, beta=args.beta, eps_low=args.eps_low,
                                        eps_high=args.eps_high, agg=args.agg, max_len=args.max_new_tokens)
            # this micro-batch's share of the batch's loss; * world as DeepSpeed averages gradients over ranks
            share = loss * count / total * weight
            engine.backward(share * world)
            sums += torch.stack([share.detach(), st["kl_sum"], st["clip_sum"], st["tokens"]]) * weight
        if n_micro:   # else no group had any signal: no update this step
            engine.step()
        grad_norm = float(engine.get_global_grad_norm()) if n_micro else 0.0   # before clipping
        dist.all_reduce(sums)
        train_s = time.time() - t0

        # --- push weights to vLLM
        t0 = time.time()
        if master_process and (step % args.sync_every == 0 or step == args.steps):
            push_weights(step, evaluate=step == args.steps or bool(args.eval_every and step % args.eval_every == 0))
        sync_s = time.time() - t0

        # --- log
        if master_process:
            m = batch["metrics"]
            log = {"step": step, **m, "loss": sums[0].item(), "kl": (sums[1] / sums[3].clamp(min=1)).item(),
                   "clip_frac": (sums[2] / sums[3].clamp(min=1)).item(), "grad_norm": grad_norm,
                   "stale_dropped": stale_dropped, "time/wait_s": wait_s, "time/ref_s": ref_s, "time/train_s": train_s, "time/sync_s": sync_s,
                   **pending_eval}
            if step == args.steps:   # the final evaluation is worth waiting for
                while (msg := next_message())["kind"] != "eval" or msg["version"] != version:
                    pass
                log.update({"eval/accuracy": msg["eval/accuracy"], "eval/step": step})
            pending_eval = {}
            metrics_file.write(json.dumps(log) + "\n")
            metrics_file.flush()
            if args.tensorboard:
                for k, v in log.items():
                    tb.add_scalar(k, v, step)
            tqdm.write(f"step {step:4d} | reward {m['reward/mean']:.3f} | loss {log['loss']:+.4f} | kl {log['kl']:.4f}"
                       f" | len {m['completion_len/mean']:.1f} | zero-std {m['frac_zero_std']:.2f}"
                       + (f" | eval {log['eval/accuracy']:.3f}" if "eval/accuracy" in log else ""))

        # --- checkpoint (HF format, with the tokenizer)
        if master_process and (step == args.steps or (args.save_every and step % args.save_every == 0)):
            path = os.path.join(args.out_dir, f"step_{step}")
            engine.module.save_pretrained(path)
            tok.save_pretrained(path)

    if master_process:
        gen.terminate()
        gen.join(timeout=30)
        metrics_file.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args())
