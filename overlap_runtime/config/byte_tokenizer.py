"""The byte-level tokenizer: UTF-8 bytes as tokens 0..255 and four special tokens (260 ids).

The hermetic default of the trainer's data (``trainer.data``), and the byte form of
``trainer.documents.DataTokenizer``.
"""

from __future__ import annotations

import torch

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<sep>")
PAD_ID, BOS_ID, EOS_ID, SEP_ID = 256, 257, 258, 259
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, specials 256..259 (see :data:`SPECIAL_TOKENS`).

    Also the byte form of ``trainer.documents.DataTokenizer`` (``name``, ``sha256``,
    ``token_id``, ``encode_batch``).
    """

    name = "byte"
    sha256 = "byte"
    vocab_size = VOCAB_SIZE

    def token_id(self, token: str) -> int | None:
        """The id of a special token (``"<eos>"`` -> 258), None for any other string."""
        return 256 + SPECIAL_TOKENS.index(token) if token in SPECIAL_TOKENS else None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """UTF-8 bytes of each text, no specials."""
        return [list(t.encode("utf-8")) for t in texts]

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> torch.Tensor:
        """``text`` -> ``[n]`` int64 token ids (``<bos>``/``<eos>`` around it if asked)."""
        ids = list(text.encode("utf-8"))
        return torch.tensor(([BOS_ID] if bos else []) + ids + ([EOS_ID] if eos else []),
                            dtype=torch.int64)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """Token ids -> text; specials are dropped, invalid UTF-8 is replaced."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return bytes(v for v in values if 0 <= v < 256).decode("utf-8", errors="replace")
