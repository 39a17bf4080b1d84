"""The code reward's jail (sandbox.py, real bubblewrap): right answers score, every known escape scores
0 and leaves no file and no process behind, and nothing of the project, the trainer's environment or the
machine's files is readable inside. Read-only escapes are also run unjailed (GRPO_UNJAILED=1), where they must
work: that proves each one is a real attack the jail stops, not code that fails for some other reason."""
import contextlib
import math
import os
import platform
import secrets
import subprocess
import sys
import threading
import time

import psutil
import pytest

import rewards
import sandbox
import tasks
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
    command line names `marker` (a daemon reparented away from us), if given. Waits up to 2 s for them to go:
    the jail's processes die with bwrap, asynchronously."""
    deadline = time.monotonic() + 2
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


def test_split_test():
    assert sandbox.split_test("assert f(1, 'a') == (3, [None])") == ("f(1, 'a')", False, (3, [None]))
    assert sandbox.split_test("assert is_even(4)") == ("is_even(4)", True, True)
    assert sandbox.split_test("assert not is_even(7)") == ("is_even(7)", True, False)
    with pytest.raises(ValueError):
        sandbox.split_test("x = add(1, 2)")


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
# a copy of this repository lives) and runs the reference solutions of tasks.py (sandbox.py held them before)
UNIVERSAL_CHEAT = PATCH_REALPATH + f"""
import ast, glob, os
def _solutions():
    found = []
    for folder in [f'/proc/{{os.getppid()}}/cwd', *glob.glob('/proc/*/cwd'), {ROOT!r}, '..', '../..']:
        for name in ('tasks.py', 'sandbox.py'):
            try:
                tree = ast.parse(open(os.path.join(folder, name)).read())
            except (OSError, SyntaxError, ValueError):
                continue
            for node in tree.body:
                if isinstance(node, ast.Assign) and getattr(node.targets[0], 'id', '') == 'PROBLEMS':
                    found += [p[2] for p in ast.literal_eval(node.value)]
    return found
for _s in _solutions():
    exec(_s, globals())
"""
ENVIRON_PROBE = PATCH_REALPATH + """
import glob, os
ESCAPED = None
for path in [f'/proc/{os.getppid()}/environ', *glob.glob('/proc/*/environ')]:
    try:
        for var in open(path, 'rb').read().split(b'\\0'):
            if var.startswith(b'REF_SERVER_TOKEN='):
                ESCAPED = var.split(b'=', 1)[1].decode()
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
    """Each probe puts what it read in ESCAPED; the test holds the real value (it never enters the jail), so a
    probe scores 1 exactly when it read it. Unjailed they all do; jailed none does."""
    if unjailed:
        monkeypatch.setenv(sandbox.UNJAILED, "1")
    # in this process's os.environ too: the child gets none of it
    monkeypatch.setenv("REF_SERVER_TOKEN", trainer_with_a_token)
    passwd, project_file = open("/etc/passwd").read(), os.path.join(ROOT, "tasks.py")
    probes = {"/etc/passwd through a patched realpath":
              (PATCH_REALPATH + "ESCAPED = open('/etc/passwd').read()", passwd),
              "/proc/<ppid>/environ and every other process's": (ENVIRON_PROBE, trainer_with_a_token),
              "dir_fd traversal": (DIR_FD_READ, passwd),
              "the project's own files":
              (f"ESCAPED = open({project_file!r}).read()", open(project_file).read()),
              "the environment":
              ("import os\nESCAPED = os.environ.get('REF_SERVER_TOKEN')", trainer_with_a_token)}
    scores = {name: sandbox.run_tests(code, [f"assert ESCAPED == {want!r}"])
              for name, (code, want) in probes.items()}
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
])
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


@pytest.mark.parametrize("code,limit", [
    ("import time\nwhile True:\n    time.sleep(1)", 3),   # no CPU used: only the wall clock (1 s) stops it
    ("while True:\n    print('x' * 10000)", 0.9),           # stopped at 1 MiB of output, before the timeout
])
def test_sleeping_and_flooding_completions_are_cut_short(code, limit):
    before, t0 = descendants(), time.time()
    assert sandbox.run_tests(code, ADD["tests"], timeout_s=1) == 0
    assert time.time() - t0 < limit and not lingering(before)


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
    # bwrap's init and the child: no other process
    assert sandbox.run_tests(code, ["assert PROCS == ['1', '2']"]) == 1
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

    before, seen = descendants(), {}
    jail = threading.Thread(target=sandbox.run_tests, args=("import time\ntime.sleep(5)", ["assert 1"]),
                            kwargs={"timeout_s": 120})
    jail.start()
    try:
        while jail.is_alive() and not seen:   # the completion's interpreter, once it runs
            for pid in descendants() - before:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p = psutil.Process(pid)
                    if p.cmdline()[:2] == [os.path.realpath(sys.executable), "-I"]:
                        seen[pid] = (p.uids(), p.gids())
            time.sleep(0.05)
    finally:
        jail.join()
    assert seen, "the jail's interpreter was never seen"
    for uids, gids in seen.values():
        assert set(uids) == {NOBODY} and set(gids) == {NOBODY}, (uids, gids)


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
