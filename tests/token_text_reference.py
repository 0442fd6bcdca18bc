"""Token texts from whole-prefix decodes: the independent reference mira.serve.token_texts is tested
against (tests/unit/test_token_texts.py, tests/e2e/test_serve.py). A token's text is what decoding
the sequence up to it adds to decoding the sequence before it (special tokens skipped), where a
prefix whose decoding ends in a replacement character (a character whose bytes have not all come)
stands for the longest shorter prefix that does not."""

from __future__ import annotations

REPLACEMENT = "\ufffd"


def _settled(tokenizer, ids: list[int]) -> str:
    """The decoding of the longest prefix of `ids` that does not end in a replacement character."""
    for end in range(len(ids), -1, -1):
        text = tokenizer.decode(ids[:end], skip_special_tokens=True)
        if not text.endswith(REPLACEMENT):
            return text
    return ""


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """The text each of `ids` adds, in order."""
    prefixes = [_settled(tokenizer, ids[:i]) for i in range(len(ids) + 1)]
    return [after[len(before):] for before, after in zip(prefixes, prefixes[1:])]


def alternative_text(tokenizer, before: list[int], token: int) -> str:
    """The text `token` would add after `before`."""
    return _settled(tokenizer, before + [token])[len(_settled(tokenizer, before)):]


def llama_style_tokenizer():
    """A small SentencePiece-style BPE tokenizer (Mixtral's and Llama's kind: words carry their leading
    space as "▁", a lone token decodes without it, unknown characters fall back to byte tokens, "<s>"
    begins every encoding), trained here on two sentences."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tokenizer.train_from_iterator(["Hello world, the sea is calm today.", "Once upon a time in a land far away"] * 20,
                                  trainer)
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):  # byte tokens are ordinary tokens, as in SentencePiece's byte fallback
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tokenizer = Tokenizer.from_str(json.dumps(data))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
