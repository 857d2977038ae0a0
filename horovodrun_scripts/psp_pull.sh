#!/usr/bin/env bash
# digits under PSP with partial pushing and partial pulling (SyncCallback), on ${NP:-4} local workers:
# a step goes on once PULL_FRACTION (default 0.75) of its round's parameter blocks have arrived.
# Slow pulls are simulated with e.g. --stragglers "base=0.02,pull=0.0025:0.5"; extra flags go to the example.
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-4}
exec horovodrun -np "$NP" -H "localhost:$NP" --gloo \
  "${PYTHON:-python3}" keras_examples/digits.py --mode psp --pull-fraction "${PULL_FRACTION:-0.75}" \
  ${MIN_CONTRIBUTIONS:+--min-contributions "$MIN_CONTRIBUTIONS"} "$@"
