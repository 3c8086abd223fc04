"""Multi-host: two processes joined by jax.distributed on localhost (CPU collectives over gloo), one device each,
run one engine with tensor_parallel_size=2 over both; each process's scheduler sees the same requests in the same
order and makes the same decisions, and both produce exactly one process's greedy tokens."""

import json
import os
import socket
import subprocess
import sys

from cbjax import LLM
from cbjax.model import get_model_config, init_model
from tests.helpers import ROOT, random_workload

OPTS = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, num_pages=40, max_model_len=96)
WORKLOAD = dict(n=8, seed=3, vocab=512, prompt_range=(1, 60), max_tokens_range=(1, 20))

SCRIPT = """
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address="localhost:{port}", num_processes=2, process_id={pid})
from cbjax import LLM
from cbjax.model import get_model_config, init_model
from tests.helpers import random_workload
model = init_model(get_model_config("test-tiny"), seed=0)
prompts, params = random_workload(**{workload!r})
llm = LLM(model, tensor_parallel_size=2, warmup="full", **{opts!r})
warm = llm.engine.num_compiles
tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
report = dict(
    tokens=tokens,
    free=llm.engine.scheduler.pool.num_free,
    compiles_after_warmup=llm.engine.num_compiles - warm,
    devices=[d.id for d in llm.engine.runner.mesh.devices.flat],
    local=[d.id for d in jax.local_devices()],
)
print("REPORT " + json.dumps(report), flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_generate_one_processes_tokens():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT.format(port=port, pid=pid, workload=WORKLOAD, opts=OPTS)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    reports = [json.loads(out.split("REPORT ", 1)[1]) for out, _ in outs]

    model = init_model(get_model_config("test-tiny"), seed=0)
    prompts, params = random_workload(**WORKLOAD)
    want = [o.outputs[0].token_ids for o in LLM(model, **OPTS).generate(prompts, params)]
    for pid, r in enumerate(reports):
        assert r["tokens"] == want, pid
        assert r["free"] == OPTS["num_pages"] and r["compiles_after_warmup"] == 0
        assert len(r["devices"]) == 2 and len(r["local"]) == 1  # the mesh spans both processes
    assert reports[0]["local"] != reports[1]["local"]
