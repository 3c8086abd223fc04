"""The draft model's bound at batch 1 from a data file of experiments/draft_bound.py: the standard model fitted to
the runs, and the roofline's prediction for an accelerator (the docs' view `draft_bound`). Defines no flags: the
docs' tables import it."""

import statistics

ACCELERATORS = ("h200", "tpu-v5e")
ALPHAS = (0.6, 0.8)  # a 7B pair's acceptance is not measured here: two values from the range papers report


def _by_round(runs: list[dict], method: str, key: str) -> dict[int, float]:
    return {r["round"]: r[key] for r in runs if r["method"] == method and r.get(key) is not None}


def _median(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def fit(data: dict) -> dict:
    """The standard model's inputs and predictions from the runs: per k, alpha (from the mean acceptance length),
    the verifying step's cost in plain target steps, predicted and measured speedup over the default; overall c and
    o from a least-squares line of the verifying step's cost over k."""
    from cbjax.sim.speculative_speedup import alpha_for_tokens, expected_tokens

    runs = data["runs"]
    default_ms = {r: 1000 / v for r, v in _by_round(runs, "off", "output_throughput").items()}
    target_ms = {r: 1000 / v for r, v in _by_round(runs, "off_1step", "output_throughput").items()}
    draft_ms = {r: 1000 / v for r, v in _by_round(runs, "draft_alone", "output_throughput").items()}
    t_default, t_target, t_draft = (_median(d.values()) for d in (default_ms, target_ms, draft_ms))
    ks = sorted({r["k"] for r in runs if r["k"]})
    verify_ms = {k: _median(_by_round(runs, f"draft_k{k}", "verify_step_ms").values()) for k in ks}
    host_ms = {k: _median(_by_round(runs, f"draft_k{k}", "verify_host_ms").values()) for k in ks}
    tokens = {k: _median(_by_round(runs, f"draft_k{k}", "tokens_per_verify_step").values()) for k in ks}
    measured = {}
    for k in ks:
        thr = _by_round(runs, f"draft_k{k}", "output_throughput")
        base = _by_round(runs, "off", "output_throughput")
        measured[k] = _median(thr[r] / base[r] for r in thr if r in base)
    mean_k = statistics.fmean(ks)
    slope = sum((k - mean_k) * (verify_ms[k] - statistics.fmean(verify_ms.values())) for k in ks) / sum(
        (k - mean_k) ** 2 for k in ks
    )
    intercept = statistics.fmean(verify_ms.values()) - slope * mean_k
    c, o = slope / t_target, intercept / t_target - 1
    alphas = {k: alpha_for_tokens(min(max(tokens[k], 1.0), k + 1), k) for k in ks}
    alpha = _median(alphas.values())
    rows = []
    for k in ks:
        cost = 1 + k * c + o
        rows.append(dict(
            k=k, alpha=alphas[k], tokens=tokens[k], expected_tokens=expected_tokens(alpha, k),
            verify_ms=verify_ms[k], verify_host_ms=host_ms[k], cost=verify_ms[k] / t_target, fitted_cost=cost,
            predicted=expected_tokens(alpha, k) * t_default / (t_target * cost), measured=measured[k],
        ))  # fmt: skip
    return dict(t_default_ms=t_default, t_target_ms=t_target, t_draft_ms=t_draft, c_standalone=t_draft / t_target,
                c=c, o=o, alpha=alpha, rows=rows)  # fmt: skip


def fit_table(data: dict) -> str:
    from experiments.doc_views import markdown_table

    f = fit(data)
    head = (
        f"Per token (medians over the rounds): the default {f['t_default_ms']:.3f} ms, a plain target step "
        f"{f['t_target_ms']:.3f} ms, a plain draft step {f['t_draft_ms']:.3f} ms (c standalone = "
        f"{f['c_standalone']:.2f}). Fitted over k: a verifying step costs 1 + {f['c']:.2f} k + {f['o']:.2f} plain "
        f"target steps (c = {f['c']:.2f}, o = {f['o']:.2f}); alpha = {f['alpha']:.2f} (median over k)."
    )
    header = ["k", "alpha", "tokens / verify step", "E(alpha, k)", "verify step ms", "of it host ms",
              "cost (target steps)", "fitted 1 + kc + o", "predicted vs default", "measured vs default"]  # fmt: skip
    body = [
        [str(r["k"]), f"{r['alpha']:.2f}", f"{r['tokens']:.2f}", f"{r['expected_tokens']:.2f}", f"{r['verify_ms']:.2f}",
         f"{r['verify_host_ms']:.2f}", f"{r['cost']:.2f}", f"{r['fitted_cost']:.2f}", f"{r['predicted']:.2f}x",
         f"{r['measured']:.2f}x"]
        for r in f["rows"]
    ]  # fmt: skip
    return head + "\n\n" + markdown_table(header, body)


def roofline_table(data: dict) -> str:
    """The roofline's batch-1 speedup over plain decoding in blocks, best k of 1..4 (its k in brackets)."""
    from cbjax.sim.speculative_speedup import SpeculationRoofline
    from experiments.doc_views import markdown_table

    f, s, shapes_ = fit(data), data["settings"], data["shapes"]
    context, overhead = s["context"], s["step_overhead_ms"] / 1000
    pairs = {"tinypy / tinypy-draft": ("tinypy", "tinypy-draft"), "7B / 1.1B": ("llama-7b", "draft-1.1b")}
    alphas = [f["alpha"], *ALPHAS]
    header = ["pair", "accelerator", "overhead / dispatch", "c (draft iteration / plain token)"]
    header += [f"alpha {alphas[0]:.2f} (tinypy's, fitted)"]
    header += [f"alpha {a:.2f}" for a in ALPHAS]
    body = []
    for name, (t, d) in pairs.items():
        for acc in ACCELERATORS:
            for oh in (0.0, overhead):
                r = SpeculationRoofline(shapes_[t], shapes_[d], acc, step_overhead_s=oh)
                cells = []
                for a in alphas:
                    best = max(range(1, 5), key=lambda k: r.speedup(a, k, context))
                    cells.append(f"{r.speedup(a, best, context):.2f}x (k={best})")
                body.append([name, acc, f"{oh * 1000:g} ms", f"{r.cost_ratio(context):.2f}", *cells])
    return markdown_table(header, body)
