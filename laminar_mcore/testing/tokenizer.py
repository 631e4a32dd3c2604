"""A character-level Hugging Face tokenizer with a chat template, built offline (nothing is
downloaded): tests save it beside a tiny checkpoint so that text prompts, stop strings and the
OpenAI routes of an engine can be exercised."""

from __future__ import annotations

import string

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
SPECIALS = ["<unk>", "<eos>"]


def save_char_tokenizer(path: str, vocab_size: int) -> int:
    """Write tokenizer files to ``path`` (ids < ``vocab_size``); returns the EOS id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(string.ascii_letters + string.digits + " <>/.,:;!?+-=*()[]'\n"))
    if len(SPECIALS + chars) > vocab_size:
        raise ValueError(f"the character vocabulary needs {len(SPECIALS + chars)} ids; the model "
                         f"has {vocab_size}")
    # Every id the model can sample decodes to exactly one character (Latin-1 letters fill up).
    chars += [chr(0xC0 + i) for i in range(vocab_size - len(SPECIALS) - len(chars))]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return vocab["<eos>"]
