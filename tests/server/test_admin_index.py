"""The admin server's index: `/` and `/api/v1` list every page with one line each (they were a
plain-text 404), and the list is the server's routes, no more, no less."""

from __future__ import annotations

import httpx

from extproc.server.admin import INDEX_PATHS, PAGES


async def test_the_index_lists_every_page_and_each_listed_page_answers(app):
    base = f"http://127.0.0.1:{app.admin_port}"
    async with httpx.AsyncClient() as c:
        for path in ("/", "/api/v1", "/api/v1/"):
            r = await c.get(base + path)
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/json"), path
            rows = r.json()["pages"]
            assert {(row["method"], row["path"]) for row in rows} == set(PAGES)
            assert all(row["what"] for row in rows)
        for method, path in PAGES:
            if method == "GET":
                assert (await c.get(base + path)).status_code in (200, 503), path
            else:  # the write routes exist (401 without the token, 403 without one configured), not 404/405
                assert (await c.post(base + path, json={})).status_code in (401, 403), path


async def test_every_route_of_the_admin_server_is_on_the_index(app):
    routes = {(r.method, r.resource.canonical) for r in app._admin._app().router.routes() if r.method != "HEAD"}
    assert routes - {("GET", p) for p in INDEX_PATHS} == set(PAGES)
