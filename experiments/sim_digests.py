"""Digests of a simulated comparison's decisions: per policy entry, a SHA-256 over every step record, one over every
request record and one over the generated tokens, so a change meant to make the simulator faster can prove it
decided nothing differently.

  python -m experiments.sim_digests --config=configs/sim_zoo.py --write=/tmp/digests.json   # record them
  python -m experiments.sim_digests --config=configs/sim_zoo.py --check=/tmp/digests.json   # compare (exit 1 if not)

Every field of every record is hashed (times as exact float reprs; STEP_FIELDS, REQUEST_FIELDS) except a step's
`host_s`, the real seconds the host spent on it (measured, so never the same twice). With `workload.load` the
capacity run's rate goes in too.
--check runs only the entries the file holds (a config that gained entries still checks the old ones).
tests/sim/test_sim_digests.py checks a small workload against tests/sim/data/sim_zoo_digests.json.
"""

from __future__ import annotations

import hashlib
import json
import sys

from absl import app, flags

from experiments import compare_policies as cp  # defines --config
from experiments.comparison_config import only_entries

FLAGS = flags.FLAGS
# The record fields digested: every field of cbjax.bench.metrics' StepRecord and RequestRecord when this was written
# but a step's host_s (real seconds, measured: never the same twice). Named here so a field added later with a
# constant default leaves digests recorded before it comparable.
STEP_FIELDS = (
    "time", "num_running", "num_waiting", "num_scheduled_seqs", "max_num_seqs", "num_scheduled_tokens",
    "padded_tokens", "kv_pages_used", "kv_pages_total", "num_preemptions", "device_s", "compiles", "swap_out_bytes",
    "swap_in_bytes", "swap_s", "recomputed_tokens", "prefix_queried_tokens", "prefix_hit_tokens", "replica",
    "decode_steps", "block_wasted_tokens", "spec_draft_tokens", "spec_accepted_tokens", "spec_verified_seqs",
    "spec_drafted_by_position", "spec_accepted_by_position",
)  # fmt: skip
REQUEST_FIELDS = (
    "request_id", "prompt_len", "output_len", "arrival_time", "first_scheduled_time", "first_token_time",
    "token_times", "finished_time", "finish_reason", "length_class", "tenant", "num_preemptions",
)  # fmt: skip


def define_flags() -> None:
    """The command's flags, defined only when it runs as the program (tests import the module)."""
    flags.DEFINE_string("write", None, "write the digests of every entry to this JSON file")
    flags.DEFINE_string("check", None, "compare against this JSON file (written by --write); exit 1 on a difference")


def _sha(items) -> str:
    h = hashlib.sha256()
    for item in items:
        h.update(repr(item).encode())
        h.update(b"\n")
    return h.hexdigest()


def result_digests(result) -> dict:
    """The digests of one OnlineResult (cbjax.bench.online): its step records, request records and outputs."""
    return dict(
        num_steps=len(result.steps),
        num_requests=len(result.requests),
        steps=_sha(tuple(getattr(s, k) for k in STEP_FIELDS) for s in result.steps),
        requests=_sha(tuple(getattr(r, k) for k in REQUEST_FIELDS) for r in result.requests),
        outputs=_sha(sorted(result.output_token_ids.items())),
        interrupted=result.interrupted,
    )


def comparison_digests(cfg, workload) -> dict:
    """Run every entry of the (resolved) config on `workload` (compare_policies.prepare_run's) and digest each."""
    comp = cp.run_comparison(cfg, workload=workload, progress=False)
    out = {name: result_digests(comp.results[name]) for name in cfg.policies}
    if comp.capacity is not None:
        out["capacity_request_rate"] = repr(comp.capacity.rate_at(comp.load))
    return out


def differences(expected: dict, got: dict) -> list[str]:
    """One line per entry (or the capacity rate) whose digests differ."""
    return [f"{k}: expected {expected[k]}, got {got.get(k)}" for k in expected if got.get(k) != expected[k]]


def main(argv):
    del argv
    if (FLAGS.write is None) == (FLAGS.check is None):
        sys.exit("sim_digests: give exactly one of --write and --check")
    cfg = cp.load_config()
    expected = None
    if FLAGS.check:
        with open(FLAGS.check) as f:
            expected = json.load(f)
        only_entries(cfg, [k for k in expected if k != "capacity_request_rate"])
    try:
        cfg, workload = cp.prepare_run(cfg)
    except ValueError as e:
        sys.exit(f"sim_digests: {e}")
    got = comparison_digests(cfg, workload)
    for name in cfg.policies:
        d = got[name]
        print(f"{name:>14}: {d['num_steps']:6d} steps {d['steps'][:12]}  requests {d['requests'][:12]}")
    if FLAGS.write:
        with open(FLAGS.write, "w") as f:
            json.dump(got, f, indent=1)
            f.write("\n")
        print(f"written: {FLAGS.write}")
        return
    diff = differences(expected, got)
    for line in diff:
        print("DIFFERS", line)
    if diff:
        sys.exit(1)
    print(f"all {len(expected)} digests equal to {FLAGS.check}")


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cp.parse_flags)
