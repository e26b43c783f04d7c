"""Every bad request is refused with an error naming the field, before any KV block is taken."""
from __future__ import annotations

import pytest

CHAT = [{"role": "user", "content": "hi"}]
BAD = {  # id: (path, body, status, param)
    "prompt longer than the context": ("/v1/completions", {"prompt": list(range(1, 1100))}, 400, "prompt"),
    "prompt plus max_tokens beyond it": ("/v1/completions", {"prompt": "hi", "max_tokens": 1023}, 400, "max_tokens"),
    "max_tokens 0": ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    "max_completion_tokens -1": ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -1}, 400,
                                 "max_tokens"),
    "max_tokens not a number": ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    "temperature below 0": ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    "temperature too high": ("/v1/chat/completions", {"messages": CHAT, "temperature": 1e3}, 400, "temperature"),
    "top_p 0": ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    "top_p above 1": ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    "unknown policy": ("/v1/completions", {"prompt": "hi", "routing": {"policy": "oracle"}}, 400, "policy"),
    "bad policy parameter": ("/v1/completions", {"prompt": "hi", "routing": {"policy": "schedule", "every": 0}},
                             400, "every"),
    "sampling inside routing": ("/v1/completions", {"prompt": "hi", "routing": {"max_tokens": 3}}, 400,
                                "routing.max_tokens"),
    "unknown field": ("/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "best_of"),
    "n above 1": ("/v1/chat/completions", {"messages": CHAT, "n": 2}, 400, "n"),
    "missing prompt": ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    "empty prompt": ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    "no messages": ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    "message without content": ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400,
                                "messages.0.content"),
    "timeout not positive": ("/v1/completions", {"prompt": "hi", "request_timeout": 0}, 400, "request_timeout"),
    "unknown model": ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_request_names_the_field(server, case):
    path, body, status, param = BAD[case]
    for stream in (False, True):
        response = server.post(path, {**body, "stream": stream})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["message"].startswith(param)
        assert isinstance(error["code"], str) and error["type"]


@pytest.mark.parametrize("raw", [b'{"prompt": "hi",', b"prompt=hi", b""])
def test_malformed_json_is_400(server, raw):
    response = server.http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "body"


def test_refused_requests_hold_nothing(server):
    for path, body, _, _ in BAD.values():
        server.post(path, body)
    stats = server.wait_idle()
    assert stats["active_requests"] == 0
