"""radixserve: an LLM inference server with continuous batching, a radix prefix cache over a
paged KV pool, chunked prefill and overlap scheduling."""

from radixserve.outputs import CompletionOutput, RequestOutput
from radixserve.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing the package must not load torch
    if name == "LLM":
        from radixserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
