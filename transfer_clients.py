"""The clients rank 0's side of the weight transfer calls: vLLM's VLLMWeightSyncClient protocol
(distributed/weight_transfer/base.py) and wait_until_up, which open_transfer calls first. EngineClient for the
generation engines, each an LLM in a child process taking its calls on a queue; ThisProcess for an LLM in this
process (tests, benches)."""
import queue
import time

from weight_transfer import apply_transfer, open_transfer


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

    def wait_until_up(self, wait_s):
        """Until every engine answers (its vLLM has started: it reads its queue only then), at most wait_s."""
        for control in self.controls:
            control.put({"kind": "transfer", "method": "up"})
        deadline = time.monotonic() + wait_s
        for i, answers in enumerate(self.answers):
            try:
                answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise SystemExit(f"grpo_train.py: vLLM engine {i} has not started after {wait_s:g} s "
                                 f"(--dist-timeout, as long as the other ranks wait for rank 0)") from None

    def init_weight_transfer_engine(self, init_info):
        self._call("init", init_info)

    def start_weight_update(self):
        self._call("start")

    def update_weights(self, update_info):
        self._call("update", update_info)

    def finish_weight_update(self, weight_version=None):
        self._call("finish")


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
    client = ThisProcess(llm, skipped)
    transfer = open_transfer("gloo", client, lambda: list(sending), 1)

    def push(pairs):
        sending[:] = list(pairs)
        transfer.send_weights()
    push.client = client
    return push
