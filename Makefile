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
STAMP = build/.tfsync-installed-$(TF_VERSION)
HOROVOD_VERSION = 0.28.1
BUILD_INPUTS = setup.py requirements.txt requirements-docs.txt constraints.txt $(wildcard third_party/horovod/*)\
	$(wildcard ops/cc/*/*.cc ops/cc/*/*.h ops/cc/kernels/cuda/* tfsync/scheduler/*.pyx)

.PHONY: install demo test docs bench clean cuda-test

install: $(STAMP)

$(STAMP): $(BUILD_INPUTS)
	@# system packages Horovod's build needs (Debian); skipped when present
	@command -v cmake >/dev/null && command -v g++ >/dev/null && command -v patch >/dev/null || \
	  (apt-get update && apt-get install -y --no-install-recommends cmake g++ make patch)
	@# what the multi-host tests' simulated hosts need (tests/multihost): skipped when present
	@command -v ip >/dev/null && command -v unshare >/dev/null && test -x /usr/sbin/sshd && command -v ssh-keygen >/dev/null || \
	  (apt-get update && apt-get install -y --no-install-recommends iproute2 util-linux openssh-server openssh-client)
	$(PIP_INSTALL) "$(TENSORFLOW)==$(TF_VERSION)" -r requirements.txt -r requirements-docs.txt
	@# Horovod from its sdist with our patch, compiled against the installed TensorFlow
	@# (rebuilt when TensorFlow or the patch changes): third_party/horovod/
	bash third_party/horovod/install.sh $(PYTHON) $(HOROVOD_VERSION) build
	$(PIP_INSTALL) --no-build-isolation --no-deps -e .
	$(PYTHON) -c "import horovod.tensorflow, tfsync.ops, tfsync.scheduler; tfsync.ops.load_library(); tfsync.scheduler.zipline([[1.0, 2.0], [1.5, 2.5]]); import keras_cv"
	@mkdir -p build && touch $@

demo: install
	$(PYTHON) -m tfsync.demo

test: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	@# the documentation site with warnings as errors: a broken internal link or anchor, or a
	@# docstring mkdocstrings cannot render, fails here (tests/single/tools/test_docs.py checks the rest)
	$(PYTHON) -m mkdocs build --strict --quiet
	$(PYTHON) -m pytest tests -q -p no:cacheprovider

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
