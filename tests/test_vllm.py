"""vLLM's CPU build, in process: sampling log-probs agree with the trainer's, and a weight push really lands
(both silent traps of vLLM 0.32's reload: the tied lm_head on CPU and the prefix cache)."""
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_train import completion_logps
from plumbing import pad_batch
from weight_sync import load_weights_into_vllm, repack_cpu_lm_head

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
vllm = pytest.importorskip("vllm")
from vllm.inputs import TokensPrompt  # noqa: E402

PROMPT = [10, 11, 12, 13]
LONG_PROMPT = [10 + i % 90 for i in range(300)]   # long enough for the prefix cache to hold many blocks


@pytest.fixture(scope="module")
def setup(tiny_model):
    torch.set_num_threads(1)
    llm = vllm.LLM(tiny_model, dtype="float32", enforce_eager=True, seed=0, max_model_len=512,
                   logprobs_mode="processed_logprobs", enable_prefix_caching=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return llm, model


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


def test_reload_alone_keeps_the_old_tied_lm_head_and_our_push_fixes_it(setup):
    llm, model = setup
    weights = perturbed(model, seed=1)
    assert "lm_head.weight" not in weights   # tied: only the embedding is pushed
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
    llm.reset_prefix_cache()
    assert max_logp_diff(model, PROMPT, sample(llm, PROMPT)) > 0.1   # the trap, on vLLM 0.32's CPU build
    load_weights_into_vllm(llm, weights)
    assert max_logp_diff(model, PROMPT, sample(llm, PROMPT)) < 1e-3


def test_push_clears_prefix_cache_computed_with_old_weights(setup):
    llm, model = setup
    sample(llm, LONG_PROMPT, max_tokens=2)   # fills the prefix cache with this prompt's KV
    weights = perturbed(model, seed=2)
    # reload without the cache reset: the cached prompt KV still comes from the old weights
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
    llm.collective_rpc(repack_cpu_lm_head)
    assert max_logp_diff(model, LONG_PROMPT, sample(llm, LONG_PROMPT)) > 0.1
    load_weights_into_vllm(llm, weights)
    assert max_logp_diff(model, LONG_PROMPT, sample(llm, LONG_PROMPT)) < 1e-3


def test_weight_sync_versions_eval_requests_and_probe_check(setup):
    from weight_sync import WeightSync
    llm, model = setup
    probe = LONG_PROMPT[:40]
    ids = torch.tensor([probe])

    def trainer_probe():
        with torch.no_grad():
            return completion_logps(model, ids, torch.ones_like(ids), len(probe) - 1)[0]

    sync = WeightSync(model.named_parameters(), probe)
    assert sync.push(model.named_parameters(), trainer_probe(), evaluate=True) == 0
    version, eval_version, diff = sync.pull(llm, -1)
    assert (version, eval_version) == (0, 0) and diff < 1e-3
    assert sync.pull(llm, 0) is None   # nothing newer
    perturbed(model, seed=3)
    assert sync.push(model.named_parameters(), trainer_probe(), evaluate=False) == 1
    version, eval_version, diff = sync.pull(llm, 0)
    assert (version, eval_version) == (1, 0) and diff < 1e-3   # the new weights landed
    # a probe that does not match what vLLM serves is reported, not hidden
    sync.push(model.named_parameters(), trainer_probe() + 0.5, evaluate=False)
    assert sync.pull(llm, 1)[2] == pytest.approx(0.5, abs=1e-3)
