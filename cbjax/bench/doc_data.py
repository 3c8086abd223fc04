"""The data files behind the docs' tables (docs/data/*.json): one file per sitting that records how its figures
were made and every run, so that each table in the docs is derived from it (`python -m experiments.doc_tables`)
and never typed by hand.

A data file is one JSON object:
  command    str: the command (or commands) that produced the runs, as a reader would type them
  commit     str: the git commit of the tree measured; `dirty`: True when the tree had uncommitted changes
  cpu        str: the processor (`cbjax.bench.results.cpu_model()`); `cpu_count`: the CPUs the OS reports
  date       str: when the sitting ran, ISO 8601 in UTC
  runs       list: every run, raw, one object per run: the labels that identify it (workload, model, engine,
             policy, round, ...) and the figures it measured. Never medians or ratios: the views compute those,
             so a reader can recompute them and a table cannot drift from its runs.
  what       str, optional: one sentence on what was measured
  anything else the script wants to keep (settings, load average, notes).
Files written before this module give `commit` as {"commit", "dirty"} and `cpu` as {"cpu", "machine",
"cpu_count"} (the manifest's shapes) or keep their runs deeper (the fidelity study's under each workload);
`provenance` reads both shapes, and each view says where it finds the runs it reads.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from cbjax.bench.results import cpu_model, write_json

REQUIRED = ("command", "commit", "cpu", "date")  # what every data file records about where its figures come from
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def git_commit(root: str = ROOT) -> tuple[str | None, bool | None]:
    """(HEAD's commit, whether tracked files differ from it) of the checkout at `root`; (None, None) outside git."""

    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return None, None
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return head.stdout.strip(), bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


def write_doc_data(
    path: str,
    *,
    command: str,
    runs: Sequence[Mapping[str, Any]],
    what: str | None = None,
    date: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Write a data file for the docs (the schema above) and return what was written. The commit, dirty flag, CPU
    and CPU count are this machine's and checkout's now; `date` defaults to now (UTC). `extra` keys are kept as
    given but may not replace the provenance fields. NaN is written as null (JSON has no NaN)."""
    if not isinstance(command, str) or not command.strip():
        raise ValueError(f"command must be the non-empty command line that produced the runs, got {command!r}")
    runs = list(runs)
    if not runs or not all(isinstance(r, Mapping) for r in runs):
        raise ValueError("runs must be a non-empty list of objects, one per run (the raw figures, not medians)")
    clash = sorted(set(extra) & {*REQUIRED, "dirty", "cpu_count", "runs", "what"})
    if clash:
        raise ValueError(f"extra fields may not replace the provenance fields: {clash}")
    commit, dirty = git_commit()
    if date is None:
        date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    data = {"what": what} if what else {}
    data.update(command=command, commit=commit, dirty=dirty, cpu=cpu_model(), cpu_count=os.cpu_count(), date=date)
    data.update(extra)
    data["runs"] = [dict(r) for r in runs]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json(path, data)
    with open(path, encoding="utf-8") as f:  # what the file holds (NaN as None), as every reader will see it
        return json.load(f)


def read_doc_data(path: str) -> dict[str, Any]:
    """A data file, checked to be an object that records every field of `REQUIRED` (ValueError otherwise)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a data file is a JSON object, got {type(data).__name__}")
    missing = [k for k in REQUIRED if data.get(k) in (None, "", {})]
    if missing:
        raise ValueError(f"{path}: a data file records {', '.join(REQUIRED)}; missing or empty: {', '.join(missing)}")
    return data


def provenance(data: Mapping[str, Any]) -> dict[str, Any]:
    """The provenance fields in one shape whatever the file's age: command, commit, dirty, cpu, cpu_count, date."""
    commit, dirty = data.get("commit"), data.get("dirty")
    if isinstance(commit, Mapping):
        commit, dirty = commit.get("commit"), commit.get("dirty", dirty)
    cpu, cpu_count = data.get("cpu"), data.get("cpu_count")
    if isinstance(cpu, Mapping):
        cpu, cpu_count = cpu.get("cpu"), cpu.get("cpu_count", cpu_count)
    return dict(command=data.get("command"), commit=commit, dirty=dirty, cpu=cpu, cpu_count=cpu_count,
                date=data.get("date"))  # fmt: skip


def _when(date) -> str:
    """'2026-12-04' as it is; a time to the minute, in UTC."""
    try:
        t = datetime.datetime.fromisoformat(str(date))
    except ValueError:
        return str(date)
    if len(str(date)) <= 10:
        return str(date)
    if t.tzinfo is not None:
        t = t.astimezone(datetime.UTC)
    return t.strftime("%Y-%m-%d %H:%M") + (" UTC" if t.tzinfo is not None else "")


def provenance_line(path: str, data: Mapping[str, Any]) -> str:
    """One Markdown line under a generated table: its data file, command, commit, CPU and date."""
    p = provenance(data)
    commit = str(p["commit"])[:7] + ("+dirty" if p["dirty"] else "")
    cpu = str(p["cpu"]) + (f", {p['cpu_count']} CPUs" if p["cpu_count"] else "")
    when = _when(p["date"])
    return f"_Data: `{path}` · `{p['command']}` · commit {commit} · {cpu} · {when}._"
