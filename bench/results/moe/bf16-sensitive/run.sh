#!/bin/bash
# Routing replay off vs r3, synchronous (async_ratio 0: every trained token on-policy, the mismatch measured every
# step), seed 0, bfloat16 in the engine AND the trainer (trainer.cpu_mixed_precision), on the shipped builtin:moe
# (2 layers, 8 experts, top-2) and on a routing-sensitive variant (4 layers, 32 experts, top-4; build_variant.py).
# Float32 references of the variant. From the repository root:
# PART untrained: an untrained 8-layer, 64-expert, top-8 model (build_untrained.py), every sample trained
# (trainer.skip_inert = false: its rewards are ~0), the mismatch then measured on every on-policy token.
# PART async: ship and var in bfloat16 both sides with configs/moe.toml's async_ratio 2 (the trainer versions ahead).
#   bash bench/results/moe/bf16-sensitive/run.sh OUT_DIR STEPS [trained|untrained|async]
set -e
OUT=${1:-/tmp/moe_bf16}; STEPS=${2:-30}; PART=${3:-trained}
run() {  # name, then --set overrides
  local name=$1; shift
  timeout 1800 python -m flashrl.cli run configs/moe.toml --set run.steps=$STEPS --set run.max_time_s=0 \
    --set run.eval_every=0 --set run.dashboard=plain --set run.output_dir=\"$OUT\" --set run.name=\"$name\" \
    --set run.seed=0 "$@" > "$OUT/$name.log" 2>&1
}
mkdir -p "$OUT"
BF16=(--set model.dtype=\"bfloat16\" --set trainer.cpu_mixed_precision=true --set scheduler.async_ratio=0)
ASYNC=(--set model.dtype=\"bfloat16\" --set trainer.cpu_mixed_precision=true)  # configs/moe.toml's async_ratio 2
if [ "$PART" = untrained ]; then
  U=$(python bench/results/moe/bf16-sensitive/build_untrained.py | tail -1)
  for m in off r3; do run untrained8x64-bf16-$m "${BF16[@]}" --set model.path=\"$U\" --set trainer.skip_inert=false --set moe.replay=\"$m\"; done
  exit 0
fi
VARIANT=$(python bench/results/moe/bf16-sensitive/build_variant.py 0 | tail -1)
if [ "$PART" = async ]; then
  for m in off r3; do run ship-bf16-async-$m "${ASYNC[@]}" --set moe.replay=\"$m\"; done
  for m in off r3; do run var-bf16-async-$m "${ASYNC[@]}" --set model.path=\"$VARIANT\" --set moe.replay=\"$m\"; done
  exit 0
fi
for m in off r3; do run ship-bf16-$m "${BF16[@]}" --set moe.replay=\"$m\"; done
for m in off r3; do run var-bf16-$m "${BF16[@]}" --set model.path=\"$VARIANT\" --set moe.replay=\"$m\"; done
for m in off r3; do run var-fp32-$m --set model.path=\"$VARIANT\" --set scheduler.async_ratio=0 --set moe.replay=\"$m\"; done
