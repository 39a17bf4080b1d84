"""The console's step line of a run (MetricsLog writes it): where the run is and when it will end, tqdm's way,
kept to a line a step on a terminal and to about 100 lines a run in a file."""
import contextlib
import math
import sys
import time

import psutil

from placement import leave_a_closed_terminal


def launch_time():
    """When the run was launched: the deepspeed launcher's start (it runs launch.py, which runs this rank),
    else this process's. The closing line's time counts from it, start-up included."""
    from run_config import launcher
    with contextlib.suppress(AttributeError, psutil.Error):
        return launcher().create_time()
    return psutil.Process().create_time()


def clock(seconds):
    """Seconds as a clock, tqdm's way: 05:07, or 1:02:03 from an hour."""
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}" if minutes >= 60 else f"{minutes:02d}:{s:02d}"


class Progress:
    """Where a run is and when it will end, tqdm's format: `step   12/100 [00:35<02:10, 1.33 s/step]`
    (elapsed since the launch < remaining, from the mean step of this launch after its first). A line is
    kept every `every` steps (0: every step up to 100 steps, else about 100 lines a run), at this launch's
    first and the last step, and when asked; between them a terminal rewrites one line in place, and a
    file (not a terminal) gets nothing, so that a log is not flooded."""

    def __init__(self, first, last, every=0, stream=None, started=None):
        self.first, self.last, self.stream = first, last, stream or sys.stdout
        self.every = every or max(1, math.ceil(last / 100))
        self.started = time.time() if started is None else started
        self.t_first, self.open_line = None, False

    def prefix(self, step, now=None):
        now = time.time() if now is None else now
        if step == self.first or self.t_first is None:
            self.t_first, rate = now, None
        else:
            rate = (now - self.t_first) / (step - self.first)
        eta = "?" if rate is None else clock(rate * (self.last - step))
        speed = "?" if rate is None else f"{rate:.2f}"
        return f"step {step:4d}/{self.last} [{clock(now - self.started)}<{eta}, {speed} s/step]"

    def show(self, step, text, keep=False):
        keep = keep or step in (self.first, self.last) or step % self.every == 0
        tty = self.stream.isatty()
        if not (keep or tty):
            return
        # a terminal's in-place line: back to its start, cleared
        back = "\r\x1b[K" if tty and self.open_line else ""
        self.put(back + text + ("\n" if keep else ""))
        self.open_line = not keep

    def say(self, text):
        """A line of its own (a warning, the end), below the line being rewritten, if any."""
        self.put(("\n" if self.open_line else "") + text + "\n")
        self.open_line = False

    def put(self, text):
        """text, now; to a terminal that has closed (placement.leave_a_closed_terminal), to no one."""
        try:
            self.stream.write(text)
            self.stream.flush()
        except OSError:
            if not leave_a_closed_terminal():
                raise
