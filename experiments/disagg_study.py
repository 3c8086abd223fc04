"""Colocated `sarathi` against disaggregated prefill/decode, on the simulator: llama-7B shapes on H200s and on TPU
v5e chips, across arrival rates up to and past capacity; goodput under a TTFT and a TPOT SLO (cbjax/bench/metrics.py:
requests meeting both, per second), per device so that setups of different sizes compare.

  python -m experiments.disagg_study --doc_data=docs/data/disagg_DATE.json

Setups (each the same number of devices on both sides: a device-for-device comparison; a colocated replica is one
engine, a disaggregated engine too):
- `colocatedN`: N replicas, each serving prompts and decodes with `sarathi` (stall-free chunked prefill under a
  token budget, --colocated_budget), behind a least-load router (cbjax/sim/engine_set.py ReplicatedSim).
- `PpDd`: P prefill and D decode engines (cbjax/sim/disaggregated.py), fcfs on both sides with a --disagg_budget
  token budget; the KV crosses the accelerator's link (--h200_link, --v5e_link; cbjax/sim/links.py).
An engine is one H200, or --v5e_chips TPU v5e chips in tensor parallel: a v5e chip's 16 GB hold the 13.5 GB of
bf16 weights with room for ~1.7k KV tokens, less than the mix's long prompts, so a v5e engine takes 2 chips and
"v5e x4" is two engines.

Workload: the chat/RAG/code mix (cbjax/bench/workload.py `mixed`, full lengths, max_model_len 4096), Poisson
arrivals, rate x --window_s requests per run (so the drain after the last arrival stays a small part of the run),
--seeds workload seeds (the same requests for every setup at a seed and total rate).
Each run records the summary and, to say which phase saturates, each role's busy share (simulated step seconds /
run duration) and what the link cost (mean transfer ms, link busy share). Step times are the roofline's
(cbjax/sim/roofline.py): data-sheet peaks, not measurements.
"""

import os
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("h200_setups", "colocated2,1p1d,colocated4,1p3d,2p2d,3p1d", "H200 setups (empty: skip)")
flags.DEFINE_string("h200_rates", "5,10,15,20,25,30,40", "H200: arrival rates, requests/s per engine")
flags.DEFINE_string("h200_link", "nvlink", "H200: the link of the KV transfers (cbjax.sim.links.LINKS)")
flags.DEFINE_string("v5e_setups", "colocated2,1p1d", "TPU v5e setups (empty: skip)")
flags.DEFINE_string("v5e_rates", "1,2,3,4,5,6,8", "TPU v5e: arrival rates, requests/s per engine")
flags.DEFINE_string("v5e_link", "ici-v5e", "TPU v5e: the link of the KV transfers")
flags.DEFINE_integer("v5e_chips", 2, "TPU v5e chips per engine (tensor parallel)")
flags.DEFINE_float("window_s", 40.0, "requests per run: rate x this many seconds of arrivals (at least min_requests)")
flags.DEFINE_integer("min_requests", 400, "requests per run, at least")
flags.DEFINE_integer("seeds", 3, "workload seeds per (setup, rate)")
flags.DEFINE_float("ttft_ms", 500.0, "TTFT SLO (ms)")
flags.DEFINE_float("tpot_ms", 30.0, "TPOT SLO (ms)")
flags.DEFINE_integer("colocated_budget", 512, "colocated sarathi: max_num_batched_tokens")
flags.DEFINE_integer("disagg_budget", 2048, "disaggregated engines: max_num_batched_tokens")
flags.DEFINE_string("doc_data", None, "write every run to this data file for the docs (docs/data/NAME.json)")

MODEL, MAX_LEN = "llama-7b", 4096
SETTINGS = ("window_s", "min_requests", "seeds", "colocated_budget", "disagg_budget", "v5e_chips", "h200_link",
            "v5e_link")  # fmt: skip
SUMMARY_KEYS = ("goodput", "slo_attainment", "request_throughput", "output_throughput", "ttft_ms_p50", "ttft_ms_p99",
                "tpot_ms_p50", "tpot_ms_p99", "num_completed", "request_preemptions", "duration_s")  # fmt: skip


def parse_setup(name: str) -> tuple[int, int]:
    """'colocatedN' -> (N, 0); 'PpDd' -> (P, D)."""
    name = name.strip().lower()
    try:
        if name.startswith("colocated"):
            n = int(name[len("colocated") :])
            if n >= 1:
                return n, 0
        elif name.count("p") == 1 and name.endswith("d"):
            p, d = (int(x) for x in name[:-1].split("p"))
            if p >= 1 and d >= 1:
                return p, d
    except ValueError:
        pass
    raise ValueError(f"a setup is 'colocatedN' or 'PpDd' (e.g. 1p3d), got {name!r}")


def build(accelerator: str, chips: int, setup: str, link: str):
    """The simulated engines of `setup` behind one engine-like object."""
    from cbjax.core.clock import VirtualClock
    from cbjax.engine import LLMEngine
    from cbjax.sim.disaggregated import DisaggregatedSim
    from cbjax.sim.engine_set import ReplicatedSim

    base = dict(runner="sim", sim_accelerator=accelerator, sim_num_chips=chips, dtype="bfloat16", max_num_seqs=256,
                max_model_len=MAX_LEN)  # fmt: skip

    def engine(**opts):
        return LLMEngine(MODEL, clock=VirtualClock(), **{**base, **opts})

    p, d = parse_setup(setup)
    if d == 0:
        return ReplicatedSim([engine(policy="sarathi", max_num_batched_tokens=FLAGS.colocated_budget)
                              for _ in range(p)])  # fmt: skip
    prefill = [engine(policy="fcfs", max_num_batched_tokens=FLAGS.disagg_budget) for _ in range(p)]
    # The decode engines' host pool is where the KV they receive lands (and where swap preemption moves KV): as
    # large as their device pool.
    pages = prefill[0].config.cache.num_pages
    decode = [engine(policy="fcfs", max_num_batched_tokens=FLAGS.disagg_budget, preemption_mode="swap",
                     num_host_pages=pages) for _ in range(d)]  # fmt: skip
    return DisaggregatedSim(prefill, decode, link=link)


def run_one(accelerator: str, chips: int, setup: str, link: str, rate_per_engine: float, seed: int) -> dict:
    from cbjax.bench.metrics import summarize
    from cbjax.bench.online import run_online
    from cbjax.bench.workload import make_workload

    p, d = parse_setup(setup)
    engines = p + d
    rate = rate_per_engine * engines
    # Goodput divides by the run's duration, arrivals and drain: a long window of arrivals keeps the drain (the last
    # long outputs finishing) a small part of it at every rate.
    n = max(FLAGS.min_requests, round(rate * FLAGS.window_s))
    workload = make_workload(dict(kind="mixed", num_requests=n, seed=seed, arrival="poisson",
                                  request_rate=rate, scale=1.0, vocab_size=32000, max_model_len=MAX_LEN))  # fmt: skip
    sim = build(accelerator, chips, setup, link)
    wall = time.perf_counter()
    res = run_online(sim, workload)
    wall = time.perf_counter() - wall
    s = summarize(res.requests, res.steps, slo={"ttft_ms": FLAGS.ttft_ms, "tpot_ms": FLAGS.tpot_ms})
    duration = s["duration_s"]
    busy = [e.runner.simulated_s / duration for e in sim.engines]
    row = dict(accelerator=accelerator, chips_per_engine=chips, setup=setup, kind="disaggregated" if d else "colocated",
               prefill=p if d else 0, decode=d, engines=engines, rate=rate, rate_per_engine=rate_per_engine,
               seed=seed, num_requests=n, **{k: s.get(k) for k in SUMMARY_KEYS})  # fmt: skip
    row["goodput_per_engine"] = s["goodput"] / engines
    row["attainment"] = s["slo_attainment"]
    if d:
        links = sim.link_summary()
        row.update(link=links["link"]["name"], prefill_busy=sum(busy[:p]) / p, decode_busy=sum(busy[p:]) / d,
                   transfer_ms_mean=1e3 * links["mean_transfer_s"], link_wait_ms_mean=1e3 * links["mean_wait_s"],
                   link_busy=max(links["busy_s"]) / duration, transfer_bytes=links["bytes"])  # fmt: skip
    else:
        row.update(link=None, engine_busy=sum(busy) / len(busy))
    row["wall_s"] = wall
    return row


def plan() -> list[tuple[str, int, str, str, list[float]]]:
    """(accelerator, chips per engine, setup, link, rates per engine) for every setup asked for."""
    out = []
    for acc, chips, setups, link, rates in (("h200", 1, FLAGS.h200_setups, FLAGS.h200_link, FLAGS.h200_rates),
                                            ("tpu-v5e", FLAGS.v5e_chips, FLAGS.v5e_setups, FLAGS.v5e_link,
                                             FLAGS.v5e_rates)):  # fmt: skip
        names = [s.strip() for s in setups.split(",") if s.strip()]
        for name in names:
            parse_setup(name)
        values = [float(r) for r in rates.split(",") if r.strip()]
        if names and (not values or min(values) <= 0):
            raise ValueError(f"{acc}: rates must be numbers > 0, got {rates!r}")
        out += [(acc, chips, name, link, values) for name in names]
    return out


def main(argv):
    del argv
    from cbjax.sim.links import get_link

    load_before = os.getloadavg()
    try:
        todo = plan()
        for _, _, _, link, _ in todo:
            get_link(link)
    except ValueError as e:
        sys.exit(f"disagg_study: {e}")
    rows = []
    for acc, chips, setup, link, rates in todo:
        for rate in rates:
            for seed in range(FLAGS.seeds):
                row = run_one(acc, chips, setup, link, rate, seed)
                rows.append(row)
                print(f"{acc} {setup:>11} {rate:>5g}/s/engine seed {seed}: goodput/engine "
                      f"{row['goodput_per_engine']:.2f} in SLO {row['attainment']:.0%} TTFT p99 "
                      f"{row['ttft_ms_p99']:.0f} TPOT p99 {row['tpot_ms_p99']:.1f} ({row['wall_s']:.1f} s)",
                      flush=True)  # fmt: skip
    if FLAGS.doc_data:
        from cbjax.bench.doc_data import write_doc_data

        write_doc_data(
            FLAGS.doc_data,
            command=" ".join(["python -m experiments.disagg_study", *sys.argv[1:]]),
            runs=rows,
            what="colocated sarathi against disaggregated prefill/decode on the simulator (roofline, llama-7B "
            "shapes): one run per (accelerator, setup, rate per engine, workload seed)",
            slo={"ttft_ms": FLAGS.ttft_ms, "tpot_ms": FLAGS.tpot_ms},
            settings={k: FLAGS[k].value for k in SETTINGS},
            load_average_before=list(load_before),
            load_average_after=list(os.getloadavg()),
        )
        print(f"data for the docs: {FLAGS.doc_data}")


if __name__ == "__main__":
    app.run(main)
