#!/bin/bash
# Serve one model over several machines with torchrun: run this on every node.
#
#   # node 0 (its address: 10.0.0.1)          # node 1
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 \   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 \
#   NPROC_PER_NODE=8 scripts/torchrun_multinode.sh --model-path /shared/Qwen3-8B --tp-size 8 --dp-size 2
#
# Every torchrun worker is one scheduler rank; global rank 0 also runs the HTTP frontend.
# Set RDZV_ENDPOINT=host:port instead of NODE_RANK to use torchrun's c10d rendezvous (node
# ranks are then assigned by torchrun). The flags after the script name go to launch.py;
# --tp-size x --pp-size x --dp-size must equal NNODES x NPROC_PER_NODE (with --pp-size N
# over N nodes, each node is one pipeline stage). torchrun stops every worker
# of every node when one fails (--max-restarts 0), so the server never half-runs.
#
# Every node needs the same cluster secret (docs/security.md): export
# GRAMSYNC_CLUSTER_SECRET, or GRAMSYNC_CLUSTER_SECRET_FILE naming a file (mode 600) on
# each node. Make one with: python -c 'import secrets; print(secrets.token_hex(32))'.
# GRAMSYNC_API_KEY, if set, guards the HTTP API.
set -euo pipefail

GRAMSYNC_DIR=${GRAMSYNC_DIR:-$(cd "$(dirname "$0")/.." && pwd)}
PYTHON=${PYTHON:-$GRAMSYNC_DIR/.venv/bin/python}
NNODES=${NNODES:?set NNODES}
NPROC_PER_NODE=${NPROC_PER_NODE:?set NPROC_PER_NODE (GPUs per node)}
MASTER_PORT=${MASTER_PORT:-29500}
GRAMSYNC_PORT=${GRAMSYNC_PORT:-30000}

if [[ "$NNODES" -gt 1 ]]; then
  if [[ -n "${GRAMSYNC_CLUSTER_SECRET_FILE:-}" ]]; then
    export GRAMSYNC_CLUSTER_SECRET=$(<"$GRAMSYNC_CLUSTER_SECRET_FILE")
  fi
  if [[ -z "${GRAMSYNC_CLUSTER_SECRET:-}" ]]; then
    echo "error: set GRAMSYNC_CLUSTER_SECRET (or GRAMSYNC_CLUSTER_SECRET_FILE) to the same secret on every node;" >&2
    echo "       make one with: python -c 'import secrets; print(secrets.token_hex(32))'" >&2
    exit 2
  fi
  export GRAMSYNC_CLUSTER_SECRET
fi

if [[ -n "${RDZV_ENDPOINT:-}" ]]; then
  WORLD=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${RDZV_ID:-gramsync}")
else
  WORLD=(--nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK or RDZV_ENDPOINT}"
         --master-addr "${MASTER_ADDR:?set MASTER_ADDR}" --master-port "$MASTER_PORT")
fi

exec "$PYTHON" -m torch.distributed.run "${WORLD[@]}" --nproc-per-node "$NPROC_PER_NODE" \
  --max-restarts 0 "$GRAMSYNC_DIR/launch.py" --host 0.0.0.0 --port "$GRAMSYNC_PORT" "$@"
