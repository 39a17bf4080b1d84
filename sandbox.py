"""The code task's reward: a completion's Python runs against unit tests in a child process (the rule-based
"reward server" of code-RL pipelines, kept local and small).

The child is `python -I -S` (isolated: no PYTHON* variables, no site-packages) started with an EMPTY
environment (no token or key of the trainer's reaches it) in a fresh temporary directory, in a session of its
own that is killed whole after `timeout_s`. Before the completion runs, a trusted prologue sets resource limits
(CPU seconds, address space, file size, open files) and installs an audit hook (PEP 578) that refuses
processes (fork, exec, subprocess, os.system), sockets, ctypes, signals to other processes, reading outside
the standard library and the temporary directory (no /proc/<pid>/environ, no project files), and writing,
renaming or deleting outside the temporary directory. Each passed test prints a line carrying a random nonce
the completion is not given, so printing "ok" or exiting early scores nothing.

This is defence in depth for a teaching project, NOT a security boundary: in-process Python code can reach the
nonce (frame introspection) or find a way around an audit hook. For completions from models you do not trust,
run this in a container or jail (nsjail, firejail, gVisor) as well. RLIMIT_NPROC is not relied on: root
ignores it (the audit hook stops forks instead).
"""
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile

from rewards import last_answer

PROLOGUE = r'''
import os, resource, sys
def _main(nonce, code, tests, cpu_s, mem_mb):
    for lim, val in ((resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_AS, mem_mb << 20),
                     (resource.RLIMIT_FSIZE, 1 << 20), (resource.RLIMIT_NOFILE, 64)):
        resource.setrlimit(lim, (val, val))
    here, lib = os.getcwd() + os.sep, (os.path.realpath(sys.base_prefix) + os.sep, os.path.realpath(sys.prefix) + os.sep)
    def inside(path, roots):
        try:
            return isinstance(path, (str, bytes)) and (os.path.realpath(os.fsdecode(path)) + os.sep).startswith(roots)
        except Exception:
            return False
    banned = ("os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty", "subprocess.Popen",
              "os.kill", "os.killpg", "signal.pthread_kill", "socket.", "ctypes.", "os.putenv", "os.unsetenv",
              "os.chdir", "os.setsid", "resource.setrlimit", "gc.get_")
    def hook(event, args):
        if event.startswith(banned):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and isinstance(args[0], (str, bytes)):
            write = any(c in (args[1] or "") for c in "wax+") or (args[2] or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            if not inside(args[0], (here,) if write else (here, *lib)):
                raise PermissionError(f"sandbox: open({args[0]!r}) outside the sandbox")
        if event in ("os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.symlink", "os.link", "os.chmod",
                     "os.truncate", "os.utime", "shutil.rmtree") and not all(
                inside(a, (here,)) for a in args if isinstance(a, (str, bytes))):
            raise PermissionError(f"sandbox: {event} outside the sandbox")
    sys.addaudithook(hook)
    ns = {"__name__": "__completion__"}
    try:
        exec(compile(code, "<completion>", "exec"), ns)
    except BaseException:
        pass
    for i, test in enumerate(tests):
        try:
            exec(compile(test, f"<test {i}>", "exec"), ns)
        except BaseException:
            continue
        sys.__stdout__.write(f"\n{nonce} {i}\n")
        sys.__stdout__.flush()
import json
_args = json.loads(sys.stdin.read())
del json
_main(*_args)
'''


def run_tests(code: str, tests: list[str], *, timeout_s: float = 5.0, cpu_s: int = 4, mem_mb: int = 512) -> int:
    """Number of `tests` (Python statements, usually asserts) that pass after `code` has run, in the sandbox."""
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="grpo_sandbox_") as tmp, open(os.path.join(tmp, ".out"), "w+") as out:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", PROLOGUE], cwd=tmp, env={},
                                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.communicate(json.dumps([nonce, code, tests, cpu_s, mem_mb]).encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:   # the whole session: whatever it started (if anything got through) goes too
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        lines = out.read(1 << 20).splitlines()   # the prologue capped the file at 1 MiB
    return len({line.split()[1] for line in lines if line.startswith(nonce + " ") and len(line.split()) == 2})


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
    if not code or not tests:
        return 0.0
    try:
        return run_tests(code, tests) / len(tests)
    except OSError:   # could not even start the child (out of processes or files): no credit, and the run goes on
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
