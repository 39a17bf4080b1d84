"""What a run removes from its --out-dir: a checkpoint (pruned, or saved over), with --overwrite the old
run's checkpoints, and the rows of its JSON-lines files (metrics.jsonl, the completions) past the step it
resumes from. checkpoints.py prunes with it; metrics.py does the rest at the run's first row, so that a run
that stops at start-up removes nothing. A leaf module: it imports none of the project's."""
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


def keep_rows(path, key, last_step):
    """A run's JSON-lines file cut to its rows whose `key` is at most last_step (none for a new run, at
    last_step 0), replaced by a rename, so a kill meanwhile leaves the old file -> the rows kept. A line that
    is not JSON (the torn last line of a killed run), or no row with a step, is dropped. No file: nothing is
    written."""
    if not os.path.exists(path):
        return []
    kept = []
    # a new run keeps no row: its old file is not read
    with open(path if last_step else os.devnull) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get(key), int) and row[key] <= last_step:
                kept.append((line, row))
    with open(path + ".tmp", "w") as f:
        f.writelines(line for line, _ in kept)
    os.replace(path + ".tmp", path)
    return [row for _, row in kept]
