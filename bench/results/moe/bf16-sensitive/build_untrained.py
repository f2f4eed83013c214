"""An UNTRAINED (random-init, seed 0) Qwen3-MoE of builtin:moe's kind with many layers and experts: the routing
extreme (near-tied router logits), not a policy. Prints its folder (OUT, default /tmp/moe-untrained-8x64).

    python bench/results/moe/bf16-sensitive/build_untrained.py [OUT]
"""

import sys
from pathlib import Path

from flashrl.models.moe import build_untrained_moe
from flashrl.moe.model import MoeSpec

out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/moe-untrained-8x64")
if not (out / "config.json").is_file():
    build_untrained_moe(out, seed=0, spec=MoeSpec(layers=8, experts=64, top_k=8))
print(out)
