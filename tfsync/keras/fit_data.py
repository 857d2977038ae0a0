"""The input iterator of a ``fit``, dropped off the training thread when the ``fit`` ends.

TensorFlow's ``tf.data`` autotuner (on by default, and in the pipeline ``fit`` builds for
NumPy arrays) gives every iterator a thread that wakes up at periods doubling from 10 ms
to 60 s.  Destroying the iterator waits for that thread, and the thread sometimes sleeps
out its period although the iterator has cancelled it: TensorFlow 2.21, 3.6-3.8 s after a
7-s ``fit``, in plain Keras too (``docs/results/chaos/README.md``, "Stalls at epoch ends").
``fit`` drops its iterator as it returns, on the training thread, so such an end stops the
worker for seconds, and its peers wait for it in the next collective: a job that fits one
epoch at a time (mid-epoch resume) pays it at epoch ends.

:class:`FitData` notes the iterator the train function is called with (a weak reference,
kept off the step's hot path but for one comparison), and at ``on_train_end`` hands it to a
daemon thread that drops it once nothing else holds it (``fit`` has returned).  The wait
then holds that thread only: TensorFlow releases Python's lock while it deletes a tensor,
so training goes on meanwhile.
"""

import sys
import threading
import time
import weakref

RELEASE_POLL_S = 0.05
# a reference held elsewhere past this (the user's): this thread drops its own, and the
# iterator is destroyed wherever that one goes, as without tfsync
RELEASE_WAIT_S = 600.0
THREAD_NAME = "tfsync-fit-data-release"


class FitData:
    """The last iterator a ``fit``'s train function was called with, released off-thread."""

    def __init__(self):
        self._seen = None  # a weak reference to it, or None

    def watching(self, train_function):
        """``train_function``, noting (weakly) the iterator it is called with."""

        def train_function_watching_data(iterator):
            seen = self._seen
            if seen is None or seen() is not iterator:
                try:
                    self._seen = weakref.ref(iterator)
                except TypeError:  # (no weak references to it: left to Keras)
                    self._seen = None
            return train_function(iterator)

        return train_function_watching_data

    def release(self) -> bool:
        """Hand the iterator, if one is alive, to a daemon thread that drops it once it holds
        the last reference; whether there was one.  Called at ``on_train_end``."""
        iterator = self._seen() if self._seen is not None else None
        self._seen = None
        if iterator is None:
            return False
        threading.Thread(target=_drop_when_last, args=([iterator],), daemon=True, name=THREAD_NAME).start()
        return True


def _drop_when_last(box):
    """Drop ``box[0]`` once ``box`` holds its last reference (or after ``RELEASE_WAIT_S``)."""
    deadline = time.monotonic() + RELEASE_WAIT_S
    while sys.getrefcount(box[0]) > 2 and time.monotonic() < deadline:  # (the list's, the argument's)
        time.sleep(RELEASE_POLL_S)
    box.clear()
