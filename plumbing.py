"""The parts of a GRPO run that are not the algorithm: configuration checks, the metrics log, resumable
checkpoints, and watching the processes a run depends on. grpo_train.py uses them; read it first."""
import json
import os
import queue
import shutil
import signal
import sys
from statistics import fmean as mean

import deepspeed
import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

import rewards
from ref_server import model_fingerprint, reload_reference, wait_for_server
from tasks import drop_long_prompts, load_task


def check_config(args, world):
    """Exits with one message naming every flag that is wrong, before anything is loaded or started."""
    # a hub id is "org/name"; anything else with a slash (or starting with . / ~) is meant as a local folder
    local = args.model.startswith((".", "/", "~")) or args.model.count("/") > 1
    try:
        rewards.parse_reward_spec(args.rewards)
        bad_rewards = None
    except ValueError as e:
        bad_rewards = f"--rewards: {e}"
    problems = [msg for bad, msg in [
        (args.group_size < 2, "--group-size must be >= 2: advantages compare the completions of one prompt"),
        (args.prompts_per_step * args.group_size < world,
         f"--prompts-per-step x --group-size must be >= the number of training ranks ({world})"),
        (min(args.micro_batch, args.prompts_per_step, args.steps, args.num_iterations, args.max_gen_rounds,
             args.max_skips) < 1, "--micro-batch, --prompts-per-step, --steps, --num-iterations, "
                                  "--max-gen-rounds and --max-skips must be >= 1"),
        (args.temperature <= 0, "--temperature must be > 0 (the log-probs are taken at it)"),
        (args.tis_cap is not None and args.tis_cap <= 0, "--tis-cap must be > 0"),
        (not 0 <= args.overlong_buffer < args.max_new_tokens, "--overlong-buffer must be in [0, --max-new-tokens)"),
        (args.ref_sync_every and args.beta == 0, "--ref-sync-every needs a reference model (--beta > 0)"),
        (local and not os.path.isdir(os.path.expanduser(args.model)), f"--model {args.model}: no such folder"),
        (bad_rewards, bad_rewards),
    ] if bad]
    if problems:
        raise SystemExit("grpo_train.py: " + "; ".join(problems))


def load_model(args):
    """-> (HF model, tokenizer, fingerprint of the starting weights: the reference)."""
    bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if bf16 else torch.float32)
    if args.grad_ckpt:   # HF checkpoints layers in train mode only (Qwen and Llama have no dropout to turn on)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model, tok, model_fingerprint(model)


def build_engine(args, model):
    """-> the DeepSpeed ZeRO-2 engine around `model` (load_model's)."""
    with open(args.ds_config) as f:
        ds_config = json.load(f)
    # gradient_accumulation_steps stays 1: micro-batches per step vary, so the loop marks the boundary itself
    bf16 = next(model.parameters()).dtype == torch.bfloat16
    ds_config.update({"train_micro_batch_size_per_gpu": args.micro_batch, "bf16": {"enabled": bf16}})
    if "optimizer" in ds_config:   # e.g. ds_config_offload.json: DeepSpeed's CPU Adam, for optimizer offload
        ds_config["optimizer"].setdefault("params", {})["lr"] = args.lr
        optimizer = None
    else:   # torch's AdamW: no JIT build on CPU
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0,
                                      fused=torch.cuda.is_available())
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine


def check_reference(args, fingerprint, refreshed):
    """All ranks: wait for the reference server; it must serve the model we start from, or, on a run resumed
    after a reference refresh, it is told to load that checkpoint again."""
    served = wait_for_server(args.ref_url, timeout=args.ref_wait)["fingerprint"]
    if refreshed and dist.get_rank() == 0:
        reload_reference(args.ref_url, refreshed)
    elif not refreshed and served != fingerprint:
        raise RuntimeError(f"{args.ref_url} serves another model than --model {args.model}")
    dist.barrier()


def load_data(args, tok):
    """-> (train samples, held-out samples, number of prompts skipped for being over --max-prompt-len)."""
    load = lambda split: load_task(args.task, split, data=args.data, seed=args.seed, tokenizer=tok)
    train_set, too_long = drop_long_prompts(load("train"), tok, args.max_prompt_len)
    eval_set = drop_long_prompts(load("test"), tok, args.max_prompt_len)[0][:args.eval_size]
    if not train_set:
        raise SystemExit(f"grpo_train.py: every prompt of --task {args.task} is longer than --max-prompt-len")
    return train_set, eval_set, too_long


def broadcast_json(obj, device, src=0):
    """dist.broadcast_object_list without pickle (the batch crosses the network between nodes): JSON bytes."""
    data = torch.tensor(bytearray(json.dumps(obj).encode()), dtype=torch.uint8) if dist.get_rank() == src else None
    n = torch.tensor([0 if data is None else len(data)], device=device)
    dist.broadcast(n, src)
    data = (data if data is not None else torch.empty(int(n), dtype=torch.uint8)).to(device)
    dist.broadcast(data, src)
    return json.loads(data.cpu().numpy().tobytes())


def held_out_eval(llm, samples, params, encode, spec):
    """Generation process: greedy completions of the held-out samples -> eval/accuracy (the first reward of
    --rewards, unweighted) and eval/format (rewards.format_reward)."""
    outs = [o.outputs[0].text for o in llm.generate([encode(s) for s in samples], params, use_tqdm=False)]
    return {"eval/accuracy": mean([rewards.score(o, s, spec[:1])[1][spec[0][0]] for o, s in zip(outs, samples)]),
            "eval/format": mean([rewards.format_reward(o, s) for o, s in zip(outs, samples)])}


def hand_over(messages, msg, parent):
    """Generation process: put msg on the bounded queue, blocking while the trainer is a batch behind.
    -> False if the trainer (pid `parent`) died meanwhile without stopping us."""
    while True:
        try:
            messages.put(msg, timeout=5)
            return True
        except queue.Full:
            if os.getppid() != parent:
                return False


def write_eval(args, msg, n):
    """--eval-only: the result, as one JSON line on stdout and in out_dir/eval.json."""
    result = {"model": args.model, "task": args.task, "eval/size": n, **msg["evals"]}
    with open(os.path.join(args.out_dir, "eval.json"), "w") as f:
        json.dump(result, f)
    print(json.dumps(result), flush=True)


def stop_on_sigterm():
    """SIGTERM ends this process the way Ctrl-C does, by raising: exit handlers run and stop its children."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _alive(proc):
    """A process that exited but was not reaped yet (a zombie) counts as gone."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class GenerationProcess:
    """Rank 0's handle on the generation process: starts it, takes its messages, and notices within seconds
    when it has died, or when the launcher above this rank has (deepspeed's single-node runner does not pass
    SIGTERM on: without this check, killing it would leave the run going as orphans)."""

    def __init__(self, target, *args):
        ctx = mp.get_context("spawn")
        self.messages = ctx.Queue(1)   # bounded: generation runs at most one batch ahead of training
        self.proc = ctx.Process(target=target, args=(*args, self.messages), daemon=True)
        self.proc.start()
        parent = psutil.Process().parent()   # deepspeed: runner -> launch.py -> this rank
        self.launcher = parent.parent() if parent else None

    def check_alive(self):
        if not self.proc.is_alive():
            raise RuntimeError(f"the generation process died (exit code {self.proc.exitcode}); its traceback is above")
        if self.launcher is not None and not _alive(self.launcher):
            raise SystemExit(f"the launcher (pid {self.launcher.pid}) is gone: stopping the run")

    def next_message(self):
        while True:
            self.check_alive()
            try:
                return self.messages.get(timeout=2)
            except queue.Empty:
                pass

    def stop(self):
        self.proc.terminate()
        self.proc.join(timeout=30)


class MetricsLog:
    """metrics.jsonl (one JSON object per step), tensorboard if asked, and a progress line per step.
    On resume the file keeps the steps up to the checkpoint, so it stays one line per step."""

    def __init__(self, out_dir, resume_step, tensorboard):
        path = os.path.join(out_dir, "metrics.jsonl")
        kept = []
        if resume_step and os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        if json.loads(line)["step"] <= resume_step:
                            kept.append(line)
                    except json.JSONDecodeError:   # the torn last line of a killed run
                        pass
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
        self.file = open(path, "a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(out_dir)

    def write(self, log):
        self.file.write(json.dumps(log) + "\n")
        self.file.flush()
        if self.tb:
            for k, v in log.items():
                self.tb.add_scalar(k, v, log["step"])
        if "reward/mean" in log:
            tqdm.write(f"step {log['step']:4d} | reward {log['reward/mean']:.3f} | loss {log['loss']:+.4f} | "
                       f"kl {log['kl']:.4f} | len {log['completion_len/mean']:.1f} | "
                       f"zero-std {log['frac_zero_std']:.2f}"
                       + (f" | eval {log['eval/accuracy']:.3f}" if "eval/accuracy" in log else ""))


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


def collate(seqs, pad_id, device="cpu", mask_truncated=False):
    """A micro-batch's sequences (dicts from the generation process, + "ref") -> dict of padded tensors.
    mask_truncated: completions cut off at the length limit get an all-zero mask (out of the loss)."""
    ids, attn, mask = pad_batch([s["prompt"] for s in seqs], [s["completion"] for s in seqs], pad_id)
    pad = lambda k: torch.stack([torch.nn.functional.pad(torch.as_tensor(s[k], dtype=torch.float32),
                                                         (0, mask.shape[1] - len(s[k]))) for s in seqs])   # (B, T)
    truncated = torch.tensor([s["truncated"] for s in seqs])
    if mask_truncated:
        mask = mask * ~truncated.unsqueeze(1)
    out = {"ids": ids, "attn": attn, "mask": mask, "old": pad("old"), "adv": torch.tensor([s["adv"] for s in seqs]),
           "truncated": truncated, "ref": pad("ref") if "ref" in seqs[0] else None}
    return {k: None if v is None else v.to(device) for k, v in out.items()}


def save_checkpoint(engine, tokenizer, out_dir, step, state, refresh=False):
    """All ranks -> the checkpoint's path. out_dir/step_K holds the HF model + tokenizer (for users, and for the
    reference server), DeepSpeed's files (each rank's ZeRO-2 optimizer shard) and `state` as grpo_state.json (with
    `refresh` it records that the reference server will serve this checkpoint). Atomic against a kill:
    everything is written to step_K.tmp, renamed when complete, and only then does the file `latest` (replaced
    by a rename) name it. Not against a power cut: nothing is fsync'ed."""
    tag, master = f"step_{step}", dist.get_rank() == 0
    tmp, final = os.path.join(out_dir, tag + ".tmp"), os.path.abspath(os.path.join(out_dir, tag))
    if refresh:
        state["ref"] = final
    if master and os.path.exists(tmp):   # left by a run killed while saving
        shutil.rmtree(tmp)
    dist.barrier()
    engine.save_checkpoint(out_dir, tag=tag + ".tmp", save_latest=False)
    if master:
        engine.module.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "grpo_state.json"), "w") as f:
            json.dump(state, f)
    dist.barrier()   # every rank's shard is written
    if master:
        if os.path.exists(final):   # saved before by a run that was then resumed from an earlier step
            shutil.rmtree(final)
        os.replace(tmp, final)
        with open(os.path.join(out_dir, "latest.tmp"), "w") as f:
            f.write(tag)
        os.replace(os.path.join(out_dir, "latest.tmp"), os.path.join(out_dir, "latest"))
    return final


def read_state(args):
    """All ranks: the run's state, a fresh one or (--resume) the one saved with the checkpoint `latest` names.
    Read before the engine is built: the generation process starts from it while DeepSpeed sets up."""
    state = {"step": 0, "version": 0, "data_pos": 0, "ref": None, "counts": {"skipped_steps": 0, "stale_dropped": 0}}
    latest, master = os.path.join(args.out_dir, "latest"), dist.get_rank() == 0
    if not args.resume:
        return state
    if not os.path.exists(latest):
        if master:
            print(f"--resume: no checkpoint in {args.out_dir}, starting from --model", flush=True)
        return state
    with open(latest) as f:
        path = os.path.join(args.out_dir, f.read().strip())
    with open(os.path.join(path, "grpo_state.json")) as f:
        state.update(json.load(f))
    if master:
        print(f"resuming after step {state['step']} from {path}", flush=True)
    return state


def load_checkpoint(engine, out_dir, step):
    """All ranks: the model and this rank's optimizer shard (DeepSpeed 0.19) of checkpoint step_<step>; none at
    step 0 (a fresh run)."""
    if step == 0:
        return
    path, _ = engine.load_checkpoint(out_dir, tag=f"step_{step}")
    if path is None:
        raise RuntimeError(f"{os.path.join(out_dir, f'step_{step}')}: DeepSpeed could not load this checkpoint")
