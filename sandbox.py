"""Runs a completion's Python against unit tests in a jail: the engine of the code reward
(rewards.code_reward), the rule-based "reward server" of code-RL pipelines, kept local and small. It imports
no project module.

The jail is bubblewrap (`bwrap`, Debian's `bubblewrap`, the sandbox Flatpak uses), one per completion: new
user, PID, network, IPC, UTS and mount namespaces; a root file system holding only /usr and the Python
installation, read-only; a 16 MiB tmpfs as the working folder (/tmp); its own /proc (its own processes
only, read-only: /proc/sys is the host's kernel settings) and a minimal, read-only /dev; an empty
environment; no new user namespaces; and a seccomp filter that refuses every new process (fork, vfork,
clone without CLONE_THREAD; clone3 answers ENOSYS so that threads fall back to clone), the kernel keyring
and a few calls only exploits use. The completion runs as "nobody" (JAIL_ID), inside the jail and on the
host, with no capability: when the trainer is root, a first bwrap of root's own (root_stage) starts the
jail's bwrap through setpriv as that user, since bwrap started by root keeps the jail root on the host.
The project, the trainer's environment and files, other processes and the network are not in the jail.
A trusted prologue sets resource limits (CPU seconds, address space, file size, open files, tasks, no core
dumps) before the completion runs; the wall clock is watched from outside, and at `timeout_s` (checked before
every read) or 1 MiB of output the jail is killed whole (its PID namespace dies with it, and with the trainer:
--die-with-parent). The
in-process audit hook that was this file's defence is gone: the code it watched could patch it (issue 14), and
inside the jail there is nothing left for it to guard.

The child only computes, the parent judges. A test `assert E == V` (or `assert E`, `assert not E`) is split in
the parent: the jail is sent E alone and writes back E's value as a Python literal of plain types (a tuple
stays a tuple), read back with ast.literal_eval; the parent compares it with V, which
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
NO_SETPRIV = ("the trainer runs as root, so the code reward starts its jail as an unprivileged user with "
              "util-linux's `setpriv`, which is not installed: `apt-get install util-linux`, or run the "
              f"trainer as another user, or set {UNJAILED}=1 to run completions unjailed, knowingly")
TMP_MB = 16   # the jail's working folder is memory: bound it (RLIMIT_FSIZE bounds only one file)
OUTPUT_CAP = 1 << 20   # bytes of the jail's output read at most

PROLOGUE = r"""
import json, os, resource, sys
def _literal(v):
    # the value as a Python literal of plain types (the parent reads it back with ast.literal_eval), so that
    # what equality depends on crosses: a tuple is no list, {1: 2} no {"1": 2}; any other type raises
    for base in (bool, int, float, complex, str, bytes):
        if isinstance(v, base):
            return base.__repr__(v)
    if v is None:
        return "None"
    if isinstance(v, (tuple, list, set, frozenset)):
        items = ", ".join(map(_literal, v))
        if isinstance(v, tuple):
            return f"({items},)" if v else "()"
        return f"[{items}]" if isinstance(v, list) else f"{{{items}}}" if v else "set()"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v).__name__)
def _main(nonce, code, exprs, cpu_s, mem_mb, nproc):
    limits = {"CPU": cpu_s, "AS": mem_mb << 20, "CORE": 0, "FSIZE": 1 << 20, "NOFILE": 64, "NPROC": nproc}
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
        try:   # the value must be plain data: an object of the completion's own class fails
            os.write(1, f"\n{nonce} {i} {_literal(eval(expr, ns))}\n".encode())
        except BaseException:
            pass
_main(*json.loads(sys.stdin.read()))
"""

# seccomp, by machine: (AUDIT_ARCH_*, clone, clone3, [refused]), numbers from the kernel's syscall tables;
# refused: fork, vfork (x86_64 only); SysV shmget, msgget, semget, whose memory outlives a detach and is not
# bound by RLIMIT_AS (it lives until the jail's IPC namespace goes); add_key, request_key, keyctl: the kernel
# keyring is not namespaced, so a key one completion adds could be read by the next; and what no computation
# needs but kernel exploits use (Docker's default profile refuses them too): bpf, perf_event_open,
# userfaultfd, io_uring_setup, io_uring_enter, io_uring_register
SECCOMP_ARCH = {"x86_64": (0xC000003E, 56, 435,
                           [57, 58, 29, 68, 64, 248, 249, 250, 321, 298, 323, 425, 426, 427]),
                "aarch64": (0xC00000B7, 220, 435,
                            [194, 186, 190, 217, 218, 219, 280, 241, 282, 425, 426, 427])}
# the completion's user and group ("nobody"), inside the jail and on the host: never root in any namespace
JAIL_ID = 65534


def seccomp_filter(machine: str) -> bytes:
    """A classic-BPF seccomp program (what bwrap --seccomp reads) that refuses to create processes: fork and
    vfork get EPERM, clone too unless it makes a thread (CLONE_THREAD), clone3 ENOSYS (its flags are behind a
    pointer BPF cannot follow; glibc then falls back to clone); the other refused calls get EPERM. Another ABI
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


def _system_binds(roots: list[str]) -> list[str]:
    """bwrap arguments that mount `roots` read-only, with /lib, /lib64 and /lib32 as on the host."""
    argv = []
    for r in roots:
        argv += ["--ro-bind", r, r]
    for d in ("/lib", "/lib64", "/lib32"):   # merged-/usr systems have them as symlinks into /usr
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    return argv


def jail_argv(bwrap: str, seccomp_fd: int, setpriv: str | None = None) -> list[str]:
    """bwrap's arguments up to the command: see the module's docstring. `setpriv`: the trainer is root, and
    this is util-linux's setpriv, which starts the jail's bwrap as JAIL_ID (see root_stage)."""
    python = os.path.realpath(sys.executable)
    # /usr (the C library and what else the interpreter links) and the Python installation, however installed
    # (a venv's interpreter resolves to its base; the standard library is under base_prefix)
    roots = sorted({"/usr", os.path.realpath(sys.base_prefix), os.path.dirname(os.path.dirname(python))})
    roots = [r for r in roots if not any(r.startswith(o + os.sep) for o in roots)]
    # (--unshare-all alone makes no user namespace when bwrap runs as root); --remount-ro /proc: the jail's
    # /proc/sys is the host's kernel settings, and bwrap (0.8) leaves it writable to a root in the jail
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--clearenv", "--uid", str(JAIL_ID), "--gid", str(JAIL_ID), "--cap-drop", "ALL",
            "--seccomp", str(seccomp_fd), *_system_binds(roots),
            "--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev", "--size", str(TMP_MB << 20),
            "--tmpfs", "/tmp", "--chdir", "/tmp", "--remount-ro", "/", "--remount-ro", "/dev"]
    return root_stage(bwrap, setpriv, roots) + argv if setpriv else argv


def root_stage(bwrap: str, setpriv: str, roots: list[str]) -> list[str]:
    """The command that starts the jail's bwrap as JAIL_ID when the trainer is root. bwrap started by root
    maps the jail's user to the host's root (capabilities, host-wide /proc/sys, no RLIMIT_NPROC), so the
    jail's bwrap must be started by an unprivileged user; but the Python installation may lie where that user
    cannot look (root's home). This first bwrap, root's own and running nothing of the completion, makes a
    mount namespace with what the jail binds, on paths anyone can walk, then setpriv drops to JAIL_ID."""
    walkable = []   # every folder above a root, created world-searchable in the stage's empty root
    for r in roots:
        parts = r.strip(os.sep).split(os.sep)[:-1]
        walkable += [os.sep + os.sep.join(parts[:i + 1]) for i in range(len(parts))]
    tools = [t for t in map(os.path.realpath, (bwrap, setpriv))
             if not any(t.startswith(r + os.sep) for r in roots)]
    argv = [bwrap, "--die-with-parent"]
    for d in dict.fromkeys(walkable):
        argv += ["--perms", "0755", "--dir", d]
    for t in tools:
        argv += ["--ro-bind", t, t]
    # the jail's bwrap needs the host's /proc (to write its user namespace's maps) and /dev (for its own
    # /dev), and a /tmp to build its root in
    return argv + [*_system_binds(roots), "--bind", "/proc", "/proc", "--dev-bind", "/dev", "/dev",
                   "--tmpfs", "/tmp", "--", setpriv, f"--reuid={JAIL_ID}", f"--regid={JAIL_ID}",
                   "--clear-groups", "--"]


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
    what the child evaluates, whether only its truth counts, and the expected value, a Python literal (a
    tuple stays a tuple). The tests are the task's own, so any other form is a bug (ValueError)."""
    node = ast.parse(test).body[0]
    if not isinstance(node, ast.Assert):
        raise ValueError(f"not an assert: {test!r}")
    e = node.test
    if isinstance(e, ast.Compare) and len(e.ops) == 1 and isinstance(e.ops[0], ast.Eq):
        return ast.unparse(e.left), False, ast.literal_eval(e.comparators[0])
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
        return ast.unparse(e.operand), True, False
    return ast.unparse(e), True, True


def read_output(fd: int, deadline: float) -> bytes:
    """What the jail writes to `fd` until EOF (every process of the jail is gone), `deadline` (time.monotonic)
    or OUTPUT_CAP bytes, whichever comes first. The deadline is checked before every read, however much is
    waiting (a jail that writes a byte at a time keeps data waiting forever), and each read appends to one
    bytearray: the time spent is linear in what is read."""
    out, poller = bytearray(), select.poll()
    poller.register(fd, select.POLLIN)
    while len(out) < OUTPUT_CAP:
        left = deadline - time.monotonic()
        # poll() wakes as soon as the child writes or exits, where Popen.wait(timeout) sleeps in steps
        if left <= 0 or not poller.poll(left * 1000):
            break
        chunk = os.read(fd, OUTPUT_CAP - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def run_tests(code: str, tests: list[str], *, timeout_s: float = 5.0, cpu_s: int = 4,
              mem_mb: int = 512, nproc: int = 64) -> int:
    """Number of `tests` (assert statements, see split_test) that pass after `code` has run, in the jail.
    `nproc`: the most tasks (processes and threads) of the jail's user. RuntimeError if the jail did not start
    (bwrap missing or refused), naming bwrap's complaint."""
    checks, nonce = [split_test(t) for t in tests], secrets.token_hex(16)
    payload = json.dumps([nonce, code, [expr for expr, _, _ in checks], cpu_s, mem_mb, nproc]).encode()
    command = [os.path.realpath(sys.executable), "-I", "-S", "-c", PROLOGUE]
    unjailed, fds = os.environ.get(UNJAILED) == "1", []
    workdir = tempfile.TemporaryDirectory(prefix="grpo_sandbox_") if unjailed else contextlib.nullcontext("/")
    with workdir as cwd:
        try:
            if not unjailed:
                bwrap, setpriv = shutil.which("bwrap"), shutil.which("setpriv")
                if bwrap is None:
                    raise RuntimeError(NO_BWRAP)
                if os.geteuid() == 0 and setpriv is None:
                    raise RuntimeError(NO_SETPRIV)
                fds = list(os.pipe())   # the seccomp program, read by bwrap from the pipe's end
                os.write(fds[1], seccomp_filter(platform.machine()))
                os.close(fds.pop())
                command = jail_argv(bwrap, fds[0], setpriv if os.geteuid() == 0 else None) + ["--", *command]
            proc = subprocess.Popen(command, cwd=cwd, env={}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True, pass_fds=fds)
        finally:
            for fd in fds:
                os.close(fd)
        deadline = time.monotonic() + timeout_s
        try:
            # the prologue reads all of stdin first thing; a jail that failed to start has closed it
            with contextlib.suppress(BrokenPipeError), proc.stdin:
                proc.stdin.write(payload)
            out = read_output(proc.stdout.fileno(), deadline)
        finally:
            try:   # bwrap (the jail's PID namespace dies with it); before wait(), so the pid is still ours
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            proc.stdout.close()
    # only whole lines: one cut at the cap or the deadline may be a prefix of another value ("12" of "123")
    lines, results = out.decode("utf-8", "replace").split("\n")[:-1], {}
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
            value = ast.literal_eval(got[0])   # plain data: literals only, nothing runs
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        passed += (bool(value) if truth else value) == want
    return passed
