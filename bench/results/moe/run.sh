#!/bin/bash
# The measurement behind README.md: configs/moe.toml, 100 steps, [moe] replay off / r3 / r2 on seeds 0-2 (async,
# the config's async_ratio 2), off / r3 in sync (async_ratio 0, seed 0), and off / r3 with bfloat16 engines (async seeds 0-2, sync seed 0).
# Run from the repository root: bash bench/results/moe/run.sh OUT_DIR; then python bench/results/moe/summarize.py OUT_DIR
set -e
OUT=${1:-/tmp/moe_runs}
run() {  # name, then --set overrides
  local name=$1; shift
  flashrl run configs/moe.toml --set run.steps=100 --set run.max_time_s=0 --set run.eval_every=20 \
    --set run.dashboard=plain --set run.output_dir=\"$OUT\" --set run.name=\"$name\" "$@"
}
for s in 1 2; do flashrl init-model configs/moe.toml --set run.seed=$s; done
for s in 0 1 2; do for m in off r3 r2; do run a-$m-s$s --set run.seed=$s --set moe.replay=\"$m\"; done; done
for m in off r3; do run s-$m-s0 --set moe.replay=\"$m\" --set scheduler.async_ratio=0; done
for m in off r3; do run b-$m-s0 --set moe.replay=\"$m\" --set model.dtype=\"bfloat16\"; done
for m in off r3; do run bs-$m-s0 --set moe.replay=\"$m\" --set model.dtype=\"bfloat16\" --set scheduler.async_ratio=0; done
for s in 1 2; do for m in off r3; do run b-$m-s$s --set moe.replay=\"$m\" --set model.dtype=\"bfloat16\" --set run.seed=$s; done; done
