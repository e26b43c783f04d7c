"""Every bad request is refused with an error naming the field, before any KV block is taken: values of the
wrong JSON type (no coercion of booleans or strings into numbers), OpenAI parameters with a value the engine
cannot honour, and text that is not Unicode (a lone surrogate)."""
from __future__ import annotations

import json

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
    "unknown field": ("/v1/completions", {"prompt": "hi", "frobnicate": 2}, 400, "frobnicate"),
    "n above 1": ("/v1/chat/completions", {"messages": CHAT, "n": 2}, 400, "n"),
    "best_of above 1": ("/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "best_of"),
    # parameters the engine does not implement, with a value that asks for something (issue 26)
    "presence_penalty not 0": ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    "frequency_penalty not 0": ("/v1/chat/completions", {"messages": CHAT, "frequency_penalty": -1}, 400,
                                "frequency_penalty"),
    "logprobs asked": ("/v1/chat/completions", {"messages": CHAT, "logprobs": True}, 400, "logprobs"),
    "top_logprobs asked": ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    "completion logprobs 0": ("/v1/completions", {"prompt": "hi", "logprobs": 0}, 400, "logprobs"),
    "logit_bias given": ("/v1/completions", {"prompt": "hi", "logit_bias": {"50": 10}}, 400, "logit_bias"),
    "echo asked": ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo"),
    "suffix given": ("/v1/completions", {"prompt": "hi", "suffix": "}"}, 400, "suffix"),
    "tools given": ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function",
                                                                         "function": {"name": "f"}}]}, 400, "tools"),
    "tool_choice required": ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, 400,
                             "tool_choice"),
    "json output asked": ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"}},
                          400, "response_format"),
    "audio asked": ("/v1/chat/completions", {"messages": CHAT, "modalities": ["text", "audio"]}, 400, "modalities"),
    # strict types: JSON true is not 1, "5" is not 5 (issue 26)
    "max_tokens true": ("/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    "max_tokens a numeric string": ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    "max_tokens 5.0": ("/v1/completions", {"prompt": "hi", "max_tokens": 5.0}, 400, "max_tokens"),
    "max_completion_tokens true": ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": True}, 400,
                                   "max_completion_tokens"),
    "n true": ("/v1/chat/completions", {"messages": CHAT, "n": True}, 400, "n"),
    "top_k true": ("/v1/completions", {"prompt": "hi", "top_k": True}, 400, "top_k"),
    "seed true": ("/v1/completions", {"prompt": "hi", "seed": True}, 400, "seed"),
    "seed a numeric string": ("/v1/completions", {"prompt": "hi", "seed": "5"}, 400, "seed"),
    "temperature true": ("/v1/chat/completions", {"messages": CHAT, "temperature": True}, 400, "temperature"),
    "temperature a numeric string": ("/v1/completions", {"prompt": "hi", "temperature": "0.5"}, 400, "temperature"),
    "top_p a numeric string": ("/v1/completions", {"prompt": "hi", "top_p": "1"}, 400, "top_p"),
    "ignore_eos a string": ("/v1/completions", {"prompt": "hi", "ignore_eos": "yes"}, 400, "ignore_eos"),
    "request_timeout true": ("/v1/completions", {"prompt": "hi", "request_timeout": True}, 400, "request_timeout"),
    "token id true": ("/v1/completions", {"prompt": [1, True]}, 400, "prompt.1"),
    "stop token id a string": ("/v1/completions", {"prompt": "hi", "stop_token_ids": ["7"]}, 400, "stop_token_ids.0"),
    "include_usage a string": ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": "yes"}}, 400,
                               "stream_options.include_usage"),
    # not Unicode: a lone surrogate (JSON allows the escape; a tokenizer cannot read it)
    "lone surrogate in a prompt": ("/v1/completions", {"prompt": "hi \ud800"}, 400, "prompt"),
    "lone surrogate in chat content": ("/v1/chat/completions", {"messages": [*CHAT, {"role": "user",
                                                                                    "content": "\udfff x"}]}, 400,
                                       "messages.1.content"),
    "lone surrogate in a stop string": ("/v1/completions", {"prompt": "hi", "stop": ["\ud83d"]}, 400, "stop"),
    "missing prompt": ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    "empty prompt": ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    "no messages": ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    "message without content": ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400,
                                "messages.0.content"),
    "timeout not positive": ("/v1/completions", {"prompt": "hi", "request_timeout": 0}, 400, "request_timeout"),
    "unknown model": ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
}


def post(server, path: str, body):
    """`body` as Python's json module writes it: a lone surrogate travels as its escape."""
    return server.http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("case", BAD)
def test_bad_request_names_the_field(server, case):
    path, body, status, param = BAD[case]
    for stream in (False, True):
        response = post(server, path, {**body, "stream": stream})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["message"].startswith(param)
        assert isinstance(error["code"], str) and error["type"]


@pytest.mark.parametrize("raw", [b'{"prompt": "hi",', b"prompt=hi", b""])
def test_malformed_json_is_400(server, raw):
    response = server.http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "body"


@pytest.mark.parametrize("stream", ["yes", "true", 1, 0, [True]])
def test_stream_is_a_boolean(server, stream):
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": stream})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "stream"


def test_refused_requests_hold_nothing(server):
    for path, body, _, _ in BAD.values():
        post(server, path, body)
    stats = server.wait_idle()
    assert stats["active_requests"] == 0
