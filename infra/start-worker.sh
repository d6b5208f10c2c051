#!/usr/bin/env bash
# Join this Mac to an orchard cluster as a worker node: one MLX worker slot by default.
#
#   infra/start-worker.sh HEAD_IP:PORT [NODE_IP]
#
# ORCHARD_WORKER_SLOTS=2 lets two orchard workers share this Mac (with
# `orchard up --workers-per-node 2`, or leave per-node at 1 to use one slot each).
set -euo pipefail
cd "$(dirname "$0")/.."
source infra/env.sh

HEAD="${1:-${ORCHARD_HEAD:-}}"
if [ -z "$HEAD" ]; then
  echo "usage: infra/start-worker.sh HEAD_IP:PORT [NODE_IP]" >&2
  exit 2
fi
NODE_IP_ARG=()
[ -n "${2:-}" ] && NODE_IP_ARG=(--node-ip-address="$2")
if [ ! -s "$RAY_AUTH_TOKEN_PATH" ]; then
  echo "missing $RAY_AUTH_TOKEN_PATH: copy it from the head (infra/README.md, step 3)" >&2
  exit 2
fi
.venv/bin/ray start --address="$HEAD" "${NODE_IP_ARG[@]}" \
  --resources="{\"orchard_node\": ${ORCHARD_WORKER_SLOTS:-1}}" --disable-usage-stats \
  ${ORCHARD_RAY_BLOCK:+--block}
