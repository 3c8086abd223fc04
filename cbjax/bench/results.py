"""The results folder of one experiment run: what was run (config, manifest) and what was measured.

  <output_dir>/<run_name>/
    config.json      the resolved experiment config (command-line overrides applied)
    manifest.json    provenance: git commit, jax/flax versions, devices, bucket tables, start time, command line
    summary.json     one object per policy: every metric of cbjax.bench.metrics.summarize, plus "policy"
    summary.csv      the same, one row per policy
    requests.jsonl   one cbjax.bench.metrics.RequestRecord per line, with a "policy" column
    steps.jsonl      one cbjax.bench.metrics.StepRecord per line, with a "policy" column

JSON has no NaN: a metric without samples (NaN in the summary) is written as null, and as an empty CSV cell.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cbjax.core.machine import cpu_model  # re-exported: experiments read it from here

__all__ = [
    "cpu_model",
    "manifest",
    "run_dir",
    "write_config",
    "write_json",
    "write_jsonl",
    "write_records",
    "write_summary",
]


def run_dir(output_dir: str, run_name: str, *, overwrite: bool = False) -> str:
    """Create and return the folder of a new run: <output_dir>/<run_name>, or, when that holds an earlier run's
    files and `overwrite` is False, the first free <run_name>_2, <run_name>_3, ... (never another run's folder)."""
    if not isinstance(run_name, str) or not run_name or os.sep in run_name or run_name in (".", ".."):
        raise ValueError(f"run_name must be a plain folder name, got {run_name!r}")
    path = os.path.join(output_dir, run_name)
    n = 1
    while not overwrite and os.path.isdir(path) and os.listdir(path):
        n += 1
        path = os.path.join(output_dir, f"{run_name}_{n}")
    os.makedirs(path, exist_ok=True)
    return path


def _clean(x: Any) -> Any:
    """JSON-safe: NaN and infinities become None, numpy scalars plain Python, tuples lists."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy scalar
        return _clean(x.item())
    return x


def write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_clean(obj), f, indent=2, allow_nan=False)
        f.write("\n")


def _json_line(row: Mapping[str, Any]) -> str:
    """json.dumps(_clean(row)): most rows (string keys, plain values, finite floats) need no cleaning, and walking
    every token time of 100k records through _clean took longer than a simulated run."""
    if all(type(k) is str for k in row):
        try:
            return json.dumps(row, allow_nan=False)
        except (TypeError, ValueError):  # a numpy scalar, NaN or infinity somewhere
            pass
    return json.dumps(_clean(row), allow_nan=False)


def write_jsonl(path: str, rows: Iterable[Mapping[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(_json_line(row) + "\n")


def write_config(path: str, config) -> None:
    """The resolved ml_collections config as JSON (placeholders that stayed unset are null)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(config.to_json_best_effort(indent=2, sort_keys=False) + "\n")


def _git_commit() -> dict[str, Any]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def manifest(
    *,
    start_time: datetime.datetime,
    engines: Mapping[str, Mapping[str, Any]],
    argv: Sequence[str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Provenance of a run. `engines` maps each policy to what its engine reported (config, buckets, warmup)."""
    import jax

    devices = jax.devices()
    d = devices[0]
    out = {
        "start_time": start_time.isoformat(timespec="seconds"),
        "command_line": list(sys.argv if argv is None else argv),
        "git": _git_commit(),
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in ("jax", "jaxlib", "flax", "numpy", "ml-collections")},
        "device": {"platform": d.platform, "kind": getattr(d, "device_kind", None), "count": len(devices)},
        "host": {"machine": platform.machine(), "cpu": cpu_model(), "cpu_count": os.cpu_count()},
        "engines": dict(engines),
    }
    if extra:
        out.update(extra)
    return out


def write_summary(folder: str, summaries: Mapping[str, Mapping[str, Any]]) -> None:
    """summary.json (a list of objects) and summary.csv (one row per policy, columns in first-seen order)."""
    rows = [{"policy": policy, **summary} for policy, summary in summaries.items()]
    write_json(os.path.join(folder, "summary.json"), rows)
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    with open(os.path.join(folder, "summary.csv"), "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in _clean(row).items()})


def _fields(record) -> dict[str, Any]:
    """dataclasses.asdict of a flat record, without its deep copy of every list."""
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}


def write_records(folder: str, results: Mapping[str, Sequence[Any]]) -> None:
    """requests.jsonl and steps.jsonl from {policy: [OnlineResult of each repeat]}, each line tagged with its
    policy and repeat (0 for the first)."""
    runs = [(p, i, res) for p, reps in results.items() for i, res in enumerate(reps)]
    write_jsonl(
        os.path.join(folder, "requests.jsonl"),
        ({"policy": p, "repeat": i, **_fields(r)} for p, i, res in runs for r in res.requests),
    )
    write_jsonl(
        os.path.join(folder, "steps.jsonl"),
        ({"policy": p, "repeat": i, **_fields(s)} for p, i, res in runs for s in res.steps),
    )
