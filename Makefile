# The README's two commands: `make demo` (install everything, run the main job)
# and `make test` (install everything, run the whole test suite).
PYTHON ?= python3
PIP = $(PYTHON) -m pip
# every pip call is constrained: nothing may pull a TensorFlow, Keras or protobuf that breaks the stack
PIP_INSTALL = $(PIP) install -c constraints.txt
STAMP = build/.tfsync-installed
HOROVOD_VERSION = 0.28.1
BUILD_INPUTS = setup.py requirements.txt constraints.txt $(wildcard ops/cc/*/*.cc ops/cc/*/*.h tfsync/scheduler/*.pyx)

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): $(BUILD_INPUTS)
	@# system packages Horovod's build needs (Debian); skipped when present
	@command -v cmake >/dev/null && command -v g++ >/dev/null || \
	  (apt-get update && apt-get install -y --no-install-recommends cmake g++ make)
	$(PIP_INSTALL) -r requirements.txt
	@# Horovod compiles against the installed TensorFlow: no build isolation, no
	@# dependency resolution (its [tensorflow] extra would pull a newer TensorFlow).
	$(PYTHON) -c "import horovod, horovod.tensorflow; assert horovod.__version__ == '$(HOROVOD_VERSION)'" 2>/dev/null || \
	  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
	  HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS=-j2 \
	  $(PIP_INSTALL) --no-build-isolation --no-deps --no-cache-dir horovod==$(HOROVOD_VERSION)
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
