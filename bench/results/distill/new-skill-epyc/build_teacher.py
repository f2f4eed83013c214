"""Build a config's first teacher (builtin:teacher: warm-started on the config's env.params, exact answers).

    python bench/results/distill/new-skill-epyc/build_teacher.py d3feas.config.toml
"""

import sys
import time

from flashrl.config import load
from flashrl.distill.build import teacher_folder

cfg = load(sys.argv[1])
t0 = time.time()
print(teacher_folder(cfg, cfg.distill.teachers[0]), f"{time.time() - t0:.1f} s", flush=True)
