#!/usr/bin/env bash
# Retrain the bundled default model on one GPU and bring it back through the device tool, whose
# files must be <= 16 MiB each and <= 8 in all: model.safetensors (~20 MB) comes back in two parts.
#   on the GPU:  OUT=... bash scripts/retrain_default_model.sh [extra train flags]
#   back here:   bash scripts/retrain_default_model.sh --assemble FILES_AT   (writes pagedllm/default_model/)
# Then evaluate on CPU (tools/eval_default_model.py) and update the card, pagedllm/default_model/README.md.
set -euo pipefail
if [ "${1:-}" = "--assemble" ]; then
  src=$2; dst=pagedllm/default_model
  cat "$src"/model.safetensors.part* > "$dst/model.safetensors"
  (cd "$dst" && echo "$(cat "$src"/model.sha256)  model.safetensors" | sha256sum -c -)
  for f in config.json generation_config.json tokenizer.json tokenizer_config.json train_log.json; do
    cp "$src/$f" "$dst/$f"
  done
  exit 0
fi
OUT=${OUT:-$PWD/retrain_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
D=/tmp/default_model
# the fixes for the import/def aims (see the card): windows start at line starts, newline and
# indentation are separate tokens
python3 tools/train_default_model.py --out $D --minutes ${MINUTES:-5} --align-windows line --pretokenizer v2 "$@" \
  2>&1 | tail -20
split -b 15M -d -a 1 $D/model.safetensors "$OUT/model.safetensors.part"
sha256sum $D/model.safetensors | cut -d' ' -f1 > "$OUT/model.sha256"
for f in config.json generation_config.json tokenizer.json tokenizer_config.json train_log.json; do cp $D/$f "$OUT/"; done
ls -la "$OUT"
