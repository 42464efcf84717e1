"""
Progress of long work: a count and an ETA for the commands that otherwise say nothing until they end (the library
index over thousands of stores, embed over a survey, export of a large checkpoint, the probe, the label-efficiency
table).

    with Progress(total=len(todo), desc="indexing", unit="store") as bar:
        ...; bar.update()                      # one done (any thread)
        bar.write("a line for stdout")         # print(), with the bar out of the way
    torch.save(obj, CountingWrites(f, bar))    # a file's bytes as they are written

Where it goes. Progress is talk about the work, not its result, so it goes to stderr: a command's stdout stays
exactly what it was (the tests, and `M=$(python -m scripts.export ...)`, read its last line). Two ways to show it,
chosen by what stderr is:
  a terminal     tqdm's bar (count, percentage, rate, ETA), redrawn in place: the user watches it
  anything else  (a log file, a pipe, launch.sh's log) a plain line at most every `every_s` seconds, and one at
                 the end, e.g. `indexing: 120/4000 (3.0%) | 2.10 store/s | elapsed 00:57 | ETA 30:47`.
                 A bar's carriage returns would fill a log with thousands of half-lines, and a line every 0.1 s
                 (tqdm's pace) would bury the command's own lines; every 30 s is enough to see it is alive and
                 when it will end. MAE_PROGRESS_EVERY_S sets the interval (the tests shorten it).
Work inside work (an export inside a fine-tuning table) gets a second bar below the first, gone when done
(tqdm's leave=None: only the outermost bar stays on the screen). Under torchrun every rank runs the same loop,
so only rank 0 (RANK, 0 when unset) shows it; the others count in silence, so that the code that calls update()
is the same on every rank.

The rate is the average since the start (tqdm's smoothing=0, in both modes): the commands' items come in
repeating patterns (a draw of the probe, a seed of the table), and over whole patterns the average is the true
rate, where a moving average would swing with each item's own cost.

Nothing here changes what is computed: it counts, and writes to stderr (and stdout only through write(), with
the caller's text).
"""
import os
import sys
import threading
import time

from tqdm import tqdm

EVERY_S = 30.0  # seconds between plain lines, unless MAE_PROGRESS_EVERY_S or every_s says otherwise


def _say(text):
    print(text, flush=True)  # the commands' own lines are flushed: a log shows them as they come


class Progress:
    """A count of `total` things (None: unknown, no percentage or ETA; an estimate: a count past it raises it),
    `initial` of them done before (a resumed run: they count for the percentage, not for the rate). unit: what a
    thing is, in the lines ("store", "window"); unit_scale: a count of bytes, shown as KB / MB / GB."""

    def __init__(self, total=None, desc="", unit="it", every_s=None, initial=0, unit_scale=False):
        self.total, self.desc, self.unit, self.unit_scale = total, desc, unit, unit_scale
        self.n = self.initial = initial
        self.every_s = float(os.environ.get("MAE_PROGRESS_EVERY_S", EVERY_S)) if every_s is None else every_s
        self.t0 = self.last = time.monotonic()
        self.lock = threading.Lock()  # update() from a pool's threads (the library index)
        self.closed = False
        self.shown = os.environ.get("RANK", "0") == "0"
        self.printed = None  # the count of the last plain line (the last word is not said twice)
        self.bar = None
        if self.shown and sys.stderr.isatty():
            # a terminal that reports no size (a pty nobody sized: `script`, some CI runners) gets no bar at all
            # from tqdm (it hides bars below the last row): then a fixed 80 x 24
            sized = min(os.get_terminal_size(sys.stderr.fileno())) > 0
            self.bar = tqdm(total=total, desc=desc, unit=unit, initial=initial, unit_scale=unit_scale,
                            unit_divisor=1024 if unit_scale else 1000, file=sys.stderr, dynamic_ncols=sized,
                            ncols=None if sized else 80, nrows=None if sized else 24, smoothing=0, leave=None)

    def update(self, n=1):
        """`n` more things done."""
        with self.lock:
            self.n += n
            if self.total is not None and self.n > self.total:  # an estimate passed (a file's headers on top of
                self.total = self.n                              # its weights): the count is the truth
                if self.bar is not None:
                    self.bar.total = self.n
            if self.bar is not None:
                self.bar.update(n)
            elif self.shown and time.monotonic() - self.last >= self.every_s:
                self._line()

    def write(self, text, log=_say):
        """log(text) (default: print it to stdout, flushed) without tearing the bar: tqdm clears it, the line goes
        out, the bar is drawn again below it. The text is the caller's, unchanged, in every mode."""
        if self.bar is None:
            log(text)
            return
        with tqdm.external_write_mode(file=sys.stdout):
            log(text)

    def close(self):
        """The last word: the bar left at its final count, or a last plain line (also after an error: how far it
        got, before the error's own line)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if self.bar is not None:
                self.bar.close()
            elif self.shown and self.printed != self.n:
                self._line()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _line(self):
        """One plain line on stderr: count, percentage, rate, elapsed, ETA (tqdm's own formatting of sizes and
        intervals, so that the two modes read alike)."""
        now = time.monotonic()
        self.last, self.printed, elapsed = now, self.n, now - self.t0
        rate = (self.n - self.initial) / elapsed if elapsed > 0 else 0.0

        def count(x):
            return tqdm.format_sizeof(x, "B", 1024) if self.unit_scale else f"{x:,}"
        text = f"{self.desc}: {count(self.n)}"
        if self.total:
            text += f"/{count(self.total)} ({100 * self.n / self.total:.1f}%)"
        if rate <= 0:
            speed = f"? {self.unit}/s"
        elif self.unit_scale:
            speed = tqdm.format_sizeof(rate, "B/s", 1024)
        else:  # a slow thing (a fine-tuning run) reads better as seconds per thing
            speed = f"{rate:.2f} {self.unit}/s" if rate >= 1 else f"{1 / rate:.1f} s/{self.unit}"
        text += f" | {speed} | elapsed {tqdm.format_interval(elapsed)}"
        if self.total:
            left = max(0, self.total - self.n)
            text += f" | ETA {tqdm.format_interval(left / rate) if rate > 0 else '?'}"
        print(text, file=sys.stderr, flush=True)


class CountingWrites:
    """A file object whose write() also counts the bytes into `bar`: torch.save into it shows the one long write
    of an export (a model file of 1.6 B parameters is 6.4 GB) as bytes written so far."""

    def __init__(self, f, bar):
        self._f, self._bar = f, bar

    def write(self, b):
        n = self._f.write(b)
        self._bar.update(memoryview(b).nbytes)  # (bytes or a buffer: its size in bytes either way)
        return n

    def __getattr__(self, name):  # flush, fileno, tell ...: the file's own
        return getattr(self._f, name)
