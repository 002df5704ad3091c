"""One choice's output: detokenized deltas, stop tokens, stop strings, length limits."""

from northmk.engine.output import ChoiceOutput
from northmk.engine.types import FinishReason, SamplingParams, TokenLogprob
from northmk.tokenizer import IncrementalDetokenizer

EOS = 1009  # the tiny tokenizer's end-of-turn id


def choice(tokenizer, prompt_len=3, max_model_len=4096, **params):
    p = SamplingParams(**params)
    return ChoiceOutput(0, p, IncrementalDetokenizer(tokenizer, p.skip_special_tokens), (EOS,), prompt_len, max_model_len)


def run(out, ids):
    finished_at = None
    for i, t in enumerate(ids):
        if out.accept(t):
            finished_at = i
            break
    delta = out.take_delta()
    return delta, finished_at


def test_text_and_ids_accumulate_until_taken(tokenizer):
    ids = tokenizer.encode("hello world")
    out = choice(tokenizer, max_tokens=50)
    delta, finished = run(out, ids)
    assert finished is None
    assert delta.token_ids == ids and delta.text == "hello world" and delta.num_generated == len(ids)
    assert out.take_delta() is None


def test_eos_finishes_with_stop_and_is_not_in_the_text(tokenizer):
    ids = tokenizer.encode("hi") + [EOS, 5]
    delta, finished = run(choice(tokenizer), ids)
    assert finished == len(ids) - 2
    assert delta.finish_reason == FinishReason.STOP and delta.stop_reason is None
    assert delta.text == "hi" and delta.token_ids[-1] == EOS


def test_ignore_eos_keeps_generating(tokenizer):
    delta, finished = run(choice(tokenizer, ignore_eos=True, max_tokens=3), [EOS, EOS, EOS])
    assert finished == 2 and delta.finish_reason == FinishReason.LENGTH


def test_stop_token_id_reports_itself_as_stop_reason(tokenizer):
    stop = tokenizer.encode("x")[0]
    delta, _ = run(choice(tokenizer, stop_token_ids=[stop]), tokenizer.encode("ab") + [stop])
    assert delta.finish_reason == FinishReason.STOP and delta.stop_reason == stop and delta.text == "ab"


def test_stop_string_is_trimmed_and_reported(tokenizer):
    delta, _ = run(choice(tokenizer, stop=["STOP"], max_tokens=50), tokenizer.encode("hello STOP here"))
    assert delta.text == "hello " and delta.stop_reason == "STOP"


def test_stop_string_kept_with_include_stop_str_in_output(tokenizer):
    out = choice(tokenizer, stop=["STOP"], include_stop_str_in_output=True, max_tokens=50)
    delta, _ = run(out, tokenizer.encode("hello STOP here"))
    assert delta.text == "hello STOP"


def test_partial_stop_string_is_withheld_across_deltas(tokenizer):
    out = choice(tokenizer, stop=["STOP"], max_tokens=50)
    texts = []
    for t in tokenizer.encode("a ST then"):  # a | ' ' | S | T | ' t' | h | en
        out.accept(t)
        texts.append(out.take_delta().text)
    assert texts == ["a", " ", "", "", "ST t", "h", "en"]


def test_max_tokens_and_context_limit_finish_with_length(tokenizer):
    delta, finished = run(choice(tokenizer, max_tokens=2), [10, 11, 12])
    assert finished == 1 and delta.finish_reason == FinishReason.LENGTH
    delta, finished = run(choice(tokenizer, prompt_len=8, max_model_len=10, max_tokens=None), [10, 11, 12])
    assert finished == 1 and delta.finish_reason == FinishReason.LENGTH


def test_min_tokens_ignores_eos_and_stop_strings_until_reached(tokenizer):
    ids = tokenizer.encode("STOP") + [EOS]
    delta, finished = run(choice(tokenizer, stop=["STOP"], min_tokens=len(ids), max_tokens=50), ids + [EOS])
    assert finished == len(ids)  # the second EOS, the first one after min_tokens


def test_logprobs_travel_with_their_tokens(tokenizer):
    out = choice(tokenizer, logprobs=1, max_tokens=5)
    out.accept(10, TokenLogprob(10, -0.5, [(10, -0.5)]))
    delta = out.take_delta()
    assert delta.logprobs == [TokenLogprob(10, -0.5, [(10, -0.5)])]


def test_abort_reports_finish_once(tokenizer):
    out = choice(tokenizer)
    out.abort()
    assert out.take_delta().finish_reason == FinishReason.ABORT
    assert out.take_delta() is None
