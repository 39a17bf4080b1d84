"""What a run removes from its --out-dir: a checkpoint (pruned, or saved over), with --overwrite the old
run's checkpoints, and the rows of its JSON-lines files (metrics.jsonl, the completions) past the step it
resumes from (an evaluation of a step up to it stays). checkpoints.py prunes with it; metrics.py does the
rest at the run's first row, so that a run that stops at start-up removes nothing; and whether a run
evaluates the weights it starts from. A leaf module: it imports none of the project's."""
import json
import os
import re
import shutil


def remove(path):
    """A checkpoint's folder or file, gone; a symlink in its place is removed, never followed."""
    if os.path.islink(path) or not os.path.isdir(path):
        os.remove(path)
    else:
        shutil.rmtree(path)


def clear_run(out_dir):
    """--overwrite: the checkpoints (step_N, and step_N.tmp of a save cut short) and `latest` of the run
    out_dir held."""
    for name in os.listdir(out_dir):
        if name == "latest" or re.fullmatch(r"step_\d+(\.tmp)?", name):
            remove(os.path.join(out_dir, name))


def json_rows(path):
    """(line, row) of each line of a JSON-lines file that is a JSON object; a line that is not JSON (the torn
    last line of a killed run), or JSON but no object, is passed over."""
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                yield line, row


def keep_rows(path, key, last_step, carry_evals=False):
    """A run's JSON-lines file cut to its rows whose `key` is at most last_step (none for a new run, at
    last_step 0), replaced by a rename, so a kill meanwhile leaves the old file -> (rows kept, carried). A
    line that is not JSON (the torn last line of a killed run), or no row with a step, is dropped.
    carry_evals (metrics.jsonl): an evaluation of a step up to last_step that arrived on a later row stays
    (carried), as a line of its own at last_step (its eval/* keys and time), as eval_completions.jsonl keeps
    its outputs. No file: nothing is written."""
    if not os.path.exists(path):
        return [], []
    kept, carried = [], []
    # a new run keeps no row: its old file is not read
    for line, row in json_rows(path) if last_step else ():
        if not isinstance(row.get(key), int):
            continue
        if row[key] <= last_step:
            kept.append((line, row))
        # an evaluation arrives a step or two after the step it scores: a resume from that step kept its
        # outputs and its checkpoint, but dropped the row it rode on
        elif carry_evals and isinstance(row.get("eval/step"), int) and row["eval/step"] <= last_step:
            evals = {k: v for k, v in row.items() if k.startswith("eval/") or k == "time/elapsed_s"}
            carried.append((json.dumps({"step": last_step, **evals}) + "\n", {"step": last_step, **evals}))
    with open(path + ".tmp", "w") as f:
        f.writelines(line for line, _ in kept + carried)
    os.replace(path + ".tmp", path)
    return [row for _, row in kept], [row for _, row in carried]


def evaluates_first(out_dir, step, eval_every):
    """Whether a run that starts from checkpoint `step` (0: none) evaluates those weights first: a new run
    does; a resumed one where --eval-every names the step and metrics.jsonl holds no evaluation of it (on
    any row: the run that saved it was killed or stopped before the evaluation arrived). The same weights
    give the same evaluation, which the resumed run's metrics then hold, as an uninterrupted run's do."""
    if not step:
        return True
    path = os.path.join(out_dir, "metrics.jsonl")
    held = os.path.exists(path) and any(row.get("eval/step") == step for _, row in json_rows(path))
    return bool(eval_every) and step % eval_every == 0 and not held
