#!/usr/bin/env bash
# The knob comparison on configs/tools.toml: usage  bench/results/tools-knobs/run.sh SEEDS STEPS OUT
# (run from the repository root; one flashrl run at a time).
set -euo pipefail
SEEDS=${1:-0}; STEPS=${2:-40}; OUT=${3:-bench/results/tools-knobs/seeds}
OFF="scheduler.queue_scheduling=false;rollout.env_async=false;rollout.redundancy=0"
exec python -m flashrl.cli bench seeds --config configs/tools.toml --seeds "$SEEDS" --sync-seeds all \
  --steps "$STEPS" --targets 0.7,0.65,0.75 --out "$OUT" --resume ${REPORT_ONLY:+--report-only} \
  --modes sync0,async2,envasync,redundant,queue,all \
  --variant "sync0=scheduler.async_ratio=0;$OFF" \
  --variant "async2=scheduler.async_ratio=2;$OFF" \
  --variant "envasync=scheduler.async_ratio=2;scheduler.queue_scheduling=false;rollout.env_async=true;rollout.redundancy=0" \
  --variant "redundant=scheduler.async_ratio=2;scheduler.queue_scheduling=false;rollout.env_async=false;rollout.redundancy=2" \
  --variant "queue=scheduler.async_ratio=2;scheduler.queue_scheduling=true;rollout.env_async=false;rollout.redundancy=0" \
  --variant "all=scheduler.async_ratio=2;scheduler.queue_scheduling=true;rollout.env_async=true;rollout.redundancy=2"
