"""What a GRPO run needs that is not the algorithm: the system flags, configuration checks, the model and
DeepSpeed engine, and the prompts (ranks.py: joining and leaving the ranks' process group). grpo_train.py
uses it; read that first. A user's mistake (a flag, the data) stops the run with one line (stop_with); a
traceback means a bug."""
import argparse
import json
import random

import deepspeed
import torch
import torch.distributed as dist
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine_process import import_vllm
from lora import adapter_targets, merged_weight
from placement import (REF_GEN_MEM, SHARED_GEN_MEM, first_rank, machine_gpus, missing_gpu, reference_beside_engine,
                       reference_device, stop_with, training_gpus)
# grpo_train.py joins and leaves the ranks' process group with ranks.init_distributed and shut_down
from ranks import init_distributed, shut_down  # noqa: F401
from rewards import parse_reward_spec
# grpo_train.get_args parses its flags with run_config.parse_flags (--config, one-line checks)
from run_config import (DEFAULT_EVAL_SIZE, add_run_args, at_least_one, ds_config_error,  # noqa: F401
                        out_of_range, parse_flags)
from ref_client import server_urls, url_error
from ref_server import default_dtype, logit_transform, missing_folder
from tasks import DataError, drop_long_prompts, load_task

# a split held out of the train data (no test split) is the same rows whatever --seed, so runs compare
HOLD_OUT_SEED = 1234

# the attention and MLP projections of Qwen2 and Llama
LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def device_list(text):
    """--gen-devices "0,1" -> [0, 1] (argparse names the flag when this raises)."""
    devices = [int(d) for d in text.split(",")]
    if len(set(devices)) != len(devices) or min(devices) < 0:
        raise ValueError(text)
    return devices


def add_system_args(p):
    """The flags that steer the machinery rather than the algorithm (grpo_train.py has those); and a bad
    flag's error in one line (argparse prints its whole usage first: 50 lines here). -> p"""
    p.error = lambda message: stop_with(f"{message} (--help lists the flags)")
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    g = p.add_argument_group("data and memory")
    g.add_argument("--prompt-key", default="prompt", help="--task custom: the prompt column")
    g.add_argument("--answer-key", default="answer", help="--task custom: the answer column")
    g.add_argument("--chat-template", default="auto", choices=["auto", "none"],
                   help="auto: prompts through the tokenizer's chat template if it has one; none: as text")
    g.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward on a rank")
    g.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing: less memory, more compute")
    g.add_argument("--ds-config", default="ds_config.json", help="DeepSpeed config (ZeRO stage 2 or 1)")
    g.add_argument("--fp32-lm-head", action="store_true",
                   help="bf16 models: the trainer's and vLLM's lm_head in fp32 (docs/variants.md)")
    g = p.add_argument_group("LoRA (peft): only low-rank adapters train; vLLM gets the merged weights")
    g.add_argument("--lora-rank", type=int, default=0, help="LoRA rank r (0: train every weight)")
    g.add_argument("--lora-alpha", type=float, default=None, help="LoRA scale alpha / r (default alpha: 2 r)")
    g.add_argument("--lora-targets", default=LORA_TARGETS,
                   help="the linear layers that get adapters, by name (or all-linear)")
    g = p.add_argument_group("processes")
    g.add_argument("--gen-device", type=int, default=0,
                   help="GPU index for vLLM, as the machine counts them; the training GPU: one-GPU mode")
    g.add_argument("--gen-devices", type=device_list, default=None,
                   help="several vLLM engines, one per GPU: 0,1,... (replaces --gen-device)")
    g.add_argument("--gen-urls", default=None,
                   help="vLLM servers started by hand, on any node (docs/gpu.md), comma-separated: the engines, in "
                        "place of --gen-devices; each samples a share")
    g.add_argument("--gen-timeout", type=float, default=600,
                   help="seconds a --gen-urls server may take to come up at start, or over one request")
    g.add_argument("--gen-mem", type=float, default=None,
                   help=f"vLLM gpu_memory_utilization (default 0.9 on a GPU of its own; 0.3 on a training GPU, "
                        f"where at most {SHARED_GEN_MEM}; 0.7 beside the reference server rank 0 starts, where at "
                        f"most {REF_GEN_MEM})")
    g.add_argument("--gen-kv-gb", type=int, default=1, help="vLLM KV cache size in GiB on CPU")
    g.add_argument("--ref-url", default=None,
                   help="reference servers started by hand (ref_server.py), comma-separated, the batch split "
                        "across them; default: rank 0 starts one itself (--ref-device)")
    g.add_argument("--ref-device", default=None,
                   help="where the reference server rank 0 starts runs: a GPU index or cpu (default: cpu without "
                        "GPUs, else the first vLLM engine's GPU)")
    g.add_argument("--ref-wait", type=float, default=300, help="seconds to wait for the reference server")
    g.add_argument("--sync-every", type=at_least_one, default=1, help="push weights to vLLM every N steps")
    g.add_argument("--sync-tol", type=float, default=0.1,
                   help="fail if vLLM's probe log-probs differ from the trainer's by more (mean)")
    g.add_argument("--max-staleness", type=int, default=1,
                   help="batches vLLM may sample ahead of training (0: on-policy at --sync-every 1, no overlap)")
    g.add_argument("--max-skips", type=int, default=3, help="stop after this many non-finite steps in a row")
    g.add_argument("--reward-workers", type=at_least_one, default=1,
                   help="code reward: completions jailed at once (bounded by cores and memory)")
    g.add_argument("--threads", type=at_least_one, default=1,
                   help="torch threads of each training rank and of the generation process (CPU)")
    g.add_argument("--dist-timeout", type=float, default=60,
                   help="minutes a collective may wait (rank 0 waits for vLLM's start and evaluations)")
    # evaluation, logging, checkpoints and --config: with the code that reads them
    add_run_args(p)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return p


def check_config(world, *, model, rewards, group_size, prompts_per_step, micro_batch, steps, num_iterations,
                 max_gen_rounds, max_skips, temperature, is_min, is_max, overlong_buffer, max_new_tokens,
                 ref_sync_every, beta, max_staleness, keep_checkpoints, eval_size, ds_config, gen_device,
                 gen_devices, ref_url, ref_device, lora_rank, lora_alpha, gen_mem, off_policy_mask, lr, eps_low,
                 eps_high, std_floor, sync_tol, ref_wait, dist_timeout, gen_kv_gb, sync_every, eval_every,
                 save_every, eval_only=False, gen_urls=None, gen_timeout=600.0, max_prompt_len=512, **more):
    """Exits with one message naming every flag that is wrong, before anything is loaded or started;
    if none is, rank 0 prints the run in one line: the model, where training and vLLM run,
    the reference, the variant (--eval-only: the model and where vLLM runs)."""
    try:
        parse_reward_spec(rewards)
        bad_rewards = None
    except ValueError as e:
        bad_rewards = f"--rewards: {e}"
    bad_model, bad_url = missing_folder(model), ref_url is not None and url_error(ref_url)
    bad_gen_urls = gen_urls is not None and url_error(gen_urls, "--gen-urls")
    gen_servers = server_urls(gen_urls or "")
    shared = (torch.cuda.is_available() and not gen_servers
              and set(gen_devices or [gen_device]) & set(training_gpus(world)))
    # GPU indices as the machine counts them: the launcher's CUDA_VISIBLE_DEVICES hides some from torch
    bad_gpu = missing_gpu(machine_gpus(), None if gen_servers else gen_device, gen_devices, ref_device)
    beside_ref = reference_beside_engine(ref_device, gen_devices or [gen_device],
                                         beta > 0 and not ref_url and not eval_only)
    # the flags out of their range, named: those given wrong, not the whole group
    below_1 = out_of_range(lambda v: v >= 1, micro_batch=micro_batch, prompts_per_step=prompts_per_step,
                           steps=steps, num_iterations=num_iterations, max_gen_rounds=max_gen_rounds,
                           max_skips=max_skips, eval_size=eval_size, max_new_tokens=max_new_tokens,
                           gen_kv_gb=gen_kv_gb)
    negative = out_of_range(lambda v: v >= 0, max_staleness=max_staleness, keep_checkpoints=keep_checkpoints,
                            beta=beta, eps_low=eps_low, eps_high=eps_high, std_floor=std_floor,
                            sync_tol=sync_tol, ref_wait=ref_wait, gen_device=gen_device,
                            eval_every=eval_every, save_every=save_every, ref_sync_every=ref_sync_every,
                            log_every=more.get("log_every", 0), log_completions=more.get("log_completions", 0))
    not_positive = out_of_range(lambda v: v > 0, lr=lr, dist_timeout=dist_timeout, gen_timeout=gen_timeout)
    # an evaluation comes with a weight push (grpo_train.main), so one between pushes would never run
    evals_skipped = eval_every > 0 and eval_every % sync_every and not eval_only
    bad_ds_config = ds_config_error(ds_config)
    problems = [msg for bad, msg in [
        (group_size < 2, "--group-size must be >= 2: advantages compare the completions of one prompt"),
        (prompts_per_step * group_size < world,
         f"--prompts-per-step x --group-size must be >= the number of training ranks ({world})"),
        (below_1, f"{below_1} must be >= 1"),
        (negative, f"{negative} must be >= 0"),
        (not_positive, f"{not_positive} must be > 0"),
        (evals_skipped, f"--eval-every {eval_every}: evaluations come with the weight pushes, every --sync-every "
                        f"{sync_every} steps: give a multiple of {sync_every} ({sync_every}, {2 * sync_every}, "
                        f"...)"),
        # vLLM samples at 0.01 at least (sampling_params.py, 0.26 to 0.32), where the log-probs it returns
        # and the trainer's and the reference's would be taken at the lower one
        (temperature < 0.01, "--temperature must be >= 0.01: vLLM samples at 0.01 at least"),
        (std_floor > 0 and more.get("scale_rewards", "group") != "group",
         "--std-floor needs --scale-rewards group: it spares a group the division by its own std"),
        (not 0 <= is_min < is_max, "--is-min must be >= 0 and below --is-max"),
        (off_policy_mask is not None and off_policy_mask < 0, "--off-policy-mask must be >= 0"),
        (lora_rank < 0 or (lora_alpha is not None and lora_alpha <= 0),
         "--lora-rank must be >= 0 and --lora-alpha > 0"),
        (max_new_tokens >= 1 and not 0 <= overlong_buffer < max_new_tokens,
         "--overlong-buffer must be in [0, --max-new-tokens)"),
        (ref_sync_every and beta == 0, "--ref-sync-every needs a reference model (--beta > 0)"),
        (more.get("kl_is_weight") and beta == 0, "--kl-is-weight weights the KL term, which --beta 0 leaves out"),
        (lora_alpha is not None and not lora_rank, "--lora-alpha scales LoRA adapters: give --lora-rank too"),
        (gen_devices and prompts_per_step < len(gen_devices),
         "--prompts-per-step must be >= the number of --gen-devices: each engine samples a share"),
        (bad_url, bad_url),
        (bad_gen_urls, bad_gen_urls),
        (gen_servers and gen_devices, "--gen-urls or --gen-devices: the engines are vLLM servers started by "
                                         "hand, or rank 0's own, not both"),
        (prompts_per_step < len(gen_servers),
         "--prompts-per-step must be >= the number of --gen-urls: each server samples a share"),
        (gen_servers and torch.cuda.is_available() and beta > 0 and not ref_url and ref_device is None,
         "--gen-urls on GPUs: say where rank 0 starts the reference server (--ref-device: a GPU no rank "
         "trains on, or cpu), or name one (--ref-url)"),
        (ref_device not in (None, "cpu") and not ref_device.isdigit(),
         f"--ref-device {ref_device}: a GPU index (0, 1, ...) or cpu"),
        (str(ref_device).isdigit() and not torch.cuda.is_available(),
         f"--ref-device {ref_device}: torch sees no GPU here; leave it out (the server runs on CPU)"),
        (bad_gpu, bad_gpu),
        (shared and (gen_mem or 0) > SHARED_GEN_MEM,
         f"--gen-mem {gen_mem}: a vLLM engine on a training GPU may take at most {SHARED_GEN_MEM} of it (the "
         f"trainer needs the rest)"),
        (beside_ref and (gen_mem or 0) > REF_GEN_MEM,
         f"--gen-mem {gen_mem}: the reference server this run starts shares a GPU with a vLLM engine, which may "
         f"then take at most {REF_GEN_MEM} of it (the server's model and the weight push's buffers need the rest; "
         f"or give the server a GPU of its own: --ref-device)"),
        (gen_mem is not None and not 0 < gen_mem <= 1, "--gen-mem must be in (0, 1]"),
        # vLLM takes a seed below 2**32; an engine's is --seed + its place in the data + 1_000_003 x its index
        (not 0 <= more.get("seed", 0) < 2**31, f"--seed must be in [0, {2**31 - 1}]: each vLLM engine's seed "
                                                f"is it plus its place in the data, below 2**32"),
        (bad_model, bad_model),
        (bad_ds_config, bad_ds_config),
        (bad_rewards, bad_rewards),
    ] if bad]
    if problems:
        stop_with("; ".join(problems))
    # rank 0's first import of vLLM (it exits in one line on a vLLM outside the range this trainer runs on)
    if first_rank():
        import_vllm()
    if first_rank() and gen_servers:
        from remote_engine import check_servers
        check_servers(gen_servers, model=model, max_len=max_prompt_len + max_new_tokens, world=world,
                      timeout=gen_timeout, fp32_lm_head=more.get("fp32_lm_head", False))
    if first_rank():
        on = "GPU" if torch.cuda.is_available() else "CPU"
        engines, servers = gen_devices or [gen_device], server_urls(ref_url or "")
        where = f"GPU {','.join(map(str, engines))}" if on == "GPU" else on
        from weight_transfer import transfer_backend, vllm as installed
        vllm = f"{len(engines)} vLLM {installed.__version__} engine{'s' * (len(engines) > 1)} on {where}"
        if gen_servers:
            vllm = f"vLLM server{'s' * (len(gen_servers) > 1)} {', '.join(gen_servers)}"
        vllm += f", weights by {transfer_backend(gen_servers or engines, world)}"
        if eval_only:
            print(f"grpo_train.py: evaluating {model} on the held-out split; {vllm}", flush=True)
            return
        started = f"reference server started by rank 0 on {reference_device(ref_device, engines)}"
        reference = ("no reference (--beta 0)" if beta == 0 else f"{started} (--beta {beta})" if not servers
                     else f"reference server{'s' * (len(servers) > 1)} {', '.join(servers)} (--beta {beta})")
        variant = describe_variant(lora_rank=lora_rank, is_min=is_min, is_max=is_max, eps_low=eps_low,
                                   eps_high=eps_high, off_policy_mask=off_policy_mask,
                                   num_iterations=num_iterations, max_gen_rounds=max_gen_rounds,
                                   overlong_buffer=overlong_buffer, ref_sync_every=ref_sync_every, **more)
        print(f"grpo_train.py: model {model}; {world} training rank{'s' * (world > 1)} on {on} (DeepSpeed, "
              f"{ds_config}); {vllm}; {reference}; {variant}", flush=True)


def describe_variant(*, ratio_level="token", eps_low=0.2, eps_high=0.2, lora_rank=0, is_mode="none",
                     is_min=0.0, is_max=3.0, off_policy_mask=None, kl_is_weight=False, fp32_lm_head=False,
                     num_iterations=1, scale_rewards="group", loss_norm="sampled", agg="seq-mean-token-mean",
                     mask_truncated=False, overlong_buffer=0, max_gen_rounds=1, ref_sync_every=0, **_):
    """The start-up line's words for the variant that runs (docs/variants.md): "GRPO" and whatever the
    flags change, e.g. "GSPO (sequence ratio, clip 0.0003/0.0004), LoRA rank 16"."""
    ratio = "GSPO (sequence ratio" if ratio_level == "sequence" else "GRPO (token ratio"
    parts = [f"{ratio}, clip {eps_low:g}/{eps_high:g}, {agg})"]
    parts += [text for on, text in [
        (lora_rank, f"LoRA rank {lora_rank}"),
        (is_mode != "none", f"importance sampling {is_mode} [{is_min:g}, {is_max:g}]"),
        (off_policy_mask is not None, f"off-policy sequence mask {off_policy_mask}"),
        (kl_is_weight, "KL weighted by the ratio to vLLM"),
        (fp32_lm_head, "lm_head in fp32"),
        (num_iterations > 1, f"{num_iterations} optimizer steps per batch"),
        (scale_rewards != "group", f"advantages scaled by {scale_rewards} std" if scale_rewards != "none"
         else "advantages not scaled by std (Dr. GRPO)"),
        (loss_norm != "sampled", "loss divided by the kept sequences"),
        (mask_truncated, "no loss on cut-off completions"),
        (overlong_buffer, f"overlong penalty over the last {overlong_buffer} tokens"),
        (max_gen_rounds > 1, f"dynamic sampling (up to {max_gen_rounds} rounds)"),
        (ref_sync_every, f"reference reloaded every {ref_sync_every} steps"),
    ] if on]
    return ", ".join(parts)


def load_policy(model, grad_ckpt=False, *, lora_rank=0, lora_alpha=None, lora_targets=LORA_TARGETS, seed=0,
                eval_only=False, fp32_lm_head=False, **_):
    """-> (HF model, tokenizer). The dtype is the reference server's rule: bf16 only on GPUs that have it
    natively, fp32 otherwise; vLLM is then given the same (generation.vllm_dtype). lora_rank > 0: peft's LoRA
    adapters (B starts at zero: the policy starts as the base model) are its only trainable weights."""
    dtype = getattr(torch, default_dtype("cuda" if torch.cuda.is_available() else "cpu"))
    # progress bars of the model's load and of each checkpoint's save would cut into the step lines
    transformers.utils.logging.disable_progress_bar()
    try:
        model_name, tok = model, AutoTokenizer.from_pretrained(model)
    except OSError as e:
        # a hub name the hub does not have, or cannot be asked for offline: transformers' first line
        stop_with(f"--model {model}: {str(e).splitlines()[0]}")
    # before its weights load: the trainer's log-probs of such a model would not be those vLLM samples with
    if why := logit_transform(AutoConfig.from_pretrained(model_name)):
        stop_with(f"--model {model_name}: {why}")
    model = AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype)
    if lora_rank:
        # peft matches targets by name, ignores one that matches nothing while another matches, and
        # raises a traceback on a norm or a whole block: each name is checked first
        try:
            targets = adapter_targets(model, lora_targets)
        except ValueError as e:
            raise SystemExit(f"grpo_train.py: {e} ({model_name})") from None
        # no dropout: the probe and the on-policy ratio need the forward pass vLLM computes; A starts random
        # (B at zero), from --seed, so that a run repeats
        torch.manual_seed(seed)
        # imported here: peft takes 1.5 s to import, and a run without LoRA (the generation process, which
        # imports this file through grpo_train.py, included) never needs it
        from peft import LoraConfig
        model.add_adapter(LoraConfig(r=lora_rank, lora_alpha=lora_alpha or 2 * lora_rank, lora_dropout=0.0,
                                     target_modules=targets))
    if fp32_lm_head:
        head_in_fp32(model.get_output_embeddings())
    if dist.is_initialized() and dist.get_rank() == 0 and not eval_only:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        print(f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.2f}%)", flush=True)
    if grad_ckpt:   # HF checkpoints layers in train mode only (Qwen and Llama have no dropout to turn on)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model, tok


def head_in_fp32(head):
    """--fp32-lm-head: the lm_head's product in fp32, its bf16 input and weight cast up, as vLLM 0.32 with
    head_dtype float32 (vllm/model_executor/layers/logits_processor.py). The weight stays the model's (tied
    or not; LoRA-adapted: merged, as pushed) and gets its gradient (its adapters') in its own dtype."""
    bias = lambda: None if head.bias is None else head.bias.float()
    head.forward = lambda h: torch.nn.functional.linear(h.float(), merged_weight(head).float(), bias())


def deepspeed_config(ds_config_path, micro_batch, bf16, world):
    """--ds-config's file with the run's settings."""
    with open(ds_config_path) as f:
        ds_config = json.load(f)
    # gradient_accumulation_steps stays 1 (check_config: ds_config_error): micro-batches per step vary, so
    # the loop marks the boundary itself
    ds_config.update({"train_micro_batch_size_per_gpu": micro_batch, "bf16": {"enabled": bf16}})
    # ZeRO-2 reduces gradients during the backward where there is a reduction to hide (2+ ranks); on one rank
    # it would only add its buffers. A value in the file wins
    ds_config.setdefault("zero_optimization", {}).setdefault("overlap_comm", world > 1)
    return ds_config


def build_engine(model, ds_config_path, lr, micro_batch):
    """-> the DeepSpeed ZeRO-2 engine around `model`."""
    bf16 = next(model.parameters()).dtype == torch.bfloat16
    ds_config = deepspeed_config(ds_config_path, micro_batch, bf16, dist.get_world_size())
    if "optimizer" in ds_config:   # e.g. ds_config_offload.json: DeepSpeed's CPU Adam, for optimizer offload
        ds_config["optimizer"].setdefault("params", {})["lr"] = lr
        optimizer = None
    else:   # torch's AdamW: no JIT build on CPU; with LoRA, state for the adapters alone
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.99), weight_decay=0.0,
                                      fused=torch.cuda.is_available())
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine


def load_prompts(tok, *, task, data, seed, max_prompt_len, eval_size, prompt_key, answer_key, chat_template,
                 eval_only=False, rewards=None, **_):
    """-> (train samples, held-out samples, number of prompts skipped for being over max_prompt_len).
    Each sample has its prompt's token ids ("prompt_ids", from drop_long_prompts), which vLLM is given.
    Data without a test split gives eval_size distinct prompts of its train split to the held-out set (a
    shuffle seeded HOLD_OUT_SEED), never trained on, whatever rows repeat them. A mistake in the data
    stops the run with one line. Rank 0 says what was loaded."""
    try:
        train_all, test = [load_task(task, split, data=data, seed=seed, tokenizer=tok, prompt_key=prompt_key,
                                     answer_key=answer_key, chat_template=chat_template, reward_spec=rewards)
                           for split in ("train", "test")]
    except DataError as e:
        stop_with(e)
    source, note = f"--task {task}" + (f" --data {data}" if data else ""), ""
    if test is None:
        # split by distinct prompt: a row repeating a prompt goes where the prompt goes, so that no prompt
        # is both held out and trained on; a held-out prompt is evaluated once
        rows = {}
        for s in train_all:
            rows.setdefault(s["prompt"], []).append(s)
        # the default takes what a small file can give: a fifth of its prompts
        fifth = eval_size == DEFAULT_EVAL_SIZE and 2 <= len(rows) < 5 * eval_size
        eval_size = max(1, len(rows) // 5) if fifth else eval_size
        if len(rows) <= eval_size:
            # one distinct prompt: no --eval-size leaves any to train on
            advice = "pass a smaller --eval-size" if len(rows) > 1 else "add prompts, or a test split"
            stop_with(f"{source} has no test split and {len(rows)} distinct prompt{'s' * (len(rows) != 1)}: "
                      f"--eval-size {eval_size} held out of them would leave none to train on ({advice})")
        prompts = random.Random(HOLD_OUT_SEED).sample(list(rows), len(rows))
        test = [rows[prompt][0] for prompt in prompts[:eval_size]]
        held_out = {s["prompt"] for s in test}
        # the rows repeating a held-out prompt leave the training set with it
        repeats = sum(len(rows[prompt]) - 1 for prompt in held_out)
        train_all = [s for s in train_all if s["prompt"] not in held_out]
        folded = f"; split by prompt: {repeats} rows repeating a prompt folded into it" if repeats else ""
        fifth = f" (--eval-size's default on a file of {len(rows)} prompts: a fifth)" if fifth else ""
        note = (f" (no test split: {eval_size} of its rows{fifth}, a shuffle seeded {HOLD_OUT_SEED}, held out "
                f"and never trained on{folded})")
    train_set, too_long = drop_long_prompts(train_all, tok, max_prompt_len)
    eval_set = drop_long_prompts(test, tok, max_prompt_len)[0][:eval_size]
    # a run evaluates at its start and end whatever --eval-every: an empty held-out set would score 0
    for kept, rows, purpose, which in ((train_set, train_all, "train on", ""),
                                       (eval_set, test, "evaluate", "held-out prompts ")):
        if kept:
            continue
        lengths = [len(tok(s["prompt"], add_special_tokens=False)["input_ids"]) for s in rows]
        # the usual cause: a chat template's system prompt and turn markers around short prompts
        templated = chat_template == "auto" and getattr(tok, "chat_template", None) and task != "demo"
        why = " with the chat template; --chat-template none: the prompts as they are" if templated else ""
        stop_with(f"{source}: no prompt to {purpose}: " + (
            f"all {len(lengths)} {which}are longer than --max-prompt-len {max_prompt_len} tokens (the "
            f"shortest has {min(lengths)}{why})" if lengths else "no records"))
    if first_rank():
        training = "" if eval_only else (f"{len(train_set)} prompts to train on ({too_long} longer than "
                                         f"--max-prompt-len skipped), ")
        print(f"grpo_train.py: {source}: {training}{len(eval_set)} held out for evaluation{note}", flush=True)
    return train_set, eval_set, too_long
