"""Stop strings: withheld while they might still match, trimmed when they do."""

from northmk.engine.stops import StopStringMatcher


def feed(matcher, deltas):
    return [matcher.push(d) for d in deltas]


def test_text_without_stop_prefixes_is_released_at_once():
    m = StopStringMatcher(["STOP"])
    assert feed(m, ["hello ", "world"]) == ["hello ", "world"]


def test_possible_stop_prefix_is_withheld_then_released_when_ruled_out():
    m = StopStringMatcher(["STOP"])
    assert feed(m, ["ab S", "T", "x"]) == ["ab ", "", "STx"]


def test_match_across_deltas_is_trimmed_and_reported():
    m = StopStringMatcher(["STOP"])
    assert feed(m, ["ab S", "TO", "Pzz"]) == ["ab ", "", ""]
    assert m.matched == "STOP"
    assert m.flush() == ""


def test_include_stop_keeps_the_stop_string():
    m = StopStringMatcher(["STOP"], include_stop=True)
    assert feed(m, ["ab ST", "OP and more"]) == ["ab ", "STOP"]


def test_earliest_of_several_stops_wins():
    m = StopStringMatcher(["cd", "abc"])
    assert feed(m, ["xabcd"]) == ["x"]
    assert m.matched == "abc"


def test_flush_releases_withheld_text_on_other_finish():
    m = StopStringMatcher(["END"])
    assert feed(m, ["done E", "N"]) == ["done ", ""]
    assert m.flush() == "EN"


def test_unchecked_push_releases_everything_and_later_matches_start_after_it():
    m = StopStringMatcher(["ab"])
    assert m.push("xa", check=False) == "xa"
    assert m.push("b") == "b"  # "ab" would straddle released text: not a match
    assert m.push("ab") == ""
    assert m.matched == "ab"
