"""`keel.LLM`: offline batch generation on the engine (vLLM's `LLM` shape)."""

from __future__ import annotations

import dataclasses

from tqdm import tqdm

from keel.serve.config import EngineConfig
from keel.serve.engine import LLMEngine
from keel.serve.generation_config import sampling_defaults
from keel.serve.outputs import RequestOutput
from keel.serve.sampling import RequestOutputKind, SamplingParams
from keel.weights.checkpoint import LoadedModel


class LLM:
    """LLM(model).generate(prompts, params) -> one RequestOutput per prompt, in input order."""

    def __init__(
        self,
        model: str | LoadedModel,
        config: EngineConfig | None = None,
        *,
        adapt: bool = False,
        generation_config: str = "auto",
        **config_kwargs,
    ) -> None:
        """adapt: rewrite a LoadedModel for serving as the engine does a model it loads (LLMEngine's `adapt`).
        generation_config: where the default sampling parameters come from, as `keel serve --generation-config`
        (auto: the model directory's generation_config.json; vllm: none; or a folder)."""
        if config is None:
            config = EngineConfig.of(**config_kwargs)
        elif config_kwargs:
            raise TypeError("LLM: give an EngineConfig or options by name, not both")
        # read first: a bad file fails before the model loads (a LoadedModel has no directory: "auto" finds none)
        self.default_sampling = sampling_defaults(model if isinstance(model, str) else None, generation_config)
        self.engine = LLMEngine(model, config, adapt=adapt)

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams `generate` uses when given none: the model's generation_config.json values over
        SamplingParams' defaults (vLLM's LLM.get_default_sampling_params)."""
        return SamplingParams(**self.default_sampling)

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt (text, or token ids)
        params_list = (
            params if isinstance(params, list) else [params or self.get_default_sampling_params()] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        # Only finished outputs are read here (vLLM's LLM asks the same): no per-step output of any request.
        params_list = [dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY) for sp in params_list]
        ids = [
            self.engine.add_request(p, sp, priority=(priority[i] if priority else 0))
            for i, (p, sp) in enumerate(zip(prompts, params_list, strict=True))
        ]
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[i] for i in ids]
