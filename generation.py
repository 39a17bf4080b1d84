"""Rank 0's side of generation: the engines it drives (a vLLM engine on a device of its own, or a vLLM server
started anywhere), what it asks of them, the pushes, and the held-out evaluation's parts merged.

grpo_train.py holds what an engine computes (`rollout`: sample -> score -> advantages -> filter);
engine_process.py holds the engine's side of the protocol below (a process of rank 0's own per engine),
remote_engine.py what a remote engine is; this file holds the protocol's rank 0 side: the engines' start,
their shares, the requests, the weight transfer, the evaluation's parts, and noticing a death.

Engines. --gen-devices 0,1,... starts one such process per device (--gen-device N is the one-engine spelling). Each
step's prompts are split across them (ref_client.even_shares: any --prompts-per-step >= the number of engines), each
samples its share with a seed of its own, and the batch is their union in engine order, so a run is reproducible for a
given number of engines. The data order is one shuffled stream cut in blocks of --prompts-per-step; engine i takes
share i of each block it draws, so with dynamic sampling (--max-gen-rounds) an engine that needs more rounds draws
further blocks without taking another's prompts. The held-out evaluation is split the same way, and the parent
averages it. --gen-urls URL,... makes each engine a vLLM server instead (started by hand, on any node: docs/gpu.md),
driven by an engine process here through the same protocol, pushes included (the server's RL routes, vLLM's HTTP
client); a server of W workers takes W ranks of the weight group, after the servers before it.

Protocol. Rank 0 sends each engine, on its `control` queue, in order, and the engine answers on `results`:
    {"kind": "batch"}                      -> {"kind": "batch", "version", "seqs", "fill", "metrics", "pos"}
    {"kind": "weights", "version", ...}    -> (the tensors follow over the weight group; with
                                              "evaluate": {"kind": "eval", "version", "evals"})
    {"kind": "reference", "path", "step"}  -> (the reference servers reload `path`, between two batches)
    {"kind": "stop"}
Each engine does one thing at a time, in the order asked. Right behind each push, rank 0 asks for batches until 1 +
`ahead` (--max-staleness) are asked for and not yet taken: the next step's and `ahead` more. So a batch is generated
by weights at most `ahead` pushes old, as the rule allows, and an engine goes from the load straight to the next
batch: had rank 0 waited to take a batch before asking for the one after, the engine would wait out that batch's
reference request every step (the demo's engines idled 17 ms a step). A push waits for the batch being generated to
finish. `ahead` 0 asks for each batch after the push: on-policy.

The push is off the trainer's path: rank 0 snapshots the weights (transfer_clients.Snapshot), runs its side of the
probe, and sends the snapshot on a thread of its own while the trainer steps on. The calls go out without waiting for
each other (transfer_clients.EngineClient), the batch requests behind the finish; the engine checks the probe as one
more request in the first batch after the load (engine_process.ProbeAlong). Rank 0 sends nothing else until the push
has landed (_landed): every message keeps its place above.

Weights cross by vLLM's own RL weight-transfer API (weight_transfer.py): NCCL between GPUs, CUDA IPC for an engine on
the one training GPU, gloo on CPU, each push start -> update -> finish as vLLM defines it. Neither side ever waits
blindly: rank 0 runs each transfer on a thread and checks while it waits that every engine lives; an engine runs a
watchdog thread that exits once its trainer (its parent) is gone, whatever call it is blocked in, and one that drives
a server ends, saying why in one line, once the server is gone or silent (remote_engine.watch_server). An engine says
it is ready only once its weight group exists and a collective has crossed it (vLLM's NCCL init runs a warm-up
all_reduce; the gloo group a handshake), so NCCL's lazily built communicator can never block the first push outside
these checks. (On a GPU, only the one-GPU layout with the gloo engine has run: see docs/gpu.md.)
"""
import argparse
import os
import queue
import threading
import time
from contextlib import contextmanager
from functools import partial

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine_process import GROUP_TIMEOUT, LOST_KEY, engine_environment, serve, vllm_dtype
from batches import merge_batches
from lora import vllm_weights
from placement import (alive, default_gen_mem, reference_beside_engine, reference_device, start_reference_server,
                       tcp_store, training_gpus)
from ref_client import RefServerError, check_reference, even_shares, server_urls, wait_for_server
from rewards import parse_reward_spec


def engine_positions(data_pos, engines):
    """The saved data position (an int before several engines, or one per engine) -> one per engine. Resumed with
    another number of engines, each starts after the furthest one: what the engines behind had not reached is skipped
    (nothing without --max-gen-rounds, where every engine draws as many blocks)."""
    saved = data_pos if isinstance(data_pos, list) else [data_pos]
    return saved if len(saved) == engines else [max(saved)] * engines


@contextmanager
def _environment(changes):
    """os.environ with `changes` inside the block, as it was after it (a spawned child copies it at start)."""
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})
        for k in [k for k, v in saved.items() if v is None]:
            del os.environ[k]


class GenerationProcess:
    """Rank 0's handle on the generation engines: starts them, asks them for batches, pushes weights to them,
    and notices within seconds when one has died, or when the launcher above this rank has (deepspeed's
    single-node runner does not pass SIGTERM on: without this check, killing it would leave orphans)."""
    # the push in flight (weight_transfer.run_on_thread), the CUDA stream it runs on, the last one's seconds
    pushing, stream, push_s = None, None, None

    def __init__(self, rollout, reference, train_set, eval_set, state, policy, *, model, gen_device, gen_devices,
                 gen_mem, gen_kv_gb, threads, seed, max_prompt_len, max_new_tokens, prompts_per_step, rewards,
                 sync_tol, max_staleness, beta, ref_url, ref_device, ref_wait, eval_only, steps, ref_sync_every,
                 out_dir, fp32_lm_head=False, gen_urls=None, gen_timeout=600.0, dist_timeout=60,
                 scale_rewards="group", **_):
        """rollout(llm, next_prompts, n_prompts, reward_spec) -> an engine's batch; reference(seqs) -> their reference
        log-probs, asked for (with --beta > 0) on the engine's scoring thread; state: the run's (data position, the
        reference's checkpoint); policy: the model the trainer starts from (its dtype is vLLM's; the reference servers
        must serve it); the rest are grpo_train.py's flags: gen_devices (or the one gen_device; or gen_urls, the vLLM
        servers, gen_timeout the bound of a request to one), rewards (eval reports its first), scale_rewards
        (merge_batches's), max_staleness (batches asked for beyond the next step's), steps and ref_sync_every (what
        the run will take, and when a reference reload comes between two requests), threads (each engine's torch
        threads: a fresh process would take every core, and on CPU fight the trainer for them: the demo's steps took
        1.7x as long)."""
        from remote_engine import ServerError, trainer_address, world_sizes
        from weight_transfer import transfer_backend
        # where each engine is: a GPU index, or a vLLM server's URL (an engine process here drives it)
        urls = server_urls(gen_urls or "")
        devices = urls or gen_devices or [gen_device]
        cpu = not torch.cuda.is_available()
        world = dist.get_world_size() if dist.is_initialized() else 1
        # an engine on a training GPU (one-GPU mode) starts at the first push, once DeepSpeed holds its memory:
        # vLLM sizes its KV cache from the free memory it measures across its start (gpu_worker.py,
        # determine_available_memory), so the trainer allocating meanwhile would be counted as vLLM's
        self.shared = not cpu and bool(set(devices) & set(training_gpus(world)))
        # beside the reference server this run starts, less (placement.REF_GEN_MEM says why)
        beside_ref = reference_beside_engine(ref_device, devices, beta > 0 and not ref_url and not eval_only)
        gen_mem = gen_mem if gen_mem is not None else default_gen_mem(self.shared, beside_ref)
        # CPU: torch.compile gains nothing for small models and costs 20 s at start (enforce_eager)
        engine_kw = dict(model=model, dtype=vllm_dtype(next(policy.parameters()).dtype), enforce_eager=cpu,
                         max_model_len=max_prompt_len + max_new_tokens, gpu_memory_utilization=gen_mem,
                         logprobs_mode="processed_logprobs")
        self.backend = transfer_backend(devices, world)
        # --beta > 0 without --ref-url: this run's own reference server, started before the engines (they
        # take its token from the environment they are spawned with); their reference calls
        # (grpo_train.reference) read args.ref_url, which names it from here on
        self.ref_server = None
        if beta > 0 and ref_url is None and not eval_only:
            device = reference_device(ref_device, devices)
            self.ref_server, ref_url = start_reference_server(model, device, out_dir, threads, fp32_lm_head)
            run_args = argparse.Namespace(**{**vars(reference.keywords["args"]), "ref_url": ref_url})
            reference = partial(reference.func, args=run_args)
        engine_kw["weight_transfer_config"] = {"backend": self.backend}
        # --fp32-lm-head: vLLM 0.32's own option (ModelConfig.head_dtype), the trainer's run_setup.head_in_fp32
        if fp32_lm_head:
            engine_kw["hf_overrides"] = {"head_dtype": "float32"}
        self.store = tcp_store("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=GROUP_TIMEOUT)
        ctx = mp.get_context("spawn")
        positions = engine_positions(state["data_pos"], len(devices))
        eval_shares = even_shares(len(eval_set), len(devices))
        # a server's workers are ranks of the weight group, after rank 0 and the engines before it
        try:
            ranks = world_sizes(urls, gen_timeout) if urls else [1] * len(devices)
            self.host = trainer_address(urls[0]) if urls else "127.0.0.1"
        except ServerError as e:
            raise SystemExit(str(e)) from None
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        self.controls, self.results, self.answers, self.procs, self.starts = [], [], [], [], []
        for i, (device, share) in enumerate(zip(devices, even_shares(prompts_per_step, len(devices)))):
            job = {"index": i, "engines": len(devices), "store_port": self.store.port, "trainer": os.getpid(),
                   "seed": seed, "pos": positions[i], "per_step": prompts_per_step, "share": list(share),
                   "max_new_tokens": max_new_tokens, "reward_spec": parse_reward_spec(rewards),
                   "sync_tol": sync_tol, "ref_url": ref_url if beta > 0 else None, "ref_wait": ref_wait,
                   "ref_step": int(os.path.basename(state["ref"]).removeprefix("step_")) if state["ref"] else 0,
                   "url": device if urls else None, "rank_offset": offsets[i], "gen_timeout": gen_timeout}
            self.controls.append(ctx.Queue())
            self.results.append(ctx.Queue())
            self.answers.append(ctx.Queue())
            self.procs.append(ctx.Process(target=serve, daemon=True, args=(
                rollout, reference, engine_kw, job, train_set, [eval_set[j] for j in eval_shares[i]], self.controls[-1],
                self.results[-1], self.answers[-1])))
            # the child sees exactly its own GPU, whatever this process has initialised; set in the
            # environment it is spawned with, not inside it, where an import may already have used CUDA
            # (a server's engine process holds no model: no GPU for it)
            self.starts.append((self.procs[-1], engine_environment(device, gen_kv_gb, threads, cpu) if not urls
                                else {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(threads)}))
        if not self.shared:
            self._start_engines()
        self.devices, self.ranks = devices, sum(ranks)
        parent = psutil.Process().parent()   # deepspeed: runner -> launch.py -> this rank
        self.launcher = parent.parent() if parent else None
        # the engines ask the reference servers for log-probs: checked while vLLM starts
        if beta > 0 and not eval_only:
            if self.ref_server is not None:
                self._wait_for_own_server(ref_url, ref_wait)
            check_reference(ref_url, ref_wait, policy, state["ref"], model)
        # the probe: the start of a training prompt, whose log-probs both sides compare after a push
        self.probe_ids = train_set[0]["prompt_ids"][:64]
        self.transfer, self.ahead, self.version, self.evals = None, max_staleness, -1, []
        # rank 0 waits for the engines' start at most as long as the other ranks wait for it
        self.start_wait_s = 60 * dist_timeout
        # batches asked for and taken in this launch, and the most it takes: never more are asked for
        self.asked, self.taken = 0, 0
        self.total, self.ref_sync_every = 0 if eval_only else steps - state["step"], ref_sync_every
        self.scale_rewards = scale_rewards
        # per pushed version: the optimizer steps behind it (policy_lag), its training step (evals), and
        # the engines' parts of its evaluation until all have answered
        self.opt_steps_at, self.step_at, self.eval_parts, self.evaluated = {}, {}, {}, -1

    def _wait_for_own_server(self, url, wait_s):
        """Until the reference server this run started answers, noticing meanwhile if it (or an engine) died."""
        deadline = time.time() + wait_s
        while True:
            try:
                return wait_for_server(url, timeout=2)
            except RefServerError:
                self.check_alive()
                if time.time() > deadline:
                    raise

    def _start_engines(self):
        for proc, env in self.starts:
            with _environment(env):
                proc.start()
        self.starts = []

    def _dead_engine(self):
        """The index of an engine whose process has ended, or None (one on a training GPU starts at its first push)."""
        return next((i for i, p in enumerate(self.procs) if p.pid is not None and not p.is_alive()), None)

    def check_alive(self):
        """SystemExit naming what died, once a push in flight had 10 s to end (one _wait_for watches: there)."""
        try:
            self._check_alive()
        except SystemExit:
            if self.pushing is not None:
                self._abort_push(self.pushing)
            raise

    def _abort_push(self, thread):
        """A push's `thread` given 10 s to end (not a set-up's: a dead engine never joins), then the weight group
        aborted: a thread leaving gloo as the interpreter exits aborts it ("terminate called without an active ...").
        Thread's own join: run_on_thread's raises the error the thread met."""
        if thread is not None:
            threading.Thread.join(thread, 10)
        if self.transfer is not None:
            self.transfer.shutdown()
            self.transfer = None

    def _check_alive(self):
        # an engine whose vLLM server failed leaves its line in the store before it exits (end_with)
        if self.store.check([LOST_KEY]):
            raise SystemExit(self.store.get(LOST_KEY).decode())
        if (i := self._dead_engine()) is not None:
            # what died and where (its own traceback, if it had one, is above)
            raise SystemExit(f"grpo_train.py: the generation process died (exit code {self.procs[i].exitcode}): "
                             f"engine {i}, {'server' if isinstance(self.devices[i], str) else 'device'} "
                             f"{self.devices[i]}; its traceback, if it had one, is above")
        if self.ref_server is not None and self.ref_server.poll() is not None:
            raise SystemExit(f"grpo_train.py: the reference server this run started died (exit code "
                             f"{self.ref_server.returncode}); its output is above")
        if self.launcher is not None and not alive(self.launcher):
            raise SystemExit(f"the launcher (pid {self.launcher.pid}) is gone: stopping the run")
        # a push that ended: landed, or failed on rank 0's side (an engine's failure ends it, seen above)
        if self.pushing is not None and not self.pushing.is_alive():
            self._landed()

    def _engines_live(self):
        """The push thread's check: an engine's death ends the push (check_alive says why)."""
        if (i := self._dead_engine()) is not None:
            raise RuntimeError(f"engine {i} died during a weight push")

    def _receive(self, engine):
        while True:
            self.check_alive()
            try:
                msg = self.results[engine].get(timeout=2)
            except queue.Empty:
                continue
            return msg

    def _send(self, msg):
        for control in self.controls:
            control.put(msg)

    def _watched(self, fn, *args):
        """fn(*args) on a thread, watched (_wait_for) -> its value."""
        from weight_transfer import run_on_thread
        return self._wait_for(run_on_thread(fn, *args))

    def _wait_for(self, thread, push=False):
        """Until `thread` (weight_transfer.run_on_thread) ends, checking every 50 ms that every engine lives -> its
        value. On an error the weight group is aborted: a transfer cut short leaves it unusable."""
        try:
            while not thread.join(0.05):
                self.check_alive()
        except BaseException as error:
            # gloo can see the connection close before the process is reaped: name the death if it was one,
            # before the abort fails the engines still in the group (a server's would name its own server)
            try:
                if not isinstance(error, SystemExit):
                    for proc in self.procs:
                        proc.join(timeout=5 / len(self.procs))
                    self.check_alive()
            finally:
                self._abort_push(thread if push else None)
            raise
        return thread.value

    def _landed(self):
        """Wait for the push in flight, if any: rank 0 sends the engines nothing else while one is."""
        if self.pushing is not None:
            pushing, self.pushing = self.pushing, None
            self._wait_for(pushing, push=True)

    def push_weights(self, engine, completion_logps, *, evaluate, step):
        """Send the weights this step left by vLLM's weight-transfer API, with the trainer's log-probs of the probe
        (every engine checks them), on a thread: the trainer goes on to its next step while they cross and the engines
        load them. The previous push has landed first; the weights cross from a snapshot (transfer_clients.Snapshot),
        which the next step's update leaves alone. Behind the push's finish go the batches it allows (1 + --max-
        staleness asked for beyond those taken), so an engine goes from the load to the next batch without waiting for
        rank 0."""
        from transfer_clients import EngineClient, PushStream, Snapshot
        from weight_transfer import open_transfer, run_on_thread
        self._landed()
        model = engine.module
        self._start_engines()
        if self.transfer is None:   # the engines join once vLLM is up (their start overlaps DeepSpeed's)
            self.client = EngineClient(self.controls, self.answers, self._engines_live)
            self.snapshot, self.stream = Snapshot(partial(vllm_weights, model)), PushStream()
        # before the transfer opens: vLLM's packed buffers are sized from the weights (packed_buffer_bytes)
        self.snapshot.take()
        if self.transfer is None:
            self.transfer = self._watched(open_transfer, self.backend, self.client, self.snapshot, self.ranks,
                                          self.start_wait_s, self.host)
        ids = torch.tensor([self.probe_ids], device=engine.device)
        with torch.no_grad():
            probe = completion_logps(model, ids, torch.ones_like(ids), len(self.probe_ids) - 1)[0]
        self.version += 1
        self.opt_steps_at[self.version], self.step_at[self.version] = engine.global_steps, step
        self.client.finish = {"version": self.version, "evaluate": evaluate, "probe_ids": self.probe_ids,
                              "probe_logps": probe.tolist()}
        self.client.then = self._asks_after_push(step)
        self.pushing = run_on_thread(self._push)

    def _push(self):
        """On the push's thread; time/push_s: from its first call until every engine has answered."""
        t0 = time.time()
        self.stream.run(self.transfer.send_weights)
        self.push_s = time.time() - t0

    def _asks_after_push(self, step):
        """The batch requests that follow the push of training step `step`: until 1 + `ahead` are asked for beyond
        those taken. At a step whose checkpoint the reference servers then load (grpo_train's `refresh`), none:
        reload_reference asks, behind its message, so batches asked for before it are scored by the reference before."""
        if self.ref_sync_every and step and step % self.ref_sync_every == 0:
            return []
        return self._asks(self.taken + 1 + self.ahead)

    def reload_reference(self, path, step):
        """The reference servers load checkpoint `path` (of training step `step`) once every engine has finished the
        batches already asked for: those are scored by the reference before, later ones by it."""
        self._landed()
        # what next_batch left unasked while a push was in flight is asked before the reload, as it would
        # have been had the push landed: which reference scores a batch does not depend on timing
        self._ask_for(self.taken + self.ahead)
        self._send({"kind": "reference", "path": path, "step": step})
        self._ask_for(self.taken + 1 + self.ahead)

    def _asks(self, n):
        """The batch requests that make n asked for in this launch (never more than it takes), counted."""
        more = max(0, min(n, self.total) - self.asked)
        self.asked += more
        return [{"kind": "batch"}] * more

    def _ask_for(self, n, wait=True):
        """Ask for batches until n are asked for in this launch. A push's calls and these requests share the engines'
        queues, where their order is the protocol's: while a push is in flight, asking waits for it to land, or
        (wait=False) is left to the requests that follow its finish."""
        if self.asked >= min(n, self.total):
            return
        if self.pushing is not None and not wait and self.pushing.is_alive():
            return
        self._landed()
        for msg in self._asks(n):
            self._send(msg)

    def _keep_eval(self, engine, msg):
        parts = self.eval_parts.setdefault(msg["version"], {})
        parts[engine] = msg["evals"]
        if len(parts) == len(self.procs):
            n = max(1, sum(p["n"] for p in parts.values()))
            self.evals.append({"eval/accuracy": sum(p["eval/accuracy"] for p in parts.values()) / n,
                               "eval/format": sum(p["eval/format"] for p in parts.values()) / n,
                               "eval/step": self.step_at[msg["version"]],
                               "eval/rows": [row for i in sorted(parts) for row in parts[i]["rows"]]})
            self.evaluated = msg["version"]
            del self.eval_parts[msg["version"]]

    def _next_batch_of(self, engine):
        while True:
            msg = self._receive(engine)
            if msg["kind"] == "batch":
                return msg
            self._keep_eval(engine, msg)

    def next_batch(self, opt_steps):
        """The next batch, the union of the engines' (with policy_lag: optimizer steps since the weights that sampled
        it, and stale_dropped). Between pushes (--sync-every K > 1) `ahead` stay asked for. On-policy (--max-staleness
        0), the batch is asked for only once the push before it has landed."""
        dropped = 0
        while True:
            self._ask_for(self.taken + 1)
            # every engine had the same pushes before the same request: one version
            batch = merge_batches([self._next_batch_of(i) for i in range(len(self.procs))],
                                  self.scale_rewards)
            self.taken += 1
            # older than the protocol allows would be a bug here: dropped, counted, never trained on
            if self.version - batch["version"] <= self.ahead:
                break
            # one more is asked for in its place: the launch still takes `total` batches to train on
            dropped, self.total = dropped + 1, self.total + 1
        self._ask_for(self.taken + self.ahead, wait=False)
        batch["metrics"].update({"policy_lag": opt_steps - self.opt_steps_at[batch["version"]],
                                 "time/push_s": self.push_s})
        return {**batch, "stale_dropped": dropped}

    def wait_eval(self):
        """Wait for the evaluation of the last push (the final one is worth waiting for) -> take_evals()."""
        self._landed()
        for i in range(len(self.procs)):
            while self.evaluated < self.version and i not in self.eval_parts.get(self.version, {}):
                msg = self._receive(i)
                if msg["kind"] == "eval":
                    self._keep_eval(i, msg)
        return self.take_evals()

    def take_evals(self):
        """The evaluations that arrived since the last call: the newest's keys, the others (several arrive
        only at the end: the last pushes', waited for together) oldest first in "eval/earlier"."""
        evals, self.evals = self.evals, []
        return {**evals[-1], **({"eval/earlier": evals[:-1]} if len(evals) > 1 else {})} if evals else {}

    def stop(self, stopping=False):
        """A push in flight lands (it and "stop" share the engines' queues) unless an engine is gone, then each side
        shuts the weight group down. After a Ctrl-C (`stopping`), whose SIGTERM reaches the engines and the reference
        server too, what the push meets is the stop, not an error (StopAfterStep.wait's rule)."""
        if self.pushing is not None and self._dead_engine() is None:
            try:
                self._landed()
            except (SystemExit, Exception):
                if not stopping:
                    raise
        self._send({"kind": "stop"})
        # an engine on a training GPU is not started before the first push
        for proc in [p for p in self.procs if p.pid is not None]:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=30)
        self._abort_push(None)
        if self.ref_server is not None:
            self.ref_server.terminate()
            self.ref_server.wait(timeout=30)
