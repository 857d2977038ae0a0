#!/usr/bin/env bash
# BSP vs SSP on digits with one straggler (rank 3 +40 ms per step), printed as a table.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m tfsync.demo "$@"
