#!/bin/bash
# usage: ab.sh label tree ; runs flashrl run configs/tiny.toml (400 steps) in tree with the plain dashboard
label=$1; tree=$2
cd $tree && PYTHONPATH=$tree OMP_NUM_THREADS=1 /usr/bin/time -v /work/main/.venv/bin/python -m flashrl.cli run configs/tiny.toml --set run.name=ab-$label --set run.dashboard=plain > /tmp/ab-$label.out 2> /tmp/ab-$label.err
echo "rc=$?" >> /tmp/ab-$label.out
