"""The sdist and the built package carry what installing from them needs (no TensorFlow involved).

``pip install --no-build-isolation tfsync-*.tar.gz`` compiles the op library from
``ops/``, cythonizes the scheduler's ``.pyx`` and ships Horovod's build script and
patch for ``python -m tfsync.install_horovod``: a file the build reads that the
sdist lacks fails only on a user's machine. The sdist is built from a copy of the
files git tracks (what a fresh clone has), so nothing left over in this checkout
(a built ``.so``, a generated ``.c``) can hide a missing entry in ``MANIFEST.in``.
"""

import os
import shutil
import subprocess
import sys
import tarfile

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD_TIMEOUT_S = 300


def tracked_files():
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"the sdist is checked from a git checkout's tracked files; none here ({exc})")
    return [p for p in out.decode().split("\0") if p and os.path.isfile(os.path.join(REPO_ROOT, p))]


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """The tracked files alone, as a fresh clone has them."""
    root = tmp_path_factory.mktemp("clone") / "tfsync"
    for path in tracked_files():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.join(REPO_ROOT, path), target)
    return root


def run(cmd, cwd):
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def sdist_names(clone, tmp_path_factory):
    dist = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(dist), str(clone)], clone)
    (archive,) = dist.glob("tfsync-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    top = names[0].split("/")[0]
    return {n.split("/", 1)[1] for n in names if "/" in n and n.split("/", 1)[0] == top}


def test_the_sdist_holds_every_source_the_build_reads(clone, sdist_names):
    tracked = [str(p.relative_to(clone)) for p in clone.rglob("*") if p.is_file()]
    needed = [
        p
        for p in tracked
        if p.startswith(("ops/", "third_party/horovod/"))
        or (p.startswith("tfsync/") and p.endswith((".py", ".pyx")))
        or p in ("setup.py", "pyproject.toml", "MANIFEST.in", "constraints.txt", "README.md")
    ]
    # the build's own inputs, so an empty list could not pass: the op sources, the .pyx, the patch
    assert any(p.endswith("_kernels.cc") for p in needed) and any(p.endswith(".pyx") for p in needed)
    assert "third_party/horovod/install.sh" in needed and any(p.endswith(".patch") for p in needed)
    missing = sorted(set(needed) - sdist_names)
    assert not missing, f"MANIFEST.in leaves these out of the sdist: {missing}"


def test_the_sdist_ships_no_build_output(sdist_names):
    # the op library is compiled against the installer's TensorFlow and the .pyx cythonized by
    # the installer's Cython: a shipped .so or generated .c would be the wrong one
    built = sorted(
        n
        for n in sdist_names
        if n.endswith((".so", ".o", ".pyc"))
        or n.startswith("tfsync/scheduler/")
        and n.endswith((".c", ".cpp"))
        or n.endswith("_build_info.json")
        or n.startswith("tfsync/_horovod_build/")
    )
    assert not built, f"the sdist carries build output: {built}"


def test_the_built_package_carries_horovods_build_files(clone, tmp_path):
    # what python -m tfsync.install_horovod runs from an installed tfsync (setup.py's build_py)
    lib = tmp_path / "lib"
    run([sys.executable, "setup.py", "build_py", "--build-lib", str(lib)], clone)
    shipped = sorted(os.listdir(lib / "tfsync" / "_horovod_build"))
    expected = sorted(os.listdir(clone / "third_party" / "horovod")) + ["constraints.txt"]
    assert shipped == sorted(expected), shipped
    assert (lib / "tfsync" / "install_horovod.py").is_file()
