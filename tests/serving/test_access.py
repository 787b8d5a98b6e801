"""Access control on the HTTP server: bearer keys for asking and, separately, for ingesting."""

import logging

import httpx
import pytest
from conftest import CORPUS

from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig
from cacheclip_rag.serving.access import Keys, exposed_without_key
from cacheclip_rag.serving.server import BackgroundServer as Server
from cacheclip_rag.serving.server import create_app

ASK, ADMIN = "ask-key-0123456789", "admin-key-9876543210"


def test_verdicts_for_each_route_and_key():
    keys = Keys(ASK, ADMIN)
    bearer = lambda k: f"Bearer {k}"  # noqa: E731
    assert keys.verdict("GET", "/health", None) is None and keys.verdict("GET", "/", None) is None
    assert keys.verdict("POST", "/v1/chat/completions", None)[0] == 401
    assert "send it as 'Authorization: Bearer <key>'" in keys.verdict("POST", "/v1/completions", None)[2]
    assert "not valid" in keys.verdict("POST", "/v1/completions", bearer("wrong"))[2]
    assert keys.verdict("POST", "/v1/chat/completions", bearer(ASK)) is None
    assert keys.verdict("POST", "/v1/chat/completions", bearer(ADMIN)) is None  # the admin key may ask too
    assert keys.verdict("POST", "/v1/chat/completions", f"bearer  {ASK} ") is None  # scheme case, spacing
    assert keys.verdict("POST", "/v1/chat/completions", f"Basic {ASK}")[0] == 401
    assert keys.verdict("GET", "/openapi.json", None)[0] == 401  # every route but /health and the page
    assert keys.verdict("POST", "/v1/documents", bearer(ASK))[:2] == (403, "permission_error")
    assert keys.verdict("POST", "/v1/documents", None)[0] == 401
    assert keys.verdict("POST", "/v1/documents", bearer(ADMIN)) is None
    only_api = Keys(api=ASK)
    assert only_api.verdict("POST", "/v1/documents", bearer(ASK)) is None  # no admin key: the API key writes
    only_admin = Keys(admin=ADMIN)
    assert only_admin.verdict("POST", "/v1/chat/completions", None) is None  # asking stays open
    assert only_admin.verdict("POST", "/v1/documents", None)[0] == 401
    assert Keys().verdict("POST", "/v1/documents", None) is None and not Keys().enabled


@pytest.mark.parametrize("api, admin, message", [
    ("", None, "api key must be a non-empty"), ("has space", None, "api key must be"),
    (None, "naïve", "admin key must be"), (ASK, ASK, "must differ"), (123, None, "api key must be a string")])
def test_bad_keys_are_refused_by_name(api, admin, message):
    with pytest.raises(ValueError, match=message):
        Keys(api, admin)


def test_keys_come_from_the_environment_unless_given(monkeypatch):
    monkeypatch.setenv("CACHECLIP_API_KEY", "from-env")
    monkeypatch.setenv("CACHECLIP_ADMIN_KEY", "")
    assert Keys.from_env() == Keys("from-env", None)
    assert Keys.from_env("given", "admin") == Keys("given", "admin")
    assert exposed_without_key("0.0.0.0", Keys()) and not exposed_without_key("127.0.0.1", Keys())
    assert not exposed_without_key("0.0.0.0", Keys(ASK))


@pytest.fixture(scope="module")
def guarded(tiny_pair, tmp_path_factory):
    engine = CacheClipEngine(*tiny_pair, tmp_path_factory.mktemp("guarded"), EngineConfig(
        chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4), top_k=3, packets=None))
    server = Server(create_app(engine, default_max_tokens=4, model_name="tiny", keys=Keys(ASK, ADMIN)))
    yield server, engine
    server.stop()
    engine.close()


def test_requests_without_the_key_get_401_and_change_nothing(guarded):
    server, engine = guarded
    before = len(engine.index)
    for headers in ({}, {"Authorization": "Bearer nope"}):
        r = httpx.post(server.url + "/v1/documents", json={"documents": CORPUS}, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                       headers=headers, timeout=30)
        assert r.status_code == 401
    r = httpx.post(server.url + "/v1/documents", json={"documents": CORPUS}, timeout=30,
                   headers={"Authorization": f"Bearer {ASK}"})
    assert r.status_code == 403 and "admin key" in r.json()["error"]["message"]
    assert len(engine.index) == before == 0  # nothing was ingested
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert "cacheclip-rag" in httpx.get(server.url + "/").text


def test_the_admin_key_ingests_and_the_api_key_asks_through_the_openai_client(guarded):
    from openai import AuthenticationError, OpenAI

    server, engine = guarded
    r = httpx.post(server.url + "/v1/documents", json={"documents": CORPUS}, timeout=60,
                   headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and len(engine.index) > 0
    client = OpenAI(base_url=server.url + "/v1", api_key=ASK, max_retries=0)
    question = [{"role": "user", "content": "What is the code in the kitchen drawer?"}]
    reply = client.chat.completions.create(model="tiny", messages=question, max_tokens=4)
    expected = engine.chat(question, max_new_tokens=4).text
    assert reply.choices[0].message.content == expected
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=question, max_tokens=4, stream=True) if c.choices)
    assert streamed == expected
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_serve_warns_when_it_binds_beyond_loopback_without_a_key(tiny_pair, tmp_path, monkeypatch, caplog):
    from cacheclip_rag.cli import main
    from cacheclip_rag.serving import server as server_lib

    folders = []
    for name, lm in zip(("primary", "aux"), tiny_pair):
        lm.model.save_pretrained(tmp_path / name)
        lm.tokenizer.save_pretrained(tmp_path / name)
        folders.append(str(tmp_path / name))
    served = {}
    monkeypatch.setattr(server_lib, "serve", lambda engine, **kw: served.update(kw))  # not the real uvicorn loop
    monkeypatch.delenv("CACHECLIP_API_KEY", raising=False)
    args = ["serve", "--store", str(tmp_path / "s"), "--primary", folders[0], "--aux", folders[1]]
    with caplog.at_level(logging.WARNING, logger="cacheclip_rag"):
        assert main([*args, "--host", "0.0.0.0"]) == 0
    assert "without an API key" in caplog.text and served["keys"] == Keys()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cacheclip_rag"):
        assert main([*args, "--host", "0.0.0.0", "--api-key", ASK, "--admin-key", ADMIN]) == 0
    assert "without an API key" not in caplog.text and served["keys"] == Keys(ASK, ADMIN)
    assert main([*args, "--api-key", "two words"]) == 2  # refused before the models load
