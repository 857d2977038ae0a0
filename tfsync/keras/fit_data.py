"""The input iterators of a ``fit``, dropped off the training thread.

TensorFlow's ``tf.data`` autotuner (on by default, and in the pipeline ``fit`` builds for
NumPy arrays) gives every iterator a thread that wakes up at periods doubling from 10 ms
to 60 s.  Destroying the iterator waits for that thread, and the thread sometimes sleeps
out its period although the iterator has cancelled it: TensorFlow 2.21, 3.6-3.8 s after a
7-s epoch, in plain Keras too (``docs/results/chaos/README.md``, "Stalls at epoch ends").
Keras builds a new iterator for every epoch of data and drops the last one on the
training thread (at the next epoch's first step, or as ``fit`` returns), so such an end
stops the worker for seconds, and its peers wait for it in the next collective.

:class:`FitData` holds the iterator the train function was last called with (one identity
comparison a step).  When the train function is called with another one, or the ``fit``
ends, it hands the one it holds to a daemon thread that drops it once nothing else holds
it.  The wait then holds that thread only: TensorFlow releases Python's lock while it
deletes a tensor, so training goes on meanwhile.
"""

import sys
import threading
import time

RELEASE_POLL_S = 0.05
# a reference held elsewhere past this (the user's): the thread drops its own, and the
# iterator is destroyed wherever that one goes, as it would be without tfsync
RELEASE_WAIT_S = 600.0
THREAD_NAME = "tfsync-fit-data-release"


class FitData:
    """The iterator a ``fit``'s train function was last called with, dropped off-thread."""

    def __init__(self):
        self._current = None

    def watching(self, train_function):
        """``train_function``, holding the iterator it is called with; the one it held before
        (an earlier epoch's) goes to the release thread."""

        def train_function_watching_data(iterator):
            if iterator is not self._current:
                _release(self._hold(iterator))
            return train_function(iterator)

        return train_function_watching_data

    def release(self) -> bool:
        """Hand the iterator held, if any, to the release thread (at ``fit``'s end, or a reset's);
        whether there was one."""
        return _release(self._hold(None))

    def _hold(self, iterator):
        previous, self._current = self._current, iterator
        return previous


def _release(iterator) -> bool:
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
