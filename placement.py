"""Where a run's processes go on a machine: the training GPUs, the share of one an engine may take, the
reference server rank 0 starts, which rank speaks for all when a mistake stops them, and where a
process's output goes once its terminal has closed. A leaf module (it imports no other of the project's):
run_setup.py and checkpoints.py check the flags with it, generation.py and weight_transfer.py place and
start processes with it, metrics.py writes the console through it."""
import ctypes
import errno
import ipaddress
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import psutil
import torch
import torch.distributed as dist


def first_rank():
    """Rank 0 (or a run without a launcher): the one that speaks for all, before and after the process group
    is up."""
    return int(os.environ.get("RANK", 0)) == 0


def stop_with(message):
    """A user's mistake: `message` in one line on stderr, exit status 1, no traceback. Every rank finds the
    same mistake: the first says it; the others wait to be stopped by the launcher (it stops every rank
    once one fails), so that none ends the run before the first has spoken, and say it only if not."""
    if not first_rank():
        time.sleep(30)
    print(f"grpo_train.py: {message}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def leave_a_closed_terminal():
    """After the terminal a process writes to has closed (hung up: the demo's, whose SIGHUP it passes on as
    a Ctrl-C), every write to it fails with EIO, and the next print would end the process before the step
    it is finishing is saved. Then its stdout and stderr, wherever the terminal was, go to /dev/null:
    nothing written there had anywhere to go. -> whether the terminal had closed"""
    closed = False
    for fd in (1, 2):
        try:
            os.write(fd, b"")
        # another error (a closed descriptor) is the caller's own write's to report
        except OSError as e:
            if e.errno != errno.EIO:
                continue
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
            closed = True
    return closed


def training_gpus(world):
    """The GPUs (as the machine counts them) of the `world` training ranks of this node: local rank i on the
    i-th visible one."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [int(d) for d in visible.split(",")[:world]] if visible else list(range(world))


# the most of a training GPU an engine sharing it may take (--gen-mem): the trainer keeps the rest
SHARED_GEN_MEM = 0.5
# the most of an engine's GPU it may take beside the reference server rank 0 starts there (the 2-GPU layout):
# vLLM takes --gen-mem of the whole GPU, and refuses to start with less free (v1/worker/utils.py,
# request_memory), while the server holds a bf16 copy of the model and its forward (Qwen2.5-7B: 14.2 GiB and
# more), and NCCL's two receive buffers (1 GiB or the largest tensor, each) come on top, outside vLLM's share
REF_GEN_MEM = 0.8


def default_gen_mem(on_training_gpu, beside_reference):
    """--gen-mem's default: 0.3 on a training GPU, 0.7 beside the reference server, else vLLM's own 0.9."""
    return 0.3 if on_training_gpu else 0.7 if beside_reference else 0.9


def reference_beside_engine(ref_device, gen_devices, starts_reference):
    """Whether the reference server rank 0 starts (starts_reference) will share a GPU with an engine."""
    device = reference_device(ref_device, gen_devices)
    return starts_reference and torch.cuda.is_available() and device in map(str, gen_devices)


def alive(proc):
    """Whether a psutil.Process runs: one that exited but was not reaped yet (a zombie) counts as gone."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def free_port():
    """A loopback port free now, for a server or a rendezvous whose master takes it by number."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def address_family(host):
    """The socket family of an address given as digits (not a name): IPv6's where it has a colon."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def held_port(host="127.0.0.1"):
    """A port of `host` (loopback by default) kept for a server that binds it later -> (a socket bound to it,
    never listening; the port). A port released now and bound seconds later, once the server has started, can
    meanwhile be given to any process's bind(0) or connect(), and the server then dies of EADDRINUSE. While this
    socket is open none is given the port, and the server binds and listens on it beside the socket: Linux lets
    sockets share a port where each sets SO_REUSEADDR and only one listens. The servers it is held for set it:
    waitress 3.0.2 (TcpWSGIServer.__init__: ref_server.py), Python's socket.create_server (the trainer's
    rendezvous and the weight group's store on CPU: tcp_store) and vLLM's StatelessProcessGroup.create (the
    weight group's store on NCCL, 0.26 to 0.32)."""
    hold = socket.socket(address_family(host))
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    hold.bind((host, 0))
    return hold, hold.getsockname()[1]


def tcp_store(host, port, world_size=None, *, is_master, **kwargs):
    """torch's TCPStore at host:port; its master listens on `host` alone. Given none, torch 2.13's server
    listens on every interface, whatever host it is given (TCPStoreLibUvBackend.cpp, UvTcpServer::makeWithPort:
    "::", else "0.0.0.0"), so it is handed a socket already listening on `host` (master_listen_fd, as vLLM
    0.32's StatelessProcessGroup.create does), which it keeps. multi_tenant: a store torch's own rendezvous
    opens on that port in this process takes this one's server (rendezvous.py, _create_c10d_store)."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, **kwargs)
    listener = socket.create_server((host, port), family=address_family(host), backlog=socket.SOMAXCONN)
    port = listener.getsockname()[1]
    return dist.TCPStore(host, port, world_size, True, master_listen_fd=listener.detach(), **kwargs)


def master_store(timeout):
    """Rank 0's rendezvous server for init_process_group (env://), listening on MASTER_ADDR alone: loopback
    for the launcher's one-node runs (it sets 127.0.0.1), the address the other nodes reach on several.
    Held until the process group has taken it over (tcp_store). None on other ranks, and where MASTER_ADDR
    is a name, or no address of this machine, or its port is taken: torch's own server then listens on
    every interface (and fails, for a port in use, with its own message)."""
    addr = os.environ.get("MASTER_ADDR", "")
    try:
        ipaddress.ip_address(addr)
        if os.environ.get("RANK") != "0":
            return None
        return tcp_store(addr, int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]), is_master=True,
                         wait_for_workers=False, multi_tenant=True, timeout=timeout)
    except (ValueError, KeyError, OSError):
        return None


def machine_gpus():
    """The GPUs of this machine, as NVML counts them: the indices --gen-devices and --ref-device name. Not
    torch.cuda.device_count(), which counts those of the launcher's CUDA_VISIBLE_DEVICES (--include, --num_gpus)
    alone. None without CUDA, or where NVML cannot say."""
    if not torch.cuda.is_available():
        return None
    # torch's own NVML count (private: torch/cuda/__init__.py, torch 2.11 and 2.13); no NVML library (ROCm),
    # or a torch without it: not known
    try:
        count = torch.cuda._raw_device_count_nvml()
    except (OSError, AttributeError):
        return None
    return count if count >= 0 else None


def missing_gpu(gpus, gen_device, gen_devices, ref_device):
    """The device flags (--gen-device: None where unused) naming a GPU beyond this machine's `gpus` (None: not
    known) -> one line for them, or None."""
    named = {"--gen-devices": gen_devices or [],
             "--gen-device": [gen_device] if gen_device is not None and not gen_devices else [],
             "--ref-device": [int(ref_device)] if str(ref_device).isdigit() else []}
    bad = [f"{flag} {','.join(map(str, given))}: this machine has no GPU {max(given)} (it has {gpus}, numbered "
           f"from 0)" for flag, given in named.items() if gpus is not None and given and max(given) >= gpus]
    return "; ".join(bad) or None


def reference_device(ref_device, gen_devices):
    """--ref-device -> "cpu" or a GPU index (as the machine counts them), its default applied."""
    if ref_device is None:
        return "cpu" if not torch.cuda.is_available() else str(gen_devices[0])
    return ref_device


def start_reference_server(model, device, checkpoint_dir, threads, fp32_lm_head=False):
    """Rank 0's own reference server (ref_server.py, run as a child process, as a user would run it): on
    loopback, on a port held for it from the start, a token made for it (in its environment, never on its
    command line, where `ps` shows it; the engines, spawned after, read it from theirs), allowed to reload
    checkpoints of `checkpoint_dir` (--ref-sync-every) -> (the process, its URL). It dies with rank 0, even
    by SIGKILL (PR_SET_PDEATHSIG); GenerationProcess notices if it dies first."""
    # the port is the server's from now on, not only once it has loaded its model and bound it: the socket
    # holding it goes with the server's process (pass_fds), which binds the port beside it
    hold, port = held_port()
    os.environ["REF_SERVER_TOKEN"] = secrets.token_hex(16)
    gpu = device != "cpu"
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": device} if gpu else {})}
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref_server.py"),
           "--model", model, "--device", "cuda:0" if gpu else "cpu", "--port", str(port),
           "--threads", str(threads), "--checkpoint-dir", os.path.abspath(checkpoint_dir),
           *(["--fp32-lm-head"] if fp32_lm_head else [])]
    # Linux's parent-death signal: a SIGKILLed rank 0 takes its server with it
    die_with_parent = lambda: ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    with hold:
        proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent, pass_fds=[hold.fileno()])
    return proc, f"http://127.0.0.1:{port}"
