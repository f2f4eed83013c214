"""Build a config's first teacher (builtin:teacher: warm-started on the config's env.params, exact answers).

    python bench/results/distill/new-skill-epyc/build_teacher.py CONFIG

CONFIG: configs/distill.toml with `params = { digits = 3, ops = ["+"] }` and `max_new_tokens = 5` (its teacher
is builtin:teacher); the runs' *.config.toml then name the built folders.
"""

import sys
import time

from flashrl.config import load
from flashrl.distill.build import teacher_folder

cfg = load(sys.argv[1])
t0 = time.time()
print(teacher_folder(cfg, cfg.distill.teachers[0]), f"{time.time() - t0:.1f} s", flush=True)
