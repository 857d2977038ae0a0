#!/usr/bin/env bash
# digits under Local SGD (every worker takes PERIOD steps alone, then the replicas average) with
# the Keras callback, on ${NP:-4} local workers. PERIOD defaults to 8; extra flags go to the example.
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-4}
exec horovodrun -np "$NP" -H "localhost:$NP" --gloo \
  "${PYTHON:-python3}" keras_examples/digits.py --mode localsgd --period "${PERIOD:-8}" "$@"
