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


_FILE_S = {}  # test file -> its tests' seconds (setup, call and teardown)
FILES_LISTED = 15  # the slowest files the run lists at its end (make test: where CI's time goes)


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_S[path] = _FILE_S.get(path, 0.0) + report.duration


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    """The slowest test files and each top folder's total, after pytest's own slowest tests: the
    last lines of the run's log, which CI keeps when it shortens a long one."""
    if not _FILE_S:
        return
    folders = {}
    for path, seconds in _FILE_S.items():
        folder = "/".join(path.split("/")[:2])
        folders[folder] = folders.get(folder, 0.0) + seconds
    write = terminalreporter.write_line
    terminalreporter.section("time by test file (s)")
    for path, seconds in sorted(_FILE_S.items(), key=lambda kv: -kv[1])[:FILES_LISTED]:
        write(f"{seconds:8.1f}  {path}")
    write("  ".join(f"{folder}: {seconds:.0f}" for folder, seconds in sorted(folders.items())))


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
