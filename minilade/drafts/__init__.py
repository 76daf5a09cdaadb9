"""Draft sources for lookahead's verification branch, and the scored tree that combines them.

    suffix.py   SuffixIndex: what followed the longest earlier occurrence of the text's ending (any length)
    history.py  DraftHistory: the same over the model's answers to earlier prompts (drafts across requests)
    recycle.py  RecycleTable: the model's own top-k next tokens after every token it read, a (V, k) table
    tree.py     DraftPath, Calibration (online acceptance estimates per source), DraftTree (paths merged into a
                trie, nodes ranked by estimated chance of acceptance)
    sources.py  each source's paths with calibration keys; replaying sources over known text

Every draft is a function of the text so far and of the model's earlier outputs, never of the token the model
will choose, so greedy verification keeps the output exactly that of plain decoding and sampling verification
keeps its distribution.
"""
