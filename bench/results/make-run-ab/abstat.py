import json,statistics,sys
for label,tree in [("before1","/tmp/before"),("after1","/tmp/after"),("after2","/tmp/after"),("before2","/tmp/before")]:
    rows=[json.loads(l) for l in open(f"{tree}/runs/ab-{label}/metrics.jsonl")]
    steps=[r for r in rows if r.get("step",0)>=1 and "time/step_s" in r]
    st=statistics.median(r["time/step_s"] for r in steps)
    wait=sum(r.get("time/sync/quiesce_s",0)+r.get("time/eval_wait_s",0) for r in steps)
    t80=next((r["time/elapsed_s"] for r in sorted(rows,key=lambda r:r["step"]) if r.get("eval/accuracy",0)>=0.8 and "time/elapsed_s" in r),None)
    s80=next((r["step"] for r in sorted(rows,key=lambda r:r["step"]) if r.get("eval/accuracy",0)>=0.8),None)
    el=max(r.get("time/elapsed_s",0) for r in rows)
    fin=[r for r in rows if "eval/accuracy" in r][-1]["eval/accuracy"]
    print(f"{label}: median step {st*1000:.0f} ms, elapsed {el:.1f} s, eval wait {wait:.1f} s ({wait/el:.1%}), 80% at step {s80} / {t80:.1f} s, final {fin:.3f}")
