#!/usr/bin/env bash
# Host discovery for horovodrun's elastic launcher (elastic.sh): prints one "host:slots" per line.
# Horovod runs it every few seconds; a host it stops printing is removed at the next reset, one it
# starts printing joins with the committed state. ${HOSTS_FILE}: a file of "host:slots" lines (edit
# it while the job runs); default: this machine under two names, one slot each (Horovod blacklists
# the host of a worker that fails, so a single name would end the job at the first loss).
if [ -n "${HOSTS_FILE:-}" ]; then
  exec grep -v '^[[:space:]]*\(#\|$\)' "$HOSTS_FILE"
fi
echo localhost:1
echo 127.0.0.1:1
