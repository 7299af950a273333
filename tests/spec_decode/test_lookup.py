"""Prompt lookup: the token after the latest earlier occurrence of the newest n-gram, longest
n-gram first, with that n-gram's length; only committed tokens are indexed, each once."""

from faser.spec_decode.lookup import MAX_N, MIN_N, PRIOR_PRECISION, PromptLookup


def test_guess_is_the_token_after_the_latest_occurrence():
    lookup = PromptLookup()
    lookup.extend([1, 2, 3, 9, 1, 2, 3, 7, 5])
    assert lookup.guess([1, 2, 3]) == (7, 3)  # the later of 9 and 7
    assert lookup.guess([8, 8, 2, 3]) == (7, 2)  # only "2 3" occurred
    assert lookup.guess([4, 4]) is None


def test_the_longest_ngram_wins():
    lookup = PromptLookup()
    lookup.extend([5, 1, 2, 3, 4, 6, 2, 3, 4, 8])
    # "2 3 4" last led to 8, but "1 2 3 4" (longer, likelier) led to 6
    assert lookup.guess([1, 2, 3, 4]) == (6, 4)
    assert lookup.guess([0, 2, 3, 4]) == (8, 3)


def test_the_newest_token_is_not_its_own_guess():
    # "1 2" ends the committed tokens: nothing has followed it yet
    lookup = PromptLookup()
    lookup.extend([7, 1, 2])
    assert lookup.guess([1, 2]) is None


def test_extending_indexes_only_the_new_tokens_and_matches_a_fresh_index():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8]
    grown, fresh = PromptLookup(), PromptLookup()
    for end in range(1, len(tokens) + 1, 4):
        grown.extend(tokens[:end])
    grown.extend(tokens)
    fresh.extend(tokens)
    for start in range(len(tokens)):
        for n in range(MIN_N, MAX_N + 1):
            tail = tokens[start : start + n]
            assert grown.guess(tail) == fresh.guess(tail)


def test_proposer_takes_the_looked_up_token_only_when_it_is_likelier():
    from types import SimpleNamespace

    from faser.sampling_params import SamplingParams
    from faser.spec_decode.proposer import prefer_lookup

    def request(greedy: bool) -> SimpleNamespace:
        params = SamplingParams(temperature=0.0 if greedy else 1.0)
        lookup = PromptLookup()
        lookup.extend([1, 2, 3, 9, 1, 2, 3])  # what the proposer indexes before it drafts
        return SimpleNamespace(params=params, lookup=lookup)

    seqs = [request(True), request(True), request(True), request(False)]
    tails = [[1, 2, 3]] * 4  # each looks up 9, from a 3-gram
    tokens = [4, 4, 9, 4]
    confidences = [0.1, 0.9, 0.2, 0.1]
    taken = prefer_lookup(seqs, tails, tokens, confidences)
    assert tokens == [9, 4, 9, 4]  # unsure draft replaced; sure draft and sampled row kept
    assert confidences == [PRIOR_PRECISION, 0.9, PRIOR_PRECISION, 0.1]
    assert taken == [3, 0, 0, 0]
    # a draft known to be right when it says 0.1 keeps its token
    tokens, confidences = [4], [0.1]
    assert prefer_lookup(seqs[:1], tails[:1], tokens, confidences, lambda q: 0.95) == [0]
    assert tokens == [4]
    # and so does one facing 3-grams known to be wrong
    tokens, confidences = [4], [0.1]
    assert prefer_lookup(seqs[:1], tails[:1], tokens, confidences, None,
                         lambda n: 0.05 if n == 3 else 0.9) == [0]
    assert tokens == [4] and confidences == [0.1]
