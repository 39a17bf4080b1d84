"""Plot a GRPO run's metrics.jsonl: reward and held-out accuracy, KL, completion length and entropy, over
steps (bottom axis) and time (top axis). Every run draws <out-dir>/metrics.png at each evaluation and at its
end (metrics.MetricsLog); this draws it again, or another run's:

    python plot.py runs/demo/metrics.jsonl runs/demo/curve.png

A killed run's torn last line is left out; a metrics file or an output folder that is not there, an output
name matplotlib writes no image for (curve.txt), or a line before the last that is no JSON object (not text,
not JSON, or another JSON value: an image given as the metrics file, a line `7`): one line.
"""
import json
import os
import sys

# (panel title, [(key, label, style)]): one panel each
PANELS = [
    ("reward and held-out accuracy", [("reward/mean", "reward/mean (training prompts)", "-"),
                                      ("eval/accuracy", "eval/accuracy (held out, greedy)", "o-")]),
    ("kl to the reference", [("kl", "kl", "-")]),
    ("completion length (tokens)", [("completion_len/mean", "completion_len/mean", "-")]),
    ("entropy (nats per token)", [("entropy", "entropy", "-")]),
]


class BadLine(ValueError):
    """A line of a metrics file that is no JSON object, and not the last (which a killed run leaves torn)."""


def read_metrics(path):
    """A run's metrics.jsonl, a dict a line, less a torn last line: a last line that is no JSON object (cut
    short, even inside a character) is left out."""
    # read as bytes: a file that is not text (an image given in its place) is one line, not a traceback
    with open(path, "rb") as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    rows = []
    for n, line in lines:
        try:
            row = json.loads(line.rstrip(b"\r\n").decode("utf-8"))
            problem = None if isinstance(row, dict) else f"not a JSON object ({line.decode().strip()[:40]})"
        except UnicodeDecodeError as e:
            problem = f"not a JSON line (not UTF-8 text: byte 0x{line[e.start]:02x}, column {e.start + 1})"
        except json.JSONDecodeError as e:
            problem = f"not a JSON line ({e.msg}, column {e.colno})"
        if problem and n != lines[-1][0]:
            raise BadLine(f"{path}:{n}: {problem}")
        if not problem:
            rows.append(row)
    return rows


def step_lines(path):
    """A run's metrics.jsonl, its steps' lines alone: less the line of an evaluation that arrived with a
    later one, at the end, which has no `loss` (docs/metrics.md)."""
    return [r for r in read_metrics(path) if "loss" in r]


def time_ticks(timed):
    """The top axis of rows that have time/elapsed_s -> (steps, labels, unit): about five of the steps, each
    labelled with the time it was reached, in seconds (minutes from 10 on); with a decimal where whole ones
    would repeat a label (a short run's steps come less than a second apart)."""
    unit, scale = ("seconds", 1) if timed[-1]["time/elapsed_s"] < 600 else ("minutes", 60)
    ticks = timed[::max(1, len(timed) // 5)]
    values = [r["time/elapsed_s"] / scale for r in ticks]
    digits = 0 if len({f"{v:.0f}" for v in values}) == len(values) else 1
    return [r["step"] for r in ticks], [f"{v:.{digits}f}" for v in values], unit


def plot_metrics(metrics_jsonl_path, out_png, title="GRPO"):
    """Four panels of a run's metrics per step (an evaluation at the step whose weights it scored,
    eval/step), the time since the metrics log opened on the top axis (time_ticks). Returns the path written
    (out_png, with the default format's extension, .png, added where it has none). Uses
    matplotlib's object API (no pyplot state): safe beside anything else the process draws."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    rows = [r for r in read_metrics(metrics_jsonl_path) if "step" in r]
    fig = Figure(figsize=(10, 6.4), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2, sharex=True).flatten()
    for ax, (name, series) in zip(axes, PANELS):
        for key, label, style in series:
            step_key = "eval/step" if key.startswith("eval/") else "step"
            points = [(r[step_key], r[key]) for r in rows if r.get(key) is not None and step_key in r]
            if points:
                ax.plot(*zip(*points), style, lw=1.3, ms=4, label=label)
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.set_ylim(-0.02, 1.02)
            ax.legend(loc="lower right", fontsize=8)
    for ax in axes[2:]:
        ax.set_xlabel("step")
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    timed = [r for r in rows if "time/elapsed_s" in r]
    if len(timed) > 1:   # the time on top, at the steps where it was reached
        steps, labels, unit = time_ticks(timed)
        for ax in axes[:2]:
            top = ax.secondary_xaxis("top")
            top.set_xticks(steps, labels)
            top.set_xlabel(f"{unit} since the start", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    # a name without an extension gets the default format's from matplotlib (curve -> curve.png):
    # the file returned is the one written
    if not os.path.splitext(out_png)[1][1:]:
        out_png = os.fspath(out_png).rstrip(".") + "." + fig.canvas.get_default_filetype()
    fig.savefig(out_png)
    return out_png


def main(argv):
    """The command line: the image's path, or one line naming what is wrong and exit status 1."""
    if argv in (["-h"], ["--help"]):
        print(__doc__.strip())
        return
    if len(argv) != 2:
        sys.exit("usage: python plot.py METRICS_JSONL OUT_PNG")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    # said before the metrics are read: matplotlib would say it only once the figure is drawn
    formats = sorted(FigureCanvasAgg.get_supported_filetypes())
    extension = os.path.splitext(argv[1])[1][1:].lower()
    if extension and extension not in formats:
        sys.exit(f"plot.py: {argv[1]}: no image format is named .{extension}: end the name with one of "
                 f"{', '.join('.' + f for f in formats)}")
    try:
        print(plot_metrics(*argv))
    except OSError as e:
        sys.exit(f"plot.py: {e.filename}: {e.strerror}")
    except BadLine as e:
        sys.exit(f"plot.py: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
