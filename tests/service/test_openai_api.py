"""The official openai client against `launch_server` in a subprocess: completions and chat, with and without
streaming, provenance on every chunk and usage split per model; the API key; raw SSE framing; the values of
OpenAI parameters that ask for nothing the engine lacks; max_tokens by default; a random policy's seed."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tokenrouter.service.client import sse_payloads

ROUTING = {"routing": {"policy": "schedule", "every": 3}}  # output positions 2, 5, 8, ... come from "large"


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0) as c:
        yield c


def expected_models(n: int) -> list[str]:
    return ["large" if i % 3 == 2 else "small" for i in range(n)]


def test_models_lists_the_pair(client):
    (card,) = client.models.list().data
    assert card.id == "pair" and card.models == ["small", "large"]


def test_completion_carries_provenance_and_usage_per_model(client):
    out = client.completions.create(model="pair", prompt="def add(a, b):", max_tokens=12, extra_body=ROUTING)
    choice = out.choices[0]
    models = [r["model"] for r in choice.provenance]
    assert models == expected_models(len(models)) and len(models) == out.usage.completion_tokens
    assert out.usage.completion_tokens_per_model == {"small": models.count("small"), "large": models.count("large")}
    assert "".join(r["text"] for r in choice.provenance).startswith(choice.text)
    assert out.routing["policy"] == "schedule:every=3" and out.routing["handoffs"] == models.count("large")


@pytest.mark.parametrize("chat", [False, True])
def test_stream_adds_up_to_the_same_response(client, chat):
    args = dict(model="pair", max_tokens=16, extra_body=ROUTING)
    if chat:
        create, args["messages"] = client.chat.completions.create, [{"role": "user", "content": "hello"}]
    else:
        create, args["prompt"] = client.completions.create, "hello"
    whole = create(**args)
    chunks = list(create(stream=True, **args))
    deltas = [c.choices[0].delta.content if chat else c.choices[0].text for c in chunks]
    records = [r for c in chunks for r in c.choices[0].provenance]
    assert all(c.choices[0].provenance for c in chunks[:-1])  # every chunk but a bare finish carries tokens
    assert "".join(d or "" for d in deltas) == (whole.choices[0].message.content if chat else whole.choices[0].text)
    assert [r["token_id"] for r in records] == [r["token_id"] for r in whole.choices[0].provenance]
    assert [r["model"] for r in records] == expected_models(len(records))
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens_per_model == whole.usage.completion_tokens_per_model
    if chat:
        assert chunks[0].choices[0].delta.role == "assistant"


def test_a_query_decision_after_the_first_tokens_streams_only_the_large_models_response(client):
    # top-1 bar 1.0: every request goes to the large model after the small model's first 3 tokens
    routing = {"routing": {"policy": "query-confidence", "threshold": 1.0, "tokens": 3}}
    args = dict(model="pair", prompt="def add(a, b):", max_tokens=10, extra_body={**routing, "ignore_eos": True})
    chunks = list(client.completions.create(stream=True, **args))
    assert [r["model"] for c in chunks for r in c.choices[0].provenance] == ["large"] * 10
    assert chunks[-1].routing["discarded_tokens"] == 3
    assert chunks[-1].usage.completion_tokens_per_model == {"small": 0, "large": 10}
    alone = client.completions.create(model="pair", prompt="def add(a, b):", max_tokens=10,
                                      extra_body={"routing": {"policy": "all-large"}, "ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == alone.choices[0].text


def test_stop_string_is_cut_from_streamed_and_whole_text(client):
    free = client.completions.create(model="pair", prompt="stop here", max_tokens=24).choices[0].text
    stop = free[6:8]
    cut = free[:free.find(stop)]
    whole = client.completions.create(model="pair", prompt="stop here", max_tokens=24, stop=[stop])
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="pair", prompt="stop here", max_tokens=24, stop=[stop], stream=True))
    assert whole.choices[0].text == streamed == cut
    assert whole.choices[0].finish_reason == "stop"


def test_api_key_is_required_except_for_health(server):
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"},
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_raw_sse_framing(server):
    body = {"prompt": "hello", "max_tokens": 5, "stream": True, **ROUTING}
    with server.http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]  # every event is one `data:` line and a blank line
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])

    async def parse():
        async def lines():
            for line in raw.splitlines():
                yield line
        return [p async for p in sse_payloads(lines())]

    payloads = asyncio.run(parse())
    assert len(payloads) == len(events) - 2
    assert sum(len(p["choices"][0]["provenance"]) for p in payloads) == 5
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert payloads[-1]["usage"]["completion_tokens"] == 5
    assert {p["id"] for p in payloads} == {payloads[0]["id"]}


# every parameter of the official client's create() the engine does not implement, at the value that asks for
# nothing (the client sends null for a parameter passed as None), and the ones it ignores (user, metadata, ...)
NEUTRAL_CHAT = dict(n=1, logprobs=False, top_logprobs=0, presence_penalty=0, frequency_penalty=0.0, logit_bias={},
                    user="user-1", tools=[], tool_choice="none", parallel_tool_calls=False, functions=None,
                    function_call=None, response_format={"type": "text"}, modalities=["text"], audio=None,
                    prediction=None, reasoning_effort=None, verbosity=None, web_search_options=None,
                    service_tier="auto", store=False, metadata={"run": "a"}, prompt_cache_key="k",
                    safety_identifier="s", seed=None, temperature=None, top_p=None, stop=None, max_tokens=None,
                    max_completion_tokens=4)
NEUTRAL_COMPLETION = dict(n=1, best_of=1, echo=False, suffix=None, logprobs=None, presence_penalty=0,
                          frequency_penalty=0, logit_bias=None, user="user-1", seed=None, temperature=None,
                          top_p=None, stop=None, max_tokens=4)


@pytest.mark.parametrize("stream", [False, True])
def test_neutral_values_of_unimplemented_parameters_are_accepted(client, stream):
    """Issue 26: `logprobs: null`, `presence_penalty: 0`, `n: 1`, ... were 400s; vLLM accepts them too."""
    extra = {"stream_options": {"include_usage": True, "include_obfuscation": False}} if stream else {}
    chat = client.chat.completions.create(model="pair", messages=[{"role": "user", "content": "hi"}], stream=stream,
                                          **NEUTRAL_CHAT, **extra)
    chat = list(chat)[-1] if stream else chat
    assert chat.usage.completion_tokens == 4
    nulls = client.chat.completions.create(model="pair", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           stream=stream, **{k: None for k in NEUTRAL_CHAT if k != "max_tokens"})
    assert (list(nulls)[-1] if stream else nulls).usage.completion_tokens == 2
    text = client.completions.create(model="pair", prompt="hi", stream=stream, **NEUTRAL_COMPLETION, **extra)
    assert (list(text)[-1] if stream else text).usage.completion_tokens == 4


def test_a_value_the_engine_cannot_honour_is_a_400_that_says_why(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="pair", messages=[{"role": "user", "content": "hi"}], presence_penalty=1)
    error = refused.value.body
    assert error["param"] == "presence_penalty" and "penalt" in error["message"].removeprefix("presence_penalty")


def test_max_tokens_defaults_to_what_the_context_has_left(client):
    """Issue 26: a prompt leaving fewer than the default 128 tokens was a 400 naming max_tokens."""
    limit = client.models.list().data[0].max_model_len
    prompt = [1 + i % 200 for i in range(limit - 5)]
    out = client.completions.create(model="pair", prompt=prompt, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    short = client.completions.create(model="pair", prompt="hi", extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 128  # the engine's default where the context has room


@pytest.mark.parametrize("policy", ["random", "query-random"])
def test_a_random_policys_seed_works_in_the_body_form_of_routing(client, policy):
    """Issue 26: `{"policy": "random", "seed": 5}` was refused (seed taken for a misplaced sampling option)."""
    def models(routing):
        out = client.completions.create(model="pair", prompt="def add(a, b):", max_tokens=24,
                                        extra_body={"routing": routing, "ignore_eos": True})
        return out.routing["policy"], [r["model"] for r in out.choices[0].provenance]

    seeds = {}
    for seed in range(6):
        spec, body = models({"policy": f"{policy}:share=0.5,seed={seed}"}), models(
            {"policy": policy, "share": 0.5, "seed": seed})
        assert spec == body
        seeds[seed] = body[1]
    assert len({tuple(m) for m in seeds.values()}) > 1  # the seed decides
