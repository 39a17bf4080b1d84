"""Memory per GPU for a GRPO run, per model size: DeepSpeed's own ZeRO-2 estimator for the training GPUs
(model states only: weights, gradients, Adam; activations and the log-prob chunks come on top), and bf16
weights for the vLLM and reference-server GPUs (vLLM then fills --gen-mem of the rest with KV cache).
LoRA (--lora-rank 16, the default --lora-targets): the frozen bf16 weights, whole on every GPU, plus the same
estimator's model states for the adapters alone. ESTIMATES, not measurements: this machine has no GPU.

    python bench/memory_table.py [--gpus 1 2 4 6]
"""
import argparse

# parameter counts (tied embeddings counted once) from the models' config.json on the Hugging Face hub
MODELS = {"Qwen2.5-0.5B": 494e6, "Qwen2.5-1.5B": 1.54e9, "Qwen2.5-3B": 3.09e9, "Qwen2.5-7B": 7.62e9}
# (layers, hidden, key/value width, MLP width) from the same config.json files: what LoRA adapts
SHAPES = {"Qwen2.5-0.5B": (24, 896, 128, 4864), "Qwen2.5-1.5B": (28, 1536, 256, 8960),
          "Qwen2.5-3B": (36, 2048, 256, 11008), "Qwen2.5-7B": (28, 3584, 512, 18944)}


def lora_params(layers, hidden, kv, mlp, rank=16):
    """Adapter weights of the default --lora-targets: r x (in + out) for each of q, k, v, o, gate, up, down."""
    per_layer = 2 * (hidden + hidden) + 2 * (hidden + kv) + 3 * (hidden + mlp)
    return layers * rank * per_layer


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 6], help="training GPU counts to show")
    a = p.parse_args()
    if min(a.gpus) < 1:
        raise SystemExit(f"memory_table.py: --gpus {' '.join(map(str, a.gpus))}: each must be 1 or "
                         f"more")
    # after the parse: deepspeed takes seconds to import, which --help need not wait for
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    gib = 2 ** 30
    print("GiB per training GPU, ZeRO-2 model states (DeepSpeed's estimator, bf16 + fp32 master + Adam);")
    print("offload = ds_config_offload.json (optimizer on the CPU; CPU RAM needed in brackets)")
    head = " ".join(f"{f'{n} GPU':>8} {f'{n} GPU offl.':>18}" for n in a.gpus)
    print(f"{'model':<14} {'vLLM/ref bf16':>13} {head} {'LoRA r16: adapters':>19} {'opt.+grads':>10} {'total':>6}")
    for name, n_params in MODELS.items():
        cells = []
        for n in a.gpus:
            _, gpu = estimate_zero2_model_states_mem_needs(int(n_params), num_gpus_per_node=n, cpu_offload=False)
            cpu_off, gpu_off = estimate_zero2_model_states_mem_needs(int(n_params), num_gpus_per_node=n,
                                                                     cpu_offload=True)
            cells.append(f"{gpu / gib:>8.1f} {gpu_off / gib:>7.1f} [{cpu_off / gib:>6.0f} CPU]")
        # LoRA on 1 GPU: only the adapters have gradients and Adam states (full: DeepSpeed's 16 bytes a weight)
        n_lora = lora_params(*SHAPES[name])
        _, lora_states = estimate_zero2_model_states_mem_needs(n_lora, num_gpus_per_node=1, cpu_offload=False)
        opt_grads, total = (lora_states - 2 * n_lora) / gib, (2 * n_params + lora_states) / gib
        lora = f"{n_lora / 1e6:>18.1f}M {opt_grads:>10.2f} {total:>6.1f}"
        print(f"{name:<14} {2 * n_params / gib:>13.1f} {' '.join(cells)} {lora}")


if __name__ == "__main__":
    main()
