import sys, time
sys.path.insert(0, "/work/main")
from flashrl.config import load as load_config
from flashrl.distill.build import teacher_folder
cfg = load_config(sys.argv[1])
t = time.time()
print(teacher_folder(cfg, cfg.distill.teachers[0]), time.time() - t, flush=True)
