"""What the speculative decoding tests share: aborting a request while others speculate."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from radixserve import LLM, SamplingParams
from radixserve.engine_types import EngineRequest, StepOutputs


def drive_tokens(llm: LLM, prompts: list[list[int]], params: Callable[[int], SamplingParams],
                 abort_after: int | None) -> dict[str, list[int]]:
    """Step ``llm``'s engine over ``prompts`` (request i with ``params(i)``) to the end; the
    token ids each request got, by request id. ``abort_after``: abort request "0" after that
    many steps (None: never)."""
    eng = llm.engine
    toks: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        eng.add_request(EngineRequest(request_id=str(i),
                                      prompt_token_ids=np.asarray(p, dtype=np.int32),
                                      sampling_params=params(i)))
    steps = 0
    while eng.has_unfinished_requests():
        out = eng.step()
        steps += 1
        collect_tokens(out, toks)
        if abort_after is not None and steps == abort_after:
            eng.abort_requests(["0"], notify=False)
    return toks


def collect_tokens(out: StepOutputs | None, toks: dict[str, list[int]]) -> None:
    """Append the token ids an engine step gave each request (``EngineCore.step``'s result,
    None for a step that gave none) to ``toks[request_id]``."""
    if out is None:
        return
    for o in out.outputs:
        toks[o.request_id] += list(o.new_token_ids)
    for rid, t in zip(out.decode_request_ids, out.decode_token_ids.tolist(), strict=True):
        toks[rid].append(t)


def check_abort_while_speculating(base: LLM, spec: LLM, prompts: list[list[int]],
                                  params: Callable[[int], SamplingParams]) -> None:
    """Request "0" aborted after 6 steps of ``spec`` (speculating) leaves the others' tokens
    those of ``base`` (no speculation) and its own a prefix of them (``params(i)`` must
    make 40 tokens, ignoring EOS), with no page leaked and nothing left running."""
    full = drive_tokens(base, prompts, params, None)
    got = drive_tokens(spec, prompts, params, 6)
    assert ({k: v for k, v in got.items() if k != "0"}
            == {k: v for k, v in full.items() if k != "0"})
    assert 0 < len(got["0"]) < 40 and got["0"] == full["0"][:len(got["0"])]
    spec.engine.scheduler.check_integrity()
    assert not spec.engine.scheduler.running
