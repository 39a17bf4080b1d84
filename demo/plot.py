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
    """reward/mean per step and eval/accuracy per evaluation, over wall time (time/elapsed_s: seconds since the
    trainer started; an evaluation is placed where its result was logged), on one 0..1 axis; the top axis
    counts optimizer steps. Returns out_png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(metrics_jsonl_path) if "step" in r and "time/elapsed_s" in r]
    reward = [(r["time/elapsed_s"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    acc = [(r["time/elapsed_s"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if reward:
        ax.plot(*zip(*reward), color="tab:blue", alpha=0.6, lw=1.2, label="reward/mean (train prompts)")
    if acc:
        ax.plot(*zip(*acc), color="tab:red", marker="o", lw=2, label="eval/accuracy (held-out, greedy)")
    ax.set_xlabel("seconds since the trainer started (time/elapsed_s)")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    if len(rows) > 1:   # optimizer steps on top, at the times they ended
        top = ax.secondary_xaxis("top")
        ticks = rows[::max(1, len(rows) // 6)]
        top.set_xticks([r["time/elapsed_s"] for r in ticks], [str(r["step"]) for r in ticks])
        top.set_xlabel("step")
    ax.set_title(title or "GRPO on the demo task", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m demo.plot METRICS_JSONL OUT_PNG")
    print(plot_metrics(sys.argv[1], sys.argv[2]))
