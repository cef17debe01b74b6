"""The step runner for an engine configuration: one ``ModelRunner``, a tensor-parallel group of
them, or a ``NullRunner`` (no weights). Kept apart from ``runner`` so that the tensor-parallel
runner, which wraps ``ModelRunner``, is imported by neither side of it."""

from __future__ import annotations

from radixserve.config import EngineConfig
from radixserve.model_executor.step_runner import StepRunner


def build_runner(config: EngineConfig, null_model: bool = False,
                 null_step_s: float = 0.0) -> StepRunner:
    """The runner for ``config``: the model loaded into a ``ModelRunner`` (seconds), or with
    ``null_model`` a ``NullRunner`` with the model's facts and no weights (overhead
    measurements; each step sleeps ``null_step_s`` seconds).

    Raises:
        ValueError: unreadable model, unsupported architecture, bad dtype/device/sizes.
    """
    if not null_model:
        if config.tensor_parallel_size > 1:
            from radixserve.model_executor.parallel.tp_runner import TensorParallelRunner

            return TensorParallelRunner(config)
        from radixserve.model_executor.runner import ModelRunner

        return ModelRunner(config)
    from radixserve.model_executor.null_runner import NullRunner

    return NullRunner.for_model(config, null_step_s)
