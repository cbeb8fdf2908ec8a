"""Chat-format agent logs -> trajectories (`harts trees ingest --format messages`).

Input: OpenAI-style message lists (`role` in system/user/assistant/tool, `content` a string or a
list of text parts; assistant `tool_calls` are kept as JSON text), as SWE-agent `.traj` files
(a JSON object with `history`) and OpenHands-style datasets publish them. Accepted files:
`.traj`/`.json` (one object with `history` or `messages`, or a bare message list) and
`.jsonl`/`.jsonl.gz` (one such object per line); a directory means all of them, by name.
A record's optional `id`, `tree` (or `instance_id`) and `reward` are kept; the default id is the
file stem (`stem:line` for JSONL), the default tree is the id, the default reward 0. Advantages are
the GRPO normalisation of rewards within each tree. A record may carry only the fields of
`RECORD_FIELDS`: the ones above and the metadata that SWE-agent `.traj` files carry next to
`history` (`environment`, `info`, `replay_config`, `trajectory`, read past); any other field is an
error, so a typo such as `rewrad` cannot silently zero a reward. Likewise a message may carry only
`MESSAGE_FIELDS`: `role`, `content`, `tool_calls` and, read past, the OpenAI fields `name` and
`tool_call_id` and SWE-agent's per-message metadata (`thought` and `action` repeat the content or the
tool call); a field that would carry text this rendering leaves out (`function_call`,
`reasoning_content`, ...) is an error, not dropped. A reward must be finite and fit
float32. Bad input raises `TrajectoryFormatError` naming the file, line and field (the readers of
harts.trees.io are shared: UTF-8, gzip and duplicate JSON keys are checked the same way).

Rendering (ChatML): each message is `<|im_start|>{role}\\n` + content + `<|im_end|>\\n`, and each
message is tokenised on its own, so trajectories with a common message prefix share their token
prefix exactly (the trie sees the sharing). Loss mask = the content and `<|im_end|>\\n` of
assistant messages. Tokenisers: a local `tokenizer.json` (the `tokenizers` package) or `byte`
(UTF-8 bytes 0-255, `<|im_start|>` = 256, `<|im_end|>` = 257).

Escaping: message content can never produce the marker tokens, so a log that contains the text
`<|im_end|>\\n<|im_start|>assistant` cannot forge a turn boundary. The byte tokenizer cannot emit
256/257 from bytes. A `tokenizer.json` must define both markers as special tokens (else it is
refused); the markers are inserted by id and content is encoded with the tokenizer's
`encode_special_tokens` on, so marker text in content becomes ordinary tokens, as any other text;
a content encoding that still contains a marker id (a vocabulary that maps text to it) is an error.
Tested in tests/trees/test_ingest.py (sample logs, bad inputs in tests/data/bad_inputs, a small
tokenizer.json with the two special tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from harts.trees.io import (
    TrajectoryFormatError, float_field, input_files, name_field, parse_json, read_lines, read_text,
)
from harts.trees.step import TOKEN_DTYPE, Step, grpo_advantages

ROLES = ("system", "user", "assistant", "tool")
INPUT_SUFFIXES = (".traj", ".json", ".jsonl", ".jsonl.gz")
MARKERS = ("<|im_start|>", "<|im_end|>")
RECORD_FIELDS = (
    "id", "tree", "instance_id", "reward", "messages", "history",
    "environment", "info", "replay_config", "trajectory",
)
MESSAGE_FIELDS = (
    "role", "content", "tool_calls",
    "name", "tool_call_id", "tool_call_ids", "agent", "message_type", "thought", "action", "is_demo",
)


class ByteTokenizer:
    """UTF-8 bytes plus two special tokens for the ChatML markers."""

    name = "byte"
    vocab_size = 258
    IM_START, IM_END = 256, 257

    def header(self, role: str) -> list[int]:
        return [self.IM_START, *f"{role}\n".encode()]

    def footer(self) -> list[int]:
        return [self.IM_END, *b"\n"]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class FileTokenizer:
    """A Hugging Face `tokenizer.json`, loaded with the `tokenizers` package.

    Both ChatML markers must be special tokens of the file: they are emitted by id, and content
    is encoded with special-token matching off, so marker text in content stays ordinary text.
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # the package raises plain Exceptions
            raise ValueError(f"{path}: cannot load tokenizer ({error})") from None
        special = {
            token.content: token_id
            for token_id, token in self._tokenizer.get_added_tokens_decoder().items() if token.special
        }
        for marker in MARKERS:
            if marker not in special:
                raise ValueError(
                    f"{path}: {marker!r} is not a special token of this tokenizer "
                    "(ChatML rendering needs <|im_start|> and <|im_end|> as special tokens)"
                )
        vocabulary = self._tokenizer.get_vocab(with_added_tokens=True)
        too_large = max(vocabulary.items(), key=lambda item: item[1], default=("", 0))
        if too_large[1] > np.iinfo(TOKEN_DTYPE).max:
            raise ValueError(
                f"{path}: token {too_large[0]!r} has id {too_large[1]:,}, more than a step's int32 tokens hold"
            )
        self.IM_START, self.IM_END = special[MARKERS[0]], special[MARKERS[1]]
        self._tokenizer.encode_special_tokens = True
        self.name = str(path)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        try:
            self._headers = {role: [self.IM_START, *self.encode(f"{role}\n")] for role in ROLES}
            self._footer = [self.IM_END, *self.encode("\n")]
        except Exception as error:  # the package raises plain Exceptions
            raise ValueError(f"{path}: cannot encode the ChatML role lines ({error})") from None

    def header(self, role: str) -> list[int]:
        return self._headers[role]

    def footer(self) -> list[int]:
        return self._footer

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids


def load_tokenizer(spec: str) -> ByteTokenizer | FileTokenizer:
    if spec == "byte":
        return ByteTokenizer()
    if not Path(spec).is_file():
        raise ValueError(f"{spec}: tokenizer is neither 'byte' nor an existing tokenizer.json file")
    return FileTokenizer(spec)


def _records(path: Path):
    """(where, default id, record) for every conversation in the file."""
    stem = path.name.split(".")[0]
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        empty = True
        for number, line in read_lines(path):
            if not line.strip():
                raise TrajectoryFormatError(f"{path}:{number}: empty line")
            empty = False
            yield f"{path}:{number}", f"{stem}:{number}", parse_json(line, path, number)
        if empty:
            raise TrajectoryFormatError(f"{path}: no conversations (empty file)")
    else:
        text = read_text(path)
        if not text.strip():
            raise TrajectoryFormatError(f"{path}: no conversation (empty file)")
        yield str(path), stem, parse_json(text, path)


def _messages(record: object, where: str) -> list:
    if isinstance(record, list):
        return record
    if isinstance(record, dict):
        for key in ("messages", "history"):
            if key in record:
                messages = record[key]
                if not isinstance(messages, list):
                    raise TrajectoryFormatError(f"{where}: field '{key}': expected a list of messages")
                return messages
        raise TrajectoryFormatError(f"{where}: field 'messages': missing (expected 'messages' or 'history')")
    raise TrajectoryFormatError(f"{where}: expected a JSON object or a list of messages")


def _content_text(message: dict, where: str) -> str:
    content = message.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise TrajectoryFormatError(f"{where}: field 'content[{k}]': only text parts are supported")
            parts.append(part["text"])
        text = "".join(parts)
    else:
        raise TrajectoryFormatError(f"{where}: field 'content': expected a string or a list of text parts")
    calls = message.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise TrajectoryFormatError(f"{where}: field 'tool_calls': expected a list")
    if calls:
        text += "".join("\n" + json.dumps(call, sort_keys=True, ensure_ascii=False) for call in calls)
    elif content is None:
        raise TrajectoryFormatError(f"{where}: field 'content': missing")
    return text


def _encode(tokenizer, text: str, where: str) -> list[int]:
    """The content's token ids; a text or tokenizer failure names the message."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise TrajectoryFormatError(
            f"{where}: field 'content': {error.object[error.start]!r} at character {error.start} "
            "is a lone surrogate, not text"
        ) from None
    try:
        return tokenizer.encode(text)
    except Exception as error:  # the tokenizers package raises plain Exceptions
        raise TrajectoryFormatError(f"{where}: field 'content': the tokenizer failed ({error})") from None


def render(messages: list, tokenizer, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and loss mask of one conversation."""
    tokens: list[int] = []
    mask: list[int] = []
    for k, message in enumerate(messages):
        at = f"{where}: message {k}"
        if not isinstance(message, dict):
            raise TrajectoryFormatError(f"{at}: expected an object")
        unknown = sorted(set(message) - set(MESSAGE_FIELDS))
        if unknown:
            raise TrajectoryFormatError(
                f"{at}: field '{unknown[0]}': unknown field (known: {', '.join(MESSAGE_FIELDS)})"
            )
        role = message.get("role")
        if role not in ROLES:
            raise TrajectoryFormatError(f"{at}: field 'role': {role!r} is not one of {', '.join(ROLES)}")
        header = tokenizer.header(role)
        content = _encode(tokenizer, _content_text(message, at), at)
        if tokenizer.IM_START in content or tokenizer.IM_END in content:
            raise TrajectoryFormatError(
                f"{at}: field 'content': the tokenizer encodes this text to a ChatML marker token id"
            )
        body = content + tokenizer.footer()
        tokens += header + body
        trained = 1 if role == "assistant" else 0
        mask += [0] * len(header) + [trained] * len(body)
    if not tokens:
        raise TrajectoryFormatError(f"{where}: empty conversation")
    mask[0] = 0
    return np.asarray(tokens, dtype=TOKEN_DTYPE), np.asarray(mask, dtype=np.uint8)


def ingest_messages(path: str | Path, tokenizer) -> Step:
    """Tokenise every conversation under `path` into one step."""
    ids, trees, rewards, token_arrays, mask_arrays = [], [], [], [], []
    seen: dict[str, str] = {}
    for file in input_files(Path(path), INPUT_SUFFIXES):
        for where, default_id, record in _records(file):
            messages = _messages(record, where)
            meta = record if isinstance(record, dict) else {}
            unknown = sorted(set(meta) - set(RECORD_FIELDS))
            if unknown:
                raise TrajectoryFormatError(
                    f"{where}: field '{unknown[0]}': unknown field (known: {', '.join(RECORD_FIELDS)})"
                )
            trajectory_id = meta.get("id", default_id)
            tree = meta.get("tree", meta.get("instance_id", trajectory_id))
            if not isinstance(trajectory_id, str) or not trajectory_id:
                raise TrajectoryFormatError(f"{where}: field 'id': expected a non-empty string")
            name_field(trajectory_id, where, "id")
            if trajectory_id in seen:
                raise TrajectoryFormatError(f"{where}: field 'id': duplicate id {trajectory_id!r} (also {seen[trajectory_id]})")
            if not isinstance(tree, str) or not tree:
                raise TrajectoryFormatError(f"{where}: field 'tree': expected a non-empty string")
            name_field(tree, where, "tree")
            reward = float_field(meta.get("reward", 0.0), where, "reward")
            tokens, mask = render(messages, tokenizer, where)
            seen[trajectory_id] = where
            ids.append(trajectory_id)
            trees.append(tree)
            rewards.append(reward)
            token_arrays.append(tokens)
            mask_arrays.append(mask)
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum([len(t) for t in token_arrays], out=offsets[1:])
    return Step(
        ids=tuple(ids),
        trees=tuple(trees),
        offsets=offsets,
        tokens=np.concatenate(token_arrays),
        loss_mask=np.concatenate(mask_arrays),
        rewards=np.asarray(rewards, dtype=np.float32),
        advantage_per_trajectory=grpo_advantages(np.asarray(rewards), trees),
        source=str(path),
    )
