"""Offline inference API, shaped like vLLM's ``LLM`` so users can switch.

Drives the same ``EngineCore`` the server uses, in-process (no ZMQ); tokenization, the chat
template and output processing (detokenization, stop strings, logprobs: ``OutputProcessor``)
are the frontend's own classes, called synchronously after each engine step.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from radixserve.config import EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.engine_types import fan_out
from radixserve.frontend.generation_config import log_sampling_defaults, sampling_defaults
from radixserve.frontend.output_processor import OutputProcessor, RequestState
from radixserve.frontend.tokenizer import FrontendTokenizer
from radixserve.model_executor.factory import build_runner
from radixserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from radixserve.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    Args:
        model: Hugging Face folder, GGUF file, or None for the default SmolLM2-135M-Instruct.
        dtype: "auto", "float32", "bfloat16" or "float16".
        page_size: tokens per KV page.
        num_pages: KV pages (None: sized from ``kv_cache_memory`` bytes).
        max_num_seqs: most requests per step.
        max_num_batched_tokens: token budget per step (decodes + prefill chunks).
        max_model_len: longest sequence in tokens (None: the model's context length).
        enable_prefix_caching: radix prefix cache on (default) or the naive cache.
        seed: seed for requests without their own.
        **kwargs: any other ``EngineConfig`` field (device, schedule_policy, ...).

    Raises:
        ValueError: bad argument, missing/unreadable model or unsupported architecture.
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", page_size: int = 16,
                 num_pages: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, seed: int = 0, **kwargs: Any) -> None:
        from radixserve.model_executor.loader import load_tokenizer

        unknown = set(kwargs) - set(EngineConfig.field_names())
        if unknown:
            raise ValueError(f"unknown LLM arguments: {', '.join(sorted(unknown))}")
        self.config = EngineConfig(
            model=model, dtype=dtype, page_size=page_size, num_pages=num_pages,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching, seed=seed,
            **kwargs)
        self.engine = EngineCore(self.config, build_runner(self.config))
        info = self.engine.runner.info
        self.model_info = info
        self.tokenizer = load_tokenizer(info.folder)
        # the same encoding and chat template code as the HTTP server
        self._tok = FrontendTokenizer(self.tokenizer)
        self.eos_token_ids = list(info.eos_token_ids)
        self._ids = itertools.count()
        self._processor = OutputProcessor(self.tokenizer)
        # the model's recommended sampling (``generation_config``: "auto", "vllm", a folder)
        self._sampling_defaults = sampling_defaults(self.config.generation_config, info.folder)
        log_sampling_defaults(self._sampling_defaults, self.config.generation_config)

    def get_tokenizer(self):  # noqa: ANN201 - a transformers tokenizer
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The ``SamplingParams`` ``generate`` and ``chat`` use when given none (vLLM's
        method): vLLM's defaults, overridden by the model's ``generation_config.json`` values
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens)
        unless ``generation_config="vllm"``."""
        return SamplingParams(**self._sampling_defaults)

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for every prompt, all batched together.

        Args:
            prompts: a string, a ``{"prompt_token_ids": [...]}`` dict, or a list of either.
            sampling_params: one for all prompts or one per prompt (default:
                ``get_default_sampling_params()``).
            use_tqdm: show a progress bar when there is more than one prompt.

        Returns:
            one ``RequestOutput`` per prompt, in input order.

        Raises:
            ValueError: bad prompt (empty, too long for ``max_model_len``) or parameters; no
                request of the call is left running.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        encoded = [self._encode(p) for p in prompts]
        return self._run(encoded, params, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them and generate.

        Raises:
            ValueError: empty conversation, or the template rejects the messages.
        """
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptType] = []
        for conv in convs:
            if not conv:
                raise ValueError("messages must not be empty")
            prompts.append(self._tok.chat_prompt(conv, add_generation_prompt,
                                                 chat_template_kwargs))
        return self.generate(prompts, sampling_params, use_tqdm)

    # ------------------------------------------------------------------ internals
    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._tok.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, dict) and "prompt" in prompt:
            text = prompt["prompt"]
            return text, self._tok.encode(text)
        raise ValueError("a prompt must be a string or a dict with 'prompt_token_ids'")

    def _run(self, encoded: list[tuple[str | None, list[int]]], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        """Add every request, step the engine until all finished, build the results.

        Raises:
            ValueError: the engine rejected a request; nothing of this call stays queued.
        """
        processor, engine = self._processor, self.engine
        results: list[RequestOutput] = []
        # engine request id -> (its RequestOutput, the states of all that output's requests)
        owner: dict[str, tuple[RequestOutput, list[RequestState]]] = {}
        now = time.time()
        try:
            for (text, ids), sp in zip(encoded, params, strict=True):
                rid = str(next(self._ids))
                out = RequestOutput(rid, text, ids, [], metrics=RequestMetrics(now))
                results.append(out)
                group: list[RequestState] = []
                for i, req in enumerate(fan_out(rid, [ids], sp, now)):
                    cid = req.request_id
                    out.outputs.append(CompletionOutput(index=i))
                    group.append(processor.add_request(cid, ids, req.sampling_params, now,
                                                       index=i))
                    owner[cid] = (out, group)
                    engine.add_request(req)
        except Exception:
            engine.abort_requests(list(owner), notify=False)
            processor.abort_requests(list(owner))
            raise
        bar = tqdm(total=len(results), desc="Processed prompts", disable=not use_tqdm
                   or len(results) < 2, dynamic_ncols=True)
        try:
            while owner and engine.has_unfinished_requests():
                step = engine.step()
                if step is None:
                    continue
                processed = processor.process(step)
                if processed.abort_ids:
                    engine.abort_requests(processed.abort_ids, notify=False)
                for d in processed.deltas:
                    if d.finish_reason is None:
                        continue
                    out, group = owner.pop(d.request_id)
                    out.outputs[d.state.index] = _completion(d.state)
                    if all(st.finished for st in group):
                        _finish(out, group)
                        bar.update(1)
        except BaseException:
            engine.abort_requests(list(owner), notify=False)
            processor.abort_requests(list(owner))
            raise
        finally:
            bar.close()
        return results


def _completion(state: RequestState) -> CompletionOutput:
    """A finished request's ``CompletionOutput`` (logprob rows as vLLM's dicts)."""
    comp = CompletionOutput(index=state.index, text=state.text, token_ids=list(state.token_ids),
                            finish_reason=state.finish_reason, stop_reason=state.stop_reason)
    if state.want_logprobs:
        comp.logprobs = [{int(e[0]): e[1] for e in row} for row in state.logprob_rows]
        comp.cumulative_logprob = sum(row[0][1] for row in state.logprob_rows)
    return comp


def _finish(out: RequestOutput, group: list[RequestState]) -> None:
    """Mark a prompt's output finished once all its ``n`` requests are: cached tokens from the
    first (as the server's usage counts them), first token time from the earliest."""
    out.finished = True
    out.num_cached_tokens = group[0].num_cached_tokens
    rows = group[0].prompt_logprob_rows
    if rows is not None:
        out.prompt_logprobs = [None] + [{int(e[0]): e[1] for e in row} for row in rows]
    out.kv_transfer_params = group[0].kv_transfer_params
    if out.metrics is not None:
        firsts = [st.first_token_time for st in group if st.first_token_time is not None]
        out.metrics.first_token_time = min(firsts) if firsts else None
        out.metrics.finished_time = time.time()
