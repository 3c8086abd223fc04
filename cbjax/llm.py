"""`LLM`: the offline facade shaped like vLLM's (`LLM(model=...).generate(prompts, sampling_params)`)."""

from collections.abc import Sequence

from cbjax.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from cbjax.core.sampling_params import SamplingParams
from cbjax.engine import LLMEngine


class LLM:
    """Offline batch generation on one engine. Options are LLMEngine's keywords (policy, max_num_seqs, ...).

    `model` is anything LLMEngine takes; None (the default) is the packaged model (cbjax/assets, nothing downloaded).
    """

    def __init__(self, model=None, **engine_options):
        self.engine = LLMEngine(model, **engine_options)
        self._counter = 0

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an existing engine (e.g. one shared between tests or runs)."""
        llm = cls.__new__(cls)
        llm.engine, llm._counter = engine, 0
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

        A prompt the engine refuses (empty, out-of-vocabulary ids, too long, ...) does not stop the others: its
        output is finished with finish_reason "abort" and `.error` holding the reason.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        engine = self.engine
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, sp in zip(prompts, params):
            rid = str(self._counter)
            self._counter += 1
            order.append(rid)
            try:
                engine.add_request(rid, prompt, sp)
            except ValueError as e:
                now = engine.clock.now()
                results[rid] = RequestOutput(
                    rid,
                    list(prompt) if not isinstance(prompt, str) else [],
                    [CompletionOutput(0, [], [], "abort")],
                    True,
                    RequestMetrics(arrival_time=now, finished_time=now),
                    error=str(e),
                )
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(order), desc="generate", unit="req")
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        tok = getattr(engine, "tokenizer", None)
        for prompt, rid in zip(prompts, order):
            out = results[rid]
            if isinstance(prompt, str):
                out.prompt = prompt
            if tok is not None:
                for c in out.outputs:
                    c.text = tok.decode(c.token_ids)
        return [results[rid] for rid in order]
