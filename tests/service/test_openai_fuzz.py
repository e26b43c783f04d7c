"""Property-based fuzz of the OpenAI endpoints on the tiny pair: request bodies drawn from the server's own
OpenAPI document (plus routing parameters drawn from the policies' declared ones, and bodies of the wrong
shape altogether). Whatever comes in: no 5xx (but a 504 the request asked for), no engine failure, and
afterwards every KV block is back. Then the shapes of issue 26, each with the answer it must get: the
neutral values of OpenAI parameters the engine lacks are served, any other value of them, a value of the
wrong JSON type (true or "5" for a number) and a lone surrogate in text are a 400 naming the field, a
random policy's seed works in the body form of `routing`, a prompt that leaves less than the default
output gets what the context has left, and a body too large to be worth validating (long lists, many keys or
values, a prompt or messages longer than the context could hold) is a 400 naming the field."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenrouter.policies import POLICIES
from tokenrouter.service.openai_protocol import CHAT_NOT_IMPLEMENTED, COMPLETION_NOT_IMPLEMENTED
from tokenrouter.service.policy_cache import _signature
from tokenrouter.service.request_bounds import MAX_VALUES, MIN_CHARS_PER_TOKEN

EXAMPLES = 60  # per endpoint
SHAPES = 40  # per endpoint: most are refused before the engine sees them
JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
ANY_JSON = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3) |
                        st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def from_schema(schema: dict, components: dict) -> st.SearchStrategy:
    """Values of a (pydantic-made) JSON schema, biased to the small ones a tiny model answers quickly."""
    if "$ref" in schema:
        return from_schema(components[schema["$ref"].rsplit("/", 1)[-1]], components)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, components) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"]) | JSON_SCALARS
    kind = schema.get("type")
    if kind == "object":
        props = {k: from_schema(v, components) for k, v in schema.get("properties", {}).items()}
        required = {k: props.pop(k) for k in schema.get("required", [])}
        return st.fixed_dictionaries(required, optional=props)
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), components), max_size=6)
    if kind == "string":
        return st.text(max_size=12) | st.sampled_from(["", "\x00", "<|im_end|>", "\ud800", "a\udfffb",
                                                       "\U0001f600" * 3])
    if kind == "integer":
        return st.integers(-2, 24) | st.integers()
    if kind == "number":
        return st.floats(-1, 3) | st.floats() | st.sampled_from([1e-38, 5e-324, 1e-7])
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return ANY_JSON


@st.composite
def routing(draw) -> dict:
    """A policy by name or spec, with parameters named as its constructor names them (and stray ones)."""
    name = draw(st.sampled_from(sorted(POLICIES)))
    declared, _ = _signature(POLICIES[name])
    keys = draw(st.lists(st.sampled_from(sorted(declared) + ["of", "k", "window", "bogus"]), max_size=3))
    params = {k: draw(st.sampled_from(sorted(POLICIES)) if k == "of" else JSON_SCALARS) for k in keys}
    return {"policy": draw(st.sampled_from([name, f"{name}:threshold=0.5", f"{name}:x"])), **params}


@st.composite
def bodies(draw, schema: str, doc: dict):
    """A body the server should serve (small prompts, few tokens), then up to two fields replaced by any value
    of their declared schema, or now and then no request body at all."""
    components = doc["components"]["schemas"]
    props = components[schema]["properties"]
    if draw(st.integers(0, 9)) == 0:
        return draw(ANY_JSON)
    text = st.text(min_size=1, max_size=12)
    if "messages" in props:
        body = {"messages": draw(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                                 "content": text}), min_size=1, max_size=3))}
    else:
        body = {"prompt": draw(text | st.lists(st.integers(0, 255), min_size=1, max_size=8))}
    body.update(draw(st.fixed_dictionaries({}, optional={
        "max_tokens": st.integers(1, 8), "temperature": st.sampled_from([0, 0.5, 1.0]), "top_p": st.floats(0.05, 1),
        "top_k": st.integers(0, 50), "seed": st.integers(0, 2**31), "stop": st.lists(text, max_size=4),
        "stop_token_ids": st.lists(st.integers(0, 255), max_size=3), "ignore_eos": st.booleans(),
        "stream": st.booleans(), "routing": routing()})))
    for key in draw(st.lists(st.sampled_from(sorted(props)), max_size=2)):
        body[key] = draw(from_schema(props[key], components))
    return body


@pytest.fixture(scope="module")
def fuzzed(serve_inprocess):
    with serve_inprocess(http_options={"request_timeout": 20}) as (svc, _, server):
        before = svc.stats()
        yield svc, server, server.http.get("/openapi.json").json()
        idle = server.wait_idle()
        assert svc.error is None
        for model in svc.models:
            assert idle[model]["free_blocks"] == before[model]["free_blocks"] == before[model]["total_blocks"]


@pytest.mark.parametrize("path,schema", [("/v1/completions", "CompletionRequest"),
                                         ("/v1/chat/completions", "ChatRequest")])
def test_no_body_harms_the_server(fuzzed, path, schema):
    svc, server, doc = fuzzed
    assert doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(schema)

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(body=bodies(schema, doc))
    def one(body):
        if isinstance(body, dict) and isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 32:
            body["max_tokens"] = 32  # bounded work per example; validation of large values is tested elsewhere
        response = server.http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
        asked_timeout = isinstance(body, dict) and body.get("request_timeout") is not None
        events = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")] if response.status_code == 200 else []
        codes = [e["error"]["code"] for e in events if "error" in e]
        if response.status_code >= 400:
            error = response.json()["error"]
            assert isinstance(error["code"], str) and isinstance(error["message"], str)
            codes.append(error["code"])
        assert response.status_code < 500 or (response.status_code == 504 and asked_timeout), response.text[:500]
        assert all(c == "request_timeout" and asked_timeout for c in codes if c in (
            "engine_failed", "internal_error", "request_timeout")), (codes, body)
        assert svc.error is None, (svc.error, body)

    one()


NOT_IMPLEMENTED = {"CompletionRequest": COMPLETION_NOT_IMPLEMENTED, "ChatRequest": CHAT_NOT_IMPLEMENTED}
WRONG_TYPE = {"integer": [True, False, "5", 5.0, [5]], "number": [True, "0.5", "1", [0.5]],
              "boolean": ["yes", "true", 1, 0, [True]]}


def scalar_type(schema: dict) -> str | None:
    """The one JSON type a field takes besides null (None: several, or not a scalar)."""
    kinds = {s.get("type") for s in schema.get("anyOf", [schema])} - {"null"}
    return kinds.pop() if len(kinds) == 1 and kinds <= {"integer", "number", "boolean"} else None


def is_neutral(value, neutral: tuple) -> bool:
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral)


@st.composite
def shapes(draw, schema: str, doc: dict, limit: int):
    """(body, expected status, expected param): a small body a tiny model answers at once, with one shape."""
    props = doc["components"]["schemas"][schema]["properties"]
    chat = "messages" in props
    text = st.text(min_size=1, max_size=8)
    body = {"messages": [{"role": "user", "content": draw(text)}]} if chat else {"prompt": draw(text)}
    body["max_tokens"] = 2
    kind = draw(st.sampled_from(["neutral", "not neutral", "wrong type", "surrogate", "seed", "too large"] +
                                ([] if chat else ["near the context"])))
    if kind == "neutral":
        field, (neutral, _) = draw(st.sampled_from(sorted(NOT_IMPLEMENTED[schema].items())))
        return {**body, field: draw(st.sampled_from(neutral))}, 200, None
    if kind == "not neutral":
        field, (neutral, _) = draw(st.sampled_from(sorted(NOT_IMPLEMENTED[schema].items())))
        values = from_schema(props[field], doc["components"]["schemas"])
        value = draw(values.filter(lambda v: not is_neutral(v, neutral)))
        return {**body, field: value}, 400, field
    if kind == "wrong type":
        typed = sorted(k for k, v in props.items() if scalar_type(v))
        field = draw(st.sampled_from(typed))
        return {**body, field: draw(st.sampled_from(WRONG_TYPE[scalar_type(props[field])]))}, 400, field
    if kind == "surrogate":
        lone = draw(st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"]))
        where = draw(st.sampled_from(["text", "stop"]))
        if where == "stop":
            return {**body, "stop": ["x", f"a{lone}"]}, 400, "stop"
        if chat:
            body["messages"].insert(0, {"role": "system", "content": draw(text) + lone})
            return body, 400, "messages.0.content"
        return {**body, "prompt": lone + body["prompt"]}, 400, "prompt"
    if kind == "too large":
        return draw(too_large(body, chat, limit))
    if kind == "seed":
        name = draw(st.sampled_from(["random", "query-random"]))
        return {**body, "routing": {"policy": name, "share": 0.5, "seed": draw(st.integers(0, 2**31 - 1))}}, 200, None
    left = draw(st.integers(1, 6))  # no max_tokens: what the context has left, not a 400
    body = {"prompt": [1 + i % 200 for i in range(limit - left)], "ignore_eos": True}
    return body, 200, left


@st.composite
def too_large(draw, body: dict, chat: bool, limit: int):
    """The bodies of issue 26, item 2, scaled to the tiny pair: each refused before validation, naming the field."""
    n = draw(st.integers(1, 20_000))
    item = draw(st.sampled_from([1, "s", None]))
    cases = [("stop", {"stop": [item] * (4 + n)}), ("stop_token_ids", {"stop_token_ids": [1] * (64 + n)}),
             ("zz0", {f"zz{i}": 1 for i in range(1 + n % 3000)}),
             ("routing", {"routing": {"policy": "random", "xs": [1] * (MAX_VALUES + n)}})]
    if chat:
        cases += [("messages", {"messages": [{"role": "user", "content": "x"}] * (limit + n % 3000)}),
                  ("messages", {"messages": [{"role": "user", "content": "x" * (limit * MIN_CHARS_PER_TOKEN + n)}]})]
    else:
        cases += [("prompt", {"prompt": [1] * (limit + n % 3000)}),
                  ("prompt", {"prompt": "x" * (limit * MIN_CHARS_PER_TOKEN + n)})]
    param, fields = draw(st.sampled_from(cases))
    return {**body, **fields}, 400, param


@pytest.mark.parametrize("path,schema", [("/v1/completions", "CompletionRequest"),
                                         ("/v1/chat/completions", "ChatRequest")])
def test_openai_shapes_get_their_answer(fuzzed, path, schema):
    svc, server, doc = fuzzed
    limit = svc.runtime.context_limit

    @settings(max_examples=SHAPES, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(case=shapes(schema, doc, limit), stream=st.booleans())
    def one(case, stream):
        body, status, expected = case
        response = server.http.post(path, content=json.dumps({**body, "stream": stream} if "stream" not in body
                                                             else body), headers={"Content-Type": "application/json"})
        assert response.status_code == status, (body, response.text[:500])
        if status == 400:
            param = response.json()["error"]["param"]
            assert param == expected or param.startswith(f"{expected}."), (body, param)
        elif isinstance(expected, int):  # near the context: the output took all that was left
            usage = [json.loads(line[6:]).get("usage") for line in response.text.splitlines()
                     if line.startswith("data: {")][-1] if stream else response.json()["usage"]
            assert usage["completion_tokens"] == expected, (body, usage)
        assert svc.error is None, (svc.error, body)

    one()
