#!/bin/bash
# HEDGE_AT 0.75 (as is) vs 0.5, agentic.toml (every 20) and tools.toml (its own eval_every), seeds 0,1, interleaved
cd /work/wt-s5
for S in 0 1; do
  for T in h75 h50; do
    PYTHONPATH=/tmp/$T OMP_NUM_THREADS=1 timeout 900 /work/main/.venv/bin/python bench/eval_cost.py --tree /tmp/$T --config configs/agentic.toml --every 20 \
      --out /tmp/hedge/out --label $T-agentic-s$S --set run.seed=$S --set run.dashboard=off > /tmp/hedge/$T-agentic-s$S.log 2>&1
    uptime >> /tmp/hedge/loads.log
  done
  for T in h50 h75; do
    PYTHONPATH=/tmp/$T OMP_NUM_THREADS=1 timeout 900 /work/main/.venv/bin/python bench/eval_cost.py --tree /tmp/$T --config configs/tools.toml --every 10 \
      --out /tmp/hedge/out --label $T-tools-s$S --set run.seed=$S --set run.dashboard=off > /tmp/hedge/$T-tools-s$S.log 2>&1
    uptime >> /tmp/hedge/loads.log
  done
done
echo done > /tmp/hedge/DONE
