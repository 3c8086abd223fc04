"""SpeculativeConfig: the `speculative_config` engine option (vLLM-shaped), checked before anything is built.

  LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                               "prompt_lookup_min": 2, "prompt_lookup_max": 4})

`num_speculative_tokens` is the most draft tokens a sequence verifies per step; `draft_length` picks how many of
them a step actually uses (draft_length.py): a fixed k, a table by batch size, or "measured" (the k that
maximises expected accepted tokens per second from the engine's own step timings).
"""

import dataclasses
from collections.abc import Mapping

from cbjax.config import validation as check

METHODS = ("ngram", "draft")
# How drafts are verified (the runner's acceptance.py): "rejection_sampling" (min(1, p/q), residual max(p - q, 0)),
# "sample_and_match" (sample p with the request's own key, accept a draft equal to it: exact for any q, the same
# tokens as without drafts, so a seeded request's output never depends on its batch, but it accepts less often
# than rejection sampling when q is not one-hot), or "auto": sample_and_match for n-gram drafts (one-hot q, where
# the two rules accept equally often), rejection_sampling for a draft model.
ACCEPTANCE_RULES = ("auto", "rejection_sampling", "sample_and_match")
DRAFT_LENGTH_RULES = ("fixed", "batch_size", "measured")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"  # ngram: prompt lookup on the host | draft: a small draft model, proposing on the device
    num_speculative_tokens: int = 4  # k: the most draft tokens per sequence and step
    prompt_lookup_min: int = 2  # ngram: the shortest suffix n-gram matched against the context
    prompt_lookup_max: int = 4  # ngram: the longest (tried first)
    # draft: the draft model's name or checkpoint directory (same vocabulary and tokenizer as the target), or a
    # built cbjax.model.Llama.
    draft_model: object = None
    # How many drafts a step uses: "fixed" (always k), "batch_size" (draft_length_table by running sequences),
    # "measured" (from acceptance and step timings measured during the run).
    draft_length: str = "fixed"
    # batch_size rule: {"1-8": 4, "9-32": 2, "33-": 0}: running sequences -> drafts (each value <= k).
    draft_length_table: tuple[tuple[int, int | None, int], ...] | None = None
    acceptance: str = "auto"  # see ACCEPTANCE_RULES
    # ngram: where a block of decode steps would run, run up to num_scheduler_steps iterations of propose, verify
    # and accept on the device in one dispatch (core/speculation/speculative_blocks.py); False: one verify step
    # per dispatch, received before the next is scheduled. None (the default): on for ngram in an engine
    # (EngineConfig resolves it, `resolved`; measured in docs/speculative.md); a scheduler given None leaves them off.
    device_blocks: bool | None = None

    def __post_init__(self):
        method = check.choice("speculative_config.method", self.method, METHODS)
        k = check.integer("speculative_config.num_speculative_tokens", self.num_speculative_tokens, 1, 64)
        lo = check.integer("speculative_config.prompt_lookup_min", self.prompt_lookup_min, 1)
        hi = check.integer("speculative_config.prompt_lookup_max", self.prompt_lookup_max, 1)
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) > prompt_lookup_max ({hi})")
        rule = check.choice("speculative_config.draft_length", self.draft_length, DRAFT_LENGTH_RULES)
        acceptance = check.choice("speculative_config.acceptance", self.acceptance, ACCEPTANCE_RULES)
        if acceptance == "auto":
            acceptance = "sample_and_match" if method == "ngram" else "rejection_sampling"
        elif acceptance == "rejection_sampling" and method == "ngram":
            raise ValueError(
                "speculative_config.acceptance='rejection_sampling' is for method='draft' (n-gram drafts "
                "are one-hot: sample_and_match is that rule, with the same acceptance)"
            )
        table = None
        if rule == "batch_size":
            if self.draft_length_table is None:
                raise ValueError("speculative_config.draft_length='batch_size' needs draft_length_table")
            table = parse_batch_table(self.draft_length_table, k)
        elif self.draft_length_table is not None:
            raise ValueError(f"speculative_config.draft_length_table is for draft_length='batch_size', not {rule!r}")
        draft = self.draft_model
        if method == "draft":
            if draft is None:
                raise ValueError("speculative_config.method='draft' needs draft_model (e.g. 'tinypy-draft')")
            if isinstance(draft, str):
                draft = check.text("speculative_config.draft_model", draft)
            elif not hasattr(draft, "cfg"):  # a built model (cbjax.model.Llama) is taken as is, like `model=`
                raise ValueError(f"speculative_config.draft_model must be a model name or path, got {draft!r}")
        elif draft is not None:
            raise ValueError("speculative_config.draft_model is for method='draft'")
        device_blocks = self.device_blocks
        if device_blocks is not None:
            device_blocks = check.boolean("speculative_config.device_blocks", device_blocks)
        if device_blocks and method != "ngram":
            raise ValueError("speculative_config.device_blocks is for method='ngram' (the device's prompt lookup)")
        for name, value in dict(
            method=method,
            num_speculative_tokens=k,
            prompt_lookup_min=lo,
            prompt_lookup_max=hi,
            draft_length=rule,
            draft_length_table=table,
            acceptance=acceptance,
            device_blocks=device_blocks,
        ).items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_option(cls, value) -> "SpeculativeConfig | None":
        """The engine option: None (off), a SpeculativeConfig, or a dict of its fields (an experiment config's
        ConfigDict too); a dict whose method is None is off (the experiment configs' default)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if hasattr(value, "to_dict"):  # ml_collections.ConfigDict
            value = value.to_dict()
        options = check.mapping("speculative_config", value)
        if "method" in options and options["method"] is None:
            return None
        unknown = set(options) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {sorted(unknown)}")
        return cls(**options)

    def resolved(self) -> "SpeculativeConfig":
        """As an engine runs it: device_blocks None made on for ngram (speculative blocks beat one verify step per
        dispatch at batch 1 against the offline default, docs/speculative.md), off for a draft model."""
        if self.device_blocks is not None:
            return self
        return dataclasses.replace(self, device_blocks=self.method == "ngram")

    @property
    def device_lookup(self) -> tuple[int, int] | None:
        """The prompt lookup (min, max) of speculative blocks on the device, or None where they are off."""
        return (self.prompt_lookup_min, self.prompt_lookup_max) if self.device_blocks else None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if self.draft_model is not None and not isinstance(self.draft_model, str):
            d["draft_model"] = repr(self.draft_model.cfg)  # a built model: its config names it in a manifest
        if self.draft_length_table is not None:
            d["draft_length_table"] = {_range_name(lo, hi): k for lo, hi, k in self.draft_length_table}
        return d


def _range_name(lo: int, hi: int | None) -> str:
    return f"{lo}-" if hi is None else f"{lo}-{hi}"


def parse_batch_table(table, k: int) -> tuple[tuple[int, int | None, int], ...]:
    """{"1-8": 4, "9-32": 2, "33-": 0} (or its parsed tuple form) -> ((1, 8, 4), (9, 32, 2), (33, None, 0)),
    ranges sorted, disjoint and covering every batch size from 1 up."""
    name = "speculative_config.draft_length_table"
    if isinstance(table, Mapping):
        rows = []
        for key, drafts in table.items():
            text = check.text(f"{name} key", key)
            lo_text, dash, hi_text = text.partition("-")
            try:
                lo, hi = int(lo_text), (int(hi_text) if hi_text.strip() else None)
            except ValueError:
                raise ValueError(f"{name}: key {key!r} is not a range like '1-8' or '33-'") from None
            if not dash:
                hi = lo
            rows.append((lo, hi, drafts))
    else:
        rows = [tuple(r) for r in table]
    rows.sort(key=lambda r: r[0])
    expected = 1
    out = []
    for lo, hi, drafts in rows:
        drafts = check.integer(f"{name}[{_range_name(lo, hi)}]", drafts, 0, k)
        if lo != expected or (hi is not None and hi < lo):
            raise ValueError(f"{name}: ranges must start at 1 and follow each other without gaps or overlaps")
        out.append((lo, hi, drafts))
        if hi is None:
            break
        expected = hi + 1
    if not out or out[-1][1] is not None or len(out) != len(rows):
        raise ValueError(f"{name}: the last range must be open ('33-'), covering every larger batch")
    return tuple(out)
