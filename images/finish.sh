#!/bin/sh
# Last build step of both images, run as root from /opt/rlaif: bake the demo's tiny policy into $RLAIF_CACHE (so every
# stage's pod starts from the same weights, with nothing built at run time), then hand the tree to the non-root user.
set -eu
mkdir -p "$RLAIF_CACHE"
python -c "from rlaif.config import load_config; from rlaif.models.tiny import ensure_tiny_policy; ensure_tiny_policy(load_config('configs/demo.yaml').policy)"
chown -R rlaif:rlaif /opt/rlaif
# The KFP launcher stages artifacts under these paths; a non-root user must be able to write them.
mkdir -p /gcs /minio /s3
chown rlaif:rlaif /gcs /minio /s3
