"""Instruction data is pure: records → (piece, trains) segments → ids with a loss mask; and the mask's way
through the Parquet rows into the labels and the evaluation sums."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparklm.data.instruct import (
    ASSISTANT,
    Record,
    RecordError,
    TemplateError,
    chat_record,
    frame,
    instruction_record,
    segments,
)
from sparklm.data.stream import TokenStream, read_rows, row_groups, validation_rows
from sparklm.model.task import IGNORE, make_batch
from sparklm.tasks.causal_lm import CausalLM

BOS, EOS = 1, 2
pieces_st = st.lists(st.tuples(st.lists(st.integers(3, 99), max_size=6), st.booleans()), max_size=8)


@settings(max_examples=300, deadline=None)
@given(pieces=pieces_st, bos=st.sampled_from([BOS, None]), eos=st.sampled_from([EOS, None]))
def test_the_mask_is_one_exactly_on_response_tokens_and_the_final_eos(pieces, bos, eos):
    ids, mask = frame([p for p, _ in pieces], [t for _, t in pieces], bos_id=bos, eos_id=eos)
    body = [tok for p, _ in pieces for tok in p]
    body_mask = [int(t) for p, t in pieces for _ in p]
    assert len(ids) == len(mask)
    head = [] if bos is None else [bos]
    tail = [] if eos is None else [eos]
    assert ids == head + body + tail  # order kept, specials only where asked
    last_trains = bool(pieces) and pieces[-1][1]
    assert mask == [0] * len(head) + body_mask + [int(last_trains)] * len(tail)  # BOS never trains
    assert sum(mask) == sum(len(p) for p, t in pieces if t) + (eos is not None and last_trains)
    assert set(mask) <= {0, 1}


def test_frame_small_example():
    assert frame([[5, 6], [7]], [False, True], bos_id=BOS, eos_id=EOS) == ([1, 5, 6, 7, 2], [0, 0, 0, 1, 1])
    assert frame([[5], [7]], [True, False], bos_id=None, eos_id=EOS) == ([5, 7, 2], [1, 0, 0])
    assert frame([[5], [7]], [False, True], bos_id=None, eos_id=None) == ([5, 7], [0, 1])


# -- rendering ------------------------------------------------------------------------------------


def chatml(messages, add_generation_prompt):
    """A ChatML-like template (as Qwen's), written in Python: a default system turn, turns ended by <|im_end|>."""
    out = "" if messages[0]["role"] == "system" else "<|im_start|>system\nYou help.<|im_end|>\n"
    out += "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


text_st = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
conversation_st = st.lists(st.tuples(st.sampled_from(["system", "user", "assistant", "tool"]), text_st),
                           min_size=1, max_size=7).filter(lambda ms: ms[0][0] != ASSISTANT)


@settings(max_examples=200, deadline=None)
@given(messages=conversation_st)
def test_template_segments_train_exactly_the_assistant_turns(messages):
    record = Record(tuple(messages))
    pieces = segments(record, chatml)
    assert "".join(p for p, _ in pieces) == chatml([{"role": r, "content": c} for r, c in messages], False)
    trained = [p for p, t in pieces if t]
    # each assistant turn trains its content and the template's end of turn; nothing else does
    assert trained == [f"{c}<|im_end|>\n" for r, c in messages if r == ASSISTANT]
    assert all(p for p, _ in pieces)  # no empty pieces


@settings(max_examples=100, deadline=None)
@given(messages=conversation_st)
def test_without_a_template_contents_are_joined_as_they_are(messages):
    pieces = segments(Record(tuple(messages)))
    assert "".join(p for p, _ in pieces) == "".join(c for _, c in messages)
    assert [p for p, t in pieces if t] == [c for r, c in messages if r == ASSISTANT and c]


def test_an_instruction_record_with_a_template():
    record = instruction_record({"prompt": "2+2?", "response": "4", "id": 7}, "prompt", "response")
    assert segments(record, chatml) == [
        ("<|im_start|>system\nYou help.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", False),
        ("4<|im_end|>\n", True)]
    assert segments(record) == [("2+2?", False), ("4", True)]


def test_a_template_that_renders_a_turn_differently_later_is_refused():
    def last_turn_marked(messages, add_generation_prompt):  # like a template that strips earlier turns' thinking
        out = "".join(f"[{m['role']}]{m['content']}" + ("!" if i == len(messages) - 1 else "")
                      for i, m in enumerate(messages))
        return out + ("[assistant]" if add_generation_prompt else "")

    with pytest.raises(TemplateError, match="renders its first 1 message"):
        segments(Record((("user", "a"), ("assistant", "b"))), last_turn_marked)
    with pytest.raises(TemplateError, match="starts with an assistant message"):
        segments(Record((("assistant", "b"), ("user", "a"))), chatml)


def test_records_from_rows_and_their_errors():
    assert instruction_record({"q": "a", "r": None}, "q", "r") == Record((("user", "a"), ("assistant", "")))
    assert not instruction_record({"q": "a", "r": None}, "q", "r").trains  # a null response: empty, dropped
    with pytest.raises(RecordError, match=r"has no 'prompt' field \(fields: question, answer\)"):
        instruction_record({"question": "a", "answer": "b"}, "prompt", "response")
    with pytest.raises(RecordError, match="has a number in 'response', not text"):
        instruction_record({"prompt": "a", "response": 4}, "prompt", "response")
    rec = chat_record({"messages": '[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]'},
                      "messages")  # CSV holds the list as JSON text
    assert rec.messages == (("user", "hi"), ("assistant", "yo")) and rec.trains
    assert rec.key() != Record((("assistant", "hi"), ("user", "yo"))).key()  # roles count in the hash
    with pytest.raises(RecordError, match="has no 'messages' field"):
        chat_record({"text": "x"}, "messages")
    with pytest.raises(RecordError, match="message 2 in 'messages' without a string 'role' and 'content'"):
        chat_record({"messages": [{"role": "user", "content": "a"}, {"content": "b"}]}, "messages")
    with pytest.raises(RecordError, match="an object in 'messages', not a list"):
        chat_record({"messages": {"role": "user"}}, "messages")
    assert not chat_record({"messages": None}, "messages").trains


def test_a_prompt_of_several_fields_joins_the_non_empty_ones():
    """Tried as a Hub user would: Alpaca records ({"instruction", "input", "output"}) could give one prompt field
    only, so `--prompt-field instruction` dropped every "input" without a word. `--prompt-field instruction,input`
    joins the fields present and non-empty with a blank line, in the order named."""
    alpaca = {"instruction": "Translate", "input": "chat", "output": "cat"}
    assert instruction_record(alpaca, "instruction,input", "output").messages == (
        ("user", "Translate\n\nchat"), ("assistant", "cat"))
    for empty in ("", None):
        assert instruction_record({**alpaca, "input": empty}, "instruction, input", "output").messages[0] == (
            "user", "Translate")
    with pytest.raises(RecordError, match=r"has no 'context' field"):
        instruction_record(alpaca, "instruction,context", "output")
    with pytest.raises(RecordError, match=r"has no 'prompt' field \(fields: instruction, input, output\); Alpaca's "
                                          r"records: --prompt-field instruction,input --response-field output"):
        instruction_record(alpaca, "prompt", "response")


def test_sharegpt_conversations_are_chat_records():
    """Tried as a Hub user would: ShareGPT records ({"from": "human" | "gpt" | "system", "value": ...}, the layout
    of many chat datasets on the Hub) were "message 1 ... without a string 'role' and 'content'"."""
    rec = chat_record({"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
                                         {"from": "gpt", "value": "yo"}]}, "conversations")
    assert rec.messages == (("system", "be brief"), ("user", "hi"), ("assistant", "yo")) and rec.trains
    assert chat_record({"m": [{"from": "tool", "value": "42"}]}, "m").messages == (("tool", "42"),)
    with pytest.raises(RecordError, match="message 1 in 'm' without a string 'role' and 'content' \\(or ShareGPT's "
                                          "'from' and 'value'\\)"):
        chat_record({"m": [{"from": "human"}]}, "m")
    with pytest.raises(RecordError, match="message 1 in 'm' without a string 'role'"):
        chat_record({"m": [{"from": ["human"], "value": "x"}]}, "m")


# -- the loss mask read back, into labels and evaluation sums -------------------------------------------


def test_rows_carry_the_loss_mask_through_stream_and_validation(tmp_path):
    seq = 4
    ids = np.arange(40 * seq, dtype=np.int64).reshape(-1, seq)
    loss = (ids % 3 == 0).astype(np.int8)  # a function of the id: alignment is checkable after shuffling
    table = pa.table({"input_ids": pa.array(list(ids), type=pa.list_(pa.int32())),
                      "loss_mask": pa.array(list(loss), type=pa.list_(pa.int8()))})
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=7)
    groups = row_groups([str(tmp_path / "p.parquet")])
    rows = read_rows(groups[0], seq)
    assert rows.attention_mask is None and rows.loss_mask.tolist() == loss[:7].tolist()
    it = iter(TokenStream(groups, seq_len=seq, batch_size=3, seed=1, window=2))
    for _ in range(20):  # across windows and an epoch
        batch = next(it)
        assert np.array_equal(batch.loss_mask, (batch.input_ids % 3 == 0).astype(np.int8))
    val = list(validation_rows(groups, seq_len=seq, rank=1, world=2, limit=9))
    got = np.concatenate([r.input_ids for r in val])
    assert len(got) == 9 and all(np.array_equal(r.loss_mask, (r.input_ids % 3 == 0)) for r in val)


def test_labels_and_eval_sums_count_only_where_the_loss_mask_is_one():
    ids = np.array([[5, 6, 7, 8, 9]], dtype=np.int64)
    attention = np.array([[1, 1, 1, 1, 0]], dtype=np.int8)
    loss = np.array([[0, 0, 1, 1, 1]], dtype=np.int8)
    batch = make_batch(ids, attention, loss)
    assert batch.labels.tolist() == [[IGNORE, IGNORE, 7, 8, IGNORE]]  # prompt and padding: no loss
    assert make_batch(ids, None, loss).labels.tolist() == [[IGNORE, IGNORE, 7, 8, 9]]
    assert make_batch(ids, None, None).labels.tolist() == ids.tolist()

    class Uniform(torch.nn.Module):  # logits that predict nothing: every target costs ln(V)
        def forward(self, input_ids, attention_mask):
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, 16)})()

    sums = CausalLM().eval_sums(Uniform(), batch, torch.ones(16, dtype=torch.float64))
    assert sums[1].item() == 2  # targets 7 and 8: the loss mask of the predicted token decides
    assert sums[0].item() == pytest.approx(2 * np.log(16))
