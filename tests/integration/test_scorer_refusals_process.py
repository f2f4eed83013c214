"""A reward-model worker process for real, both runners (issue 51, item 3): a text past the model's length is
cut to its last tokens and scored (counted), beside a short one in the same batch; before, vLLM's pooling
runner refused the long text and with it the whole batch (retried, then every episode failed)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from flashrl.rewardmodel.build import RmSpec, build_untrained_rm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rm") / "rm"
    out.mkdir()
    build_untrained_rm(out, RmSpec(), seed=0)  # max_position_embeddings = 256
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("runner", ["torch", "vllm"])
def test_a_text_past_the_model_length_is_cut_and_scored_beside_the_others(rm_folder: Path, runner: str) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from flashrl.rewardmodel.build import scores
    from flashrl.rewardmodel.client import ProcessScorer, RewardModelClient

    long = "12+34=46;" * 40  # 360 characters (tokens), past 256
    texts = ["12+3=15", long]
    model = AutoModelForSequenceClassification.from_pretrained(str(rm_folder), dtype=torch.float32).eval()
    want = scores(model, AutoTokenizer.from_pretrained(str(rm_folder)), ["12+3=15", long[-256:]])

    async def main() -> tuple[list[float], dict[str, float]]:
        client = RewardModelClient(ProcessScorer(rm_folder, runner=runner), max_batch=8, batch_wait_s=0.05, retries=0)
        try:
            got = await asyncio.gather(*(client.score(t) for t in texts))
            return list(got), client.counters
        finally:
            await client.aclose()

    got, counters = asyncio.run(main())
    assert got == pytest.approx(want, abs=1e-4)
    assert counters["rm_batches"] == 1 and counters["rm_truncated"] == 1 and not counters.get("rm_error")
    assert counters[f"rm_workers_{runner}"] == 1
