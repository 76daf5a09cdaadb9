"""Each answer is the one it gets alone: requests served together, sharing forward passes, give exactly what the
same request gives through LLM.generate in this process (greedy, and sampled with a seed), whatever the strategy."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from minilade import LLM
from minilade.decoding import make_strategy
from minilade.decoding.auto import COST_SIZES
from minilade.decoding.step_costs import step_costs_for

from .helpers import API_KEY, WORDS, metric

LONG_PROMPT = " ".join([WORDS] * 12)  # a prefill of a few hundred rows joins the other requests' steps

# (chat?, prompt, request fields); the strategy settings are minilade's own fields.
CASES = [
    (True, "the cat", {"max_tokens": 40, "temperature": 0}),
    (True, "the dog ran to", {"max_tokens": 40, "temperature": 0, "strategy": "lookahead", "window": 3,
                              "ngram": 3, "guesses": 3}),
    (False, "the bird sang over", {"max_tokens": 40, "temperature": 0, "strategy": "autoregressive"}),
    (False, "the red house", {"max_tokens": 30, "temperature": 0.9, "top_p": 0.9, "seed": 7}),
    (False, "by the sea the", {"max_tokens": 30, "temperature": 0.8, "top_k": 20, "seed": 11,
                               "presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2,
                               "strategy": "lookahead", "window": 4, "ngram": 3, "guesses": 4}),
    (True, "the mat and", {"max_tokens": 40, "temperature": 0, "stop": [":n"]}),  # the tiny model says ":n"
    (False, LONG_PROMPT, {"max_tokens": 40, "temperature": 0}),
    (True, "sat on the", {"max_tokens": 40, "temperature": 0, "stream": True}),
]
SAMPLING = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty")
STRATEGY = ("window", "ngram", "guesses")


@pytest.fixture(scope="module")
def alone(tiny_ckpt, kept_tables):
    """The same checkpoint loaded here as the server loads it; auto steps by the costs the server measured and
    kept, so that seeded sampling takes the same steps."""
    llm = LLM.load(tiny_ckpt, dtype="float32", progress=False, compile=False)
    costs = step_costs_for(llm.model, COST_SIZES, kept_tables / "step_costs.json")

    def generate(chat: bool, prompt, fields: dict):
        strategy = make_strategy(fields.get("strategy", "auto"), costs=costs,
                                 **{k: fields[k] for k in STRATEGY if k in fields})
        return llm.generate(prompt, chat=chat, max_new_tokens=fields["max_tokens"], stop=fields.get("stop", ()),
                            strategy=strategy, **{k: fields[k] for k in SAMPLING if k in fields})
    return generate


def ask(client: openai.OpenAI, model: str, chat: bool, prompt: str, fields: dict) -> tuple[str, int]:
    """The answer's text and completion tokens, streamed or not as fields say."""
    fields = dict(fields)
    stream = fields.pop("stream", False)
    extra = {k: fields.pop(k) for k in ("top_k", "repetition_penalty", "strategy", *STRATEGY) if k in fields}
    if chat:
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                             stream=stream, extra_body=extra, **fields)
        if stream:
            chunks = list(out)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), -1
        return out.choices[0].message.content, out.usage.completion_tokens
    out = client.completions.create(model=model, prompt=prompt, extra_body=extra, **fields)
    return out.choices[0].text, out.usage.completion_tokens


def test_concurrent_answers_equal_alone(server, alone):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    passes, served = metric(server, "minilade_forward_passes_total"), metric(server, "minilade_pass_requests_total")
    with ThreadPoolExecutor(len(CASES)) as pool:
        answers = list(pool.map(lambda case: ask(client, model, *case), CASES))
    passes = metric(server, "minilade_forward_passes_total") - passes
    served = metric(server, "minilade_pass_requests_total") - served
    assert served / passes > 1.5, "the requests did not share forward passes"
    for (chat, prompt, fields), (text, n_tokens) in zip(CASES, answers):
        expected = alone(chat, prompt, fields)
        assert text == expected.text, (prompt, fields)
        assert n_tokens in (-1, len(expected.token_ids))
        assert expected.finish_reason == "stop" or "stop" not in fields, "no stop string met: pick another"


def test_next_turn_reuses_the_conversation_and_answers_as_alone(server, alone):
    """A chat's next turn resends the conversation: its prompt's first tokens come from the kept K/V of the turn
    before (usage says how many), and the answer is the one a whole prefill gives."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": "answer in words"}, {"role": "user", "content": LONG_PROMPT[:300]}]
    before = 0  # the prompt tokens of the turn before
    for turn in range(3):
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
        answer = out.choices[0].message.content
        cached = out.usage.prompt_tokens_details.cached_tokens
        assert before - 4 <= cached < out.usage.prompt_tokens  # all of the turn before, give or take a merge
        before = out.usage.prompt_tokens
        expected = alone(True, messages, {"max_tokens": 24, "temperature": 0})
        assert answer == expected.text
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"and then {turn}?"}]
