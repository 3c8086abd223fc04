"""Length prediction on the simulator: how the length-aware policies' latency degrades as their output-length
predictor errs more (docs/policies.md, "Length prediction").

  python -m experiments.compare_policies --config=configs/length_prediction.py \
      --config.doc_data=docs/data/length_prediction_2026-12-04.json

Each length-aware policy (sjf on prompt + predicted output, srpt_oracle on predicted remaining work, residual_sjf,
hrrn, slo_aware; cbjax/core/length_aware.py) runs with the oracle predictor (max_tokens, exact here: the workload
ignores EOS), the noisy one at sigma 0.25, 0.5, 1 and 2 (max_tokens x exp(sigma z), seeded per request), and the
learned one (per tenant and prompt-length bucket, fitted online); fcfs and sjf on the prompt alone are the
references. sim_zoo.py's engine and committed llama-tiny CPU profile; 2000 requests of the 1/8-length chat/RAG/code
mix at 1.1x fcfs's capacity on the same requests offline (just past saturation: fcfs's queue grows slowly over the
~35 s of arrivals, so the order matters; at 0.95 the queue hardly forms and every policy looks alike); every
request runs to its end (no horizon), so a starved request counts in the tails. 5 workload seeds (the simulator's
only spread): each entry's median over them with a 95% interval, and its ratio to fcfs paired by seed. slo_aware
has a TTFT target of 1 s and an E2E target of 3 s (the E2E slack is what reads the prediction). About 2.5 minutes
of one CPU core. Every field not set here is sim_zoo.py's, then policy_zoo.py's, then base.py's.
"""

from cbjax.bench.config_files import sibling_config

# Predictor settings of every length-aware entry: label suffix -> policy options.
PREDICTORS = {
    "oracle": dict(length_predictor="oracle"),
    "s025": dict(length_predictor="noisy", sigma=0.25),
    "s05": dict(length_predictor="noisy", sigma=0.5),
    "s1": dict(length_predictor="noisy", sigma=1.0),
    "s2": dict(length_predictor="noisy", sigma=2.0),
    "learned": dict(length_predictor="learned"),
}
FAMILIES = ("sjf", "srpt_oracle", "residual_sjf", "hrrn", "slo_aware")
TTFT_SLO_S = 1.0  # the SLOs of the goodput column, and slo_aware's targets: with only a TTFT target slo_aware
E2E_SLO_S = 3.0  # would not read the predicted output at all (its TTFT slack is prompt-only)


def get_config():
    c = sibling_config(__file__, "sim_zoo.py")
    c.run_name = "length_prediction"  # results/length_prediction/
    c.workload.num_requests = 2000
    c.workload.load = 1.1  # of fcfs's offline capacity on the simulator: just past saturation
    c.horizon_after_last_arrival_s = None  # every request to its end: starvation shows in the tails
    c.seeds = 5
    c.repeats = 1
    c.baseline = "fcfs"
    c.slo.ttft_ms = TTFT_SLO_S * 1e3
    c.slo.tpot_ms = 50.0
    c.slo.e2e_ms = E2E_SLO_S * 1e3
    entries = ["fcfs", "sjf"]  # the references: arrival order, and sjf on the prompt alone (no predictor)
    for family in FAMILIES:
        for tag, options in PREDICTORS.items():
            label = f"{family}_{tag}"
            entries.append(label)
            c.variants[label] = dict(policy=family)
            targets = dict(ttft_slo_s=TTFT_SLO_S, e2e_slo_s=E2E_SLO_S) if family == "slo_aware" else {}
            c.policy_options[label] = dict(options, **targets)
    c.policies = tuple(entries)
    return c
