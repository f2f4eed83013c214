#!/bin/bash
# bf16-sensitive's ship arms (../bf16-sensitive/run.sh, PART trained) on other seeds: routing replay off vs r3,
# synchronous (async_ratio 0), bfloat16 in the engine AND the trainer (trainer.cpu_mixed_precision), the shipped
# builtin:moe (2 layers, 8 experts, top-2; `flashrl run` builds and warm-starts it per seed, the seed is in its key).
# From the repository root:
#   bash bench/results/moe/bf16-seeds/run.sh OUT_DIR STEPS SEED...
set -e
OUT=${1:-/tmp/moe_bf16_seeds}; STEPS=${2:-30}; shift 2 || true
SEEDS=${@:-1 2}
run() {  # name, seed, then --set overrides
  local name=$1 seed=$2; shift 2
  timeout 1800 python -m flashrl.cli run configs/moe.toml --set run.steps=$STEPS --set run.max_time_s=0 \
    --set run.eval_every=0 --set run.dashboard=plain --set run.output_dir=\"$OUT\" --set run.name=\"$name\" \
    --set run.seed=$seed "$@" > "$OUT/$name.log" 2>&1
}
mkdir -p "$OUT"
BF16=(--set model.dtype=\"bfloat16\" --set trainer.cpu_mixed_precision=true --set scheduler.async_ratio=0)
for s in $SEEDS; do
  for m in off r3; do run ship-bf16-$m-s$s $s "${BF16[@]}" --set moe.replay=\"$m\"; done
done
