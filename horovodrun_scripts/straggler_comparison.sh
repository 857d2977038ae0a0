#!/usr/bin/env bash
# Plain Horovod beside tfsync's answer to a straggler (rank 3 +40 ms per step) on digits: a table and a plot.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m tfsync.demo --situations straggler "$@"
