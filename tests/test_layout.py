"""The shape of the code: grpo_train.py within its figures (tools/script_figures.py), helper
modules imported by the trainer alone, and ref_server.py a file that runs on its own."""
import os
import subprocess
import sys

from test_imports import import_graph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPERS = {"generation", "run_setup", "metrics", "checkpoints"}


def figures(path):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "script_figures.py"), str(path)],
                          capture_output=True, text=True, timeout=60)


def test_grpo_train_keeps_its_figures():
    p = figures(os.path.join(ROOT, "grpo_train.py"))
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_figures_script_runs_from_any_folder(tmp_path):
    """Given no file, it measures this repository's grpo_train.py wherever it is started; a file that is not
    there is one line naming it."""
    script = os.path.join(ROOT, "tools", "script_figures.py")
    p = subprocess.run([sys.executable, script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("lines ") and "(at most 300)" in p.stdout, p.stderr
    p = subprocess.run([sys.executable, script, "nothing.py"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1 and p.stderr == "script_figures.py: nothing.py: no such file\n", p.stderr


def test_the_figures_script_catches_each_breach(tmp_path):
    wide = tmp_path / "wide.py"
    wide.write_text("x = 1\n" + "y = '" + "a" * 100 + "'\n")
    trailing = tmp_path / "trailing.py"
    trailing.write_text("x = torch.ones(2)   # (B, T)\ny = 2   # why, at the end of a line\n")
    long = tmp_path / "long.py"
    long.write_text("x = 1\n" * 301)
    for path, breach in [(wide, "widest line"), (trailing, "end-of-line comments"), (long, "lines")]:
        p = figures(path)
        assert p.returncode != 0 and breach in p.stderr, (path, p.stdout, p.stderr)


def test_helpers_are_imported_by_the_trainer_alone():
    graph = import_graph(ROOT)
    for module, imports in graph.items():
        assert not (imports & HELPERS) or module == "grpo_train", (module, imports & HELPERS)
    assert HELPERS <= graph["grpo_train"]


def test_ref_server_runs_on_its_own(tmp_path):
    """One file copied to the reference machine: it imports no project module, and starts alone."""
    assert import_graph(ROOT)["ref_server"] == set()
    with open(os.path.join(ROOT, "ref_server.py")) as f:
        (tmp_path / "ref_server.py").write_text(f.read())
    p = subprocess.run([sys.executable, "ref_server.py", "--help"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": ""})
    assert p.returncode == 0 and "--model" in p.stdout, p.stderr[-2000:]


def test_ref_server_is_read_in_one_sitting():
    """ref_server.py is the file a user edits to serve another reference: at most 450 lines, none over 100
    columns."""
    with open(os.path.join(ROOT, "ref_server.py")) as f:
        lines = f.read().splitlines()
    wide = [i for i, line in enumerate(lines, 1) if len(line) > 100]
    assert not wide, f"ref_server.py lines over 100 columns: {wide}"
    assert len(lines) <= 450, f"ref_server.py has {len(lines)} lines"
