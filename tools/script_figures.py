"""The figures grpo_train.py promises its reader (README, "How to read grpo_train.py"): at most 300 lines,
20,000 characters and 100 columns, and comments on their own line above the block they explain (the one
kind at the end of a line is a tensor's shape, as in `# (B, T)`).

    python tools/script_figures.py [FILE]    (FILE: this repository's grpo_train.py unless given)
"""
import argparse
import io
import os
import re
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = {"lines": 300, "characters": 20000, "widest line": 100}
SHAPE = re.compile(r"# \([\w ,+*]*\)$")


def figures(path):
    """-> {"lines", "characters", "widest line", "characters per non-blank line", "end-of-line comments"};
    the last lists (line number, comment) of every comment after code that is not a shape."""
    with open(path) as f:
        text = f.read()
    lines = text.splitlines()
    trailing = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0]
            if lines[row - 1][:tok.start[1]].strip() and not SHAPE.search(tok.string):
                trailing.append((row, tok.string))
    filled = [line for line in lines if line.strip()]
    return {"lines": len(lines), "characters": len(text), "widest line": max(map(len, lines)),
            "characters per non-blank line": round(sum(map(len, filled)) / len(filled), 1),
            "end-of-line comments": trailing}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", nargs="?", default=os.path.join(ROOT, "grpo_train.py"),
                   help="the file to measure (this repository's grpo_train.py)")
    path = p.parse_args(argv).file
    if not os.path.isfile(path):
        raise SystemExit(f"script_figures.py: {path}: no such file")
    got = figures(path)
    for key, value in got.items():
        limit = LIMITS.get(key)
        print(f"{key:32s} {value}" + (f" (at most {limit})" if limit else ""))
    bad = [k for k, limit in LIMITS.items() if got[k] > limit] + (["end-of-line comments"] if got[
        "end-of-line comments"] else [])
    if bad:
        raise SystemExit(f"{path}: over the promise: {', '.join(bad)}")


if __name__ == "__main__":
    main()
