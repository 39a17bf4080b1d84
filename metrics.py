"""The metrics of a GRPO run: what each step logs (docs/metrics.md lists every key), how the ranks' sums
are combined, the run's counters, and the metrics file. grpo_train.py uses it; read that first."""
import contextlib
import json
import math
import os
import time
from statistics import fmean as mean, stdev

import torch
import torch.distributed as dist

from progress import Progress, launch_time
from run_folder import clear_run, evaluates_first, keep_rows


def rollout_metrics(scored, advantages, rounds, n_kept, n_dropped, args):
    """A batch's reward/* (std: unbiased, as the advantages'), completion_len/*, frac_zero_std,
    gen/rounds, gen/samples, batch/groups, and "samples": max(2, --log-completions) of its rows (prompt,
    gold answer, completion, total reward, each reward, advantage), spread over its groups (MetricsLog
    writes them to completions.jsonl, and NoSignalWatch shows two). scored: (total reward, {reward name:
    value}, reward errors, vLLM completion, sample, completion text) of every sample; advantages: each
    one's, in the same order."""
    totals, parts, errors, completions, samples, texts = zip(*scored)
    group_size, n_samples = args.group_size, max(2, args.log_completions)
    picked = range(0, len(scored), max(1, len(scored) // n_samples))[:n_samples]
    metrics = {f"reward/{name}": mean([p[name] for p in parts]) for name in parts[0]}
    metrics.update({
        "reward/mean": mean(totals), "reward/std": stdev(totals), "reward/errors": sum(errors),
        "completion_len/mean": mean([len(c.token_ids) for c in completions]),
        "completion_len/truncated": mean([c.finish_reason == "length" for c in completions]),
        "frac_zero_std": n_dropped / (n_kept + n_dropped), "gen/rounds": rounds, "gen/samples": len(scored),
        "batch/groups": min(n_kept, len(completions) // rounds) // group_size,
        "samples": [{"prompt": samples[i]["prompt"], "answer": str(samples[i]["answer"]), "completion": texts[i],
                     "reward": totals[i], "rewards": parts[i], "advantage": advantages[i]} for i in picked]})
    return metrics


def add_stats(sums, stats, weight):
    """Accumulate a micro-batch's stats (weight 0: a rank's filler pass): keys ending in _max by max."""
    for k, v in stats.items():
        v = v * weight
        sums[k] = torch.maximum(sums[k], v) if k in sums and k.endswith("_max") else sums.get(k, 0) + v


def policy_stats(logps, entropy, vllm_logps, mask):
    """A micro-batch's sums, before any update, of |trainer's - vLLM's log-probs| (sampling/logp_diff_*)
    and of the policy's entropy (entropy), over the tokens in the loss."""
    with torch.no_grad():
        gap = (logps - vllm_logps).abs() * mask
        return {"gap_sum": gap.sum(), "gap_max": gap.max(), "entropy_sum": (entropy * mask).sum()}


# the stats every rank sums (or maxes) in the same order, whether or not it had a micro-batch
SUM_KEYS = ("loss", "kl_sum", "clip_low", "clip_high", "tokens", "ratio_sum", "gap_sum", "entropy_sum",
            "is_outside", "off_policy")
MAX_KEYS = ("ratio_max", "gap_max")


def reduce_stats(sums, device):
    """The step's stats summed (maxed) over all ranks."""
    as_tensor = lambda keys: torch.stack([torch.as_tensor(sums.get(k, 0.0), dtype=torch.float32, device=device)
                                          for k in keys])
    total, top = as_tensor(SUM_KEYS), as_tensor(MAX_KEYS)
    dist.all_reduce(total)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return dict(zip(SUM_KEYS + MAX_KEYS, total.tolist() + top.tolist()))


def loss_metrics(sums, num_iterations):
    """loss (mean over --num-iterations), kl, clip/*, ratio/*, sampling/* and entropy of a step (the last
    two taken once, before the update, while "tokens" counts every iteration's)."""
    tokens, n = max(sums["tokens"], 1), num_iterations
    return {"loss": sums["loss"] / n, "kl": sums["kl_sum"] / tokens, "clip/low": sums["clip_low"] / tokens,
            "clip/high": sums["clip_high"] / tokens, "ratio/mean": sums["ratio_sum"] / tokens,
            "ratio/max": sums["ratio_max"], "sampling/logp_diff_mean": sums["gap_sum"] * n / tokens,
            "sampling/logp_diff_max": sums["gap_max"], "entropy": sums["entropy_sum"] * n / tokens,
            "sampling/is_outside": sums["is_outside"] / tokens,
            "sampling/off_policy_masked": sums["off_policy"] / tokens}


# step 1 of a run: the policy is the reference and sampled the batch (policy_lag 0), so both numbers are
# rounding: ~1e-12 and ~1e-6 in fp32 on CPU; bf16 on GPUs leaves a few hundredths of a nat of log-prob gap
# (0.03-0.04 nats RMS at 0.5B), which these bounds allow
FIRST_STEP_KL, FIRST_STEP_GAP = 1e-3, 0.1


def first_step_check(log):
    """Step 1's metrics -> one warning line if the policy is not the reference or vLLM computes other
    log-probs than the trainer for the same weights, else None."""
    # a step without these (no kept sequence) has nothing to check
    kl, gap = log.get("kl", 0.0), log.get("sampling/logp_diff_mean", 0.0)
    causes = []
    if kl > FIRST_STEP_KL:
        causes.append(f"kl to the reference {kl:.3g} > {FIRST_STEP_KL:g} with the policy equal to it: the "
                      f"reference server holds another checkpoint, or computes in another dtype (its --dtype, "
                      f"--fp32-lm-head)")
    if gap > FIRST_STEP_GAP:
        causes.append(f"sampling/logp_diff_mean {gap:.3g} > {FIRST_STEP_GAP:g} for the very weights vLLM "
                      f"sampled with: a dtype mismatch (--fp32-lm-head on one side only), a chat template or "
                      f"tokenizer that differs between vLLM and the trainer, or a sampling setting vLLM applies "
                      f"that the trainer does not (top-p/top-k, a penalty, the model's generation_config.json)")
    return f"self-check at step 1 failed: {'; '.join(causes)}" if causes else None


@contextlib.contextmanager
def timed(times, key):
    """times[key] = the seconds the block took."""
    t0 = time.time()
    yield
    times[key] = time.time() - t0


class Counters:
    """The run's counters, saved with each checkpoint (`saved`, a dict the state holds): skipped_steps
    (updates DeepSpeed skipped for a non-finite gradient norm) and stale_dropped; it stops the run after
    --max-skips steps in a row with a skipped update."""

    def __init__(self, saved, max_skips):
        self.saved, self.max_skips, self.in_a_row = saved, max_skips, 0

    def after_step(self, step, grad_norms, stale_dropped):
        skipped = sum(not math.isfinite(g) for g in grad_norms)
        self.saved["skipped_steps"] += skipped
        self.saved["stale_dropped"] += stale_dropped
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if self.in_a_row >= self.max_skips:
            raise SystemExit(f"grpo_train.py: stopping at step {step}: the gradient norm was not finite "
                             f"{self.in_a_row} times in a row (--max-skips); the last checkpoint is unaffected")


class NoSignalWatch:
    """Says aloud when nothing is learning: after `patience` steps in a row whose groups all had equal
    rewards (frac_zero_std 1: every advantage 0, so loss and gradient 0), one warning that names what those
    batches show; again only after a step with signal."""

    def __init__(self, patience=3, template=lambda: None):
        self.patience, self.streak, self.template = patience, [], template

    def check(self, log, samples=()):
        """log: a step's metrics, samples: some of its (prompt, completion, reward) rows -> the warning to
        print, or None. It shows two of the completions, and names the chat template when one was applied
        (template(): its description, or None)."""
        self.streak = self.streak + [log] if log["frac_zero_std"] == 1 else []
        if len(self.streak) != self.patience:
            return None
        seen = lambda key: mean([r[key] for r in self.streak])
        parts = [k.split("/")[1] for k in log if k.startswith("reward/")
                 and k not in ("reward/mean", "reward/std", "reward/errors", "reward/overlong")]
        truncated, reward = seen("completion_len/truncated"), seen("reward/mean")
        findings = []
        if truncated >= 0.5:
            findings.append(f"{100 * truncated:.0f}% of the completions were cut at --max-new-tokens: raise it "
                            f"(mean length {seen('completion_len/mean'):.0f} tokens)")
        if "format" in parts and seen("reward/format") == 0:
            findings.append("the format reward is 0 for every completion: the completions never use the "
                            "<think>/<answer> format; check the prompt's instructions and --chat-template")
        if parts and all(seen(f"reward/{p}") == 1 for p in parts):
            findings.append("every completion has the full reward: the task is solved for this model; use "
                            "harder prompts")
        elif reward == 0 and not findings:
            findings.append("every completion scores 0: the task is too hard for this model, or the reward "
                            "never matches its answers (look at a few completions and the answer column)")
        if not findings:
            findings.append(f"the completions of each prompt score alike (mean reward {reward:.3f}); more "
                            f"--group-size or --temperature gives groups a chance to differ")
        if template := self.template():
            findings.append(f"the prompts went through {template} (--chat-template none: as written)")
        shown = [f"{clip(r['prompt'])} -> {clip(r['completion'])} (reward {r['reward']:.3f})"
                 for r in samples[:2]]
        if shown:
            findings.append("two of the last step's completions: " + ", ".join(shown))
        return (f"no learning signal: for {self.patience} steps in a row every group's completions had equal "
                f"rewards (frac_zero_std 1), so the loss and gradient are 0: " + "; ".join(findings))


def clip(text, width=80):
    """A prompt or completion in one line: quoted, its newlines and markers visible, the middle cut."""
    text = repr(text)
    return text if len(text) <= width else text[:width // 2 - 2] + " .. " + text[-(width // 2 - 2):]


def describe_template(model, task, chat_template):
    """"MODEL's chat template" when the prompts of this run went through one (tasks.chat_prompt's rule),
    else None. Loads the tokenizer: only called when a warning names it."""
    if chat_template == "none" or task == "demo":
        return None
    from transformers import AutoTokenizer
    has_template = getattr(AutoTokenizer.from_pretrained(model), "chat_template", None)
    return f"{model}'s chat template" if has_template else None


def numbers(log):
    """The metrics a chart can plot (tensorboard, W&B): numbers, without the None of a missing one."""
    return {k: v for k, v in log.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class MetricsLog:
    """What rank 0 writes as a run goes: metrics.jsonl (a line per step, and per evaluation that arrived with
    a later one or after the last line), config.yaml (which --config repeats), the progress line, the plot
    metrics.png (plot.py: at the end, and at an evaluation a minute or more after the last), tensorboard and
    W&B if asked, completions.jsonl and eval_completions.jsonl (--log-completions), and the closing line. A
    resumed run's files keep the steps up to its checkpoint and their evaluations (evaluate_first: whether it
    evaluates its starting weights). --eval-only writes eval.json and eval_outputs.jsonl instead."""
    # a drawing holds rank 0's loop 0.4 s (the first 0.9 s, importing matplotlib): drawn at every
    # evaluation of the demo (one in 10 steps of ~0.1 s) it was a fifth of the training time
    plot_every_s = 60.0

    def __init__(self, resume_step, *, out_dir, steps, tensorboard=False, wandb=False, eval_only=False,
                 log_completions=0, log_completions_every=1, log_every=0, model=None, task="demo",
                 chat_template="none", **flags):
        self.out_dir, self.t_start, self.file, self.tb, self.wandb = out_dir, time.time(), None, None, None
        self.steps, self.first_step, self.model, self.task = steps, resume_step + 1, model, task
        self.log_completions, self.completions_every = log_completions, log_completions_every
        self.flags, self.plot_failed, self.plotted = flags, False, time.time()
        self.progress = Progress(self.first_step, steps, log_every, started=launch_time())
        self.no_signal = NoSignalWatch(template=lambda: describe_template(model, task, chat_template))
        # (eval/step, eval/accuracy) of the run, the resumed part's included: the summary's before -> after
        self.evals = []
        self.evaluate_first = evaluates_first(out_dir, resume_step, flags.get("eval_every"))
        if eval_only:
            return
        os.makedirs(out_dir, exist_ok=True)
        # the run's files are written at the first row (open): after the checkpoint has loaded
        self.resume_step = resume_step
        self.resolved = resolved = {
            "model": model, "task": task, "chat_template": chat_template, "out_dir": out_dir, "steps": steps,
            "tensorboard": tensorboard, "wandb": wandb, "log_completions": log_completions,
            "log_completions_every": log_completions_every, "log_every": log_every, **flags}
        if wandb:
            import wandb as wandb_module
            self.wandb = wandb_module.init(
                project=os.environ.get("WANDB_PROJECT", "minimal-grpo"), name=os.path.basename(
                    os.path.abspath(out_dir)), dir=out_dir, config=resolved, settings=wandb_module.Settings(
                    quiet=True))
            # a row per line, charted against the run's step: rows logged at one step= are merged, one
            # value a key, which lost an evaluation that arrived beside another or after the last step
            self.wandb.define_metric("step")
            self.wandb.define_metric("*", step_metric="step")
            print(f"wandb: {self.wandb.url or self.wandb.dir}", flush=True)

    def open(self):
        """The run's files, at its first row: with --overwrite, the old run's checkpoints deleted; config.yaml
        written; metrics.jsonl, completions.jsonl and eval_completions.jsonl keep the rows up to the checkpoint
        resumed from (none in a new run)."""
        # at the first row, not at start-up: the checkpoint has loaded, vLLM has started and a step has
        # trained, so a new run that stops before (a typo in --data, a model that does not load) leaves
        # the old run whole; and before the new run's first checkpoint, which would sit beside the old's
        if self.flags.get("overwrite") and not self.resume_step:
            clear_run(self.out_dir)
        # the old run's config.yaml too stays until here: --eval-only of its older checkpoints reads it
        self.save_config(self.resolved)
        # the step each file's rows belong to: a training step, or the step an evaluation scored
        for name, key in (("completions.jsonl", "step"), ("eval_completions.jsonl", "eval/step")):
            keep_rows(os.path.join(self.out_dir, name), key, self.resume_step)
        path = os.path.join(self.out_dir, "metrics.jsonl")
        kept, carried = keep_rows(path, "step", self.resume_step, carry_evals=True)
        self.evals += [(row["eval/step"], row["eval/accuracy"]) for row in kept + carried if "eval/step" in row]
        self.file = open(path, "a")
        # a resumed run's clock and charts go on from its checkpoint's line: tensorboard hides the old run's
        # points after it (purge_step; all, for a new run), the evaluations carried back to it drawn again
        self.t_start -= kept[-1].get("time/elapsed_s", 0) if kept else 0
        if self.resolved["tensorboard"]:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(self.out_dir, purge_step=self.resume_step + 1)
            for row in carried:
                self.chart(row)

    def save_config(self, flags):
        """config.yaml: every flag of the run as resolved (command line over --config over the defaults), in
        --config's format, less what a config file does not set (run_config.NOT_IN_CONFIG)."""
        import yaml
        from run_config import NOT_IN_CONFIG
        kept = {k: v for k, v in sorted(flags.items()) if k not in NOT_IN_CONFIG}
        with open(os.path.join(self.out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(kept, f, sort_keys=False)

    def write(self, log):
        # evaluations that arrived with a later one (at the end, the last pushes'): first, a line each
        self.write_evals(log["step"], log.pop("eval/earlier", []))
        samples, outputs = log.pop("samples", []), log.pop("eval/rows", None)
        self.record(log)
        step = log["step"]
        # an evaluation arrives a step or so after the push it scores: its own step says which weights
        evals = f" | eval {log['eval/accuracy']:.3f} (step {log['eval/step']})" if "eval/step" in log else ""
        clipped = log.get("clip/low", 0) + log.get("clip/high", 0)
        warnings = [w for w in (self.no_signal.check(log, samples), step == 1 and first_step_check(log)) if w]
        self.progress.show(step, f"{self.progress.prefix(step)} | reward {log['reward/mean']:.3f} | loss "
                           f"{log['loss']:+.4f} | kl {log['kl']:.4f} | clip {clipped:.2f} | entropy "
                           f"{log['entropy']:.3f} | len {log['completion_len/mean']:.1f} | zero-std "
                           f"{log['frac_zero_std']:.2f}{evals}", keep=bool(evals or warnings))
        for warning in warnings:
            self.progress.say(warning)
        if self.log_completions and step % self.completions_every == 0:
            self.write_rows("completions.jsonl", {"step": step}, samples[:self.log_completions])
        if "eval/step" in log:
            self.took_eval(log, outputs)

    def write_evals(self, step, evals):
        """Evaluations without a step's line to ride: a line each (`step`, their eval/* keys, the time),
        their held-out outputs and a console line."""
        for row in evals:
            outputs = row.pop("eval/rows", None)
            self.record({"step": step, **row})
            self.progress.say(f"eval {row['eval/accuracy']:.3f} (step {row['eval/step']})")
            self.took_eval(row, outputs)

    def record(self, row):
        """A line of metrics.jsonl (opened at the first), with the time since the start, and its points in
        tensorboard and W&B."""
        if self.file is None:
            self.open()
        row["time/elapsed_s"] = time.time() - self.t_start
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb:
            self.chart(row)
        if self.wandb:
            self.wandb.log(numbers(row))

    def chart(self, row):
        """A row's numbers in tensorboard, at its step."""
        for k, v in numbers(row).items():
            self.tb.add_scalar(k, v, row["step"])

    def took_eval(self, row, outputs):
        """An evaluation's share of the log: the closing line's before -> after, its held-out outputs
        (--log-completions), and the plot if one is due."""
        self.evals.append((row["eval/step"], row["eval/accuracy"]))
        if self.log_completions and outputs:
            self.write_rows("eval_completions.jsonl", {"eval/step": row["eval/step"]}, outputs)
        if time.time() - self.plotted >= self.plot_every_s:
            self.plot()

    def write_rows(self, name, head, rows, folder=None, mode="a"):
        """Rows (completions with what scored them), one JSON object each, appended to `name`."""
        with open(os.path.join(folder or self.out_dir, name), mode) as f:
            f.writelines(json.dumps({**head, **row}, default=str) + "\n" for row in rows)

    def plot(self):
        """metrics.png (plot.py), titled with the run's model and task; without matplotlib, one line once."""
        data = self.flags.get("data")
        title = f"GRPO: {self.model} on --task {self.task}" + (f" --data {data}" if data else "")
        self.plotted = time.time()
        try:
            from plot import plot_metrics
            plot_metrics(self.file.name, os.path.join(self.out_dir, "metrics.png"), title)
        except ImportError as e:
            if not self.plot_failed:
                self.progress.say(f"no plot: {e.name} is not installed (pip install -r requirements.txt)")
            self.plot_failed = True

    def close(self, step, stopped=None, evals=None):
        """The end of a run (stopped: a stopped one's StopAfterStep.ending, what stopped it and the line
        that continues it): the evaluations that arrived after the last line (a stopped run's; take_evals'
        form), a line each; the plot, tensorboard's and W&B's files closed, and the closing line: held-out
        accuracy before -> after, the steps, the wall time since the launch, the last checkpoint."""
        if evals:
            self.write_evals(step, [*evals.pop("eval/earlier", []), evals])
        if self.file is None:
            return
        self.plot()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
        wall = time.time() - self.progress.started
        took = f"{int(wall // 60)} min {wall % 60:.0f} s" if wall >= 60 else f"{wall:.0f} s"
        accuracy = " -> ".join(f"{a:.3f} (step {s})" for s, a in self.evals[:1] + self.evals[1:][-1:])
        accuracy = f"held-out accuracy {accuracy}" if self.evals else "no evaluation"
        checkpoint = os.path.join(self.out_dir, f"step_{step}") if step else "none"
        ran = f"steps {self.first_step}-{step}" if step >= self.first_step else "no step"
        how, resume = stopped or (None, None)
        end = f"stopped after step {step} of {self.steps} ({how})" if stopped else "done"
        self.progress.say(f"{end}: {accuracy}; {ran} in {took}; last checkpoint {checkpoint}"
                          + (f"; to continue:\n{resume}" if stopped else ""))
        if self.wandb:
            # finish() returns before W&B's service has written the run's file (it is told, not waited
            # for: wandb 0.31); teardown waits for it, so a closed log is a complete one (and where the
            # service failed, its exit with the service's code comes after the closing line, as at exit)
            import wandb as wandb_module
            wandb_module.teardown()

    def write_eval(self, n, evals):
        """--eval-only: the result, as one JSON line on stdout and in eval.json, and the held-out outputs in
        eval_outputs.jsonl (no training run's file), beside the checkpoint evaluated (or in --out-dir)."""
        folder = self.flags.get("eval_dir") or self.out_dir
        outputs, _ = evals.pop("eval/rows", []), evals.pop("eval/step", None)
        result = {"model": self.model, "step": self.flags.get("eval_step"), "task": self.task,
                  "data": self.flags.get("data"), "eval/size": n, **evals}
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "eval.json"), "w") as f:
            json.dump(result, f)
        self.write_rows("eval_outputs.jsonl", {}, outputs, folder, mode="w")
        print(json.dumps(result), flush=True)
