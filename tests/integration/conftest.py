"""Fixtures for tests against a real ``radixserve serve`` process."""

from __future__ import annotations

import pytest
from server_utils import ServerProcess

#: Engine flags of the shared default-model server: a small KV pool keeps memory low.
SERVER_ARGS = ["--num-pages", "640", "--max-num-seqs", "96", "--seed", "0"]


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    """One default-model server for the whole session (the model loads once)."""
    srv = ServerProcess(SERVER_ARGS, tmp_path_factory.mktemp("server"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()
