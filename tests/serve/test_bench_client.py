"""The serve benchmark's load generator (scripts/bench/serve.py) reads a streamed answer as the server sent it."""

from __future__ import annotations

import httpx

from scripts.bench.serve import conversation, one_request

from .helpers import start_server


def test_the_load_generator_reads_streamed_answers_whole(tiny_ckpt):
    server = start_server(tiny_ckpt)
    try:
        for chat in (True, False):
            streamed = one_request(server.url, "the cat sat on", chat, 12)
            body = {"max_tokens": 12, "temperature": 0}
            body.update({"messages": [{"role": "user", "content": "the cat sat on"}]} if chat
                        else {"prompt": "the cat sat on"})
            whole = httpx.post(f"{server.url}/v1/{'chat/completions' if chat else 'completions'}", json=body,
                               timeout=60).json()
            choice = whole["choices"][0]
            assert streamed["text"] == (choice["message"]["content"] if chat else choice["text"])
            assert streamed["tokens"] == whole["usage"]["completion_tokens"]
            assert streamed["ttft"] > 0 and len(streamed["gaps"]) >= 1 and streamed["step_kinds"]
        turns = conversation(server, ["the cat sat on", "the dog ran to"], 12)
        assert turns[0]["answer"] == one_request(server.url, "the cat sat on", True, 12)["text"]
        assert turns[1]["prompt_tokens"] > turns[0]["prompt_tokens"] and turns[1]["cached_tokens"] > 0
    finally:
        assert server.stop() == 0, server.output()
