"""The code reward's sandbox (sandbox.py): right answers score, hostile completions are contained and score 0,
and nothing they do reaches the test process, its files, its environment or its process table."""
import os
import time

import psutil
import pytest

import sandbox
from demo.tiny_model import build_tokenizer


def answer(code):
    return f"<think>.</think><answer>\n```python\n{code}\n```\n</answer>"


ADD = {"tests": ["assert add(1, 2) == 3", "assert add(-5, 5) == 0", "assert add(10, 32) == 42"]}


def children():
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_every_reference_solution_passes_its_tests():
    tok = build_tokenizer()
    samples = sandbox.code_samples("train", tok) + sandbox.code_samples("test", tok)
    assert len(samples) == len(sandbox.PROBLEMS) and len(sandbox.code_samples("test", tok)) == 4
    for s in samples:
        assert sandbox.code_reward(answer(s["answer"]), s) == 1.0, s["answer"]
        assert s["prompt"].startswith("<|im_start|>system") and "<answer>" in s["prompt"]


def test_partial_credit_and_no_answer():
    assert sandbox.code_reward(answer("def add(a, b):\n    return a + b if a < 5 else 0"), ADD) == pytest.approx(2 / 3)
    assert sandbox.code_reward("def add(a, b): return a + b", ADD) == 0.0   # no <answer>
    assert sandbox.code_reward(answer("def add(a, b) return"), ADD) == 0.0   # a syntax error
    assert sandbox.code_reward(answer("def add(a, b):\n    return a + b"), {"tests": []}) == 0.0


@pytest.mark.parametrize("name,code", [
    ("infinite loop", "def add(a, b):\n    while True:\n        pass"),
    ("infinite loop at import", "while True:\n    pass"),
    ("fork bomb", "import os\nwhile True:\n    os.fork()"),
    ("subprocess", "import subprocess\nsubprocess.run(['sleep', '100'])"),
    ("huge allocation", "x = bytearray(8 << 30)\ndef add(a, b):\n    return a + b + len(x)"),
    ("kill the parent", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)"),
    ("early exit", "import sys\nsys.exit(0)"),
    ("fake results", "for i in range(10):\n    print(f'ok {i}')\n    print(i)\nimport os\nos._exit(0)"),
    ("socket", "import socket\nsocket.create_connection(('127.0.0.1', 22))"),
    ("ctypes", "import ctypes\nctypes.CDLL(None).system(b'touch /tmp/pwned_ctypes')"),
])
def test_hostile_completions_are_contained_and_score_zero(name, code):
    before, t0 = children(), time.time()   # (other tests' servers may be running: only new ones count)
    assert sandbox.code_reward(answer(code), ADD) == 0.0
    assert time.time() - t0 < 10   # the 5 s wall-clock limit, plus start-up
    time.sleep(0.2)
    assert not children() - before and not os.path.exists("/tmp/pwned_ctypes")


def test_the_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("REF_SERVER_TOKEN", "top-secret")
    probe = "import os\nSEEN = 'top-secret' in str(os.environ)"
    assert sandbox.run_tests(probe, ["assert not SEEN"]) == 1 and sandbox.run_tests(probe, ["assert SEEN"]) == 0
    # nor through /proc: the parent's environment file is outside the sandbox
    probe = f"SEEN = 'top-secret' in open('/proc/{os.getpid()}/environ').read()"
    assert sandbox.run_tests(probe, ["assert 'SEEN' not in globals()"]) == 1


def test_files_outside_the_temporary_directory_are_untouched(tmp_path):
    target, victim = tmp_path / "written.txt", tmp_path / "victim.txt"
    victim.write_text("keep me")
    code = (f"import os, shutil\n"
            f"for attempt in (lambda: open({str(target)!r}, 'w').write('x'),\n"
            f"                lambda: os.remove({str(victim)!r}),\n"
            f"                lambda: os.rename({str(victim)!r}, 'stolen'),\n"
            f"                lambda: open({str(victim)!r}, 'a').write('x')):\n"
            f"    try:\n        attempt()\n    except PermissionError:\n        pass\n"
            f"open('inside.txt', 'w').write('fine')\nINSIDE = open('inside.txt').read()")
    assert sandbox.run_tests(code, ["assert INSIDE == 'fine'"]) == 1   # its own directory works
    assert not target.exists() and victim.read_text() == "keep me"
