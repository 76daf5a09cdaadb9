"""The server's API as clients see it: the real openai client for what it covers, raw HTTP for what it hides."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from .helpers import API_KEY, CONTEXT, metric, post


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


def error_of(response: httpx.Response, status: int) -> dict:
    """The response's error object, checked to have the OpenAI shape and the status."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


def test_health_and_models(server, client):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert len(models) == 1 and models[0].owned_by == "minilade"


def test_chat_completion_carries_usage_and_step_statistics(client, model_id):
    out = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "the cat"}],
                                         max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= out.usage.completion_tokens <= 12 and out.usage.prompt_tokens > 3
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert 0 <= out.usage.prompt_tokens_details.cached_tokens < out.usage.prompt_tokens
    stats = out.model_extra["minilade"]
    assert stats["forward_passes"] >= 1 and stats["tokens_per_pass"] > 0 and stats["strategy"] == "auto"


def test_chat_stream_shapes(client, model_id):
    """The first chunk carries the role, the last content chunk the finish_reason, a last chunk without choices the
    usage (asked for); the streamed text is the whole answer's."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the dog ran"}]
    whole = client.chat.completions.create(model=model_id, messages=messages, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=model_id, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    content = chunks[:-1]
    assert [c.choices[0].finish_reason for c in content][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in content) == whole.choices[0].message.content
    plain = list(client.chat.completions.create(model=model_id, messages=messages, max_tokens=5, stream=True))
    assert all(c.usage is None for c in plain)


def test_completion_whole_and_streamed(client, model_id):
    whole = client.completions.create(model=model_id, prompt="the bird sang", max_tokens=16, temperature=0)
    assert whole.object == "text_completion" and whole.usage.completion_tokens <= 16
    pieces = list(client.completions.create(model=model_id, prompt="the bird sang", max_tokens=16, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in pieces) == whole.choices[0].text
    assert pieces[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_token_id_prompt(client, model_id):
    out = client.completions.create(model=model_id, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0)
    assert out.usage.prompt_tokens == 4


@pytest.mark.parametrize("field, value", [("n", 2), ("logprobs", True), ("tools", [{"type": "function"}]),
                                          ("frobnicate", 1), ("temperature", -1), ("top_p", 0),
                                          ("stop", ["a", "b", "c", "d", "e"]), ("max_tokens", 0),
                                          ("max_tokens", CONTEXT), ("strategy", "beam"), ("window", 0),
                                          ("messages", []), ("stream_options", {"include_usage": True})])
def test_bad_fields_are_400_naming_the_field(server, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, field: value}
    error = error_of(post(server, "/v1/chat/completions", body), 400)
    assert error["param"] == field and error["type"] == "invalid_request_error"


def test_openai_client_sees_bad_request(client, model_id):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], n=2)
    assert caught.value.body["param"] == "n"


def test_prompt_past_the_context(server):
    error = error_of(post(server, "/v1/completions", {"prompt": list(range(3, 3 + CONTEXT))}), 400)
    assert error["param"] == "prompt" and "context" in error["message"]


def test_malformed_json_and_oversized_body(server):
    assert error_of(post(server, "/v1/completions", b'{"prompt": "the'), 400)["code"] == "invalid_json"
    big = json.dumps({"prompt": "x" * 70_000})
    assert error_of(post(server, "/v1/completions", big), 413)["code"] == "body_too_large"


def test_key_route_model_and_method(server, client):
    body = {"prompt": "the", "max_tokens": 2}
    assert error_of(post(server, "/v1/completions", body, key=None), 401)["code"] == "invalid_api_key"
    assert error_of(post(server, "/v1/completions", body, key="wrong"), 401)
    assert error_of(post(server, "/v1/nothing", body), 404)
    assert error_of(post(server, "/v1/completions", {**body, "model": "gpt-4"}), 404)["param"] == "model"
    assert error_of(httpx.get(f"{server.url}/v1/completions"), 405)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)


def test_disconnect_mid_stream_frees_the_request(server):
    """A client that goes away mid-stream: its generation is cancelled at the next step and nothing runs on."""
    cancelled = metric(server, "minilade_requests_cancelled_total")
    body = {"prompt": "the cat sat", "max_tokens": CONTEXT - 16, "temperature": 0, "stream": True,
            "strategy": "autoregressive", "stop": ["never appears in this text"]}
    with httpx.stream("POST", f"{server.url}/v1/completions", content=json.dumps(body),
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 20
    while metric(server, "minilade_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server, "minilade_requests_running") == 0
    assert metric(server, "minilade_requests_cancelled_total") == cancelled + 1


def test_metrics(server):
    """Self-contained (tests of this module may run on other workers): one answered and one refused request first."""
    assert post(server, "/v1/completions", {"prompt": "the cat", "max_tokens": 2}).status_code == 200
    error_of(post(server, "/v1/chat/completions", {"messages": [], "max_tokens": 4}), 400)
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    assert "# TYPE minilade_forward_passes_total counter" in text
    assert metric(server, "minilade_forward_passes_total") > 0 and metric(server, "minilade_rows_fed_total") > 0
    assert 'minilade_requests_total{endpoint="/v1/chat/completions",status="400"}' in text
