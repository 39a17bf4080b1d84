"""Runs a completion's Python against unit tests in a jail: the engine of the code reward
(rewards.code_reward), the rule-based "reward server" of code-RL pipelines, kept local and small. It imports
no project module.

The jail is bubblewrap (`bwrap`, Debian's `bubblewrap`, the sandbox Flatpak uses), one per completion: new
user, PID, network, IPC, UTS and mount namespaces; a root file system holding only /usr and the Python
installation, read-only; a tmpfs of 16 MiB and 4,096 files as the working folder (/tmp, mounted by the
trusted prologue: bwrap's --tmpfs bounds no files); its own /proc (its own processes
only, read-only: /proc/sys is the host's kernel settings) and a minimal, read-only /dev; an empty
environment; no new user namespaces; and a seccomp filter that refuses every new process (fork, vfork,
clone without CLONE_THREAD; clone3 answers ENOSYS so that threads fall back to clone), the kernel keyring
and a few calls only exploits use. The completion runs as "nobody" (JAIL_ID) inside the jail, with no
capability; when the trainer is root, as a host uid of its own (host_uid: one per running jail, which no
account has): a first bwrap of root's own (root_stage) starts the jail's bwrap through setpriv as that
user, since bwrap started by root keeps the jail root on the host. Where user namespaces are refused
(Docker's default seccomp profile, Ubuntu 24.04's AppArmor), the jail cannot start and check_jail says in
one line what to run instead (USERNS_BLOCKED).
The project, the trainer's environment and files, other processes and the network are not in the jail.
A trusted prologue sets resource limits (CPU seconds, address space, file size, open files, tasks, no core
dumps) before the completion runs; the wall clock is watched from outside, and at `timeout_s` (checked before
every read) or 1 MiB of output the jail is killed whole (its PID namespace dies with it, and with the trainer:
--die-with-parent). The
in-process audit hook that was this file's defence is gone: the code it watched could patch it (issue 14), and
inside the jail there is nothing left for it to guard.

The child only computes, the parent judges. Each test `assert E` is parsed in the parent (split_test):
the jail is sent only the parts of E that call or name the completion's code (`f(x, k=[1])`) and writes
back their values, as JSON of plain types with each container tagged (a tuple stays a tuple); the parent
reads them with a bounded parser (read_value: size, depth, hash collisions) and evaluates the rest of E
itself with trusted builtins (judge): every comparison, sum, and/or/not and `in`. The expected values
never leave the parent (nor do the reference solutions, which live in tasks.py), and nothing the
completion does (an object whose __eq__ is always True, patched builtins or reporting helpers, the nonce
read through sys._getframe and result lines forged with it, sys.exit()) passes a test without producing
the right values. Result lines carry a random nonce only so that the completion's own prints are not
taken for results.

GRPO_UNJAILED=1 runs the same child without the jail (`python -I -S`, an empty environment, a temporary
folder, the same resource limits): no isolation at all, for completions you trust, or inside a container of
its own.
"""
import ast
import builtins
import contextlib
import errno
import grp
import json
import math
import operator
import os
import platform
import pwd
import random
import re
import secrets
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time

UNJAILED = "GRPO_UNJAILED"
NO_BWRAP = ("the code reward runs each completion in a bubblewrap jail and `bwrap` is not installed: "
            "`apt-get install bubblewrap` (the package is `bubblewrap` on Debian, Ubuntu, Fedora and Arch), "
            f"or set {UNJAILED}=1 to run completions unjailed, knowingly")
NO_SETPRIV = ("the trainer runs as root, so the code reward starts its jail as an unprivileged user with "
              "util-linux's `setpriv`, which is not installed: `apt-get install util-linux`, or run the "
              f"trainer as another user, or set {UNJAILED}=1 to run completions unjailed, knowingly")
# bwrap's words where user namespaces are refused: Docker's default seccomp profile ("No permissions to
# create new namespace"), Ubuntu 24.04's AppArmor restriction ("setting up uid map: Permission denied")
USERNS_REFUSED = re.compile(r"No permissions to create new namespace|Creating new namespace failed|"
                            r"uid map: Permission denied|RTM_NEWADDR: Operation not permitted")
USERNS_BLOCKED = ("user namespaces are refused here (Docker's default seccomp profile, or Ubuntu "
                  "24.04's AppArmor restriction), so bubblewrap cannot make the code reward's jail: run the "
                  "container with `docker run --security-opt seccomp=unconfined`, or on Ubuntu "
                  "`sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`, or set GRPO_UNJAILED=1 "
                  "inside a container of its own, knowingly (no jail)")
TMP_MB = 16   # the jail's working folder is memory: bound it (RLIMIT_FSIZE bounds only one file)
TMP_FILES = 4096   # and its files: each costs the host's kernel memory whatever its size
OUTPUT_CAP = 1 << 20   # bytes of the jail's output read at most
JAIL_MB = 512 + TMP_MB   # the most memory one jail may hold: run_tests' mem_mb and its /tmp

PROLOGUE = r"""
import json, os, resource, sys
def _plain(v):
    # the value as JSON of plain types, each container tagged with its type (a tuple stays a tuple, {1: 2}
    # no {"1": 2}), read back by the parent's bounded parser (sandbox.read_value); any other type raises
    if v is None or isinstance(v, (int, float, str)):
        return v
    if isinstance(v, complex):
        return ["complex", float(v.real), float(v.imag)]
    if isinstance(v, bytes):
        return ["bytes", bytes.hex(v)]
    for kind in (tuple, list, set, frozenset):
        if isinstance(v, kind):
            return [kind.__name__, *map(_plain, v)]
    if isinstance(v, dict):
        return ["dict", *(_plain(x) for pair in dict.items(v) for x in pair)]
    raise TypeError(type(v).__name__)
def _own_tmp(tmp_mb, tmp_files):
    # a /tmp that bounds files as well as bytes (bwrap's --tmpfs takes no nr_inodes): a mount namespace of
    # the jail's own user, with CAP_SYS_ADMIN and CAP_SETPCAP, which bwrap left for this alone; then every
    # capability is dropped, the bounding set too, before the completion runs, or the jail stops here
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    options = f"size={tmp_mb}m,nr_inodes={tmp_files},mode=0700".encode()
    # unshare(CLONE_NEWNS); mount with MS_NOSUID | MS_NODEV; prctl(PR_CAPBSET_DROP, cap); capset to none
    mounted = libc.unshare(0x20000) == 0 and libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 6, options) == 0
    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)
    libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)())
    caps = [l.split()[1] for l in open("/proc/self/status") if l.startswith("Cap")]
    if not mounted or set(caps) != {"0" * 16}:
        sys.exit(f"the jail's /tmp could not be made (errno {ctypes.get_errno()}), or capabilities stayed")
    os.chdir("/tmp")
def _main(nonce, code, exprs, cpu_s, mem_mb, nproc, tmp):
    if tmp:
        _own_tmp(*tmp)
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
    # only the values of the calls into the completion: every comparison, sum or truth test of a test is
    # the parent's (judge), so nothing here, patched or forged, decides whether a test passes
    for i, expr in enumerate(exprs):
        try:
            value = json.dumps(_plain(eval(expr, ns)), separators=(",", ":"))
            os.write(1, f"\n{nonce} {i} {value}\n".encode())
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
# the completion's user and group inside the jail ("nobody"): never root in any namespace
JAIL_ID = 65534
# when the trainer is root, the jail's user and group on the host: one uid per running jail, never a host
# account's (65534 is the host's "nobody", whose daemons could read and signal a jail), from a block of
# HOST_UID_BLOCK that each process picks at random in HOST_UIDS, far above login accounts and the
# subordinate ranges containers are given (from 100000)
HOST_UIDS, HOST_UID_BLOCK = range(1 << 30, (1 << 31) - (1 << 16)), 1024
_free_uids, _uid_lock = None, threading.Lock()


@contextlib.contextmanager
def host_uid():
    """A host uid (the same number as its gid) for one jail as long as it runs, held by no other jail of
    this process meanwhile: from this process's block (see HOST_UIDS), less any uid an account has."""
    global _free_uids
    with _uid_lock:
        if _free_uids is None:   # this process's first jail
            start = random.SystemRandom().randrange(HOST_UIDS.start, HOST_UIDS.stop, HOST_UID_BLOCK)
            accounts = {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
            _free_uids = [u for u in range(start, start + HOST_UID_BLOCK) if u not in accounts]
        if not _free_uids:
            raise RuntimeError(f"more than {HOST_UID_BLOCK} jails at once")
        uid = _free_uids.pop()
    try:
        yield uid
    finally:
        with _uid_lock:
            _free_uids.append(uid)


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


def jail_argv(bwrap: str, seccomp_fd: int, setpriv: str | None = None, uid: int = JAIL_ID) -> list[str]:
    """bwrap's arguments up to the command: see the module's docstring. `setpriv`: the trainer is root, and
    this is util-linux's setpriv, which starts the jail's bwrap as host user `uid` (see root_stage)."""
    python = os.path.realpath(sys.executable)
    # /usr (the C library and what else the interpreter links) and the Python installation, however installed
    # (a venv's interpreter resolves to its base; the standard library is under base_prefix)
    roots = sorted({"/usr", os.path.realpath(sys.base_prefix), os.path.dirname(os.path.dirname(python))})
    roots = [r for r in roots if not any(r.startswith(o + os.sep) for o in roots)]
    # (--unshare-all alone makes no user namespace when bwrap runs as root); --remount-ro /proc: the jail's
    # /proc/sys is the host's kernel settings, and bwrap (0.8) leaves it writable to a root in the jail
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--clearenv", "--uid", str(JAIL_ID), "--gid", str(JAIL_ID), "--cap-drop", "ALL",
            "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SETPCAP",
            "--seccomp", str(seccomp_fd), *_system_binds(roots),
            "--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev", "--size", str(TMP_MB << 20),
            "--tmpfs", "/tmp", "--chdir", "/tmp", "--remount-ro", "/", "--remount-ro", "/dev"]
    return root_stage(bwrap, setpriv, roots, uid) + argv if setpriv else argv


def root_stage(bwrap: str, setpriv: str, roots: list[str], uid: int) -> list[str]:
    """The command that starts the jail's bwrap as host user `uid` (host_uid) when the trainer is root.
    bwrap started by root maps the jail's user to the host's root (capabilities, host-wide /proc/sys, no
    RLIMIT_NPROC), so the jail's bwrap must be started by an unprivileged user; but the Python installation
    may lie where that user cannot look (root's home). This first bwrap, root's own and running nothing of
    the completion, makes a mount namespace with what the jail binds, on paths anyone can walk, then setpriv
    drops to `uid`."""
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
                   "--tmpfs", "/tmp", "--", setpriv, f"--reuid={uid}", f"--regid={uid}",
                   "--clear-groups", "--"]


def check_jail() -> None:
    """RuntimeError, saying what to do, if completions cannot be jailed here; a warning if GRPO_UNJAILED=1."""
    if os.environ.get(UNJAILED) == "1":
        print(f"{UNJAILED}=1: the code reward runs completions WITHOUT a jail (no isolation)",
              file=sys.stderr)
        return
    if run_tests("X = 6 * 7", ["assert X == 42"]) != 1:
        raise RuntimeError("the bubblewrap jail started but did not run a trivial program correctly")


# what the trainer evaluates itself in a test, with its own builtins: the rest goes to the jail
TRUSTED = {name: getattr(builtins, name) for name in (
    "abs", "all", "any", "bool", "float", "int", "isinstance", "len", "list", "max", "min", "round",
    "sorted", "str", "sum", "tuple", "type")}
MATH = {"isclose", "isnan", "isinf", "isfinite", "fabs", "sqrt", "floor", "ceil", "pi", "e", "inf", "nan"}
# nodes the trainer evaluates (their children may still be the jail's)
OWN = (ast.Constant, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.BinOp, ast.IfExp, ast.Tuple, ast.List,
       ast.Set, ast.Dict, ast.Subscript, ast.Slice)
# the parse of the jail's values: at most this many values and containers in one completion's, nested
# this deep, and this many distinct values sharing one hash (more make a set or dict quadratic)
MAX_NODES, MAX_DEPTH, MAX_COLLISIONS = 50_000, 64, 8
CMP = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
       ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
       ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_, ast.IsNot: operator.is_not}
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
          ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitAnd: operator.and_,
          ast.BitOr: operator.or_, ast.BitXor: operator.xor, ast.MatMult: operator.matmul}
UNARY = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}
STRING = re.compile(r'"[^"]*"')   # a JSON string once its escaped backslashes and quotes are gone


def hashed(kind, items):
    """kind(items) for a set, frozenset or dict (items: its keys, or (key, value) pairs for a dict), once
    no more than MAX_COLLISIONS distinct keys share a hash: keys of one hash (multiples of 2**61 - 1, or
    tuples built to collide) make each insertion compare with all before it. ValueError if they do."""
    items, seen = list(items), {}
    for key in (pair[0] for pair in items) if kind is dict else items:
        same = seen.setdefault(hash(key), [])
        if not any(key == other for other in same):
            same.append(key)
            if len(same) > MAX_COLLISIONS:
                raise ValueError("too many values share one hash")
    return kind(items)


def numeric_sum(items, start=0):
    """sum() of numbers only: summing lists (sum(xs, [])) copies the total so far at each item."""
    if not isinstance(start, (int, float, complex)):
        raise ValueError("sum() of numbers only")
    return sum(items, start)


TRUSTED.update(set=lambda items=(): hashed(set, items), frozenset=lambda items=(): hashed(frozenset, items),
               sum=numeric_sum)


def split_test(test: str) -> tuple[ast.expr, list[str]]:
    """'assert E' -> (E, the parts of E the jail computes). A part is a maximal subexpression that calls
    into or names the completion's code (`f(x, k=[1])`, `X`, `obj.m()`); the trainer evaluates the rest
    (judge): comparisons, arithmetic, and/or/not, containers, subscripts, TRUSTED's builtins and MATH's
    math functions, so the expected values never enter the jail and no verdict comes out of it. Each part
    is marked on its node (`node.jail`, its index). The tests are the task's own, so a test that is no
    assert, or that needs a comprehension or a lambda of the trainer's, is a bug (ValueError)."""
    body = ast.parse(test).body
    if len(body) != 1 or not isinstance(body[0], ast.Assert):
        raise ValueError(f"not an assert: {test!r}")
    parts = []

    def is_math(node):
        return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "math" and node.attr in MATH)

    def mark(node):
        if isinstance(node, (ast.operator, ast.cmpop, ast.boolop, ast.unaryop, ast.expr_context)) or (
                isinstance(node, ast.Name) and node.id in TRUSTED) or is_math(node):
            return
        if isinstance(node, ast.Call) and (is_math(node.func) or (
                isinstance(node.func, ast.Name) and node.func.id in TRUSTED)):
            children = [*node.args, *node.keywords]
        elif isinstance(node, (ast.keyword, *OWN)) and not (isinstance(node, ast.Dict) and None in node.keys):
            children = list(ast.iter_child_nodes(node))
        elif isinstance(node, (ast.Name, ast.Call, ast.Attribute)):
            node.jail = len(parts)
            parts.append(ast.unparse(node))
            return
        else:
            raise ValueError(f"{type(node).__name__} in a test the trainer cannot judge: {test!r}")
        for child in children:
            mark(child)
    mark(body[0].test)
    return body[0].test, parts


def judge(node: ast.expr, values: dict):
    """The value of a test's expression, evaluated here with trusted builtins; `values` holds what the jail
    computed for each marked part (split_test), by index. Raises (KeyError for a part without a value,
    ValueError for a result too big to build) where the test fails."""
    value = lambda n: judge(n, values)
    if hasattr(node, "jail"):
        return values[node.jail]
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return TRUSTED[node.id]
    if isinstance(node, ast.Attribute):
        return getattr(math, node.attr)
    if isinstance(node, ast.BoolOp):   # and/or stop at their first deciding value, as Python's
        for item in node.values:
            got = value(item)
            if bool(got) == isinstance(node.op, ast.Or):
                return got
        return got
    if isinstance(node, ast.Compare):
        left = value(node.left)
        for op, right in zip(node.ops, map(value, node.comparators)):
            if not CMP[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.UnaryOp):
        return UNARY[type(node.op)](value(node.operand))
    if isinstance(node, ast.BinOp):
        return binary(node.op, value(node.left), value(node.right))
    if isinstance(node, ast.IfExp):
        return value(node.body) if value(node.test) else value(node.orelse)
    if isinstance(node, (ast.Tuple, ast.List)):
        return (tuple if isinstance(node, ast.Tuple) else list)(map(value, node.elts))
    if isinstance(node, ast.Set):
        return hashed(set, map(value, node.elts))
    if isinstance(node, ast.Dict):
        return hashed(dict, zip(map(value, node.keys), map(value, node.values)))
    if isinstance(node, ast.Subscript):
        return value(node.value)[value(node.slice)]
    if isinstance(node, ast.Slice):
        return slice(*(None if n is None else value(n) for n in (node.lower, node.upper, node.step)))
    func = TRUSTED[node.func.id] if isinstance(node.func, ast.Name) else getattr(math, node.func.attr)
    return func(*map(value, node.args), **{k.arg: value(k.value) for k in node.keywords})


def binary(op: ast.operator, a, b):
    """a op b, refused (ValueError) where the jail's values would make it huge: a sequence repeated, a
    power or a shift past OUTPUT_CAP bytes, or formatting a string (its width is the completion's)."""
    sizes = [len(x) * y for x, y in ((a, b), (b, a)) if isinstance(x, (str, bytes, list, tuple))
             and isinstance(y, int)] if isinstance(op, ast.Mult) else []
    ints = isinstance(a, int) and isinstance(b, int)
    if (any(n > OUTPUT_CAP for n in sizes) or (isinstance(op, ast.LShift) and ints and b > 8 * OUTPUT_CAP)
            or (isinstance(op, ast.Pow) and ints and abs(a) > 1 and b * a.bit_length() > 8 * OUTPUT_CAP)
            or (isinstance(op, ast.Mod) and isinstance(a, (str, bytes)))):
        raise ValueError("too big")
    return BINARY[type(op)](a, b)


def read_value(text: str, budget: list[int]):
    """A value the jail wrote (JSON of plain types, containers tagged: see PROLOGUE's _plain), read without
    running anything and within bounds, counted before json parses it: budget[0] values at most (the rest
    is taken off it, across the values of one completion), MAX_DEPTH deep, sets and dicts through
    `hashed`, integers of at most sys.get_int_max_str_digits() digits. ValueError (TypeError for an
    unhashable key, RecursionError for a nest too deep for json) otherwise."""
    if len(text) > OUTPUT_CAP:
        raise ValueError("longer than the jail may write")
    # the counts must not see the text of strings ("," in "a,b"), when they matter: escapes go first, so
    # that every quote left is a string's end, and the scan is linear (else a string starts at each one)
    bare = text if text.count(",") < budget[0] else STRING.sub(
        "", text.replace("\\\\", "").replace('\\"', ""))
    budget[0] -= bare.count(",") + 1
    if budget[0] < 0:
        raise ValueError("too many values")
    return tagged(json.loads(text), MAX_DEPTH)


def tagged(value, depth: int):
    """json's value with its tagged containers built (["tuple", 1, 2] -> (1, 2)), at most `depth` deep."""
    if isinstance(value, dict):
        raise ValueError("a JSON object: the jail writes dicts as tagged lists")
    if not isinstance(value, list):
        return value
    if depth == 0:
        raise ValueError("nested too deep")
    tag, *rest = [tagged(x, depth - 1) for x in value] or [None]
    if tag in ("list", "tuple"):
        return rest if tag == "list" else tuple(rest)
    if tag in ("set", "frozenset"):
        return hashed(set if tag == "set" else frozenset, rest)
    if tag == "dict" and len(rest) % 2 == 0:
        return hashed(dict, zip(rest[::2], rest[1::2]))
    if tag == "bytes" and len(rest) == 1 and isinstance(rest[0], str):
        return bytes.fromhex(rest[0])
    if tag == "complex" and len(rest) == 2 and all(type(x) is float for x in rest):
        return complex(*rest)
    raise ValueError(f"not a tagged container: {tag!r}")


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
    exprs = [part for _, parts in checks for part in parts]
    tmp = None if os.environ.get(UNJAILED) == "1" else [TMP_MB, TMP_FILES]
    payload = json.dumps([nonce, code, exprs, cpu_s, mem_mb, nproc, tmp]).encode()
    command = [os.path.realpath(sys.executable), "-I", "-S", "-c", PROLOGUE]
    unjailed, fds, root = os.environ.get(UNJAILED) == "1", [], os.geteuid() == 0
    workdir = tempfile.TemporaryDirectory(prefix="grpo_sandbox_") if unjailed else contextlib.nullcontext("/")
    uid = host_uid() if root and not unjailed else contextlib.nullcontext(JAIL_ID)
    with workdir as cwd, uid as uid:
        try:
            if not unjailed:
                bwrap, setpriv = shutil.which("bwrap"), shutil.which("setpriv")
                if bwrap is None:
                    raise RuntimeError(NO_BWRAP)
                if root and setpriv is None:
                    raise RuntimeError(NO_SETPRIV)
                fds = list(os.pipe())   # the seccomp program, read by bwrap from the pipe's end
                os.write(fds[1], seccomp_filter(platform.machine()))
                os.close(fds.pop())
                command = jail_argv(bwrap, fds[0], setpriv if root else None, uid) + ["--", *command]
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
    if f"{nonce} ready" not in lines and USERNS_REFUSED.search(out[-2000:].decode("utf-8", "replace")):
        raise RuntimeError(USERNS_BLOCKED)
    if f"{nonce} ready" not in lines:   # printed before the completion runs: what is here is bwrap's error
        raise RuntimeError(f"the code reward's jail did not start (bubblewrap >= 0.8 with user namespaces is "
                           f"needed, or {UNJAILED}=1): {out[-2000:].decode('utf-8', 'replace').strip()}")
    for line in lines:
        fields = line.split(" ", 2)
        if len(fields) == 3 and fields[0] == nonce:
            results.setdefault(fields[1], []).append(fields[2])
    passed, budget, first = 0, [MAX_NODES], 0
    for expr, parts in checks:
        values = {}
        for k in range(len(parts)):
            got = results.get(str(first + k), [])
            # none, or a second one: the completion found the nonce and offers a guess of its own
            if len(got) == 1:
                with contextlib.suppress(ValueError, TypeError, RecursionError):
                    values[k] = read_value(got[0], budget)
        first += len(parts)
        try:
            passed += bool(judge(expr, values))
        except Exception:   # whatever a Python expression raises on these values: the test fails
            pass
    return passed
