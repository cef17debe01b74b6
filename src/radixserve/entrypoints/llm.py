"""Offline inference API, shaped like vLLM's ``LLM`` so users can switch.

Drives the same ``EngineCore`` the server uses, in-process (no ZMQ); tokenization, the chat
template, incremental detokenization and stop strings are the frontend's own classes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from radixserve.config import EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.engine_types import FINISH_STOP, EngineRequest
from radixserve.frontend.detokenizer import IncrementalDetokenizer
from radixserve.frontend.tokenizer import FrontendTokenizer
from radixserve.model_executor.runner import build_runner
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

    def get_tokenizer(self):  # noqa: ANN201 - a transformers tokenizer
        return self.tokenizer

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for every prompt, all batched together.

        Args:
            prompts: a string, a ``{"prompt_token_ids": [...]}`` dict, or a list of either.
            sampling_params: one for all prompts or one per prompt (default: vLLM's defaults).
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
            sampling_params = SamplingParams()
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
        results: list[RequestOutput] = []
        track: dict[str, tuple[RequestOutput, CompletionOutput, IncrementalDetokenizer]] = {}
        added: list[str] = []
        now = time.time()
        try:
            for (text, ids), sp in zip(encoded, params, strict=True):
                rid = str(next(self._ids))
                out = RequestOutput(rid, text, ids, [], metrics=RequestMetrics(now))
                results.append(out)
                for i in range(sp.n):
                    child = sp if sp.n == 1 else _child_params(sp, i)
                    cid = rid if sp.n == 1 else f"{rid}-{i}"
                    comp = CompletionOutput(index=i, logprobs=[] if sp.logprobs is not None
                                            else None)
                    comp.cumulative_logprob = 0.0 if sp.logprobs is not None else None
                    out.outputs.append(comp)
                    detok = IncrementalDetokenizer(
                        self.tokenizer, ids, sp.skip_special_tokens, sp.stop,
                        sp.include_stop_str_in_output)
                    self.engine.add_request(EngineRequest(
                        request_id=cid, prompt_token_ids=np.asarray(ids, dtype=np.int32),
                        sampling_params=child, arrival_time=now))
                    added.append(cid)
                    track[cid] = (out, comp, detok)
        except Exception:
            self.engine.abort_requests(added, notify=False)
            raise
        bar = tqdm(total=len(results), desc="Processed prompts", disable=not use_tqdm
                   or len(results) < 2, dynamic_ncols=True)
        remaining = {id(r): len(r.outputs) for r in results}
        try:
            while track and self.engine.has_unfinished_requests():
                step = self.engine.step()
                if step is None:
                    continue
                stopped: list[str] = []
                for o in step.all_outputs():
                    entry = track.get(o.request_id)
                    if entry is None:
                        continue
                    out, comp, detok = entry
                    new = o.new_token_ids
                    if new and out.metrics and out.metrics.first_token_time is None:
                        out.metrics.first_token_time = time.time()
                    if o.num_prompt_tokens:  # 0: a column-wise decode, which carries none
                        out.num_cached_tokens = o.num_cached_tokens
                    if new:
                        comp.token_ids.extend(new)
                        detok.add(new)
                        if o.logprobs and comp.logprobs is not None:
                            for row in o.logprobs:
                                comp.logprobs.append({int(t): lp for t, lp in row})
                                comp.cumulative_logprob += row[0][1]  # type: ignore[operator]
                    finish = o.finish_reason
                    if detok.stopped and finish is None:
                        finish = FINISH_STOP
                        stopped.append(o.request_id)
                    if finish is None:
                        continue
                    if detok.stopped:
                        comp.stop_reason = detok.stop_str
                    else:
                        detok.finish()
                        comp.stop_reason = o.stop_reason
                    comp.finish_reason = finish
                    comp.text = detok.text
                    del track[o.request_id]
                    remaining[id(out)] -= 1
                    if remaining[id(out)] == 0:
                        out.finished = True
                        if out.metrics:
                            out.metrics.finished_time = time.time()
                        bar.update(1)
                if stopped:
                    self.engine.abort_requests(stopped, notify=False)
        except BaseException:
            self.engine.abort_requests(list(track), notify=False)
            raise
        finally:
            bar.close()
        return results

def _child_params(sp: SamplingParams, i: int) -> SamplingParams:
    """The i-th of ``n`` samples: its own seed so samples differ but stay reproducible."""
    import msgspec

    seed = None if sp.seed is None else sp.seed + i
    return msgspec.structs.replace(sp, n=1, seed=seed)
