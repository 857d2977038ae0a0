"""python -m tfsync.install_horovod refuses to start, naming each missing piece and how to get it,
before anything is downloaded or compiled; it finds Horovod's build files (no TensorFlow needed)."""

import os
import subprocess

import pytest

from tfsync import install_horovod


def test_missing_tools_are_named_with_the_package_that_brings_them(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # (an empty directory: no tool is found)
    monkeypatch.delenv("CXX", raising=False)
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    with pytest.raises(SystemExit) as exc:
        install_horovod.install(build_dir=str(tmp_path / "build"))
    message = str(exc.value)
    for needed in ("`cmake` is not on the PATH: `apt-get install cmake`", "`patch`", "`tar`", "no C++ compiler"):
        assert needed in message, message
    assert not started and not (tmp_path / "build").exists()


def test_the_checks_pass_where_the_tools_are(tmp_path, monkeypatch):
    for tool in ("cmake", "patch", "tar", "bash", "g++"):
        path = tmp_path / tool
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    missing = install_horovod.missing_requirements()
    # (what remains can only be what this Python lacks: TensorFlow or its headers, never a tool)
    assert not [m for m in missing if "PATH" in m], missing


def test_the_build_files_are_found_in_the_package_or_the_checkout():
    files, constraints_dir = install_horovod.build_files_dir()
    assert os.path.isfile(os.path.join(files, "install.sh"))
    assert any(name.endswith(".patch") for name in os.listdir(files))
    assert os.path.isfile(os.path.join(constraints_dir, "constraints.txt"))


def test_horovods_runtime_dependencies_are_checked_before_the_build(monkeypatch):
    # (the script installs Horovod with --no-deps and imports it after an 8-minute build)
    real = install_horovod.importlib.util.find_spec
    absent = {"psutil", "yaml"}
    monkeypatch.setattr(
        install_horovod.importlib.util, "find_spec", lambda name: None if name in absent else real(name)
    )
    missing = "\n".join(install_horovod.missing_requirements(python="py"))
    assert "the Python package psutil is not installed: `py -m pip install psutil`" in missing
    assert "the Python package pyyaml is not installed: `py -m pip install pyyaml`" in missing
