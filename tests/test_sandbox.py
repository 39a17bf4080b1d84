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


def test_split_test():
    assert sandbox.split_test("assert f(1, 'a') == (3, [None])") == ("f(1, 'a')", False, [3, [None]])
    assert sandbox.split_test("assert is_even(4)") == ("is_even(4)", True, True)
    assert sandbox.split_test("assert not is_even(7)") == ("is_even(7)", True, False)
    with pytest.raises(ValueError):
        sandbox.split_test("x = add(1, 2)")


def test_partial_credit_and_no_answer():
    assert sandbox.code_reward(answer("def add(a, b):\n    return a + b if a < 5 else 0"), ADD) == pytest.approx(2 / 3)
    assert sandbox.code_reward("<answer>def add(a, b):\n    return a * b + 1</answer>", ADD) == pytest.approx(1 / 3)
    assert sandbox.code_reward("def add(a, b): return a + b", ADD) == 0.0   # no <answer>
    assert sandbox.code_reward(answer("def add(a, b) return"), ADD) == 0.0   # a syntax error
    assert sandbox.code_reward(answer("def add(a, b):\n    return a + b"), {"tests": []}) == 0.0
    assert sandbox.code_reward(answer("def add(a, b):\n    return a + b"), {"tests": "assert add(1, 2) == 3"}) == 0.0


def test_ordinary_code_is_not_blocked():
    code = ("import collections, functools, math, re\nP = collections.namedtuple('P', 'x y')\n"
            "@functools.lru_cache(None)\ndef add(a, b):\n    print('debug', a, b)\n"
            "    return P(a, b).x + math.floor(b) + len(re.findall('z', ''))")
    assert sandbox.code_reward(answer(code), ADD) == 1.0


@pytest.mark.parametrize("name,code", [
    ("infinite loop", "def add(a, b):\n    while True:\n        pass"),
    ("infinite loop at import", "while True:\n    pass"),
    ("fork bomb", "import os\nwhile True:\n    os.fork()"),
    ("subprocess", "import subprocess\nsubprocess.run(['sh', '-c', 'touch MARKER; sleep 100'])"),
    ("_posixsubprocess", "import _posixsubprocess, os\nr, w = os.pipe()\n"   # (CPython 3.11's signature)
                         "_posixsubprocess.fork_exec([b'/bin/sh', b'-c', b'touch MARKER; sleep 100'], [b'/bin/sh'], "
                         "True, (w,), None, None, -1, -1, -1, -1, -1, -1, r, w, True, True, -1, None, None, -1, -1, "
                         "None, True)"),
    ("sub-interpreter", "import _xxsubinterpreters as s\n"
                        "s.run_string(s.create(), \"import os; os.system('touch MARKER')\")"),
    ("ctypes", "import ctypes\nctypes.CDLL(None).system(b'touch MARKER')"),
    ("huge allocation", "x = bytearray(8 << 30)\ndef add(a, b):\n    return a + b + len(x)"),
    ("kill the parent", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)"),
    ("kill the parent through a pidfd", "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), 9)"),
    ("early exit", "import sys\nsys.exit(0)"),
    ("fake results", "for i in range(10):\n    print(f'ok {i}')\n    print(i)\nimport os\nos._exit(0)"),
    ("socket", "import socket\nsocket.create_connection(('127.0.0.1', 22))"),
    ("always equal", "class Yes:\n    __eq__ = __bool__ = lambda *a: True\ndef add(a, b):\n    return Yes()"),
    ("patched builtins", "import builtins, json\nbuiltins.exec = builtins.eval = json.dumps = lambda *a, **k: 'true'"),
])
def test_hostile_completions_are_contained_and_score_zero(name, code, tmp_path):
    marker = tmp_path / "pwned"
    before, t0 = children(), time.time()   # (other tests' servers may be running: only new ones count)
    assert sandbox.code_reward(answer(code.replace("MARKER", str(marker))), ADD) == 0.0
    assert time.time() - t0 < 10   # the 5 s wall-clock limit, plus start-up
    time.sleep(0.2)
    assert not children() - before and not marker.exists()


@pytest.mark.parametrize("code,limit", [
    ("import time\nwhile True:\n    time.sleep(1)", 3),   # no CPU used: only the wall clock (1 s here) stops it
    ("while True:\n    print('x' * 10000)", 0.9),           # stopped at 1 MiB of output, long before the timeout
])
def test_sleeping_and_flooding_completions_are_cut_short(code, limit):
    before, t0 = children(), time.time()
    assert sandbox.run_tests(code, ADD["tests"], timeout_s=1) == 0
    assert time.time() - t0 < limit and not children() - before


def test_forged_results_need_the_right_values():
    # in-process code can find the nonce (here in the harness's frame) and write result lines itself; they count
    # only if they hold the right values, which the child never sees, and not at all next to the harness's own
    forge = ("import os, sys\ndef add(a, b):\n    nonce = sys._getframe(2).f_locals['nonce']\n"
             "    for i, v in enumerate(VALUES):\n        os.write(1, f'\\n{nonce} {i} {v}\\n'.encode())\n    END")
    assert sandbox.run_tests(forge.replace("VALUES", "[3, 0, 42]").replace("END", "os._exit(0)"), ADD["tests"]) == 3
    assert sandbox.run_tests(forge.replace("VALUES", "['true'] * 3").replace("END", "os._exit(0)"), ADD["tests"]) == 0
    assert sandbox.run_tests(forge.replace("VALUES", "[3, 0, 42]").replace("END", "return a + b"), ADD["tests"]) == 0


def test_the_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("REF_SERVER_TOKEN", "top-secret")
    probe = "import os\nSEEN = 'top-secret' in str(os.environ)"
    assert sandbox.run_tests(probe, ["assert not SEEN"]) == 1 and sandbox.run_tests(probe, ["assert SEEN"]) == 0
    # nor through /proc: the parent's environment file is outside the sandbox
    probe = f"SEEN = 'top-secret' in open('/proc/{os.getpid()}/environ').read()"
    assert sandbox.run_tests(probe, ["assert 'SEEN' not in globals()"]) == 1


@pytest.mark.parametrize("attempt", [
    "open('../args.json')",                                 # what the harness was sent: the nonce, the expressions
    "os.listdir('/')",
    "os.open(sys.prefix, os.O_RDONLY)",                  # a standard-library folder: its fd, as dir_fd=, would escape
    "os.open(os.path.join(sys.prefix, 'no-such-file'), os.O_RDONLY | os.O_TRUNC)",   # O_TRUNC truncates, read or not
    "open(S('/etc/hostname'))",               # S: a str whose methods show realpath() a path inside the sandbox
    "os.symlink('/', 'root')",
    "os.mknod('null', stat.S_IFCHR | 0o666, os.makedev(1, 3)) or open('null', 'w')",   # a device in its directory
    "resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE)",
    "resource.setrlimit(resource.RLIMIT_CPU, (100, 100))",                   # root could raise its own limits
])
def test_the_audit_hook_refuses(attempt):
    probe = (f"import os, resource, stat, sys\n"
             f"S = type('S', (str,), {{'startswith': lambda *a: False, 'partition': lambda *a: ('x', '', '')}})\n"
             f"try:\n    {attempt}\n    R = 'allowed'\nexcept Exception as e:\n    R = type(e).__name__")
    assert sandbox.run_tests(probe, ["assert R == 'PermissionError'"]) == 1


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
