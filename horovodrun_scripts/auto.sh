#!/usr/bin/env bash
# digits with SyncCallback(mode="auto"): the mode picked from the measured iteration times
# (first after 16 steps, then at epoch ends), on ${NP:-4} local workers.
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-4}
exec horovodrun -np "$NP" -H "localhost:$NP" --gloo \
  "${PYTHON:-python3}" keras_examples/digits.py --mode auto "$@"
