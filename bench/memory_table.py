"""Memory per GPU for a GRPO run, per model size: DeepSpeed's own ZeRO-2 estimator for the training GPUs
(model states only: weights, gradients, Adam; activations and the log-prob chunks come on top), and bf16
weights for the vLLM and reference-server GPUs (vLLM then fills --gen-mem of the rest with KV cache).
ESTIMATES, not measurements: this machine has no GPU.

    python bench/memory_table.py [--gpus 1 2 4 6]
"""
import argparse

from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

# parameter counts (tied embeddings counted once) from the models' config.json on the Hugging Face hub
MODELS = {"Qwen2.5-0.5B": 494e6, "Qwen2.5-1.5B": 1.54e9, "Qwen2.5-3B": 3.09e9, "Qwen2.5-7B": 7.62e9}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 6], help="training GPU counts to show")
    a = p.parse_args()
    gib = 2 ** 30
    print("GiB per training GPU, ZeRO-2 model states (DeepSpeed's estimator, bf16 + fp32 master + Adam);")
    print("offload = ds_config_offload.json (optimizer on the CPU; CPU RAM needed in brackets)")
    head = " ".join(f"{f'{n} GPU':>8} {f'{n} GPU offl.':>18}" for n in a.gpus)
    print(f"{'model':<14} {'vLLM/ref bf16':>13} {head}")
    for name, n_params in MODELS.items():
        cells = []
        for n in a.gpus:
            _, gpu = estimate_zero2_model_states_mem_needs(int(n_params), num_gpus_per_node=n, cpu_offload=False)
            cpu_off, gpu_off = estimate_zero2_model_states_mem_needs(int(n_params), num_gpus_per_node=n,
                                                                     cpu_offload=True)
            cells.append(f"{gpu / gib:>8.1f} {gpu_off / gib:>7.1f} [{cpu_off / gib:>6.0f} CPU]")
        print(f"{name:<14} {2 * n_params / gib:>13.1f} {' '.join(cells)}")


if __name__ == "__main__":
    main()
