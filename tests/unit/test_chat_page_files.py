"""The chat page's routes and files without a model or a browser: ``/`` and its script and
style load without the API key while ``/v1`` stays guarded, they carry the strict content
policy, and nothing in them points at another host (no CDN, no outside font). The page itself
is tested in headless Chromium by tests/integration/test_chat_page.py."""

from __future__ import annotations

import re
from importlib import resources

from fastapi import FastAPI
from fastapi.testclient import TestClient

from radixserve.entrypoints.openai.chat_page import FILES, register_chat_page
from radixserve.entrypoints.openai.middleware import APIKeyMiddleware


def _client(api_key: str | None = None) -> TestClient:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": []}

    register_chat_page(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return TestClient(app)


def test_page_and_files_load_without_the_key_and_v1_stays_guarded() -> None:
    c = _client(api_key="k")
    page = c.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    for path, kind in (("/static/chat.js", "text/javascript"), ("/static/chat.css", "text/css")):
        r = c.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), path
        assert path in page.text  # the page loads exactly these
    assert c.head("/").status_code == 200
    assert c.get("/v1/models").status_code == 401
    assert c.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200


def test_files_point_at_no_other_host() -> None:
    static = resources.files("radixserve.entrypoints.openai").joinpath("static")
    names = sorted(p.name for p in static.iterdir())
    assert names == sorted(FILES), "static/ and chat_page.FILES must list the same files"
    for name in names:
        text = static.joinpath(name).read_text(encoding="utf-8")
        assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/|@import", text, re.I), name
    html = static.joinpath("chat.html").read_text(encoding="utf-8")
    for ref in re.findall(r'(?:src|href)="([^"]*)"', html):
        assert ref.startswith("/static/") or ref.startswith("data:"), ref
