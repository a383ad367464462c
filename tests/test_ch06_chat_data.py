"""Chat data (code/ch06_capstone/chat_data.py) and the global-token loss (distkit/tokens.py).

A tiny byte-level BPE tokenizer is trained here on a few sentences (nothing downloaded) and given
a ChatML chat template, once with {% generation %} marks and once without: the two ways of
finding the assistant's tokens must agree. The loss test runs 2 gloo ranks (torch
multiprocessing, no transformers import): unequal valid tokens per rank and per micro-batch.
"""
import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

# (not from conftest: the spawned ranks import this file, and conftest's imports cost them time)
CODE = Path(__file__).resolve().parent.parent / "code"
sys.path[:0] = [str(CODE), str(CODE / "ch06_capstone")]
import chat_data  # noqa: E402
from distkit.tokens import (IGNORE, global_token_loss, global_valid_tokens,  # noqa: E402
                            sum_gradients)

TURN = "<|im_start|>{{ m.role }}\n"
CHATML = ("{% for m in messages %}" + TURN + "{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_MARKED = ("{% for m in messages %}" + TURN + "{% if m.role == 'assistant' %}"
                 "{% generation %}{{ m.content }}<|im_end|>\n{% endgeneration %}"
                 "{% else %}{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen3-like: an assistant turn followed by more turns is rendered without its content
# Mistral-like: refuses a conversation whose roles do not alternate
STRICT = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
          + TURN + "{{ m.content }}<|im_end|>\n{% endfor %}")
FORGETFUL = ("{% for m in messages %}" + TURN + "{% if m.role == 'assistant' and not loop.last "
             "%}(earlier){% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SENTENCES = ["You are a helpful assistant.", "What is the capital of France?",
             "The capital of France is Paris.", "How many ranks does FSDP use here?",
             "Two ranks, on the CPU, with gloo.", "Thanks! Can you say it again?"]
CONVERSATION = [{"role": "system", "content": SENTENCES[0]},
                {"role": "user", "content": SENTENCES[1]},
                {"role": "assistant", "content": SENTENCES[2]},
                {"role": "user", "content": SENTENCES[3]},
                {"role": "assistant", "content": SENTENCES[4]}]


def make_tokenizer(folder, template):
    """A byte-level BPE trained on SENTENCES, ChatML special tokens, saved and loaded back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(SENTENCES * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>",
                                   eos_token="<|im_end|>", bos_token="<|im_start|>")
    fast.chat_template = template
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {name: make_tokenizer(root / name, t) for name, t in
            (("plain", CHATML), ("marked", CHATML_MARKED), ("forgetful", FORGETFUL),
             ("strict", STRICT))}


def test_assistant_tokens_prefix_by_prefix_equal_generation_marks(tokenizers):
    """Both ways find the same tokens: exactly each assistant turn's content and its end of turn
    (the template's newline after it too)."""
    plain = chat_data.encode(tokenizers["plain"], CONVERSATION)
    marked = chat_data.encode(tokenizers["marked"], CONVERSATION)
    assert plain == marked
    ids, mask = plain
    tok = tokenizers["plain"]
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs, current = runs + [current], []
    runs += [current] if current else []
    assert [tok.decode(r) for r in runs] == [SENTENCES[2] + "<|im_end|>\n",
                                            SENTENCES[4] + "<|im_end|>\n"]
    # the assistant speaks first: its turn's header is not trained on, as in the marked template
    first = [CONVERSATION[2], CONVERSATION[3]]
    assert chat_data.encode(tokenizers["plain"], first) == chat_data.encode(
        tokenizers["marked"], first)
    labels = chat_data.shifted_labels(ids, mask)
    assert sum(y != IGNORE for y in labels) == sum(mask)  # (the first token is never the
    # assistant's: every target is a masked token)


def test_a_template_that_rewrites_earlier_turns_or_raises_is_refused(tokenizers):
    with pytest.raises(chat_data.BadRecord, match=r"^x.jsonl:3: the chat template renders "
                       r"turn 2 differently"):
        chat_data.encode(tokenizers["forgetful"], CONVERSATION, "x.jsonl:3")
    # one assistant turn, last: nothing rewritten, accepted
    ids, mask = chat_data.encode(tokenizers["forgetful"], CONVERSATION[:3])
    assert sum(mask) > 0
    # a template that raises: one line naming the record
    with pytest.raises(chat_data.BadRecord, match=r"^x.jsonl:4: the chat template refused it: "
                       r"Conversation roles must alternate user/assistant$"):
        chat_data.encode(tokenizers["strict"], CONVERSATION, "x.jsonl:4")
    assert sum(chat_data.encode(tokenizers["strict"], CONVERSATION[1:3])[1]) > 0


@pytest.mark.parametrize("line, reason", [
    ('{"messages": [{"role": "user", "content": "hi"}', "not JSON"),
    ('["a list"]', "a record is a JSON object"),
    ('{"text": "plain text"}', "a record needs 'messages'"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ('{"messages": [{"role": "bot", "content": "hi"}]}', "message 0: unknown role 'bot'"),
    ('{"messages": [{"role": "user"}]}', "message 0 needs a string 'role' and 'content'"),
    ('{"prompt": "hi", "response": 3}', "'prompt' and 'response'"),
])
def test_a_bad_record_is_one_line_naming_file_and_line(tmp_path, line, reason):
    path = tmp_path / "data.jsonl"
    good = json.dumps({"prompt": "hi", "response": "hello"})
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(chat_data.BadRecord) as e:
        chat_data.read_records(path)
    assert str(e.value).startswith(f"{path}:3: {reason}") and "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)


def test_an_empty_file_is_one_line(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n  \n")
    with pytest.raises(chat_data.BadRecord, match=r"e.jsonl: no records \(an empty file\)$"):
        chat_data.read_records(tmp_path / "e.jsonl")


def test_both_record_forms_and_packing(tmp_path, tokenizers):
    """prompt/response = the same conversation as messages; packed rows keep each document's
    positions and labels; the valid count per row is what the loss divides by."""
    path = tmp_path / "chat.jsonl"
    pair = {"system": SENTENCES[0], "prompt": SENTENCES[1], "response": SENTENCES[2]}
    path.write_text("\n".join(json.dumps(r) for r in [
        {"messages": CONVERSATION[:3]}, pair, {"messages": CONVERSATION}] * 3) + "\n")
    records = chat_data.read_records(path)
    assert records[0][1] == records[1][1] and records[1][0] == f"{path}:2"
    tok = tokenizers["plain"]
    lengths = [len(chat_data.encode(tok, m)[0]) for _, m in records[:3]]
    seq_len = lengths[0] + lengths[1] + 5  # two short ones fit a row, the long one its own
    packed = chat_data.load_chat([path], tok, seq_len)
    assert lengths[2] <= seq_len and packed.truncated == packed.dropped == 0
    assert packed.documents == [2, 1] * 3
    row = 0
    x, y, pos = packed.input_ids[row], packed.labels[row], packed.position_ids[row]
    a, b = lengths[0], lengths[0] + lengths[1]
    assert pos[:b].tolist() == list(range(a)) + list(range(lengths[1]))
    assert pos[b:].tolist() == list(range(seq_len - b))  # the padding: its own document
    assert (x[b:] == tok.pad_token_id).all() and (y[b:] == IGNORE).all()
    assert y[a - 1] == IGNORE  # a document's last position predicts nothing of the next
    ids, mask = chat_data.encode(tok, records[0][1])
    assert y[:a].tolist() == chat_data.shifted_labels(ids, mask)
    assert packed.valid.tolist() == (packed.labels != IGNORE).sum(1).tolist()
    assert packed.valid[0] == 2 * sum(mask)
    line = chat_data.summary(packed)
    assert line.startswith(f"6 rows of {seq_len} tokens, 9 conversations; ")
    train, held = chat_data.load_chat([path], tok, seq_len, heldout_every=3)
    assert sum(train.documents) == 6 and held.documents == [1, 1, 1]  # every 3rd: the long one
    assert chat_data.is_chat(path) and not chat_data.is_chat(tmp_path / "missing.jsonl")
    (tmp_path / "text.jsonl").write_text('{"text": "a document"}\n')
    assert not chat_data.is_chat(tmp_path / "text.jsonl")
    # cut and dropped: rows shorter than the first assistant token
    short = chat_data.load_chat([path], tok, lengths[2] - 3)
    assert short.truncated == 3 and short.dropped == 0
    none = chat_data.pack([(ids, mask)], 4, 0)
    assert none.dropped == 1 and len(none.documents) == 0


def test_packed_documents_attend_only_to_themselves_on_cpu_sdpa():
    """transformers 5.23 reads the documents from the position_ids (no attention_mask): a packed
    row's logits equal each document run alone. Without the position_ids (the wrong answer)
    the second document attends to the first and its positions run on: logits differ."""
    import families
    from transformers import AutoModelForCausalLM
    docs = [torch.randint(0, 96, (n,)) for n in (7, 12, 5)]
    row = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    for family in ("llama", "gemma3_text"):  # (Gemma 3: its sliding-window layer too, window 8)
        config = families.tiny_config(family, vocab_size=96, seq_len=32)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            alone = torch.cat([model(input_ids=d[None]).logits[0] for d in docs])
            packed = model(input_ids=row, position_ids=positions).logits[0]
            crossed = model(input_ids=row).logits[0]
        assert (packed - alone).abs().max() < 1e-5, family
        assert (crossed[7:] - alone[7:]).abs().max() > 1e-3  # documents 2, 3 see document 1


# ---- the global-token loss on 2 ranks (torch.multiprocessing, gloo, FSDP2 on a tiny model)

V, H = 32, 16
NORMALISATIONS = ("global", "global-hsdp", "mean", "no-factor")  # HSDP: 2 replicas x 1 shard


def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(V, H), torch.nn.Linear(H, H), torch.nn.Tanh(),
                               torch.nn.Linear(H, V))


def _batch():
    """8 sequences of 12 tokens, shifted labels; sequence j's first j + 1 labels masked: rank 0's
    micro-batches hold 21 and 17 valid labels, rank 1's 13 and 9; one process 60."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (8, 13), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:].clone()
    for j in range(8):
        y[j, :j + 1] = IGNORE
    return x, y


def _worker(rank, port, out):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    x, y = _batch()
    from torch.distributed.device_mesh import init_device_mesh
    hsdp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    runs = {}
    for normalisation in NORMALISATIONS:
        model = _tiny()
        mesh = {"mesh": hsdp} if normalisation == "global-hsdp" else {}
        for layer in (model[0], model[1], model[3]):
            fully_shard(layer, **mesh)
        fully_shard(model, **mesh)
        if normalisation.startswith("global"):
            assert sum_gradients(model) == 4
        mine = slice(rank * 4, rank * 4 + 4)
        micro = [(x[mine][i:i + 2], y[mine][i:i + 2]) for i in (0, 2)]  # 2 micro-batches
        count = global_valid_tokens([b for _, b in micro])
        share = torch.zeros(())
        for xb, yb in micro:
            logits = model(xb)
            if normalisation == "mean":  # each micro-batch's mean, averaged over all of them
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), yb.flatten(),
                                                         ignore_index=IGNORE) / len(micro)
            else:
                loss = global_token_loss(logits, yb, count)
            loss.backward()
            share += loss.detach()
        dist.all_reduce(share)
        runs[normalisation] = {
            "loss": share.item() / (2 if normalisation == "mean" else 1), "count": int(count),
            "grads": {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                      for n, p in model.named_parameters()},
            "valid": [int((b != IGNORE).sum()) for _, b in micro]}
    if rank == 0:
        torch.save(runs, out)
    dist.barrier()
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One spawn of 2 gloo ranks runs the three normalisations (each rank: a torch import)."""
    import torch.multiprocessing as mp
    out = tmp_path_factory.mktemp("tokens") / "runs.pt"
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=2)
    return torch.load(out)


def _one_process():
    x, y = _batch()
    model = _tiny()
    loss = global_token_loss(model(x), y, (y != IGNORE).sum())  # no group: this process
    loss.backward()
    assert abs(loss.item() - torch.nn.functional.cross_entropy(
        model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE).item()) < 1e-6
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _gaps(run, reference):
    loss, grads = reference
    scale = (torch.cat([g.flatten() for g in run["grads"].values()]).norm()
             / torch.cat([g.flatten() for g in grads.values()]).norm()).item()
    return (abs(run["loss"] - loss),
            max((run["grads"][n] - g).abs().max().item() for n, g in grads.items()), scale)


@pytest.mark.parametrize("normalisation", NORMALISATIONS)
def test_global_token_loss_equals_one_process_on_two_ranks(two_ranks, normalisation):
    """Sum over valid tokens / the step's valid tokens (both ranks, both micro-batches) with FSDP
    summing gradients = one process, loss and step-1 gradients. The mean of the micro-batches'
    and ranks' means weights tokens unequally (wrong); the global loss with FSDP still
    averaging gives gradients 1/2 of one process's (wrong, and the loss hides it)."""
    run = two_ranks[normalisation]
    loss_gap, grad_gap, scale = _gaps(run, _one_process())
    if normalisation.startswith("global"):  # FSDP, and HSDP (the replicas' all-reduce sums)
        assert loss_gap < 1e-5 and grad_gap < 1e-6, (loss_gap, grad_gap)
    elif normalisation == "mean":
        assert loss_gap > 1e-3 and grad_gap > 1e-3, (loss_gap, grad_gap)
    else:
        assert loss_gap < 1e-5 and abs(scale - 0.5) < 1e-4, (loss_gap, scale)
    assert run["valid"] == [21, 17] and run["count"] == 60  # rank 0's micro-batches; the step's


def test_packed_chat_loss_equals_each_conversation_alone(tmp_path, tokenizers):
    """Packing + shifted labels + the global-token loss compose: the loss of packed rows (with
    position_ids) = the mean over every assistant token of the conversations run one by one
    with transformers' own shift (model(labels=...)'s -100 convention) and summed."""
    import families
    from transformers import AutoModelForCausalLM
    tok = tokenizers["plain"]
    path = tmp_path / "chat.jsonl"
    convs = [CONVERSATION[:3], CONVERSATION, CONVERSATION[1:3], CONVERSATION[:3]]
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    packed = chat_data.load_chat(path, tok, 96)
    assert len(packed.documents) < len(convs)  # some rows hold several conversations
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(families.tiny_config("llama", vocab_size=len(tok),
                                                                  seq_len=96))
    with torch.no_grad():
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits
        loss = global_token_loss(logits, packed.labels)
        total, count = 0.0, 0
        for c in convs:
            ids, mask = chat_data.encode(tok, c)
            labels = torch.tensor([i if m else IGNORE for i, m in zip(ids, mask)])[None]
            n = int((labels[:, 1:] != IGNORE).sum())
            total += model(input_ids=torch.tensor(ids)[None], labels=labels).loss.item() * n
            count += n
    assert count == int(packed.valid.sum())
    assert abs(loss.item() - total / count) < 1e-5
