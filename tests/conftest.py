import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

# Each test's time limit (pytest-timeout), by folder: a test that needs more says so with its own
# pytest.mark.timeout(...). Past it the test fails with every thread's stack (where it hung), and the
# launches it started are killed with it (tfsync.launch.run_bounded_command), so a hang costs its
# folder's limit once, not the suite.
TIMEOUT_S = {"single": 60, "packaging": 60, "parallel": 300, "multihost": 480}


def pytest_collection_modifyitems(config, items):
    tests = os.path.join(ROOT, "tests")
    for item in items:
        if item.get_closest_marker("timeout") is not None:
            continue
        folder = os.path.relpath(str(item.path), tests).split(os.sep)[0]
        if folder in TIMEOUT_S:
            item.add_marker(pytest.mark.timeout(TIMEOUT_S[folder]))


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
