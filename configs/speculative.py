"""Speculative decoding in the policy comparison: fcfs without speculation, with n-gram drafts (k = 4), with the
packaged draft model (tinypy-draft, k = 4), and with the adaptive draft lengths (by batch size, for n-gram and the
draft model; from measured acceptance and step cost), on tinypy completing held-out Python code
(docs/speculative.md).

  python -m experiments.compare_policies --config=configs/speculative.py

The workload file holds 96 code prompts of 160 tokens from the held-out standard-library files, 64 tokens each
(python -m experiments.speculative --write_workload=docs/data/spec_code_prompts.jsonl); Poisson arrivals.
Every field not set here is base.py's (see the comments there).
"""

import os

from cbjax.bench.config_files import sibling_config

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NGRAM = dict(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
_DRAFT = dict(method="draft", num_speculative_tokens=4, draft_model="tinypy-draft")


def get_config():
    c = sibling_config(__file__, "base.py")
    c.run_name = "speculative"  # results/speculative/
    c.model = "tinypy"  # the packaged code model (its tokenizer made the workload's ids)
    c.policies = ("fcfs", "fcfs_ngram", "fcfs_draft", "fcfs_adaptive", "fcfs_draft_adaptive", "fcfs_measured")
    c.variants.fcfs_ngram = dict(policy="fcfs", speculative_config=_NGRAM)
    c.variants.fcfs_draft = dict(policy="fcfs", speculative_config=_DRAFT)
    # k by running sequences: drafts while the device has compute to spare, none in big batches.
    table = ((1, 8, 4), (9, 32, 2), (33, None, 0))  # = {"1-8": 4, "9-32": 2, "33-": 0}
    c.variants.fcfs_adaptive = dict(
        policy="fcfs", speculative_config=dict(_NGRAM, draft_length="batch_size", draft_length_table=table)
    )
    c.variants.fcfs_draft_adaptive = dict(
        policy="fcfs", speculative_config=dict(_DRAFT, draft_length="batch_size", draft_length_table=table)
    )
    c.variants.fcfs_measured = dict(policy="fcfs", speculative_config=dict(_NGRAM, draft_length="measured"))
    c.engine.max_num_seqs = 32
    c.engine.max_num_batched_tokens = 256
    c.engine.max_model_len = 224  # 160 prompt + 64 output tokens (tinypy: 256 positions)
    c.engine.num_pages = 512
    c.workload.kind = "jsonl"
    c.workload.path = os.path.join(_ROOT, "docs", "data", "spec_code_prompts.jsonl")
    c.workload.arrival = "poisson"
    c.workload.request_rate = 8.0
    c.workload.num_requests = 96
    c.workload.scale = 1.0
    return c
