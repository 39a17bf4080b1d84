"""The documentation: README.md is read in five minutes (at most 15,000 characters), links every
page of docs/, every relative link lands, and every command in README.md and docs/*.md still runs as written.

The commands are the shell lines of fenced code blocks (no language, or sh/bash/shell/console) and the inline
code spans of two words or more that begin with python, deepspeed, make or pip (a span with "[" is a
synopsis, not a command).
How each is checked, on this CPU machine:
- `python SCRIPT ...`, `python -m MODULE ...` and `deepspeed [launcher flags] SCRIPT ...`: the launcher's
  flags go through DeepSpeed's own launcher parser, the script's through the script's own argparse parser
  (the script runs as __main__ until it calls parse_args, then stops; abbreviations refused), so a
  renamed or removed flag, or a bad value for a typed flag, fails. A `...` stands for flags left out: it
  is dropped, and the parse then does not demand required flags. `--help` runs this way too, to the end.
  Scripts under tools/ run for real (they are cheap); `python -c CODE` is compiled (its imports may need a
  GPU).
- `make TARGET`: `make -n TARGET` (the recipe is printed, not run).
- `pip install -r FILE`: the file exists.
- Every command's tokens that name a repository file (ending .py, .json, .txt, .md, .sh, .toml, .yaml):
  the file exists.
Other commands (export, echo, ds_report, ...) need a GPU machine, the network or a shell: not checked.
docs/pending/ holds other branches' drafts, not pages: it is not read.
"""
import argparse
import contextlib
import io
import json
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import built_once

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 15_000
SHELL_LANGUAGES = {"", "sh", "bash", "shell", "console"}
COMMAND_WORDS = {"python", "python3", "deepspeed", "make", "pip", "pip3"}
# shlex's operators that end a simple command ("(" and ")" come from "$(...)")
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")", "\n"}
REDIRECTS = {">", ">>", "<", "2>", "&>"}
REPO_FILE = re.compile(r"^[\w./-]+\.(py|json|txt|md|sh|toml|yaml|yml)$")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```", re.M | re.S)


def fenced_commands(text):
    """(line number, one shell line: continuations joined) for each line of the shell blocks."""
    for block in FENCE.finditer(text):
        if block.group(1).lower() not in SHELL_LANGUAGES:
            continue
        first = text.count("\n", 0, block.start(2)) + 1
        lines = block.group(2).split("\n")
        i = 0
        while i < len(lines):
            start, line = i, lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i]
            if line.strip():
                yield first + start, line.strip()
            i += 1


def inline_commands(text):
    """(line number, command) for each inline code span outside the fenced blocks that begins with a
    command word; a span broken over two lines is one command."""
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for span in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose):
        command = " ".join(span.group(1).split())
        words = command.split()
        if len(words) > 1 and words[0] in COMMAND_WORDS and "[" not in command:
            yield text.count("\n", 0, span.start()) + 1, command


def simple_commands(line):
    """The simple commands of a shell line, each a list of words without its leading VAR=value
    assignments and redirections; comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, words, tokens = [], [], list(lexer)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in SEPARATORS:
            commands.append(words)
            words = []
        elif token in REDIRECTS:
            i += 1
        elif not (ENV_ASSIGNMENT.match(token) and not words):
            words.append(token)
        i += 1
    commands.append(words)
    return [c for c in commands if c]


def all_commands():
    """(id, words) for every checkable command of README.md and docs/*.md."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for line_no, line in [*fenced_commands(text), *inline_commands(text)]:
            for words in simple_commands(line):
                if words[0] in COMMAND_WORDS:
                    found.append((f"{page.relative_to(ROOT)}:{line_no}:{' '.join(words)[:60]}", words))
    return found


def parse_job(words):
    """The flag check of a python/deepspeed command as a job for the child process, or None when the
    command has no flags to parse there (python -c, tools/, a script without argparse)."""
    partial = "..." in words
    words = [w for w in words if w != "..."]
    if words[0] == "deepspeed":
        return {"launcher": words[1:], "partial": partial}
    args = words[1:]
    if args[:1] == ["-c"]:
        return None
    if args[:1] == ["-m"]:
        module, argv = args[1], args[2:]
        path = ROOT / (module.replace(".", "/") + ".py")
    else:
        path, argv, module = ROOT / args[0], args[1:], None
    if path.parent == ROOT / "tools" or not path.is_file() or "ArgumentParser" not in path.read_text():
        return None
    if module == "demo.run_demo" and "--" in argv:   # the flags after `--` are grpo_train.py's
        return {"script": str(ROOT / "grpo_train.py"), "module": None, "partial": True,
                "argv": ["--model", "m", *argv[argv.index("--") + 1:]], "and": {
                    "script": str(path), "module": module, "argv": argv[:argv.index("--")], "partial": partial}}
    return {"script": str(path), "module": module, "argv": argv, "partial": partial}


class _Parsed(Exception):
    """Raised from parse_args: the flags parsed, stop before the script does any work."""


def _check_flags(job):
    """In the child: -> None if the job's flags parse (and those of the job it names "and"), else what the
    parser said."""
    if "and" in job:
        return _check_flags(job["and"]) or _check_flags({k: v for k, v in job.items() if k != "and"})
    if "launcher" in job:
        from deepspeed.launcher.runner import parse_args as launcher_parse_args
        try:
            launcher = launcher_parse_args(job["launcher"])
        except SystemExit as e:
            return f"the deepspeed launcher refused its flags (exit status {e.code})"
        job = {"script": str(ROOT / launcher.user_script), "module": None, "argv": launcher.user_args,
               "partial": job["partial"]}
        if not os.path.isfile(job["script"]):
            return f"the launcher's script {launcher.user_script} does not exist"
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, args=None, namespace=None):
        # a flag renamed to a longer name must fail, not pass as its abbreviation
        parser.allow_abbrev = False
        if job["partial"]:
            for action in parser._actions:
                action.required = False
        original(parser, args, namespace)
        raise _Parsed()

    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [job["script"], *job["argv"]]
    sys.path[:0] = [os.path.dirname(job["script"]), str(ROOT)]
    argparse.ArgumentParser.parse_args = parse_then_stop
    try:
        if job["module"]:
            runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(job["script"], run_name="__main__")
        return "the script never called ArgumentParser.parse_args"
    except _Parsed:
        return None
    except SystemExit as e:
        return None if e.code in (0, None) else f"exit status {e.code}"
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv, sys.path[:] = saved_argv, saved_path


def child_main(results_path):
    """Parses each job of stdin (a JSON list) in this one process, so the scripts' imports (torch, vLLM,
    DeepSpeed) are paid once; writes a JSON list of [error or null, what the parser printed] to
    results_path (not stdout, where the libraries may print too)."""
    os.chdir(ROOT)
    results = []
    for job in json.load(sys.stdin):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            error = _check_flags(job)
        results.append([error, out.getvalue()[-2000:]])
    Path(results_path).write_text(json.dumps(results))


def run_parse_jobs(jobs, results):
    """Each job's [error or None, output], written to the file `results` as JSON by one child process."""
    child = f"from test_docs import child_main; child_main({str(results)!r})"
    p = subprocess.run([sys.executable, "-c", child],
                       input=json.dumps(jobs), capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})
    assert p.returncode == 0 and results.exists(), p.stdout[-3000:] + p.stderr[-3000:]


COMMANDS = all_commands()
# Two commands no parser may accept: the check must fail them, or it checks nothing.
BROKEN = [["python", "grpo_train.py", "--model", "m", "--no-such-flag"],
          ["deepspeed", "--num_gpus", "1", "grpo_train.py", "--model", "m", "--steps", "many"],
          ["python", "-m", "demo.run_demo", "--steps", "3", "--", "--lora-rnak", "4"]]


@pytest.fixture(scope="module")
def parsed(tmp_path_factory):
    """{job as JSON: [error or None, output]} for every flag check, all run in one child process, once per
    test run (the workers share the answers)."""
    jobs = [job for _, words in COMMANDS if (job := parse_job(words))]
    jobs += [parse_job(words) for words in BROKEN]
    unique = {json.dumps(j, sort_keys=True): j for j in jobs}
    answers = built_once(tmp_path_factory, "parsed.json",
                         lambda path: run_parse_jobs(list(unique.values()), path))
    return dict(zip(unique, json.loads(answers.read_text())))


def test_readme_is_read_in_five_minutes():
    # counted in bytes, as a reader's tools count a file: the few non-ASCII characters count more than once
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md has {size:,} bytes (at most {README_LIMIT:,})"


def test_readme_links_every_docs_page():
    readme = README.read_text()
    assert PAGES[1:], "docs/ has no pages"
    missing = [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in readme]
    assert not missing, f"README.md does not link {missing}"


def github_anchor(heading):
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_land(page):
    """Every relative link of a page names a file that exists and, with #anchor, one of its headings."""
    text = FENCE.sub("", page.read_text())
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            bad.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", FENCE.sub("", path.read_text()), re.M)
            if anchor not in {github_anchor(h) for h in headings}:
                bad.append(f"{target}: no such heading")
    assert not bad, bad


def test_the_commands_are_found():
    """The extraction finds the README's own commands (an empty list would pass every check below)."""
    found = {" ".join(words[:3]) for _, words in COMMANDS}
    assert {"make demo", "make test"} <= found
    assert any(words[0] == "deepspeed" and "grpo_train.py" in words for _, words in COMMANDS)
    assert any(words[:2] == ["python", "ref_server.py"] for _, words in COMMANDS)


def test_a_broken_command_fails_the_check(parsed):
    # each refusal names what it refused: the unknown flag, the bad value
    for words, named in zip(BROKEN, ["--no-such-flag", "'many'", "--lora-rnak"]):
        error, output = parsed[json.dumps(parse_job(words), sort_keys=True)]
        assert error and named in output, (words, error, output)


@pytest.mark.parametrize("words", [w for _, w in COMMANDS], ids=[i for i, _ in COMMANDS])
def test_command_runs_as_written(words, parsed):
    named = [w.split("=")[-1] for w in words]
    missing = [f for f in named if REPO_FILE.match(f) and not (ROOT / f).exists()]
    assert not missing, f"{' '.join(words)}: no such file {missing}"
    if words[0] == "make":
        if shutil.which("make") is None:
            pytest.skip("no make on this machine")
        p = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr
    elif words[0] in ("pip", "pip3"):
        for flag, value in zip(words, words[1:]):
            if flag in ("-r", "--requirement"):
                assert (ROOT / value).is_file(), f"{' '.join(words)}: no {value}"
    elif words[0] in ("python", "python3") and words[1:2] == ["-c"]:
        compile(words[2], "<python -c>", "exec")
    elif words[0] in ("python", "python3") and words[1].startswith("tools/"):
        p = subprocess.run([sys.executable, *words[1:]], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
    elif (job := parse_job(words)) is not None:
        error, output = parsed[json.dumps(job, sort_keys=True)]
        assert error is None, f"{' '.join(words)}: {error}\n{output}"


def test_the_cpu_requirements_name_pytorchs_cpu_index():
    """torch==2.13.0+cpu is only on PyTorch's CPU index: the file names it, so pip -r finds it anywhere."""
    lines = (ROOT / "requirements-cpu.txt").read_text().splitlines()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines and "torch==2.13.0+cpu" in lines


# what a user cannot use: the project's own bookkeeping and places outside the repository
NOT_FOR_USERS = re.compile(r"\b[Ii]ssues? \d+|\.\./shared|main today|main @")
# pages their owners rewrite separately
def test_docs_and_tests_speak_to_users():
    files = list(PAGES) + [ROOT / "bench" / "README.md"]
    files += sorted((ROOT / "tests").glob("*.py"))
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:80]}" for p in files
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if NOT_FOR_USERS.search(line) and p.name != "test_docs.py"]
    assert not found, "\n".join(found)


def test_the_documented_launch_learns_on_the_demo_model():
    """The docstring's launch line uses the demo's learning rate (the default is for real models) and the
    launcher's quiet log level."""
    import grpo_train
    from demo.run_demo import TRAIN_FLAGS
    line = next(l for l in grpo_train.__doc__.splitlines() if l.strip().startswith("deepspeed"))
    words = line.split()
    assert words[1:3] == ["--log_level", "critical"], line
    args = grpo_train.get_args(words[words.index("grpo_train.py") + 1:])
    assert args.lr == float(TRAIN_FLAGS[TRAIN_FLAGS.index("--lr") + 1]) and args.task == "demo"


def outline_blocks(text):
    """The line numbers of the fenced blocks marked as an outline (their first line: `# outline: ...`)."""
    lines = set()
    for block in FENCE.finditer(text):
        if block.group(2).lstrip().startswith("# outline"):
            first = text.count("\n", 0, block.start(2)) + 1
            lines |= set(range(first, first + block.group(2).count("\n") + 1))
    return lines


def test_every_launch_of_the_trainer_runs_as_written_or_is_an_outline():
    """A documented line that starts the trainer either runs as written in a test (tests/test_e2e.py,
    RUN_AS_WRITTEN: from a checkout with `make demo`'s model) or says it is an outline: `...` for the flags
    left out, or a block whose first line is `# outline: ...` (it needs GPUs or the hub)."""
    from test_e2e import RUN_AS_WRITTEN
    run = {(page, start) for page, start in RUN_AS_WRITTEN}
    left = []
    for page in PAGES:
        text, name = page.read_text(), str(page.relative_to(ROOT))
        outlines = outline_blocks(text)
        for line_no, line in [*fenced_commands(text), *inline_commands(text)]:
            for words in simple_commands(line):
                if "grpo_train.py" not in words or words[0] not in COMMAND_WORDS:
                    continue
                if "..." in words or line_no in outlines:
                    continue
                if not any(name == page and " ".join(words).startswith(start) for page, start in run):
                    left.append(f"{name}:{line_no}: {' '.join(words)[:90]}")
    assert not left, "\n".join(left)
    # each line the tests run is in its page, once
    for page, start in RUN_AS_WRITTEN:
        text = (ROOT / page).read_text()
        assert sum(line.startswith(start) for _, line in fenced_commands(text)) == 1, (page, start)


def test_the_eight_gpu_layout_is_one_layout(monkeypatch):
    """README's 8-GPU line, docs/gpu.md's layout table and its launch line, the GPU recipe and
    bench/gpu_check.py's layout all train on GPUs 2-7 with vLLM on GPU 0 and the reference on GPU 1."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from gpu_check import layout
    assert layout(8) == (0, 1, [2, 3, 4, 5, 6, 7])
    gpu = (ROOT / "docs" / "gpu.md").read_text()
    assert "| 8 | GPUs 2-7 | GPU 0 | GPU 1 |" in gpu
    launches = [words for page in (README, ROOT / "docs" / "gpu.md") for _, line in fenced_commands(page.read_text())
                for words in simple_commands(line) if "localhost:2,3,4,5,6,7" in " ".join(words)
                or "localhost:3,4,5,6,7" in " ".join(words)]
    assert len(launches) == 3, launches   # README's, the layouts', the recipe's
    for words in launches:
        flags = dict(zip(words, words[1:]))
        assert flags["--include"] == "localhost:2,3,4,5,6,7" and flags["--gen-device"] == "0", words
        assert flags["--ref-device"] == "1" and "--gen-devices" not in flags, words
    assert "The 8-GPU line below has not run" in README.read_text()


def test_make_gpu_check_runs_the_active_python(tmp_path):
    """`make gpu-check` runs in the python of the shell that runs make (a GPU machine's environment): the
    Makefile puts .venv/bin, whose torch is the CPU tests', first on PATH, and its gpu-check ran that one
    ("no GPU here" on a GPU machine once `make test` or `make demo` had made .venv)."""
    active = tmp_path / "bin"
    active.mkdir()
    (active / "python3").symlink_to(sys.executable)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env["PATH"] = f"{active}:{env['PATH']}"
    for target, flags in (("gpu-check-quick", " --quick"), ("gpu-check", "")):
        p = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
        command = f"env -u TORCH_EXTENSIONS_DIR {active}/python3 bench/gpu_check.py{flags}"
        assert p.stdout.splitlines()[-1] == command, p.stdout


def test_make_gpu_check_on_a_machine_without_a_gpu_is_one_line():
    """`make gpu-check` (README) and `make gpu-check-quick` (docs/gpu.md) on a CPU machine: one line saying
    there is no GPU and what to run instead, at once, and a non-zero status (gpu-check-quick ran the
    shell's python, whose missing torch was a traceback); bench/gpu_check.py run straight says the same in
    one line, and in a python without torch says that."""
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has a GPU")
    # a user's shell: not inside another make (`make test`), whose variables would make this one speak
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    for target in ("gpu-check", "gpu-check-quick"):
        p = subprocess.run(["make", target], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
        said = [line for line in p.stderr.splitlines() if not line.startswith("make: ***")]
        assert p.returncode != 0 and p.stdout == "" and len(said) == 1, p.stdout + p.stderr
        assert said[0].startswith(f"make {target}: no GPU here") and "make test" in said[0]
    without_torch = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['bench/gpu_check.py']; "
                     "runpy.run_path('bench/gpu_check.py', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", without_torch], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT / "bench")})
    assert p.returncode == 1 and p.stderr == (f"gpu_check: this python ({sys.executable}) has no torch: install "
                                              "the GPU requirements into it (pip install -r requirements.txt), "
                                              "or activate the environment that has them\n"), p.stderr
    p = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1 and p.stderr.startswith("gpu_check: no GPU here") and p.stderr.count("\n") == 1
    assert "--tiny" in p.stderr
