#!/usr/bin/env bash
# digits under synchronous SGD with ${BACKUPS:-1} backup worker(s), on ${NP:-4} local workers.
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-4}
exec horovodrun -np "$NP" -H "localhost:$NP" --gloo \
  "${PYTHON:-python3}" keras_examples/digits.py --mode backup --backups "${BACKUPS:-1}" "$@"
