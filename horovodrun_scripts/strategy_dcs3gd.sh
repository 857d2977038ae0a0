#!/usr/bin/env bash
# digits under DC-S3GD with tfsync.distribute.SyncStrategy (no callback), on ${NP:-4} local workers.
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-4}
exec horovodrun -np "$NP" -H "localhost:$NP" --gloo \
  "${PYTHON:-python3}" keras_examples/digits_strategy.py --mode dcs3gd "$@"
