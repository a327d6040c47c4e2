"""The chain index alone (no mitmproxy): which turn a request continues when
traffic is untidy: retries of turns left without an answer, the same request
sent twice, identical conversations, tool outputs between their calls, a
paused server tool loop; and tool-result digests keyed with the store's secret."""

from __future__ import annotations

import json

import pytest
from blake3 import blake3
from protocols_support import lift, lift_answer, sse_bytes
from stateful_responses.items import canonical_json
from stateful_responses.record.index import CHAIN_RESPONSES, CHAIN_TIPS, CHAIN_TURNS, ChainIndex, Turn
from stateful_responses.state.storage import SHARD_TAG_SIZE

URLS = {
    "openai-responses": "http://127.0.0.1/v1/responses",
    "openai-chat": "http://127.0.0.1/v1/chat/completions",
    "anthropic-messages": "http://127.0.0.1/v1/messages",
    "gemini-chat": "http://127.0.0.1/v1beta/models/g:streamGenerateContent?alt=sse",
}
SECRET = b"s" * 32


def begin(index: ChainIndex, protocol: str, body: dict, secret: bytes = SECRET) -> Turn:
    """A request on its way upstream, as the glue starts it."""
    turn = index.begin(lift(protocol, URLS[protocol], json.dumps(body).encode()), b"credential", secret,
                       flow_id="flow", upstream="http://upstream")
    index.claim(turn)
    return turn


def answered(index: ChainIndex, turn: Turn, protocol: str, answer: dict) -> Turn:
    index.finish(turn, lift_answer(protocol, json.dumps(answer).encode(), sse=False))
    return turn


def responses_answer(*output: dict) -> dict:
    return {"id": f"resp_{len(output)}", "status": "completed", "output": list(output)}


def said(text: str, item_id: str = "msg_1") -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call(n: int) -> dict:
    return {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": "get_weather",
            "arguments": json.dumps({"city": f"City{n}"})}


def output(n: int) -> dict:
    return {"type": "function_call_output", "call_id": f"call_{n}", "output": json.dumps({"temp": 20 + n})}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def chat(*messages: dict) -> dict:
    return {"model": "m", "messages": list(messages)}


def chat_answer(text: str) -> dict:
    return {"id": "chatcmpl-1", "choices": [{"index": 0, "finish_reason": "stop",
                                             "message": {"role": "assistant", "content": text}}]}


def test_a_retry_of_a_turn_left_without_an_answer_continues_its_chain():
    index = ChainIndex()
    opening = begin(index, "openai-chat", chat(user("hi")))
    index.finish(opening, None)  # a 500: no answer
    retried = answered(index, begin(index, "openai-chat", chat(user("hi"))), "openai-chat", chat_answer("hello"))
    assert retried.chain_id == opening.chain_id

    second = chat(user("hi"), {"role": "assistant", "content": "hello"}, user("more"))
    failed = begin(index, "openai-chat", second)
    answered(index, failed, "openai-chat", {"error": {"message": "overloaded"}})  # an error body: a dead end
    retry = answered(index, begin(index, "openai-chat", second), "openai-chat", chat_answer("more it is"))
    assert (retry.chain_id, retry.previous.turn_id, retry.fork) == (opening.chain_id, retried.turn_id, False)
    assert failed.record()["previousTurnId"] == retried.turn_id and failed.chain_id == opening.chain_id
    assert retry.record()["stickyScope"] == "conversation"


def opened_and_asked_again(protocol: str) -> tuple[dict, dict]:
    """A protocol's opening request, and the request that goes on from its answer ``hello``."""
    if protocol == "gemini-chat":
        def content(role: str, text: str) -> dict:
            return {"role": role, "parts": [{"text": text}]}
        return ({"contents": [content("user", "hi")]},
                {"contents": [content("user", "hi"), content("model", "hello"), content("user", "more")]})
    body = {"model": "m", "max_tokens": 64}
    return ({**body, "messages": [user("hi")]},
            {**body, "messages": [user("hi"), {"role": "assistant", "content": "hello"}, user("more")]})


def streamed_answer(protocol: str, text: str, ended: bool = True) -> bytes:
    """A streamed answer of ``text``; one that stopped before it ended, when not ``ended``."""
    if protocol == "openai-chat":
        events = [{"id": "chatcmpl-1", "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}}]}]
        end = [{"id": "chatcmpl-1", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}, "[DONE]"]
    elif protocol == "anthropic-messages":
        events = [("message_start", {"type": "message_start", "message": {
                      "id": "msg_1", "type": "message", "role": "assistant", "content": [], "stop_reason": None}}),
                  ("content_block_start", {"type": "content_block_start", "index": 0,
                                           "content_block": {"type": "text", "text": ""}}),
                  ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                           "delta": {"type": "text_delta", "text": text}})]
        end = [("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}),
               ("message_stop", {"type": "message_stop"})]
    else:
        events = [{"candidates": [{"content": {"role": "model", "parts": [{"text": text}]}, "index": 0}],
                   "responseId": "r1"}]
        end = [{"candidates": [{"content": {"role": "model", "parts": []}, "finishReason": "STOP", "index": 0}],
                "responseId": "r1"}]
    return sse_bytes(events + (end if ended else []))


@pytest.mark.parametrize("protocol", ["openai-chat", "anthropic-messages", "gemini-chat"])
def test_a_stream_that_stopped_before_its_end_is_a_dead_end_and_its_retry_continues_the_chain(protocol):
    index = ChainIndex()
    opening, second = opened_and_asked_again(protocol)
    first = begin(index, protocol, opening)
    index.finish(first, lift_answer(protocol, streamed_answer(protocol, "hello"), sse=True))
    cut = begin(index, protocol, second)
    stopped = lift_answer(protocol, streamed_answer(protocol, "the start of an answer", ended=False), sse=True)
    assert stopped.status == "unknown" and stopped.messages  # what came is there, but it never ended
    index.finish(cut, stopped)
    retry = begin(index, protocol, second)
    assert (retry.chain_id, retry.previous.turn_id, retry.fork) == (first.chain_id, first.turn_id, False)
    assert (cut.chain_id, cut.record()["previousTurnId"]) == (first.chain_id, first.turn_id)


def test_a_refused_anthropic_turn_is_a_dead_end_and_the_conversation_goes_on_from_the_turn_before():
    index = ChainIndex()
    opening, second = opened_and_asked_again("anthropic-messages")
    first = answered(index, begin(index, "anthropic-messages", opening), "anthropic-messages", {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [{"type": "text", "text": "hello"}],
        "stop_reason": "end_turn"})
    refused = answered(index, begin(index, "anthropic-messages", second), "anthropic-messages", {
        "id": "msg_2", "type": "message", "role": "assistant", "content": [{"type": "text", "text": "I can't"}],
        "stop_reason": "refusal"})
    again = begin(index, "anthropic-messages", second)  # sent again without the refused turn, as the API asks
    assert (again.chain_id, again.previous.turn_id, again.fork) == (first.chain_id, first.turn_id, False)
    assert refused.chain_id == first.chain_id


def test_an_answer_out_of_tokens_is_continued_and_the_same_request_again_is_its_retry():
    index = ChainIndex()
    first = answered(index, begin(index, "openai-chat", chat(user("hi"))), "openai-chat", chat_answer("hello"))
    history = [user("hi"), {"role": "assistant", "content": "hello"}, user("more")]
    short = {"id": "chatcmpl-2", "choices": [{"index": 0, "finish_reason": "length",
                                             "message": {"role": "assistant", "content": "cut sh"}}]}
    cut = answered(index, begin(index, "openai-chat", chat(*history)), "openai-chat", short)
    go_on = begin(index, "openai-chat", chat(*history, {"role": "assistant", "content": "cut sh"}, user("go on")))
    assert (go_on.previous.turn_id, go_on.chain_id, go_on.fork) == (cut.turn_id, first.chain_id, False)
    index.finish(go_on, None)
    retry = begin(index, "openai-chat", chat(*history))  # or asked again, with more tokens
    assert (retry.previous.turn_id, retry.chain_id, retry.fork) == (first.turn_id, first.chain_id, False)


def test_a_retry_racing_its_first_attempt_stays_on_the_chain_and_two_answers_still_fork():
    index = ChainIndex()
    first = answered(index, begin(index, "openai-chat", chat(user("hi"))), "openai-chat", chat_answer("hello"))
    body = chat(user("hi"), {"role": "assistant", "content": "hello"}, user("more"))
    attempt = begin(index, "openai-chat", body)
    again = begin(index, "openai-chat", body)  # the client gave up waiting; the attempt is still on its way
    assert (attempt.chain_id, again.chain_id, again.fork) == (first.chain_id, first.chain_id, False)
    answered(index, attempt, "openai-chat", chat_answer("one answer"))
    answered(index, again, "openai-chat", chat_answer("another answer"))  # both reached the client
    assert attempt.chain_id == first.chain_id
    assert again.chain_id != first.chain_id and again.record()["stickyScope"] == "request"
    assert again.record()["resumeFrom"]["turnId"] == first.turn_id


def test_a_different_continuation_of_an_answered_turn_is_a_fork():
    index = ChainIndex()
    first = answered(index, begin(index, "openai-chat", chat(user("hi"))), "openai-chat", chat_answer("hello"))
    history = [user("hi"), {"role": "assistant", "content": "hello"}]
    on = answered(index, begin(index, "openai-chat", chat(*history, user("one way"))), "openai-chat", chat_answer("a"))
    other = begin(index, "openai-chat", chat(*history, user("another way")))
    assert on.chain_id == first.chain_id and (other.fork, other.previous.turn_id) == (True, first.turn_id)
    assert other.chain_id != first.chain_id


def test_identical_openings_are_told_apart_by_the_item_ids_their_clients_echo():
    index = ChainIndex()
    a1 = answered(index, begin(index, "openai-responses", {"input": [user("hi")]}), "openai-responses",
                  responses_answer(said("hello", "msg_a")))
    b1 = answered(index, begin(index, "openai-responses", {"input": [user("hi")]}), "openai-responses",
                  responses_answer(said("hello", "msg_b")))
    b2 = begin(index, "openai-responses", {"input": [user("hi"), said("hello", "msg_b"), user("b again")]})
    a2 = begin(index, "openai-responses", {"input": [user("hi"), said("hello", "msg_a"), user("a again")]})
    assert (b2.previous.turn_id, b2.chain_id, b2.fork) == (b1.turn_id, b1.chain_id, False)
    assert (a2.previous.turn_id, a2.chain_id, a2.fork) == (a1.turn_id, a1.chain_id, False)


def test_identical_openings_without_ids_go_on_from_the_turns_still_at_their_tips():
    index = ChainIndex()
    history = [user("hi"), {"role": "assistant", "content": "hello"}]
    a1 = answered(index, begin(index, "openai-chat", chat(user("hi"))), "openai-chat", chat_answer("hello"))
    b1 = answered(index, begin(index, "openai-chat", chat(user("hi"))), "openai-chat", chat_answer("hello"))
    a2 = answered(index, begin(index, "openai-chat", chat(*history, user("a"))), "openai-chat", chat_answer("x"))
    b2 = begin(index, "openai-chat", chat(*history, user("b")))
    assert (a2.previous.turn_id, a2.chain_id) == (a1.turn_id, a1.chain_id)
    assert (b2.previous.turn_id, b2.chain_id, b2.fork) == (b1.turn_id, b1.chain_id, False)


def test_outputs_between_their_calls_answer_them_all_and_continue_the_answer_that_made_them():
    index = ChainIndex()
    opening = answered(index, begin(index, "openai-responses", {"input": [user("weather?")]}), "openai-responses",
                       responses_answer(call(1), call(2)))
    interleaved = begin(index, "openai-responses",
                        {"input": [user("weather?"), call(1), output(1), call(2), output(2)]})
    assert (interleaved.previous.turn_id, interleaved.chain_id) == (opening.turn_id, opening.chain_id)
    assert [r.call_id for r in interleaved.submitted] == ["call_1", "call_2"]
    answered(index, interleaved, "openai-responses", responses_answer(call(3)))
    # the next step of the loop: only the newest call is answered now
    history = [user("weather?"), call(1), output(1), call(2), output(2), call(3), output(3)]
    step = begin(index, "openai-responses", {"input": history})
    assert (step.previous.turn_id, step.chain_id) == (interleaved.turn_id, opening.chain_id)
    assert [r.call_id for r in step.submitted] == ["call_3"]
    assert step.record()["toolContinuation"]["mode"] == "tool_outputs"


def test_a_paused_server_tool_turn_is_continued_by_its_resend_as_a_server_tool_followup():
    index = ChainIndex()
    blocks = [{"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "q"}}]
    body = {"model": "m", "max_tokens": 64, "messages": [user("search")]}
    paused = answered(index, begin(index, "anthropic-messages", body), "anthropic-messages",
                      {"id": "msg_1", "type": "message", "role": "assistant", "content": blocks,
                       "stop_reason": "pause_turn"})
    resend = begin(index, "anthropic-messages", {**body, "messages": [user("search"),
                                                                      {"role": "assistant", "content": blocks}]})
    record = resend.record()
    assert (record["previousTurnId"], record["chainId"], record["stickyScope"]) == \
        (paused.turn_id, paused.chain_id, "conversation")
    assert (record["toolContinuation"]["mode"], record["stateOrigin"]) == ("servertool_followup", "servertool-followup")


def test_tool_result_digests_are_keyed_with_the_stores_secret():
    body = {"input": [user("weather?"), call(1), output(1)]}

    def digest(secret: bytes) -> str:
        return begin(ChainIndex(), "openai-responses", body, secret).record()["toolContinuation"][
            "resumeOutputs"][0]["digest"]

    assert digest(SECRET) == digest(SECRET) != digest(b"t" * 32)
    unkeyed = blake3(canonical_json(output(1)["output"])).hexdigest(16)
    assert digest(SECRET) != unkeyed  # holding the record file, one cannot confirm a guess of the result


def test_responses_in_a_conversation_are_its_chain_on_every_proxy_and_at_once_never_fork():
    index, replica = ChainIndex(), ChainIndex()
    body = {"input": [user("hi")], "conversation": "conv_1"}
    first = answered(index, begin(index, "openai-responses", body), "openai-responses", responses_answer(call(1)))
    record = first.record()
    assert (record["stickyScope"], record["resumeFrom"]["conversationId"]) == ("conversation", "conv_1")
    left = begin(index, "openai-responses", {"input": [output(1)], "conversation": {"id": "conv_1"}})
    right = begin(index, "openai-responses", {"input": [user("meanwhile")], "conversation": "conv_1"})
    for turn in (left, right):  # both on their way before either answered
        assert (turn.chain_id, turn.previous.turn_id, turn.fork) == (first.chain_id, first.turn_id, False)
    assert [r.call_id for r in left.submitted] == ["call_1"]
    answered(index, left, "openai-responses", responses_answer(said("done")))
    answered(index, right, "openai-responses", responses_answer(said("also done", "msg_2")))
    assert left.chain_id == right.chain_id == first.chain_id  # no branch: both joined the conversation
    elsewhere = begin(replica, "openai-responses", body)  # another proxy of the same store, memory empty
    assert elsewhere.chain_id == first.chain_id and elsewhere.unresolved and replica.table_of(elsewhere) == \
        "chain-responses"
    replica.resolve(elsewhere, {key: value for write in index.take_writes()
                                if (key := write.key) in elsewhere.unresolved and (value := write.value)})
    assert elsewhere.previous.turn_id == right.turn_id  # the conversation's newest turn
    other = begin(index, "openai-responses", {"input": [user("hi")], "conversation": "conv_2"})
    assert other.chain_id != first.chain_id and other.previous is None


def test_a_turns_records_and_its_chains_tip_share_their_credentials_shard_and_another_replica_reads_them():
    index = ChainIndex()
    opening = {"model": "m", "input": [user("hi")]}
    first = answered(index, begin(index, "openai-responses", opening), "openai-responses",
                     responses_answer(said("hello")))
    stranger = index.begin(lift("openai-responses", URLS["openai-responses"], json.dumps(opening).encode()),
                           b"another credential", SECRET, flow_id="flow", upstream="http://upstream")
    index.claim(stranger)
    store: dict[str, dict[bytes, bytes]] = {}
    for write in index.take_writes():
        store.setdefault(write.table, {})[write.key] = write.value
    assert {table: {key[:SHARD_TAG_SIZE] for key in keys} for table, keys in store.items()} == \
        {CHAIN_TURNS: {first.shard}, CHAIN_RESPONSES: {first.shard}, CHAIN_TIPS: {first.shard, stranger.shard}}
    assert first.shard != stranger.shard

    replica = ChainIndex()  # another proxy: everything from the store
    follow_up = {"model": "m", "input": [user("hi"), said("hello"), user("more")]}
    turn = replica.begin(lift("openai-responses", URLS["openai-responses"], json.dumps(follow_up).encode()),
                         b"credential", SECRET, flow_id="flow 2", upstream="http://upstream")
    replica.resolve(turn, {k: v for k, v in store[replica.table_of(turn)].items() if k in turn.unresolved})
    replica.learn_tips(turn, {k: v for k, v in store[CHAIN_TIPS].items() if k in replica.unknown_tips(turn)})
    assert (turn.previous.turn_id, turn.chain_id, turn.fork) == (first.turn_id, first.chain_id, False)


def test_a_whole_history_resent_after_turns_continued_by_id_continues_the_last_of_them():
    index = ChainIndex()
    body = {"model": "m", "input": [user("one")]}
    first = answered(index, begin(index, "openai-responses", body), "openai-responses",
                     {"id": "resp_a", "status": "completed", "output": [said("a", "msg_a")]})
    by_id = answered(index, begin(index, "openai-responses", {"model": "m", "input": [user("two")],
                                                                "previous_response_id": "resp_a"}),
                     "openai-responses", {"id": "resp_b", "status": "completed", "output": [said("b", "msg_b")]})
    whole = [user("one"), said("a", "msg_a"), user("two"), said("b", "msg_b"), user("three")]
    resent = begin(index, "openai-responses", {"model": "m", "input": whole})
    assert by_id.previous is not None and by_id.previous.turn_id == first.turn_id
    assert resent.previous is not None and resent.previous.turn_id == by_id.turn_id
    assert resent.chain_id == first.chain_id and not resent.fork
