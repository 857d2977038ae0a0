"""``keras_examples/text_lm.py``'s corpus: which files are text, the held-out split by file, and
the windows (inputs and next-byte targets); one process, no training."""

import importlib.util
import os
import sys
import sysconfig

import numpy as np
import pytest

from tfsync.launch import REPO_ROOT


@pytest.fixture(scope="module")
def text_lm():
    examples = os.path.join(REPO_ROOT, "keras_examples")
    spec = importlib.util.spec_from_file_location("example_text_lm", os.path.join(examples, "text_lm.py"))
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, examples)  # (it imports digits.py's helpers, as the examples beside it do)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(examples)
    return module


def test_every_text_file_is_read_whatever_its_extension_and_the_rest_skipped(text_lm, tmp_path):
    files = {
        "a.py": b"print('hello')\n",
        "notes/b.md": "# caf\u00e9\n".encode(),
        "notes/c": b"no extension\n",
        "data.bin": b"\x00\x01binary",  # a NUL byte
        "latin.txt": "caf\u00e9".encode("latin-1"),  # not UTF-8
        "empty.txt": b"",
        "__pycache__/a.cpython-311.pyc": b"cached\n",
        "site-packages/pkg.py": b"x = 1\n",
    }
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    os.symlink(tmp_path / "a.py", tmp_path / "link.py")
    read = text_lm.read_text_files(str(tmp_path), skip=("site-packages",))
    assert list(read) == ["a.py", "notes/b.md", "notes/c"]
    assert read["notes/b.md"] == files["notes/b.md"]
    assert "site-packages/pkg.py" in text_lm.read_text_files(str(tmp_path))  # (skipped only when asked)


def test_the_split_is_by_file_and_fixed_and_an_empty_split_is_refused(text_lm):
    files = {f"m{i}.py": bytes([65 + i % 26]) * 10 for i in range(200)}
    held = [p for p in files if text_lm.held_out(p, 0.1)]
    assert 5 < len(held) < 40  # about a tenth
    train, val = text_lm.split_corpus(files, 0.1)
    assert len(val) == 10 * len(held) and len(train) == 10 * (200 - len(held))
    assert held == [p for p in files if text_lm.held_out(p, 0.1)]  # the same every time: a hash of the path
    with pytest.raises(ValueError, match=r"2 text files, 2 for training and 0 held out .* point --corpus"):
        text_lm.split_corpus({"a.py": b"a", "b.py": b"b"}, 1e-9)


def test_windows_pair_each_byte_with_the_next(text_lm):
    stream = np.frombuffer(bytes(range(256)) * 4, np.uint8)
    x, y = text_lm.windows(stream, 50, 16, np.random.default_rng(0))
    assert x.shape == y.shape == (50, 16) and x.dtype == np.int32
    assert np.array_equal(y[:, :-1], x[:, 1:]) and np.array_equal(y[:, -1], (x[:, -1] + 1) % 256)
    with pytest.raises(ValueError, match=r"holds no window of --context 16"):
        text_lm.windows(stream[:10], 1, 16, np.random.default_rng(0))


def test_the_default_corpus_is_the_standard_library_without_installed_packages(text_lm):
    directory, skip = text_lm.default_corpus()
    assert directory == sysconfig.get_paths()["stdlib"] and "site-packages" in skip
    assert os.path.isfile(os.path.join(directory, "json", "decoder.py"))
