"""scripts/bench/replay.py: greedy steps replayed over saved outputs, policies and strategies from their text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minilade.decoding.step_costs import StepCosts
from scripts.bench import replay
from scripts.bench.common import UsageError

COSTS = StepCosts({1: 1.0, 64: 2.0})


def test_a_suffix_draft_is_accepted_up_to_its_first_wrong_token() -> None:
    # The prefill emits 1; "1" occurred at the start, followed by 2 3 4: drafted, and right up to the 9.
    policy = replay.parse_policy("suffix:4,1", COSTS)
    done = replay.replay(policy.make([1, 2, 3, 4], None), [1, 2, 3, 4], [1, 2, 3, 4, 9], COSTS)
    assert (done.new_tokens, done.passes, done.rows) == (5, 2, 1 + 4)


def test_a_policy_that_drafts_nothing_replays_plain_decoding() -> None:
    done = replay.replay(replay.parse_policy("pool:3,2", COSTS).make([5, 6], None), [5, 6], [7, 8, 9], COSTS)
    assert (done.passes, done.rows) == (3, 2)


def test_auto_with_history_drafts_from_the_other_outputs_of_the_set_only() -> None:
    records = [dict(dataset="a", prompt=[1], output=[5, 6, 7, 8, 9, 10]), dict(dataset="a", prompt=[2], output=[3]),
               dict(dataset="a", prompt=[3], output=[5, 6, 7, 8, 9, 11]), dict(dataset="b", prompt=[3], output=[4])]
    history = replay.other_outputs(records, records[2])
    assert history.frozen and len(history) == 7  # the set's other outputs, never the record's own
    assert len(replay.other_outputs(records, records[3])) == 0  # nor another set's
    flat = StepCosts({1: 1.0, 64: 1.0})
    plain, drafted = (replay.replay(replay.parse_policy(f"{kind}:8,1,3,1,16", flat).make([3], history), [3],
                                    records[2]["output"], flat) for kind in ("auto", "auto+history"))
    assert plain.passes == 6 and drafted.passes < plain.passes  # after 5, the first answer drafts 6 7 8 9


@pytest.mark.parametrize("text", ["suffix:4", "pool:a,b", "nope:1,2", "auto:1,1,1,1,0", "auto+history:1,1"])
def test_bad_policies_are_refused_in_one_line(text: str) -> None:
    with pytest.raises(UsageError, match="bad policy"):
        replay.parse_policy(text, COSTS)


def test_strategies_take_their_fields_and_refuse_unknown_ones() -> None:
    strategy = replay.parse_strategy("auto:7,5,7:recycle_topk=2,suffix_branches=1")
    assert (strategy.window, strategy.ngram, strategy.recycle_topk, strategy.suffix_branches) == (7, 5, 2, 1)
    with pytest.raises(UsageError, match="no setting 'recycle_topk'"):
        replay.parse_strategy("lookahead:7,5,7:recycle_topk=1")


def test_rank_writes_the_table_and_the_plot(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    saved = tmp_path / "ar.json"
    saved.write_text(json.dumps(dict(records=[dict(dataset="humaneval", index=0, prompt=[1, 2, 3, 4],
                                                   output=[1, 2, 3, 4, 9])])))
    out, plot = tmp_path / "rank.json", tmp_path / "rank.png"
    assert replay.main(["rank", "--ar", str(saved), "--policies", "suffix:4,1", "--out", str(out),
                        "--plot", str(plot)]) == 0
    assert "| humaneval | suffix:4,1 | 2.50 | 5.0 |" in capsys.readouterr().out
    assert json.loads(out.read_text())["results"][0]["compression"] == 2.5
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_per_prompt_rows_list_every_prompt_slowest_first(tmp_path: Path, capsys) -> None:
    saved = tmp_path / "ar.json"
    saved.write_text(json.dumps(dict(records=[
        dict(dataset="humaneval", index=0, prompt=[1, 2, 3, 4], output=[1, 2, 3, 4, 9]),  # drafted: 2 passes
        dict(dataset="humaneval", index=1, prompt=[5, 6], output=[7, 8, 9])])))  # nothing to draft: 3 passes
    out = tmp_path / "rank.json"
    assert replay.main(["rank", "--ar", str(saved), "--policies", "suffix:4,1", "--costs",
                        str(write_costs(tmp_path)), "--per-prompt", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    slow, fast = "| humaneval | suffix:4,1 | 1 | 3 | 1.00 | 1.00 |", "| humaneval | suffix:4,1 | 0 | 5 | 2.50 | 4.00 |"
    assert slow in printed and fast in printed and printed.index(slow) < printed.index(fast)
    row = json.loads(out.read_text())["results"][0]
    assert [p["index"] for p in row["prompts"]] == [0, 1] and row["median_speedup"] == 2.5


def write_costs(folder: Path) -> Path:
    """A flat step-cost curve: rows cost nothing, so a prompt's estimated speedup is its steps saved."""
    path = folder / "flat.json"
    path.write_text(json.dumps({"1": 1.0, "128": 1.0}))
    return path


def test_live_costs_reach_auto_only() -> None:
    flat = StepCosts({1: 1.0, 128: 1.0})
    auto = replay.with_costs(replay.parse_strategy("auto:7,5,7"), flat)
    assert auto.costs is flat
    lookahead = replay.parse_strategy("lookahead:7,5,7")
    assert replay.with_costs(lookahead, flat) is lookahead
    assert replay.with_costs(replay.parse_strategy("auto:7,5,7"), None).costs is None
