"""Training of the packaged models (experiments/train_tiny.py) on the Python standard library's own sources.

  nice -n 10 python -m experiments.train_tiny --config=configs/train_tiny.py          # tinypy (main)
  nice -n 10 python -m experiments.train_tiny --config=configs/train_tiny.py:draft    # tinypy-draft

Sized for about 20 minutes (main) and 8 minutes (draft) on a shared 2-core CPU; docs/models.md has the results.
"""

import ml_collections


def get_config(which: str = "main"):
    c = ml_collections.ConfigDict()
    c.name = "tinypy"  # cbjax/assets/<name>/ receives the exported checkpoint
    c.out_dir = ""  # "": cbjax/assets/<name>/
    c.work_dir = "/tmp/cbjax_train"  # <work_dir>/<name>/: orbax checkpoints, loss log, token cache, samples
    c.seed = 0  # model init, data order, corpus split
    # ---- corpus and tokenizer
    c.val_every = 50  # every 50th stdlib file (by sorted path) is held out for the validation loss
    c.corpus_max_mb = 0.0  # 0: every .py file of the stdlib (tests excluded); else stop after this many MB
    c.vocab_size = 4096  # byte-level BPE trained with `tokenizers`
    c.tokenizer_train_mb = 8.0  # train the BPE on the first N MB of the training files (it is the slow part)
    c.tokenizer_from = ""  # a tokenizer.json to reuse instead of training one (the draft shares the main's)
    # ---- model (Llama architecture: RMSNorm, RoPE, GQA, SwiGLU; tied embeddings keep the file small)
    # 2.4M params: on this CPU's ~20 minutes a 4M-param 4x256 model saw only 2M tokens and ended worse (val 3.49
    # nats/token) than the 0.9M-param draft after 4M tokens (3.05); at this compute, smaller and longer wins.
    c.hidden_size = 192
    c.num_layers = 4
    c.num_heads = 6  # head_dim 32
    c.num_kv_heads = 2
    c.intermediate_size = 512  # ~2.7x hidden
    c.rope_theta = 10000.0
    c.seq_len = 256  # context trained on, and the exported max_position_embeddings
    # ---- optimisation
    c.batch_size = 8  # sequences of seq_len + 1 tokens per step (small: the CPU affords few tokens, so more steps)
    c.learning_rate = 3e-3  # peak, after linear warmup; cosine decay to 10% of it
    c.warmup_steps = 30
    c.num_steps = 4000  # the run ends at num_steps or time_budget_s, whichever first; the cosine follows that
    c.time_budget_s = 19 * 60.0  # wall-clock budget of the training loop, across resumes
    c.weight_decay = 0.1
    c.grad_clip = 1.0
    # ---- bookkeeping
    c.log_every = 10  # train loss to the log every N steps
    c.eval_every = 50  # validation loss every N steps (fixed validation batches)
    c.eval_batches = 4
    c.checkpoint_every = 50  # orbax checkpoint (resumable) every N steps
    c.export_dtype = "bfloat16"  # dtype of model.safetensors in cbjax/assets
    c.figure_dir = "docs/figures"  # the loss curve PNG goes here
    c.sample_prompts = ("def fibonacci(n):", "import os\n", "class Stack:\n", "    def __init__(self")
    c.sample_tokens = 96

    if which == "draft":
        c.name = "tinypy-draft"
        c.tokenizer_from = "cbjax/assets/tinypy/tokenizer.json"  # same vocabulary: needed for speculative decoding
        c.hidden_size = 128
        c.num_layers = 2
        c.num_heads = 4
        c.num_kv_heads = 2
        c.intermediate_size = 352
        c.learning_rate = 4e-3
        c.num_steps = 2000  # ~7 minutes here
        c.time_budget_s = 8 * 60.0
    elif which != "main":
        raise ValueError(f"unknown config {which!r}: main or draft")
    return c
