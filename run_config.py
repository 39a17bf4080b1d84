"""A run's configuration: the command line, a --config YAML file under it (the command line wins, as TRL's
--config), the flags that need each other or a package, and what a checkpoint's --eval-only evaluates.
grpo_train.get_args uses it; each run saves the resolved flags as <out-dir>/config.yaml (metrics.py), which
--config takes back to repeat the run; and the words run_setup.check_config says of a flag out of its range
or a --ds-config file that is not JSON or holds settings the trainer cannot run. A mistake is one line
naming the flag, file or key (stop_with)."""
import argparse
import contextlib
import importlib.util
import json
import math
import os
import shlex
import sys

from placement import first_rank, stop_with

# --eval-size's default; a file without a test split and with fewer than 5 x as many prompts: a fifth of them
DEFAULT_EVAL_SIZE = 200
# the flags an --eval-only of a checkpoint takes from the run that trained it, unless given: what decides
# the held-out set, how its prompts are written, the reward that scores it, and the generation lengths
EVAL_FLAGS = ("task", "data", "seed", "prompt_key", "answer_key", "chat_template", "rewards",
              "max_new_tokens", "max_prompt_len", "eval_size")
# what each logging flag imports, and the pin the requirements files install
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard==2.21.0"), "wandb": ("wandb", "wandb==0.31.0")}
# flags no config file sets: the launcher's, those that say what to do with an --out-dir this once, and
# --help, which would print the help and exit 0 where the file meant a run
NOT_IN_CONFIG = ("config", "local_rank", "resume", "overwrite", "resume_with_changes", "help")


def at_least_one(text):
    """--threads "4", --log-completions-every "10" -> the count (argparse names the flag when this raises)."""
    if int(text) < 1:
        raise ValueError(text)
    return int(text)


def out_of_range(within, **flags):
    """The flags whose value is not `within`, as the command line names them: "--lr, --dist-timeout"."""
    return ", ".join(f"--{name.replace('_', '-')}" for name, value in flags.items() if not within(value))


def ds_config_error(path):
    """--ds-config's mistake in one line (no such file, not JSON, not a JSON object, a setting the trainer or
    DeepSpeed refuses), or None."""
    if not os.path.isfile(path):
        return f"--ds-config {path}: {'a folder, not a file' if os.path.isdir(path) else 'no such file'}"
    try:
        with open(path) as f:
            config = json.load(f)
    except OSError as e:
        return f"--ds-config {path}: {e.strerror}"
    except ValueError as e:
        # json's error names the line and column; a file that is not text, the byte
        where = f"{e.msg}, line {e.lineno}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else e
        return f"--ds-config {path}: not JSON ({where})"
    if not isinstance(config, dict):
        return (f"--ds-config {path}: a JSON object of DeepSpeed's settings is expected, not a "
                f"{type(config).__name__}")
    # a step accumulates all its micro-batches, each weighted by its share of the batch: DeepSpeed's own
    # accumulation would divide every gradient again (and the clip act on a norm that much smaller), and
    # a fixed batch size disagrees with --micro-batch
    if config.get("gradient_accumulation_steps", 1) != 1 or "train_batch_size" in config:
        return (f"--ds-config {path}: keep gradient_accumulation_steps 1 and leave out train_batch_size: "
                f"a step accumulates all its micro-batches itself (--micro-batch sets their size)")
    return deepspeed_settings_error(path, config)


def deepspeed_settings_error(path, config):
    """The sections of a --ds-config file the trainer fills in or relies on, checked before vLLM starts
    (DeepSpeed reads them after): zero_optimization (DeepSpeed's own check, and a stage of 1 or 2) and
    optimizer. One line naming the key, or None."""
    zero, optimizer = config.get("zero_optimization", {}), config.get("optimizer", {})
    params = optimizer.get("params", {}) if isinstance(optimizer, dict) else {}
    # the trainer sets zero_optimization.overlap_comm and optimizer.params.lr in them
    for key, value in (("zero_optimization", zero), ("optimizer", optimizer), ("optimizer.params", params)):
        if not isinstance(value, dict):
            return (f"--ds-config {path}: {key} must be a JSON object of settings, not "
                    f"{json.dumps(value)[:80]}")
    stage = zero.get("stage")
    # stage 3 splits the weights, which the weight push and the log-probs read whole; stage 0 (DeepSpeed's
    # default) has no ZeRO optimizer: fp32 weights (CPU) get no grad norm for the step and no optimizer
    # shard in the checkpoint
    if isinstance(stage, bool) or stage not in (1, 2):
        given = "missing" if stage is None else json.dumps(stage)[:80]
        return (f"--ds-config {path}: zero_optimization.stage is {given}: this trainer runs ZeRO stage 2 "
                f"(ds_config.json) or 1; stage 3 splits the weights, which it reads whole, and 0 is no ZeRO")
    # imported here: DeepSpeed takes seconds to import, and only check_config (run_setup has it) asks this
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    try:
        DeepSpeedZeroConfig(**zero)
    # pydantic's ValidationError, one error a line: the first names the key
    except ValueError as e:
        first = e.errors()[0] if hasattr(e, "errors") else {"loc": (), "msg": str(e)}
        key = ".".join(["zero_optimization", *map(str, first["loc"])])
        return f"--ds-config {path}: {key}: {first['msg']}"
    return None


def add_run_args(p):
    """The flags of evaluation, logging, checkpoints, and --config (run_setup.add_system_args adds them)."""
    g = p.add_argument_group("evaluation, logging and checkpoints")
    g.add_argument("--eval-every", type=int, default=0,
                   help="held-out eval every N steps, a multiple of --sync-every (and first, last)")
    g.add_argument("--eval-size", type=int, default=DEFAULT_EVAL_SIZE,
                   help="held-out samples per evaluation (held out of --data when it has no test split; the "
                        "default 200 holds out a fifth of a file of fewer than 1000 prompts)")
    g.add_argument("--eval-only", action="store_true", help="evaluate --model on the held-out split and exit")
    g.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (and at the end)")
    g.add_argument("--keep-checkpoints", type=int, default=2,
                   help="checkpoints kept on disk, newest first (0: all); the reference's is kept too")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out-dir")
    g.add_argument("--resume-with-changes", action="store_true",
                   help="--resume even where flags that change the run differ from the checkpoint's")
    g.add_argument("--overwrite", action="store_true",
                   help="start afresh in an --out-dir that holds another run (its checkpoints are deleted)")
    g.add_argument("--log-completions", type=int, default=0,
                   help="N training completions (prompt, answer, completion, each reward, advantage) written to "
                        "completions.jsonl every --log-completions-every steps, and each evaluation's held-out "
                        "outputs (answer, completion, verdict) to eval_completions.jsonl")
    g.add_argument("--log-completions-every", type=at_least_one, default=1, help="steps between those rows")
    g.add_argument("--log-every", type=int, default=0,
                   help="a step line every N steps (0: every step up to 100 steps, else about 100 lines a run); "
                        "on a terminal the steps between rewrite one line")
    g.add_argument("--tensorboard", action="store_true", help="also log to tensorboard in --out-dir")
    g.add_argument("--wandb", action="store_true",
                   help="also log to Weights & Biases (its own settings: WANDB_PROJECT, WANDB_MODE=offline, ...)")
    p.add_argument("--config", default=None,
                   help="a YAML file of flag: value (max_new_tokens: 512); flags on the command line win "
                        "(--no-FLAG turns off a switch it sets)")


def config_argv(path, parser):
    """--config FILE's keys as command-line words, placed before the command line's own so that those win.
    A key is a flag's name (max_new_tokens or max-new-tokens); true/false for a switch; a list for
    --gen-devices. An unknown key, a malformed file or a file that is not a mapping: one line."""
    import yaml
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except OSError as e:
        stop_with(f"--config {path}: {e.strerror}")
    except UnicodeDecodeError as e:
        stop_with(f"--config {path}: not a text file (byte {e.start} is not UTF-8)")
    except yaml.YAMLError as e:
        stop_with(f"--config {path}: not YAML{yaml_problem(e)}")
    if config is None:
        return []
    if not isinstance(config, dict):
        stop_with(f"--config {path}: a mapping of flag: value is expected, not {type(config).__name__}")
    actions = {a.dest: a for a in parser._actions}
    words = []
    for key, value in config.items():
        dest = str(key).replace("-", "_")
        if dest not in actions or dest in NOT_IN_CONFIG:
            stop_with(f"--config {path}: unknown key {key!r} (the keys are the flags' names: --help lists "
                      f"them; --resume and --overwrite go on the command line)")
        flag = actions[dest].option_strings[0]
        switch = isinstance(actions[dest], argparse._StoreTrueAction)
        if switch and not isinstance(value, bool):
            stop_with(f"--config {path}: {key}: true or false, not {value!r}")
        if switch and value:
            words.append(flag)
        elif value is not None and not switch:
            listed = ",".join(map(str, value)) if isinstance(value, list) else str(value)
            words += [flag, listed]
    return words


def yaml_problem(e):
    """A yaml.YAMLError as " (line 2, column 1): what is wrong there"."""
    where = getattr(e, "problem_mark", None)
    at = f" (line {where.line + 1}, column {where.column + 1})" if where else ""
    return f"{at}: {getattr(e, 'problem', None) or e}"


def given_flags(parser, argv):
    """The flags the command line (or the config file) gave, whatever their values: a parse in which each
    flag starts as a marker that only a given flag replaces."""
    unset = object()
    marked = argparse.Namespace(**{a.dest: unset for a in parser._actions})
    return {k for k, v in vars(parser.parse_args(argv, marked)).items() if v is not unset}


def parse_flags(parser, argv=None):
    """grpo_train.py's flags: --config's file under the command line's, then the checks that need more than
    one flag (one line each), then, for --eval-only of a checkpoint, the flags of the run that trained it."""
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    path = pre.parse_known_args(argv)[0].config
    words = (config_argv(path, parser) if path else []) + argv
    # --no-<switch> turns off a switch a --config file sets (not in --help: it matters only there)
    for switch in [a for a in parser._actions if isinstance(a, argparse._StoreTrueAction)]:
        if switch.dest not in NOT_IN_CONFIG:
            parser.add_argument("--no-" + switch.option_strings[0][2:], dest=switch.dest, action="store_false",
                                help=argparse.SUPPRESS)
    args = parser.parse_args(words)
    given = given_flags(parser, words)
    # argparse's float takes "nan" and "inf" (in the YAML file too: .nan, .inf), which no flag means: one
    # line, before a timeout overflows or vLLM refuses its sampling parameters in the generation process
    if not_finite := out_of_range(lambda v: v is None or math.isfinite(v), **{
            a.dest: getattr(args, a.dest) for a in parser._actions if a.type is float}):
        stop_with(f"{not_finite} must be a finite number")
    if args.beta == 0 and args.ref_url and not args.eval_only:
        stop_with("--ref-url names reference servers, but --beta 0 trains without a reference: drop "
                  "--ref-url, or give --beta > 0")
    for flag, (module, pin) in PACKAGES.items():
        if getattr(args, flag) and importlib.util.find_spec(module) is None:
            stop_with(f"--{flag} needs the {module} package, which is not installed: pip install -r "
                      f"requirements.txt (or requirements-cpu.txt) installs it, or pip install {pin}")
    if args.eval_only:
        evaluate_as_trained(args, given, parser)
    return args


def checkpoint_state(folder):
    """A checkpoint folder's grpo_state.json (its step and its run's flags), or None for any other model; one
    line where it cannot be read or is not a JSON object."""
    path = os.path.join(folder, "grpo_state.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            state = json.load(f)
        problem = None if isinstance(state, dict) else "is not a JSON object"
    except (OSError, ValueError, RecursionError) as e:
        problem = f"cannot be read ({str(e)[:200]})"
    if problem:
        stop_with(f"--eval-only: {path} {problem}: mend it, or move it away to evaluate {folder} as any "
                  f"model, on the flags given")
    return state


def run_config_of(folder, state):
    """The flags a checkpoint folder was trained with, as its grpo_state.json (`state`) records them: those
    of the launch that saved it, even where a later --resume-with-changes changed them. A checkpoint of an
    earlier version, which does not record --eval-size, takes what it lacks from <out-dir>/config.yaml beside
    it (the latest launch's flags); one line where that cannot be read or is not a mapping."""
    import yaml
    recorded = state["config"] if isinstance(state.get("config"), dict) else {}
    beside = os.path.join(os.path.dirname(os.path.abspath(folder)), "config.yaml")
    if all(k in recorded for k in EVAL_FLAGS) or not os.path.isfile(beside):
        return recorded
    try:
        with open(beside) as f:
            config = yaml.safe_load(f) or {}
        problem = None if isinstance(config, dict) else ": not a mapping of flag: value"
    except OSError as e:
        problem = f": {e.strerror}"
    except yaml.YAMLError as e:
        problem = f": not YAML{yaml_problem(e)}"
    if problem:
        stop_with(f"--eval-only: {beside}{problem}; it holds the flags of {folder}'s run: mend it, or move it "
                  f"away to take those its grpo_state.json keeps")
    return {**config, **recorded}


def evaluate_as_trained(args, given, parser):
    """--eval-only of a checkpoint (a folder with grpo_state.json): the held-out set, prompts, reward and
    lengths of the run that trained it (EVAL_FLAGS not given), its step (args.eval_step), and the result
    written beside it (args.eval_dir: the folder itself, or --out-dir if given). Rank 0 says what it took."""
    state = checkpoint_state(args.model)
    args.eval_step, args.eval_dir = None, args.out_dir
    if state is None:
        return
    config = run_config_of(args.model, state)
    taken = {k: config[k] for k in EVAL_FLAGS if k in config and k not in given}
    vars(args).update(taken)
    args.eval_step = state.get("step")
    if "out_dir" not in given:
        args.eval_dir = args.model
    if first_rank():
        said = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in taken.items() if v != parser.get_default(k))
        print(f"grpo_train.py: --eval-only: {args.model} is step {args.eval_step} of a run; evaluating it "
              f"as that run did: {said} (flags given here win)", flush=True)


def launcher():
    """The deepspeed launcher's process (its runner: it starts launch.py, which starts each rank of this
    node), or None when this rank was started otherwise (a multi-node runner, a test)."""
    import psutil
    with contextlib.suppress(AttributeError, psutil.Error):
        runner = psutil.Process().parent().parent()
        if any(os.path.basename(word) == "deepspeed" for word in runner.cmdline()[:2]):
            return runner
    return None


def launch_command(resume=False):
    """The command line that launched this run, as typed (the launcher's, with the CUDA_VISIBLE_DEVICES
    it was given), or this rank's own under `deepspeed`; with resume, without --overwrite and with
    --resume: the line that continues the run."""
    import psutil
    words, devices = ["deepspeed", *[w for w in sys.argv if not w.startswith("--local_rank")]], None
    runner = launcher()
    with contextlib.suppress(AttributeError, psutil.Error):
        typed = runner.cmdline()
        start = next(i for i, w in enumerate(typed) if os.path.basename(w) == "deepspeed")
        words, devices = ["deepspeed", *typed[start + 1:]], runner.environ().get("CUDA_VISIBLE_DEVICES")
    if resume:
        words = [w for w in words if w != "--overwrite"] + ([] if "--resume" in words else ["--resume"])
    return (f"CUDA_VISIBLE_DEVICES={devices} " if devices else "") + shlex.join(words)
