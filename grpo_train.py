"""GRPO in one file: vLLM samples, a server holds the reference model, DeepSpeed ZeRO-2 trains.
    deepspeed --log_level critical --num_gpus 1 grpo_train.py --model runs/demo/model --lr 3e-4

The choices of one step (docs/variants.md: the flags that change them):
 1. Rollout: vLLM samples G completions per prompt, with each token's log-prob under the policy
    that sampled it (the behaviour policy, pi_vLLM): weights one push old, as vLLM samples the
    next batch while the trainer trains on this one.
 2. Advantage: A = (r - mean) / (std + 1e-4) of the rewards in each group of G. Groups of equal
    rewards carry no signal: left out of the loss, still divided by what was sampled (as TRL).
 3. Loss per token: -(w min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A) - beta KL), with
    ratio = exp(logp - old_logp) to the trainer's own log-probs before the update (1 at
    --num-iterations 1), and KL = exp(ref - logp) - (ref - logp) - 1 (k3) to the reference.
 4. w = pi_old(y) / pi_vLLM(y), the sequence's weight for vLLM having sampled it (one push of lag
    and vLLM's numerics); 0 above 3 (masked IS, as TRL): truncated, it would still train on the
    sequences furthest off-policy; per token, it would ignore the prefix.
"""
import argparse
from functools import partial

import torch
import torch.distributed as dist

import rewards
from batches import broadcast_json, collate, micro_batches, normaliser
from checkpoints import StopAfterStep, load_checkpoint, read_state, save_checkpoint, save_on_stop
from generation import GenerationProcess
from metrics import (Counters, MetricsLog, add_stats, loss_metrics, policy_stats, reduce_stats,
                     rollout_metrics, timed)
from ref_client import ref_logps
from run_setup import (add_system_args, build_engine, check_config, init_distributed, load_policy,
                       load_prompts, parse_flags, shut_down)

def get_args(argv=None):
    p = argparse.ArgumentParser(description="GRPO trainer; launch it with the deepspeed launcher")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", required=True, help="HF hub name or folder: policy and reference")
    g.add_argument("--task", default="demo", help="prompt set (tasks.py)")
    g.add_argument("--data", default=None, help="file, folder or hub dataset")
    g.add_argument("--rewards", default="demo", help="name[:weight],... of rewards.REWARDS")
    g.add_argument("--out-dir", default="runs/grpo", help="metrics.jsonl and checkpoints go here")
    g.add_argument("--seed", type=int, default=0, help="seed for the prompt order and sampling")
    g = p.add_argument_group("GRPO")
    g.add_argument("--steps", type=int, default=100, help="training steps (batches)")
    g.add_argument("--prompts-per-step", type=int, default=8, help="prompts sampled per step")
    g.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    g.add_argument("--max-new-tokens", type=int, default=512, help="completion length limit")
    g.add_argument("--max-prompt-len", type=int, default=512, help="longer prompts are skipped")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    g.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
    g.add_argument("--beta", type=float, default=0.04, help="KL weight; 0: no reference")
    g.add_argument("--eps-low", type=float, default=0.2, help="ratio clip below: 1 - eps_low")
    g.add_argument("--eps-high", type=float, default=0.2, help="ratio clip above (DAPO: 0.28)")
    g.add_argument("--agg", default="seq-mean-token-mean", help="loss aggregation (choice 3)",
                   choices=["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
    g.add_argument("--loss-norm", default="sampled", choices=["sampled", "kept"],
                   help="divide the loss by what was sampled or kept (choice 2)")
    g.add_argument("--ratio-level", default="token", choices=["token", "sequence"],
                   help="sequence: GSPO (its paper: --eps-low 3e-4 --eps-high 4e-4)")
    g.add_argument("--is-mode", default="sequence-mask", help="vLLM's weight w (choice 4)",
                   choices=["none", "token-truncate", "token-mask", "sequence-truncate",
                            "sequence-mask"])
    g.add_argument("--is-min", type=float, default=0.0, help="w's lower bound")
    g.add_argument("--is-max", type=float, default=3.0, help="w's upper bound")
    g = p.add_argument_group("GRPO variants (the defaults leave them off)")
    g.add_argument("--num-iterations", type=int, default=1, help="optimizer steps per batch (mu)")
    g.add_argument("--scale-rewards", default="group", choices=["group", "batch", "none"],
                   help="std that divides advantages")
    g.add_argument("--std-floor", type=float, default=0.0, help="groups with less std: r - mean")
    g.add_argument("--off-policy-mask", type=float, default=None, help="DeepSeek-V3.2's delta")
    g.add_argument("--kl-is-weight", action="store_true", help="k3 x pi / pi_vllm (DeepSeek-V3.2)")
    g.add_argument("--mask-truncated", action="store_true", help="no loss on cut-off completions")
    g.add_argument("--overlong-buffer", type=int, default=0, help="DAPO overlong penalty span")
    g.add_argument("--max-gen-rounds", type=int, default=1, help="dynamic sampling rounds")
    g.add_argument("--ref-sync-every", type=int, default=0, help="reference reloads policy every K")
    # system, evaluation, logging and checkpoint flags: with the code they steer; --config's file
    return parse_flags(add_system_args(p), argv)

def advantages(scores, group_size, scale="group", std_floor=0.0):
    """Flat rewards of N groups -> advantages (N, G), has_signal (N,): unequal rewards, exactly
    (choice 2). "batch" leaves r - mean: batches.merge_batches divides by the whole batch's std."""
    r = torch.tensor(scores, dtype=torch.float64).view(-1, group_size)   # (N, G)
    # unbiased std, as TRL; --scale-rewards none is Dr. GRPO's
    std = r.std(1, keepdim=True)                                          # (N, 1)
    scale_by = torch.where(std < std_floor, 1.0, std + 1e-4) if scale == "group" else 1.0  # (N, 1)
    return (r - r.mean(1, keepdim=True)) / scale_by, r.amax(1) > r.amin(1)

def completion_logps(model, input_ids, attention_mask, n_completion, temperature=1.0, chunk=512,
                     entropy=False):
    """Log-probs of each row's last n_completion tokens (entropy=True: and the detached entropy at
    each). The lm_head runs on `chunk` tokens at a time under checkpointing: no (B, T, V) logits."""
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)           # (B, L)
    out = model.model(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids, use_cache=False)
    hidden = out.last_hidden_state[:, -n_completion - 1:-1]              # (B, T, H)
    targets = input_ids[:, -n_completion:]                               # (B, T)

    def token_logps(h, t):
        logits = model.lm_head(h).float() / temperature                   # (n, V)
        logp = logits.gather(-1, t[:, None])[:, 0] - logits.logsumexp(-1)   # (n,)
        return logp, torch.distributions.Categorical(logits=logits.detach()).entropy()

    pieces = zip(hidden.flatten(0, 1).split(chunk), targets.flatten().split(chunk))
    logps, ents = zip(*[torch.utils.checkpoint.checkpoint(token_logps, h, t, use_reentrant=False)
                        for h, t in pieces])
    logps, ents = torch.cat(logps).view(targets.shape), torch.cat(ents).view(targets.shape)
    return (logps, ents) if entropy else logps                           # (B, T)

# grpo_loss's keywords that are flags
LOSS_FLAGS = ("beta", "eps_low", "eps_high", "agg", "ratio_level", "is_mode", "is_min", "is_max",
              "off_policy_mask", "kl_is_weight")

def grpo_loss(logps, old_logps, ref_logps, advantages, mask, *, beta, eps_low, eps_high, agg,
              max_len, vllm_logps=None, ratio_level="token", is_mode="none", is_min=0.0,
              is_max=3.0, off_policy_mask=None, kl_is_weight=False):
    """Choices 3 and 4 -> (loss, count, stats): the loss averages over `count` sequences (tokens,
    for token-mean). The variants: docs/variants.md."""
    keep = mask > 0                                                       # (B, T)
    mask = mask.to(logps.dtype)                                           # (B, T)
    n = mask.sum(1, keepdim=True).clamp(1)                                # (B, 1)
    # padding holds anything: zeroed before exp, where it could overflow to inf
    log_ratio = torch.where(keep, logps - old_logps, 0.0)                 # (B, T)
    seq_log_ratio = log_ratio.sum(1, keepdim=True) / n                    # (B, 1)
    ratio = torch.exp(seq_log_ratio if ratio_level == "sequence" else log_ratio)  # (B, T or 1)
    A = advantages.unsqueeze(1)                                           # (B, 1)
    surrogate = torch.min(ratio * A, ratio.clamp(1 - eps_low, 1 + eps_high) * A)  # (B, T)
    # choice 4: w = old / vLLM's per token or sequence (a product); out of bounds: cut, or 0
    w = torch.ones_like(A)                                                # (B, 1)
    outside = off = torch.zeros_like(keep)                                # (B, T)
    if is_mode != "none":
        d = torch.where(keep, old_logps - vllm_logps, 0.0)                # (B, T)
        w = torch.exp(d.sum(1, keepdim=True) if is_mode[0] == "s" else d)  # (B, T or 1)
        outside = ((w < is_min) | (w > is_max)) & keep                    # (B, T)
        w = w.clamp(is_min, is_max) if "truncate" in is_mode else w.where(~outside, 0.0)  # (B, T)
    # DeepSeek-V3.2: A < 0 and mean KL(vLLM || now) > delta: out of the surrogate
    if off_policy_mask is not None:
        kl_vllm = torch.where(keep, vllm_logps - logps.detach(), 0.0)     # (B, T)
        off = (A < 0) & (kl_vllm.sum(1, keepdim=True) / n > off_policy_mask)  # (B, 1)
    surrogate = surrogate * w * ~off                                      # (B, T)
    d = torch.where(keep, ref_logps - logps, 0.0) if beta else torch.zeros_like(logps)
    kl = torch.exp(d) - d - 1                                             # (B, T)
    # x pi / pi_vllm, not detached: the reverse KL's gradient (DeepSeek-V3.2)
    if kl_is_weight:
        kl = kl * torch.exp(torch.where(keep, logps - vllm_logps, 0.0))   # (B, T)
    token_loss = -(surrogate - beta * kl) * mask                          # (B, T)
    n_tokens = mask.sum()
    if agg == "seq-mean-token-mean":
        loss, count = (token_loss.sum(1) / n.squeeze(1)).mean(), len(logps)
    elif agg == "token-mean":
        loss, count = token_loss.sum() / n_tokens.clamp(min=1), n_tokens.item()
    else:
        loss, count = token_loss.sum() / (len(logps) * max_len), len(logps)
    # the min picks the clipped term: below the clip for A < 0, above it for A > 0
    with torch.no_grad():
        low = (ratio < 1 - eps_low) & (A < 0) & keep                      # (B, T)
        high = (ratio > 1 + eps_high) & (A > 0) & keep                    # (B, T)
        stats = {"kl_sum": (kl * mask).sum(), "clip_low": low.sum(), "clip_high": high.sum(),
                 "tokens": n_tokens, "ratio_sum": (ratio * mask).sum(), "is_outside": outside.sum(),
                 "ratio_max": torch.where(keep, ratio, 0).max(), "off_policy": (off & keep).sum()}
    return loss, count, stats

def rollout(llm, next_prompts, n_prompts, reward_spec, args):
    """An engine's share of a batch: sample -> score -> advantages -> filter."""
    from vllm import SamplingParams
    # vLLM would also decode each token's log-prob (demo: 6-20 ms a batch): the text is decoded here
    sampling = SamplingParams(n=args.group_size, temperature=args.temperature,
                              max_tokens=args.max_new_tokens, logprobs=0, detokenize=False)
    decode = partial(llm.get_tokenizer().decode, skip_special_tokens=True)
    size = n_prompts * args.group_size
    kept, dropped, scored, advs, rounds = [], [], [], [], 0
    # more rounds only with dynamic sampling, until groups with signal fill the batch
    while len(kept) < size and rounds < args.max_gen_rounds:
        rounds += 1
        # sample: the next prompts of a shuffled pass over the data, G completions each
        picked = next_prompts()
        outs = llm.generate([{"prompt_token_ids": s["prompt_ids"]} for s in picked], sampling,
                            use_tqdm=False)
        # score: every completion with every reward, plus the overlong penalty
        jobs = [(decode(c.token_ids), s, c) for s, o in zip(picked, outs) for c in o.outputs]
        scores = rewards.score_all(jobs, reward_spec, args.reward_workers)
        for (text, s, c), (total, parts, n_err) in scores:
            parts["overlong"] = rewards.overlong_penalty(
                len(c.token_ids), args.max_new_tokens, args.overlong_buffer)
            scored.append((total + parts["overlong"], parts, n_err, c, s, text))
        # advantages within each group; filter: groups with equal rewards are dropped
        adv, signal = advantages([x[0] for x in scored[-size:]], args.group_size,
                                 args.scale_rewards, args.std_floor)
        advs += adv.flatten().tolist()
        for o, group_adv, has_signal in zip(outs, adv.tolist(), signal):
            for c, a in zip(o.outputs, group_adv):
                old = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
                seq = {"prompt": o.prompt_token_ids, "completion": list(c.token_ids), "adv": a,
                       "old": old, "truncated": c.finish_reason == "length"}
                (kept if has_signal else dropped).append(seq)
    fill = [(len(s["completion"]), s["truncated"]) for s in dropped[:max(0, size - len(kept))]]
    metrics = rollout_metrics(scored, advs, rounds, len(kept), len(dropped), args)
    return {"seqs": kept[:size], "fill": fill, "metrics": metrics}

def reference(seqs, args):
    """The kept sequences' reference log-probs, asked for by the engine that sampled them, on a
    thread: the forward overlaps the next weight load and the trainer's step (rule: generation)."""
    got = ref_logps(args.ref_url, [s["prompt"] for s in seqs], [s["completion"] for s in seqs],
                    args.temperature, retry_for=args.ref_wait)
    return [ref.tolist() for ref in got]

def train_step(engine, chunks, total, pad_id, args):
    """--num-iterations optimizer steps on this rank's micro-batches -> (stats, grad norms)."""
    sums, old_trainer, grad_norms = {}, {}, []
    for it in range(args.num_iterations if chunks else 0):
        for i, (chunk, weight) in enumerate(chunks):
            b = collate(chunk, pad_id, engine.device, args.mask_truncated)
            engine.set_gradient_accumulation_boundary(i == len(chunks) - 1)
            logps, entropy = completion_logps(engine.module, b["ids"], b["attn"],
                                              b["mask"].shape[1], args.temperature, entropy=True)
            # before any update: --is-mode's old policy, the gap to vLLM's log-probs, the entropy
            if it == 0:
                old_trainer[i] = logps.detach()
                add_stats(sums, policy_stats(logps, entropy, b["old"], b["mask"]), weight)
            old = b["old"] if args.is_mode == "none" else old_trainer[i]
            loss, count, stats = grpo_loss(logps, old, b["ref"], b["adv"], b["mask"],
                                           max_len=args.max_new_tokens, vllm_logps=b["old"],
                                           **{k: getattr(args, k) for k in LOSS_FLAGS})
            # this micro-batch's share of the batch's loss; x world: DeepSpeed averages ranks
            share = loss * count / total * weight
            engine.backward(share * dist.get_world_size())
            add_stats(sums, {**stats, "loss": share.detach()}, weight)
        engine.step()
        # DeepSpeed 0.19 skips an update whose gradient norm is not finite, and reports inf
        grad_norms.append(float(engine.get_global_grad_norm()))
    return sums, grad_norms or [0.0]

def main(args):
    rank, world = init_distributed(args.dist_timeout, args.threads)
    # the one process with side effects: vLLM, weight pushes, logs
    master_process = rank == 0
    check_config(world, **vars(args))
    state = read_state(master_process, **vars(args))
    model, tok = load_policy(**vars(args))
    train_set, eval_set, too_long = load_prompts(tok, **vars(args))
    # vLLM starts (15 s on CPU) while DeepSpeed sets up, and waits for the first weights
    if master_process:
        gen = GenerationProcess(partial(rollout, args=args), partial(reference, args=args),
                                train_set, eval_set, state, model, **vars(args))
        log = MetricsLog(state["step"], **vars(args))
    engine = build_engine(model, args.ds_config, args.lr, args.micro_batch)
    load_checkpoint(engine, args.out_dir, state["step"])
    counters = Counters(state["counts"], args.max_skips)
    # the generation process loads the starting weights (evaluated if due) first
    if master_process:
        gen.push_weights(engine, completion_logps, evaluate=log.evaluate_first, step=state["step"])
        if args.eval_only:
            log.write_eval(len(eval_set), gen.wait_eval())
    last = state["step"] if args.eval_only else args.steps
    stop = StopAfterStep()
    for step in range(state["step"] + 1, last + 1):
        # --- batch: rank 0 takes the generation process's next one (none after Ctrl-C); all get it
        times = {}
        with timed(times, "time/wait_s"):
            batch = master_process and stop.wait(gen.next_batch, engine.global_steps)
            batch = broadcast_json(batch, engine.device)
        if batch is None:
            save_on_stop(engine, tok, args.out_dir, state, args.keep_checkpoints)
            break
        mine = batch["seqs"][rank::world]

        # --- loss and step
        with timed(times, "time/train_s"):
            fill = batch["fill"] if args.loss_norm == "sampled" else []
            total = normaliser(batch["seqs"], fill, args.agg, args.mask_truncated)
            chunks = micro_batches(mine, batch["seqs"], world, args.micro_batch)
            sums, grad_norms = train_step(engine, chunks, total, tok.pad_token_id, args)
            sums = reduce_stats(sums, engine.device)
        counters.after_step(step, grad_norms, batch["stale_dropped"])

        # --- push weights to vLLM
        with timed(times, "time/sync_s"):
            evaluate = step == last or bool(args.eval_every and step % args.eval_every == 0)
            if master_process and (step % args.sync_every == 0 or step == last):
                stop.wait(gen.push_weights, engine, completion_logps, evaluate=evaluate, step=step)

        # --- log
        if master_process:
            evals = stop.wait(gen.wait_eval if step == last else gen.take_evals) or {}
            log.write({"step": step, **batch["metrics"], **loss_metrics(sums, args.num_iterations),
                       "grad_norm": grad_norms[-1], **counters.saved, "data/too_long": too_long,
                       **times, **evals})

        # --- checkpoint; with --ref-sync-every the reference servers reload it (rule: rollout)
        state.update(step=step, data_pos=batch["pos"])
        refresh = args.ref_sync_every and step % args.ref_sync_every == 0
        if step == last or refresh or (args.save_every and step % args.save_every == 0):
            save_checkpoint(engine, tok, args.out_dir, state, keep=args.keep_checkpoints,
                            new_reference=refresh)
        if refresh and master_process and step < last:
            stop.wait(gen.reload_reference, state["ref"], step)
    shut_down(gen if master_process else None, stop.requested)
    if master_process:
        log.close(state["step"], stop.ending(), gen.take_evals())

if __name__ == "__main__":
    main(get_args())
