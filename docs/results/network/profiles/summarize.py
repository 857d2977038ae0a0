"""Where one worker's threads spent a py-spy profile (``py-spy record --threads --idle --format raw``).

Usage: python summarize.py PROFILE.txt [...]

Each sample of the three threads that matter is put in one class: the training thread
(``MainThread``: Keras' compiled train step, or waiting for a round outside it), the
TensorFlow threads that run the step's ``tf.py_function`` (the engine's step: waiting for a
round, or running a protocol's compiled function), and the exchange thread
(``tfsync-exchange``: inside Horovod's allreduce, or idle with no round pushed).  Shares are of
the profile's wall time: the samples of the thread sampled most (a live thread is sampled
at every tick, running or not, with ``--idle``).
"""

import collections
import sys


def classify(stack):
    frames = stack.split(";")
    thread = frames[0].split(": ", 1)[1] if ": " in frames[0] else "py_function (TensorFlow thread)"
    if thread.startswith(("tfsync-control", "Thread-", "tfsync-collective")):
        return None, None  # (the control plane and the watchdog: waiting on sockets and timers)
    if "horovod_grouped_allreduce" in stack or "horovod_allreduce" in stack:
        return thread, "in Horovod's allreduce"
    if "RoundExchange.wait" in stack:
        return thread, "waiting for a round"
    if thread == "tfsync-exchange" and "Condition.wait" in frames[-1]:
        return thread, "idle: no round pushed"
    if "compile_flat" in stack:
        return thread, "a protocol's compiled function"
    if "train_function" in stack:
        return thread, "the train step (graph)"
    return thread, "other (Python, no frame)"


def summarize(path):
    counts, totals = collections.Counter(), collections.Counter()
    with open(path) as f:
        for line in f:
            stack, n = line.rsplit(" ", 1)
            thread, what = classify(stack)
            if thread is None:
                continue
            counts[thread, what] += int(n)
            totals[thread] += int(n)
    wall = max(totals.values())
    print(f"{path}: {wall} samples")
    for (thread, what), n in sorted(counts.items()):
        print(f"  {thread:34s} {what:34s} {n:5d} {n / wall:5.0%}")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        summarize(p)
