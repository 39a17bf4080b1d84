"""
GRPO in one file: a vLLM generation process, a reference-model server and a DeepSpeed ZeRO-2 trainer.

Launch (the offline CPU demo does all of this for you: `make demo`):
    python ref_server.py --model runs/demo/model --device cpu &
    deepspeed --num_gpus 1 grpo_train.py --model runs/demo/model --task demo --rewards demo
On GPUs (GPU 0 generates with vLLM, GPU 1 serves the reference model, GPUs 2-7 train; README: more):
    CUDA_VISIBLE_DEVICES=1 python ref_server.py --model Qwen/Qwen2.5-1.5B-Instruct --device cuda:0 &
    CUDA_VISIBLE_DEVICES=2,3,4,5,6,7 deepspeed grpo_train.py --model Qwen/Qwen2.5-1.5B-Instruct \
        --task gsm8k --rewards gsm8k,format:0.5 --gen-device 0

The choices this script makes, in the order a step meets them (the default, then the flag that changes it):
 1. Sampling: G completions per prompt from vLLM at --temperature; vLLM's log-probs of the sampled tokens
    (at the same temperature) are the behaviour ("old") log-probs of the PPO ratio.
 2. Reward: the weighted sum of --rewards; --overlong-buffer L adds DAPO's soft overlong penalty (0 until L
    tokens before --max-new-tokens, then down to -1 at it).
 3. Advantages: (r - mean) / (std + 1e-4) within each group of G, for every token of the completion.
    --scale-rewards batch: the batch's std; none: no std (Dr. GRPO); --std-floor: r - mean where std is below.
 4. Groups whose G rewards are all equal carry no signal: dropped and counted (frac_zero_std). --max-gen-rounds
    R (DAPO's dynamic sampling): up to R rounds of sampling to fill the batch with groups that have signal.
 5. Loss per token: -(min(r*A, clip(r, 1-eps_low, 1+eps_high)*A) - beta*KL), r = exp(logp - old_logp),
    KL = k3 = exp(ref - logp) - (ref - logp) - 1 against the frozen reference model (in the loss, not the
    reward). --agg: seq-mean-token-mean (GRPO, default), token-mean (DAPO) or seq-mean-token-sum-norm (Dr.
    GRPO), however the batch is split in micro-batches. --mask-truncated: no loss on cut-off completions.
 6. --tis-cap C: old_logp is the trainer's own (its first forward on the batch); each token's surrogate is
    weighted by min(exp(old_trainer - old_vllm), C), truncated IS for vLLM's numerics and the lag of choice 8.
 7. One optimizer step per batch; --num-iterations mu: mu steps (PPO epochs), so r leaves 1 and the clip
    acts. A step with a non-finite gradient norm is skipped (skipped_steps); --max-skips in a row stop the run.
 8. Asynchrony: vLLM generates the next batch while the trainer trains on this one, so a batch is usually
    one policy version old (policy_lag); batches older than --max-staleness are dropped.
 9. Weights go to vLLM in memory every --sync-every steps, checked on a probe sequence's log-probs.
10. The reference is frozen; --ref-sync-every K: the reference server reloads the checkpoint saved every K steps.
"""
import argparse
import math
import os
import time
from statistics import fmean as mean

import deepspeed
import torch
import torch.distributed as dist
from tqdm import tqdm

import rewards
from plumbing import (GenerationProcess, MetricsLog, broadcast_json, build_engine, check_config, check_reference,
                      collate, hand_over, held_out_eval, load_checkpoint, load_data, load_model, read_state,
                      save_checkpoint, stop_on_sigterm, write_eval)
from ref_server import ref_logps, reload_reference
from tasks import shuffled_forever
from weight_sync import WeightSync


def get_args(argv=None):
    p = argparse.ArgumentParser(description="GRPO trainer; launch it with the deepspeed launcher")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", required=True, help="HF hub name or local folder: the policy, and the reference")
    g.add_argument("--task", default="demo", help="prompt set (tasks.py): demo, gsm8k, countdown, code")
    g.add_argument("--data", default=None, help="local data (folder or file) for the task, instead of the hub")
    g.add_argument("--rewards", default="demo", help="name[:weight],... of rewards.REWARDS; eval reports the first")
    g.add_argument("--out-dir", default="runs/grpo", help="metrics.jsonl and checkpoints go here")
    g.add_argument("--seed", type=int, default=0, help="seed for the prompt order and sampling")
    g = p.add_argument_group("GRPO")
    g.add_argument("--steps", type=int, default=100, help="training steps (batches)")
    g.add_argument("--prompts-per-step", type=int, default=8, help="prompts sampled per step")
    g.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    g.add_argument("--max-new-tokens", type=int, default=512, help="completion length limit (tokens)")
    g.add_argument("--max-prompt-len", type=int, default=512, help="longer prompts are skipped (data/too_long)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, for log-probs too")
    g.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
    g.add_argument("--beta", type=float, default=0.04, help="KL penalty weight; 0 needs no reference server")
    g.add_argument("--eps-low", type=float, default=0.2, help="ratio clip below: 1 - eps_low")
    g.add_argument("--eps-high", type=float, default=0.2, help="ratio clip above: 1 + eps_high (DAPO: 0.28)")
    g.add_argument("--agg", default="seq-mean-token-mean", help="loss aggregation (choice 5 above)",
                   choices=["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
    g.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward on each rank")
    g = p.add_argument_group("GRPO variants (choices 2-7 above; the defaults leave them off)")
    g.add_argument("--num-iterations", type=int, default=1, help="optimizer steps per batch (mu)")
    g.add_argument("--scale-rewards", default="group", choices=["group", "batch", "none"], help="advantage std")
    g.add_argument("--std-floor", type=float, default=0.0, help="groups with a smaller std: r - mean only")
    g.add_argument("--tis-cap", type=float, default=None, help="truncated importance sampling cap C")
    g.add_argument("--mask-truncated", action="store_true", help="no loss on completions cut at the limit")
    g.add_argument("--overlong-buffer", type=int, default=0, help="DAPO soft overlong penalty over L tokens")
    g.add_argument("--max-gen-rounds", type=int, default=1, help="dynamic sampling: rounds to fill a batch")
    g.add_argument("--ref-sync-every", type=int, default=0, help="reference server reloads the policy every K")
    g = p.add_argument_group("system")
    g.add_argument("--ds-config", default="ds_config.json", help="DeepSpeed config (ZeRO-2)")
    g.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing: less memory, more compute")
    g.add_argument("--gen-device", type=int, default=0, help="GPU index (as the machine counts) for vLLM")
    g.add_argument("--gen-mem", type=float, default=0.9, help="vLLM gpu_memory_utilization")
    g.add_argument("--gen-kv-gb", type=int, default=1, help="vLLM KV cache size in GiB on CPU")
    g.add_argument("--ref-url", default="http://127.0.0.1:59875", help="reference server (ref_server.py)")
    g.add_argument("--ref-wait", type=float, default=300, help="seconds to wait for the reference server")
    g.add_argument("--sync-every", type=int, default=1, help="push weights to vLLM every N steps")
    g.add_argument("--sync-tol", type=float, default=0.1, help="fail if vLLM's probe log-probs differ more")
    g.add_argument("--max-staleness", type=int, default=1, help="drop batches more versions old than this")
    g.add_argument("--max-skips", type=int, default=3, help="stop after this many non-finite steps in a row")
    g.add_argument("--threads", type=int, default=1, help="torch threads per training rank (CPU)")
    g = p.add_argument_group("evaluation, logging and checkpoints")
    g.add_argument("--eval-every", type=int, default=0, help="held-out eval every N steps (and first and last)")
    g.add_argument("--eval-size", type=int, default=200, help="held-out samples per evaluation")
    g.add_argument("--eval-only", action="store_true", help="evaluate --model on the held-out split and exit")
    g.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (and at the end)")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out-dir")
    g.add_argument("--tensorboard", action="store_true", help="also log to tensorboard in --out-dir")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- the loss and log-probs

def grpo_loss(logps, old_logps, ref_logps, advantages, mask, *, beta, eps_low, eps_high, agg, max_len,
              vllm_logps=None, tis_cap=None):
    """Clipped per-token GRPO objective with a k3 KL penalty, as a loss to minimise. With tis_cap, old_logps
    are the trainer's own and each token is weighted by min(exp(old_logps - vllm_logps), tis_cap) (choice 6).

    Returns (loss, count, stats): `loss` is an average over `count` units (sequences, or tokens for
    token-mean), so a micro-batch's share of a bigger batch is loss * count / total_count."""
    mask = mask.to(logps.dtype)                                                   # (B, T)
    ratio = torch.exp(logps - old_logps)                                          # (B, T)
    adv = advantages.unsqueeze(1)                                                 # (B, 1)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)                              # (B, T)
    surrogate = torch.min(ratio * adv, clipped * adv)                             # (B, T)
    mismatch = (old_logps - vllm_logps) * mask if tis_cap else torch.zeros_like(mask)   # (B, T)
    if tis_cap:
        surrogate = surrogate * torch.exp(mismatch).clamp(max=tis_cap)            # (B, T)
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
    with torch.no_grad():   # where the min picks the clipped term: below for A < 0, above for A > 0
        low = ((ratio < 1 - eps_low) & (adv < 0)).to(mask.dtype) * mask          # (B, T)
        high = ((ratio > 1 + eps_high) & (adv > 0)).to(mask.dtype) * mask        # (B, T)
        stats = {"kl_sum": (kl * mask).sum(), "clip_low": low.sum(), "clip_high": high.sum(), "tokens": n_tokens,
                 "mismatch_sum": mismatch.abs().sum(), "mismatch_max": mismatch.abs().max()}
    return loss, count, stats


def _token_logps(hidden, targets, lm_head, temperature):
    logits = lm_head(hidden).float() / temperature                                   # (n, V)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)   # (n,)


def completion_logps(model, input_ids, attention_mask, n_completion, temperature=1.0, chunk=512):
    """Log-prob of each of the last `n_completion` tokens of every row (B, T), float32, at `temperature`.

    The full (B, T, vocab) logits are never made: the lm_head runs on `chunk` tokens at a time under activation
    checkpointing, so forward and backward hold one chunk's logits (~100 MB at vocab 152k), at the price of
    running the lm_head twice. Assumes logits = lm_head(hidden), as in Qwen, Llama and Mistral."""
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)                        # (B, L) left padding
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False).last_hidden_state[:, -n_completion - 1:-1]  # (B, T, H)
    targets = input_ids[:, -n_completion:]                                            # (B, T)
    out = [torch.utils.checkpoint.checkpoint(_token_logps, h, t, model.lm_head, temperature, use_reentrant=False)
           for h, t in zip(hidden.flatten(0, 1).split(chunk), targets.flatten().split(chunk))]
    return torch.cat(out).view(targets.shape)                                         # (B, T)


# ----------------------------------------------------------------------------- the generation process

def advantages(rewards, G, scale="group", std_floor=0.0):
    """Rewards of N groups of G, flat (N*G,) -> advantages (N, G) and has_signal (N,) (choices 3, 4)."""
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, G)                        # (N, G)
    std = r.std(1, keepdim=True)                                                       # (N, 1) unbiased, as TRL
    scale_by = {"group": std + 1e-4, "batch": torch.full_like(std, r.std().item() + 1e-4),
                "none": torch.ones_like(std)}[scale]                                   # (N, 1)
    scale_by = torch.where(std < std_floor, 1.0, scale_by)                             # (N, 1)
    return (r - r.mean(1, keepdim=True)) / scale_by, std.squeeze(1) > 0               # (N, G), (N,)


def generation_process(args, train_set, eval_set, sync, data_pos, messages):
    """Owns vLLM on its own device: sample -> score -> advantages -> hand the batch to the trainer.
    On any error it dies with a traceback on stderr; the trainer notices and stops the run."""
    os.environ["CUDA_VISIBLE_DEVICES"] = str(args.gen_device)   # GPU: a device of its own; CPU: no effect
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"            # engine in this process: 3 s start, not 20
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.gen_kv_gb))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    cpu = not torch.cuda.is_available()
    # fp32 on CPU: vLLM's bf16 CPU log-probs differ from the trainer's by up to 3 nats; torch.compile gains
    # nothing for small CPU models and costs 20 s at start (enforce_eager). A resumed run reseeds (data_pos).
    llm = LLM(args.model, seed=args.seed + data_pos, dtype="float32" if cpu else "auto", enforce_eager=cpu,
              gpu_memory_utilization=args.gen_mem, logprobs_mode="processed_logprobs",   # log-probs at temperature
              max_model_len=args.max_prompt_len + args.max_new_tokens)
    tok = llm.get_tokenizer()
    sampling = SamplingParams(n=args.group_size, temperature=args.temperature,
                              max_tokens=args.max_new_tokens, logprobs=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    spec = rewards.parse_reward_spec(args.rewards)
    encode = lambda s: TokensPrompt(prompt_token_ids=tok(s["prompt"], add_special_tokens=False)["input_ids"])
    order = shuffled_forever(len(train_set), args.seed, skip=data_pos)   # resume: after the trained prompts
    version, evaluated, parent, idle_s, P, G = -1, -1, os.getppid(), 0.0, args.prompts_per_step, args.group_size
    while True:
        # the newest weights the trainer pushed (version 0: the ones it started with), checked on a probe
        if pulled := sync.pull(llm, version):
            version, eval_version, probe_diff = pulled
            if probe_diff > args.sync_tol:
                raise RuntimeError(f"weight sync failed: vLLM's probe log-probs differ from the trainer's by "
                                   f"{probe_diff:.4f} on average (--sync-tol {args.sync_tol}), version {version}")
            if eval_version > evaluated:   # held-out: greedy; accuracy = the first reward of --rewards
                evals = held_out_eval(llm, eval_set, greedy, encode, spec)
                messages.put({"kind": "eval", "version": version, "evals": evals})
                evaluated = eval_version
                if args.eval_only:
                    return
        elif version < 0 and os.getppid() == parent:   # we start before the trainer's first push: wait for it
            time.sleep(0.05)
            continue

        t0, seqs, scores, completions, rounds, zero_std = time.time(), [], [], [], 0, 0
        while len(seqs) < P * G and rounds < args.max_gen_rounds:   # one round unless dynamic sampling (4)
            rounds += 1
            # --- sample: the next prompts of a shuffled pass over the data, G completions each
            picked = [train_set[next(order)] for _ in range(P)]
            data_pos += P
            outs = llm.generate([encode(s) for s in picked], sampling, use_tqdm=False)

            # --- score: every completion with every reward (logged as reward/<name>), plus the overlong term
            for s, c in ((s, c) for s, o in zip(picked, outs) for c in o.outputs):
                total, parts, n_err = rewards.score(c.text, s, spec)
                parts["overlong"] = rewards.overlong_penalty(len(c.token_ids), args.max_new_tokens,
                                                             args.overlong_buffer)
                scores.append((total + parts["overlong"], parts, n_err))
                completions.append(c)

            # --- advantages: within each group; groups whose rewards are all equal are dropped
            adv, signal = advantages([s[0] for s in scores[-P * G:]], G, args.scale_rewards, args.std_floor)
            zero_std += (~signal).sum().item()
            seqs += [{"prompt": o.prompt_token_ids, "completion": list(c.token_ids), "adv": a.item(),
                      "old": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
                      "truncated": c.finish_reason == "length"}
                     for o, group_adv, keep in zip(outs, adv, signal) if keep for c, a in zip(o.outputs, group_adv)]
        metrics = {f"reward/{name}": mean([s[1][name] for s in scores]) for name in scores[0][1]}
        metrics.update({"reward/mean": mean([s[0] for s in scores]), "reward/errors": sum(s[2] for s in scores),
                        "completion_len/mean": mean([len(c.token_ids) for c in completions]),
                        "completion_len/truncated": mean([c.finish_reason == "length" for c in completions]),
                        "frac_zero_std": zero_std / (rounds * P), "gen/rounds": rounds,
                        "batch/groups": min(P, len(seqs) // G), "data/prompts_seen": data_pos,
                        "time/gen_s": time.time() - t0, "time/gen_idle_s": idle_s, "sync/logp_diff": probe_diff})
        t0 = time.time()
        batch = {"kind": "batch", "version": version, "seqs": seqs[:P * G], "metrics": metrics}   # (4)
        if not hand_over(messages, batch, parent):   # blocks while the trainer is a batch behind
            return   # the trainer died without stopping us
        idle_s = time.time() - t0


# ----------------------------------------------------------------------------- the trainer

def main(args):
    t_start = time.time()
    if torch.cuda.is_available():   # GPU only: one device per rank, before any collective
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    master_process = rank == 0   # the one process with side effects: vLLM, weight pushes, logs
    stop_on_sigterm()   # a kill ends the run like Ctrl-C: the generation process is stopped on the way out
    torch.set_num_threads(args.threads)   # the CPU is shared with vLLM and the reference server
    check_config(args, world)   # a bad configuration fails here with a message, not later in a child process

    model, tok, fingerprint = load_model(args)   # (+ --grad-ckpt)
    state = read_state(args)   # --resume: the data position, policy version, counters (model and optimizer: below)
    train_set, eval_set, too_long = load_data(args, tok)   # prompts over --max-prompt-len are skipped
    probe_ids = tok(train_set[0]["prompt"] + str(train_set[0]["answer"]), add_special_tokens=False)["input_ids"][:64]

    version, counts, in_a_row, pending_eval, pushed_at_step = state["version"], state["counts"], 0, {}, {}
    if master_process:   # vLLM starts (15 s on CPU) while DeepSpeed sets up; it waits for the first push
        os.makedirs(args.out_dir, exist_ok=True)
        metrics_log = None if args.eval_only else MetricsLog(args.out_dir, state["step"], args.tensorboard)
        sync = WeightSync(model.named_parameters(), probe_ids, first_version=version)
        gen = GenerationProcess(generation_process, args, train_set, eval_set, sync, state["data_pos"])
    engine = build_engine(args, model)   # ZeRO-2 optimizer
    load_checkpoint(engine, args.out_dir, state["step"])   # resumed (step > 0): the model and optimizer
    if args.beta > 0 and not args.eval_only:   # the reference server is up and serves our reference
        check_reference(args, fingerprint, state["ref"])

    def push_weights(step, evaluate):
        """Rank 0: hand the weights to the generation process, with our log-probs of the probe (choice 9)."""
        ids = torch.tensor([probe_ids], device=engine.device)
        with torch.no_grad():
            probe = completion_logps(engine.module, ids, torch.ones_like(ids), len(probe_ids) - 1)[0]
        v = sync.push(engine.module.named_parameters(), probe, evaluate, while_waiting=lambda: gen.check_alive())
        pushed_at_step[v] = step
        return v

    if master_process:   # the generation process loads the starting weights (and evaluates them) first
        version = push_weights(state["step"], evaluate=state["step"] == 0)
        if args.eval_only:
            write_eval(args, gen.next_message(), len(eval_set))
    for step in tqdm(range(state["step"] + 1, 1 if args.eval_only else args.steps + 1), disable=not master_process,
                     desc="grpo"):
        # --- sample, score, advantages: done by the generation process; rank 0 takes its next fresh batch
        t0 = time.time()
        batch = None
        while master_process and batch is None:
            msg = gen.next_message()
            if msg["kind"] == "eval":
                pending_eval = {**msg["evals"], "eval/step": pushed_at_step[msg["version"]]}
            elif version - msg["version"] > args.max_staleness:
                counts["stale_dropped"] += 1
            else:
                batch = msg
                batch["metrics"]["policy_lag"] = version - batch["version"]
        batch, wait_s = broadcast_json(batch, engine.device), time.time() - t0
        seqs = batch["seqs"]
        mine = seqs[rank::world]   # this rank's share

        # --- reference log-probs over HTTP (none needed when beta == 0); a restarting server is waited for
        t0 = time.time()
        if args.beta > 0 and mine:
            got = ref_logps(args.ref_url, [s["prompt"] for s in mine], [s["completion"] for s in mine],
                            args.temperature, retry_for=args.ref_wait)
            for s, r in zip(mine, got):
                s["ref"] = r.tolist()
        ref_s = time.time() - t0

        # --- loss and step: micro-batches accumulate into one optimizer step, --num-iterations steps per batch
        t0 = time.time()
        total = sum(len(s["completion"]) for s in seqs) if args.agg == "token-mean" else len(seqs)
        n_micro = math.ceil(math.ceil(len(seqs) / world) / args.micro_batch)   # the same on every rank
        sums, grad_norm = torch.zeros(6, device=engine.device), 0.0   # loss, KL, clip low, high, tokens, mismatch
        mismatch_max, old_trainer = torch.zeros((), device=engine.device), {}
        for it in range(args.num_iterations if n_micro else 0):   # n_micro == 0: no group had signal, no update
            for i in range(n_micro):
                chunk = mine[i * args.micro_batch:(i + 1) * args.micro_batch]
                weight = 1.0 if chunk else 0.0   # ZeRO-2 reduces at every backward: no data, a zero-weight pass
                b = collate(chunk or [{**seqs[0], "ref": seqs[0]["old"]}], tok.pad_token_id, engine.device,
                            mask_truncated=args.mask_truncated)
                engine.set_gradient_accumulation_boundary(i == n_micro - 1)
                logps = completion_logps(engine.module, b["ids"], b["attn"], b["mask"].shape[1], args.temperature)
                if args.tis_cap and it == 0:   # the trainer's own old log-probs: before the first update (6)
                    old_trainer[i] = logps.detach()
                loss, count, st = grpo_loss(logps, old_trainer[i] if args.tis_cap else b["old"], b["ref"], b["adv"],
                                            b["mask"], beta=args.beta, eps_low=args.eps_low, eps_high=args.eps_high,
                                            agg=args.agg, max_len=args.max_new_tokens, vllm_logps=b["old"],
                                            tis_cap=args.tis_cap)
                # this micro-batch's share of the batch's loss; * world as DeepSpeed averages gradients over ranks
                share = loss * count / total * weight
                engine.backward(share * world)
                sums += torch.stack([share.detach(), *(st[k] for k in ("kl_sum", "clip_low", "clip_high", "tokens",
                                                                         "mismatch_sum"))]) * weight
                mismatch_max = torch.maximum(mismatch_max, st["mismatch_max"] * weight)
            engine.step()
            # DeepSpeed 0.19 skips the update itself when the gradient norm is not finite, and reports inf
            grad_norm = float(engine.get_global_grad_norm())
            in_a_row = 0 if math.isfinite(grad_norm) else in_a_row + 1
            counts["skipped_steps"] += not math.isfinite(grad_norm)
            if in_a_row >= args.max_skips:
                raise SystemExit(f"grpo_train.py: stopping at step {step}: the gradient norm was not finite "
                                 f"{in_a_row} times in a row (--max-skips); the last checkpoint is unaffected")
        dist.all_reduce(sums)
        dist.all_reduce(mismatch_max, op=dist.ReduceOp.MAX)
        train_s = time.time() - t0

        # --- push weights to vLLM
        t0 = time.time()
        if master_process and (step % args.sync_every == 0 or step == args.steps):
            version = push_weights(step, step == args.steps or bool(args.eval_every and step % args.eval_every == 0))
        sync_s = time.time() - t0

        # --- log
        if master_process:
            loss, kl, low, high, tokens, mismatch = (sums / sums[4].clamp(min=1)).tolist()
            log = {"step": step, **batch["metrics"], "loss": sums[0].item() / args.num_iterations, "kl": kl,
                   "clip/low": low, "clip/high": high, "grad_norm": grad_norm, **counts, "data/too_long": too_long,
                   "time/wait_s": wait_s, "time/ref_s": ref_s, "time/train_s": train_s, "time/sync_s": sync_s,
                   "time/elapsed_s": time.time() - t_start, **pending_eval}
            if args.tis_cap:
                log.update({"sampling/logp_diff_mean": mismatch, "sampling/logp_diff_max": mismatch_max.item()})
            if step == args.steps:   # the final evaluation is worth waiting for
                while (msg := gen.next_message())["kind"] != "eval" or msg["version"] != version:
                    pass
                log.update({**msg["evals"], "eval/step": step})
            pending_eval = {}
            metrics_log.write(log)

        # --- checkpoint (resumable, with the HF model inside); the reference server may reload it (choice 10)
        refresh = args.ref_sync_every and step % args.ref_sync_every == 0
        if step == args.steps or refresh or (args.save_every and step % args.save_every == 0):
            state.update(step=step, version=version, data_pos=batch["metrics"]["data/prompts_seen"])
            path = save_checkpoint(engine, tok, args.out_dir, step, state, refresh=refresh)
            if refresh and master_process:
                reload_reference(args.ref_url, path)
            dist.barrier()

    if master_process:
        gen.stop()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args())
