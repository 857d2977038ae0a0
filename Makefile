# The README's two commands: `make demo` (install everything, run the main job)
# and `make test` (install everything, run the whole test suite); `make docs` builds the
# documentation site (docs/, mkdocs.yml) into build/site; `make cuda-test` runs the CUDA
# kernels' standalone test.
PYTHON ?= python3
PIP = $(PYTHON) -m pip
# every pip call is constrained: nothing may pull a TensorFlow, Keras or protobuf that breaks the stack
PIP_INSTALL = $(PIP) install -c constraints.txt
# The TensorFlow everything is compiled against (docs/install.md, "Supported versions"): 2.21.0 is
# the default CI runs, 2.20.0 is verified; on GPU machines
# make install TENSORFLOW='tensorflow[and-cuda]' (in an environment without tensorflow-cpu).
TENSORFLOW ?= tensorflow-cpu
TF_VERSION ?= 2.21.0
# one stamp per environment (sys.prefix): make install PYTHON=venv/bin/python in a checkout that
# installed into another interpreter installs again
PYTHON_ID := $(shell $(PYTHON) -c "import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:10])" 2>/dev/null)
STAMP = build/.tfsync-installed-$(TF_VERSION)-$(PYTHON_ID)
HOROVOD_VERSION = 0.28.1
BUILD_INPUTS = setup.py requirements.txt requirements-docs.txt constraints.txt $(wildcard third_party/horovod/*)\
	$(wildcard ops/cc/*/*.cc ops/cc/*/*.h ops/cc/kernels/cuda/* tfsync/scheduler/*.pyx)

.PHONY: install demo test docs bench clean cuda-test check-python

install: $(STAMP)

$(STAMP): $(BUILD_INPUTS)
	@# system packages Horovod's build needs (Debian), and ccache, which keeps the compiled objects of
	@# Horovod's and tfsync's builds (outside the checkout, keyed by each file's preprocessed source,
	@# the compiler and its flags): a fresh clone compiles only what changed; skipped when present
	@command -v cmake >/dev/null && command -v g++ >/dev/null && command -v patch >/dev/null && command -v ccache >/dev/null || \
	  (apt-get update && apt-get install -y --no-install-recommends cmake g++ make patch ccache)
	@# what the multi-host tests' simulated hosts need (tests/multihost): skipped when present
	@command -v ip >/dev/null && command -v unshare >/dev/null && test -x /usr/sbin/sshd && command -v ssh-keygen >/dev/null || \
	  (apt-get update && apt-get install -y --no-install-recommends iproute2 util-linux openssh-server openssh-client)
	$(PIP_INSTALL) "$(TENSORFLOW)==$(TF_VERSION)" -r requirements.txt -r requirements-docs.txt
	@# Horovod from its sdist with our patch, compiled against the installed TensorFlow
	@# (rebuilt when TensorFlow or the patch changes): third_party/horovod/
	bash third_party/horovod/install.sh $(PYTHON) $(HOROVOD_VERSION) build
	@# (the op library's and the scheduler's compiles through ccache where it is installed)
	if command -v ccache >/dev/null; then export CC="ccache $${CC:-gcc}" CXX="ccache $${CXX:-g++}"; fi; \
	  $(PIP_INSTALL) --no-build-isolation --no-deps -e .
	$(PYTHON) -c "import horovod.tensorflow, tfsync.ops, tfsync.scheduler; tfsync.ops.load_library(); tfsync.scheduler.zipline([[1.0, 2.0], [1.5, 2.5]]); import keras_cv"
	@mkdir -p build && touch $@

demo: install
	$(PYTHON) -m tfsync.demo

test: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	@# every folder of tests/ (the documentation site's strict build is tests/single/tools/test_docs.py);
	@# each test bounded (tests/conftest.py), the run stopped after 5 failures, and the 25 slowest
	@# tests listed at the end: where CI's time goes
	$(PYTHON) -m pytest tests -q -p no:cacheprovider --maxfail=5 --durations=25

# make check-python PY=3.12 (or 3.13, 3.11): the install and CHECK_TESTS under that interpreter, in a
# virtual environment of its own (VENV, default build/venv-3.12; docs/install.md, "Supported versions").
# The interpreter is python3.12 on the PATH, else pyenv's newest 3.12.x. CHECK_TESTS: every
# single-process test (the op library against its reference, the Cython scheduler against its twin,
# the policies, the engine on the fake cluster), the sdist's contents, and under horovodrun BSP (the
# op library's finiteness check), PSP and delay compensation (its kernels) on real Horovod ranks.
CHECK_TESTS ?= tests/single tests/packaging tests/parallel/test_bsp.py tests/parallel/test_partial_under_horovodrun.py \
	tests/parallel/test_compensation_under_horovodrun.py
PYENV_ROOT ?= $(HOME)/.pyenv
VENV ?= build/venv-$(PY)
check-python:
	@case "$(PY)" in 3.11|3.12|3.13) ;; *) echo "make check-python: PY=$(PY): expected 3.11, 3.12 or 3.13 (Keras 3.15 needs 3.11 or newer; TensorFlow $(TF_VERSION) has wheels up to 3.13), e.g. make check-python PY=3.12"; exit 2;; esac
	@py=; if python$(PY) -c "" 2>/dev/null; then py=$$(command -v python$(PY)); fi; \
	if [ -z "$$py" ]; then py=$$(ls -d $(PYENV_ROOT)/versions/$(PY).*/bin/python$(PY) 2>/dev/null | sort -V | tail -1); fi; \
	if [ -z "$$py" ]; then echo "make check-python: no python$(PY) on the PATH nor under $(PYENV_ROOT)/versions/$(PY).*; install it (apt-get install python$(PY) python$(PY)-venv python$(PY)-dev, or pyenv install $(PY))"; exit 2; fi; \
	"$$py" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$(PY)'.split('.'))))" || { echo "make check-python: $$py is not Python $(PY)"; exit 2; }; \
	"$$py" -c "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" || \
	  { echo "make check-python: $$py has no headers (Python.h), which Horovod's and the scheduler's builds need: apt-get install python$(PY)-dev"; exit 2; }; \
	test -x $(VENV)/bin/python || { echo "make check-python: creating $(VENV) with $$py"; "$$py" -m venv $(VENV); }
	$(MAKE) install PYTHON=$(abspath $(VENV))/bin/python
	PATH=$(abspath $(VENV))/bin:$$PATH $(abspath $(VENV))/bin/python -m pytest -q -p no:cacheprovider $(CHECK_TESTS)

# Only the documentation's packages (requirements-docs.txt), not the whole stack: the API
# reference is read from the sources by static analysis, nothing is imported.
docs:
	@$(PYTHON) -c "import mkdocs, mkdocstrings_handlers.python" 2>/dev/null || $(PIP_INSTALL) -r requirements-docs.txt
	$(PYTHON) -m mkdocs build --strict

# Writes build/: a run becomes a result once it is filed as a study under docs/results/<study>/
# with a README (command, date, commit, machine), replacing that study's previous run.
bench: install
	$(PYTHON) -m tfsync.bench --json build/bench_training.json

# The CUDA kernels' standalone test (ops/cuda_test/): built by nvcc alone, no TensorFlow
# and no install needed. Where `nvidia-smi` lists a GPU it checks every kernel against the
# CPU reference and measures its bandwidth; elsewhere it checks the kernels' bodies on the
# CPU and says it skipped the GPU run.
cuda-test:
	bash ops/cuda_test/run.sh

clean:
	rm -rf build tfsync/ops/*.so tfsync/ops/_build_info.json tfsync/scheduler/*.so tfsync/scheduler/_zipline.c
