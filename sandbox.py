"""Runs a completion's Python in a jail and hands back the values of a test's parts: the engine of the code
reward (rewards.code_reward), the rule-based "reward server" of code-RL pipelines, kept local and small. Its
one project module is judge.py, the trainer's side of each test.

The jail is bubblewrap (`bwrap`, Debian's `bubblewrap`, the sandbox Flatpak uses), one per completion: new
user, PID, network, IPC, UTS and mount namespaces; a root file system holding only /usr and the Python
installation, read-only; a tmpfs of 16 MiB and 4,096 files as the working folder (/tmp, mounted by the trusted
prologue: bwrap's --tmpfs bounds no files); its own /proc (its own processes only, read-only: /proc/sys is the
host's kernel settings) and a minimal, read-only /dev; an empty environment; no new user namespaces; the
completion's interpreter as the jail's pid 1 (no init of bwrap's beside it); and a seccomp filter that refuses
every new process (fork, vfork, clone without CLONE_THREAD; clone3 answers ENOSYS so that threads fall back to
clone), acting on another process (ptrace, process_vm_*), prctl(PR_SET_PDEATHSIG), the kernel keyring and a
few calls only exploits use. The completion runs as "nobody" (JAIL_ID) inside the jail, with no capability;
when the trainer is root, as a host uid of its own (host_uid: one per running jail, which no account has): a
first bwrap of root's own (root_stage) starts the jail's bwrap through setpriv as that user, since bwrap
started by root keeps the jail root on the host. Where user namespaces are refused (Docker's default seccomp
profile, Ubuntu 24.04's AppArmor), the jail cannot start and check_jail says in one line what to run instead
(USERNS_BLOCKED). The project, the trainer's environment and files, other processes and the network are not in
the jail. A trusted prologue sets resource limits (CPU seconds, address space, file size, open files, tasks,
no core dumps) before the completion runs; the wall clock is watched from outside, and at `timeout_s` (checked
before every read) or 1 MiB of output the jail is killed whole, and waited for: SIGKILL to the init of its
outermost PID namespace (end_jail). It dies with the trainer too (--die-with-parent; when the trainer is root,
the root stage's PID namespace, around the jail's, dies with it). What a jail may hold outside its address
space is counted in jail_mb.

The child only computes, the parent judges (judge.py). Each test `assert E` is parsed in the parent
(split_test): the jail is sent only the parts of E that name the completion's own definitions (`f(x,
k=[1])`) and writes back their values, as JSON of plain types with each container tagged (PLAIN); the
parent reads them with a bounded parser (read_value: size, depth, hash collisions) and evaluates the rest
of E itself with an allow-list of builtins (judge): every comparison, sum, range, and/or/not and `in`. The
expected values never leave the parent (nor do the reference solutions, which live in tasks.py), and
nothing the completion does (an object whose __eq__ is always True, patched or rebound builtins, patched
reporting helpers, the nonce read through sys._getframe and result lines forged with it, sys.exit())
passes a test without producing the right values. Result lines carry a random nonce only so that the
completion's own prints are not taken for results.

GRPO_UNJAILED=1 runs the same child without the jail (`python -I -S`, an empty environment, a temporary
folder, the same resource limits): no isolation at all, for completions you trust, or inside a container of
its own.
"""
import contextlib
import errno
import grp
import json
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

from judge import MAX_NODES, OUTPUT_CAP, judge, read_value, split_test

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
FILE_MB, NOFILE = 1, 64   # RLIMIT_FSIZE (MiB) and RLIMIT_NOFILE in the jail


def jail_mb(mem_mb: int = 512) -> int:
    """The most memory one jail may hold, in MiB: its address space (run_tests' mem_mb), its /tmp, and
    what it holds outside both, a memfd, pipe or socket buffer per file: NOFILE open and as many again in
    flight (passed over a unix socket, then closed: the kernel lets a user have RLIMIT_NOFILE files in
    flight, and one message more), each at most FILE_MB (RLIMIT_FSIZE bounds a memfd, which mmap cannot
    grow past its size) or a pipe's most (/proc/sys/fs/pipe-max-size, 1 MiB by default)."""
    with open("/proc/sys/fs/pipe-max-size") as f:
        per_file = max(FILE_MB << 20, int(f.read()))
    return mem_mb + TMP_MB + -(-(2 * NOFILE + 1) * per_file >> 20)


# the jail's side of a value: JSON of plain types, each container tagged with its type (a tuple stays a
# tuple, {1: 2} no {"1": 2}), read back by the trainer's bounded parser (judge.read_value); what Python
# compares by its items comes with its items: a range as its bounds, a dict view or an iterator (a
# generator, map, filter, zip...) with at most `most` items (an endless generator has no value). Any other
# type raises.
PLAIN = r"""
import collections.abc, itertools
def _plain(v, most):
    if v is None or isinstance(v, (int, float, str)):
        return v
    if isinstance(v, complex):
        return ["complex", float(v.real), float(v.imag)]
    if isinstance(v, bytes):
        return ["bytes", bytes.hex(v)]
    for kind in (tuple, list, set, frozenset):
        if isinstance(v, kind):
            return [kind.__name__, *(_plain(x, most) for x in v)]
    if isinstance(v, dict):
        return ["dict", *(_plain(x, most) for pair in dict.items(v) for x in pair)]
    if isinstance(v, range):
        return ["range", v.start, v.stop, v.step]
    for kind, tag in ((collections.abc.ItemsView, "dict_items"), (collections.abc.KeysView, "dict_keys"),
                      (collections.abc.ValuesView, "dict_values"), (collections.abc.Iterator, "iter")):
        if isinstance(v, kind):
            items = list(itertools.islice(v, most + 1))
            if len(items) > most:
                raise ValueError("more items than one completion's values may hold")
            return [tag, *(_plain(x, most) for x in items)]
    raise TypeError(type(v).__name__)
"""
PROLOGUE = PLAIN + r"""
import json, os, resource, sys
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
def _main(nonce, code, exprs, limits, tmp, most):
    if tmp:
        _own_tmp(*tmp)
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
            value = json.dumps(_plain(eval(expr, ns), most), separators=(",", ":"))
            os.write(1, f"\n{nonce} {i} {value}\n".encode())
        except BaseException:
            pass
_main(*json.loads(sys.stdin.read()))
"""

# seccomp, by machine: (AUDIT_ARCH_*, clone, clone3, [refused], prctl), numbers from the kernel's tables;
# refused: fork, vfork (x86_64 only); SysV shmget, msgget, semget, whose memory outlives a detach and is not
# bound by RLIMIT_AS (it lives until the jail's IPC namespace goes); add_key, request_key, keyctl: the kernel
# keyring is not namespaced, so a key one completion adds could be read by the next; and what no computation
# needs but kernel exploits use (Docker's default profile refuses them too): bpf, perf_event_open,
# userfaultfd, io_uring_setup, io_uring_enter, io_uring_register; and what acts on another process of the
# jail: ptrace, process_vm_readv, process_vm_writev, pidfd_getfd, process_madvise. And prctl's
# PR_SET_PDEATHSIG: the completion, the jail's pid 1, dies by that signal when bwrap does (with the trainer)
SECCOMP_ARCH = {"x86_64": (0xC000003E, 56, 435,
                           [57, 58, 29, 68, 64, 248, 249, 250, 321, 298, 323, 425, 426, 427,
                            101, 310, 311, 438, 440], 157),
                "aarch64": (0xC00000B7, 220, 435,
                            [194, 186, 190, 217, 218, 219, 280, 241, 282, 425, 426, 427,
                             117, 270, 271, 438, 440], 167)}
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
    pointer BPF cannot follow; glibc then falls back to clone); the other refused calls get EPERM, and so does
    prctl(PR_SET_PDEATHSIG). Another ABI (i386, x32) kills the process."""
    if machine not in SECCOMP_ARCH:
        raise RuntimeError(f"no seccomp filter for {machine} (only {', '.join(SECCOMP_ARCH)}); "
                           f"set {UNJAILED}=1 to run completions unjailed, knowingly")
    arch, clone, clone3, refused, prctl = SECCOMP_ARCH[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06   # BPF_LD|W|ABS, BPF_JMP|JEQ|JGE|JSET|K, BPF_RET|K
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    n = len(refused)
    # (code, jump if true, jump if false, k); a jump skips that many instructions
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, 0x80000000),   # the arch, or kill the process
            (ld, 0, 0, 0), (jge, 9 + n, 0, 0x40000000), (jeq, 8 + n, 0, clone3),   # nr; x32, clone3: ENOSYS
            *[(jeq, 5 + n - k, 0, nr) for k, nr in enumerate(refused)],            # refused: EPERM
            (jeq, 0, 2, prctl), (ld, 0, 0, 16), (jeq, 3, 4, 1),                    # PR_SET_PDEATHSIG: EPERM
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


def jail_argv(bwrap: str, seccomp_fd: int, info_fd: int, setpriv: str | None = None,
              uid: int = JAIL_ID) -> list[str]:
    """bwrap's arguments up to the command: see the module's docstring. `setpriv`: the trainer is root, and
    this is util-linux's setpriv, which starts the jail's bwrap as host user `uid` (see root_stage). The
    first bwrap writes the pid of its first process, a PID namespace's init, to `info_fd` (jail_init)."""
    if setpriv:
        # the root stage holds each tool at its real path alone (/bin, a symlink on merged-/usr, is not in it)
        bwrap, setpriv = os.path.realpath(bwrap), os.path.realpath(setpriv)
    python = os.path.realpath(sys.executable)
    # /usr (the C library and what else the interpreter links) and the Python installation, however installed
    # (a venv's interpreter resolves to its base; the standard library is under base_prefix)
    roots = sorted({"/usr", os.path.realpath(sys.base_prefix), os.path.dirname(os.path.dirname(python))})
    roots = [r for r in roots if not any(r.startswith(o + os.sep) for o in roots)]
    # (--unshare-all alone makes no user namespace when bwrap runs as root); --remount-ro /proc: the jail's
    # /proc/sys is the host's kernel settings, and bwrap (0.8) leaves it writable to a root in the jail
    # --as-pid-1: the completion's own interpreter is the jail's pid 1, under its limits (bwrap's init
    # would be a process of the completion's user, dumpable and without RLIMIT_AS, that it could attach to)
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--as-pid-1",
            "--new-session", "--clearenv", "--uid", str(JAIL_ID), "--gid", str(JAIL_ID), "--cap-drop", "ALL",
            "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SETPCAP",
            "--seccomp", str(seccomp_fd), *_system_binds(roots),
            "--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev", "--size", str(TMP_MB << 20),
            "--tmpfs", "/tmp", "--chdir", "/tmp", "--remount-ro", "/", "--remount-ro", "/dev"]
    argv = root_stage(bwrap, setpriv, roots, uid) + argv if setpriv else argv
    return [argv[0], "--info-fd", str(info_fd), *argv[1:]]


def root_stage(bwrap: str, setpriv: str, roots: list[str], uid: int) -> list[str]:
    """The command that starts the jail's bwrap as host user `uid` (host_uid) when the trainer is root
    (`bwrap` and `setpriv`: real paths, no symlink). bwrap started by root maps the jail's user to the host's
    root (capabilities, host-wide /proc/sys, no RLIMIT_NPROC), so the jail's bwrap must be started by an
    unprivileged user; but the Python installation may lie where that user cannot look (root's home). This
    first bwrap, root's own and running nothing of the completion, makes a mount namespace with what the jail
    binds, on paths anyone can walk, then setpriv drops to `uid`. It also makes a PID namespace, whose init
    (bwrap's, root's) dies with the trainer (--die-with-parent) and takes the jail's bwrap and the jail with
    it: the kernel sends no parent-death signal from root's bwrap, which has dropped its capabilities, to a
    process of `uid`."""
    walkable = []   # every folder above a root, created world-searchable in the stage's empty root
    for r in roots:
        parts = r.strip(os.sep).split(os.sep)[:-1]
        walkable += [os.sep + os.sep.join(parts[:i + 1]) for i in range(len(parts))]
    tools = [t for t in (bwrap, setpriv) if not any(t.startswith(r + os.sep) for r in roots)]
    argv = [bwrap, "--die-with-parent", "--unshare-pid"]
    for d in dict.fromkeys(walkable):
        argv += ["--perms", "0755", "--dir", d]
    for t in tools:
        argv += ["--ro-bind", t, t]
    # the jail's bwrap needs a /proc (to write its user namespace's maps) of this PID namespace, where it
    # looks its child up by pid; the kernel lets it mount the jail's own /proc only where a proc is mounted
    # whole, which bwrap's --proc is not (it covers /proc/irq and /proc/bus), so the host's is there too.
    # And /dev (for its own /dev), and a /tmp to build its root in
    return argv + [*_system_binds(roots), "--proc", "/proc", "--bind", "/proc", "/run/host-proc",
                   "--dev-bind", "/dev", "/dev", "--tmpfs", "/tmp", "--", setpriv, f"--reuid={uid}",
                   f"--regid={uid}", "--clear-groups", "--"]


def check_jail() -> None:
    """RuntimeError, saying what to do, if completions cannot be jailed here; a warning if GRPO_UNJAILED=1."""
    if os.environ.get(UNJAILED) == "1":
        print(f"{UNJAILED}=1: the code reward runs completions WITHOUT a jail (no isolation)",
              file=sys.stderr)
        return
    if run_tests("X = 6 * 7", ["assert X == 42"]) != 1:
        raise RuntimeError("the bubblewrap jail started but did not run a trivial program correctly")


def jail_init(info: int, bwrap_pid: int) -> int | None:
    """A pidfd of the init of the jail's outermost PID namespace (the root stage's as root), whose pid bwrap
    wrote to `info` (--info-fd; read once, never waited on); None if there is none or it has ended. Its
    parent is bwrap, our child not yet waited for: a child of bwrap's, still running once that was read, is
    the jail's, not a process that took its pid since."""
    with contextlib.suppress(ValueError, KeyError, TypeError, OSError):
        pid = json.loads(os.read(info, 1 << 16))["child-pid"]
        init = os.pidfd_open(pid)
        with open(f"/proc/{pid}/stat") as f:
            parent = int(f.read().rsplit(")", 1)[1].split()[1])
        if parent == bwrap_pid and not ended(init, 0):
            return init
        os.close(init)
    return None


def end_jail(init: int | None) -> None:
    """SIGKILL to the jail's init (jail_init); back once it has ended, or after 10 s. The kernel ends every
    process of its PID namespace, and of those within, before it: bwrap's death alone would end them only
    through the parent-death signal, after run_tests had returned."""
    if init is None:
        return
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(init, signal.SIGKILL)
    # bounded: a process stuck in the kernel may take long to end
    ended(init, 10)
    os.close(init)


def ended(pidfd: int, wait_s: float) -> bool:
    """Whether the process has ended, waiting up to `wait_s`: an init ends after its namespace's others."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(wait_s * 1000))


def read_output(fd: int, deadline: float) -> bytes:
    """What the jail writes to `fd` until EOF (every process of the jail is gone), `deadline` (time.monotonic)
    or OUTPUT_CAP bytes, whichever comes first. The deadline is checked before every read, however much is
    waiting (a jail that writes a byte at a time keeps data waiting forever): past it, what already waits is
    read once, as this process may have waited that long for a core while the jail's lines were there. Each
    read appends to one bytearray: the time spent is linear in what is read."""
    out, poller = bytearray(), select.poll()
    poller.register(fd, select.POLLIN)
    while len(out) < OUTPUT_CAP:
        left = deadline - time.monotonic()
        # poll() wakes as soon as the child writes or exits, where Popen.wait(timeout) sleeps in steps
        if not poller.poll(max(left, 0) * 1000):
            break
        chunk = os.read(fd, OUTPUT_CAP - len(out))
        out += chunk
        if not chunk or left <= 0:
            break
    return bytes(out)


def run_tests(code: str, tests: list[str], *, timeout_s: float = 5.0, cpu_s: int = 4,
              mem_mb: int = 512, nproc: int = 64) -> int:
    """Number of `tests` (assert statements, see split_test) that pass after `code` has run, in the jail.
    `nproc`: the most tasks (processes and threads) of the jail's user. RuntimeError if the jail did not start
    (bwrap missing or refused), naming bwrap's complaint."""
    checks, nonce = [split_test(t) for t in tests], secrets.token_hex(16)
    exprs = [part for _, parts in checks for part in parts]
    tmp = None if os.environ.get(UNJAILED) == "1" else [TMP_MB, TMP_FILES]
    limits = {"CPU": cpu_s, "AS": mem_mb << 20, "CORE": 0, "FSIZE": FILE_MB << 20, "NOFILE": NOFILE,
              "NPROC": nproc}
    payload = json.dumps([nonce, code, exprs, limits, tmp, MAX_NODES]).encode()
    command = [os.path.realpath(sys.executable), "-I", "-S", "-c", PROLOGUE]
    unjailed, fds, root, info = os.environ.get(UNJAILED) == "1", [], os.geteuid() == 0, None
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
                # where the first bwrap writes its child's pid (jail_init)
                info, info_w = os.pipe()
                os.set_blocking(info, False)
                fds.append(info_w)
                command = jail_argv(bwrap, fds[0], info_w, setpriv if root else None, uid) + ["--", *command]
            proc = subprocess.Popen(command, cwd=cwd, env={}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True, pass_fds=fds)
        except BaseException:
            if info is not None:
                os.close(info)
            raise
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
            if info is not None:
                # bwrap's child does not inherit the pipe: what is in it is bwrap's
                end_jail(jail_init(info, proc.pid))
                os.close(info)
            # bwrap too; before wait(), so the pid is still ours
            try:
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
