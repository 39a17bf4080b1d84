"""A model of one GRPO step of the README's 8-GPU recipe at Qwen2.5-1.5B, for 1, 2 and 3 generation engines:
pure arithmetic on figures measured elsewhere, printed as a table. No GPU, nothing run: a model, not a
measurement.

    python bench/step_model.py [--gen-tok-s 30000] [--ref-servers 1]

The node: 8 GPUs = E generation engines + 1 reference server + (7 - E) training ranks. The step (the
recipe's shape): 32 prompts x 8 completions = 256 sequences of 256 prompt + 512 completion tokens, every
completion at the recipe's --max-new-tokens (the worst case, and the shape of the H100 figures below).

Figures, and where each comes from:
  train    27,495 tokens/s per H100 at 1.5B, bf16, ZeRO-2, micro-batch 8, fixed lengths (no padding):
           MEASURED, bench/README.md section 6 (`python bench/gpu_bench.py --no-gen --steps 5`, world size 1).
  ref      32 x (256 + 512) tokens in 321 ms through ref_server.py's HTTP /logps at 1.5B (76,677 tokens/s):
           MEASURED, bench/README.md section 6 (`python bench/gpu_transfer.py`).
  gen      --gen-tok-s generated tokens/s per engine: NOT MEASURED (no GPU with vLLM has run here). The
           default, 30,000, is a CITED public figure for a bigger model, used as a floor: Qwen3.5-9B on one
           H100 80GB HBM3 with vLLM, "Throughput Profile", 29,822 total (prompt + generated) tokens/s
           (GPUStack performance lab, docs.gpustack.ai/latest/performance-lab/qwen3.5-9b/h100), counted here
           as generated tokens/s. A 1.5B model decodes faster; replace the figure with the measured
           one (bench/gpu_check.py's gen tok/s) when a GPU run has it.
  push     3.09 GB of bf16 weights broadcast over NVLink at --push-gb-s: NOT MEASURED (NCCL refuses two ranks
           on one GPU); 100 GB/s is an assumption between pinned-memory copies (52-54 GB/s, measured) and a
           device-to-device copy (846 GB/s, measured). vLLM's own load after the broadcast is not counted.

Assumptions: training scales linearly with ranks (ZeRO-2's gradient reduction over NVLink is left out);
--padded-fraction of the training positions are padding (bench/padding.py measures it; 0 = the measured
fixed-length shape); generation splits evenly over engines and each engine keeps its --gen-tok-s at a
third of the batch (optimistic: fewer sequences per engine fill the GPU less, and the longest completion
still takes --max-new-tokens decode steps); the reference splits evenly over --ref-servers.

The pipeline (--max-staleness 1): the engines sample batch k+1 while the trainer trains on batch k, so a
step takes the longest of the stages that run side by side. The engines pause for each push, so the
generation stage is gen + push. Two placements of the reference forward:
  previous       the trainer asks for it before training: trainer stage = ref + train + push.
  this version   the rollout asks for it and the reference GPU scores batch k while the engines sample
                 batch k+1: three stages, gen + push, ref, train + push. (If the generation process waited
                 for the reference before sampling on, its stage would be gen + ref + push.)
"""
import argparse

from _common import count, print_table

WEIGHT_GB = 3.09   # Qwen2.5-1.5B in bf16, tied embeddings once (bench/README.md section 6)


def step_times(engines, gpus, seqs, prompt_len, completion_len, gen_tok_s, train_tok_s, ref_tok_s,
               ref_servers, push_gb_s, padded_fraction):
    """-> dict of the phase times in seconds and the step time of each placement of the reference."""
    ranks = gpus - ref_servers - engines
    tokens = seqs * (prompt_len + completion_len)
    t = {"engines": engines, "ranks": ranks,
         "gen": seqs * completion_len / (engines * gen_tok_s),
         "ref": tokens / (ref_servers * ref_tok_s),
         "train": tokens / (1 - padded_fraction) / (ranks * train_tok_s),
         "push": WEIGHT_GB / push_gb_s}
    t["main"] = max(t["gen"] + t["push"], t["ref"] + t["train"] + t["push"])
    stages = {"generation": t["gen"] + t["push"], "reference": t["ref"], "training": t["train"] + t["push"]}
    t["rollout"] = max(stages.values())
    t["critical"] = max(stages, key=stages.get)
    return t


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=count, default=8, help="GPUs on the node")
    p.add_argument("--engines", type=int, nargs="+", default=[1, 2, 3], help="generation engines to show")
    p.add_argument("--ref-servers", type=int, default=1, help="reference servers (one GPU each)")
    p.add_argument("--seqs", type=count, default=256, help="sequences per step (the recipe: 32 prompts x 8)")
    p.add_argument("--prompt-len", type=count, default=256)
    p.add_argument("--completion-len", type=count, default=512, help="tokens of every completion")
    p.add_argument("--gen-tok-s", type=float, default=30000, help="generated tokens/s per engine (cited)")
    p.add_argument("--train-tok-s", type=float, default=27495, help="training tokens/s per rank (measured)")
    p.add_argument("--ref-tok-s", type=float, default=32 * 768 / 0.321, help="reference tokens/s (measured)")
    p.add_argument("--push-gb-s", type=float, default=100, help="weight broadcast GB/s (assumed)")
    p.add_argument("--padded-fraction", type=float, default=0.0, help="padding share of training positions")
    a = p.parse_args()
    if any(e < 1 or a.gpus - a.ref_servers - e < 1 for e in a.engines) or not 0 <= a.padded_fraction < 1:
        raise SystemExit("step_model.py: every --engines value needs >= 1 engine and >= 1 training GPU left "
                         "after the reference servers; --padded-fraction must be in [0, 1)")
    # the model's reference stage is the servers' (--beta 0, no reference, is not modelled)
    if a.ref_servers < 1:
        raise SystemExit(f"step_model.py: --ref-servers {a.ref_servers}: the model needs 1 or more")
    rows = []
    for engines in a.engines:
        t = step_times(engines, a.gpus, a.seqs, a.prompt_len, a.completion_len, a.gen_tok_s, a.train_tok_s,
                       a.ref_tok_s, a.ref_servers, a.push_gb_s, a.padded_fraction)
        rows.append([t["engines"], t["ranks"], f"{t['gen']:.2f}", f"{t['ref']:.2f}", f"{t['train']:.2f}",
                     f"{t['push']:.3f}", f"{t['main']:.2f}", f"{t['rollout']:.2f}", t["critical"]])
    print(f"model, not measurement: {a.seqs} x ({a.prompt_len} + {a.completion_len}) tokens per step, "
          f"{a.gpus} GPUs, {a.ref_servers} reference server(s), "
          f"{a.gen_tok_s:,.0f} gen tok/s per engine (cited)")
    print_table(["engines", "training ranks", "gen s", "ref s", "train s", "push s",
                 "step s, ref on trainer's path (previous version)", "step s, ref in the rollout (this version)",
                 "critical path (this version)"], rows)


if __name__ == "__main__":
    main()
