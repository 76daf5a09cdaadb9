"""On the real demo model: answers served together are those LLM.generate gives alone, greedy and seeded, with eager
steps (float32) and in the default configuration (what the machine measures fastest and exact: native steps where
they serve the model). Shared passes of compiled graphs are checked on a tiny model (test_compiled_passes.py): a
real model's take minutes to compile on 2 cores."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from minilade import LLM
from minilade.decoding import make_strategy
from minilade.decoding.auto import COST_SIZES
from minilade.decoding.step_costs import step_costs_for

from .helpers import start_server

pytestmark = pytest.mark.real_model

CASES = [  # (prompt, request fields)
    ("Explain in two sentences why the sky is blue.", {"temperature": 0}),
    ("Write a Python function that reverses a string.", {"temperature": 0, "strategy": "lookahead"}),
    ("Name three rivers in Europe.", {"temperature": 0, "strategy": "autoregressive"}),
    ("Tell me a short story about a cat.", {"temperature": 0.8, "top_p": 0.95, "seed": 5}),
]


@pytest.mark.parametrize("server_args, load", [
    ((), {"dtype": "float32", "compile": False}),
    (("--dtype", "auto", "--compile", "auto"), {}),  # the server's and LLM.load's defaults
], ids=["eager", "default"])
def test_concurrent_chats_equal_alone(smollm2_gguf, kept_tables, server_args, load):
    server = start_server(smollm2_gguf, *server_args)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id

        def ask(case):
            prompt, fields = case
            fields = dict(fields)
            extra = {"strategy": fields.pop("strategy")} if "strategy" in fields else {}
            out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=32, extra_body=extra, **fields)
            return out.choices[0].message.content

        with ThreadPoolExecutor(len(CASES)) as pool:
            answers = list(pool.map(ask, CASES))
    finally:
        assert server.stop() == 0
    llm = LLM.load(smollm2_gguf, progress=False, **load)
    ready = next(line for line in server.output().splitlines() if "ready, serving" in line)
    configuration = llm.setup.split(" steps")[0]  # dtype, quantized layers and kind of steps; measured times follow
    assert f": {configuration} steps" in ready  # the server runs the model as the library does here (kept choices)
    if "native steps" in llm.setup:
        assert ready.endswith("in native passes")
    costs = step_costs_for(llm.model, COST_SIZES, kept_tables / "step_costs.json")  # those the server measured
    for (prompt, fields), answer in zip(CASES, answers):
        fields = dict(fields)
        strategy = make_strategy(fields.pop("strategy", "auto"), costs=costs)
        assert answer == llm.generate(prompt, chat=True, max_new_tokens=32, strategy=strategy, **fields).text
