#!/usr/bin/env bash
# digits under DC-S3GD (overlapped allreduce, delay-compensated gradients) with the Keras
# callback, on ${NP:-4} local workers. DC_LAMBDA defaults to 0.04; extra flags go to the example.
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-4}
exec horovodrun -np "$NP" -H "localhost:$NP" --gloo \
  "${PYTHON:-python3}" keras_examples/digits.py --mode dcs3gd \
  ${DC_LAMBDA:+--dc-lambda "$DC_LAMBDA"} "$@"
