"""Your data as an environment: rows of JSONL / Parquet / CSV files or a `datasets` folder, scored
by a reward given by name or by reference (flashrl/rewards.py). Single-turn.

    [env]
    name = "dataset"
    [env.params]
    path = "data/train.jsonl"          # a file, a list of files, or a folder saved by datasets' save_to_disk
    eval_fraction = 0.1                # held-out rows drawn by a seeded shuffle (run.seed) ...
    # eval_path = "data/test.jsonl"    # ... or a held-out file (then eval_fraction is not used)
    prompt = "question"                # column mapping; answer = "" when the reward needs none
    answer = "answer"
    id = "id"                          # "" = "<file>:<line>"
    extra = ["difficulty"]             # more columns: usable in the template, passed to the reward
    template = "Q: {prompt}\\nA:"        # {prompt} is the prompt column; {name} any column of `extra`
    reward = "./my_reward.py:score"    # exact | regex | math | "module:function" | "./file.py:function"

Reading: files are read incrementally and only the mapped columns of a row are kept (JSONL line by
line with msgspec; Parquet in record batches of the needed columns with pyarrow; CSV with the
standard csv module, every value a string as written, so "007" stays "007"; a `datasets` folder is
memory-mapped Arrow, iterated in batches). Each split is held as Task objects (id, prompt text,
answer, extras); shuffling per epoch is the controller's (scheduler.DataStream, seeded by run.seed).

Bad rows (invalid JSON, not an object, a missing column, an empty prompt, a value of the wrong
type, a duplicate id, a template field that is not there) are never silently dropped: each is
counted (``counters["bad_rows"]``, logged per step as ``env/bad_rows``) and reported with its file
and line (row for Parquet / `datasets`) in one warning per file (the first 10 listed). A file with
no usable row is an error naming the file and the first problems.

Rewards run off the event loop (RewardRunner); a reward that fails (raises, returns garbage, times
out, kills its worker) raises EnvFailure("reward_error" / "reward_timeout" / "reward_crash") after
logging its traceback: an infrastructure failure, retried and counted, never a 0.
"""

from __future__ import annotations

import csv
import logging
import random
import string
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta

from flashrl.env import EnvFailure, SingleTurnEnv, StepResult, Task
from flashrl.rewards import RewardFailed, RewardOptions, RewardRunner

log = logging.getLogger(__name__)

IMAGE_TOKEN = "<image>"  # where an image goes in a prompt (flashrl.vision.IMAGE_TOKEN; builtin:vlm's, Idefics3's)
MAX_LISTED = 10  # bad rows listed per file in the warning (all are counted)
_BATCH = 4096
Paths = Union[str, list[str]]


class BadRow(msgspec.Struct, frozen=True):
    file: str
    where: str  # "line 12" or "row 11"
    why: str

    def __str__(self) -> str:
        return f"{self.file}: {self.where}: {self.why}"


class DatasetParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[env.params]`` of ``env.name = "dataset"``."""

    path: Annotated[Paths, Meta(description="train rows: a .jsonl/.parquet/.csv file, a list of them, or a datasets save_to_disk folder")]
    eval_path: Annotated[Paths, Meta(description="held-out rows from these files (then eval_fraction is not used); empty: by fraction")] = ""
    eval_fraction: Annotated[float, Meta(ge=0, lt=1, description="share of the rows of `path` held out, drawn by a shuffle seeded with run.seed")] = 0.1
    format: Annotated[Literal["auto", "jsonl", "parquet", "csv", "datasets"], Meta(description="auto: by file extension; a folder is a datasets folder")] = "auto"
    split: Annotated[str, Meta(min_length=1, description="the split of a saved DatasetDict used for `path`")] = "train"
    eval_split: Annotated[str, Meta(min_length=1, description="the split of a saved DatasetDict used for `eval_path`")] = "test"
    prompt: Annotated[str, Meta(min_length=1, description="column holding the prompt")] = "prompt"
    answer: Annotated[str, Meta(description="column holding the reference answer (\"\" = none)")] = "answer"
    id: Annotated[str, Meta(description="column holding a unique row id (\"\" = <file>:<line>)")] = ""
    extra: Annotated[list[str], Meta(description="more columns kept per row: usable in the template, passed to the reward")] = []
    template: Annotated[str, Meta(min_length=1, description="prompt text: {prompt} is the prompt column, {name} a column of `extra`")] = "{prompt}"
    images: Annotated[str, Meta(description=(
        "column holding a row's image(s) for a vision-language model: a file path or a list of them (relative to "
        "the data file's folder); the prompt gets one <image> in front per image unless it places them itself "
        "(\"\" = none)"))] = ""
    max_rows: Annotated[int, Meta(ge=0, description="read at most this many rows per split (0 = all)")] = 0
    reward: Annotated[str, Meta(min_length=1, description="exact | regex | math | 'package.module:function' | './file.py:function'")] = "exact"
    answer_pattern: Annotated[str, Meta(description="regex reward: where the answer is in the response (group 'answer' or 1)")] = ""
    case_sensitive: Annotated[bool, Meta(description="exact / regex rewards: compare case-sensitively")] = True
    reward_executor: Annotated[Literal["auto", "thread", "process"], Meta(description="where a plain reward function runs (auto: process for math, thread otherwise); async ones run on the loop")] = "auto"
    reward_workers: Annotated[int, Meta(ge=1, le=256, description="reward threads or processes")] = 2
    reward_timeout_s: Annotated[float, Meta(gt=0, description="deadline of one reward call; a process worker past it is replaced")] = 10.0


def _paths(p: Paths) -> list[str]:
    return [p] if isinstance(p, str) and p else list(p) if isinstance(p, list) else []


def _format_of(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.is_dir():
        return "datasets"
    suffixes = [s.lower() for s in path.suffixes]
    for ext, kind in ((".jsonl", "jsonl"), (".ndjson", "jsonl"), (".json", "jsonl"), (".parquet", "parquet"),
                      (".pq", "parquet"), (".csv", "csv")):
        if ext in suffixes:
            return kind
    raise ValueError(f"env.params.path: cannot tell the format of {str(path)!r} from its name; "
                     "name it .jsonl / .parquet / .csv, or set env.params.format")


def _need_pyarrow(what: str) -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise ValueError(f"{what} needs pyarrow: pip install 'flashrl[data]'") from None


# --------------------------------------------------------------------------- readers: (where, row | error)
RawRow = tuple[str, Union[dict[str, Any], str]]


def _read_jsonl(path: Path, columns: list[str]) -> Iterator[RawRow]:
    dec = msgspec.json.Decoder()
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = dec.decode(line)
            except msgspec.DecodeError as e:
                yield f"line {n}", f"invalid JSON ({e})"
                continue
            if not isinstance(obj, dict):
                yield f"line {n}", f"a JSON {type(obj).__name__}, not an object"
                continue
            yield f"line {n}", obj


def _read_csv(path: Path, columns: list[str]) -> Iterator[RawRow]:
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        for row in reader:
            where = f"line {reader.line_num}"
            if None in row:
                yield where, f"more fields than the header's {len(reader.fieldnames or [])}"
                continue
            yield where, {k: v for k, v in row.items() if v is not None}  # a short row lacks its last columns


def _read_parquet(path: Path, columns: list[str]) -> Iterator[RawRow]:
    _need_pyarrow("reading Parquet")
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    have = [c for c in columns if c in pf.schema_arrow.names]
    n = 0
    for batch in pf.iter_batches(batch_size=_BATCH, columns=have):
        for row in batch.to_pylist():
            n += 1
            yield f"row {n}", row


def _read_datasets(path: Path, columns: list[str], split: str) -> Iterator[RawRow]:
    try:
        from datasets import Dataset, DatasetDict, load_from_disk
    except ImportError:
        raise ValueError("reading a datasets folder needs the datasets package: pip install 'flashrl[data]'") from None
    try:
        ds = load_from_disk(str(path))
    except Exception as e:
        raise ValueError(f"env.params.path: {path} is not a folder saved by datasets' save_to_disk: {e}") from None
    if isinstance(ds, DatasetDict):
        if split not in ds:
            raise ValueError(f"env.params: {path} holds splits {sorted(ds)}, not {split!r}; set env.params.split / eval_split")
        ds = ds[split]
    assert isinstance(ds, Dataset)
    have = [c for c in columns if c in ds.column_names]
    n = 0
    for batch in ds.select_columns(have).iter(batch_size=_BATCH):
        keys = list(batch)
        size = len(batch[keys[0]]) if keys else 0
        for i in range(size):
            n += 1
            yield f"row {n}", {k: batch[k][i] for k in keys}


# --------------------------------------------------------------------------- the suite
class DatasetEnv(SingleTurnEnv):
    """One episode: the prompt is the row's rendered template; the single step is scored by the reward."""

    def __init__(self, suite: DatasetSuite) -> None:
        super().__init__()
        self._suite = suite

    async def judge(self, task: Task, action: str) -> StepResult:
        suite = self._suite
        row = suite.row(task)
        try:
            res = await suite.rewards.score(row, action)
        except RewardFailed as e:
            suite._counts[e.reason] += 1
            log.error("reward %r failed on row %s (%s): %s", suite.params.reward, task.id,
                      task.meta.get("_source", "?"), e.detail)
            raise EnvFailure(e.reason, e.detail.splitlines()[-1] if e.detail else "") from None
        info: dict[str, Any] = {"metrics": res.metrics} if res.metrics else {}
        if res.correct is not None:
            info["correct"] = res.correct
        return StepResult(reward=res.reward, done=True, info=info)


class DatasetSuite:
    Params = DatasetParams

    def __init__(self, params: DatasetParams, seed: int, eval_size: int) -> None:
        self.params = params
        self.seed = seed
        self._counts: Counter[str] = Counter()
        self.bad_rows: list[BadRow] = []  # the first MAX_LISTED per file
        self._fields = self._template_fields(params)
        self.rewards = RewardRunner(
            params.reward,
            RewardOptions(case_sensitive=params.case_sensitive, answer_pattern=params.answer_pattern,
                          timeout_s=params.reward_timeout_s),
            executor=params.reward_executor, workers=params.reward_workers, timeout_s=params.reward_timeout_s,
        )
        train_paths, eval_paths = _paths(params.path), _paths(params.eval_path)
        if not train_paths:
            raise ValueError("env.params.path: give a data file, a list of files or a datasets folder")
        rows = self._load(train_paths, params.split, "env.params.path")
        if eval_paths:
            train = rows
            evals = self._load(eval_paths, params.eval_split, "env.params.eval_path")
        else:
            k = round(len(rows) * params.eval_fraction)
            if params.eval_fraction > 0 and k == 0 and len(rows) > 1:
                k = 1
            if k >= len(rows):
                raise ValueError(f"env.params.eval_fraction: {params.eval_fraction} of {len(rows)} usable rows leaves "
                                 "none to train on; lower it or add rows")
            held = set(random.Random(f"dataset-split:{seed}").sample(range(len(rows)), k))
            train = [t for i, t in enumerate(rows) if i not in held]
            evals = [t for i, t in enumerate(rows) if i in held]
        self._train = train
        self._eval = evals[:eval_size]

    # ------------------------------------------------------------------ loading
    @staticmethod
    def _template_fields(p: DatasetParams) -> list[str]:
        try:
            names = [f for _, f, _, _ in string.Formatter().parse(p.template) if f is not None]
        except ValueError as e:
            raise ValueError(f"env.params.template: {p.template!r} is not a valid template: {e}") from None
        allowed = {"prompt", *p.extra}
        for f in names:
            if not f.isidentifier():
                raise ValueError(f"env.params.template: field {{{f}}} must be a plain column name")
            if f not in allowed:
                raise ValueError(f"env.params.template: {{{f}}} is neither {{prompt}} nor a column listed in "
                                 f"env.params.extra ({', '.join(p.extra) or 'empty'}); add it to extra")
        return names

    def _columns(self) -> list[str]:
        p = self.params
        return list(dict.fromkeys(c for c in (p.prompt, p.answer, p.id, p.images, *p.extra) if c))

    def _load(self, paths: list[str], split: str, key: str) -> list[Task]:
        p = self.params
        tasks: list[Task] = []
        seen: set[str] = set()
        for name in paths:
            path = Path(name).expanduser()
            if not path.exists():
                raise ValueError(f"{key}: {name!r} not found (relative paths are relative to {Path.cwd()})")
            fmt = _format_of(path, p.format)
            if fmt == "jsonl":
                rows = _read_jsonl(path, self._columns())
            elif fmt == "csv":
                rows = _read_csv(path, self._columns())
            elif fmt == "parquet":
                rows = _read_parquet(path, self._columns())
            else:
                rows = _read_datasets(path, self._columns(), split)
            good, bad = 0, []
            try:
                for where, raw in rows:
                    if p.max_rows and len(tasks) >= p.max_rows:
                        break
                    task = self._task(name, where, raw, seen) if isinstance(raw, dict) else raw
                    if isinstance(task, Task):
                        tasks.append(task)
                        good += 1
                    else:
                        bad.append(BadRow(name, where, task))
            except Exception as e:  # OSError, a bad encoding, pyarrow's errors on a corrupt file, ...
                if isinstance(e, ValueError) and str(e).startswith("env.params"):
                    raise  # ours, already naming the key and the file
                raise ValueError(f"{key}: reading {name} as {fmt} failed: {type(e).__name__}: {e}") from None
            if bad:
                self._counts["bad_rows"] += len(bad)
                self.bad_rows += bad[:MAX_LISTED]
                listed = "; ".join(f"{b.where}: {b.why}" for b in bad[:MAX_LISTED])
                more = f" (and {len(bad) - MAX_LISTED} more)" if len(bad) > MAX_LISTED else ""
                log.warning("%s: %d bad row(s) not used, %d used: %s%s", name, len(bad), good, listed, more)
            if good == 0:
                listed = "; ".join(f"{b.where}: {b.why}" for b in bad[:3])
                raise ValueError(f"{key}: {name} has no usable row ({len(bad)} bad{': ' + listed if listed else ', it is empty'}); "
                                 f"check the column mapping (prompt={p.prompt!r}, answer={p.answer!r}, id={p.id!r}, extra={p.extra})")
        return tasks

    def _task(self, file: str, where: str, raw: dict[str, Any], seen: set[str]) -> Task | str:
        p = self.params
        for col in self._columns():
            if col not in raw:
                return f"missing column {col!r}"
        prompt = raw[p.prompt]
        if not isinstance(prompt, str):
            return f"column {p.prompt!r} (prompt) is a {type(prompt).__name__}, expected text"
        if not prompt.strip():
            return "empty prompt"
        answer = ""
        if p.answer:
            a = raw[p.answer]
            if isinstance(a, bool) or not isinstance(a, (str, int, float)):
                return f"column {p.answer!r} (answer) is a {type(a).__name__}, expected text or a number"
            answer = str(a)
        if p.id:
            i = raw[p.id]
            if isinstance(i, bool) or not isinstance(i, (str, int)):
                return f"column {p.id!r} (id) is a {type(i).__name__}, expected text or an integer"
            tid = str(i)
        else:
            tid = f"{file}:{where.split()[-1]}"
        if tid in seen:
            return f"duplicate id {tid!r}"
        meta = {c: raw[c] for c in p.extra}
        values = {"prompt": prompt, **meta}
        try:
            text = p.template.format_map(values) if self._fields != ["prompt"] or p.template != "{prompt}" else prompt
        except (ValueError, TypeError, KeyError) as e:
            return f"template {p.template!r} cannot be filled: {e}"
        if not text.strip():
            return "empty prompt after the template"
        if p.images:  # paths only: the image is loaded where a model needs it (a bad one: that sample, counted)
            refs = raw[p.images] if isinstance(raw[p.images], list) else [raw[p.images]]
            if not refs or not all(isinstance(r, str) and r for r in refs):
                return f"column {p.images!r} (images) must be a file path or a list of them"
            meta["images"] = [str(Path(file).expanduser().parent / r) for r in refs]  # an absolute r stays itself
            if IMAGE_TOKEN not in text:
                text = IMAGE_TOKEN * len(refs) + text
        seen.add(tid)
        meta["_source"] = f"{file} {where}"
        return Task(id=tid, prompt=text, answer=answer, meta=meta)

    # ------------------------------------------------------------------ EnvSuite
    @property
    def counters(self) -> dict[str, int]:
        """bad_rows, reward failures by reason, reward worker starts/kills (logged as env/<name>)."""
        return {**self._counts, **self.rewards.counters}

    @staticmethod
    def row(task: Task) -> dict[str, Any]:
        """What the reward function receives for ``task``."""
        row = {k: v for k, v in task.meta.items() if k != "_source"}
        row.update(id=task.id, prompt=task.prompt, answer=task.answer)
        return row

    def train_tasks(self) -> Sequence[Task]:
        return self._train

    def eval_tasks(self) -> Sequence[Task]:
        return self._eval

    def make_env(self) -> DatasetEnv:
        return DatasetEnv(self)

    async def aclose(self) -> None:
        await self.rewards.aclose()
