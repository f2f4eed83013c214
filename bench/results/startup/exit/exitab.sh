echo -20 > /proc/self/autogroup
source /work/main/.venv/bin/activate
for i in 1 2 3; do for v in main dev; do
  cd /work/$v; if [ $v = dev ]; then export PYTHONPATH=/work/dev; else unset PYTHONPATH; fi
  d=/tmp/exitab/$v$i; rm -rf $d
  t0=$(date +%s.%N)
  flashrl run configs/tiny.toml --set run.steps=20 --set run.output_dir=$d --set run.eval_every=10 --set run.dashboard=off > $d.log 2>&1
  t1=$(date +%s.%N)
  sd=$(grep -h "clean shutdown" $d/tiny/logs/engine0.log | cut -c12-23)
  echo "$v$i wall $(echo "$t1 - $t0" | bc) engine_clean_shutdown_at $sd exit_at $(date -d @$t1 +%T.%N | cut -c1-12)" >> /tmp/exitab/summary.txt
done; done
echo DONE >> /tmp/exitab/summary.txt
