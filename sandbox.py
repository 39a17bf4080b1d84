"""Runs a completion's Python against unit tests in a jail: the engine of the code reward
(rewards.code_reward), the rule-based "reward server" of code-RL pipelines, kept local and small. It imports
no project module.

The jail is bubblewrap (`bwrap`, Debian's `bubblewrap`, the sandbox Flatpak uses), one per completion: new
user, PID, network, IPC, UTS and mount namespaces; a root file system holding only /usr and the Python
installation, read-only; a 16 MiB tmpfs as the working folder (/tmp); its own /proc (its own processes only)
and a minimal, read-only /dev; an empty environment; no new user namespaces; and a seccomp filter that refuses
every new process (fork, vfork, clone without CLONE_THREAD; clone3 answers ENOSYS so that threads fall back to
clone). RLIMIT_NPROC cannot do that last part: it does not bind root, and the trainer often runs as root. The
project, the trainer's environment and files, other processes and the network are not in the jail at all.
A trusted prologue sets resource limits (CPU seconds, address space, file size, open files, no core dumps)
before the completion runs; the wall clock is watched from outside, and at `timeout_s` or 1 MiB of output the
jail is killed whole (its PID namespace dies with it, and with the trainer: --die-with-parent). The
in-process audit hook that was this file's defence is gone: the code it watched could patch it (issue 14), and
inside the jail there is nothing left for it to guard.

The child only computes, the parent judges. A test `assert E == V` (or `assert E`, `assert not E`) is split in
the parent: the jail is sent E alone and writes back E's value as JSON; the parent compares it with V, which
never leaves the parent (nor do the reference solutions, which live in tasks.py). So nothing the completion
does (an object whose __eq__ is always True, patched builtins, sys.exit(), printed fake results) passes a test
without producing the right values. Result lines carry a random nonce only so that the completion's own
prints are not taken for results.

GRPO_UNJAILED=1 runs the same child without the jail (`python -I -S`, an empty environment, a temporary
folder, the same resource limits): no isolation at all, for completions you trust, or inside a container of
its own.
"""
import ast
import contextlib
import errno
import json
import os
import platform
import secrets
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

UNJAILED = "GRPO_UNJAILED"
NO_BWRAP = ("the code reward runs each completion in a bubblewrap jail and `bwrap` is not installed: "
            "`apt-get install bubblewrap` (the package is `bubblewrap` on Debian, Ubuntu, Fedora and Arch), "
            f"or set {UNJAILED}=1 to run completions unjailed, knowingly")
TMP_MB = 16   # the jail's working folder is memory: bound it (RLIMIT_FSIZE bounds only one file)

PROLOGUE = r"""
import json, os, resource, sys
def _main(nonce, code, exprs, cpu_s, mem_mb):
    limits = {"CPU": cpu_s, "AS": mem_mb << 20, "CORE": 0, "FSIZE": 1 << 20, "NOFILE": 64}
    for name, val in limits.items():   # the hard limits too: in the jail nothing can raise them again
        resource.setrlimit(getattr(resource, "RLIMIT_" + name), (val, val))
    # before the completion runs, which therefore cannot hide it: the parent knows the jail started
    os.write(1, f"\n{nonce} ready\n".encode())
    ns = {"__name__": "__completion__"}
    try:
        exec(compile(code, "<completion>", "exec"), ns)
    except BaseException:   # a crash or sys.exit() at import: the tests still run (and fail if need be)
        pass
    for i, expr in enumerate(exprs):
        try:   # the value must be JSON: an object of the completion's own class fails
            os.write(1, f"\n{nonce} {i} {json.dumps(eval(expr, ns))}\n".encode())
        except BaseException:
            pass
_main(*json.loads(sys.stdin.read()))
"""

# seccomp, by machine: (AUDIT_ARCH_*, clone, clone3, [refused]), numbers from the kernel's syscall tables;
# refused: fork, vfork (x86_64 only), and SysV shmget, msgget, semget, whose memory outlives a detach and is
# not bound by RLIMIT_AS (it lives until the jail's IPC namespace goes)
SECCOMP_ARCH = {"x86_64": (0xC000003E, 56, 435, [57, 58, 29, 68, 64]),
                "aarch64": (0xC00000B7, 220, 435, [194, 186, 190])}


def seccomp_filter(machine: str) -> bytes:
    """A classic-BPF seccomp program (what bwrap --seccomp reads) that refuses to create processes: fork and
    vfork get EPERM, clone too unless it makes a thread (CLONE_THREAD), clone3 ENOSYS (its flags are behind a
    pointer BPF cannot follow; glibc then falls back to clone); SysV IPC objects get EPERM. Another ABI
    (i386, x32) kills the process."""
    if machine not in SECCOMP_ARCH:
        raise RuntimeError(f"no seccomp filter for {machine} (only {', '.join(SECCOMP_ARCH)}); "
                           f"set {UNJAILED}=1 to run completions unjailed, knowingly")
    arch, clone, clone3, refused = SECCOMP_ARCH[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06   # BPF_LD|W|ABS, BPF_JMP|JEQ|JGE|JSET|K, BPF_RET|K
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    n = len(refused)
    # (code, jump if true, jump if false, k); a jump skips that many instructions
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, 0x80000000),   # the arch, or kill the process
            (ld, 0, 0, 0), (jge, 6 + n, 0, 0x40000000), (jeq, 5 + n, 0, clone3),   # nr; x32, clone3: ENOSYS
            *[(jeq, 2 + n - k, 0, nr) for k, nr in enumerate(refused)],            # refused: EPERM
            (jeq, 0, 3, clone), (ld, 0, 0, 16), (jset, 1, 0, 0x10000),             # clone: CLONE_THREAD?
            (ret, 0, 0, eperm), (ret, 0, 0, allow), (ret, 0, 0, enosys)]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


def jail_argv(bwrap: str, seccomp_fd: int) -> list[str]:
    """bwrap's arguments up to the command: see the module's docstring."""
    python = os.path.realpath(sys.executable)
    # /usr (the C library and what else the interpreter links) and the Python installation, however installed
    # (a venv's interpreter resolves to its base; the standard library is under base_prefix)
    roots = sorted({"/usr", os.path.realpath(sys.base_prefix), os.path.dirname(os.path.dirname(python))})
    roots = [r for r in roots if not any(r.startswith(o + os.sep) for o in roots)]
    # (--unshare-all alone makes no user namespace when bwrap runs as root)
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--clearenv", "--seccomp", str(seccomp_fd)]
    for r in roots:
        argv += ["--ro-bind", r, r]
    for d in ("/lib", "/lib64", "/lib32"):   # merged-/usr systems have them as symlinks into /usr
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    return argv + ["--proc", "/proc", "--dev", "/dev", "--size", str(TMP_MB << 20), "--tmpfs", "/tmp",
                   "--chdir", "/tmp", "--remount-ro", "/", "--remount-ro", "/dev"]


def check_jail() -> None:
    """RuntimeError, saying what to do, if completions cannot be jailed here; a warning if GRPO_UNJAILED=1."""
    if os.environ.get(UNJAILED) == "1":
        print(f"{UNJAILED}=1: the code reward runs completions WITHOUT a jail (no isolation)",
              file=sys.stderr)
        return
    if run_tests("X = 6 * 7", ["assert X == 42"]) != 1:
        raise RuntimeError("the bubblewrap jail started but did not run a trivial program correctly")


def split_test(test: str) -> tuple[str, bool, object]:
    """'assert E == V' -> (E, False, V), 'assert E' -> (E, True, True), 'assert not E' -> (E, True, False):
    what the child evaluates, whether only its truth counts, and the expected value as JSON sees it (tuples
    are lists). The tests are the task's own, so any other form is a bug (ValueError)."""
    node = ast.parse(test).body[0]
    if not isinstance(node, ast.Assert):
        raise ValueError(f"not an assert: {test!r}")
    e = node.test
    if isinstance(e, ast.Compare) and len(e.ops) == 1 and isinstance(e.ops[0], ast.Eq):
        return ast.unparse(e.left), False, json.loads(json.dumps(ast.literal_eval(e.comparators[0])))
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
        return ast.unparse(e.operand), True, False
    return ast.unparse(e), True, True


def run_tests(code: str, tests: list[str], *, timeout_s: float = 5.0, cpu_s: int = 4,
              mem_mb: int = 512) -> int:
    """Number of `tests` (assert statements, see split_test) that pass after `code` has run, in the jail.
    RuntimeError if the jail did not start (bwrap missing or refused), naming bwrap's complaint."""
    checks, nonce = [split_test(t) for t in tests], secrets.token_hex(16)
    payload = json.dumps([nonce, code, [expr for expr, _, _ in checks], cpu_s, mem_mb]).encode()
    command = [os.path.realpath(sys.executable), "-I", "-S", "-c", PROLOGUE]
    unjailed, fds = os.environ.get(UNJAILED) == "1", []
    workdir = tempfile.TemporaryDirectory(prefix="grpo_sandbox_") if unjailed else contextlib.nullcontext("/")
    with workdir as cwd:
        try:
            if not unjailed:
                bwrap = shutil.which("bwrap")
                if bwrap is None:
                    raise RuntimeError(NO_BWRAP)
                fds = list(os.pipe())   # the seccomp program, read by bwrap from the pipe's end
                os.write(fds[1], seccomp_filter(platform.machine()))
                os.close(fds.pop())
                command = jail_argv(bwrap, fds[0]) + ["--", *command]
            proc = subprocess.Popen(command, cwd=cwd, env={}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True, pass_fds=fds)
        finally:
            for fd in fds:
                os.close(fd)
        out, deadline = b"", time.monotonic() + timeout_s
        try:
            # the prologue reads all of stdin first thing; a jail that failed to start has closed it
            with contextlib.suppress(BrokenPipeError), proc.stdin:
                proc.stdin.write(payload)
            # read until EOF (every process of the jail is gone), the deadline, or 1 MiB; poll() wakes as soon
            # as the child exits, where Popen.wait(timeout) sleeps in steps of up to 50 ms
            poller = select.poll()
            poller.register(proc.stdout, select.POLLIN)
            while len(out) < 1 << 20 and poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                out += chunk
        finally:
            try:   # bwrap (the jail's PID namespace dies with it); before wait(), so the pid is still ours
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            proc.stdout.close()
    lines, results = out.decode("utf-8", "replace").splitlines(), {}
    if f"{nonce} ready" not in lines:   # printed before the completion runs: what is here is bwrap's error
        raise RuntimeError(f"the code reward's jail did not start (bubblewrap >= 0.8 with user namespaces is "
                           f"needed, or {UNJAILED}=1): {out[-2000:].decode('utf-8', 'replace').strip()}")
    for line in lines:
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0] == nonce:
            results.setdefault(parts[1], []).append(parts[2])
    passed = 0
    for i, (_, truth, want) in enumerate(checks):
        got = results.get(str(i), [])
        # none, or a second one: the completion found the nonce and offers a guess of its own
        if len(got) != 1:
            continue
        try:
            value = json.loads(got[0])   # plain data
        except (ValueError, RecursionError):
            continue
        passed += (bool(value) if truth else value) == want
    return passed
