# Environment shared by every orchard Ray node (sourced by start-head.sh / start-worker.sh and
# by the launchd service). Ray refuses multi-node clusters on macOS unless told otherwise, and
# caps the object store at 2 GiB on macOS unless large stores are enabled.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1
export RAY_ENABLE_MAC_LARGE_OBJECT_STORE=1
# Token authentication: every node and every driver (`orchard up`) must read the same token.
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH="${RAY_AUTH_TOKEN_PATH:-$HOME/.orchard/ray_auth_token}"
export RAY_USAGE_STATS_ENABLED=0
# Ray starts worker processes at niceness 15; orchard's engine worker is what the Mac is for.
export RAY_worker_niceness=0

orchard_auth_token() {
  if [ ! -s "$RAY_AUTH_TOKEN_PATH" ]; then
    mkdir -p "$(dirname "$RAY_AUTH_TOKEN_PATH")"
    ( umask 077; python3 -c 'import secrets; print(secrets.token_hex(32), end="")' \
        > "$RAY_AUTH_TOKEN_PATH" )
    echo "wrote a new Ray auth token to $RAY_AUTH_TOKEN_PATH" >&2
  fi
}
