#!/usr/bin/env bash
# digits under tfsync.elastic (mode ${MODE:-bsp}): the job goes on when a worker dies or a host goes
# or comes, from the last epoch end. ${NP:-2} workers to start, at least ${MIN_NP:-1}, at most
# ${MAX_NP:-$NP}; the hosts come from discover_hosts.sh (${HOSTS_FILE}, or this machine as two hosts).
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-2}
# a survivor whose collective waits on a live peer sees a worker's death only at Gloo's timeout
# (docs/guide/elastic.md, cost of a failure): 10 s, above this example's longest collective
export HOROVOD_GLOO_TIMEOUT_SECONDS=${HOROVOD_GLOO_TIMEOUT_SECONDS:-10}
exec horovodrun -np "$NP" --min-np "${MIN_NP:-1}" --max-np "${MAX_NP:-$NP}" \
  --host-discovery-script horovodrun_scripts/discover_hosts.sh --gloo \
  "${PYTHON:-python3}" keras_examples/digits.py --elastic --mode "${MODE:-bsp}" "$@"
