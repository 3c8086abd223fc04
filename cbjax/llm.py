"""`LLM`: the offline facade shaped like vLLM's (`LLM(model=...).generate(prompts, sampling_params)`)."""

import contextlib
from collections.abc import Sequence

from cbjax.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from cbjax.config import validation as check
from cbjax.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from cbjax.core.sampling_params import SamplingParams
from cbjax.engine import LLMEngine
from cbjax.engine_config import OFFLINE_OVERRIDES


class LLM:
    """Offline batch generation on one engine. Options are LLMEngine's keywords (policy, max_num_seqs, ...);
    `data_parallel_size` > 1 serves with that many replicas behind a router (cbjax/data_parallel.py);
    `disaggregation={"prefill": P, "decode": D}` with P prefill and D decode engines (cbjax/disaggregated.py).

    `model` is anything LLMEngine takes; None (the default) is the packaged model (cbjax/assets, nothing downloaded).
    Its defaults are EngineConfig's with OFFLINE_OVERRIDES applied (cbjax/engine_config.py: blocks of decode steps,
    num_scheduler_steps=8, where LLMEngine's default is 1); pass num_scheduler_steps=1 for one step per dispatch.
    """

    def __init__(self, model=None, *, data_parallel_size: int = 1, disaggregation=None, **engine_options):
        engine_options = OFFLINE_OVERRIDES | engine_options
        if disaggregation is not None:  # prefill and decode engines (cbjax/disaggregated.py)
            from cbjax.disaggregated import DisaggregatedEngine

            if data_parallel_size != 1:
                raise ValueError("disaggregation and data_parallel_size > 1 do not combine (use prefill/decode counts)")
            self.engine = DisaggregatedEngine(model, disaggregation=disaggregation, **engine_options)
        elif check.integer("data_parallel_size", data_parallel_size, 1) == 1:
            self.engine = LLMEngine(model, **engine_options)
        else:  # replicas behind a router; router= and router_options= go with it (cbjax/data_parallel.py)
            from cbjax.data_parallel import DataParallelEngine

            self.engine = DataParallelEngine(model, data_parallel_size=data_parallel_size, **engine_options)
        self.num_submitted = 0  # prompts submitted so far: the next one's request id

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an existing engine (e.g. one shared between tests or runs)."""
        llm = cls.__new__(cls)
        llm.engine, llm.num_submitted = engine, 0
        return llm

    def generate(
        self,
        prompts: "str | Sequence[str | Sequence[int]]",
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in order.

        Prompts are token-id lists, or text when the model has a tokenizer; then each output's `.text` is its
        decoded completion and `.prompt` the prompt text.

        All or nothing per prompt: a prompt the engine refuses (not text or a sequence of integer ids, empty,
        out-of-vocabulary ids, too long, bad SamplingParams, ...) does not stop the others: its output is finished
        with finish_reason "abort" and `.error` holding the reason. A malformed call (prompts not a list, a flat list
        of ids, a params list of another length) is a ValueError before anything is queued. Nothing of this call is
        left in the engine when it returns or raises (Ctrl-C included).
        """
        prompts, params = _prompts_and_params(prompts, sampling_params)
        check.boolean("use_tqdm", use_tqdm)
        engine = self.engine
        results: dict[str, RequestOutput] = {}
        order = []
        try:
            for prompt, sp in zip(prompts, params):
                rid = str(self.num_submitted)
                self.num_submitted += 1
                order.append(rid)
                try:
                    engine.add_request(rid, prompt, sp)
                except ValueError as e:
                    text = None if engine.tokenizer is None else ""
                    results[rid] = _refused(rid, prompt, engine.clock.now(), str(e), text)
            self._run(results, len(order), use_tqdm)
        except BaseException:
            # Ctrl-C or a failure inside a step: this call's unfinished requests must not stay queued, to be run
            # (and thrown away) by the next call.
            for rid in order:
                if rid in engine.requests and not engine.requests[rid].is_finished:
                    with contextlib.suppress(ValueError):
                        engine.abort_request(rid)
            raise
        # (The engine gives each output its text: decoded when first read, or cut at a stop string.)
        for prompt, rid in zip(prompts, order):
            if isinstance(prompt, str):
                results[rid].prompt = prompt
        return [results[rid] for rid in order]

    def beam_search(self, prompts: Sequence, params: "BeamSearchParams") -> "list[BeamSearchOutput]":
        """Beam search for each prompt, as vLLM's LLM.beam_search (cbjax/beam_search.py): one output per prompt,
        its best `params.beam_width` beams first. The beams' KV pages are forked as they branch and freed as they
        die (cbjax/core/kv_fork.py)."""
        return beam_search(self, prompts, params)

    def _run(self, results: dict[str, RequestOutput], total: int, use_tqdm: bool) -> None:
        """Step until the engine is idle, keeping every finished output."""
        engine = self.engine
        # Only finished outputs are kept: no output object per generated token (vLLM's offline generate asks for
        # final outputs only too). At 64 running sequences that was ~15% of the host's time per step.
        streamed, engine.stream_outputs = engine.stream_outputs, False
        # Nothing arrives during the call: a block's rows come at its end (streaming them costs a wait per row).
        rows, engine.stream_rows = engine.stream_rows, False
        bar = None
        try:
            if use_tqdm:
                from tqdm import tqdm

                bar = tqdm(total=total, initial=len(results), desc="generate", unit="req")
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            engine.stream_outputs, engine.stream_rows = streamed, rows
            if bar is not None:
                bar.close()


def _prompts_and_params(prompts, sampling_params) -> tuple[list, list]:
    """The call's prompts and one SamplingParams per prompt. ValueError (before anything is queued) when the call
    itself is malformed; a malformed single prompt is left for add_request to refuse, as that prompt's output."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a string or a list of prompts, got {type(prompts).__name__}")
    prompts = list(prompts)
    if prompts and all(check.is_integer(p) for p in prompts):
        raise ValueError("prompts is a flat list of token ids: pass a list of prompts, e.g. [[1, 2, 3]] for one")
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return prompts, [sampling_params or SamplingParams()] * len(prompts)
    if isinstance(sampling_params, (str, bytes)) or not isinstance(sampling_params, Sequence):
        raise ValueError(
            f"sampling_params must be SamplingParams or a list of them, got {type(sampling_params).__name__}"
        )
    if len(sampling_params) != len(prompts):
        raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
    return prompts, list(sampling_params)


def _refused(rid: str, prompt, now: float, error: str, text: str | None) -> RequestOutput:
    """The output of a prompt the engine refused: finished, finish_reason "abort", the reason in `.error`."""
    try:
        ids = check.token_ids("prompt", prompt)
    except ValueError:
        ids = []
    return RequestOutput(
        rid,
        ids,
        [CompletionOutput(0, [], [], "abort", text)],
        True,
        RequestMetrics(arrival_time=now, finished_time=now),
        error=error,
    )
