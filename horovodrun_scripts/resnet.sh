#!/usr/bin/env bash
# keras-cv ResNet + RandAugment on the digits images (32x32), SyncCallback(mode=${MODE:-ssp}),
# on ${NP:-4} local workers. Any tfsync mode flag works: resnet.sh --mode psp --min-contributions 3
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-4}
exec horovodrun -np "$NP" -H "localhost:$NP" --gloo \
  "${PYTHON:-python3}" keras_examples/resnet_digits.py --mode "${MODE:-ssp}" "$@"
