"""What is counted over every collection, over real HTTP (kvfuse/service/api/auth.py,
Principal.check_every_collection): /metrics (not public here) and /v1/fidelity answer a key that sees
every collection, whether it writes (KVFUSE_API_KEY) or only reads, and refuse a key limited to some
collections with 403, naming none; the public /metrics of test_scoped_keys.py stays open to every key."""

from __future__ import annotations

import pytest
from service_helpers import API_KEY, Holder, make_client, metric, serving

pytestmark = pytest.mark.slow

TEAM_A, READER, AUDITOR = "team-a-key-0123456789", "reader-key-0123456789", "auditor-key-0123456789"
KEY_FILE = f"""{TEAM_A}: {{collections: [alpha], access: write}}
{READER}: {{collections: [alpha], access: read}}
{AUDITOR}: {{access: read}}
"""
ROUTES = ("/metrics", "/v1/fidelity")


@pytest.fixture(scope="module")
def holder(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("figures")
    (root / "keys.yaml").write_text(KEY_FILE)
    env = {"KVFUSE_API_KEY": API_KEY, "KVFUSE_SERVER__API_KEYS_FILE": str(root / "keys.yaml"),
           "KVFUSE_STORE__PRECOMPUTE_CONTEXT": "none", "KVFUSE_MODEL__MAX_CONTEXT_TOKENS": "1024"}

    def setup(admin) -> None:
        resp = admin.post("/v1/documents?wait=true", json={"documents": [
            {"id": "a-note", "text": "Alpha's note on the harbour tides.", "collection": "alpha"},
            {"id": "b-note", "text": "Beta's note on the copper ledger.", "collection": "beta"},
            {"id": "b-more", "text": "Beta's second note, on the orchard.", "collection": "beta"}]})
        assert resp.status_code == 201, resp.text

    with serving(root, env, setup=setup) as h:
        yield h


def test_keys_that_see_every_collection_read_the_service_wide_figures(holder: Holder) -> None:
    for key in (API_KEY, AUDITOR):
        with make_client(holder.server, key=key) as c:
            assert metric(c, "kvfuse_documents") == 3  # beta's two included
            fidelity = c.get("/v1/fidelity")
            assert fidelity.status_code == 200 and "methods" in fidelity.json()


@pytest.mark.parametrize("key", [TEAM_A, READER])
def test_a_key_limited_to_collections_is_refused_them_naming_none(holder: Holder, key: str) -> None:
    with make_client(holder.server, key=key) as c:
        for route in ROUTES:
            resp = c.get(route)
            assert resp.status_code == 403, (route, resp.text)
            err = resp.json()["error"]
            assert err["code"] == "collection_forbidden" and "every collection" in err["message"]
            assert "alpha" not in resp.text and "beta" not in resp.text
        assert c.get("/v1/collections").json()["collections"] == [{"name": "alpha", "documents": 1}]


def test_without_a_key_they_are_unauthorized(holder: Holder) -> None:
    with make_client(holder.server, key=None) as anon:
        for route in ROUTES:
            assert anon.get(route).status_code == 401
