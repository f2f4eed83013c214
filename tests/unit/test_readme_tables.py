"""README's results tables are recomputed from committed raw results (flashrl/bench/readme.py), and a test says so;
README's links resolve."""

from __future__ import annotations

import gzip
import json
import lzma
import re
import shutil
from pathlib import Path

import pytest

import flashrl.bench.provenance as provenance
from flashrl.bench.readme import ReadmeError, load_spec, update

ROOT = Path(__file__).resolve().parents[2]
HOST = {"date": "2026-11-28 06:00 UTC", "commit": "abc1234", "dirty": [], "cpu": "Intel(R) Xeon(R) Processor",
        "flags": ["avx2", "avx512f", "amx_tile"], "cores": 2, "mem_gib": 23.4, "load_avg": [1.0, 1.0, 1.0]}


def test_readme_agrees_with_the_committed_results() -> None:
    """Every generated block of README.md equals what `flashrl bench readme` makes of bench/results today."""
    assert update(ROOT, check=True) == [], "run `flashrl bench readme` (README.md disagrees with bench/results)"


def _metrics(accs: dict[int, float], sps: float, steps: int = 20) -> list[dict[str, object]]:
    """A run's metrics.jsonl: step 0's eval, then one record per step of 0.5 s (evals at some steps)."""
    recs: list[dict[str, object]] = [{"step": 0, "version": 0, "eval/accuracy": accs[0], "time/eval_s": 1.0}]
    for s in range(1, steps + 1):
        rec: dict[str, object] = {"step": s, "samples": sps * 0.5, "time/step_s": 0.5, "time/elapsed_s": s * 0.5}
        if s in accs:
            rec["eval/accuracy"] = accs[s]
        recs.append(rec)
    return recs


def _write_run(res: Path, mode: str, seed: int, recs: list[dict[str, object]], rc: int = 0) -> None:
    d = res / "runs" / f"{mode}-seed{seed}"
    d.mkdir(parents=True)
    (d / "bench_run.json").write_text(json.dumps({"mode": mode, "seed": seed, "returncode": rc, "startup_s": 7.0,
                                                  "peak_mem_gib": 1.5, "wall_s": 30.0}))
    (d / "metrics.jsonl.xz").write_bytes(lzma.compress("".join(json.dumps(r) + "\n" for r in recs).encode()))


def _tree(tmp_path: Path) -> Path:
    """A peers folder in the bench's layout (raw files only: no results.json) and a README with its block."""
    res = tmp_path / "bench/results/p"
    res.mkdir(parents=True)
    _write_run(res, "async", 0, _metrics({0: 0.5, 4: 0.7, 5: 0.85, 20: 0.9}, 1800.4))
    _write_run(res, "trl", 0, _metrics({0: 0.5, 6: 0.81, 20: 0.9}, 1400.0))
    _write_run(res, "async", 1, _metrics({0: 0.5, 10: 0.7, 20: 0.75}, 1700.0))
    _write_run(res, "trl", 1, _metrics({0: 0.5, 5: 0.8, 20: 0.9}, 1350.0))
    _write_run(res, "sync", 0, _metrics({0: 0.5}, 100.0), rc=1)
    provenance.append_record(res, HOST)
    (tmp_path / "bench/results/readme.toml").write_text(
        '[[table]]\nname = "tiny"\nkind = "peers"\ndir = "bench/results/p"\ntarget = "80%"\n'
        'extras = ["gain"]\ncompare = ["async", "trl"]\n')
    (tmp_path / "README.md").write_text("# x\n\n<!-- results:tiny (generated) -->\nold\n<!-- /results:tiny -->\nend\n")
    return tmp_path


def test_peers_table_recomputed_from_the_raw_runs(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    assert update(root, check=True) == ["tiny"]
    assert update(root) == ["tiny"] and update(root, check=True) == []
    text = (root / "README.md").read_text()
    # TRL first, failed runs (sync) left out, each seed's number in seed order
    assert "| | TRL GRPOTrainer, HF generate | flashrl async, vLLM |" in text
    assert "| trained samples/s, seeds 0, 1 | 1400, 1350 | 1800, 1700 |" in text
    assert "| time to 80% held-out, training clock | 3.0 s, 2.5 s | 2.5 s, not reached |" in text
    # start-up 7 s, less TRL's step-0 eval (1 s, before its clock): both sides charged alike
    assert "| time to 80% held-out, counting start-up | 9.0 s, 8.5 s | 9.5 s, not reached |" in text
    assert "| held-out gain, points (final - start) | +40.0, +40.0 | +40.0, +25.0 |" in text
    assert "seeds 0, 1: 1.29x, 1.26x the trained samples/s; 80% reached 1.20x, - sooner" in text
    assert "Intel(R) Xeon(R) Processor (avx2, avx512f, amx_tile), 2 cores, commit abc1234, 2026-11-28" in text
    assert text.startswith("# x\n") and text.endswith("<!-- /results:tiny -->\nend\n")


def test_a_hand_edited_number_is_caught(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    update(root)
    readme = root / "README.md"
    readme.write_text(readme.read_text().replace("1800, 1700", "1900, 1700"))
    assert update(root, check=True) == ["tiny"]


def test_a_derived_file_does_not_make_the_table(tmp_path: Path) -> None:
    """results.json is the bench's report, not the raw data: a table is recomputed without it and ignores it."""
    root = _tree(tmp_path)
    update(root)
    (root / "bench/results/p/results.json").write_text(json.dumps([{"mode": "async", "seed": 0, "samples_per_s": 1.0}]))
    assert update(root, check=True) == []


def test_a_table_measured_with_uncommitted_changes_is_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "bench/results/p/host.json").unlink()
    provenance.append_record(root / "bench/results/p", {**HOST, "dirty": ["flashrl/x.py"]})
    with pytest.raises(ReadmeError, match="uncommitted changes"):
        update(root, check=True)


def _copy_tables(dst: Path) -> None:
    """README.md, readme.toml and every table's folder, copied from this checkout."""
    (dst / "bench/results").mkdir(parents=True)
    shutil.copy(ROOT / "README.md", dst / "README.md")
    shutil.copy(ROOT / "bench/results/readme.toml", dst / "bench/results/readme.toml")
    for t in load_spec(ROOT / "bench/results/readme.toml").table:
        shutil.copytree(ROOT / t.dir, dst / t.dir, symlinks=True)


def _edit_one_line(raw: Path) -> None:
    """Lower the last held-out accuracy of one committed raw metrics file by 0.2 (one line changed)."""
    unpack, pack = ((lzma.decompress, lzma.compress) if raw.suffix == ".xz" else
                    (gzip.decompress, gzip.compress) if raw.suffix == ".gz" else (bytes, bytes))
    lines = unpack(raw.read_bytes()).decode().splitlines(keepends=True)
    n = max(i for i, line in enumerate(lines) if '"eval/accuracy"' in line)
    rec = json.loads(lines[n])
    rec["eval/accuracy"] -= 0.2
    lines[n] = json.dumps(rec) + "\n"
    raw.write_bytes(pack("".join(lines).encode()))


def test_check_passes_on_the_committed_data_and_fails_when_one_raw_line_is_edited(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`flashrl bench readme --check` on a copy of this checkout's tables: green as committed; one metrics line of
    each table's raw data edited (in turn) makes it name that table and exit 1."""
    from typer.testing import CliRunner

    from flashrl.cli import app

    _copy_tables(tmp_path)
    monkeypatch.chdir(tmp_path)
    ok = CliRunner().invoke(app, ["bench", "readme", "--check"])
    assert ok.exit_code == 0, ok.output
    for t in load_spec(ROOT / "bench/results/readme.toml").table:
        raws = sorted(p for p in (tmp_path / t.dir).rglob("*metrics.jsonl*") if p.is_file()
                      and (t.kind != "peers" or f"{(t.modes or ['sync'])[0]}-seed" in p.as_posix()))
        assert raws, f"{t.dir}: no raw metrics committed"
        backup = raws[0].read_bytes()
        _edit_one_line(raws[0])
        bad = CliRunner().invoke(app, ["bench", "readme", "--check"])
        assert bad.exit_code == 1 and t.name in bad.output, (t.name, bad.output)
        raws[0].write_bytes(backup)


def _links(text: str) -> list[str]:
    return [m for m in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in m and not m.startswith("mailto:")]


def _anchors(md: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    out = set()
    for line in md.read_text().splitlines():
        if line.startswith("#"):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def test_every_readme_link_resolves() -> None:
    """README is an index: each relative link names a file (and heading) that exists."""
    broken = []
    for link in _links((ROOT / "README.md").read_text()):
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else ROOT / "README.md"
        if not target.exists():
            broken.append(link)
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(link)
    assert not broken, f"README.md links to what is not there: {broken}"


def test_readme_stays_an_index() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


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
