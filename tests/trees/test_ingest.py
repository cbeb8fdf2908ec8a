import json

import numpy as np
import pytest

from harts.cli.main import main
from harts.trees.ingest import ByteTokenizer, ingest_messages, render
from harts.trees.io import TrajectoryFormatError, read_step
from harts.trees.trie import PrefixIndex

SAMPLES = "data/samples"


def test_sample_round_trip(tmp_path, capsys):
    out = tmp_path / "step.jsonl"
    assert main(["trees", "ingest", "--format", "messages", "--tokenizer", "byte", f"{SAMPLES}/messages.jsonl", str(out)]) == 0
    step = read_step(out)
    committed = read_step(f"{SAMPLES}/messages-byte.jsonl")
    assert step.ids == committed.ids
    np.testing.assert_array_equal(step.tokens, committed.tokens)
    np.testing.assert_array_equal(step.loss_mask, committed.loss_mask)
    assert step.trees == ("repo-a__issue-12", "repo-a__issue-12", "repo-b__issue-7", "repo-b__issue-7")
    text = bytes(t for t in step.trajectory_tokens(0).tolist() if t < 256).decode()
    assert "parse_duration" in text


def test_shared_message_prefix_shares_tokens():
    step = ingest_messages(f"{SAMPLES}/messages.jsonl", ByteTokenizer())
    records = [json.loads(line) for line in open(f"{SAMPLES}/messages.jsonl")]
    index = PrefixIndex.from_step(step)
    tokenizer = ByteTokenizer()
    for a in range(len(records)):
        for b in range(a + 1, len(records)):
            common = 0
            for x, y in zip(records[a]["messages"], records[b]["messages"]):
                if x != y:
                    break
                common += 1
            prefix_tokens, _ = render(records[a]["messages"][:common], tokenizer, "t") if common else ([], None)
            assert index.lcp_of(a, b) >= len(prefix_tokens)
            if common:
                assert index.lcp_of(a, b) < step.lengths[a]


def test_loss_mask_is_assistant_content():
    tokenizer = ByteTokenizer()
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "uu"},
        {"role": "assistant", "content": "aaa"},
        {"role": "tool", "content": "t"},
    ]
    tokens, mask = render(messages, tokenizer, "x")
    # header(role) = <|im_start|> + role + "\n"; body = content + <|im_end|> + "\n".
    trained = bytes(t for t, m in zip(tokens.tolist(), mask.tolist()) if m and t < 256)
    assert trained == b"aaa\n"
    assert int(mask.sum()) == len("aaa") + 2
    assert mask[0] == 0


def test_real_swe_agent_logs(tmp_path):
    step = ingest_messages(f"{SAMPLES}/swe-agent", ByteTokenizer())
    assert step.num_trajectories == 2
    assert step.ids == ("test-repo-default", "test-repo-function-calling")
    assert step.num_semantic_tokens > 50_000
    assert 0.05 < step.loss_mask.mean() < 0.5
    assert step.tokens.max() < ByteTokenizer.vocab_size


@pytest.mark.parametrize("record, fragment", [
    ({"messages": [{"role": "robot", "content": "x"}]}, "field 'role'"),
    ({"messages": [{"role": "user"}]}, "field 'content': missing"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "content[0]"),
    ({"history": "nope"}, "field 'history'"),
    ({"turns": []}, "field 'messages': missing"),
    ({"id": 5, "messages": [{"role": "user", "content": "x"}]}, "field 'id'"),
    ({"messages": []}, "empty conversation"),
])
def test_bad_messages(tmp_path, record, fragment):
    path = tmp_path / "logs.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(TrajectoryFormatError) as error:
        ingest_messages(path, ByteTokenizer())
    assert fragment in str(error.value) and "logs.jsonl:1" in str(error.value)


def test_tokenizer_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(set("abcdefghijklmnopqrstuvwxyz<|>_ \n")))}
    vocab["[UNK]"] = len(vocab)
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    logs = tmp_path / "logs.jsonl"
    logs.write_text("\n".join(json.dumps({"id": f"r{i}", "messages": [
        {"role": "user", "content": "fix the bug"}, {"role": "assistant", "content": f"done {c}"}]}) for i, c in enumerate("ab")) + "\n")
    out = tmp_path / "out.npz"
    assert main(["trees", "ingest", "--format", "messages", "--tokenizer", str(path), str(logs), str(out)]) == 0
    step = read_step(out)
    assert step.num_trajectories == 2
    # The two differ at the last content character, before the 11-character "<|im_end|>\n" footer.
    assert PrefixIndex.from_step(step).lcp_of(0, 1) == len(step.trajectory_tokens(0)) - 12
