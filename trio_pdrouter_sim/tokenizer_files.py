"""A small model directory for ``--tokenizer`` and the router's ``--kv-tokenizer-path``.

:func:`write_model_dir` trains a byte-level BPE tokenizer on a corpus (so every text encodes)
whose post-processor puts ``<s>`` before a completion's tokens, and writes it as
``tokenizer.json`` beside a ``tokenizer_config.json`` whose chat template renders messages as
the simulator does (``requests._chat_text``). Tests and benchmarks make one; nothing is
downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

__all__ = ["CHAT_TEMPLATE", "write_model_dir"]

BOS = "<s>"
EOS = "</s>"

#: The simulator's chat rendering as a Hugging Face chat template (trim_blocks and lstrip_blocks
#: on, as Hugging Face and vLLM render): ``<|role|>\ncontent\n`` per message, then the assistant's.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{% for part in m['content'] %}{{ part.get('text', '') }}{% endfor %}"
    "{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def write_model_dir(directory: Path, corpus: Iterable[str], *, vocab_size: int = 2000) -> Path:
    """Train on ``corpus``, write the tokenizer files into ``directory``; returns it."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    bos = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos)]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return directory
