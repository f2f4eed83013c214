"""``flashrl samples RUN_DIR [--step N]``: what the model wrote, from runs/<name>/samples.jsonl.

Each line of samples.jsonl is one rollout (controller.ledger.Ledger.sample_line): step, kind ("train": rollouts
of the batch trained at that step; "eval": held-out generations of the weights after that step),
prompt, response, answer, reward, correct, the reward function's extra metrics, the policy
versions that generated it, finish reason and turns, and its lineage: ``version_first`` /
``version_last`` (first and last generated token), ``updates_spanned``, ``interrupted`` (a weight
update landed mid-generation; its tokens were kept and generation went on on the new weights),
``restarts``, ``restored`` (resumes that continued it from a checkpoint, its tokens before kept) and, for
trained samples, ``staleness`` and ``token_staleness_mean`` (ledger.sample_line
says exactly what each means).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec


class SamplesError(ValueError):
    pass


def load(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "samples.jsonl" if run_dir.is_dir() else run_dir
    if not path.is_file():
        raise SamplesError(f"{path}: no samples.jsonl (is {run_dir} a run directory? log.samples_per_step and "
                           "log.eval_samples must be > 0)")
    out = []
    dec = msgspec.json.Decoder()
    lines = path.read_bytes().splitlines()
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append(dec.decode(line))
            except msgspec.DecodeError as e:  # a run killed mid-write leaves a partial last line
                if n < len(lines):
                    raise SamplesError(f"{path}:{n}: not JSON ({e})") from None
    return out


def select(rows: list[dict[str, Any]], step: int | None, kind: str, limit: int) -> tuple[int, list[dict[str, Any]]]:
    if kind not in ("train", "eval", "all"):
        raise SamplesError(f"--kind: {kind!r}; expected train, eval or all")
    rows = [r for r in rows if kind == "all" or r.get("kind") == kind]
    if not rows:
        raise SamplesError(f"no {'' if kind == 'all' else kind + ' '}samples logged")
    steps = sorted({int(r.get("step", 0)) for r in rows})
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise SamplesError(f"--step {step}: no samples at that step; logged steps: {_ranges(steps)}")
    picked: list[dict[str, Any]] = []
    for k in ("train", "eval"):
        picked += [r for r in rows if r.get("step") == step and r.get("kind") == k][:limit]
    return step, picked


def _ranges(steps: list[int]) -> str:
    if len(steps) <= 12:
        return ", ".join(map(str, steps))
    return ", ".join(map(str, steps[:6])) + ", ..., " + ", ".join(map(str, steps[-3:]))


def show(run_dir: Path, step: int | None = None, kind: str = "all", limit: int = 8, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    step, rows = select(load(run_dir), step, kind, limit)
    console = console or Console()
    table = Table(title=f"{run_dir}: step {step}", show_lines=True, expand=True)
    for col, style, ratio in (("kind", "dim", None), ("prompt", "", 4), ("response", "bold", 4), ("answer", "dim", 2),
                              ("reward", "", None), ("versions", "dim", None), ("end", "dim", None)):
        table.add_column(col, style=style or None, overflow="fold", ratio=ratio, no_wrap=ratio is None)
    for r in rows:
        ok = r.get("correct")
        reward = Text(f"{r.get('reward', 0.0):.3g}", style="green" if ok else "red")
        extra = r.get("metrics") or {}
        if extra:
            reward.append("\n" + "\n".join(f"{k}={v:.3g}" for k, v in sorted(extra.items())), style="dim")
        versions = r.get("policy_versions") or []
        end = f"{r.get('finish_reason', '')}\n{r.get('turns', 0)} turn(s)"
        table.add_row(r.get("kind", ""), r.get("prompt", ""), r.get("response", ""), str(r.get("answer", "")), reward,
                      ",".join(map(str, versions)), end)
    console.print(table)
