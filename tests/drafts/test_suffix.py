"""The suffix index: longest earlier match, drafts that copy what followed it (past the text's end), branches."""

from __future__ import annotations

import pytest

from minilade.drafts.suffix import SuffixDraft, SuffixIndex, copy_after


def test_longest_earlier_match_and_its_occurrences_most_recent_first() -> None:
    index = SuffixIndex(max_key=4)
    text = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]
    assert index.match(text) == (3, [6, 2])  # [1 2 3] ended at 2 and 6; the text's own end (10) is not a match
    assert index.match(text + [9]) == (0, [])  # 9 never occurred before
    assert index.match([7]) == (0, [])


def test_drafts_copy_what_followed_and_branch_where_occurrences_disagree() -> None:
    index = SuffixIndex(max_key=4)
    text = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]
    assert index.drafts(text, 3, branches=3) == [SuffixDraft((5, 1, 2), 3, 0), SuffixDraft((4, 1, 2), 3, 1)]
    assert index.drafts(text, 3, branches=1) == [SuffixDraft((5, 1, 2), 3, 0)]
    assert index.drafts(text, 0) == []


def test_a_draft_runs_past_the_end_of_the_text_by_copying_itself() -> None:
    text = [9, 1, 2, 1, 2]
    assert SuffixIndex().drafts(text, 7) == [SuffixDraft((1, 2, 1, 2, 1, 2, 1), 2, 0)]  # [1 2] ended at 2
    assert copy_after([5, 6, 7], 1, 4) == (7, 7, 7, 7)  # after 6 came 7; after that, the copy's own tokens


def test_shorter_keys_add_branches_only_for_new_occurrences() -> None:
    index = SuffixIndex(max_key=3)
    text = [8, 1, 2, 6, 1, 2, 7, 3, 2]  # [3 2] never occurred; [2] ended at 2 and 5
    assert index.drafts(text, 2, branches=4) == [SuffixDraft((7, 3), 1, 0), SuffixDraft((6, 1), 1, 1)]


def test_index_grows_incrementally_and_keeps_a_bounded_number_of_positions() -> None:
    index = SuffixIndex(max_key=2, keep=2)
    text = [1, 1, 1, 1, 1, 1]
    index.update(text[:3])
    assert index.indexed == 3
    index.update(text)
    assert index.match(text) == (2, [4])  # only the `keep` latest ends of [1 1]: 5 (the text's own), 4
    assert len(index) == 2  # keys [1] and [1 1]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="key length must be >= 1"):
        SuffixIndex(max_key=0)
    with pytest.raises(ValueError, match="kept per key must be >= 1"):
        SuffixIndex(keep=0)
