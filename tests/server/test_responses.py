"""Response bodies from RequestOutputs (no server): OpenAI's completions and chat logprobs shapes,
echo, several choices, usage summed over them, and stream chunks per choice."""

from __future__ import annotations

from kvfit.engine.output import CompletionOutput, Logprob, RequestOutput
from kvfit.sampling_params import SamplingParams
from kvfit.server.params import GenerateInput
from kvfit.server.responses import ResponseBuilder, completion_logprobs


class Chars:
    """Token i is chr(i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)

    def token_text(self, token_id):
        return chr(token_id)


A, B, C, X = ord("a"), ord("b"), ord("c"), ord("x")


def step(chosen: int, logprob: float, *others: tuple[int, float]) -> dict[int, Logprob]:
    entries = {chosen: Logprob(logprob, None, chr(chosen))}
    entries.update({t: Logprob(lp, None, chr(t)) for t, lp in others})
    ranked = sorted(entries.items(), key=lambda e: -e[1].logprob)
    return {t: Logprob(lp.logprob, rank, lp.decoded_token) for rank, (t, lp) in enumerate(ranked, 1)}


def builder(chat=False, top_logprobs=None, echo=False, stream=False, stop=(), include_usage=False, echo_text=None,
            prompt_logprobs=False, continuous_usage=False):
    inp = GenerateInput([X, X], SamplingParams(stop=stop), True, stream, include_usage, echo=echo,
                        echo_text=echo_text, top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
                        continuous_usage=continuous_usage)
    return ResponseBuilder(chat, "m", inp, Chars())


def output(*samples: CompletionOutput, finished=True, prompt_logprobs=None) -> RequestOutput:
    return RequestOutput("r", "xx", [X, X], prompt_logprobs, list(samples), finished)


SAMPLE = CompletionOutput(0, "ab", [A, B], -1.5, [step(A, -0.5, (C, -1.0)), step(B, -1.0, (C, -0.25))],
                          "length", None)


def test_completion_logprobs_shape():
    lp = completion_logprobs([A, B], SAMPLE.logprobs, 1, Chars().decode and builder().text_of)
    assert lp == {"tokens": ["a", "b"], "token_logprobs": [-0.5, -1.0],
                  "top_logprobs": [{"a": -0.5}, {"c": -0.25, "b": -1.0}], "text_offset": [0, 1]}


def test_full_completion_with_echo_and_logprobs():
    body = builder(top_logprobs=1, echo=True, prompt_logprobs=True).full(
        output(SAMPLE, prompt_logprobs=[None, step(X, -2.0)]), 2)
    choice = body["choices"][0]
    assert choice["text"] == "xxab"
    assert choice["logprobs"] == {"tokens": ["x", "x", "a", "b"], "token_logprobs": [None, -2.0, -0.5, -1.0],
                                  "top_logprobs": [None, {"x": -2.0}, {"a": -0.5}, {"c": -0.25, "b": -1.0}],
                                  "text_offset": [0, 1, 2, 3]}
    assert choice["prompt_logprobs"] == [None, {str(X): {"logprob": -2.0, "rank": 1, "decoded_token": "x"}}]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_full_chat_with_logprobs_and_two_choices():
    second = CompletionOutput(1, "c", [C], -3.0, [step(C, float("-inf"), (A, -0.1))], "stop", "\n")
    body = builder(chat=True, top_logprobs=1).full(output(second, SAMPLE), 5)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    first = body["choices"][0]
    assert first["message"] == {"role": "assistant", "content": "ab", "refusal": None, "annotations": None,
                                "audio": None, "function_call": None, "reasoning": None}     # vLLM's ChatMessage
    assert first["logprobs"]["content"][1] == {"token": "b", "logprob": -1.0, "bytes": [98],
                                              "top_logprobs": [{"token": "c", "logprob": -0.25, "bytes": [99]}]}
    last = body["choices"][1]
    assert last["logprobs"]["content"][0]["logprob"] == -9999.0          # -inf is not JSON
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", "\n")
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_chat_echo_repeats_the_assistant_message():
    body = builder(chat=True, echo=True, echo_text="Sure: ").full(output(SAMPLE), 2)
    assert body["choices"][0]["message"]["content"] == "Sure: ab"


def test_stream_chunks_per_choice_hold_back_a_possible_stop_string():
    b = builder(stream=True, stop=("bc",), top_logprobs=0)
    first = output(CompletionOutput(0, "ab", [A, B], None, SAMPLE.logprobs), CompletionOutput(1, "a", [A], None,
                   SAMPLE.logprobs[:1]), finished=False)
    chunks = b.chunks(first)
    # each choice holds back its last character (len("bc") - 1: it may begin the stop string) but
    # sends the logprobs of every new token; each chunk names its choice
    assert [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks] == [(0, "a"), (1, "")]
    assert [c["choices"][0]["logprobs"]["tokens"] for c in chunks] == [["a", "b"], ["a"]]
    done = output(CompletionOutput(0, "ab", [A, B], None, SAMPLE.logprobs, "length"),
                  CompletionOutput(1, "a", [A], None, SAMPLE.logprobs[:1], "stop", 2))
    chunks = b.chunks(done)
    assert [(c["choices"][0]["index"], c["choices"][0]["text"], c["choices"][0]["finish_reason"])
            for c in chunks] == [(0, "b", "length"), (1, "a", "stop")]
    assert chunks[0]["choices"][0]["logprobs"] is None                     # no new token
    assert chunks[1]["choices"][0]["stop_reason"] == 2
    assert b.chunks(done) == []                                            # a finished choice says nothing more


def test_chat_stream_opens_each_choice_with_its_role_and_echo_once():
    b = builder(chat=True, stream=True, echo=True, echo_text="E")
    assert [c["choices"][0]["delta"] for c in b.role_chunks(2)] == [{"role": "assistant", "content": ""}]
    chunks = b.chunks(output(CompletionOutput(0, "a", [A]), finished=False))
    assert chunks[0]["choices"][0]["delta"] == {"content": "Ea"}
    chunks = b.chunks(output(CompletionOutput(0, "a", [A], finish_reason="stop")))
    assert chunks[0]["choices"][0]["delta"] == {} and chunks[0]["choices"][0]["finish_reason"] == "stop"


def test_continuous_usage_puts_the_usage_so_far_in_every_chunk():
    b = builder(chat=True, stream=True, include_usage=True, continuous_usage=True)
    assert b.role_chunks(2)[0]["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}
    chunk = b.chunks(output(CompletionOutput(0, "ab", [A, B]), finished=False))[0]
    assert chunk["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    plain = builder(stream=True, include_usage=True)
    assert "usage" not in plain.chunks(output(CompletionOutput(0, "a", [A]), finished=False))[0]     # as vLLM


def test_a_choice_that_begins_in_a_later_step_gets_its_first_chunk_then():
    # n > 1: the engine folds every child into one output, the ones not begun as empty samples; each choice's first
    # emitted chunk carries the prompt's token ids (return_token_ids) and echo's prefix, whenever it comes
    inp = GenerateInput([X, X], SamplingParams(n=2), True, True, False, echo=True, return_token_ids=True)
    b = ResponseBuilder(False, "m", inp, Chars())
    first = b.chunks(output(CompletionOutput(0, "a", [A]), CompletionOutput(1), finished=False))
    assert [c["choices"][0]["index"] for c in first] == [0]
    later = b.chunks(output(CompletionOutput(0, "ab", [A, B]), CompletionOutput(1, "c", [C]), finished=False))
    by_choice = {c["choices"][0]["index"]: c["choices"][0] for c in later}
    assert by_choice[1]["prompt_token_ids"] == [X, X] and by_choice[1]["text"] == "xxc"
    assert by_choice[1]["token_ids"] == [C] and "prompt_token_ids" not in by_choice[0]
    assert first[0]["choices"][0]["prompt_token_ids"] == [X, X] and first[0]["choices"][0]["text"] == "xxa"
