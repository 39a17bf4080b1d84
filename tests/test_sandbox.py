"""The code reward's jail (sandbox.py, real bubblewrap): right answers score, every known escape scores
0 and leaves no file and no process behind, and nothing of the project, the trainer's environment or the
machine's files is readable inside. Read-only escapes are also run unjailed (GRPO_UNJAILED=1), where they must
work: that proves each one is a real attack the jail stops, not code that fails for some other reason."""
import contextlib
import math
import os
import platform
import pwd
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc

import psutil
import pytest

import rewards
import sandbox
import tasks
from conftest import running
from demo.tiny_model import build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADD = {"tests": ["assert add(1, 2) == 3", "assert add(-5, 5) == 0", "assert add(10, 32) == 42"]}
CORRECT_ADD = "def add(a, b):\n    return a + b"


@pytest.fixture(autouse=True)
def jailed(monkeypatch):
    monkeypatch.delenv(sandbox.UNJAILED, raising=False)   # however the tests were started


def answer(code):
    return f"<think>.</think><answer>\n```python\n{code}\n```\n</answer>"


def descendants():
    return {p.pid for p in psutil.Process().children(recursive=True)}


def lingering(before, marker=None):
    """Processes the completion left: new descendants of this process, or any process on the machine whose
    command line names `marker` (a daemon reparented away from us), if given. Waits up to 10 s for them to go:
    the jail's processes die with bwrap, asynchronously (on a machine busy with other tests, not at once)."""
    deadline = time.monotonic() + 10
    while True:
        left = descendants() - before
        for p in psutil.process_iter(["cmdline"]) if marker else ():
            if marker in " ".join(p.info["cmdline"] or []):
                left.add(p.pid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def test_every_reference_solution_passes_its_tests():
    tok = build_tokenizer()
    samples = tasks.load_task("code", "train", tokenizer=tok) + tasks.load_task("code", "test", tokenizer=tok)
    assert len(samples) == len(tasks.PROBLEMS) and len(tasks.load_task("code", "test", tokenizer=tok)) == 4
    for s in samples:
        assert rewards.code_reward(answer(s["answer"]), s) == 1.0, s["answer"]
        assert s["prompt"].startswith("<|im_start|>system") and "<answer>" in s["prompt"]


def test_split_test_sends_only_the_calls_into_the_completion():
    """The jail gets the parts of a test that name or call the completion's code; the comparisons, the
    arithmetic, and/or/not, `in`, the expected values and the trusted builtins stay with the trainer."""
    parts = lambda test: sandbox.split_test(test)[1]
    assert parts("assert f(1, 'a') == (3, [None])") == ["f(1, 'a')"]
    assert parts("assert abs(area(r=2) - 12.566) < 1e-3") == ["area(r=2)"]
    assert parts("assert is_even(4) and not is_even(7)") == ["is_even(4)", "is_even(7)"]
    assert parts("assert 3 in divisors(6) or X") == ["divisors(6)", "X"]
    assert parts("assert math.isclose(area(1), 3.14159, rel_tol=1e-4)") == ["area(1)"]
    assert parts("assert sorted(set(f([3, 1])))[0]==1") == ["f([3, 1])"]
    assert parts("assert Solution().f(g(2)) == 3") == ["Solution().f(g(2))"]
    for bad in ("x = add(1, 2)", "assert all(f(x) == 1 for x in [1, 2])", "assert f(1) == [*g()]"):
        with pytest.raises(ValueError):
            sandbox.split_test(bad)


# every form of test the tasks ship: the code task's (== and bare truth), MBPP's (no spaces, math.isclose),
# a float tolerance, and/or, not, in, keyword arguments, subscripts
FORMS = ["assert area(2) > 12 and area(r=2) < 13", "assert abs(area(2) - 12.566) < 1e-3",
         "assert math.isclose(area(1), 3.14159, rel_tol=1e-4)", "assert is_even(4) and not is_even(7)",
         "assert not is_even(3) or is_even(5)", "assert 3 in divisors(6)", "assert 5 not in divisors(6)",
         "assert divisors(n=6)==[1, 2, 3, 6]", "assert divisors(12)[-1] == 12 == max(divisors(12))",
         "assert sorted(set(divisors(4)), reverse=True) == [4, 2, 1]", "assert is_even(0)"]
FORMS_RIGHT = ("import math\ndef area(r):\n    return math.pi * r * r\n"
               "def is_even(n):\n    return n % 2 == 0\n"
               "def divisors(n):\n    return [d for d in range(1, n + 1) if n % d == 0]")


def test_every_form_of_test_is_judged_by_the_trainer():
    assert sandbox.run_tests(FORMS_RIGHT, FORMS) == len(FORMS)
    # each wrong solution fails exactly the tests that its values fail
    wrong_area = FORMS_RIGHT.replace("math.pi * r * r", "3.14 * r * r")
    assert sandbox.run_tests(wrong_area, FORMS[:3]) == 1   # 12.56: inside 12..13 only
    odd = FORMS_RIGHT.replace("n % 2 == 0", "n % 2 == 1")
    assert sandbox.run_tests(odd, FORMS[3:5]) == 1   # not is_even(3) is False, is_even(5) True
    no_last = FORMS_RIGHT.replace("range(1, n + 1)", "range(1, n)")
    assert sandbox.run_tests(no_last, FORMS[5:10]) == 2   # 3 in, 5 not in: the others miss n


# a completion that solves nothing and forges every value as true: it finds the nonce in the prologue's
# frame and writes the result lines itself, then leaves before the prologue's own; or it replaces the
# prologue's reporting helper (whatever it is called) so that every value reported is true
FORGE_TRUE = """
import os, sys
_caller = sys._getframe(1).f_locals
_true = 'true' if '_plain' in vars(sys.modules['__main__']) else 'True'
for _i in range(len(_caller['exprs'])):
    os.write(1, f"\\n{_caller['nonce']} {_i} {_true}\\n".encode())
os._exit(0)
"""
REPLACE_REPORTER = """
import sys
_main_module = sys.modules['__main__']
_main_module._plain = lambda value: True
_main_module._literal = lambda value: 'True'
def area(r):
    return 0
def is_even(n):
    return 0
def divisors(n):
    return []
"""


@pytest.mark.parametrize("cheat", [FORGE_TRUE, REPLACE_REPORTER])
def test_forging_or_patching_the_report_scores_zero(cheat):
    """Where the jail judged `assert E` itself and the trainer took its word for the truth, both cheats
    scored 3 of 3 on tests they do not solve. Now the jail reports only the values of the calls."""
    tests = ["assert abs(area(2) - 12.566) < 1e-3", "assert is_even(4) and not is_even(7)",
             "assert 3 in divisors(6)"]
    assert sandbox.run_tests(cheat, tests) == 0
    assert sandbox.run_tests(FORMS_RIGHT, tests) == 3


def test_the_trainer_refuses_to_build_huge_results():
    """The trainer's own arithmetic on the jail's values is bounded: a string repeated, a power, a shift
    past the output cap, sum() of lists (quadratic) and formatting with the completion's string fail the
    test instead of taking the trainer's memory or time; the same operations within bounds pass."""
    code = ("def s():\n    return 'x' * 100\ndef n():\n    return 10 ** 9\n"
            "def lists():\n    return [[0]] * 2000")
    tests = ["assert s() * n() != ''", "assert 3 ** n() > 0", "assert 1 << n() > 0",
             "assert sum(lists(), []) != []", "assert s() % () != ''"]
    assert sandbox.run_tests(code, tests) == 0
    within = ["assert s() * 3 == 'x' * 300", "assert sum([n(), 1]) == 10 ** 9 + 1"]
    assert sandbox.run_tests(code, within) == 2


def test_a_value_too_big_to_judge_fails_that_test_alone():
    """A completion returning range(10 ** 20), more items than len() counts, made the code reward raise
    (OverflowError) and the whole completion count as an error. That test fails now, the others pass."""
    code = "def add(a, b):\n    return range(10 ** 20) if a == 10 else a + b"
    assert rewards.code_reward(answer(code), ADD) == pytest.approx(2 / 3)


COLLIDE = 2 ** 61 - 1   # hash(k * COLLIDE) == 0 for every integer k: a set of them is quadratic to build


def bounded(read, text):
    """read(text) must refuse (ValueError): -> (CPU seconds, peak bytes allocated) it took to do so."""
    tracemalloc.start()
    cpu = time.process_time()
    try:
        with pytest.raises(ValueError):
            read(text)
        return time.process_time() - cpu, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_jails_values_are_read_within_bounds():
    """The trainer read each value with ast.literal_eval: a 1 MiB line of a set of colliding hashes took
    8.9 s of its CPU, a list of empty lists +484 MiB of its memory. Now the value is counted before it is
    parsed and sets and dicts of colliding keys are refused: both fail fast, in little memory, and a
    million empty lists, more than the jail may write, at once."""
    collide = '["set",' + ",".join(str(k * COLLIDE) for k in range((1 << 20) // 26)) + "]"
    empties = '["list",' + ",".join(['["list"]'] * ((1 << 20) // 9 - 1)) + "]"
    assert len(collide) < 1 << 20 and len(empties) < 1 << 20
    million = '["list",' + ",".join(['["list"]'] * 10 ** 6) + "]"   # more than the jail may write
    for text in (collide, empties, million):
        cpu, peak = bounded(lambda t: sandbox.read_value(t, [sandbox.MAX_NODES]), text)
        assert cpu < 1 and peak < 16 << 20, (cpu, peak)
    # deep nests, JSON objects, untagged or unknown containers, too many digits: refused
    for bad in ('["list",' * 70 + "1" + "]" * 70, '{"a": 1}', '["list",{"a": 1}]', "[1, 2]",
                '["range", 3]', "9" * 5000, "[1"):
        with pytest.raises((ValueError, RecursionError)):
            sandbox.read_value(bad, [100])
    # what honest code returns still reads back, with its types
    text = ('["dict","k",["tuple",1,2.5,null,true],'
            '["frozenset",1],["list",["bytes","ff"],["complex",0.0,2.0]]]')
    assert sandbox.read_value(text, [100]) == {"k": (1, 2.5, None, True), frozenset({1}): [b"\xff", 2j]}


def test_a_forged_line_of_colliding_hashes_costs_the_trainer_little():
    """The same attack through the jail: a completion finds the nonce and writes a 1 MiB value (in the
    prologue's format, whichever it is) for its test, then leaves; the trainer refuses it quickly."""
    code = f"""
import os, sys
_caller = sys._getframe(1).f_locals
_items = [str(k * {COLLIDE}) for k in range({(1 << 20) // 26})]
_json = '_plain' in vars(sys.modules['__main__'])
_value = '["set",' + ','.join(_items) + ']' if _json else '{{' + ', '.join(_items) + '}}'
os.write(1, f"\\n{{_caller['nonce']}} 0 {{_value}}\\n".encode())
os._exit(0)
"""
    cpu = time.process_time()
    assert sandbox.run_tests(code, ["assert f() != {0}"], timeout_s=30) == 0
    assert time.process_time() - cpu < 2


def test_partial_credit_and_no_answer():
    partial = "def add(a, b):\n    return a + b if a < 5 else 0"
    assert rewards.code_reward(answer(partial), ADD) == pytest.approx(2 / 3)
    wrong = "<answer>def add(a, b):\n    return a * b + 1</answer>"
    assert rewards.code_reward(wrong, ADD) == pytest.approx(1 / 3)
    assert rewards.code_reward("def add(a, b): return a + b", ADD) == 0.0   # no <answer>
    assert rewards.code_reward(answer("def add(a, b) return"), ADD) == 0.0   # a syntax error
    assert rewards.code_reward(answer(CORRECT_ADD), {"tests": []}) == 0.0
    assert rewards.code_reward(answer(CORRECT_ADD), {"tests": "assert add(1, 2) == 3"}) == 0.0


def test_ordinary_code_is_not_blocked():
    code = ("import collections, functools, math, re, tempfile, threading\n"
            "P = collections.namedtuple('P', 'x y')\n"
            "box = []\nt = threading.Thread(target=box.append, args=(0,))\nt.start()\nt.join()\n"
            "with tempfile.TemporaryFile() as f:\n    f.write(b'scratch')\n"
            "@functools.lru_cache(None)\ndef add(a, b):\n    print('debug', a, b)\n"
            "    return P(a, b).x + math.floor(b) + len(re.findall('z', '')) + box[0]")
    assert rewards.code_reward(answer(code), ADD) == 1.0


# --------------------------------------------------------- escapes that read: they work unjailed, not jailed

PATCH_REALPATH = "import posixpath\nposixpath.realpath = lambda p, *a, **k: '/tmp/sandbox/' + str(p)\n"
# a cheat: no implementation at all; it finds the project (the parent's working folder, or where
# a copy of this repository lives) and runs the reference solutions of tasks.py (sandbox.py held them before),
# those of the first folder that has them (parsing every process's folder could outlast the time limit)
UNIVERSAL_CHEAT = PATCH_REALPATH + f"""
import ast, glob, os
def _solutions():
    for folder in [f'/proc/{{os.getppid()}}/cwd', *glob.glob('/proc/*/cwd'), {ROOT!r}, '..', '../..']:
        found = []
        for name in ('tasks.py', 'sandbox.py'):
            try:
                tree = ast.parse(open(os.path.join(folder, name)).read())
            except (OSError, SyntaxError, ValueError):
                continue
            for node in tree.body:
                if isinstance(node, ast.Assign) and getattr(node.targets[0], 'id', '') == 'PROBLEMS':
                    found += [p[2] for p in ast.literal_eval(node.value)]
        if found:
            return found
    return []
for _s in _solutions():
    exec(_s, globals())
"""
# every token it finds: other runs on the machine (tests run side by side) hold tokens of their own
ENVIRON_PROBE = PATCH_REALPATH + """
import glob, os
ESCAPED = []
for path in [f'/proc/{os.getppid()}/environ', *glob.glob('/proc/*/environ')]:
    try:
        for var in open(path, 'rb').read().split(b'\\0'):
            if var.startswith(b'REF_SERVER_TOKEN='):
                ESCAPED.append(var.split(b'=', 1)[1].decode())
    except OSError:
        pass
"""
DIR_FD_READ = """
import os
fd = os.open('.', os.O_RDONLY)
os.makedirs('a/b/c/d/e/f', exist_ok=True)
os.chdir('a/b/c/d/e/f')
ESCAPED = os.read(os.open('../' * 40 + 'etc/passwd', os.O_RDONLY, dir_fd=fd), 1 << 20).decode()
"""


def test_the_universal_cheat_scores_zero():
    tok = build_tokenizer()
    samples = tasks.load_task("code", "train", tokenizer=tok) + tasks.load_task("code", "test", tokenizer=tok)
    assert [rewards.code_reward(answer(UNIVERSAL_CHEAT), s) for s in samples] == [0.0] * len(samples)


def test_the_universal_cheat_works_unjailed(monkeypatch):
    """The cheat is real: without the jail it scores 1.0 on every problem with no implementation at all."""
    monkeypatch.setenv(sandbox.UNJAILED, "1")
    tok = build_tokenizer()
    samples = tasks.load_task("code", "train", tokenizer=tok) + tasks.load_task("code", "test", tokenizer=tok)
    assert [rewards.code_reward(answer(UNIVERSAL_CHEAT), s) for s in samples] == [1.0] * len(samples)


@pytest.fixture
def trainer_with_a_token():
    """A process of the machine whose environment holds a secret, as the trainer's holds REF_SERVER_TOKEN."""
    token = secrets.token_hex(16)
    proc = subprocess.Popen(["sleep", "60"], env={"REF_SERVER_TOKEN": token})
    yield token
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("unjailed", [False, True])
def test_reading_outside_the_jail_fails(monkeypatch, trainer_with_a_token, unjailed):
    """Each probe puts what it read in ESCAPED (the environ probe, every token it found); the test holds the
    real value (it never enters the jail), so a probe scores 1 exactly when it read it. Unjailed they all do;
    jailed none does."""
    if unjailed:
        monkeypatch.setenv(sandbox.UNJAILED, "1")
    # in this process's os.environ too: the child gets none of it
    monkeypatch.setenv("REF_SERVER_TOKEN", trainer_with_a_token)
    passwd, project_file = open("/etc/passwd").read(), os.path.join(ROOT, "tasks.py")
    read = lambda want: f"assert ESCAPED == {want!r}"
    probes = {"/etc/passwd through a patched realpath":
              (PATCH_REALPATH + "ESCAPED = open('/etc/passwd').read()", read(passwd)),
              "/proc/<ppid>/environ and every other process's":
              (ENVIRON_PROBE, f"assert {trainer_with_a_token!r} in ESCAPED"),
              "dir_fd traversal": (DIR_FD_READ, read(passwd)),
              "the project's own files":
              (f"ESCAPED = open({project_file!r}).read()", read(open(project_file).read())),
              "the environment":
              ("import os\nESCAPED = os.environ.get('REF_SERVER_TOKEN')", read(trainer_with_a_token))}
    scores = {name: sandbox.run_tests(code, [test]) for name, (code, test) in probes.items()}
    # unjailed, the child's environment is still empty: only the four probes of the file system succeed
    assert scores == {name: int(unjailed and name != "the environment") for name in probes}


# ------------------------------------------------ escapes that write or spawn: jailed only, checked by events

WRITE_OUTSIDE = """
import os, shutil
up = '../' * 40 + TARGET.lstrip('/')
for attempt in (lambda: open(TARGET, 'w').write('x'), lambda: os.remove(VICTIM),
                lambda: os.rename(VICTIM, 'stolen'), lambda: open(VICTIM, 'a').write('x'),
                lambda: shutil.copy('/proc/self/cmdline', TARGET),
                lambda: os.open(up, os.O_WRONLY | os.O_CREAT, dir_fd=os.open('.', os.O_RDONLY)),
                lambda: open(os.__file__, 'a').write('x')):
    try:
        attempt()
    except OSError:
        pass
"""
GC_HOOK_PATCH = """
import gc, os, sys
for obj in gc.get_objects():   # the audit hook of before: lift its ban through its closure cells
    if callable(obj) and getattr(obj, '__name__', '') == 'hook' and getattr(obj, '__closure__', None):
        for cell in obj.__closure__:
            if isinstance(cell.cell_contents, tuple):
                cell.cell_contents = ()
if os.system('touch MARKER') == 0:
    def add(a, b):
        return a + b
"""
BACKGROUND_SHELL = """
import os, subprocess
ok = os.system("setsid sh -c 'sleep 20; touch MARKER' >/dev/null 2>&1 &") == 0
try:
    subprocess.Popen(['sh', '-c', 'sleep 20; touch MARKER'], start_new_session=True)
except OSError:
    ok = False
if ok:
    def add(a, b):
        return a + b
"""


def test_writing_outside_the_working_folder_changes_nothing(tmp_path):
    target, victim = tmp_path / "written.txt", tmp_path / "victim.txt"
    victim.write_text("keep me")
    code = f"TARGET, VICTIM = {str(target)!r}, {str(victim)!r}\n" + WRITE_OUTSIDE + (
        "open('inside.txt', 'w').write('fine')\nINSIDE = open('inside.txt').read()")
    assert sandbox.run_tests(code, ["assert INSIDE == 'fine'"]) == 1   # its own folder works
    assert not target.exists() and victim.read_text() == "keep me" and os.listdir(tmp_path) == ["victim.txt"]


# ids hold no pid (the "kill the test process" code names this one): every process that collects the
# tests, as pytest-xdist's workers do, must see the same ids
@pytest.mark.parametrize("name,code", [
    ("gc-based hook patching then os.system", GC_HOOK_PATCH),
    ("setsid'd background shell that writes a file 20 s later", BACKGROUND_SHELL),
    ("infinite loop", "def add(a, b):\n    while True:\n        pass"),
    ("infinite loop at import", "while True:\n    pass"),
    ("fork bomb", "import os\nwhile True:\n    os.fork()"),
    ("thread bomb", "import threading, time\nwhile True:\n"
                    "    threading.Thread(target=time.sleep, args=(60,)).start()"),
    ("memory bomb", "x = bytearray(8 << 30)\ndef add(a, b):\n    return a + b + len(x)"),
    ("slow memory bomb", "x = []\nwhile True:\n    x.append(bytearray(1 << 20))"),
    ("disk bomb", "for i in range(10 ** 6):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))"),
    ("subprocess", "import subprocess\nsubprocess.run(['sh', '-c', 'touch MARKER; sleep 100'])"),
    ("ctypes", "import ctypes\nctypes.CDLL(None).system(b'touch MARKER')"),
    ("sub-interpreter", "import _xxsubinterpreters as s\n"
                        "s.run_string(s.create(), \"import os; os.system('touch MARKER')\")"),
    ("kill the test process", f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)"),
    ("kill the parent through a pidfd",
     "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), 9)"),
    ("early exit", "import sys\nsys.exit(0)"),
    ("fake results", "for i in range(10):\n    print(f'ok {i}')\n    print(i)\nimport os\nos._exit(0)"),
    ("socket", "import socket\nsocket.create_connection(('127.0.0.1', 22))"),
    ("always equal", "class Yes:\n    __eq__ = __bool__ = lambda *a: True\ndef add(a, b):\n    return Yes()"),
    ("patched builtins",
     "import builtins, json\nbuiltins.exec = builtins.eval = json.dumps = lambda *a, **k: 'true'"),
], ids=lambda v: v.split(chr(10))[0] if "os.kill(" in v else None)
def test_hostile_completions_score_zero_and_leave_nothing(name, code, tmp_path):
    marker = tmp_path / f"pwned-{secrets.token_hex(4)}"   # a name no other process on the machine mentions
    before = descendants()   # (other tests' servers may be running: only new ones count)
    assert rewards.code_reward(answer(code.replace("MARKER", str(marker))), ADD) == 0.0
    assert not lingering(before, marker.name)
    assert not marker.exists()


def test_the_kernel_refuses_new_processes_and_sysv_memory():
    """The events behind the fork and shell cases (seccomp refuses them, as root too), and SysV shared memory,
    which would hold memory beyond RLIMIT_AS until the jail ends: each one fails with EPERM. And the resource
    limits hold: root inside the jail has no capability to raise them."""
    code = ("import ctypes, os, subprocess\nR = []\nfor f in (os.fork, lambda: subprocess.run(['true'])):\n"
            "    try:\n        f()\n        R.append('started')\n"
            "    except OSError as e:\n        R.append(e.errno)\n"
            "R.append(os.system('true'))\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            # IPC_PRIVATE, 256 MiB, IPC_CREAT | 0600
            "R.append((libc.shmget(0, 1 << 28, 0o1600), ctypes.get_errno()))\n"
            "t = __import__('threading').Thread(target=R.append, args=('thread',))\nt.start()\nt.join()\n"
            "import resource\ntry:\n    resource.setrlimit(resource.RLIMIT_CPU, (100, 100))\n"
            "except ValueError:\n    R.append('limit kept')")
    # EPERM twice; system(3) answers exit status 127 (32512 as a wait status): its shell never started; shmget
    # -1 with EPERM; threads still work; the prologue's limits cannot be raised
    assert sandbox.run_tests(code, ["assert R == [1, 1, 32512, (-1, 1), 'thread', 'limit kept']"]) == 1


@pytest.mark.parametrize("code,timeout_s,stop", [
    ("import time\nwhile True:\n    time.sleep(1)", 1, "deadline"),   # no CPU used: only the wall clock stops it
    ("while True:\n    print('x' * 10000)", 60, "cap"),                # 1 MiB of output, long before the clock
])
def test_sleeping_and_flooding_completions_are_cut_short(code, timeout_s, stop, monkeypatch):
    """What ended the reading of the jail's output, as the reader returns: its deadline had passed, or it held
    OUTPUT_CAP bytes (or the jail ended by itself: "eof"). Then the jail is killed whole: nothing lingers."""
    read, stops = sandbox.read_output, []

    def reader(fd, deadline):
        out = read(fd, deadline)
        stops.append("cap" if len(out) == sandbox.OUTPUT_CAP else
                     "deadline" if time.monotonic() >= deadline else "eof")
        return out
    monkeypatch.setattr(sandbox, "read_output", reader)
    before = descendants()
    assert sandbox.run_tests(code, ADD["tests"], timeout_s=timeout_s) == 0
    assert stops == [stop] and not lingering(before)


# a trainer whose one completion sleeps: its jail runs until killed
SLEEPING_TRAINER = ("import sys\nsys.path.insert(0, {root!r})\nimport sandbox\n"
                    "sandbox.run_tests('import time\\nX = 1\\ntime.sleep(10 ** 6)', ['assert X == 1'], "
                    "timeout_s=600)")


def is_jail_interpreter(process):
    with contextlib.suppress(psutil.NoSuchProcess):
        return process.cmdline()[:2] == [os.path.realpath(sys.executable), "-I"]
    return False


def outlive_the_trainer(trainer, jail):
    """The trainer killed outright (SIGKILL) -> the pids of `jail` (psutil processes) still running 10 s on."""
    trainer.kill()
    trainer.wait()
    deadline = time.monotonic() + 10
    while any(map(running, jail)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p.pid for p in jail if running(p)]


def test_the_jail_dies_with_the_trainer():
    """A trainer killed outright (SIGKILL, the OOM killer) cleans nothing up, so its jails must end with it.
    As root they did not: the jail's bwrap and the completion kept running, for as long as the completion
    liked, after the trainer was gone."""
    trainer = subprocess.Popen([sys.executable, "-c", SLEEPING_TRAINER.format(root=ROOT)])
    jail = []
    try:
        deadline = time.monotonic() + 60
        while not any(map(is_jail_interpreter, jail)):   # every process of the jail, once the completion runs
            assert trainer.poll() is None and time.monotonic() < deadline, "the jail did not start"
            jail = psutil.Process(trainer.pid).children(recursive=True)
            time.sleep(0.05)
        assert not outlive_the_trainer(trainer, jail), "the jail outlived the trainer"
    finally:
        trainer.kill()
        trainer.wait()
        for process in jail:   # psutil checks it is still the same process, not a pid used again
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def test_what_waits_at_the_deadline_is_read_once(monkeypatch):
    """A reader that gets a core back only after its deadline still reads what the jail wrote before it (its
    "ready" line, its results): without it the jail "did not start", and the completion scored nan. Once:
    then it stops, data waiting or not, and with nothing waiting it does not wait (each poll's timeout, in
    ms, is recorded: the real poll runs)."""
    timeouts, real_poll = [], select.poll

    class RecordedPoll:
        def __init__(self):
            self.poller = real_poll()

        def register(self, *args):
            self.poller.register(*args)

        def poll(self, timeout):
            timeouts.append(timeout)
            return self.poller.poll(timeout)
    monkeypatch.setattr(select, "poll", RecordedPoll)
    r, w = os.pipe()
    try:
        os.write(w, b"\nready\n")
        assert sandbox.read_output(r, time.monotonic() - 1) == b"\nready\n" and timeouts == [0]
        assert sandbox.read_output(r, time.monotonic() - 1) == b"" and timeouts == [0, 0]
    finally:
        os.close(r)
        os.close(w)


def test_forged_results_need_the_right_values():
    # in-process code can find the nonce (here in the prologue's frame) and write result lines itself; they
    # count only if they hold the right values, which the child never sees, and not at all next to the
    # harness's own
    forge = ("import os, sys\ndef add(a, b):\n    nonce = sys._getframe(2).f_locals['nonce']\n"
             "    for i, v in enumerate(VALUES):\n        os.write(1, f'\\n{nonce} {i} {v}\\n'.encode())\n"
             "    END")
    forged = lambda values, end: sandbox.run_tests(forge.replace("VALUES", values).replace("END", end),
                                                   ADD["tests"])
    assert forged("[3, 0, 42]", "os._exit(0)") == 3
    assert forged("['true'] * 3", "os._exit(0)") == 0
    assert forged("[3, 0, 42]", "return a + b") == 0


def test_the_jail_holds_only_the_python_installation():
    code = ("import os\nROOT = sorted(os.listdir('/'))\n"
            "PROCS = sorted(p for p in os.listdir('/proc') if p.isdigit())")
    # the child alone, as the jail's pid 1: no other process
    assert sandbox.run_tests(code, ["assert PROCS == ['1']"]) == 1
    libs = {d for d in ("lib", "lib64", "lib32") if os.path.exists("/" + d)}
    top = sorted({"dev", "proc", "tmp", "usr", os.path.realpath(sys.base_prefix).split(os.sep)[1]} | libs)
    assert sandbox.run_tests(code, [f"assert ROOT == {top!r}"]) == 1


def test_without_bwrap_the_code_reward_refuses_to_start(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))   # a PATH with no bwrap on it
    with pytest.raises(ValueError, match=r"reward 'code'.*apt-get install bubblewrap.*GRPO_UNJAILED=1"):
        rewards.parse_reward_spec("code,format:0.1")
    assert rewards.parse_reward_spec("format") == [("format", 1.0)]   # other rewards do not need it
    # should the jail fail during a run, the reward is nan, which score() counts as an error, not a silent 0
    total, parts, errors = rewards.score(answer(CORRECT_ADD), ADD, [("code", 1.0)])
    assert (total, parts, errors) == (0.0, {"code": 0.0}, 1)
    assert math.isnan(rewards.code_reward(answer(CORRECT_ADD), ADD))
    monkeypatch.setenv(sandbox.UNJAILED, "1")   # knowingly: it runs, and says so
    assert rewards.parse_reward_spec("code") == [("code", 1.0)]
    assert "WITHOUT a jail" in capsys.readouterr().err
    assert rewards.code_reward(answer(CORRECT_ADD), ADD) == 1.0


def test_tools_found_through_a_symlink_start_the_jail(monkeypatch, tmp_path):
    """As root no jail started where `bwrap` or `setpriv` was found through a symlink (PATH=/bin:/usr/bin,
    /bin a symlink to usr/bin): the root stage bound each tool at its real path and ran it by the path
    found, which is not in it. Both run from their real paths now."""
    for tool in ("bwrap", "setpriv"):
        os.symlink(shutil.which(tool), tmp_path / tool)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert sandbox.run_tests("X = 6 * 7", ["assert X == 42"]) == 1


# ------------------------------------------------------------- never root, its own clock, types

NOBODY = 65534   # the jail's user and group (sandbox.JAIL_ID)


def test_the_completion_never_runs_as_root():
    """bwrap started by root kept the jail's user root on the host, with every capability and a writable
    /proc/sys: a completion set kernel.core_pattern to a shell command the kernel then ran as root. Seen from
    inside: an unprivileged user and group, no capability, /proc/sys not writable (opened only: nothing is
    written). Seen from the host: the jail's processes belong to that user too, not to root."""
    code = ("import os\nIDS = [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), os.getgroups()]\n"
            "CAPS = [l.split()[1] for l in open('/proc/self/status') if l.startswith('Cap')]\n"
            "SYSCTL = []\nfor name in ('kernel/core_pattern', 'kernel/hostname', 'vm/drop_caches'):\n"
            "    try:\n        os.close(os.open('/proc/sys/' + name, os.O_WRONLY))\n"
            "        SYSCTL.append('writable')\n    except OSError as e:\n        SYSCTL.append(e.errno)\n")
    tests = [f"assert IDS == {[NOBODY] * 4 + [[]]!r}", f"assert CAPS == {['0' * 16] * 5!r}",
             "assert 'writable' not in SYSCTL"]
    assert sandbox.run_tests(code, tests) == 3

    for uids, gids in jail_interpreters(1).values():
        assert len(set(uids)) == 1 and set(uids) == set(gids) and uids[0] in sandbox.HOST_UIDS, (uids, gids)


def jail_interpreters(n, while_running=lambda seen: None):
    """Runs n jails at once, each a completion that sleeps: -> {pid: (uids, gids)} of their interpreters as
    the host sees them, once all n run; while_running(that dict) is called then, while they still run."""
    before, seen = descendants(), {}
    jails = [threading.Thread(target=sandbox.run_tests, args=("import time\ntime.sleep(8)", ["assert time"]),
                              kwargs={"timeout_s": 120}) for _ in range(n)]
    for jail in jails:
        jail.start()
    try:
        while all(j.is_alive() for j in jails) and len(seen) < n:   # the interpreters, once they run
            for pid in descendants() - before:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p = psutil.Process(pid)
                    if p.cmdline()[:2] == [os.path.realpath(sys.executable), "-I"]:
                        seen[pid] = (p.uids(), p.gids())
            time.sleep(0.05)
        assert len(seen) == n, f"{len(seen)} of the {n} jails' interpreters seen"
        while_running(seen)
    finally:
        for jail in jails:
            jail.join()
    return seen


# what a host process may do to a jail's process: read its environment, signal it, open its memory
PEEK = """for pid in "$@"; do
    cat /proc/$pid/environ >/dev/null 2>&1 && echo done || echo refused
    kill -0 $pid 2>/dev/null && echo done || echo refused
    (exec 3</proc/$pid/mem) 2>/dev/null && echo done || echo refused
done"""


def test_each_jail_has_a_host_uid_no_account_has():
    """The jail ran as the host's "nobody" (65534): any host process of that user read a running jail's
    environment, opened its memory and signalled it. Now each running jail has its own uid, from a range no
    account uses; a process of the old shared user is refused all three (root, the same peek, is not)."""
    accounts, answers = {p.pw_uid for p in pwd.getpwall()}, {}

    def peek(seen):
        for who, drop in (("nobody", ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]),
                          ("root", [])):
            out = subprocess.run([*drop, "sh", "-c", PEEK, "peek", *map(str, seen)], capture_output=True,
                                 text=True, timeout=60)
            answers[who] = out.stdout.split()

    seen = jail_interpreters(2, peek)
    uids = [uids[0] for uids, _ in seen.values()]
    assert len(set(uids)) == 2 and not set(uids) & (accounts | {NOBODY}), uids
    assert answers == {"nobody": ["refused"] * 6, "root": ["done"] * 6}, answers


def test_the_jails_tmp_bounds_files_too():
    """/tmp bounded bytes, not files: 500,000 empty files in 3 s took 624 MiB of the host's kernel memory.
    Creating files now stops at sandbox.TMP_FILES with ENOSPC, in the jail's working folder; the trusted
    step that mounts it leaves the completion no capability."""
    code = ("import os\nN, E = 0, None\ntry:\n    for i in range(100000):\n"
            "        open(f'f{i}', 'w').close()\n        N += 1\nexcept OSError as e:\n    E = e.errno\n"
            "CAPS = [l.split()[1] for l in open('/proc/self/status') if l.startswith('Cap')]\n"
            "CWD = os.getcwd()")
    tests = [f"assert {sandbox.TMP_FILES} - 16 < N < {sandbox.TMP_FILES}", "assert E == 28",
             f"assert CAPS == {['0' * 16] * 5!r}", "assert CWD == '/tmp'"]
    assert sandbox.run_tests(code, tests, timeout_s=30) == 4


def test_rlimit_nproc_binds_in_the_jail():
    """As root RLIMIT_NPROC bound nothing: a completion held thousands of tasks (threads with small stacks,
    within RLIMIT_AS), bounded only by the host's pid_max."""
    code = ("import threading, time\nthreading.stack_size(1 << 15)\nSTARTED = 0\ntry:\n"
            "    for _ in range(300):\n"
            "        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "        STARTED += 1\nexcept RuntimeError:\n    pass\n")
    # the threads were refused (RuntimeError), after as many as the limit allows, less the jail's own tasks
    assert sandbox.run_tests(code, ["assert 0 < STARTED < 64"], timeout_s=60) == 1


KEYRING = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
# add_key("user", "i19", "secret", 6, KEY_SPEC_PROCESS_KEYRING)
KEY = libc.syscall(NR, b"user", b"i19", b"secret", 6, ctypes.c_int(-2))
KEY = [KEY, ctypes.get_errno() if KEY < 0 else 0]
"""


@pytest.mark.skipif(platform.machine() not in sandbox.SECCOMP_ARCH, reason="no seccomp filter here")
@pytest.mark.parametrize("unjailed", [False, True])
def test_the_kernel_keyring_is_refused(monkeypatch, unjailed):
    """The keyring is not namespaced: a key one completion added was read by the next. Unjailed the call
    works (a key in a keyring of that process alone), which proves the jail is what refuses it."""
    if unjailed:
        monkeypatch.setenv(sandbox.UNJAILED, "1")
    nr = {"x86_64": 248, "aarch64": 217}[platform.machine()]
    code = KEYRING.replace("NR", str(nr))
    assert sandbox.run_tests(code, ["assert KEY[0] > 0"]) == int(unjailed)   # a key's serial number
    assert sandbox.run_tests(code, ["assert KEY == [-1, 1]"]) == int(not unjailed)   # EPERM


@pytest.mark.skipif(platform.machine() not in sandbox.SECCOMP_ARCH, reason="no seccomp filter here")
def test_every_refused_system_call_gets_eperm():
    refused = sandbox.SECCOMP_ARCH[platform.machine()][3]
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nERRNOS = []\n"
            f"for nr in {refused!r}:\n    libc.syscall(nr, 0, 0, 0, 0, 0)\n"
            "    ERRNOS.append(ctypes.get_errno())\n")
    assert sandbox.run_tests(code, [f"assert ERRNOS == {[1] * len(refused)!r}"]) == 1


class CountingClock:
    """run_tests' clock, one second further at each look: its deadline comes after a known number of looks.
    Each look after it is counted, and waits a moment first, so that the jail has written more by then."""

    def __init__(self):
        self.now, self.deadline, self.late = 0.0, None, 0

    def monotonic(self):
        self.now += 1
        if self.deadline is None:   # the first look sets the deadline
            self.deadline = self.now + TIMEOUT_LOOKS
        if self.now >= self.deadline:
            self.late += 1
            time.sleep(0.2)
        return self.now


TIMEOUT_LOOKS = 3


def test_run_tests_stops_reading_at_its_deadline(monkeypatch):
    """A completion that keeps data waiting kept the reading loop going, whatever the clock said (30 s of a
    5 s timeout, at 100% CPU, with a byte at a time). The clock is looked at before
    every read, and nothing is read once it says the deadline has passed."""
    clock = CountingClock()
    monkeypatch.setattr(sandbox, "time", clock)
    code = "import os\nwhile True:\n    os.write(1, b'x' * 65536)"   # the pipe is never empty
    assert sandbox.run_tests(code, ADD["tests"], timeout_s=TIMEOUT_LOOKS) == 0
    assert clock.late <= 1   # the one look that finds the deadline passed


def test_a_result_line_cut_at_the_cap_does_not_count():
    """Output stops at OUTPUT_CAP bytes; a result line cut there ("1" of "1000...") is not a result. The
    completion writes exactly enough first that the cap falls after the value's first digit."""
    ready, head = len("\n") + 32 + len(" ready\n"), len("\n") + 32 + len(" 0 ")
    filler = sandbox.OUTPUT_CAP - ready - head - 1
    code = (f"import os\nos.write(1, b'.' * {filler})\n"
            "def big():\n    return 10 ** 4000")
    assert sandbox.run_tests(code, ["assert big() == 1"], timeout_s=30) == 0
    # the same value, whole, is read and judged
    assert sandbox.run_tests(code.replace(f"{filler}", "1"), ["assert big() == 1"], timeout_s=30) == 0
    assert sandbox.run_tests(code.replace(f"{filler}", "1"), ["assert big()"], timeout_s=30) == 1


# the expected side of each test is Python's builtins on constants, which the jail computed (and a
# completion could choose): range, dict, pow, a string method
EXPECTED_TESTS = ["assert f(10) == pow(2, 10)", "assert g() == dict(a=2, b=1)",
                  "assert w() == ' '.join(['a', 'b'])", "assert r() == range(4)"]
SOLVES = ("def f(n):\n    return 2 ** n\ndef g():\n    return {'a': 2, 'b': 1}\n"
          "def w():\n    return 'a b'\ndef r():\n    return range(4)")
# solves nothing: binds the builtins the tests use at module level, in whose namespace the jail
# evaluated them, to what its own functions return
REBINDS = ("pow = dict = range = lambda *args, **kwargs: 7\n"
           "def f(n):\n    return 7\ndef g():\n    return 7\ndef w():\n    return 7\ndef r():\n    return 7")
# solves nothing: finds the nonce and writes 7 as the value of every part, then leaves
FORGES = """
import os, sys
_caller = sys._getframe(1).f_locals
for _i in range(len(_caller['exprs'])):
    os.write(1, f"\\n{_caller['nonce']} {_i} 7\\n".encode())
os._exit(0)
"""


def test_the_expected_side_never_comes_from_the_jail():
    """A completion that rebinds range, dict and pow passed 3 of these 4 tests, one that forges the values
    4 of 4, solving nothing, and the right one 3 of 4 (the jail wrote no value for `range(4)`). Now the
    jail is asked for f(10), g(), w() and r() alone: they score 0, 0 and 4, as Python scores them."""
    python = {}
    exec(SOLVES, python)
    assert all(eval(t.removeprefix("assert "), python) for t in EXPECTED_TESTS)
    assert [sandbox.run_tests(code, EXPECTED_TESTS) for code in (REBINDS, FORGES, SOLVES)] == [0, 0, 4]


# a completion that solves nothing and answers every isclose() itself
ISCLOSE_ALWAYS = "def isclose(*args, **kwargs):\n    return True\ndef half(x):\n    return 0"
ISCLOSE_TESTS = ["assert isclose(half(1), 0.5)", "assert isclose(half(3), 1.5, rel_tol=1e-9)"]


def test_isclose_alone_is_maths_not_the_completions():
    """`isclose` alone (after `from math import isclose`) was a name of the completion's: the jail was sent
    `isclose(half(1), 0.5)`, expected value and all, and a completion defining isclose() to return True
    passed every test. Now it is math.isclose, the trainer's: the jail is asked for half(1) alone."""
    assert sandbox.split_test(ISCLOSE_TESTS[1])[1] == ["half(3)"]
    right = "from math import isclose\ndef half(x):\n    return x / 2"
    assert [sandbox.run_tests(code, ISCLOSE_TESTS) for code in (ISCLOSE_ALWAYS, right)] == [0, 2]


LAZY_CODE = """
def evens(n):
    return (i for i in range(0, n, 2))
def upto(n):
    return range(n)
def squares(xs):
    return map(lambda x: x * x, xs)
def positive(xs):
    return filter(lambda x: x > 0, xs)
def names(d):
    return d.keys()
def counts(d):
    return d.values()
def pairs(d):
    return d.items()
"""
LAZY_TESTS = ["assert list(evens(7)) == [0, 2, 4, 6]", "assert sorted(upto(3), reverse=True) == [2, 1, 0]",
              "assert len(upto(5)) == 5 and upto(5) == range(5)", "assert set(squares([1, 2, 2])) == {1, 4}",
              "assert list(positive([-1, 2, 0, 3])) == [2, 3]", "assert names({'a': 1, 'b': 2}) == {'a', 'b'}",
              "assert sum(counts({'a': 1, 'b': 2})) == 3",
              "assert sorted(pairs({'b': 2, 'a': 1})) == [('a', 1), ('b', 2)]",
              "assert evens(3) != [0, 2]"]


def test_generators_ranges_views_map_and_filter_are_judged_as_python():
    """Right code returning a generator, range, dict view, map or filter scored 0 where Python gives every
    test: the jail wrote no value for them. Now each comes back with its items, rebuilt as the same kind
    of object, and scores as in Python (a generator still is no list)."""
    python = {}
    exec(LAZY_CODE, python)
    assert all(eval(t.removeprefix("assert "), python) for t in LAZY_TESTS)
    assert sandbox.run_tests(LAZY_CODE, LAZY_TESTS) == len(LAZY_TESTS)


PID_1 = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
PID, PROCS = os.getpid(), sorted(p for p in os.listdir('/proc') if p.isdigit())
LIMIT = next(line.split()[3] for line in open('/proc/1/limits') if line.startswith('Max address space'))
# ptrace(PTRACE_ATTACH, 1), process_vm_readv(1, ...): each answer and errno
CALLS = []
for nr, args in ((NR_PTRACE, (16, 1, 0, 0)), (NR_VM_READ, (1, 0, 0, 0, 0, 0))):
    CALLS.append((libc.syscall(nr, *args), ctypes.get_errno()))
"""


@pytest.mark.skipif(platform.machine() not in sandbox.SECCOMP_ARCH, reason="no seccomp filter here")
def test_the_jails_pid_1_is_the_completion_under_its_limits():
    """bwrap's init was the jail's pid 1: a process of the completion's user, dumpable, without RLIMIT_AS,
    which a completion attached to with ptrace and made map 1 GiB. Now the completion's interpreter is
    pid 1, the jail's only process, under the address-space limit; and ptrace and process_vm_readv of it
    are refused (EPERM)."""
    numbers = {"x86_64": (101, 310), "aarch64": (117, 270)}[platform.machine()]
    code = PID_1.replace("NR_PTRACE", str(numbers[0])).replace("NR_VM_READ", str(numbers[1]))
    tests = ["assert PID == 1", "assert PROCS == ['1']", f"assert LIMIT == '{512 << 20}'",
             "assert CALLS == [(-1, 1), (-1, 1)]"]
    assert sandbox.run_tests(code, tests) == 4


HOLD = """
import array, os, socket
HELD, OPEN = 0, []
ours, theirs = socket.socketpair()
def filled():
    # a memfd written to RLIMIT_FSIZE (EFBIG); its memory is outside RLIMIT_AS
    global HELD
    fd = os.memfd_create('held')
    try:
        while True:
            HELD += os.write(fd, bytes(65536))
    except OSError:
        return fd
try:
    # the working folder, to full (ENOSPC)
    for i in range(100):
        with open(f'f{i}', 'wb') as f:
            for _ in range(16):
                HELD += f.write(bytes(65536))
except OSError:
    pass
try:
    # in flight: sent over the socket and closed here, until the kernel refuses (ETOOMANYREFS)
    while True:
        fd = filled()
        ours.sendmsg([b'.'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', [fd]))])
        os.close(fd)
except OSError:
    pass
try:
    # then open, until no file is left (EMFILE)
    while True:
        OPEN.append(filled())
except OSError:
    pass
HELD >>= 20
"""


def test_a_jails_memory_budget_counts_what_it_holds_outside_its_address_space():
    """--reward-workers gave each jail 528 MiB (its address space and /tmp), but a jail also holds memfds
    passed in flight and kept open, pipes and its /tmp, none of it under RLIMIT_AS. A completion holding
    all it can this way (MiB, the kernel's own counts of what it wrote) stays within sandbox.jail_mb()
    beside its address space, and holds more than /tmp alone: what the budget of before missed."""
    outside = sandbox.jail_mb(512) - 512
    assert sandbox.run_tests(HOLD, [f"assert {sandbox.TMP_MB} < HELD <= {outside}"], timeout_s=60) == 1
    assert sandbox.run_tests(HOLD, [f"assert HELD > {outside} - 16"], timeout_s=60) == 1   # it is tight


def test_the_judge_keeps_pythons_types():
    """Equality as Python has it: a tuple is not a list, an int key not a str key; but what Python calls
    equal still passes (a namedtuple and a tuple, 1 and 1.0, a frozenset and a set)."""
    code = ("import collections\nP = collections.namedtuple('P', 'x y')\n"
            "def unique(xs):\n    return tuple(sorted(set(xs)))\n"
            "def counts():\n    return {'1': 2}\n"
            "def point():\n    return P(1, 2)\n"
            "def misc():\n    return [1.0, frozenset({3}), b'x', None, True, 2j, {(1, 'a'): ()}, set()]")
    tests = ["assert unique([3, 1, 2, 1]) == [1, 2, 3]", "assert counts() == {1: 2}",
             "assert point() == (1, 2)",
             "assert misc() == [1, {3}, b'x', None, 1, 2j, {(1, 'a'): ()}, set()]"]
    assert sandbox.run_tests(code, tests) == 2
    assert sandbox.run_tests(code, tests[2:]) == 2


# runs a command under a seccomp filter that refuses new user namespaces, as Docker's default profile does:
# clone and unshare with CLONE_NEWUSER get EPERM, clone3 ENOSYS (x86_64's numbers)
BLOCK_USERNS = """
import ctypes, os, struct, sys
ld, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06
allow, eperm, enosys = 0x7FFF0000, 0x00050001, 0x00050026
prog = [(ld, 0, 0, 4), (jeq, 1, 0, 0xC000003E), (ret, 0, 0, allow), (ld, 0, 0, 0), (jeq, 0, 1, 435),
        (ret, 0, 0, enosys), (jeq, 1, 0, 56), (jeq, 0, 3, 272), (ld, 0, 0, 16), (jset, 0, 1, 0x10000000),
        (ret, 0, 0, eperm), (ret, 0, 0, allow)]
code = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *i) for i in prog))
class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0   # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.byref(Program(len(prog), ctypes.addressof(code))), 0, 0) == 0
os.execv(sys.argv[1], sys.argv[1:])
"""
CHECK_JAIL = """
import sandbox
try:
    sandbox.check_jail()
    print('jailed')
except RuntimeError as e:
    print(e)
"""


@contextlib.contextmanager
def unprivileged_folder(files):
    """A folder of sandbox.py, judge.py and `files` ({name: text}) that an unprivileged user can read, for the
    system's Python (the project's may lie in root's home): sandbox.py imports no project module but
    judge.py."""
    folder = tempfile.mkdtemp(prefix="grpo_user_", dir="/tmp")
    try:
        for name in ("sandbox.py", "judge.py"):
            shutil.copy(os.path.join(ROOT, name), folder)
        for name, text in files.items():
            open(os.path.join(folder, name), "w").write(text)
        os.chmod(folder, 0o755)
        for name in os.listdir(folder):
            os.chmod(os.path.join(folder, name), 0o644)
        yield folder
    finally:
        shutil.rmtree(folder)


@pytest.mark.skipif(platform.machine() != "x86_64" or not os.path.exists("/usr/bin/python3"),
                    reason="the filter is x86_64's; the unprivileged user runs the system's Python")
def test_where_user_namespaces_are_refused_the_run_says_what_to_run():
    """Docker's default seccomp profile (simulated: a filter refusing CLONE_NEWUSER on the trainer) stops
    bwrap. As root and as an unprivileged user, the check at start is then one line saying what to run;
    without the filter, the same user gets its jail."""
    with unprivileged_folder({"block.py": BLOCK_USERNS}) as folder:
        user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        python, blocked = "/usr/bin/python3", ["/usr/bin/python3", "block.py"]
        said = {who: subprocess.run([*prefix, python, "-c", CHECK_JAIL], cwd=folder, capture_output=True,
                                    text=True, timeout=120).stdout
                for who, prefix in (("root", blocked), ("user", user + blocked), ("user, no filter", user))}
    assert said["user, no filter"] == "jailed\n"
    for who in ("root", "user"):
        assert said[who] == sandbox.USERNS_BLOCKED + "\n", (who, said[who])
    assert "seccomp=unconfined" in said["root"] and "apparmor_restrict_unprivileged_userns=0" in said["root"]


# a completion that would outlive its jail: it turns its parent-death signal off (PR_SET_PDEATHSIG 0), ignores
# what a closed pipe or terminal sends, names itself (PR_SET_NAME: /proc/PID/comm) and sleeps
OUTLIVES = """
import ctypes, signal, time
libc = ctypes.CDLL(None)
libc.prctl(1, 0, 0, 0, 0)
libc.prctl(15, b"NAME", 0, 0, 0)
for s in (signal.SIGPIPE, signal.SIGHUP, signal.SIGTERM):
    signal.signal(s, signal.SIG_IGN)
X = 1
time.sleep(600)
"""
# runs it, then lists the processes of that name still running as run_tests returns (no zombie)
OUTLIVES_RUN = """
import json, os, sys
import sandbox
sandbox.run_tests(sys.argv[1], ["assert X == 1"], timeout_s=3)
left = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        continue
    if stat.split(" (", 1)[1].startswith(sys.argv[2] + ")") and stat.rsplit(")", 1)[1].split()[0] != "Z":
        left.append(int(pid))
print(json.dumps(left))
"""


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"),
                    reason="the unprivileged user runs the system's Python")
def test_every_process_of_a_jail_is_gone_when_run_tests_returns():
    """A trainer not run by root killed the jail's bwrap at the deadline, and the completion died only by
    its parent-death signal, which it can turn off: it then ran on, reparented, after run_tests returned and
    after the trainer. Now its jail's PID namespace is killed through its first process, and run_tests
    returns once it is gone: for an unprivileged trainer and for root."""
    name = f"out{secrets.token_hex(4)}"
    code = OUTLIVES.replace("NAME", name)
    user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    try:
        with unprivileged_folder({"outlives.py": OUTLIVES_RUN}) as folder:
            for who, prefix, python in (("user", user, "/usr/bin/python3"), ("root", [], sys.executable)):
                run = subprocess.run([*prefix, python, "outlives.py", code, name], cwd=folder, timeout=120,
                                     capture_output=True, text=True)
                assert run.stdout == "[]\n", (who, run.stdout, run.stderr[-2000:])
    finally:
        for p in psutil.process_iter(["name"]):
            if p.info["name"] == name:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()


# a trainer, not root, whose one completion would outlive it
OUTLIVES_TRAINER = """
import sys
import sandbox
sandbox.run_tests(sys.argv[1], ["assert X == 1"], timeout_s=600)
"""


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"),
                    reason="the unprivileged user runs the system's Python")
def test_a_jail_dies_with_a_trainer_not_root():
    """A completion that turned its parent-death signal off (prctl PR_SET_PDEATHSIG 0) ran on after its
    trainer, not root, was killed outright: only that signal ended it when bwrap died. seccomp now refuses
    the prctl (EPERM), and the completion dies with bwrap, which dies with the trainer."""
    name = f"out{secrets.token_hex(4)}"
    user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    trainer, jail = None, []
    try:
        with unprivileged_folder({"trainer.py": OUTLIVES_TRAINER}) as folder:
            code = OUTLIVES.replace("NAME", name)
            trainer = subprocess.Popen([*user, "/usr/bin/python3", "trainer.py", code], cwd=folder)
            deadline = time.monotonic() + 60
            while not jail:   # the completion, once it has named itself
                assert trainer.poll() is None and time.monotonic() < deadline, "the jail did not start"
                jail = [p for p in psutil.process_iter(["name"]) if p.info["name"] == name]
                time.sleep(0.05)
            assert not outlive_the_trainer(trainer, jail), "the completion outlived the trainer"
    finally:
        if trainer is not None:
            trainer.kill()
            trainer.wait()
        for process in jail:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
