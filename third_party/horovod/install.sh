#!/usr/bin/env bash
# Builds Horovod from its published source distribution against the installed TensorFlow,
# with the patch beside this script (what it changes and why: the patch's header), and
# installs it. Skipped when the installed Horovod was built by this script against the
# same TensorFlow version and the same patch; an upgraded TensorFlow rebuilds it.
#
# Usage: install.sh PYTHON HOROVOD_VERSION BUILD_DIR  (run from the repository root; the
# Makefile calls it). pip runs under constraints.txt like every pip call of `make install`.
set -euo pipefail
python=$1
version=$2
build_dir=$3
here=$(cd "$(dirname "$0")" && pwd)
patch_file="$here/horovod-$version-tf2.19.patch"
[ -f "$patch_file" ] || { echo "install.sh: no patch for Horovod $version at $patch_file" >&2; exit 2; }

tf_version=$("$python" -c "import tensorflow as tf; print(tf.__version__)" 2>/dev/null) || {
  echo "install.sh: TensorFlow does not import with $python; install requirements.txt first" >&2
  exit 2
}
# what this build depends on: the Horovod version, the TensorFlow it compiles against, the patch
want="horovod $version, tensorflow $tf_version, patch $(sha256sum "$patch_file" | cut -c1-16)"

have=$("$python" - <<'PY' 2>/dev/null || true
import os
import horovod
import horovod.tensorflow  # noqa: F401  (loads the op library: fails when built against another TensorFlow)
stamp = os.path.join(os.path.dirname(horovod.__file__), "tfsync_build.txt")
print(open(stamp).read().strip() if os.path.exists(stamp) else "built elsewhere, horovod " + horovod.__version__)
PY
)
if [ "$have" = "$want" ]; then
  echo "Horovod: installed ($have)"
  exit 0
fi
echo "Horovod: building ($want; installed: ${have:-none})"

src_root="$build_dir/horovod-src"
rm -rf "$src_root"
mkdir -p "$src_root"
"$python" -m pip download --no-deps --no-binary :all: -d "$src_root" "horovod==$version"
tar -xzf "$src_root/horovod-$version.tar.gz" -C "$src_root"
src="$src_root/horovod-$version"
patch -p1 -d "$src" < "$patch_file"

# Gloo only, TensorFlow only; no build isolation and no dependency resolution (Horovod's
# [tensorflow] extra would pull another TensorFlow than the one it compiles against)
HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
  HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS=-j2 \
  "$python" -m pip install -c constraints.txt --no-build-isolation --no-deps --no-cache-dir "$src"

"$python" - "$want" <<'PY'
import os
import sys

import horovod
import horovod.tensorflow  # noqa: F401

with open(os.path.join(os.path.dirname(horovod.__file__), "tfsync_build.txt"), "w") as f:
    f.write(sys.argv[1] + "\n")
PY
rm -rf "$src_root"
echo "Horovod: built and installed ($want)"
