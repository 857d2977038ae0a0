# The README's two commands: `make demo` (install everything, run the main job)
# and `make test` (install everything, run the whole test suite).
PYTHON ?= python3
PIP = $(PYTHON) -m pip
# every pip call is constrained: nothing may pull a TensorFlow, Keras or protobuf that breaks the stack
PIP_INSTALL = $(PIP) install -c constraints.txt
# The TensorFlow everything is compiled against (README "Supported versions"): 2.21.0 is
# the default CI runs, 2.20.0 is verified; on GPU machines
# make install TENSORFLOW='tensorflow[and-cuda]' (in an environment without tensorflow-cpu).
TENSORFLOW ?= tensorflow-cpu
TF_VERSION ?= 2.21.0
STAMP = build/.tfsync-installed-$(TF_VERSION)
HOROVOD_VERSION = 0.28.1
BUILD_INPUTS = setup.py requirements.txt constraints.txt $(wildcard third_party/horovod/*)\
	$(wildcard ops/cc/*/*.cc ops/cc/*/*.h tfsync/scheduler/*.pyx)

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): $(BUILD_INPUTS)
	@# system packages Horovod's build needs (Debian); skipped when present
	@command -v cmake >/dev/null && command -v g++ >/dev/null && command -v patch >/dev/null || \
	  (apt-get update && apt-get install -y --no-install-recommends cmake g++ make patch)
	@# what the multi-host tests' simulated hosts need (tests/multihost): skipped when present
	@command -v ip >/dev/null && command -v unshare >/dev/null && test -x /usr/sbin/sshd && command -v ssh-keygen >/dev/null || \
	  (apt-get update && apt-get install -y --no-install-recommends iproute2 util-linux openssh-server openssh-client)
	$(PIP_INSTALL) "$(TENSORFLOW)==$(TF_VERSION)" -r requirements.txt
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
	$(PYTHON) -m pytest tests -q -p no:cacheprovider

bench: install
	$(PYTHON) -m tfsync.bench --json docs/bench_training.json

clean:
	rm -rf build tfsync/ops/*.so tfsync/ops/_build_info.json tfsync/scheduler/*.so tfsync/scheduler/_zipline.c
