"""README's results tables are made from committed results (flashrl/bench/readme.py), and a test says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import flashrl.bench.provenance as provenance
from flashrl.bench.readme import ReadmeError, update

ROOT = Path(__file__).resolve().parents[2]
HOST = {"date": "2026-11-28 06:00 UTC", "commit": "abc1234", "dirty": [], "cpu": "Intel(R) Xeon(R) Processor",
        "flags": ["avx2", "avx512f", "amx_tile"], "cores": 2, "mem_gib": 23.4, "load_avg": [1.0, 1.0, 1.0]}


def test_readme_agrees_with_the_committed_results() -> None:
    """Every generated block of README.md equals what `flashrl bench readme` makes of bench/results today."""
    assert update(ROOT, check=True) == [], "run `flashrl bench readme` (README.md disagrees with bench/results)"


def _run(mode: str, seed: int, sps: float, train_s: float | None) -> dict[str, object]:
    time_to = {} if train_s is None else {"80%": {"step": 10, "train_s": train_s, "process_s": train_s + 7.0}}
    return {"mode": mode, "seed": seed, "returncode": 0, "samples_per_s": sps, "time_to": time_to,
            "first_acc": 0.5, "final_acc": 0.9, "peak_mem_gib": 1.5}


def _tree(tmp_path: Path) -> Path:
    res = tmp_path / "bench/results/p"
    res.mkdir(parents=True)
    runs = [_run("async", 0, 1800.4, 2.25), _run("trl", 0, 1400.0, 3.0), _run("async", 1, 1700.0, None),
            _run("trl", 1, 1350.0, 2.5), {"mode": "sync", "seed": 0, "returncode": 1}]
    (res / "results.json").write_text(json.dumps(runs))
    provenance.append_record(res, HOST)
    (tmp_path / "bench/results/readme.toml").write_text(
        '[[table]]\nname = "tiny"\nkind = "peers"\ndir = "bench/results/p"\ntarget = "80%"\n')
    (tmp_path / "README.md").write_text("# x\n\n<!-- results:tiny (generated) -->\nold\n<!-- /results:tiny -->\nend\n")
    return tmp_path


def test_peers_table_from_results_json(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    assert update(root, check=True) == ["tiny"]
    assert update(root) == ["tiny"] and update(root, check=True) == []
    text = (root / "README.md").read_text()
    # TRL first, failed runs (sync) left out, each seed's number in seed order
    assert "| | TRL GRPOTrainer, HF generate | flashrl async, vLLM |" in text
    assert "| trained samples/s, seeds 0, 1 | 1400, 1350 | 1800, 1700 |" in text
    assert "| time to 80% held-out, training clock | 3.0 s, 2.5 s | 2.2 s, not reached |" in text
    assert "| time to 80% held-out, counting start-up | 10.0 s, 9.5 s | 9.2 s, not reached |" in text
    assert "Intel(R) Xeon(R) Processor (avx2, avx512f, amx_tile), 2 cores, commit abc1234, 2026-11-28" in text
    assert text.startswith("# x\n") and text.endswith("<!-- /results:tiny -->\nend\n")


def test_a_hand_edited_number_is_caught(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    update(root)
    readme = root / "README.md"
    readme.write_text(readme.read_text().replace("1800, 1700", "1900, 1700"))
    assert update(root, check=True) == ["tiny"]


def test_a_result_without_its_host_is_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "bench/results/p/host.json").unlink()
    with pytest.raises(ReadmeError, match="no host.json"):
        update(root, check=True)
    (root / "README.md").write_text("no blocks\n")
    provenance.append_record(root / "bench/results/p", HOST)
    with pytest.raises(ReadmeError, match="no block for table 'tiny'"):
        update(root, check=True)


def test_host_record_names_cpu_flags_commit_and_changes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    answers = {"rev-parse": "1234567", "status": " M flashrl/x.py\n M README.md"}
    monkeypatch.setattr(provenance, "_git", lambda repo, *args: answers[args[0]])
    rec = provenance.host_record(tmp_path)
    assert rec["commit"] == "1234567" and rec["dirty"] == ["flashrl/x.py", "README.md"]
    assert rec["cores"] and isinstance(rec["flags"], list) and rec["cpu"]
    provenance.append_record(tmp_path, rec)
    provenance.append_record(tmp_path, HOST)
    assert provenance.read_records(tmp_path) == [rec, HOST]  # one entry per invocation, in order
    assert "+ uncommitted changes" in provenance.describe(rec)
