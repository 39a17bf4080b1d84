"""The code task's reward: a completion's Python runs against unit tests in a child process (the rule-based
"reward server" of code-RL pipelines, kept local and small).

The child only computes, the parent judges. A test `assert E == V` (or `assert E`, `assert not E`) is split in
the parent: the child is sent E alone and writes back E's value as JSON; the parent compares it with V, which
never leaves the parent. So nothing the completion does inside the child (an object whose __eq__ is always
True, patched builtins, sys.exit(), printed fake results) can pass a test without producing the right values.
Result lines carry a random nonce only so that the completion's own prints are not taken for results.

The child is `python -I -S` (isolated: no PYTHON* variables, no site-packages) started with an EMPTY
environment (no token or key of the trainer's reaches it) in a fresh temporary directory, in a session of its
own that is killed whole after `timeout_s` or 1 MiB of output. Before the completion runs, a trusted prologue
sets resource limits (CPU seconds, address space, file size, open files, no core dumps, no processes for a
non-root user) and installs an audit hook (PEP 578) that refuses new processes (fork, exec, spawn, os.system,
_posixsubprocess, sub-interpreters), signals, sockets, ctypes, changing rlimits, reading files outside the
standard library and the temporary directory (no /proc/<pid>/environ, no project files), and writing, renaming,
linking or deleting outside that directory. OpenAI human-eval's `reliability_guard` instead sets such functions
to None, which the code it guards can undo (posix.kill is still there); here that is done only for
signal.pidfd_send_signal, which is not audited.

This is defence in depth for a teaching project, NOT a security boundary. Known gaps: an audit hook sees only
the calls CPython audits (os.mknod and os.mkfifo are not: they can create empty special files wherever the user
may, though opening one is refused; threads are not, and RLIMIT_NPROC does not bind root); in-process code can
re-create a built-in module the prologue trimmed, or find some other way around the hook; and the child runs as
the trainer's user. For completions from models you do not trust, run this in a container or jail (nsjail,
firejail, gVisor) as an unprivileged user as well.
"""
import ast
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time

from rewards import last_answer

PROLOGUE = r"""
import _signal, json, os, resource, sys
def _main(nonce, code, exprs, cpu_s, mem_mb):
    for lim, val in ((resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_AS, mem_mb << 20), (resource.RLIMIT_CORE, 0),
                     (resource.RLIMIT_FSIZE, 1 << 20), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_NPROC, 0)):
        resource.setrlimit(lim, (val, val))   # NPROC 0: no fork, however many processes the user already has
    _signal.__dict__.pop("pidfd_send_signal", None)   # not audited: it would let the completion kill its parent
    here = os.getcwd() + os.sep
    lib = tuple(os.path.realpath(p) + os.sep for p in (sys.base_prefix, sys.prefix))
    def allowed(path, how):   # how: "read", "list" or "write"
        if type(path) not in (str, bytes):   # a str subclass's own methods could show realpath another path
            return False
        try:
            real = os.path.realpath(os.fsdecode(path))
        except (OSError, ValueError):
            return False
        if (real + os.sep).startswith(here):   # anything in its own directory but a device or FIFO (os.mknod)
            return not os.path.exists(real) or os.path.isfile(real) or os.path.isdir(real)
        # the standard library: read its files and list its folders, never open a folder (a folder's descriptor,
        # passed as dir_fd=, would take a path that looks inside the sandbox to a file outside it)
        return (real + os.sep).startswith(lib) and (os.path.isfile(real) if how == "read" else
                                                    how == "list" and os.path.isdir(real))
    banned = ("os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg",
              "socket.", "ctypes.", "resource.", "cpython.PyInterpreterState_New")   # (sub-interpreters lack the hook)
    def hook(event, args):
        if event.startswith(banned) or event == "import" and args[0] == "_posixsubprocess":   # fork_exec isn't audited
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            write = any(c in (mode or "") for c in "wax+") or flags & (
                os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND)   # O_RDONLY | O_TRUNC truncates
            ok = type(path) is int or allowed(path, "write" if write else "read")
        elif event.startswith(("os.", "shutil.")):   # remove, rename, link, chmod, mkdir, utime, copy...: all write
            how = "list" if event in ("os.listdir", "os.scandir", "os.walk") else "write"
            ok = all(allowed(a, how) for a in args if isinstance(a, (str, bytes)))
        else:
            ok = True
        if not ok:
            raise PermissionError(f"sandbox: {event} outside the sandbox")
    sys.addaudithook(hook)
    ns = {"__name__": "__completion__"}
    try:
        exec(compile(code, "<completion>", "exec"), ns)
    except BaseException:   # a crash or sys.exit() at import: the tests still run (and fail if nothing was defined)
        pass
    for i, expr in enumerate(exprs):
        try:   # the value must be JSON: an object of the completion's own class fails
            os.write(1, f"\n{nonce} {i} {json.dumps(eval(expr, ns))}\n".encode())
        except BaseException:
            pass
_main(*json.loads(open(sys.argv[1]).read()))
"""


def split_test(test: str) -> tuple[str, bool, object]:
    """'assert E == V' -> (E, False, V), 'assert E' -> (E, True, True), 'assert not E' -> (E, True, False): what the
    child evaluates, whether only its truth counts, and the expected value as JSON sees it (tuples are lists). The
    tests are this project's own, so any other form is a bug."""
    node = ast.parse(test).body[0]
    if not isinstance(node, ast.Assert):
        raise ValueError(f"not an assert: {test!r}")
    e = node.test
    if isinstance(e, ast.Compare) and len(e.ops) == 1 and isinstance(e.ops[0], ast.Eq):
        return ast.unparse(e.left), False, json.loads(json.dumps(ast.literal_eval(e.comparators[0])))
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
        return ast.unparse(e.operand), True, False
    return ast.unparse(e), True, True


def run_tests(code: str, tests: list[str], *, timeout_s: float = 5.0, cpu_s: int = 4, mem_mb: int = 512) -> int:
    """Number of `tests` (assert statements, see split_test) that pass after `code` has run, in the sandbox."""
    checks, nonce = [split_test(t) for t in tests], secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="grpo_sandbox_", ignore_cleanup_errors=True) as root:
        work, args = os.path.join(root, "work"), os.path.join(root, "args.json")
        os.mkdir(work)
        with open(args, "w") as f:   # read by the prologue before its hook shuts everything outside `work`
            json.dump([nonce, code, [expr for expr, _, _ in checks], cpu_s, mem_mb], f)
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", PROLOGUE, args], cwd=work, env={},
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        out, deadline = b"", time.monotonic() + timeout_s
        try:   # read until EOF (the child is gone), the deadline, or 1 MiB; poll() wakes as soon as the child exits,
            poller = select.poll()   # where Popen.wait(timeout) sleeps in steps of up to 50 ms
            poller.register(proc.stdout, select.POLLIN)
            while len(out) < 1 << 20 and poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                out += chunk
        finally:
            try:   # the whole session (if anything got through, it goes too); before wait(), so the pid is still ours
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            proc.stdout.close()
    text = out.decode("utf-8", "replace")
    lines = {}
    for line in text.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0] == nonce:
            lines.setdefault(parts[1], []).append(parts[2])
    passed = 0
    for i, (_, truth, want) in enumerate(checks):
        got = lines.get(str(i), [])
        if len(got) != 1:   # none, or a second one: the completion found the nonce and offers a guess of its own
            continue
        try:
            value = json.loads(got[0])   # plain data; never unpickled
        except (ValueError, RecursionError):
            continue
        passed += (bool(value) if truth else value) == want
    return passed


def extract_code(completion: str) -> str | None:
    """The last <answer>...</answer>, without a ```python fence around it."""
    code = last_answer(completion) if isinstance(completion, str) else None
    if code is None:
        return None
    code = code.strip()
    if code.startswith("```"):
        code = code.split("\n", 1)[1] if "\n" in code else ""
        code = code.rsplit("```", 1)[0]
    return code


def code_reward(completion, sample):
    """Fraction of the sample's unit tests that pass; 0 without an answer. Never raises."""
    code = extract_code(completion)
    tests = sample.get("tests") if isinstance(sample, dict) else None
    if not code or not isinstance(tests, list) or not tests:
        return 0.0
    try:
        return run_tests(code, tests) / len(tests)
    except Exception:   # could not start the child (out of processes or files), or a malformed test: no credit
        return 0.0


# (function, what it must do, a reference solution, unit tests): written for this project
PROBLEMS = [
    ("add(a, b)", "returns the sum of a and b", "def add(a, b):\n    return a + b",
     ["assert add(1, 2) == 3", "assert add(-5, 5) == 0", "assert add(10, 32) == 42"]),
    ("is_even(n)", "returns True if the integer n is even", "def is_even(n):\n    return n % 2 == 0",
     ["assert is_even(4)", "assert not is_even(7)", "assert is_even(0)", "assert not is_even(-3)"]),
    ("reverse(s)", "returns the string s reversed", "def reverse(s):\n    return s[::-1]",
     ["assert reverse('abc') == 'cba'", "assert reverse('') == ''", "assert reverse('racecar') == 'racecar'"]),
    ("maximum(xs)", "returns the largest number of the non-empty list xs without using max()",
     "def maximum(xs):\n    m = xs[0]\n    for x in xs:\n        if x > m:\n            m = x\n    return m",
     ["assert maximum([1, 5, 3]) == 5", "assert maximum([-2, -9]) == -2", "assert maximum([7]) == 7"]),
    ("count_vowels(s)", "returns how many characters of s are vowels (a, e, i, o, u, either case)",
     "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)",
     ["assert count_vowels('hello') == 2", "assert count_vowels('xyz') == 0", "assert count_vowels('AEiou') == 5"]),
    ("factorial(n)", "returns n! for an integer n >= 0",
     "def factorial(n):\n    r = 1\n    for i in range(2, n + 1):\n        r *= i\n    return r",
     ["assert factorial(0) == 1", "assert factorial(5) == 120", "assert factorial(10) == 3628800"]),
    ("fib(n)", "returns the n-th Fibonacci number, fib(0) = 0 and fib(1) = 1",
     "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
     ["assert fib(0) == 0", "assert fib(1) == 1", "assert fib(10) == 55", "assert fib(30) == 832040"]),
    ("is_palindrome(s)", "returns True if s reads the same backwards, ignoring case",
     "def is_palindrome(s):\n    return s.lower() == s.lower()[::-1]",
     ["assert is_palindrome('Level')", "assert not is_palindrome('abc')", "assert is_palindrome('')"]),
    ("sum_digits(n)", "returns the sum of the decimal digits of the integer n >= 0",
     "def sum_digits(n):\n    return sum(int(d) for d in str(n))",
     ["assert sum_digits(0) == 0", "assert sum_digits(123) == 6", "assert sum_digits(9999) == 36"]),
    ("unique(xs)", "returns the elements of xs without repeats, in the order they first appear",
     "def unique(xs):\n    out = []\n    for x in xs:\n        if x not in out:\n            out.append(x)\n    return out",
     ["assert unique([1, 2, 1, 3, 2]) == [1, 2, 3]", "assert unique([]) == []", "assert unique(['a', 'a']) == ['a']"]),
    ("gcd(a, b)", "returns the greatest common divisor of two positive integers",
     "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a",
     ["assert gcd(12, 18) == 6", "assert gcd(7, 13) == 1", "assert gcd(100, 10) == 10"]),
    ("is_prime(n)", "returns True if the integer n is a prime number",
     "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))",
     ["assert is_prime(2)", "assert not is_prime(1)", "assert is_prime(97)", "assert not is_prime(91)"]),
    ("word_count(s)", "returns the number of words of s, words being separated by whitespace",
     "def word_count(s):\n    return len(s.split())",
     ["assert word_count('a b  c') == 3", "assert word_count('') == 0", "assert word_count(' one ') == 1"]),
    ("flatten(xss)", "returns one list with the elements of the lists in xss, in order",
     "def flatten(xss):\n    return [x for xs in xss for x in xs]",
     ["assert flatten([[1], [2, 3], []]) == [1, 2, 3]", "assert flatten([]) == []"]),
    ("clamp(x, lo, hi)", "returns x limited to the range lo..hi",
     "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))",
     ["assert clamp(5, 0, 10) == 5", "assert clamp(-1, 0, 10) == 0", "assert clamp(11, 0, 10) == 10"]),
    ("second_largest(xs)", "returns the second largest distinct value of xs (which has at least two)",
     "def second_largest(xs):\n    return sorted(set(xs))[-2]",
     ["assert second_largest([1, 3, 2]) == 2", "assert second_largest([5, 5, 4]) == 4"]),
]


def code_samples(split: str, tokenizer) -> list[dict]:
    """Every fourth problem is held out ("test")."""
    from tasks import chat_prompt
    out = []
    for i, (signature, what, solution, tests) in enumerate(PROBLEMS):
        if (i % 4 == 3) == (split == "test"):
            user = (f"Write a Python function `{signature}` that {what}. Put only the code of the function "
                    f"in <answer> </answer>.")
            out.append({"prompt": chat_prompt(tokenizer, user), "answer": solution, "tests": tests})
    return out
