"""Tests for cbjax.bench.workload: generators, presets, loaders, clipping and config validation (arrivals and
lengths: test_arrivals.py, test_lengths.py)."""

import json
import os
import pathlib
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbjax.bench import trace_files as wf
from cbjax.bench.requests import WorkloadRequest
from cbjax.bench.workload import clip_to_max_model_len, make_workload

DATA = os.path.join(os.path.dirname(__file__), "data")

# ---------------------------------------------------------------------------------------------- make_workload


def synth(**kw):
    cfg = dict(
        kind="synthetic",
        num_requests=50,
        seed=0,
        arrival="poisson",
        request_rate=10.0,
        prompt_len=dict(dist="uniform", low=4, high=40),
        output_len=dict(dist="uniform", low=1, high=20),
    )
    cfg.update(kw)
    return cfg


def test_synthetic_requests_are_well_formed():
    reqs = make_workload(synth(vocab_size=100))
    assert len(reqs) == 50 and all(isinstance(r, WorkloadRequest) for r in reqs)
    assert [r.arrival_time for r in reqs] == sorted(r.arrival_time for r in reqs)
    assert reqs[0].arrival_time == 0.0
    ids = np.concatenate([r.prompt_token_ids for r in reqs])
    assert ids.min() >= 3 and ids.max() < 100  # special ids 0..2 avoided
    assert all(4 <= r.prompt_len <= 40 and 1 <= r.max_tokens <= 20 for r in reqs)
    assert len({r.request_id for r in reqs}) == 50
    assert all(type(t) is int for t in reqs[0].prompt_token_ids)


def test_same_seed_same_workload_different_seed_different():
    assert make_workload(synth()) == make_workload(synth())
    a, b = make_workload(synth(seed=0)), make_workload(synth(seed=1))
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in b]
    assert [r.arrival_time for r in a] != [r.arrival_time for r in b]


def test_request_rate_changes_arrivals_only():
    a, b = make_workload(synth(request_rate=1.0)), make_workload(synth(request_rate=50.0))
    assert [(r.prompt_token_ids, r.max_tokens) for r in a] == [(r.prompt_token_ids, r.max_tokens) for r in b]
    assert a[-1].arrival_time > 10 * b[-1].arrival_time


def test_config_objects_by_attribute_or_item():
    as_dict = make_workload(synth())
    ns = synth()
    ns["prompt_len"] = types.SimpleNamespace(**ns["prompt_len"])
    assert make_workload(types.SimpleNamespace(**ns)) == as_dict
    mc = pytest.importorskip("ml_collections")
    assert make_workload(mc.ConfigDict(synth())) == as_dict
    assert make_workload(mc.FrozenConfigDict(synth())) == as_dict


def test_bare_int_length_means_fixed():
    reqs = make_workload(synth(prompt_len=12, output_len=3))
    assert {(r.prompt_len, r.max_tokens) for r in reqs} == {(12, 3)}


def test_length_class_by_threshold():
    reqs = make_workload(synth(prompt_len=dict(dist="uniform", low=1, high=60), output_len=10, long_threshold=40))
    assert all(r.length_class == ("long" if r.prompt_len + 10 > 40 else "short") for r in reqs)
    assert {r.length_class for r in reqs} == {"short", "long"}


def test_deadline_s():
    reqs = make_workload(synth(deadline_s=2.5))
    assert all(r.deadline == pytest.approx(r.arrival_time + 2.5) for r in reqs)


def test_tenant_priority_sets_the_priority_of_listed_tenants():
    reqs = make_workload(dict(kind="mixed", num_requests=60, seed=0, tenant_priority=dict(chat=0, rag=2)))
    assert {(r.tenant, r.priority) for r in reqs} == {("chat", 0), ("rag", 2), ("code", 0)}
    with pytest.raises(ValueError, match="tenant_priority"):
        make_workload(dict(kind="mixed", num_requests=5, tenant_priority=dict(chat="high")))


# ---------------------------------------------------------------------------------------------- presets


def test_mixed_preset_fractions_lengths_and_classes():
    reqs = make_workload(dict(kind="mixed", num_requests=1000, seed=0))
    by = {name: [r for r in reqs if r.tenant == name] for name in ("chat", "rag", "code")}
    for name, frac in (("chat", 0.60), ("rag", 0.25), ("code", 0.15)):
        assert len(by[name]) / 1000 == pytest.approx(frac, abs=0.01)
    med = {
        name: (np.median([r.prompt_len for r in rs]), np.median([r.max_tokens for r in rs])) for name, rs in by.items()
    }
    assert med["chat"] == pytest.approx((256, 128), rel=0.1)
    assert med["rag"] == pytest.approx((2048, 128), rel=0.1)
    assert med["code"] == pytest.approx((512, 1024), rel=0.1)
    assert {r.length_class for r in by["chat"]} == {"short"}
    assert {r.length_class for r in by["rag"] + by["code"]} == {"long"}
    # the components are interleaved, not in blocks
    assert {r.tenant for r in reqs[:50]} == {"chat", "rag", "code"}


def test_mixed_preset_small_n_has_exact_mix():
    reqs = make_workload(dict(kind="mixed", num_requests=20, seed=5))
    assert sorted(r.tenant for r in reqs).count("chat") == 12
    assert sum(r.tenant == "rag" for r in reqs) == 5 and sum(r.tenant == "code" for r in reqs) == 3


def test_mixed_scale_shrinks_every_length():
    full = make_workload(dict(kind="mixed", num_requests=400, seed=0))
    small = make_workload(dict(kind="mixed", num_requests=400, seed=0, scale=0.125))
    assert [r.tenant for r in small] == [r.tenant for r in full]
    rag = [r for r in small if r.tenant == "rag"]
    assert np.median([r.prompt_len for r in rag]) == pytest.approx(256, rel=0.1)
    assert max(r.prompt_len for r in rag) <= 512 and min(r.prompt_len for r in rag) >= 96
    assert sum(r.prompt_len + r.max_tokens for r in small) < 0.15 * sum(r.prompt_len + r.max_tokens for r in full)


def test_shared_prefix_shares_exactly_the_prefix():
    reqs = make_workload(
        dict(
            kind="shared_prefix",
            num_requests=60,
            seed=0,
            num_prefixes=3,
            prefix_len=16,
            prompt_len=dict(dist="uniform", low=4, high=8),
            output_len=5,
            tenant_per_prefix=True,
        )
    )
    groups = {}
    for r in reqs:
        assert 20 <= r.prompt_len <= 24
        groups.setdefault(r.tenant, []).append(r)
    assert sorted(groups) == ["prefix-0", "prefix-1", "prefix-2"]
    prefixes = set()
    for rs in groups.values():
        assert len(rs) >= 5
        heads = {r.prompt_token_ids[:16] for r in rs}
        assert len(heads) == 1
        prefixes |= heads
        suffixes = [r.prompt_token_ids[16:] for r in rs]
        assert len(set(suffixes)) == len(suffixes)  # every suffix is the request's own
        assert len({s[0] for s in suffixes}) > 1  # the shared part stops at the prefix
    assert len(prefixes) == 3
    default = make_workload(
        dict(kind="shared_prefix", num_requests=5, num_prefixes=2, prefix_len=4, prompt_len=2, output_len=2)
    )
    assert {r.tenant for r in default} == {"default"}


# ---------------------------------------------------------------------------------------------- max_model_len


def test_clip_rules():
    r = WorkloadRequest("r", 0.0, tuple(range(3, 13)), 20, prompt="text")
    assert clip_to_max_model_len(r, 40) is r
    assert clip_to_max_model_len(r, 25).max_tokens == 15 and clip_to_max_model_len(r, 25).prompt == "text"
    c = clip_to_max_model_len(r, 8)
    assert c.prompt_token_ids == tuple(range(3, 10)) and c.max_tokens == 1 and c.prompt is None
    with pytest.raises(ValueError, match="max_model_len"):
        clip_to_max_model_len(r, 1)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(1, 300), st.integers(2, 400))
def test_clip_invariant(p, o, m):
    c = clip_to_max_model_len(WorkloadRequest("r", 0.0, tuple([5] * p), o), m)
    assert c.prompt_len + c.max_tokens <= m and c.max_tokens >= 1
    assert c.prompt_len == min(p, m - 1) and c.max_tokens == min(o, m - c.prompt_len)


def test_make_workload_clips_to_max_model_len():
    kw = dict(prompt_len=dict(dist="uniform", low=50, high=200), output_len=dict(dist="uniform", low=50, high=150))
    raw, clipped = make_workload(synth(**kw)), make_workload(synth(max_model_len=128, **kw))
    assert all(r.prompt_len + r.max_tokens <= 128 for r in clipped)
    assert any(r.prompt_len == 127 and r.max_tokens == 1 for r in clipped)
    for a, b in zip(raw, clipped):
        assert a.prompt_token_ids[: b.prompt_len] == b.prompt_token_ids


# ---------------------------------------------------------------------------------------------- loaders


def test_jsonl_trace_replay():
    reqs = make_workload(dict(kind="jsonl", path=os.path.join(DATA, "trace.jsonl")))
    assert [r.request_id for r in reqs] == ["b", "a", "req-2"]
    b, a, c = reqs
    assert (b.arrival_time, a.arrival_time, c.arrival_time) == (0.0, 0.5, 2.0)
    assert a.prompt_token_ids == (5, 6, 7, 8) and a.max_tokens == 4 and (a.tenant, a.priority) == ("t1", 2)
    assert b.prompt == "abcdefghij" and b.prompt_len == 3 and b.max_tokens == 2  # ceil(10 chars / 4)
    assert c.deadline == 3.0 and c.length_class == "long" and a.length_class == "short"


def test_jsonl_with_tokenizer_and_generated_arrivals():
    path = os.path.join(DATA, "trace.jsonl")
    reqs = make_workload(dict(kind="jsonl", path=path, arrival="offline"), tokenize=lambda s: [ord(ch) for ch in s])
    assert [r.request_id for r in reqs] == ["a", "b", "req-2"]  # file order, all at t=0
    assert reqs[1].prompt_token_ids == tuple(ord(ch) for ch in "abcdefghij")
    assert reqs[2].deadline == 1.0  # the 1 s slack moves with the arrival
    assert len(make_workload(dict(kind="jsonl", path=path, num_requests=2))) == 2
    with pytest.raises(ValueError, match="num_requests=4"):
        make_workload(dict(kind="jsonl", path=path, num_requests=4))


def test_save_jsonl_replays_exactly(tmp_path):
    reqs = make_workload(synth(deadline_s=1.0, long_threshold=30))
    reqs[0] = WorkloadRequest(reqs[0].request_id, 0.0, reqs[0].prompt_token_ids, 3, prompt="hi", priority=-1)
    path = tmp_path / "w.jsonl"
    wf.save_jsonl(reqs, path)
    assert make_workload(dict(kind="jsonl", path=str(path))) == reqs


def test_peers_json_roundtrip(tmp_path):
    reqs = make_workload(dict(kind="peers_json", path=os.path.join(DATA, "peers.json")))
    assert [(r.request_id, r.prompt_token_ids, r.max_tokens, r.arrival_time) for r in reqs] == [
        ("req-0", (3, 4, 5), 2, 0.0),
        ("req-1", (31999, 7), 5, 0.0),
    ]
    wf.save_peers_json(reqs, tmp_path / "p.json")
    assert json.loads((tmp_path / "p.json").read_text()) == json.loads(pathlib.Path(DATA, "peers.json").read_text())
    with pytest.raises(ValueError, match=r"entry 1: 'prompt_token_ids'\[0\] = 31999 is out of range"):
        make_workload(dict(kind="peers_json", path=os.path.join(DATA, "peers.json"), vocab_size=1000))


def test_sharegpt():
    path = os.path.join(DATA, "sharegpt.json")
    reqs = make_workload(dict(kind="sharegpt", path=path))
    assert [r.request_id for r in reqs] == ["sharegpt-0", "sharegpt-2"]  # entry 1 has no reply
    # "Hello there, how are you?" is 25 chars -> 7 tokens; "Fine, thanks." 13 -> 4; "Why?" -> 1; the reply 43 -> 11
    assert [(r.prompt_len, r.max_tokens) for r in reqs] == [(7, 4), (1, 11)]
    assert reqs[0].prompt == "Hello there, how are you?"
    words = make_workload(
        dict(kind="sharegpt", path=path, arrival="poisson", request_rate=1.0),
        tokenize=lambda s: list(range(3, 3 + len(s.split()))),
    )
    assert [(r.prompt_len, r.max_tokens) for r in words] == [(5, 2), (1, 9)]
    assert words[1].arrival_time > 0


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


GOOD = '{"arrival_time": 0, "prompt_token_ids": [5], "max_tokens": 1}\n'


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"prompt_token_ids": [5], "max_tokens": 1}', "missing 'arrival_time'"),
        ('{"arrival_time": "x", "prompt_token_ids": [5], "max_tokens": 1}', "'arrival_time' must be a finite number"),
        ('{"arrival_time": 1, "max_tokens": 1}', "missing 'prompt_token_ids' or 'prompt'"),
        ('{"arrival_time": 1, "prompt_token_ids": [], "max_tokens": 1}', "non-empty list"),
        ('{"arrival_time": 1, "prompt_token_ids": [5, -1], "max_tokens": 1}', r"'prompt_token_ids'\[1\]"),
        ('{"arrival_time": 1, "prompt_token_ids": [5], "max_tokens": 0}', "'max_tokens' must be an int >= 1"),
        ('{"arrival_time": 1, "prompt_token_ids": [5], "output_len": 2.5}', "'output_len' must be an int"),
        ('{"arrival_time": 1, "prompt_token_ids": [5]}', "missing 'max_tokens'"),
        ('{"arrival_time": 1, "prompt": 7, "max_tokens": 1}', "'prompt' must be a string"),
        ('{"arrival_time": 1, "prompt": "x", "max_tokens": 1, "priority": "high"}', "'priority' must be an int"),
        ('{"arrival_time": 1, "prompt": "x", "max_tokens": 1, "length_class": "huge"}', "'length_class'"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path, bad_line, message):
    path = _write(tmp_path, "bad.jsonl", GOOD + "\n" + bad_line + "\n" + GOOD)
    with pytest.raises(ValueError, match=message) as e:
        make_workload(dict(kind="jsonl", path=path))
    assert f"{path}, line 3:" in str(e.value)


def test_duplicate_request_id_is_an_error(tmp_path):
    line = '{"request_id": "x", "arrival_time": 0, "prompt_token_ids": [5], "max_tokens": 1}\n'
    path = _write(tmp_path, "dup.jsonl", line + line)
    with pytest.raises(ValueError, match=r"line 2: duplicate request_id 'x' \(first on line 1\)"):
        wf.load_jsonl(path)


@pytest.mark.parametrize(
    "entry, message",
    [
        ('"hi"', "expected an object"),
        ('{"max_new_tokens": 3}', "missing 'prompt_token_ids'"),
        ('{"prompt_token_ids": [3, "a"], "max_new_tokens": 3}', r"'prompt_token_ids'\[1\]"),
        ('{"prompt_token_ids": [3], "max_new_tokens": true}', "'max_new_tokens' must be an int >= 1"),
    ],
)
def test_malformed_peers_entry_names_file_and_index(tmp_path, entry, message):
    path = _write(tmp_path, "bad.json", '[{"prompt_token_ids": [3], "max_new_tokens": 1}, ' + entry + "]")
    with pytest.raises(ValueError, match=message) as e:
        wf.load_peers_json(path)
    assert f"{path}, entry 1:" in str(e.value)


@pytest.mark.parametrize(
    "entry",
    [
        '{"conversation": []}',
        '{"conversations": [{"from": "human"}]}',
        '{"conversations": [{"from": "human", "value": "q"}, "a"]}',
    ],
)
def test_malformed_sharegpt_entry_names_file_and_index(tmp_path, entry):
    good = '{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}'
    path = _write(tmp_path, "bad.json", f"[{good}, {good}, {entry}]")
    with pytest.raises(ValueError, match=f"{path}, entry 2:"):
        wf.load_sharegpt(path)


def test_invalid_json_file_names_file(tmp_path):
    path = _write(tmp_path, "bad.json", '[{"prompt_token_ids": [3],\n "max_new_tokens": }]')
    with pytest.raises(ValueError, match=f"{path}: invalid JSON at line 2"):
        wf.load_peers_json(path)
    path = _write(tmp_path, "obj.json", '{"a": 1}')
    with pytest.raises(ValueError, match="expected a JSON list"):
        wf.load_sharegpt(path)


def test_arrival_trace_for_generated_workload(tmp_path):
    path = _write(tmp_path, "times.jsonl", '100.0\n{"timestamp": 101.5}\n{"arrival_time": 100.25}\n')
    reqs = make_workload(synth(num_requests=3, arrival="trace", path=path))
    assert [r.arrival_time for r in reqs] == [0.0, 0.25, 1.5]
    with pytest.raises(ValueError, match="fewer than num_requests=4"):
        make_workload(synth(num_requests=4, arrival="trace", path=path))
    bad = _write(tmp_path, "bad_times.jsonl", '1.0\n"soon"\n')
    with pytest.raises(ValueError, match=f"{bad}, line 2: arrival time must be a finite number"):
        make_workload(synth(num_requests=2, arrival="trace", path=bad))


# ---------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "override, message",
    [
        (dict(kind=None), "kind is required"),
        (dict(kind="random"), "kind must be one of"),
        (dict(num_requests=0), "num_requests must be >= 1"),
        (dict(num_requests=2.5), "num_requests must be an integer"),
        (dict(num_requests=None), "num_requests is required"),
        (dict(seed=-1), "seed must be >= 0"),
        (dict(arrival="bursty"), "arrival must be one of"),
        (dict(request_rate=None), "request_rate is required"),
        (dict(request_rate=-1.0), "request_rate must be > 0"),
        (dict(arrival="gamma", burstiness=0), "burstiness must be > 0"),
        (dict(vocab_size=3), "low_id must be < vocab_size"),
        (dict(prompt_len=None), "prompt_len is required"),
        (dict(prompt_len=dict(dist="zipf")), r"prompt_len\.dist must be one of"),
        (dict(prompt_len=dict(dist="fixed")), r"prompt_len\.value is required"),
        (dict(output_len=dict(dist="uniform", low=5, high=2)), r"output_len\.high must be >= output_len\.low"),
        (dict(output_len=dict(dist="lognormal", median=10)), r"output_len\.sigma is required"),
        (dict(output_len=dict(dist="lognormal", median=10, mean=10, sigma=1)), "exactly one of"),
        (dict(output_len=dict(dist="lognormal", median=-3, sigma=1)), r"output_len\.median must be > 0"),
        (dict(output_len=dict(dist="lognormal", median=10, sigma=1, min=20, max=10)), r"output_len\.max must be >= "),
        (dict(output_len=dict(dist="fixed", value=3, maximum=5)), r"output_len: unknown field\(s\) \['maximum'\]"),
        (dict(output_len="long"), "output_len must be a length spec"),
        (dict(output_len=0), "output_len must be >= 1"),
        (dict(max_model_len=1), "max_model_len must be >= 2"),
        (dict(scale=0), "scale must be > 0"),
        (dict(deadline_s=-1), "deadline_s must be > 0"),
        (dict(requst_rate=5.0), r"unknown field\(s\) \['requst_rate'\]"),
        (dict(arrival="trace"), "path is required"),
        (dict(kind="shared_prefix"), "prefix_len is required"),
        (dict(kind="shared_prefix", prefix_len=4, num_prefixes=0), "num_prefixes must be >= 1"),
        (dict(kind="jsonl", path=None), "path is required for kind='jsonl'"),
        (dict(kind="sharegpt", path="x.json", arrival="trace"), "arrival='trace' is not available"),
        (dict(kind="peers_json", path="x.json", scale=0.5), "scale applies to generated workloads and production"),
    ],
)
def test_invalid_config_names_the_field(override, message):
    with pytest.raises(ValueError, match=message):
        make_workload(synth(**override))


def test_missing_file_is_reported():
    with pytest.raises(FileNotFoundError):
        make_workload(dict(kind="peers_json", path=os.path.join(DATA, "nope.json")))
