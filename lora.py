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
        merged = {f"{name}.base_layer.weight": layer.base_layer.weight + sum(map(layer.get_delta_weight,
                                                                                   layer.active_adapters))
                  for name, layer in model.named_modules() if isinstance(layer, LoraLayer)}
    return [(name.replace(".base_layer.", "."), merged.get(name, w)) for name, w in named if ".lora_" not in name]


def base_model_view(model):
    """A LoRA policy as ref_server.model_fingerprint reads a model (config, state_dict): its weights merged, under
    the base model's names (vllm_weights). The policy itself when it has no adapters."""
    if not getattr(model, "peft_config", None):
        return model
    state = dict(vllm_weights(model, model.state_dict().items()))
    return SimpleNamespace(config=model.config, state_dict=lambda: state)
