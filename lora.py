"""LoRA's one fragile integration: a policy with peft's adapters, seen as the base model it adapts (what vLLM,
the reference server and the merged checkpoint take). run_setup.load_policy adds the adapters; generation.py,
run_setup.py and checkpoints.py use this."""
from types import SimpleNamespace

import torch


def vllm_weights(model, named=None):
    """The policy's weights as vLLM's model names them -> [(name, tensor)], of `named` (the model's (name, tensor)
    pairs: its named_parameters by default, or its state_dict's items). With LoRA adapters (tested with peft
    0.21.2's LoRA layers, added by transformers 5.19's add_adapter), each adapted layer's weight is merged,
    W + scale B A, under the base layer's name (peft's `q_proj.base_layer.weight` is vLLM's `q_proj.weight`),
    and the adapters' own weights are left out. The merge goes into new tensors (so a push holds a merged copy of
    the adapted weights while it sends): merging into W in place and back would not give W back bit for bit, and
    the run would drift from the base weights a resumed run starts from."""
    named = list(model.named_parameters() if named is None else named)
    if not getattr(model, "peft_config", None):
        return named
    from peft.tuners.lora import LoraLayer
    with torch.no_grad():
        merged = {f"{name}.base_layer.weight": merged_weight(layer)
                  for name, layer in model.named_modules() if isinstance(layer, LoraLayer)}
    return [(name.replace(".base_layer.", "."), merged.get(name, w)) for name, w in named if ".lora_" not in name]


def merged_weight(layer):
    """A linear layer's weight as a push sends it to vLLM: with LoRA adapters (peft's LoraLayer), a new tensor
    W + scale B A, through which the adapters get their gradients; the layer's own weight otherwise."""
    if not hasattr(layer, "get_delta_weight"):
        return layer.weight
    return layer.base_layer.weight + sum(map(layer.get_delta_weight, layer.active_adapters))


def base_model_view(model):
    """A LoRA policy as ref_server.model_fingerprint reads a model (config, state_dict): its weights merged, under
    the base model's names (vllm_weights). The policy itself when it has no adapters."""
    if not getattr(model, "peft_config", None):
        return model
    state = dict(vllm_weights(model, model.state_dict().items()))
    return SimpleNamespace(config=model.config, state_dict=lambda: state)


def adapter_targets(model, spec: str):
    """--lora-targets "q_proj,v_proj" -> the names peft's LoraConfig matches (or "all-linear"). ValueError,
    naming the flag, for a name that is empty, that no layer of the model has, or that names what LoRA does
    not adapt here (a norm, a decoder block, an embedding, an lm_head tied to the embedding): each must name
    linear layers."""
    if spec == "all-linear":
        return spec
    kinds = {}   # a layer's last name -> the kinds of module under it
    for name, module in model.named_modules():
        kinds.setdefault(name.rsplit(".", 1)[-1], set()).add(type(module))
    # a tied lm_head is the embedding to vLLM (peft merges into lm_head alone): vLLM would sample unadapted
    heads = [n for n, m in model.named_modules() if m is model.get_output_embeddings()]
    tied = getattr(model.config, "tie_word_embeddings", False) and heads and heads[0].rsplit(".", 1)[-1]
    linear = sorted(n for n, k in kinds.items() if n and k == {torch.nn.Linear} and n != tied)
    targets = spec.split(",")
    for t in targets:
        if not t.strip():
            raise ValueError(f"--lora-targets {spec!r}: an empty name (names are comma-separated, e.g. "
                             f"{','.join(linear[:2])}; or all-linear)")
        if t not in kinds:
            raise ValueError(f"--lora-targets: the model has no layer named {t}; its linear layers: "
                             f"{', '.join(linear)}")
        if t == tied:
            raise ValueError(f"--lora-targets: {t} shares its weight with the embedding (tie_word_embeddings), "
                             f"which vLLM would use unadapted; adapt the other linear layers: "
                             f"{', '.join(linear)}")
        if kinds[t] != {torch.nn.Linear}:
            what = ", ".join(sorted(k.__name__ for k in kinds[t]))
            raise ValueError(f"--lora-targets: {t} is a {what}, not a linear layer (LoRA adapts linear "
                             f"layers here: {', '.join(linear)})")
    return targets
