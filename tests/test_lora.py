"""LoRA's pieces on the tiny model, without DeepSpeed or vLLM (tests/test_checkpoint.py and tests/test_e2e.py run
those): the flags' checks, the gradients that reach the adapters, and the merged weights a push sends."""
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from grpo_train import completion_logps
from lora import vllm_weights
from run_setup import LORA_TARGETS, load_policy


def test_a_lora_target_the_model_lacks_is_named(tiny_model):
    """peft alone would train q_proj and say nothing of a mistyped qq_proj beside it."""
    with pytest.raises(SystemExit, match="--lora-targets: the model has no layer named qq_proj; its linear "
                                         "layers: .*q_proj"):
        load_policy(tiny_model, lora_rank=4, lora_targets="q_proj,qq_proj")
    model, _ = load_policy(tiny_model, lora_rank=4, lora_targets="all-linear")
    assert any(".lora_A." in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("targets,expected", [
    ("input_layernorm", "input_layernorm is a Qwen2RMSNorm, not a linear layer"),
    ("q_proj,mlp", "mlp is a Qwen2MLP, not a linear layer"),
    ("0", "0 is a Qwen2DecoderLayer, not a linear layer"),
    ("", "--lora-targets '': an empty name"),
    ("q_proj,", "--lora-targets 'q_proj,': an empty name"),
    # the tiny model ties lm_head to the embedding: vLLM sampled with the unadapted head (logp off by 0.9)
    ("q_proj,lm_head", "lm_head shares its weight with the embedding (tie_word_embeddings), which vLLM "
                       "would use unadapted; adapt the other linear layers: down_proj, gate_proj, k_proj, "
                       "o_proj, q_proj, up_proj, v_proj")])
def test_a_lora_target_that_is_no_linear_layer_is_one_line(tiny_model, targets, expected):
    """A norm, a decoder block or an empty name went through to peft, which raised a traceback; a tied lm_head
    through to a push that left it out."""
    with pytest.raises(SystemExit) as stop:
        load_policy(tiny_model, lora_rank=4, lora_targets=targets)
    message = str(stop.value.code)
    assert message.startswith("grpo_train.py: --lora-targets") and expected in message, message
    assert "\n" not in message


def test_only_the_adapters_get_gradients_with_and_without_gradient_checkpointing(tiny_model):
    """The loss's log-probs (completion_logps) backpropagate into the adapters alone; --grad-ckpt's recomputation
    gives the same gradients. At the start B = 0, so A's gradient is 0 and B's is not."""
    ids = torch.randint(10, 60, (3, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for grad_ckpt in (False, True):
        model, _ = load_policy(tiny_model, grad_ckpt, lora_rank=4)
        completion_logps(model, ids, torch.ones_like(ids), 8).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        assert all(p.requires_grad == (".lora_" in n) for n, p in model.named_parameters())
    assert grads[0].keys() == grads[1].keys() and all(".lora_" in n for n in grads[0])
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g)
        assert (g.abs().max() > 0) == (".lora_B." in n), n


def test_the_push_sends_peft_merged_weights_under_the_base_models_names(tiny_model):
    """vllm_weights against peft's own merge (merge_and_unload) of the same trained adapters: the same names as
    the base model's parameters, in its order, and the same values; the model itself is left unmerged."""
    model, _ = load_policy(tiny_model, lora_rank=4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    before = {n: p.clone() for n, p in model.named_parameters()}
    sent = vllm_weights(model)
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert [n for n, _ in sent] == [n for n, _ in base.named_parameters()]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS.split(","))
    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), config)
    loaded = reference.load_state_dict({f"base_model.model.{n}": p for n, p in before.items()}, strict=False)
    assert loaded.missing_keys == ["base_model.model.lm_head.weight"] and not loaded.unexpected_keys   # tied
    merged = dict(reference.merge_and_unload().named_parameters())
    for name, w in sent:
        torch.testing.assert_close(w, merged[name], rtol=1e-6, atol=1e-6)
    assert max((w - dict(base.named_parameters())[n]).abs().max().item() for n, w in sent) > 1e-3
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.fixture(scope="module")
def untied_model(tmp_path_factory):
    """The tiny model with an lm_head of its own (tie_word_embeddings=False, as Qwen2.5-7B)."""
    from demo.tiny_model import build_model, build_tokenizer, save
    tok = build_tokenizer()
    model = build_model(tok, seed=0, tie_word_embeddings=False)
    return save(model, tok, str(tmp_path_factory.mktemp("untied")))


def test_an_fp32_lm_head_computes_with_its_adapter(untied_model):
    """--fp32-lm-head with lm_head among --lora-targets, on a model whose lm_head is its own: the trainer's
    log-probs are those of the merged weights a push sends vLLM, and the head's adapter gets gradients. The
    fp32 head computed with the base weight alone (up to 1.5 nats from the merged model's; no gradient)."""
    ids = torch.randint(10, 60, (3, 16), generator=torch.Generator().manual_seed(0))
    model, _ = load_policy(untied_model, lora_rank=4, lora_targets="q_proj,lm_head", fp32_lm_head=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    logps = completion_logps(model, ids, torch.ones_like(ids), 8)
    pushed = AutoModelForCausalLM.from_pretrained(untied_model)
    pushed.load_state_dict(dict(vllm_weights(model)))
    torch.testing.assert_close(logps.detach(), completion_logps(pushed, ids, torch.ones_like(ids), 8))
    logps.sum().backward()
    head = {n: p.grad for n, p in model.named_parameters() if n.startswith("lm_head.lora_")}
    assert len(head) == 2 and all(g is not None and g.abs().max() > 0 for g in head.values()), head
