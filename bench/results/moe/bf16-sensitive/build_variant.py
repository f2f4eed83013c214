"""Build (once, cached like builtin:moe) a more routing-sensitive builtin:moe variant and print its folder.

configs/moe.toml's model with MoeSpec(layers=4, experts=32, top_k=4) (hidden 128, expert width 128: dimensions
vLLM's CPU MoE kernel serves, as builtin:moe's), warm-started on the config's task exactly as builtin:moe is
(flashrl/models ensure_model with a spec: the spec is part of the cache key). The runs point model.path at it.

    python bench/results/moe/bf16-sensitive/build_variant.py [seed]
"""

import sys
from pathlib import Path

from flashrl.config import load
from flashrl.models import ensure_model
from flashrl.moe.model import MoeSpec

ROOT = Path(__file__).resolve().parents[4]
seed = sys.argv[1] if len(sys.argv) > 1 else "0"
cfg = load(ROOT / "configs" / "moe.toml", [f"run.seed={seed}"])
print(ensure_model(cfg, spec=MoeSpec(layers=4, experts=32, top_k=4)))
