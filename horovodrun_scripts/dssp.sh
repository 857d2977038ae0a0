#!/usr/bin/env bash
# digits under DSSP with the Keras callback, on ${NP:-4} local workers.
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-4}
exec horovodrun -np "$NP" -H "localhost:$NP" --gloo \
  "${PYTHON:-python3}" keras_examples/digits.py --mode dssp --low "${LOW:-3}" --high "${HIGH:-15}" "$@"
