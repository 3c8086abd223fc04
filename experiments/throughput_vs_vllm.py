"""Offline throughput of cbjax against vLLM-CPU, in rounds, written as a data file for the docs.

  python -m experiments.throughput_vs_vllm --workloads wl64.json --models llama-tiny=tiny-llama \\
      llama-small=small-llama --dtypes float32 --rounds 3 --peers /tmp/peers \\
      --doc_data docs/data/throughput_vs_vllm_DATE.json [--lock /tmp/cbjax-cpu.lock]

Each round runs, for every (workload, model, dtype), one process of `python -m experiments.throughput` and then one
of the peers' `bench_vllm.py --warmup` (../shared/peers/README.md) on the same workload; vLLM's `--dtype` is the
dtype, cbjax's `--matmul_dtype bfloat16` stands for bfloat16. A round of one comparison holds `--lock` (an flock
shared with the other measurements on this machine) from its cbjax process to the end of its vLLM process, so both
sides see the same minute. Every process is one run of the data file (`workload`, `model`, `dtype`, `engine`,
`round`, `output_throughput` = its `output_tok_per_s`, `wall_s`, the load average before and after, and its whole
JSON line as `result`); the file is rewritten after every round, so an interrupted sitting keeps what it measured.
The table: the view `ab` by workload, model and dtype, side `engine` (docs/benchmarks.md).

`--also_cbjax NAME=ITEM[,ITEM...]` adds, in every round, one more cbjax process (engine `NAME`), between cbjax's
and vLLM's and under the same lock; an ITEM `VAR=VALUE` sets an environment variable, an ITEM `--flag=value` adds
a flag of experiments.throughput. E.g. the previous tree's path through an env switch, `cbjax-xla=CBJAX_MATMUL=xla`
(XLA's dot instead of the packed kernel), or another setting, `cbjax-kv-bf16=--kv_cache_dtype=bfloat16`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from experiments.measurement_lock import held

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_SCRIPTS = os.path.join(os.path.dirname(HERE), "shared", "peers")
WHAT = "offline output tok/s of cbjax and vLLM-CPU, one process per engine and round, cbjax first"


def last_json_line(text: str) -> dict:
    """The last line of a process's stdout that is a JSON object (its result; logs come before it)."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the output:\n" + text[-2000:])


def cbjax_command(workload: str, model: str, dtype: str) -> list[str]:
    cmd = [sys.executable, "-m", "experiments.throughput", "--workload", workload, "--model", model]
    return cmd + (["--matmul_dtype", "bfloat16"] if dtype == "bfloat16" else [])


def vllm_command(peers: str, workload: str, peer_model: str, dtype: str) -> list[str]:
    python = os.path.join(peers, "venv-vllm", "bin", "python")
    script = os.path.join(PEER_SCRIPTS, "bench_vllm.py")
    return [python, script, "--workload", workload, "--model", os.path.join(peers, peer_model), "--warmup",
            "--dtype", dtype]  # fmt: skip


def run_process(cmd: list[str], env: dict, timeout: float) -> dict:
    """One measured process: its JSON line, with the load average before and after it."""
    before = os.getloadavg()[0]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE, timeout=timeout, check=False)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-3000:]}")
    result = last_json_line(r.stdout)
    return {
        "result": result,
        "load_average_before": round(before, 2),
        "load_average_after": round(os.getloadavg()[0], 2),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", required=True, help="peers-format workload files; label: file stem")
    ap.add_argument("--models", nargs="+", required=True, help="CBJAX_MODEL=PEER_MODEL_DIR (under --peers)")
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--peers", default=os.environ.get("PEER_DIR", "/tmp/peers"), help="setup.sh's PEER_DIR")
    ap.add_argument("--lock", default=None, help="flock held for each round of one comparison")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one process may take")
    ap.add_argument("--doc_data", required=True, help="the data file to write (docs/data/*.json)")
    ap.add_argument("--also_cbjax", nargs="*", default=[], help="NAME=ITEM[,ITEM]: another cbjax side (docstring)")
    args = ap.parse_args(argv)
    from cbjax.bench.doc_data import write_doc_data

    models = [m.split("=", 1) for m in args.models]
    workloads = {}  # label -> what the file holds (the processes get its absolute path)
    for path in args.workloads:
        with open(path) as f:
            wl = json.load(f)
        workloads[os.path.splitext(os.path.basename(path))[0]] = dict(
            path=os.path.abspath(path),
            requests=len(wl),
            prompt_tokens=sum(len(w["prompt_token_ids"]) for w in wl),
            output_tokens=sum(w["max_new_tokens"] for w in wl),
        )
    env_cbjax = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    env_vllm = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "PEER_DIR": args.peers}
    also = {}  # engine name -> (its extra flags, its environment)
    for spec in args.also_cbjax:
        name, _, items = spec.partition("=")
        items = [i for i in items.split(",") if i]
        extra = [i for i in items if i.startswith("--")]
        pairs = [i.split("=", 1) for i in items if not i.startswith("--")]
        if not name or not items or any(len(p) != 2 for p in pairs) or name in ("cbjax", "vllm"):
            raise ValueError(f"--also_cbjax takes NAME=VAR=VALUE|--flag=value[,...], got {spec!r}")
        also[name] = (extra, {**env_cbjax, **dict(pairs)})
    command = (
        f"python -m experiments.throughput_vs_vllm --workloads {' '.join(args.workloads)} --models "
        f"{' '.join(args.models)} --dtypes {' '.join(args.dtypes)} --rounds {args.rounds} --peers {args.peers}"
        + (f" --also_cbjax {' '.join(args.also_cbjax)}" if args.also_cbjax else "")
    )
    commands = {
        "cbjax": "python -m experiments.throughput --workload WL.json --model MODEL [--matmul_dtype bfloat16]",
        "vllm": "VLLM_CPU_NUM_OF_RESERVED_CPU=0 $PEERS/venv-vllm/bin/python ../shared/peers/bench_vllm.py "
        "--workload WL.json --model $PEERS/PEER_MODEL --warmup --dtype DTYPE",
    }
    runs = []
    for rnd in range(1, args.rounds + 1):
        for label, wl_info in workloads.items():
            workload = wl_info["path"]
            for model, peer_model in models:
                for dtype in args.dtypes:
                    sides = {
                        "cbjax": (cbjax_command(workload, model, dtype), env_cbjax),
                        **{n: (cbjax_command(workload, model, dtype) + extra, env) for n, (extra, env) in also.items()},
                        "vllm": (vllm_command(args.peers, workload, peer_model, dtype), env_vllm),
                    }
                    with held(args.lock):
                        for engine, (cmd, env) in sides.items():
                            m = run_process(cmd, env, args.timeout)
                            r = m["result"]
                            run = dict(workload=label, model=model, peer_model=peer_model, dtype=dtype, engine=engine,
                                       round=rnd, output_throughput=r["output_tok_per_s"], wall_s=r["wall_s"],
                                       output_tokens=r["output_tokens"], setup_s=r.get("setup_s"), **m)  # fmt: skip
                            runs.append(run)
                            print(json.dumps({k: v for k, v in run.items() if k != "result"}), flush=True)
                    write_doc_data(
                        args.doc_data, command=command, runs=runs, commands=commands, what=WHAT, workloads=workloads
                    )


if __name__ == "__main__":
    main()
