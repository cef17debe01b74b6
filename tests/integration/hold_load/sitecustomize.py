"""Test hook (imported at interpreter start-up through PYTHONPATH, see
``server_utils.hold_load_env``): in the engine-core process, hold the model load until the test
releases it, so a test can act "while the model loads" without racing the load.

Active only when ``RADIXSERVE_TEST_HOLD_LOAD`` names a folder and this interpreter runs the
engine-core module. Then ``radixserve.model_executor.loader.resolve_model`` (the first step of
every model load) first writes ``loading`` (this pid) into the folder, then waits until
``release`` exists there. A signal that interrupts the wait (the engine core turns SIGTERM into
KeyboardInterrupt while it loads) writes ``interrupted`` before it propagates.
"""

from __future__ import annotations

import os
import sys

ENGINE_MODULE = "radixserve.core.engine_proc"


def _install(hold_dir: str) -> None:
    import time
    from pathlib import Path

    import radixserve.model_executor.loader as loader

    real_resolve = loader.resolve_model
    folder = Path(hold_dir)

    def held_resolve_model(*args, **kwargs):
        (folder / "loading").write_text(str(os.getpid()))
        try:
            while not (folder / "release").exists():
                time.sleep(0.02)
        except BaseException as e:
            (folder / "interrupted").write_text(type(e).__name__)
            raise
        return real_resolve(*args, **kwargs)

    loader.resolve_model = held_resolve_model


_hold_dir = os.environ.get("RADIXSERVE_TEST_HOLD_LOAD")
if _hold_dir and ENGINE_MODULE in getattr(sys, "orig_argv", sys.argv):
    _install(_hold_dir)
