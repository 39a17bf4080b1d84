"""Resumable checkpoints of a GRPO run: out_dir/step_N holds the HF model and tokenizer, DeepSpeed's files
(every rank's ZeRO-2 optimizer shard) and the run's state (grpo_state.json); out_dir/latest names the newest
complete one. With LoRA, step_N also holds step_N/adapter (peft's format: load it onto --model with
peft.PeftModel.from_pretrained), DeepSpeed's files hold the adapters alone, and the model's place holds the
merged model, so that a step folder loads, serves and evaluates as any model does (--eval-only --model
step_N). grpo_train.py uses it; read that first."""
import contextlib
import fcntl
import json
import os
import pickle
import re
import signal

import psutil
import torch.distributed as dist
from safetensors.torch import save_file

from lora import vllm_weights
from placement import leave_a_closed_terminal, stop_with
from run_config import EVAL_FLAGS
from run_folder import remove


# flags that may change when a run is resumed: its length, where it writes, and the machinery (devices,
# servers, memory, reward workers, evaluation, logging, the --config file that gave the flags); every
# other flag changes what the run learns
FREE_ON_RESUME = {
    "steps", "out_dir", "resume", "overwrite", "resume_with_changes", "local_rank", "micro_batch",
    "grad_ckpt", "ds_config", "gen_device", "gen_devices", "gen_urls", "gen_timeout", "gen_mem",
    "gen_kv_gb", "ref_url", "ref_device", "ref_wait", "sync_tol", "max_skips", "threads", "dist_timeout",
    "reward_workers", "eval_every", "eval_only", "save_every", "keep_checkpoints",
    "tensorboard", "wandb", "log_every", "log_completions", "log_completions_every", "config"}
# flags no resume can change: the checkpoint's weights are these
FIXED_ON_RESUME = ("model", "lora_rank", "lora_targets")


# the --out-dir locks this process holds, by (device, inode) of the folder: held until it exits
_held = {}


def hold_out_dir(out_dir):
    """Rank 0: an exclusive lock on --out-dir for the run's life (flock on the folder itself, so that a
    symlink to it is the same folder; the kernel drops it when the process ends, killed or not): a second
    run on the folder stops in one line before it touches anything, where it would write over this one's
    metrics and checkpoints. A folder it cannot make or write into is one line too."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    # a file of that name (makedirs' FileExistsError), a parent that is a file, a place with no write
    # permission or none at all (/proc/nope)
    except OSError as e:
        why = (f"a broken symbolic link, to {os.readlink(out_dir)}" if os.path.islink(out_dir) else
               "a file is there" if isinstance(e, FileExistsError) else f"{e.filename}: {e.strerror}")
        stop_with(f"--out-dir {out_dir}: cannot make that folder ({why}): pass another --out-dir")
    # a folder that is there but not this user's to write in: the first save would fail, steps later
    if not os.access(out_dir, os.W_OK | os.X_OK):
        stop_with(f"--out-dir {out_dir}: cannot write in that folder (no permission, or a read-only "
                  f"file system): pass another --out-dir")
    fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    folder = os.fstat(fd)
    if (folder.st_dev, folder.st_ino) in _held:
        return os.close(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        stop_with(f"--out-dir {out_dir} is in use by another run{lock_holder(folder)}: wait for it to "
                  f"end, or pass another --out-dir")
    _held[folder.st_dev, folder.st_ino] = fd


def lock_holder(folder):
    """" (pid N)": the process holding a flock on `folder` (an os.stat), read from /proc/locks."""
    inode = f"{os.major(folder.st_dev):02x}:{os.minor(folder.st_dev):02x}:{folder.st_ino}"
    with open("/proc/locks") as f:
        pids = [line.split()[4] for line in f if "FLOCK" in line and line.split()[5] == inode]
    return f" (pid {pids[0]})" if pids else ""


def fresh_state(config=None):
    return {"step": 0, "data_pos": 0, "ref": None, "counts": {"skipped_steps": 0, "stale_dropped": 0},
            "config": config}


def holds_run(out_dir):
    """-> what in out_dir shows that a run wrote there (its checkpoint, checkpoint folders or metrics), or
    None."""
    latest, metrics = os.path.join(out_dir, "latest"), os.path.join(out_dir, "metrics.jsonl")
    if os.path.exists(latest):
        with open(latest) as f:
            return f"its checkpoint {f.read().strip()}"
    # latest lost: the new run would prune or save over them
    if kept := checkpoint_folders(out_dir):
        return f"its checkpoints {listed(kept)}"
    if os.path.exists(metrics) and os.path.getsize(metrics):
        return "its metrics.jsonl"
    return None


def checkpoint_in(model, out_dir):
    """Whether the folder `model` is, or is in, a step_N (or step_N.tmp) checkpoint of out_dir."""
    if not model or not os.path.isdir(model):
        return False
    inside = os.path.relpath(os.path.realpath(model), os.path.realpath(out_dir)).split(os.sep)[0]
    return re.fullmatch(r"step_\d+(\.tmp)?", inside) is not None


def flag_changes(saved, config):
    """-> ["--lr 0.001 (was 1e-06)", ...]: the flags of config that differ from the saved run's."""
    return [f"--{k.replace('_', '-')} {config.get(k)} (was {v})" for k, v in saved.items()
            if k not in FREE_ON_RESUME and config.get(k) != v]


def read_state(master, *, out_dir, resume, steps, overwrite=False, resume_with_changes=False,
               eval_only=False, **flags):
    """All ranks: the run's state, a fresh one or (resume) the one saved with the checkpoint `latest` names;
    it records the run's flags (config), which a resume compares. Read before the engine is built: the
    generation process starts from it while DeepSpeed sets up. An --out-dir that holds another run is
    refused unless --resume or --overwrite (which deletes nothing here: MetricsLog does, at the new run's
    first row); a resume that would change the run is refused unless --resume-with-changes, one with another
    --model or --lora-rank always, one with no step left to take, and one into step_N folders that no
    `latest` names (one into a new or empty folder starts from --model): one line each."""
    # --resume-with-changes is a --resume (alone, it was refused as a fresh run into a run's folder)
    resume = resume or resume_with_changes
    # --eval-only evaluates --model as it is: with --resume it waited for an evaluation never asked for
    if eval_only and resume:
        stop_with(f"--eval-only evaluates --model; it takes no --resume: name the checkpoint "
                  f"(--model {os.path.join(out_dir, 'step_N')})")
    # a run saves over, prunes and (--overwrite) removes its --out-dir's checkpoints, and its policy and
    # reference load from --model meanwhile
    if not eval_only and checkpoint_in(flags.get("model"), out_dir):
        stop_with(f"--model {flags['model']} is a checkpoint in --out-dir {out_dir}, which this run saves "
                  f"over, prunes or removes: copy it out first, or pass another --out-dir")
    # --eval-only writes only its result (beside the checkpoint it evaluates): no run's folder to hold
    if master and not eval_only:
        hold_out_dir(out_dir)
    # what a resume compares, and every flag an --eval-only of its checkpoints takes (--eval-size too)
    config = {k: v for k, v in flags.items() if k not in FREE_ON_RESUME or k in EVAL_FLAGS}
    state, latest = fresh_state(config), os.path.join(out_dir, "latest")
    found = None if eval_only or not os.path.isdir(out_dir) else holds_run(out_dir)
    if found and not (resume or overwrite):
        stop_with(f"--out-dir {out_dir} holds another run ({found}): --resume continues it, --overwrite "
                  f"replaces it, or pass another --out-dir")
    if not resume:
        return state
    if not os.path.exists(latest):
        # step_N folders without latest (lost, or deleted by hand): a fresh run would empty the metrics
        # at its first row and prune or replace those checkpoints at its saves
        if not overwrite and (kept := checkpoint_folders(out_dir)):
            stop_with(f"--resume: {out_dir} holds checkpoints ({listed(kept)}) but no file latest naming the "
                      f"one to resume: write its name into it (the newest: echo {kept[-1]} > {latest}), or "
                      f"start afresh with --overwrite")
        if master:
            print(f"--resume: no checkpoint in {out_dir}, starting from --model", flush=True)
        return state
    with open(latest) as f:
        tag = f.read().strip()
    path = os.path.join(out_dir, tag)
    state.update(checked_state(path, tag, flags))
    saved, state["config"] = state["config"] or {}, config
    if fixed := [k for k in FIXED_ON_RESUME if k in saved and saved[k] != config.get(k)]:
        was = " ".join(f"--{k.replace('_', '-')} {saved[k]}" for k in fixed)
        now = " ".join(f"--{k.replace('_', '-')} {config.get(k)}" for k in fixed)
        stop_with(f"--resume: {path} was trained with {was}; it cannot continue with {now} (pass "
                  f"{was}, or start a new run in another --out-dir)")
    changes = flag_changes(saved, config)
    if changes and not resume_with_changes:
        stop_with(f"--resume: these flags differ from {path}'s run: {', '.join(changes)}; "
                  f"--resume-with-changes continues with them, or pass the run's values")
    if steps <= state["step"]:
        stop_with(f"--steps {steps}: the checkpoint in {out_dir} is at step {state['step']} already; pass "
                  f"a larger --steps")
    if master:
        print(f"resuming after step {state['step']} from {path}"
              + (f" with {', '.join(changes)}" if changes else ""), flush=True)
    return state


def listed(folders):
    """Checkpoint folders in a line: "step_10, step_20", or from 4 on "4 of them, step_10 to step_40"."""
    return ", ".join(folders) if len(folders) < 4 else f"{len(folders)} of them, {folders[0]} to {folders[-1]}"


def checkpoint_folders(out_dir):
    """The complete checkpoint folders in out_dir (not a save's step_N.tmp), oldest first: ["step_10", ...]."""
    if not os.path.isdir(out_dir):
        return []
    steps = sorted(int(m[1]) for name in os.listdir(out_dir) if (m := re.fullmatch(r"step_(\d+)", name))
                   and os.path.isdir(os.path.join(out_dir, name)))
    return [f"step_{n}" for n in steps]


def checked_state(path, tag, flags) -> dict:
    """grpo_state.json of checkpoint folder `path` (`tag`, as `latest` names it), checked before anything of
    the run is touched: its step is the folder's, its data position one a run reaches by then, its counts
    and reference checkpoint are what a run writes; a one-line stop naming what is not, otherwise."""
    where = os.path.join(path, "grpo_state.json")
    if not (folder := re.fullmatch(r"step_(\d+)", tag)) or not os.path.isdir(path):
        stop_with(f"--resume: {os.path.dirname(path)}/latest names {tag!r}, no checkpoint folder step_N "
                  f"there: write the name of one into it, or start afresh with --overwrite")
    try:
        with open(where) as f:
            state = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        stop_with(f"--resume: {where} cannot be read ({str(e)[:200]}): resume from another checkpoint "
                  f"(write its name into latest), or start afresh with --overwrite")
    # what a field missing from the file is in the run's state: a fresh run's
    state = {**fresh_state(), **state} if isinstance(state, dict) else {}
    step, counts, ref, positions = (state.get(k) for k in ("step", "counts", "ref", "data_pos"))
    step = step if type(step) is int else -1
    counts_ok = isinstance(counts, dict) and all(type(counts.get(k)) is int and counts[k] >= 0
                                                 for k in fresh_state()["counts"])
    # each engine's position in the shuffled stream moves --prompts-per-step a draw, up to
    # --max-gen-rounds draws a batch, and a batch thrown away as stale was drawn too
    saved = state.get("config") if isinstance(state.get("config"), dict) else {}
    most = lambda k: max(saved[k] if type(saved.get(k)) is int else 1, flags.get(k) or 1)
    drawn = most("prompts_per_step") * most("max_gen_rounds") * (step + counts["stale_dropped"]) \
        if counts_ok else 0
    positions = positions if isinstance(positions, list) else [positions]
    ref_step = re.fullmatch(r"step_(\d+)", os.path.basename(ref)) if isinstance(ref, str) else None
    problems = [why for bad, why in [
        (step < 1 or step != int(folder[1]), f"its step {state.get('step')!r} is not the folder's ({tag})"),
        (not counts_ok, f"its counts {counts!r} are not counts of skipped steps and stale batches"),
        (not positions or any(type(p) is not int or not 0 <= p <= drawn for p in positions),
         f"its data position {state.get('data_pos')!r} is not one a run reaches by then (0 to {drawn})"),
        (ref is not None and not (ref_step and int(ref_step[1]) <= step),
         f"its reference checkpoint {ref!r} is not one of the run's"),
    ] if bad]
    if problems:
        stop_with(f"--resume: {where} does not describe that checkpoint: {'; '.join(problems)}; resume from "
                  f"another (write its name into latest), or start afresh with --overwrite")
    return state


def load_checkpoint(engine, out_dir, step):
    """All ranks: the model and this rank's optimizer shard (DeepSpeed 0.19) of checkpoint step_<step>; none at
    step 0 (a fresh run). A file of them missing (deleted to save space), cut short or garbled, or a load
    DeepSpeed gives up on: one line naming the folder, before the run writes anything."""
    if step == 0:
        return
    tag = f"step_{step}"
    folder = os.path.join(out_dir, tag)
    restart = (f"resume from another checkpoint (write its name into {out_dir}/latest), or start a new run "
               f"from its weights (--model {folder}) in another --out-dir")
    # the files DeepSpeed 0.19 reads for this rank, named as it names them: a missing model file fails its
    # load on a bare assert, a missing shard on a traceback
    needed = [engine._get_ckpt_name(out_dir, tag), engine._get_zero_ckpt_name(out_dir, tag)]
    if missing := [os.path.basename(name) for name in needed if not os.path.isfile(name)]:
        stop_with(f"--resume: {folder} has no {' and no '.join(missing)}, which DeepSpeed reads to resume: "
                  f"{restart}")
    # frozen weights (LoRA's base) are not in the checkpoint: they are --model's, loaded already
    frozen = any(not p.requires_grad for p in engine.module.parameters())
    try:
        path, _ = engine.load_checkpoint(out_dir, tag=tag, load_module_strict=not frozen)
    # torch.load of a file cut short (a copy that did not finish) or garbled
    except (RuntimeError, EOFError, pickle.UnpicklingError) as e:
        stop_with(f"--resume: DeepSpeed could not load the checkpoint {folder} "
                  f"({str(e).partition(chr(10))[0].partition('. ')[0][:200]}): {restart}")
    if path is None:
        stop_with(f"--resume: DeepSpeed could not load the checkpoint {folder}: {restart}")


def save_checkpoint(engine, tokenizer, out_dir, state, *, keep, new_reference=False):
    """All ranks: checkpoint step_<state["step"]>, atomic against a kill: everything is written to step_N.tmp,
    renamed when complete, and only then does the file `latest` (replaced by a rename) name it. Not against
    a power cut: nothing is fsync'ed. new_reference: the reference servers are to load this checkpoint
    (--ref-sync-every; the generation process has them do it), and the state records it, so a resumed run
    has them load it again and it is never pruned. keep: how many step_N folders stay (0: all)."""
    tag, master = f"step_{state['step']}", dist.get_rank() == 0
    tmp, final = os.path.join(out_dir, tag + ".tmp"), os.path.abspath(os.path.join(out_dir, tag))
    if new_reference:
        state["ref"] = final
    if master and os.path.lexists(tmp):   # left by a run killed while saving
        remove(tmp)
    dist.barrier()
    engine.save_checkpoint(out_dir, tag=tag + ".tmp", save_latest=False, exclude_frozen_parameters=True)
    if master:
        lora = bool(getattr(engine.module, "peft_config", None))
        # a peft folder beside config.json would make transformers load its adapters onto the base model it names
        engine.module.save_pretrained(os.path.join(tmp, "adapter") if lora else tmp)
        if lora:
            save_merged(engine.module, tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "grpo_state.json"), "w") as f:
            json.dump(state, f)
    dist.barrier()   # every rank's shard is written
    if master:
        if os.path.lexists(final):   # saved before by a run that was then resumed from an earlier step
            remove(final)
        os.replace(tmp, final)
        with open(os.path.join(out_dir, "latest.tmp"), "w") as f:
            f.write(tag)
        os.replace(os.path.join(out_dir, "latest.tmp"), os.path.join(out_dir, "latest"))
        if keep:
            prune_checkpoints(out_dir, state["step"], keep, state["ref"])
    dist.barrier()


def save_merged(model, path):
    """A LoRA policy as a checkpoint of its base architecture, adapters merged (for from_pretrained, vLLM and
    the reference server's /reload): config.json, generation_config.json, model.safetensors (one file, as
    the weights vLLM gets)."""
    model.config.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    save_file({name: w.contiguous() for name, w in vllm_weights(model)}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})


def prune_checkpoints(out_dir, step, keep, ref):
    """Delete the step_N folders before `step` but the newest keep - 1 of them, and never `ref` (the one the
    reference server serves). Folders after `step` (left by a run that was resumed from earlier) stay: the
    save at that step replaces them."""
    steps = sorted(int(m.group(1)) for name in os.listdir(out_dir) if (m := re.fullmatch(r"step_(\d+)", name)))
    older = [n for n in steps if n < step]
    for n in older[:max(0, len(older) - (keep - 1))]:
        path = os.path.abspath(os.path.join(out_dir, f"step_{n}"))
        if path != ref:
            remove(path)


class StopNow(SystemExit):
    """A second Ctrl-C: the run ends where it is (a checkpoint being written stays step_N.tmp, never latest)."""


class StopAfterStep:
    """Ctrl-C or SIGTERM during the loop: the run finishes the step it is in, saves a checkpoint and prints
    the line that continues it; a second Ctrl-C stops at once. deepspeed 0.19.8's launcher passes a Ctrl-C
    or a SIGTERM on as SIGTERM to each rank's processes in turn (launch.py, sigkill_handler:
    terminate_process_tree), killing what is left of them 30 s later; a terminal's Ctrl-C also reaches each
    process as SIGINT, and a SIGTERM sent to the launch's whole process group (a job scheduler) reaches each
    rank too. So a rank may get SIGTERM twice for one stop, up to 30 s apart: SIGTERM only ever asks. Rank 0
    makes the stop (it takes no more batches). The engines ignore SIGINT (ranks.init_distributed) but
    die of the launcher's SIGTERM: once stopping, rank 0 waits for none of them (`wait`). Built on every rank
    before the loop (the launcher is alive then). Another rank passes its first request on to rank 0, as
    SIGTERM, where rank 0 runs beside it (ask_rank_zero); one that rank 0 got too is asked once all the same."""

    def __init__(self):
        from run_config import launch_command
        # whether a Ctrl-C came, and the first signal's name for the stop's lines
        self.requested, self.ctrl_c, self.asked_by = False, False, None
        self.resume = launch_command(resume=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.on_signal)

    def on_signal(self, signum, frame):
        ctrl_c = signum == signal.SIGINT
        if ctrl_c and self.ctrl_c:
            raise StopNow(128 + signum)
        first = not self.requested
        # recorded before the print, which can block: a second Ctrl-C meanwhile stops at once
        self.ctrl_c |= ctrl_c
        self.requested = True
        if first:
            # a stop that comes as the terminal closes (the demo's SIGHUP): the step still finishes and saves
            leave_a_closed_terminal()
            self.asked_by = "Ctrl-C" if ctrl_c else "SIGTERM"
            again = " (Ctrl-C again: at once)" if ctrl_c else ""
            if dist.get_rank() == 0:
                print(f"\n{self.asked_by}: the run stops after this step, with a checkpoint{again}", flush=True)
            else:
                ask_rank_zero()

    def ending(self):
        """-> None while the run goes on; after a stop, (what asked for it, the line that continues it)."""
        return (self.asked_by, self.resume) if self.requested else None

    def wait(self, wait, *args, **kw):
        """Rank 0's wait(*args, **kw) on the engines -> its value; None once a stop is asked for, before or
        while it waits: the engines' and the launcher's ends it then meets are the stop, not errors."""
        if self.requested:
            return None
        try:
            value = wait(*args, **kw)
        except (SystemExit, Exception) as e:
            if isinstance(e, StopNow) or not self.requested:
                raise
            return None
        return None if self.requested else value


def ask_rank_zero():
    """Another rank's stop: a SIGTERM to rank 0 (which only ever asks for the stop), found among this rank's
    siblings under the launcher (its RANK); on another node, where rank 0 is not one, the stop asks nothing."""
    with contextlib.suppress(psutil.Error, AttributeError, StopIteration):   # no launcher, or rank 0 gone
        siblings = psutil.Process().parent().children()
        next(p for p in siblings if p.environ().get("RANK") == "0").send_signal(signal.SIGTERM)


def save_on_stop(engine, tokenizer, out_dir, state, keep):
    """All ranks, after a stop: a checkpoint of the last step taken, unless one was saved at it (`latest`
    names it) or no step was taken."""
    latest = os.path.join(out_dir, "latest")
    saved = None
    if os.path.exists(latest):
        with open(latest) as f:
            saved = f.read().strip()
    if state["step"] and saved != f"step_{state['step']}":
        save_checkpoint(engine, tokenizer, out_dir, state, keep=keep)
