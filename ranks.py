"""The ranks' process group: each rank joins it through the deepspeed launcher (its port, its threads, its
signals until the loop), and leaves it at the end. run_setup.py passes these on to grpo_train.py."""
import datetime
import gc
import os
import signal
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT

from placement import free_port, master_store, stop_with


def exit_on_sigterm(signum, frame):
    """Until the loop, SIGTERM ends a rank: raising runs exit handlers, which stop the generation process.
    Once: deepspeed's launcher passes on to each rank a SIGTERM that its whole process group got, and a
    second raise would break into those handlers (a handler that does nothing, not SIG_IGN, which a child
    started meanwhile would inherit)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    sys.exit(128 + signum)


def init_distributed(timeout_minutes, threads):
    """-> (rank, world size). One GPU per rank; until the loop (checkpoints.StopAfterStep), SIGTERM ends a
    rank and SIGINT is left to the launcher; `threads` torch threads, since the CPU is shared with vLLM and
    the reference server. A taken --master_port is one line."""
    # without the launcher DeepSpeed looks for MPI instead, and fails on a missing mpi4py
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        stop_with("start it through the deepspeed launcher, which starts its processes: deepspeed "
                  "--num_gpus 1 grpo_train.py --model ... (docs: README.md)")
    if torch.cuda.is_available():   # before any collective
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # DeepSpeed builds CPU Adam (ds_config_offload.json) where TORCH_EXTENSIONS_DIR says, else in ~/.cache: a
    # launch by hand from the venv then rebuilt what `make` had built in the venv; the venv's folder, as the
    # Makefile's
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    skip_shm_allreduce_op()
    # until the loop takes Ctrl-C (checkpoints.StopAfterStep), a rank and the processes it starts (the
    # engines, the reference server: they inherit it) ignore a terminal's SIGINT: the launcher stops them
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the launcher's default port on one node: a port of this launch's own, the same for each of its ranks
    # (the children of one launch.py), so that two runs on one machine do not both take 29500
    if os.environ["MASTER_PORT"] == str(TORCH_DISTRIBUTED_DEFAULT_PORT) and os.environ.get("CROSS_SIZE") == "1":
        os.environ["MASTER_PORT"] = str(TORCH_DISTRIBUTED_DEFAULT_PORT + 1 + os.getppid() % 2000)
    # rank 0's rendezvous listens on MASTER_ADDR alone, not on every interface as torch's own would
    rendezvous = master_store(datetime.timedelta(minutes=timeout_minutes))
    try:
        deepspeed.init_distributed(timeout=datetime.timedelta(minutes=timeout_minutes))
    except dist.DistNetworkError as e:
        if "EADDRINUSE" not in str(e):
            raise
        stop_with(f"port {os.environ['MASTER_PORT']} on {os.environ['MASTER_ADDR']}, where the ranks meet, is "
                  f"taken (another run on this machine?): give this run another with the launcher's "
                  f"--master_port, e.g. deepspeed --master_port {free_port()} ...")
    del rendezvous
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    torch.set_num_threads(threads)
    return dist.get_rank(), dist.get_world_size()


def skip_shm_allreduce_op():
    """On CPU, DeepSpeed 0.19.8's init_distributed JIT-compiles a shared-memory all-reduce op (about a minute,
    once per venv) and maps a 66 MB buffer per rank in /dev/shm that it never removes. Only its tensor-parallel
    inference layers call that op (dist.inference_all_reduce); ZeRO's training collectives go through
    torch.distributed (deepspeed/comm/torch.py: TorchBackend.all_reduce). Marked unusable in the table of
    compatible ops, which DeepSpeed fills once per process and keeps, build_shm_op returns None: nothing is
    built, loaded or mapped (on gloo, the CPU backend here; with oneccl_bindings_for_pytorch installed,
    DeepSpeed's ccl backend would map buffers of its own). A GPU's accelerator has no such op, and
    build_shm_op stops before that table: so does this, so as not to fill it there (a probe of every op)."""
    if get_accelerator().create_op_builder("ShareMemCommBuilder") is not None:
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def shut_down(generation_process, stopping):
    """The end of a run (`stopping`: after a Ctrl-C): rank 0 stops the generation process; every rank leaves
    the process group."""
    if generation_process is not None:
        generation_process.stop(stopping)
    dist.barrier()
    dist.destroy_process_group()
    # the interpreter's last garbage collection walks the whole heap (torch, DeepSpeed, transformers) only
    # to free it at exit: 1.5 s of every launch's end on CPU; frozen objects are left to the exit itself
    gc.freeze()
