"""The installed Horovod sums float16 with AVX/F16C (third_party/horovod's patch, fix 12).

``compression="fp16"`` (and Horovod's own ``Compression.fp16``) sums float16 in
Gloo's ring allreduce.  Gloo has a vectorized float16 sum behind its USE_AVX
option, which Horovod's build never set: each element then went through a
software conversion, 3x a float32 allreduce's time.  Timing it here would be a
timing assertion, so this reads the built library instead: the function Gloo's
allreduce calls for a float16 sum, ``gloo::sum<gloo::float16>(void*, const void*,
const void*, size_t)``, must convert with ``vcvtph2ps`` (F16C), as the unpatched
build's generic loop does not.
"""

import glob
import os
import re
import subprocess

import horovod
import pytest

HOROVOD_DIR = os.path.dirname(horovod.__file__)
SUM = "gloo::sum<gloo::float16>(void*, void const*, void const*, unsigned long)"


def cpu_has_f16c():
    """Whether this CPU has AVX and F16C: the patch builds the vectorized sum only then (the
    build's own -march=native probe), and where it is not built there is nothing to find."""
    if not os.path.exists("/proc/cpuinfo"):
        return False
    with open("/proc/cpuinfo") as f:
        flags = f.read().split()
    return "avx" in flags and "f16c" in flags


def built_here():
    """Whether the installed Horovod is the one install.sh built (its stamp): the sum of a
    Horovod built elsewhere is that build's, not something this project's patch decides."""
    stamp = os.path.join(HOROVOD_DIR, "tfsync_build.txt")
    if not os.path.exists(stamp):
        return False
    with open(stamp) as f:
        return "patch" in f.read()


@pytest.mark.skipif(not built_here(), reason="Horovod was not built by third_party/horovod/install.sh (make install)")
@pytest.mark.skipif(not cpu_has_f16c(), reason="no AVX and F16C here: the patch keeps Gloo's scalar float16 sum")
def test_the_float16_sum_horovods_gloo_allreduce_calls_converts_with_f16c():
    (lib,) = glob.glob(os.path.join(HOROVOD_DIR, "tensorflow", "mpi_lib*.so"))
    symbols = subprocess.run(["nm", "-C", "-S", lib], capture_output=True, text=True, check=True).stdout
    found = [line for line in symbols.splitlines() if line.endswith(" " + SUM)]
    assert found, f"{lib} has no {SUM}: Horovod's Gloo allreduce cannot sum float16"
    address, size = (int(x, 16) for x in re.split(r"\s+", found[0])[:2])
    code = subprocess.run(
        ["objdump", "-d", f"--start-address={address}", f"--stop-address={address + size}", lib],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "vcvtph2ps" in code and "vcvtps2ph" in code, (
        f"{SUM} in {lib} converts float16 in software: Gloo was built without USE_AVX "
        "(third_party/horovod's patch, fix 12, sets it where the build has -mavx -mf16c)"
    )
