"""The clients rank 0's side of the weight transfer calls: vLLM's VLLMWeightSyncClient protocol
(distributed/weight_transfer/base.py) and wait_until_up, which open_transfer calls first. EngineClient for the
generation engines, each an LLM in a child process taking its calls on a queue; ThisProcess for an LLM in this
process (tests, benches)."""
import queue
import time

import torch

from weight_transfer import ParamMeta, WeightSource, apply_transfer, open_transfer


class EngineClient:
    """vLLM's VLLMWeightSyncClient (distributed/weight_transfer/base.py) over the engines' queues: each call
    goes to every engine, which makes the same call on its LLM (apply_transfer) and answers when done.
    `finish` is the extra the engines get with finish_weight_update (the version, the probe), and `then` the
    messages that follow it (the batches asked for behind the push).

    A push's calls go out without waiting for each other's answers: an engine takes its queue in order, so
    start, update and finish reach it in the order vLLM defines, and it goes from one to the next without
    waiting for rank 0 (rank 0's push runs on a thread beside the training step, which can keep it from
    answering for a few milliseconds); finish_weight_update collects every answer. The one exception is an
    update that lends the engines a buffer rank 0 refills once the call returns (lends_a_buffer): it
    returns once every engine has answered it, as vLLM's HTTP and Ray clients do (clients.py). Meanwhile
    `alive()` (GenerationProcess._engines_live) is called every 50 ms: an engine that died never leaves
    rank 0 waiting."""

    def __init__(self, controls, answers, alive=lambda: None):
        self.controls, self.answers, self.alive = controls, answers, alive
        self.finish, self.then, self.unanswered = {}, [], 0

    def _put(self, method, info=None, extra=None):
        for i, control in enumerate(self.controls):
            # vLLM's trainer engines address one LLM of several workers (rank_offset 1, then each worker's
            # rank); each engine here is an LLM of one worker: engine i sits at rank i + 1
            if method == "init" and "rank_offset" in info:
                control.put({"kind": "transfer", "method": method, "info": {**info, "rank_offset": 1 + i}})
            else:
                control.put({"kind": "transfer", "method": method, "info": info, **(extra or {})})
        self.unanswered += 1

    def _answered(self, deadline=None, late=None):
        """Every engine's answers to the calls sent so far, checking alive() every 50 ms."""
        for i, answers in enumerate(self.answers):
            for _ in range(self.unanswered):
                while True:
                    try:
                        answers.get(timeout=0.05)
                        break
                    except queue.Empty:
                        self.alive()
                        if deadline is not None and time.monotonic() > deadline:
                            raise SystemExit(late(i)) from None
        self.unanswered = 0

    def wait_until_up(self, wait_s):
        """Until every engine answers (its vLLM has started: it reads its queue only then), at most wait_s."""
        self._put("up")
        self._answered(time.monotonic() + wait_s, lambda i: (
            f"grpo_train.py: vLLM engine {i} has not started after {wait_s:g} s (--dist-timeout, as long "
            f"as the other ranks wait for rank 0)"))

    def init_weight_transfer_engine(self, init_info):
        self._put("init", init_info)
        self._answered()

    def start_weight_update(self):
        self._put("start")

    def update_weights(self, update_info):
        self._put("update", update_info)
        if lends_a_buffer(update_info):
            self._answered()

    def finish_weight_update(self, weight_version=None):
        self._put("finish", extra=self.finish)
        for msg in self.then:
            for control in self.controls:
                control.put(msg)
        self._answered()


def lends_a_buffer(update_info):
    """Whether an update's tensors stay in a buffer of rank 0's that its sender refills once update_weights
    returns: vLLM's CUDA IPC update info (ipc_engine.py, IPCWeightTransferUpdateInfo.ipc_handles, 0.26 to
    0.32). Its packed sender puts every chunk into one buffer (packed_tensor.py, packed_ipc_producer: "the
    consumer has finished reading the buffer before resuming the generator"; 0.32:
    IPCTrainerWeightTransferEngine._send_packed, 0.26: IPCWeightTransferEngine._send_packed). The engine's
    answer comes after vLLM's update_weights, which copies the chunk out (packed_ipc_consumer clones it) and
    synchronises the device (base.py, WeightTransferEngine.update_weights). NCCL's and gloo's one update
    runs beside a broadcast into the engines' own buffers, which waits for them itself."""
    return update_info.get("ipc_handles") is not None


class Snapshot(WeightSource):
    """What a push sends (vLLM's WeightSource), as the step before it left the weights: the trainer's next
    step updates its parameters while they cross. take() calls `weights` (lora.vllm_weights: the LoRA-merged,
    untied view) and copies the trainable ones into buffers kept from push to push: one more copy of them on
    rank 0's device (at 1.5B parameters in bf16, 3.1 GB of the training GPU's memory); frozen ones (LoRA's
    base weights) and tensors made for the push (LoRA's merged weights) are sent as they are."""

    def __init__(self, weights):
        self.weights, self.buffers, self.pairs = weights, {}, []

    def take(self):
        pairs = []
        for name, tensor in self.weights():
            if isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad:
                if name not in self.buffers:
                    self.buffers[name] = torch.empty_like(tensor, requires_grad=False)
                tensor = self.buffers[name].copy_(tensor.detach())
            pairs.append((name, tensor))
        # the copies are done before the push's own stream reads them (vLLM's packers do not wait for ours)
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        self.pairs = pairs

    def metadata(self):
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.pairs]

    def __iter__(self):
        return iter([(n, t.detach()) for n, t in self.pairs])


class PushStream:
    """On a GPU, a CUDA stream of the push's own, current on the thread that pushes: vLLM's senders wait for
    their current stream when they are done (0.32: nccl_engine.py, _post_send_sync), which on the default
    stream would be the trainer's next step, queued meanwhile. The push ends once its stream has: the next
    Snapshot.take overwrites what it read, whatever the sender waited for. Nothing on CPU."""

    def __init__(self):
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None

    def run(self, fn):
        if self.stream is None:
            return fn()
        with torch.cuda.stream(self.stream):
            out = fn()
        self.stream.synchronize()
        return out


class ThisProcess:
    """vLLM's weight-sync client for an LLM in this process (tests, benches): each call made as an engine
    makes it (apply_transfer), rank 0's side on the same process."""

    def __init__(self, llm, skipped):
        self.llm, self.skipped, self.version = llm, skipped, -1

    def wait_until_up(self, wait_s):
        pass

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
    client, snapshot = ThisProcess(llm, skipped), Snapshot(lambda: sending)
    transfer = open_transfer("gloo", client, snapshot, 1)

    def push(pairs):
        sending[:] = list(pairs)
        snapshot.take()
        transfer.send_weights()
    push.client = client
    return push
