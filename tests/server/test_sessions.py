"""Server-side sessions: a turn sends only its new messages and gets the tokens a stateless request with the whole
conversation gets; turns are transactional (a failed one commits nothing), one at a time, within a byte budget."""

import pytest


@pytest.fixture(scope="module")
def store(tiny):
    return tiny.store("qwen3_moe")


def test_a_session_keeps_the_conversation(serve, store):
    server = serve(store, prefix_cache_mb=64)
    with server.http() as h:
        s = h.post("/v1/sessions", json={"messages": [{"role": "system", "content": "Be brief."}],
                                         "settings": {"max_tokens": 6}}).raise_for_status().json()
        assert s["object"] == "session" and s["usage"]["turns"] == 0
        history = [{"role": "system", "content": "Be brief."}]
        for question in ("Hello there", "And then what happened next?"):
            turn = {"role": "user", "content": question}
            r = h.post("/v1/chat/completions", json={"session_id": s["id"], "messages": [turn]}).raise_for_status()
            stateless = h.post("/v1/chat/completions", json={"messages": history + [turn], "max_tokens": 6}).json()
            answer = r.json()["choices"][0]["message"]["content"]
            assert answer == stateless["choices"][0]["message"]["content"]
            history += [turn, {"role": "assistant", "content": answer}]
        got = h.get(f"/v1/sessions/{s['id']}").json()
        assert got["messages"] == history and got["usage"]["turns"] == 2 and got["usage"]["cached_tokens"] > 0
        streamed = h.post("/v1/chat/completions", json={"session_id": s["id"], "stream": True,
                                                        "messages": [{"role": "user", "content": "More"}]})
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        assert h.get(f"/v1/sessions/{s['id']}").json()["usage"]["turns"] == 3
        bad = h.post("/v1/chat/completions", json={"session_id": s["id"], "messages": [{"role": "wizard"}]})
        assert bad.status_code == 400  # a refused turn commits nothing and leaves the session free
        assert h.get(f"/v1/sessions/{s['id']}").json()["usage"]["turns"] == 3
        assert h.delete(f"/v1/sessions/{s['id']}").json()["deleted"] is True
        assert h.get(f"/v1/sessions/{s['id']}").status_code == 404
        missing = h.post("/v1/chat/completions", json={"session_id": "sess-nope", "messages": []})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "session_id"


def test_sessions_stay_within_their_budget(serve, store):
    server = serve(store, session_budget_bytes=600, max_sessions=2)
    with server.http() as h:
        first = h.post("/v1/sessions", json={"messages": [{"role": "system", "content": "a" * 200}]}).json()
        h.post("/v1/sessions", json={"messages": [{"role": "system", "content": "b" * 200}]}).raise_for_status()
        h.post("/v1/sessions", json={}).raise_for_status()  # the least recently used idle one leaves
        assert h.get(f"/v1/sessions/{first['id']}").status_code == 404
        too_big = h.post("/v1/sessions", json={"messages": [{"role": "system", "content": "c" * 700}]})
        assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "messages"
        bad = h.post("/v1/sessions", json={"settings": {"wizardry": 1}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "settings.wizardry"
