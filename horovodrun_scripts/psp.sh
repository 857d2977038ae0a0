#!/usr/bin/env bash
# digits under PSP (partial pushing) with the Keras callback, on ${NP:-4} local workers.
# MIN_CONTRIBUTIONS defaults to workers - 1; extra flags go to the example.
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-4}
exec horovodrun -np "$NP" -H "localhost:$NP" --gloo \
  "${PYTHON:-python3}" keras_examples/digits.py --mode psp \
  ${MIN_CONTRIBUTIONS:+--min-contributions "$MIN_CONTRIBUTIONS"} "$@"
