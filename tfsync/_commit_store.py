"""An elastic job's last commit on storage: what lets the job restart when every worker is gone.

:class:`tfsync.elastic.KerasState` keeps its commits in host memory; a reset restores and
broadcasts them from a surviving worker.  When no worker of the job survives (every host of
the last round removed, preempted, or the job relaunched) that memory is gone.  Given a
directory every host shares (``commit_dir=``, or ``TFSYNC_COMMIT_DIR``), the job's rank 0
writes each commit there too, and the rank 0 of a job that has no newer commit in memory
(a fresh process) reads it before the state is broadcast.

One file, ``tfsync-elastic-state.npz`` (NumPy's ``.npz``: ``v0``, ``v1``, ... the variables in
the state's order, and ``meta``, the pickled attributes and the variables' shapes and dtypes),
replaced atomically (written beside it, then renamed), so a reader sees a whole commit, the
last one or the one before.  A writer thread writes it, the newest commit only: the training
step does not wait for the disk, and a commit made while the last is still being written
replaces it in the queue (it is newer).  A failed write (a full disk, a lost mount) is logged
and counted, and training goes on: the commit is still in memory.
"""

import logging
import os
import pickle
import threading
import time

import numpy as np

log = logging.getLogger("tfsync.elastic")

FILE_NAME = "tfsync-elastic-state.npz"
FORMAT = 1


class CommitStore:
    """The commit file in ``directory``, created (with the directory) when first written.

    Refuses, at construction, a directory it cannot create or write (``ValueError``)."""

    def __init__(self, directory: str):
        self.directory = os.path.abspath(os.path.expanduser(str(directory)))
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            raise ValueError(
                f"tfsync.elastic: commit_dir={directory!r} cannot be created ({exc.strerror}); pass a directory "
                f"every host of the job can write (shared storage: NFS, a mounted bucket), or None"
            ) from None
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise ValueError(
                f"tfsync.elastic: commit_dir={directory!r} is not writable by this process; pass a directory "
                f"every host of the job can write (shared storage: NFS, a mounted bucket), or None"
            )
        self.path = os.path.join(self.directory, FILE_NAME)
        self.written = 0  # commits written
        self.write_s = 0.0  # seconds the writer spent writing them
        self.failed = 0  # writes that failed (logged)
        self.last_error = None
        self._pending = None  # the newest commit not yet written: (values, attrs, position)
        self._cond = threading.Condition()
        self._busy = False
        self._thread = None

    # ------------------------------------------------------------------ writing
    def write(self, values, attrs, position):
        """Queue a commit: ``values`` (the variables' NumPy copies, never changed afterwards),
        ``attrs`` (the state's attributes, a copy) and ``position`` (epoch, sample).  Returns at
        once; a commit still queued is replaced."""
        with self._cond:
            self._pending = (values, attrs, position)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tfsync-commit-writer", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the queued commit to be written; whether it was."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _run(self):
        while True:
            with self._cond:
                while self._pending is None:
                    self._cond.wait()
                item, self._pending, self._busy = self._pending, None, True
            t = time.monotonic()
            try:
                self._write_file(*item)
                self.written += 1
                self.write_s += time.monotonic() - t
            except Exception as exc:  # noqa: BLE001 - a storage failure must not stop training
                self.failed += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "tfsync.elastic: the commit at epoch %s, sample %s could not be written to %s (%s); it is "
                    "still in memory, and the job could not restart from it if every worker were lost",
                    item[2][0],
                    item[2][1],
                    self.path,
                    self.last_error,
                )
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write_file(self, values, attrs, position):
        meta = {
            "format": FORMAT,
            "attrs": attrs,
            "position": tuple(position),
            "shapes": [tuple(v.shape) for v in values],
            "dtypes": [str(v.dtype) for v in values],
            "time": time.time(),
        }
        tmp = f"{self.path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                arrays = {f"v{i}": v for i, v in enumerate(values)}
                np.savez(f, meta=np.frombuffer(pickle.dumps(meta), np.uint8), **arrays)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    # ------------------------------------------------------------------ reading
    def read_meta(self):
        """The last commit's metadata (a dict: ``attrs``, ``position``, ``shapes``, ``dtypes``,
        ``time``), or None when the directory holds none."""
        if not os.path.exists(self.path):
            return None
        with np.load(self.path, allow_pickle=False) as data:
            return self._meta(data)

    def read(self, after=None):
        """``(meta, values)`` of the last commit, or None: when there is none, or its position
        (epoch, sample) is not past ``after`` (the variables are then not read)."""
        if not os.path.exists(self.path):
            return None
        with np.load(self.path, allow_pickle=False) as data:
            meta = self._meta(data)
            if after is not None and tuple(meta["position"]) <= tuple(after):
                return None
            return meta, [data[f"v{i}"] for i in range(len(meta["shapes"]))]

    def _meta(self, data):
        try:
            meta = pickle.loads(data["meta"].tobytes())
        except Exception as exc:  # noqa: BLE001 - said below
            raise ValueError(
                f"tfsync.elastic: {self.path} is not a commit tfsync wrote ({type(exc).__name__}: {exc}); "
                f"remove it, or pass another commit_dir"
            ) from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(
                f"tfsync.elastic: {self.path} holds a commit of another format; remove it, or pass another commit_dir"
            )
        return meta

    def check(self, values, names, attr_names):
        """Refuse a commit on storage that another model or state wrote (``ValueError``, saying
        what differs): ``values`` are this state's variables (NumPy copies), ``names`` their
        paths; returns the commit's metadata, or None when there is none."""
        meta = self.read_meta()
        if meta is None:
            return None
        shapes = [tuple(v.shape) for v in values]
        dtypes = [str(v.dtype) for v in values]
        problem = None
        if len(meta["shapes"]) != len(shapes):
            problem = f"{len(meta['shapes'])} variables, this state {len(shapes)}"
        else:
            for i, (a, b, da, db) in enumerate(zip(meta["shapes"], shapes, meta["dtypes"], dtypes, strict=True)):
                if tuple(a) != b or da != db:
                    problem = f"variable {i} ({names[i]}) is {da}{list(a)} there and {db}{list(b)} here"
                    break
        if problem is None and set(meta["attrs"]) != set(attr_names):
            problem = f"its attributes are {sorted(meta['attrs'])}, this state's {sorted(attr_names)}"
        if problem is not None:
            raise ValueError(
                f"tfsync.elastic: commit_dir {self.directory} holds the commit of another model or state "
                f"({problem}); a job restarts from the commit there, so it must be this job's: remove "
                f"{self.path}, or pass a directory of this job's own"
            )
        return meta


__all__ = ["FILE_NAME", "CommitStore"]
