"""What a GRPO run needs that is not the algorithm: the system flags, process start-up, configuration
checks, the model and DeepSpeed engine, the prompts, and how the ranks share a batch. grpo_train.py uses
it; read that first."""
import datetime
import json
import math
import os
import signal
import sys

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from rewards import parse_reward_spec
from ref_server import default_dtype, server_urls
from tasks import drop_long_prompts, load_task


def device_list(text):
    """--gen-devices "0,1" -> [0, 1] (argparse names the flag when this raises)."""
    devices = [int(d) for d in text.split(",")]
    if len(set(devices)) != len(devices) or min(devices) < 0:
        raise ValueError(text)
    return devices


def add_system_args(p):
    """The flags that steer the machinery rather than the algorithm (grpo_train.py has those)."""
    g = p.add_argument_group("data and memory")
    g.add_argument("--prompt-key", default="prompt", help="--task custom: the prompt column")
    g.add_argument("--answer-key", default="answer", help="--task custom: the answer column")
    g.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward on a rank")
    g.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing: less memory, more compute")
    g.add_argument("--ds-config", default="ds_config.json", help="DeepSpeed config (ZeRO-2)")
    g = p.add_argument_group("processes")
    g.add_argument("--gen-device", type=int, default=0,
                   help="GPU index for vLLM, as the machine counts them; the training GPU: one-GPU mode")
    g.add_argument("--gen-devices", type=device_list, default=None,
                   help="several vLLM engines, one per GPU: 0,1,... (replaces --gen-device)")
    g.add_argument("--gen-mem", type=float, default=0.9, help="vLLM gpu_memory_utilization")
    g.add_argument("--gen-kv-gb", type=int, default=1, help="vLLM KV cache size in GiB on CPU")
    g.add_argument("--ref-url", default="http://127.0.0.1:59875",
                   help="reference server (ref_server.py); several: comma-separated, the batch split across them")
    g.add_argument("--ref-wait", type=float, default=300, help="seconds to wait for the reference server")
    g.add_argument("--sync-every", type=int, default=1, help="push weights to vLLM every N steps")
    g.add_argument("--sync-tol", type=float, default=0.1,
                   help="fail if vLLM's probe log-probs differ from the trainer's by more (mean)")
    g.add_argument("--max-staleness", type=int, default=1,
                   help="batches vLLM may sample ahead of training (0: on-policy, no overlap)")
    g.add_argument("--max-skips", type=int, default=3, help="stop after this many non-finite steps in a row")
    g.add_argument("--threads", type=int, default=1,
                   help="torch threads of each training rank and of the generation process (CPU)")
    g.add_argument("--dist-timeout", type=float, default=60,
                   help="minutes a collective may wait (rank 0 waits for vLLM's start and evaluations)")
    g = p.add_argument_group("evaluation, logging and checkpoints")
    g.add_argument("--eval-every", type=int, default=0, help="held-out eval every N steps (and first, last)")
    g.add_argument("--eval-size", type=int, default=200, help="held-out samples per evaluation")
    g.add_argument("--eval-only", action="store_true", help="evaluate --model on the held-out split and exit")
    g.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (and at the end)")
    g.add_argument("--keep-checkpoints", type=int, default=2,
                   help="checkpoints kept on disk, newest first (0: all); the reference's is kept too")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out-dir")
    g.add_argument("--tensorboard", action="store_true", help="also log to tensorboard in --out-dir")


def init_distributed(timeout_minutes, threads):
    """-> (rank, world size). One GPU per rank; SIGTERM ends a rank as Ctrl-C does; `threads` torch threads,
    since the CPU is shared with vLLM and the reference server."""
    if torch.cuda.is_available():   # before any collective
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed.init_distributed(timeout=datetime.timedelta(minutes=timeout_minutes))
    # raising on SIGTERM runs exit handlers, which stop the generation process
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    torch.set_num_threads(threads)
    return dist.get_rank(), dist.get_world_size()


def check_config(world, *, model, rewards, group_size, prompts_per_step, micro_batch, steps, num_iterations,
                 max_gen_rounds, max_skips, temperature, tis_cap, overlong_buffer, max_new_tokens,
                 ref_sync_every, beta, max_staleness, keep_checkpoints, gen_devices, ref_url, **_):
    """Exits with one message naming every flag that is wrong, before anything is loaded or started."""
    # a hub id is "org/name"; anything else with a slash (or starting with . / ~) is meant as a local folder
    local = model.startswith((".", "/", "~")) or model.count("/") > 1
    try:
        parse_reward_spec(rewards)
        bad_rewards = None
    except ValueError as e:
        bad_rewards = f"--rewards: {e}"
    problems = [msg for bad, msg in [
        (group_size < 2, "--group-size must be >= 2: advantages compare the completions of one prompt"),
        (prompts_per_step * group_size < world,
         f"--prompts-per-step x --group-size must be >= the number of training ranks ({world})"),
        (min(micro_batch, prompts_per_step, steps, num_iterations, max_gen_rounds, max_skips) < 1,
         "--micro-batch, --prompts-per-step, --steps, --num-iterations, --max-gen-rounds and --max-skips "
         "must be >= 1"),
        (min(max_staleness, keep_checkpoints) < 0, "--max-staleness and --keep-checkpoints must be >= 0"),
        (temperature < 1e-3, "--temperature must be >= 0.001 (the log-probs are taken at it)"),
        (tis_cap is not None and tis_cap <= 0, "--tis-cap must be > 0"),
        (not 0 <= overlong_buffer < max_new_tokens, "--overlong-buffer must be in [0, --max-new-tokens)"),
        (ref_sync_every and beta == 0, "--ref-sync-every needs a reference model (--beta > 0)"),
        (gen_devices and prompts_per_step < len(gen_devices),
         "--prompts-per-step must be >= the number of --gen-devices: each engine samples a share"),
        (not server_urls(ref_url), "--ref-url must name at least one server"),
        (local and not os.path.isdir(os.path.expanduser(model)), f"--model {model}: no such folder"),
        (bad_rewards, bad_rewards),
    ] if bad]
    if problems:
        raise SystemExit("grpo_train.py: " + "; ".join(problems))


def load_policy(model_name, grad_ckpt):
    """-> (HF model, tokenizer). The dtype is the reference server's rule: bf16 only on GPUs that have it
    natively, fp32 otherwise; vLLM is then given the same (generation.vllm_dtype)."""
    dtype = getattr(torch, default_dtype("cuda" if torch.cuda.is_available() else "cpu"))
    tok = AutoTokenizer.from_pretrained(model_name)
    model = AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype)
    if grad_ckpt:   # HF checkpoints layers in train mode only (Qwen and Llama have no dropout to turn on)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model, tok


def build_engine(model, ds_config_path, lr, micro_batch):
    """-> the DeepSpeed ZeRO-2 engine around `model`."""
    with open(ds_config_path) as f:
        ds_config = json.load(f)
    # gradient_accumulation_steps stays 1: micro-batches per step vary, so the loop marks the boundary itself
    bf16 = next(model.parameters()).dtype == torch.bfloat16
    ds_config.update({"train_micro_batch_size_per_gpu": micro_batch, "bf16": {"enabled": bf16}})
    if "optimizer" in ds_config:   # e.g. ds_config_offload.json: DeepSpeed's CPU Adam, for optimizer offload
        ds_config["optimizer"].setdefault("params", {})["lr"] = lr
        optimizer = None
    else:   # torch's AdamW: no JIT build on CPU
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0,
                                      fused=torch.cuda.is_available())
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine


def load_prompts(tok, *, task, data, seed, max_prompt_len, eval_size, prompt_key, answer_key, **_):
    """-> (train samples, held-out samples, number of prompts skipped for being over max_prompt_len).
    Each sample has its prompt's token ids ("prompt_ids", from drop_long_prompts), which vLLM is given."""
    load = lambda split: load_task(task, split, data=data, seed=seed, tokenizer=tok, prompt_key=prompt_key,
                                   answer_key=answer_key)
    train_set, too_long = drop_long_prompts(load("train"), tok, max_prompt_len)
    eval_set = drop_long_prompts(load("test"), tok, max_prompt_len)[0][:eval_size]
    if not train_set:
        raise SystemExit(f"grpo_train.py: every prompt of --task {task} is longer than --max-prompt-len")
    return train_set, eval_set, too_long


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


def micro_batches(mine, seqs, world, size):
    """This rank's sequences (`mine`, every world-th of the batch `seqs`) in micro-batches, each with its weight.
    Every rank runs as many as the busiest: ZeRO-2 reduces gradients at every backward, so a rank with none
    left runs the batch's first sequence at weight 0."""
    n_micro = math.ceil(math.ceil(len(seqs) / world) / size)
    chunks = [mine[i * size:(i + 1) * size] for i in range(n_micro)]
    filler = [{**seqs[0], "ref": seqs[0]["old"]}] if seqs else []
    return [(chunk, 1.0) if chunk else (filler, 0.0) for chunk in chunks]


def shut_down(generation_process):
    """The end of a run: rank 0 stops the generation process; every rank leaves the process group."""
    if generation_process is not None:
        generation_process.stop()
    dist.barrier()
    dist.destroy_process_group()
