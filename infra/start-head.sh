#!/usr/bin/env bash
# Start the Ray head of an orchard cluster on this Mac (or Linux box), then orchard on it.
#
#   infra/start-head.sh [HEAD_IP]          # HEAD_IP: this machine's address on the cluster LAN
#
# The head hosts the router and the gRPC frontend; it offers one orchard worker slot too
# (ORCHARD_HEAD_SLOTS=0 keeps MLX off the head). Other Macs join with infra/start-worker.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source infra/env.sh

HEAD_IP="${1:-${ORCHARD_HEAD_IP:-}}"
if [ -z "$HEAD_IP" ]; then
  echo "usage: infra/start-head.sh HEAD_IP   (this Mac's address on the cluster network)" >&2
  exit 2
fi
SLOTS="${ORCHARD_HEAD_SLOTS:-1}"

orchard_auth_token   # creates $RAY_AUTH_TOKEN_PATH on the head; copy it to every node
.venv/bin/ray start --head --node-ip-address="$HEAD_IP" --port="${RAY_PORT:-6379}" \
  --resources="{\"orchard_node\": $SLOTS}" --include-dashboard=false --disable-usage-stats \
  ${ORCHARD_RAY_BLOCK:+--block}
echo "Ray head up at $HEAD_IP:${RAY_PORT:-6379}. Next, on every other Mac:"
echo "  copy $RAY_AUTH_TOKEN_PATH there, then run infra/start-worker.sh $HEAD_IP:${RAY_PORT:-6379}"
echo "Then here: .venv/bin/orchard up --address $HEAD_IP:${RAY_PORT:-6379} --workers N --detach"
