"""The views of the docs' generated tables: each turns a data file (cbjax/bench/doc_data.py) into Markdown. A
marker in the docs names a view and passes its parameters (experiments/doc_tables.py). Views compute every median,
interval and ratio from the raw runs, so a table can say no more than its runs do.

  rows            one row per run, or per element of a list inside each run
  medians         per group of runs: each column's median with its 95% interval (bootstrap over the runs,
                  cbjax/bench/intervals.py), and optionally each group's paired ratio to a baseline group
  ab              two sides of one comparison (cbjax and vLLM, engine A and engine B) side by side, with their
                  paired ratio per round and its interval
  pivot           one row per value of a key and one column per value of another (models side by side)
  ttft_tail       `medians` of the TTFT tail's columns per policy: who waits for everyone (the lpm starvation study)
  fidelity_study  the simulator-fidelity study's tables (experiments/fidelity_study.report; its runs sit under
                  each workload)
  fidelity_verdicts  the same study in short: per-run bias, speed probes, the verdicts

Parameters shared by the tabular views:
  rows     the key of a list inside each run whose elements are the records, each merged with its run's own
           fields (a run of a policy comparison holds one summary per policy: rows="policies")
  where    {key: value}: only the records that match every pair
  columns  each a key (dots reach into nested objects: "load.request_rate") or {"key", "header", "format"};
           a key of LABELS takes its header and format from there
Records without a `run` field are numbered by their run's position (1, 2, ...), which `pair` can then use.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cbjax.bench.comparison_table import COLUMNS
from cbjax.bench.intervals import Interval, format_interval, median_interval, paired_ratio_interval, significant

# key -> (header, format): the comparison table's columns, and the other keys data files record.
LABELS: dict[str, tuple[str, str]] = {key: (header, fmt) for header, key, fmt in COLUMNS}
LABELS.update({
    "e2e_ms_p50": ("E2E p50", "{:.0f}"),
    "output_tok_per_s": ("out tok/s", "{:.1f}"),
    "output_throughput_vs_static": ("out tok/s vs static", "{:.2f}x"),
    "load.load": ("load", "{:.2f}"),
    "load.capacity_request_rate": ("capacity req/s", "{:.1f}"),
    "load.request_rate": ("rate req/s", "{:.1f}"),
    "request_rate": ("rate req/s", "{:g}"),
    "ttft_ms_max": ("TTFT max", "{:.0f}"),
    "ttft_worst5_share": ("TTFT share of worst 5%", "{:.0%}"),
    "first_turn_ttft_ms_p99": ("first turns TTFT p99", "{:.0f}"),
    "later_turn_ttft_ms_p99": ("later turns TTFT p99", "{:.0f}"),
})  # fmt: skip

VIEWS: dict[str, Callable[..., str]] = {}


def view(name: str):
    """Register a view: a function (data, **params) -> Markdown."""

    def register(fn):
        VIEWS[name] = fn
        return fn

    return register


# ---- records and cells ----


def lookup(record: Mapping[str, Any], key: str) -> Any:
    """record[key], with dots reaching into nested objects; None where any part is missing."""
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def records(data: Mapping[str, Any], rows: str | None = None, where: Mapping[str, Any] | None = None) -> list[dict]:
    """The data file's runs as flat records (see the module docstring for `rows` and `where`)."""
    runs = data.get("runs")
    if not isinstance(runs, list):
        raise ValueError("this view reads the data file's `runs` list, and the file has none")
    out = []
    for i, run in enumerate(runs):
        base = {"run": i + 1, **run}
        if rows is None:
            items = [base]
        else:
            inner = lookup(run, rows)
            if not isinstance(inner, list):
                raise ValueError(f"run {i + 1}: `{rows}` is not a list")
            items = [{**base, **x} for x in inner]
        out += [r for r in items if all(lookup(r, k) == v for k, v in (where or {}).items())]
    return out


def _num(x: Any) -> float:
    try:
        return math.nan if x is None or isinstance(x, bool) else float(x)
    except (TypeError, ValueError):
        return math.nan


def cell(value: Any, fmt: str = "{}") -> str:
    """One table cell: '-' for a missing value or NaN; numbers through `fmt`; '|' escaped for Markdown."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            text = fmt.format(round(value) if "d}" in fmt else value)
        except (ValueError, TypeError, OverflowError):  # a format that does not fit the value: show it plainly
            text = str(value)
    else:
        text = str(value)
    return text.replace("|", "\\|")


@dataclasses.dataclass(frozen=True)
class Column:
    key: str
    header: str
    fmt: str

    def interval(self, iv: Interval) -> str:
        """'median [low, high]' in this column's format (an integer format shows rounded medians)."""
        fmt = self.fmt.replace("{:d}", "{:.0f}")
        return "-" if math.isnan(iv.median) else format_interval(iv, fmt).replace("|", "\\|")


def column(spec: str | Mapping[str, str]) -> Column:
    """A column from a key (LABELS gives its header and format, else the key itself and plain formatting) or from
    {"key", "header", "format"}."""
    if isinstance(spec, str):
        header, fmt = LABELS.get(spec, (spec, "{}"))
        return Column(spec, header, fmt)
    unknown = set(spec) - {"key", "header", "format"}
    if "key" not in spec or unknown:
        raise ValueError(f"a column is a key or {{key, header, format}}, got {dict(spec)}")
    header, fmt = LABELS.get(spec["key"], (spec["key"], "{}"))
    return Column(spec["key"], spec.get("header", header), spec.get("format", fmt))


def markdown_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])


def _groups(recs: Sequence[dict], by: Sequence[str]) -> dict[tuple, list[dict]]:
    """Records grouped by their values of `by`, groups in the order first seen."""
    groups: dict[tuple, list[dict]] = {}
    for r in recs:
        groups.setdefault(tuple(lookup(r, k) for k in by), []).append(r)
    return groups


def _paired(group: Sequence[dict], base: Sequence[dict], key: str, pair: str) -> tuple[list[float], list[float]]:
    """The values of `key` in `group` and `base` for each value of `pair` both have (in `group`'s order)."""
    by_pair = {lookup(r, pair): r for r in base}
    both = [(r, by_pair[lookup(r, pair)]) for r in group if lookup(r, pair) in by_pair]
    return [_num(lookup(a, key)) for a, _ in both], [_num(lookup(b, key)) for _, b in both]


def _ratio_cell(ratio: Interval) -> str:
    """'1.80x [1.58, 1.82] *': the median ratio, its interval when known, * where the interval excludes 1."""
    if math.isnan(ratio.median):
        return "-"
    text = f"{_ratio(ratio.median)}x"
    if ratio.known:
        text += f" [{_ratio(ratio.low)}, {_ratio(ratio.high)}]"
    return text + (" *" if significant(ratio) else "")


def _ratio(x: float) -> str:
    """Two decimals, or two significant digits below 0.1 (a TTFT 200x lower is 0.005, not 0.00)."""
    return f"{x:.2f}" if abs(x) >= 0.1 or x == 0 else f"{x:.2g}"


# ---- the views ----


@view("rows")
def rows_view(data, columns: Sequence, rows: str | None = None, where: Mapping | None = None) -> str:
    """One row per record, the given columns."""
    cols = [column(c) for c in columns]
    recs = records(data, rows, where)
    return markdown_table([c.header for c in cols], [[cell(lookup(r, c.key), c.fmt) for c in cols] for r in recs])


def _ratio_column(key: str, cols: Sequence[Column]) -> Column:
    """The column of a ratio to the baseline: its key's default header, or where that is the bare key, the header the
    table gives the key's column, less its unit (a ratio has none)."""
    default = column(key)
    given = next((c for c in cols if c.key == key), None)
    if default.header != key or given is None:
        return default
    return dataclasses.replace(given, header=given.header.removesuffix(" ms").removesuffix(" s"))


@view("medians")
def medians_view(
    data,
    by: Sequence[str],
    columns: Sequence,
    rows: str | None = None,
    where: Mapping | None = None,
    baseline: Mapping | None = None,
    ratios: Sequence[str] = (),
    pair: str = "run",
) -> str:
    """Per group of records with equal values of `by`: each column's median over the group's runs and the 95%
    interval of that median, and the number of runs. With `baseline` ({key: value} naming the baseline group
    among the groups that share the other `by` values), each key of `ratios` adds the group's ratio to the
    baseline: the median of the per-run ratios paired by `pair` (runs of the same sitting share its drift), with
    its interval, starred where the interval excludes 1."""
    cols = [column(c) for c in columns]
    ratio_cols = [_ratio_column(k, cols) for k in ratios]
    if ratio_cols and not baseline:
        raise ValueError("ratios need a baseline ({key: value})")
    groups = _groups(records(data, rows, where), by)
    base_name = "/".join(str(v) for v in (baseline or {}).values())
    header = [*(column(k).header for k in by), *(c.header for c in cols)]
    header += [f"{c.header} vs {base_name}" for c in ratio_cols] + ["runs"]
    body = []
    for key, group in groups.items():
        row = [cell(v) for v in key]
        row += [c.interval(median_interval([_num(lookup(r, c.key)) for r in group])) for c in cols]
        base_key = tuple((baseline or {}).get(k, v) for k, v in zip(by, key))
        for c in ratio_cols:
            if base_key == key or base_key not in groups:
                row.append("-")
                continue
            values, base = _paired(group, groups[base_key], c.key, pair)
            row.append(_ratio_cell(paired_ratio_interval(values, base)))
        body.append([*row, str(len(group))])
    caption = "Medians over the runs [95% bootstrap interval of the median]"
    if ratio_cols:
        caption += (
            f"; vs {base_name}: the median of the per-{pair} ratios (the group's value / {base_name}'s) [interval], "
            "* where the interval excludes 1"
        )
    return caption + ".\n\n" + markdown_table(header, body)


@view("ab")
def ab_view(
    data,
    by: Sequence[str],
    side: str,
    a: str,
    b: str,
    value: str,
    pair: str = "round",
    rows: str | None = None,
    where: Mapping | None = None,
    labels: Mapping[str, str] | None = None,
) -> str:
    """Per group of `by`: side `a`'s and side `b`'s `value` (median [interval] and every run's value, in pair
    order), the ratio a / b paired by `pair` (median [interval], * where the interval excludes 1) and each pair's
    ratio."""
    labels = dict(labels or {})
    v = column(value)
    name_a, name_b = labels.get(a, a), labels.get(b, b)
    groups = _groups(records(data, rows, where), by)
    header = [*(column(k).header for k in by), f"{name_a} {v.header} (runs)", f"{name_b} {v.header} (runs)"]
    header += [f"{name_a} / {name_b}", f"per {pair}"]
    body = []
    for key, group in groups.items():
        side_a = [r for r in group if lookup(r, side) == a]
        side_b = [r for r in group if lookup(r, side) == b]
        cells = []
        for recs in (side_a, side_b):
            values = [_num(lookup(r, v.key)) for r in recs]
            runs = ", ".join(cell(x, v.fmt) for x in values)
            cells.append(f"{v.interval(median_interval(values))} ({runs})")
        va, vb = _paired(side_a, side_b, v.key, pair)
        per_pair = ", ".join(_ratio(x / y) if y and math.isfinite(x / y) else "-" for x, y in zip(va, vb))
        body.append([*(cell(k) for k in key), *cells, _ratio_cell(paired_ratio_interval(va, vb)), per_pair or "-"])
    caption = (
        f"Medians over the runs [95% bootstrap interval of the median] (every run); {name_a} / {name_b}: the "
        f"median of the per-{pair} ratios [interval], * where the interval excludes 1"
    )
    return caption + ".\n\n" + markdown_table(header, body)


TTFT_TAIL = ("ttft_ms_p50", "ttft_ms_p99", "ttft_ms_max", "ttft_worst5_share", "first_turn_ttft_ms_p99",
             "later_turn_ttft_ms_p99", "prefix_cache_hit_rate", "request_throughput")  # fmt: skip


@view("ttft_tail")
def ttft_tail_view(data, by: Sequence[str] = ("policy",), where: Mapping | None = None, baseline: Mapping | None = None,
                   ratios: Sequence[str] = ()) -> str:  # fmt: skip
    """Where a policy starves some requests (the lpm starvation study, docs/policies.md): per group of `by`, the
    medians [intervals] of TTFT p50, p99 and max, the share of all TTFT the worst 5% of requests carry, the TTFT p99
    of first turns (cache misses) and of later turns, the prefix-cache hit rate and req/s (`medians` view)."""
    return medians_view(data, by, TTFT_TAIL, where=where, baseline=baseline, ratios=ratios)


@view("fidelity_study")
def fidelity_study_view(data) -> str:
    """The tables and verdicts of `python -m experiments.fidelity_study --report FILE`."""
    from experiments import fidelity_study

    return fidelity_study.report(data)


@view("fidelity_verdicts")
def fidelity_verdicts_view(data) -> str:
    """A fidelity study in short: the bias of each real run, the speed probes and the verdict lines."""
    from experiments import fidelity_study

    lines = "\n".join(fidelity_study.verdict_lines(data))
    return "\n\n".join([fidelity_study.run_bias_line(data), fidelity_study.probe_line(data), lines])


@view("draft_bound")
def draft_bound_view(data, part: str) -> str:
    """The draft model at batch 1 (experiments/draft_bound.py): part "fit", the standard speculative-decoding model
    fitted to the runs beside the measured speedup; part "roofline", its prediction on accelerators."""
    from experiments import draft_bound_report

    parts = {"fit": draft_bound_report.fit_table, "roofline": draft_bound_report.roofline_table}
    if part not in parts:
        raise ValueError(f"part is one of {sorted(parts)}, got {part!r}")
    return parts[part](data)


@view("pivot")
def pivot_view(
    data,
    row: str,
    column_key: str,
    value: str = "value",
    rows: str | None = None,
    where: Mapping | None = None,
    labels: Mapping[str, str] | None = None,
    formats: Mapping[str, str] | None = None,
    corner: str = "",
) -> str:
    """One table row per value of `row` and one column per value of `column_key` (e.g. a measure per row, a model
    per column), each cell the `value` of the records with both: one record shows its value, several their median
    [interval]. `labels` names the rows (and orders them: the labelled first, in its order); `formats` gives a row's
    format ({row value: "{:.3f}"})."""
    labels, formats = dict(labels or {}), dict(formats or {})
    recs = records(data, rows, where)
    row_keys = list(dict.fromkeys([*(k for k in labels if any(lookup(r, row) == k for r in recs)),
                                   *(lookup(r, row) for r in recs)]))  # fmt: skip
    col_keys = list(dict.fromkeys(lookup(r, column_key) for r in recs))
    body = []
    for rk in row_keys:
        line = [cell(labels.get(rk, rk))]
        for ck in col_keys:
            values = [lookup(r, value) for r in recs if lookup(r, row) == rk and lookup(r, column_key) == ck]
            fmt = formats.get(rk, "{}")
            if len(values) == 1:
                line.append(cell(values[0], fmt))
            else:
                line.append(Column(value, "", fmt).interval(median_interval([_num(v) for v in values])))
        body.append(line)
    return markdown_table([corner, *(cell(c) for c in col_keys)], body)


@view("length_prediction")
def length_prediction_view(data, metric: str, baseline: str = "fcfs", pair: str = "run") -> str:
    """The predictor-error study (configs/length_prediction.py): one row per policy and one column per length
    predictor, each cell the entry's `metric` over the `baseline` entry's, paired by `pair` (the median of the
    per-run ratios [95% interval], * where the interval excludes 1). An entry's policy and predictor are read from
    the data file's config: its variant's policy (else the entry's own name) and its policy options'
    length_predictor and sigma."""
    config = data.get("config") or {}
    variants, options = config.get("variants") or {}, config.get("policy_options") or {}
    entries = _groups(records(data), ["policy"])
    if (baseline,) not in entries:
        raise ValueError(f"the baseline entry {baseline!r} has no runs in this data file")
    base = entries[(baseline,)]
    col = column(metric)
    table: dict[str, dict[str, str]] = {}
    for (entry,), group in entries.items():
        variant = variants.get(entry) or {}
        predictor = _predictor_label(options.get(entry) or variant.get("policy_options") or {})
        ratio = paired_ratio_interval(*_paired(group, base, col.key, pair))
        table.setdefault(variant.get("policy", entry), {})[predictor] = "-" if entry == baseline else _ratio_cell(ratio)
    predictors = list(dict.fromkeys(p for row in table.values() for p in row))
    body = [[cell(policy), *(row.get(p, "") for p in predictors)] for policy, row in table.items()]
    base_iv = col.interval(median_interval([_num(lookup(r, col.key)) for r in base]))
    caption = (
        f"{col.header} over {baseline}'s ({base_iv}): the median of the per-{pair} ratios [95% interval], * where "
        "the interval excludes 1"
    )
    return caption + ".\n\n" + markdown_table(["policy", *predictors], body)


def _predictor_label(options: Mapping[str, Any]) -> str:
    kind = options.get("length_predictor")
    if kind is None:
        return "no predictor"
    return f"noisy sigma={options.get('sigma'):g}" if kind == "noisy" else kind


@view("kv_sharing")
def kv_sharing_view(data) -> str:
    """KV pages in use with a request's samples sharing the prompt's pages against without (experiments/
    kv_sharing.py): per (workload, n), the peak and the mean over steps of each, the saving (1 - with / without)
    and the pages copied on write."""
    groups = _groups(records(data), ["workload", "n"])
    header = ["workload", "n or beam width", "peak pages without", "peak with", "peak saving"]
    header += ["mean pages without", "mean with", "mean saving", "pages copied"]
    body = []
    for (workload, n), group in groups.items():
        side = {r["sharing"]: r for r in group}
        without, shared = side[False], side[True]
        row = [cell(workload), cell(n)]
        for key in ("peak_pages", "mean_pages"):
            row += [cell(without[key], "{:.0f}"), cell(shared[key], "{:.0f}")]
            row.append(cell(1 - shared[key] / without[key], "{:.1%}"))
        body.append([*row, cell(shared["page_copies"])])
    return markdown_table(header, body)
