#!/usr/bin/env bash
# digits under DiLoCo (INNER_STEPS local steps, then the averaged pseudo-gradient through an outer
# Nesterov SGD step) with the Keras callback, on ${NP:-4} local workers. INNER_STEPS defaults to 8,
# OUTER_LR to 0.7, OUTER_MOMENTUM to 0.9 (the paper's); OVERLAP_STEPS (unset: 0) overlaps the outer
# exchange with that many inner steps (the streaming variant); extra flags go to the example.
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-4}
exec horovodrun -np "$NP" -H "localhost:$NP" --gloo \
  "${PYTHON:-python3}" keras_examples/digits.py --mode diloco --inner-steps "${INNER_STEPS:-8}" \
  --outer-lr "${OUTER_LR:-0.7}" --outer-momentum "${OUTER_MOMENTUM:-0.9}" \
  ${OVERLAP_STEPS:+--overlap-steps "$OVERLAP_STEPS"} "$@"
