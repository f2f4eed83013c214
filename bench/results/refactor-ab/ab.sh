#!/bin/bash
# usage: ab.sh LABEL TREE CONFIG  -- flashrl run CONFIG (its own steps) in TREE (a `git archive` of one commit
# with the model cache linked in), plain dashboard, one thread per torch op; run folder TREE/runs/ab-LABEL
label=$1; tree=$2; config=$3
cd "$tree" && PYTHONPATH=$tree OMP_NUM_THREADS=1 /usr/bin/time -v /work/main/.venv/bin/python -m flashrl.cli run "$config" \
    --set run.name=ab-$label --set run.dashboard=plain > /tmp/ab-$label.out 2> /tmp/ab-$label.err
echo "rc=$?" >> /tmp/ab-$label.out
