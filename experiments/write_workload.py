"""Write a generated workload in the peers' JSON format, so cbjax and the peer baselines run the same requests.

  python -m experiments.write_workload --out /tmp/wl_mixed.json --kind mixed --num_requests 96 --scale 0.3

Any make_workload kind and fields (cbjax/bench/workload.py); arrival times are dropped (the peer format is
offline). Prints the request, prompt-token and output-token counts.
"""

import json

from absl import app, flags

flags.DEFINE_string("out", None, "output JSON file", required=True)
flags.DEFINE_string("kind", "mixed", "synthetic | mixed | shared_prefix")
flags.DEFINE_integer("num_requests", 96, "requests")
flags.DEFINE_float("scale", 0.3, "multiplies every generated length")
flags.DEFINE_integer("seed", 0, "workload seed")
flags.DEFINE_string("fields", "{}", "more make_workload fields as JSON (prompt_len, output_len, ...)")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    from cbjax.bench.trace_files import save_peers_json
    from cbjax.bench.workload import make_workload

    cfg = dict(kind=FLAGS.kind, num_requests=FLAGS.num_requests, scale=FLAGS.scale, seed=FLAGS.seed)
    cfg.update(json.loads(FLAGS.fields))
    requests = make_workload(cfg)
    save_peers_json(requests, FLAGS.out)
    prompt = sum(r.prompt_len for r in requests)
    output = sum(r.max_tokens for r in requests)
    print(json.dumps(dict(out=FLAGS.out, requests=len(requests), prompt_tokens=prompt, output_tokens=output)))


if __name__ == "__main__":
    app.run(main)
