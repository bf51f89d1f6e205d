"""The offline API: `LLM(model=PATH, **options).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import replace

from tqdm.auto import tqdm

from tandem.workers.config import EngineConfig
from tandem.workers.core.request import RequestOutput, SamplingParams
from tandem.workers.engine.builder import build_engine
from tandem.workers.engine.prompts import Prompt
from tandem.workers.text.tokenizer import apply_chat_template


class LLM:
    """Generate offline from a local Hugging Face model directory (the demo model by default)."""

    def __init__(self, model: str | None = None, **options) -> None:
        self.config = EngineConfig.from_options(model=model, **options)
        self.engine = build_engine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        # The engine's insides hold reference cycles, which would keep its weights and KV cache
        # (device memory, workers) until some later garbage collection: the LLM's last
        # reference going away shuts the engine down at once, as shutdown() does.
        self._shutdown = weakref.finalize(self, self.engine.shutdown)
        self._shutdown.atexit = False  # at exit the process's end frees it all anyway

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        ids = [str(next(self._ids)) for _ in prompts]
        for request_id, prompt, p in zip(ids, prompts, params):
            # Only finished outputs are returned: the engine builds no output (and decodes no
            # text) for a request until it finishes.
            self.engine.add_request(request_id, prompt, replace(p, output_kind="final"))
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.tokenizer(apply_chat_template(self.tokenizer, c),
                                                       add_special_tokens=False).input_ids}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm, leave=False)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]

    def shutdown(self) -> None:
        """Give back the device memory and the workers now (idempotent)."""
        self._shutdown()
