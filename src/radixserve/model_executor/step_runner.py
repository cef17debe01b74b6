"""What the engine core drives: the ``StepRunner`` interface and the model facts a runner
reports. A null model (overhead benchmark) or a KV-checksum model (scheduler tests) can stand
in for the real ``ModelRunner``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from radixserve.model_executor.forward_batch import ForwardBatch, SampleResult


@dataclass
class ModelInfo:
    """Facts about a runner's model.

    Attributes:
        name: display name; folder: Hugging Face folder with tokenizer and chat template.
        max_model_len: longest sequence in tokens; vocab_size: ids are below it.
        eos_token_ids: ids that end generation; dtype/device: as strings ("bfloat16", "cpu").
    """

    name: str
    folder: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    dtype: str
    device: str


class StepRunner(Protocol):
    """Runs steps for the engine core.

    Attributes:
        num_pages: KV pages its storage holds, the null page 0 included.
        max_model_len: longest sequence in tokens.
        info: its model's facts.
        device: where sampling generators live ("cpu", a ``torch.device``).
    """

    num_pages: int
    max_model_len: int
    info: ModelInfo
    device: Any

    def execute(self, batch: ForwardBatch) -> SampleResult:
        """Run the step; returns one sampled token per row with ``batch.sample`` set."""
        ...
