"""Plot a GRPO run's metrics: mean reward per step and held-out accuracy per evaluated step.

    python -m demo.plot runs/demo/metrics.jsonl runs/demo/curve.png
"""
import json
import sys


def read_metrics(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def plot_metrics(metrics_jsonl_path, out_png, title=None):
    """reward/mean over "step" and eval/accuracy over "eval/step" (falling back to "step"), on one 0..1 axis.

    Returns out_png.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_jsonl_path)
    reward = sorted((r["step"], r["reward/mean"]) for r in rows if "step" in r and "reward/mean" in r)
    acc = sorted((r.get("eval/step", r.get("step")), r["eval/accuracy"]) for r in rows if "eval/accuracy" in r)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if reward:
        ax.plot(*zip(*reward), color="tab:blue", alpha=0.6, lw=1.2, label="reward/mean (train prompts)")
    if acc:
        ax.plot(*zip(*acc), color="tab:red", marker="o", lw=2, label="eval/accuracy (held-out, greedy)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title or "GRPO on the demo task")
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m demo.plot METRICS_JSONL OUT_PNG")
    print(plot_metrics(sys.argv[1], sys.argv[2]))
