"""A generation engine: a process of rank 0's own (generation.py starts it, one per engine) that runs
`serve`, the engine's side of generation.py's protocol, around an LLM. The LLM is either a vLLM engine this
process starts on its device (--gen-devices: vLLM in this process, quieted by quiet_vllm_console), or a vLLM
server started by hand anywhere (--gen-urls: remote_engine.ServerLLM, which generates like vllm.LLM and takes
the pushes over the server's HTTP routes). Either way the same loop samples (grpo_train.rollout), has the
reference servers score each batch, loads each push and checks it (the probe), and evaluates its share of the
held-out set; and the process exits once its trainer is gone, whatever call it is blocked in."""
import atexit
import datetime
import gc
import importlib.util
import logging
import os
import queue
import re
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
import torch.distributed as dist
from tqdm import tqdm

from ref_client import reload_reference
from rewards import format_reward, score
from tasks import shuffled_forever

GROUP_TIMEOUT = datetime.timedelta(minutes=30)


def vllm_dtype(model_dtype):
    """vLLM serves in the trainer's dtype (its "auto" would pick fp16 on pre-Ampere GPUs, the trainer fp32)."""
    return str(model_dtype).removeprefix("torch.")


def engine_environment(device, kv_gb, threads, cpu):
    """The environment a local engine's process is spawned with: its own GPU only, vLLM's engine core in
    this process, its threads. On CPU, torch.compile off: vLLM compiles two sampler helpers even with
    enforce_eager (v1/sample/ops: the random sample and the sampled token's rank; vLLM 0.26 to 0.32), which
    cost the demo's first batch 1.5 s of inductor's work, 9 s with its cache empty; eager, they sample the
    same tokens. torch.compile reads the variable where vLLM's modules define them: set before they are
    imported."""
    env = {"CUDA_VISIBLE_DEVICES": str(device), "VLLM_CPU_KVCACHE_SPACE": str(kv_gb),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(threads)}
    return {**env, "TORCHDYNAMO_DISABLE": "1"} if cpu else {**env, **flashinfer_sampler_off()}


def flashinfer_sampler_off():
    """{"VLLM_USE_FLASHINFER_SAMPLER": "0"} where vLLM's CUDA build lacks FlashInfer, which it requires but a
    --no-deps install (an offline one) can leave out: else vLLM's sampler imports it as the engine starts
    (v1/sample/ops/topk_topp_sampler.py, flashinfer_sampler_supported: model runner V2's Sampler always, V1's
    unless log-probs are processed; seen on vLLM 0.26.0 on one H200). {} where it is installed, or the
    variable is set."""
    if "VLLM_USE_FLASHINFER_SAMPLER" in os.environ or importlib.util.find_spec("flashinfer"):
        return {}
    return {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


def _wait_until(done, check_alive):
    """Poll done() every millisecond, calling check_alive (which raises, or exits) every 50 ms meanwhile."""
    checked = time.time()
    while not done():
        if time.time() - checked > 0.05:
            check_alive()
            checked = time.time()
        time.sleep(0.001)


# vLLM 0.32.0's warnings that are untrue or beside the point in the generation process, each with why:
# (the logger that says it, how the message starts)
VLLM_NOISE = [
    # it may disturb "the random state of the Python process that launched vLLM": this process runs vLLM only
    ("vllm.engine.arg_utils", "The global random seed is set to"),
    # on CPU we ask for eager mode (GenerationProcess): these say back what we asked
    ("vllm.config.vllm", "Enforce eager set, disabling torch.compile"),
    ("vllm.config.vllm", "Inductor compilation was disabled by user settings"),
    # vLLM's own prompt renderer asks its own CPU worker, which refuses by design: the threads stay as set
    ("vllm.v1.worker.cpu_worker", "CPU backend doesn't allow to use `torch.set_num_threads`"),
    # the cache of Mamba-style layers, which the models trained here do not have
    ("vllm.platforms.cpu", "Reset SSM cache type"),
]
# a reload's "<layer>: Failed to load weights" for layers whose weights a push never carries (never_pushed);
# any other layer's still shows, and weight_transfer.unloaded_layers makes it an error
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def import_vllm():
    """A process's first import of vLLM (weight_transfer.py's imports), with the garbage collector off: as
    their objects pile up it would walk them again and again, about 1 s of CPU in each process that imports
    them. Then the heap as it stands, mostly modules' objects that live as long as the process, is frozen
    (gc.freeze): later collections leave it out. A full collection first, so that no garbage made before is
    frozen with it. Once vLLM is imported, a call does nothing."""
    if "weight_transfer" in sys.modules:
        return
    gc.collect()
    was_on = gc.isenabled()
    gc.disable()
    try:
        import weight_transfer  # noqa: F401
    finally:
        gc.freeze()
        if was_on:
            gc.enable()


def never_pushed(model):
    """vLLM's layer classes a push carries nothing for: every rotary embedding, a subclass of vLLM's
    RotaryEmbeddingBase (Llama 3's and YaRN's too: a cos/sin cache computed from the config), and a tied
    lm_head (its weight is the embedding's, pushed under the embedding's name)."""
    from transformers import AutoConfig
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    tied = getattr(AutoConfig.from_pretrained(model), "tie_word_embeddings", False)
    return (RotaryEmbeddingBase, ParallelLMHead) if tied else (RotaryEmbeddingBase,)


def class_names(classes):
    """The names of `classes` and of every subclass of theirs defined so far."""
    names, todo = set(), list(classes)
    while todo:
        names.add(todo[-1].__name__)
        todo += todo.pop().__subclasses__()
    return names


def quiet_vllm_console(model):
    """The generation process's console, set before its engine starts: vLLM's warnings less VLLM_NOISE and
    the untrue reload warnings, none of its INFO lines (its configuration, each reload's timing: for vLLM's
    developers), no progress bar -> LLM() keywords. Tested on vLLM 0.32.0 (vllm-cpu). Filters sit on the
    loggers that speak, since vLLM replaces its handlers when the engine starts."""
    os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"
    for name, start in VLLM_NOISE:
        logging.getLogger(name).addFilter(lambda record, start=start: not record.getMessage().startswith(start))
    skipped = never_pushed(model)
    logging.getLogger(RELOAD_LOGGER).addFilter(
        lambda record: not (record.getMessage().endswith(": Failed to load weights")
                            and record.getMessage().split(":")[0] in class_names(skipped)))
    # vLLM's kernel dispatcher reads a deprecated torch name while it looks for kernels: nothing to act on
    warnings.filterwarnings("ignore", "`torch.distributed.reduce_op` is deprecated", FutureWarning)
    # tqdm's default lock (made even for a hidden bar) is a named semaphore, which this process, ended by
    # the launcher's SIGTERM when a run is stopped, never unregisters: Python's resource tracker then
    # reported it leaked, after the run's last line. The bars of one process need only a thread lock.
    tqdm.set_lock(threading.RLock())
    return {"use_tqdm_on_load": False}


def probe_params():
    """The probe's request: one token, and the prompt's log-probs (temperature 1), undecoded: nothing reads
    the entries' text."""
    from vllm import SamplingParams
    return SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)


def probe_logps(out, ids):
    """A probe request's output -> vLLM's log-probs of ids[1:] given the tokens before each."""
    return torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])])


def vllm_probe_logps(llm, ids):
    """vLLM's log-probs of ids[1:] given the tokens before each (temperature 1), a request of their own."""
    return probe_logps(llm.generate([{"prompt_token_ids": ids}], probe_params(), use_tqdm=False)[0], ids)


class ProbeAlong:
    """The LLM as rollout sees it after a push: its first generate also asks for the probe's log-probs, one
    more request in the same engine steps as the batch's (vLLM takes a SamplingParams per prompt), where a
    request of its own costs a push an engine step (bench/README.md section 4: 150 ms alone, 52 riding a
    batch, at 104M parameters on CPU).
    `got` holds them after that generate; everything else is the LLM's."""

    def __init__(self, llm, probe_ids):
        self.llm, self.probe_ids, self.got = llm, probe_ids, None

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def generate(self, prompts, params, **kw):
        if self.got is not None:
            return self.llm.generate(prompts, params, **kw)
        params = params if isinstance(params, list) else [params] * len(prompts)
        outs = self.llm.generate([*prompts, {"prompt_token_ids": self.probe_ids}], [*params, probe_params()],
                                 **kw)
        self.got = probe_logps(outs[-1], self.probe_ids)
        return outs[:-1]


def check_probe(got, expected, last_got, last_expected, tol, version):
    """The weights landed: vLLM's probe log-probs equal the trainer's, and if the trainer's moved since the
    last push, vLLM's moved too (a reload that silently did nothing would pass the first test whenever a
    step moves the probe by less than tol). -> mean |vLLM - trainer|."""
    diff = (got - expected).abs().mean().item()
    # `not <=`: NaN log-probs fail too
    if not diff <= tol:
        raise RuntimeError(f"weight sync failed: vLLM's probe log-probs differ from the trainer's by "
                           f"{diff:.4f} on average (--sync-tol {tol}), version {version}")
    if last_got is not None and not torch.equal(expected, last_expected) and torch.equal(got, last_got):
        raise RuntimeError(f"weight sync failed: the trainer's weights changed but vLLM's probe log-probs "
                           f"did not, version {version}: the reload did nothing")
    return diff


def held_out_eval(llm, samples, max_new_tokens, spec):
    """Greedy completions of this engine's share of the held-out samples -> the sums of eval/accuracy (the
    first reward of --rewards, unweighted) and eval/format (rewards.format_reward), their count, and "rows":
    each sample's prompt, gold answer, completion and verdicts (--log-completions writes them)."""
    from vllm import SamplingParams
    greedy = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    prompts = [{"prompt_token_ids": s["prompt_ids"]} for s in samples]
    outs = llm.generate(prompts, greedy, use_tqdm=False) if samples else []
    texts = [o.outputs[0].text for o in outs]
    first = spec[:1]
    correct = [score(t, s, first)[1][first[0][0]] for t, s in zip(texts, samples)]
    formats = [format_reward(t, s) for t, s in zip(texts, samples)]
    rows = [{"prompt": s["prompt"], "answer": str(s["answer"]), "completion": t, "accuracy": c, "format": f}
            for s, t, c, f in zip(samples, texts, correct, formats)]
    return {"eval/accuracy": sum(correct), "eval/format": sum(formats), "n": len(samples), "rows": rows}


def exit_if_orphaned(parent, who):
    """An engine whose trainer (its parent) died without stopping it (SIGKILL, OOM, a lost node) exits at once:
    nothing in it is worth saving, and a collective still pending would keep a normal exit waiting."""
    if os.getppid() != parent:
        print(f"{who}: the trainer (pid {parent}) is gone; exiting", flush=True)
        os._exit(1)


def shares_of_blocks(n_train, seed, pos, per_step, share):
    """An engine's prompts, a list of training-set indices per draw: the shuffled stream (resumed at
    position `pos`) cut in blocks of per_step, of which this engine takes the positions in `share` of each
    block it draws. Engines drawing different numbers of blocks (dynamic sampling) never take one prompt
    position twice; one engine with the whole share reads the stream as it is."""
    order = shuffled_forever(n_train, seed, skip=pos)
    while True:
        block = [next(order) for _ in range(per_step)]
        yield [block[i] for i in share]


def leave_now():
    """Exit code 0 at once, the console's buffers written (registered only after a clean stop)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def watch_parent(check_parent):
    """A daemon thread that runs check_parent every second: the engine exits once its trainer is gone,
    whatever its main thread is blocked in (vLLM's start, a rendezvous, a collective)."""
    def watch():
        while True:
            time.sleep(1)
            check_parent()
    threading.Thread(target=watch, daemon=True, name="watch-trainer").start()


def serve(rollout, reference, engine_kw, job, train_set, eval_share, control, results, answers):
    """One engine's main loop; `job` holds its index and settings (GenerationProcess builds it). On any error
    it dies with a traceback on stderr; rank 0 notices. A vLLM server it drives that fails or stops
    answering (remote_engine.ServerError) ends it with that error's one line instead (end_with). (A local
    engine has VLLM_ENABLE_V1_MULTIPROCESSING=0 in its environment: vLLM in this process, 3 s to start,
    not 20.)

    A sampled batch is handed to one scoring thread, which asks the reference servers for it (`reference`)
    and then sends it, while this loop goes on to the next message: the push that follows (and its weight
    load) overlaps the reference forward, where waiting for it would put generation + reference + load on
    every step's path (measured on the demo: 0.151 s a step against 0.122 before the reference moved here).
    One thread, so batches are scored and sent in the order sampled; a reference reload first waits for
    the batches sampled before it, so which checkpoint scored which batch stays the rule (ref/step)."""
    from remote_engine import ServerError
    # the trainer's pid as it gave it: one that died while this process was still starting must be seen
    check_parent = partial(exit_if_orphaned, job["trainer"], f"generation engine {job['index']}")
    watch_parent(check_parent)
    store = dist.TCPStore("127.0.0.1", job["store_port"], is_master=False, timeout=GROUP_TIMEOUT)
    try:
        _serve(rollout, reference, engine_kw, job, train_set, eval_share, control, results, answers, store,
               check_parent)
    except ServerError as e:
        end_with(store, results, str(e))


def _serve(rollout, reference, engine_kw, job, train_set, eval_share, control, results, answers, store,
           check_parent):
    """serve's loop."""
    import_vllm()
    from weight_transfer import apply_transfer, register_gloo, shutdown_transfer
    index, engines = job["index"], job["engines"]
    register_gloo()
    skipped = never_pushed(engine_kw["model"])
    # a CPU run's engine has no device to name
    if torch.cuda.is_available():
        print(f"generation engine {index}: CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
    # a seed of its own per engine; a resumed run reseeds (+ pos): vLLM's RNG cannot be saved from outside
    pos, per_step = job["pos"], job["per_step"]
    llm = open_llm(job, engine_kw, job["seed"] + pos + 1_000_003 * index, partial(end_with, store, results))
    draws = shares_of_blocks(len(train_set), job["seed"], pos, per_step, job["share"])

    def next_prompts():
        nonlocal pos
        pos += per_step
        return [train_set[i] for i in next(draws)]

    version, last, probe_diff, idle_s, ref_step = -1, (None, None), None, 0.0, job["ref_step"]
    # the probe of the last push until it is checked: (ids, the trainer's log-probs)
    probing = None

    def checked(got):
        # the push landed: vLLM's probe log-probs against the trainer's (check_probe)
        nonlocal last, probe_diff, probing
        expected = torch.tensor(probing[1])
        probe_diff = check_probe(got, expected, *last, job["sync_tol"], version)
        last, probing = (got, expected), None
    # at most one batch is being scored: the next waits for it, so batches leave in the order sampled
    scoring, pending = ThreadPoolExecutor(1, thread_name_prefix="reference"), None

    def score_and_send(batch, ref_step):
        t0 = time.time()
        # with --beta 0 there is no reference server (ref_url None) to ask
        if job["ref_url"]:
            for seq, ref in zip(batch["seqs"], reference(batch["seqs"])):
                seq["ref"] = ref
            batch["metrics"]["ref/step"] = ref_step
        batch["metrics"]["time/ref_s"] = time.time() - t0
        results.put(batch)

    def wait_scored():
        # a scoring thread's error (a reference server down past --ref-wait) ends this engine, as in the loop
        nonlocal pending
        if pending is not None:
            pending, done = None, pending
            done.result()

    while True:
        t0 = time.time()
        try:
            msg = control.get(timeout=1)
        except queue.Empty:
            check_parent()
            if pending is not None and pending.done():
                wait_scored()
            continue
        finally:
            idle_s += time.time() - t0
        if msg["kind"] == "stop":
            scoring.shutdown(wait=False, cancel_futures=True)
            shutdown_transfer(llm)
            # multiprocessing flushes the queues and unlinks the semaphores before atexit runs; after it,
            # vLLM's exit clean-up and the last garbage collection of this process's heap took 2.8 s on CPU
            # (every launch's end waited for it) and free nothing that outlives the process
            atexit.register(leave_now)
            return
        if msg["kind"] == "transfer":
            apply_transfer(llm, msg, skipped)
            answers.put(msg["method"])
        if msg["kind"] == "transfer" and msg["method"] == "finish":
            # the probe rides the next batch (ProbeAlong), or, before an evaluation, goes first alone
            version, probing = msg["version"], (msg["probe_ids"], msg["probe_logps"])
            if msg["evaluate"]:
                checked(vllm_probe_logps(llm, msg["probe_ids"]))
                evals = held_out_eval(llm, eval_share, job["max_new_tokens"], job["reward_spec"])
                results.put({"kind": "eval", "version": version, "evals": evals})
        elif msg["kind"] == "reference":
            # every engine has scored the batches asked for before this message; engine 0 then has the
            # servers reload, and no engine scores another batch until they have: the same rule every time
            wait_scored()
            done = f"reference/{msg['step']}"
            store.add(done, 1)
            if index == 0:
                _wait_until(lambda: store.add(done, 0) >= engines, check_parent)
                reload_reference(job["ref_url"], msg["path"], retry_for=job["ref_wait"])
                store.set(done + "/loaded", "1")
            _wait_until(lambda: store.check([done + "/loaded"]), check_parent)
            ref_step = msg["step"]
        elif msg["kind"] == "batch":
            t0 = time.time()
            along = ProbeAlong(llm, probing[0]) if probing else llm
            batch = rollout(along, next_prompts, len(job["share"]), job["reward_spec"])
            if probing:
                checked(along.got)
            batch["metrics"].update({"data/prompts_seen": pos * len(job["share"]) // per_step,
                                     "sync/logp_diff": probe_diff, "sync/probe_logp": last[0].mean().item(),
                                     "time/gen_s": time.time() - t0,
                                     "time/gen_idle_s": idle_s})
            wait_scored()
            pending = scoring.submit(score_and_send, {"kind": "batch", "version": version, "pos": pos, **batch},
                                     ref_step)
            idle_s = 0.0



def open_llm(job, engine_kw, seed, lost):
    """The engine's LLM: the vLLM server at job["url"] (--gen-urls), which calls lost(line) if it dies or
    stalls while nothing waits on it, or else a vLLM engine of this process's own, which ends the run with
    lost(line) where vLLM refuses a flag's value as it starts."""
    if job["url"]:
        from remote_engine import ServerLLM
        return ServerLLM(job["url"], job["rank_offset"], engine_kw["model"], job["gen_timeout"], seed, lost)
    from vllm import LLM
    try:
        return LLM(seed=seed, **engine_kw, **quiet_vllm_console(engine_kw["model"]))
    # vLLM 0.26 to 0.32: ModelConfig's length check (a pydantic ValueError) and cpu_worker.py's memory check
    # name vLLM's settings, not the flags that set them
    except ValueError as e:
        if longest := re.search(r"derived max_model_len \((\S+) or", str(e)):
            lost(f"grpo_train.py: --max-prompt-len + --max-new-tokens: {engine_kw['max_model_len']} tokens, "
                 f"more than {engine_kw['model']} holds ({longest[1]})")
        if "requested memory for kv" in str(e):
            lost(f"grpo_train.py: --gen-kv-gb {os.environ.get('VLLM_CPU_KVCACHE_SPACE')}: more than this "
                 f"machine has free for vLLM's KV cache ({str(e).partition(' on kv cache')[0]})")
        raise


# the key of rank 0's store under which an engine leaves the line it ends with (end_with)
LOST_KEY = "lost"
# how long an ending engine lets its results' feeder thread write what it holds: enough for a rank 0 that is
# reading (a message cut short by the exit would block its read for good); one that is not reads the line
# in the store instead, and never reads this queue again
FLUSH_S = 5.0
# the server's watch thread and the main thread can both find the server gone: the second waits for the exit
ENDING = threading.Lock()


def end_with(store, results, line):
    """This engine ends the run with `line` (the vLLM server it drives failed): it leaves the line in rank
    0's store, which rank 0 reads whenever it checks its engines (GenerationProcess.check_alive), whether or
    not it is reading this engine's results then; then it exits, after FLUSH_S at most. Rank 0 may not read
    the results for a long time (it waits for a push to land, with a batch of this engine's untaken): waiting
    for the feeder thread without a bound would keep this process, and rank 0 with it, waiting for good."""
    with ENDING:
        store.set(LOST_KEY, line)
        results.close()
        flushing = threading.Thread(target=results.join_thread, daemon=True)
        flushing.start()
        flushing.join(FLUSH_S)
        os._exit(1)
