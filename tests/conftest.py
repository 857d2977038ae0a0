import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
    session.config._tfsync_exitstatus = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process once pytest has reported everything, without the interpreter's
    finalization: at exit Python frees the last Keras fits' tf.data iterators, and TensorFlow's
    iterator destructor waits for the iterator's autotuning thread
    (``RootDataset::Iterator::~Iterator → UnboundedThreadPool::LogicalThreadWrapper::
    ~LogicalThreadWrapper``, the thread in ``model::Model::OptimizeLoop``), which was seen to
    take minutes after a passing suite (the same wait the chaos soak met after elastic resets).
    The results are written by then; the exit status is pytest's."""
    status = getattr(config, "_tfsync_exitstatus", None)
    if status is None:  # (no session ran: --help, a usage error)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
