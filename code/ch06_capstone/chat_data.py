"""Chat and instruction data for the capstone: JSONL conversations -> packed rows whose labels are
the assistant's tokens only.

A record is one line of JSON, either a conversation or a prompt/response pair:

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}
    {"prompt": "...", "response": "..."}            (optional "system"; "completion" also read)

Each is rendered with the tokenizer's chat template (the model folder's tokenizer_config.json or
chat_template.jinja: the format the model was tuned with), tokenized, and trained on the
assistant's tokens only: every other label is -100 (ignored by the loss). Which tokens are the
assistant's: where the template marks them with {% generation %} ... {% endgeneration %},
transformers says so (apply_chat_template(..., return_assistant_tokens_mask=True)); most
templates don't (Llama 3's, Qwen 2.5's), so the spans are found prefix by prefix: the text of
the turns before assistant turn i plus the generation prompt, and the text up to and including
turn i, are both prefixes of the whole conversation's text; the characters between them are the
assistant's (its content and its end-of-turn token: the model must learn to stop). A template
that renders earlier turns differently once later turns follow (Qwen3's drops the reasoning of
earlier turns) breaks that, and is refused in one line.

Labels here are SHIFTED: labels[t] is the target of position t (the token after it), -100
unless that token is the assistant's. Pass them to distkit.tokens.global_token_loss with the
model's logits, not to model(labels=...), which would shift them again.

Packing: short conversations are concatenated into rows of exactly seq_len tokens (no compute on
padding but a row's tail), each document keeping its own positions (position_ids restart at 0)
and its own labels (a document's last position predicts nothing: no target crosses into the next
document). What attention may cross is up to the attention implementation (transformers 5.23,
read in its source):
- sdpa, eager, flex: create_causal_mask (masking_utils.find_packed_sequence_indices) reads the
  documents from the position_ids when no attention_mask is passed and no cache is used, and
  builds a block-diagonal causal mask: a token attends only to earlier tokens of its own
  document. On the CPU with sdpa too (tests: packed logits = each document alone, < 1e-5, Llama
  and Gemma 3's sliding-window layer; without position_ids they differ). The cost: an explicit
  (S x S) mask instead of is_causal (on a GPU, sdpa then leaves its flash kernel for the
  memory-efficient one), and every masked pair is still computed: S^2 / 2 per row, where a
  varlen kernel pays the sum of L^2 / 2 over the documents.
- flash_attention_2/3: documents are separated (varlen kernel, boundaries where the position_ids
  restart) ONLY for a batch of one row (_is_packed_sequence: batch_size == 1): reshape a
  micro-batch's input_ids, position_ids and labels to (1, rows x seq_len) first ("padding
  free"). With several rows, each row is one causal sequence and documents attend to earlier
  documents of their row.
- Documents also attend across when an attention_mask is passed (the detection is skipped), when
  the position_ids do not restart (the rotary positions then run on too), and under an attention
  function that ignores the mask (chapter 09's context-parallel attention).
Padding at a row's end is a document of its own (positions from 0), with labels -100.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

IGNORE = -100
ROLES = ("system", "user", "assistant", "tool")


class BadRecord(ValueError):
    """A record (or a file) the data cannot be read from: one line, FILE:LINE: reason."""


def _messages(record, where: str) -> list[dict]:
    """A record's conversation, checked: a list of {role, content} with an assistant turn."""
    if not isinstance(record, dict):
        raise BadRecord(f"{where}: a record is a JSON object, not {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise BadRecord(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                    not isinstance(m.get("content"), str):
                raise BadRecord(f"{where}: message {i} needs a string 'role' and 'content'")
            if m["role"] not in ROLES:
                raise BadRecord(f"{where}: message {i}: unknown role {m['role']!r} (one of "
                                f"{', '.join(ROLES)})")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    elif "prompt" in record:
        response = record.get("response", record.get("completion"))
        if not isinstance(record["prompt"], str) or not isinstance(response, str):
            raise BadRecord(f"{where}: 'prompt' and 'response' (or 'completion') must be strings")
        messages = ([{"role": "system", "content": record["system"]}]
                    if isinstance(record.get("system"), str) else [])
        messages += [{"role": "user", "content": record["prompt"]},
                     {"role": "assistant", "content": response}]
    else:
        raise BadRecord(f"{where}: a record needs 'messages' (a list of {{role, content}}) or "
                        f"'prompt' and 'response'; found keys {sorted(record)[:5]}")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord(f"{where}: no assistant message: nothing to train on")
    return messages


def read_records(path) -> list[tuple[str, list[dict]]]:
    """Every record of a JSONL file, as ("FILE:LINE", messages). Blank lines are skipped; a bad
    line raises BadRecord naming it; a file without records raises BadRecord too."""
    path = Path(path)
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BadRecord(f"{path}: cannot read: {e.__class__.__name__}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadRecord(f"{where}: not JSON ({e.msg}, column {e.colno})") from None
        records.append((where, _messages(record, where)))
    if not records:
        raise BadRecord(f"{path}: no records (an empty file)")
    return records


def _render(tokenizer, messages, where: str = "", **kw):
    """apply_chat_template, its refusals (a template that raises on a role order, e.g. Mistral's
    "roles must alternate") made one BadRecord line."""
    from jinja2.exceptions import TemplateError
    try:
        return tokenizer.apply_chat_template(messages, **{"tokenize": False, **kw})
    except TemplateError as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise BadRecord(f"{where}: the chat template refused it: {why}") from None


def _opening(tokenizer, upto: str) -> str:
    """The text before an opening assistant turn's content: up to the end of the generation
    prompt (what add_generation_prompt adds after a user turn, e.g. "<|im_start|>assistant\n"),
    found in `upto`, the rendering of that turn alone; "" if the template shows none."""
    user = [{"role": "user", "content": "x"}]
    try:
        plain = _render(tokenizer, user)
        prompt = _render(tokenizer, user, add_generation_prompt=True)
    except BadRecord:
        return ""
    header = prompt[len(plain):] if prompt.startswith(plain) else ""
    at = upto.find(header) if header else -1
    return upto[:at + len(header)] if at >= 0 else ""


def assistant_spans(tokenizer, messages, where: str = "") -> tuple[str, list[tuple[int, int]]]:
    """(the conversation's text, the character spans of the assistant's turns), found prefix by
    prefix (see the module's docstring)."""
    text = _render(tokenizer, messages, where)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i:
            before = _render(tokenizer, messages[:i], where, add_generation_prompt=True)
        else:  # the assistant speaks first: the template's opening and the assistant's header
            before = _opening(tokenizer, _render(tokenizer, messages[:1], where))
        upto = _render(tokenizer, messages[:i + 1], where)
        if not (text.startswith(upto) and upto.startswith(before)):
            raise BadRecord(f"{where}: the chat template renders turn {i} differently once "
                            "later turns follow (e.g. it drops earlier reasoning): the "
                            "assistant's tokens cannot be found prefix by prefix; use a "
                            "template with {% generation %} marks")
        spans.append((len(before), len(upto)))
    return text, spans


def encode(tokenizer, messages, where: str = "") -> tuple[list[int], list[bool]]:
    """A conversation's token ids and, per token, whether it is the assistant's."""
    template = tokenizer.chat_template or ""
    if not template:
        raise BadRecord(f"{where}: the tokenizer has no chat template (chat_template in "
                        "tokenizer_config.json or chat_template.jinja)")
    if re.search(r"\{%-?\s*generation\s*-?%\}", template):
        out = _render(tokenizer, messages, where, tokenize=True, return_dict=True,
                      return_assistant_tokens_mask=True)
        return list(out["input_ids"]), [bool(a) for a in out["assistant_masks"]]
    text, spans = assistant_spans(tokenizer, messages, where)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def shifted_labels(ids: list[int], mask: list[bool]) -> list[int]:
    """labels[t] = ids[t + 1] where token t + 1 is the assistant's, else -100; the last -100."""
    return [ids[t + 1] if mask[t + 1] else IGNORE for t in range(len(ids) - 1)] + [IGNORE]


@dataclass
class Packed:
    """Rows of seq_len tokens: input_ids, shifted labels (-100: not trained on), position_ids
    (restarting at 0 for each document), documents per row, valid labels per row."""
    input_ids: torch.Tensor      # (rows, seq_len) int64
    labels: torch.Tensor         # (rows, seq_len) int64, shifted
    position_ids: torch.Tensor   # (rows, seq_len) int64
    documents: list[int]         # documents in each row (the padding not counted)
    valid: torch.Tensor          # (rows,) valid labels per row
    truncated: int = 0           # documents cut to seq_len
    dropped: int = 0             # documents left without a valid label once cut


def pack(examples, seq_len: int, pad_id: int) -> Packed:
    """Pack (ids, mask) examples, in order, into rows of seq_len tokens: a document goes into the
    current row if it fits, else starts a new one (the row's rest is padding). A document
    longer than seq_len is cut to it (counted); one left without a valid label is dropped."""
    rows, row, truncated, dropped = [], [], 0, 0
    for ids, mask in examples:
        if len(ids) > seq_len:
            ids, mask, truncated = ids[:seq_len], mask[:seq_len], truncated + 1
        labels = shifted_labels(ids, mask)
        if all(y == IGNORE for y in labels):
            dropped += 1
            continue
        if sum(len(d[0]) for d in row) + len(ids) > seq_len:
            rows.append(row)
            row = []
        row.append((ids, labels))
    if row:
        rows.append(row)
    x = torch.full((len(rows), seq_len), pad_id, dtype=torch.int64)
    y = torch.full((len(rows), seq_len), IGNORE, dtype=torch.int64)
    pos = torch.zeros((len(rows), seq_len), dtype=torch.int64)
    for r, docs in enumerate(rows):
        at = 0
        for ids, labels in docs:
            x[r, at:at + len(ids)] = torch.tensor(ids)
            y[r, at:at + len(ids)] = torch.tensor(labels)
            pos[r, at:at + len(ids)] = torch.arange(len(ids))
            at += len(ids)
        pos[r, at:] = torch.arange(seq_len - at)  # the padding: a document of its own
    return Packed(x, y, pos, [len(d) for d in rows], (y != IGNORE).sum(1), truncated, dropped)


def is_chat(path) -> bool:
    """Whether a --data file is chat data: a .jsonl/.json file whose first record has 'messages'
    or 'prompt' (corpus.py reads other JSONL as plain text documents, their "text" field)."""
    path = Path(path)
    if path.suffix not in (".jsonl", ".json") or not path.is_file():
        return False
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(record, dict) and ("messages" in record or "prompt" in record)
    return False


def _pad_id(tokenizer) -> int:
    for pad in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if pad is not None:
            return pad
    return 0


def load_chat(paths, tokenizer, seq_len: int, heldout_every: int = 0):
    """Every record of the JSONL files, encoded with the tokenizer's chat template, packed.
    heldout_every = K > 0: every K-th conversation (the K-th, 2K-th, ...) is held out, packed on
    its own, and (train, heldout) is returned; else one Packed."""
    examples = []
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        for where, messages in read_records(path):
            examples.append(encode(tokenizer, messages, where))
    if heldout_every <= 0:
        return pack(examples, seq_len, _pad_id(tokenizer))
    held = [e for i, e in enumerate(examples, 1) if i % heldout_every == 0]
    train = [e for i, e in enumerate(examples, 1) if i % heldout_every]
    if not held or not train:
        raise BadRecord(f"{len(examples)} conversations: too few to hold out every "
                        f"{heldout_every}th and train on the rest")
    return pack(train, seq_len, _pad_id(tokenizer)), pack(held, seq_len, _pad_id(tokenizer))


def summary(packed: Packed) -> str:
    """One line: rows, documents, trained-on (valid) and masked tokens."""
    total = packed.labels.numel()
    valid = int(packed.valid.sum())
    return (f"{len(packed.documents)} rows of {packed.labels.shape[1]} tokens, "
            f"{sum(packed.documents)} conversations; {valid:,} assistant tokens trained on, "
            f"{total - valid:,} masked (-100)"
            + (f"; {packed.truncated} cut to the row length" if packed.truncated else "")
            + (f", {packed.dropped} dropped (no assistant token left)" if packed.dropped else ""))
