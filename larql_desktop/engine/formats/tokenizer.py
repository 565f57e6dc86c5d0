"""Tokenizers built from a GGUF's vocabulary that reproduce llama.cpp's token ids exactly.

Two vocabulary types are supported, as llama.cpp names them:

* ``gpt2`` (byte-level BPE, e.g. SmolLM2): a port of llama.cpp's ``llm_tokenizer_bpe`` (lowest-rank-first
  merging) over the GGUF's tokens and merges, after splitting the text into words with the regexes llama.cpp
  uses for the GGUF's ``pre`` type.
* ``llama`` (SentencePiece-style BPE with scores and ``<0xNN>`` byte fallback, e.g. Gemma 3):
  a port of llama.cpp's ``llm_tokenizer_spm`` (best-score-first symbol merging).

Special tokens follow llama.cpp's ``tokenizer_st_partition``: user-defined tokens are always
split out of the text before tokenization, control tokens only when ``parse_special`` is set,
longest token first.

A rendered chat prompt is tokenised with `encode_template`: the template's own markers (``<|im_start|>``) are
special tokens, while the messages' contents, escaped with `escape_specials` before rendering, stay plain text, so
that a marker typed in a message is several ordinary tokens and cannot fake a system or assistant turn.
"""
from __future__ import annotations

import bisect
import codecs
import functools
import heapq
import re
import unicodedata
from array import array
from typing import Callable, Iterable, Sequence

import numpy as np

from larql_desktop.engine.formats.gguf import PackedStrings

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Tokens llama.cpp treats as end-of-generation by their text (llama-vocab.cpp), forcing them to control.
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
              "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")
# Fill-in-the-middle tokens llama.cpp also forces to control type by their text.
_FIM_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
              "<|fim_suffix|>", "<fim-suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
              "<|fim_middle|>", "<fim-middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
              "<|fim_pad|>", "<fim-pad>", "<PAD>", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
              "<|file_sep|>", "<fim-sep>", "<SEP>")

# llama.cpp pre-tokenizer regexes for byte-level BPE vocabularies, by tokenizer.ggml.pre.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SMOLLM = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}
_PRE_GPT2 = {"gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion", "granite-docling"}
_PRE_LLAMA3 = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"}
_PRE_QWEN2 = {"qwen2", "deepseek-r1-qwen", "megrez", "hunyuan-dense"}


# Decoded pieces kept per tokenizer (~100 bytes each).
PIECE_CACHE_SIZE = 16384


class TokenizerError(ValueError):
    """A GGUF whose tokenizer cannot be built (missing vocabulary, unsupported type)."""


class TextTooLong(ValueError):
    """A text that cannot fit in some number of tokens, known from its length alone, before tokenising it."""


# How `escape_specials` writes a control token's text inside a message: this escape character, then one character
# standing for the token (its index among the vocabulary's control tokens); the escape character itself is
# written twice. Supplementary private-use characters: no vocabulary's special token contains them.
_ESCAPE = "\U0010FFFD"
_ESCAPE_BASE = 0x100000
_MAX_ESCAPED = 0x10FFFD - _ESCAPE_BASE
_ESCAPED_PAIR = re.compile("\U0010FFFD(.)", re.DOTALL)

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


class VocabularyIndex:
    """Text -> token id over a vocabulary's `PackedStrings`, for lookups in a hot loop without a dict of every
    text (which keeps every text alive as a Python string: ~36 MB for Gemma 3's 262k). Texts are found by their
    `hash` in a sorted array, first narrowed to the hashes sharing its top 16 bits, and confirmed against the
    texts themselves, so a hash collision can never give a wrong id. Where a text appears twice the later id
    wins, as in llama.cpp's token_to_id map."""

    _BUCKET_SHIFT = 48      # buckets by the hash's top 16 bits: a 262k vocabulary has ~4 hashes in each

    def __init__(self, texts: PackedStrings):
        hashes = np.fromiter((hash(t) for t in texts), dtype=np.int64, count=len(texts))
        order = np.argsort(hashes, kind="stable")          # equal hashes: ids ascending
        hashes = hashes[order]
        bounds = (np.arange(-(1 << 15), (1 << 15) + 1, dtype=np.int64) << self._BUCKET_SHIFT)
        bounds[-1] = np.iinfo(np.int64).max
        # Ids and bucket starts in 32 bits (a vocabulary is far below 2**31 tokens): 1.3 MB less for Gemma 3's.
        self._hashes, self._ids, self._starts = array("q"), array("i"), array("i")
        self._hashes.frombytes(hashes.tobytes())
        self._ids.frombytes(order.astype(np.int32).tobytes())
        self._starts.frombytes(np.searchsorted(hashes, bounds[:-1]).astype(np.int32).tobytes())
        self._starts.append(len(hashes))
        self._texts = texts

    def get(self, text: str) -> int | None:
        h = hash(text)
        bucket = (h >> self._BUCKET_SHIFT) + (1 << 15)
        hashes, low = self._hashes, self._starts[bucket]
        i = bisect.bisect_right(hashes, h, low, self._starts[bucket + 1]) - 1
        # Equal hashes sit together, ids ascending: scan back from the last so the later duplicate wins.
        while i >= low and hashes[i] == h:
            tid = self._ids[i]
            if self._texts[tid] == text:
                return tid
            i -= 1
        return None


class Tokenizer:
    """Encode text to token ids and back, exactly as llama.cpp does for the same GGUF."""

    def __init__(self, tokens: Sequence[str] | PackedStrings, token_types: Sequence[int] | None, *, model: str,
                 pre: str | None = None, merges: Iterable[str] | None = None, scores: Sequence[float] | None = None,
                 bos_id: int | None = None, eos_id: int | None = None, add_bos: bool | None = None,
                 add_eos: bool | None = None, add_space_prefix: bool | None = None,
                 eot_id: int | None = None, eom_id: int | None = None):
        self.tokens = tokens if isinstance(tokens, PackedStrings) else PackedStrings.of(tokens)
        self.vocab_size = n = len(self.tokens)
        if n == 0:
            raise TokenizerError("the GGUF has an empty tokenizer vocabulary")
        if token_types is None:
            types = np.full(n, TOKEN_NORMAL, dtype=np.int32)
        else:
            types = np.asarray(token_types, dtype=np.int32).copy()
            if len(types) != n:
                raise TokenizerError(f"token_type has {len(types)} entries for {n} tokens")
        self.model = model
        self.pre = pre
        self._index = VocabularyIndex(self.tokens)

        # End-of-generation tokens, and llama.cpp's override of their (and FIM tokens') type to control.
        stop = set()
        for text in _EOG_TEXTS + _FIM_TEXTS:
            tid = self.token_id(text)
            if tid is not None:
                types[tid] = TOKEN_CONTROL
                if text in _EOG_TEXTS:
                    stop.add(tid)
        self._types = types
        self.bos_id = bos_id if bos_id is not None and 0 <= bos_id < n else None
        self.eos_id = eos_id if eos_id is not None and 0 <= eos_id < n else None
        for tid in (self.eos_id, eot_id, eom_id):
            if tid is not None and 0 <= tid < n:
                stop.add(int(tid))
        self.stop_ids: frozenset[int] = frozenset(stop)

        if model == "llama":
            self._kind = "spm"
            self.add_bos = True if add_bos is None else bool(add_bos)
            self.add_eos = False if add_eos is None else bool(add_eos)
            self.add_space_prefix = True if add_space_prefix is None else bool(add_space_prefix)
            given = np.zeros(n, dtype=np.float32) if scores is None else np.asarray(scores, dtype=np.float32)
            # A packed array, not a list: each read gives the same Python float, and 262k floats take 2 MB, not 8.
            self._scores = array("d", given.astype(np.float64).tobytes())
            if len(self._scores) != n:
                raise TokenizerError(f"scores has {len(self._scores)} entries for {n} tokens")
            self._byte_ids = [self.token_id(f"<0x{b:02X}>") for b in range(256)]
        elif model == "gpt2":
            self._kind = "bpe"
            self.add_bos = False if add_bos is None else bool(add_bos)
            self.add_eos = False if add_eos is None else bool(add_eos)
            self.add_space_prefix = False
            if not merges:
                raise TokenizerError("byte-level BPE GGUF has no tokenizer.ggml.merges")
            self._bpe = ByteLevelBpe(self.tokens, self._index, merges, pre or "default")
        else:
            raise TokenizerError(f"unsupported tokenizer model {model!r} (supported: 'gpt2', 'llama')")

        # Special tokens for tokenizer_st_partition: control, user-defined and unknown; longest (in bytes) first.
        marked = np.nonzero((types == TOKEN_CONTROL) | (types == TOKEN_USER_DEFINED) | (types == TOKEN_UNKNOWN))[0]
        special = sorted((int(i) for i in marked), key=lambda i: (-len(self.tokens[i].encode("utf-8")), i))
        self._special_all = [(self.tokens[i], i) for i in special if self.tokens[i]]
        self._special_user = [(t, i) for t, i in self._special_all if types[i] == TOKEN_USER_DEFINED]
        # The ones only `parse_special` splits out: what message text is escaped from (longest first, as above).
        self._special_parsed = [t for t, i in self._special_all if types[i] != TOKEN_USER_DEFINED]
        if len(self._special_parsed) > _MAX_ESCAPED:
            raise TokenizerError(f"{len(self._special_parsed)} control tokens are more than message text can be "
                                 "escaped from")
        # The pieces decoding reads most (a reply's tokens), not the whole vocabulary once it has all been seen.
        self._piece_cached = functools.lru_cache(maxsize=PIECE_CACHE_SIZE)(self._piece)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_gguf(cls, gguf_file) -> "Tokenizer":
        """Build from a `GgufFile` (or anything with a GGUF-style `metadata` dict)."""
        md = gguf_file.metadata if hasattr(gguf_file, "metadata") else gguf_file
        # Packed as read from the file where it can be: 262k Python strings made and dropped leave the heap
        # fragmented.
        tokens = (md.packed_strings("tokenizer.ggml.tokens") if hasattr(md, "packed_strings")
                  else md.get("tokenizer.ggml.tokens"))
        model = md.get("tokenizer.ggml.model")
        if not tokens or model is None:
            raise TokenizerError("the GGUF has no tokenizer (tokenizer.ggml.model / tokens missing)")

        def _int(key):
            v = md.get(key)
            return None if v is None else int(v)

        def _bool(key):
            v = md.get(key)
            return None if v is None else bool(v)

        merges = (md.packed_strings("tokenizer.ggml.merges") if hasattr(md, "packed_strings")
                  else md.get("tokenizer.ggml.merges"))
        return cls(tokens, md.get("tokenizer.ggml.token_type"), model=str(model),
                   pre=md.get("tokenizer.ggml.pre"), merges=merges,
                   scores=md.get("tokenizer.ggml.scores"),
                   bos_id=_int("tokenizer.ggml.bos_token_id"), eos_id=_int("tokenizer.ggml.eos_token_id"),
                   add_bos=_bool("tokenizer.ggml.add_bos_token"), add_eos=_bool("tokenizer.ggml.add_eos_token"),
                   add_space_prefix=_bool("tokenizer.ggml.add_space_prefix"),
                   eot_id=_int("tokenizer.ggml.eot_token_id"), eom_id=_int("tokenizer.ggml.eom_token_id"))

    # ------------------------------------------------------------------ encoding
    def token_id(self, text: str) -> int | None:
        """The id of the token whose text is `text` (the later one where a text appears twice), or None."""
        return self._index.get(text)

    @property
    def max_piece_bytes(self) -> int:
        """The most bytes one token stands for (special ones written out): a text of n characters takes at least
        n / max_piece_bytes tokens."""
        return self._longest_piece[0]

    @property
    def max_piece_chars(self) -> int:
        """The most characters one token's text can start (its bytes decoded, an incomplete sequence counting
        once per byte): a text of n characters takes at least n / max_piece_chars tokens."""
        return self._longest_piece[1]

    @functools.cached_property
    def _longest_piece(self) -> tuple[int, int]:
        """(most bytes, most characters) of one token's piece, special ones written out."""
        # One sweep of the whole vocabulary, past `piece_bytes`' cache: it would keep every piece.
        most_bytes = most_chars = 1
        for i in range(self.vocab_size):
            piece = self._piece(i, True)
            most_bytes = max(most_bytes, len(piece))
            most_chars = max(most_chars, len(piece.decode("utf-8", "replace")))
        return most_bytes, most_chars

    def _check_fits(self, text: str, max_tokens: int | None) -> None:
        # A text longer than max_tokens of the longest pieces cannot fit: refused without the cost of tokenising
        # it (seconds for a few hundred thousand characters, on a thread the other requests share the GIL with).
        if max_tokens is not None and len(text) > max_tokens * self.max_piece_chars:
            raise TextTooLong(f"the prompt is at least {-(-len(text) // self.max_piece_chars)} tokens (it has "
                              f"{len(text)} characters) but the context holds {max_tokens}")

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = False,
               max_tokens: int | None = None) -> list[int]:
        """Token ids for `text`. add_bos None = the GGUF's default (and its add_eos default);
        parse_special=True matches control-token strings such as ``<|im_start|>`` as single tokens.
        max_tokens: a text too long to fit in that many tokens raises TextTooLong before it is tokenised."""
        self._check_fits(text, max_tokens)
        return self._encode_fragments(self._partition(text, parse_special), add_bos)

    def escape_specials(self, text: str) -> str:
        """A message's text, about to be rendered into a chat template, with every control-token string in it
        (``<|im_start|>``, ``<end_of_turn>``) escaped: `encode_template` reads the escapes back as plain text."""
        if _ESCAPE in text:
            text = text.replace(_ESCAPE, _ESCAPE + _ESCAPE)
        for index, token_text in enumerate(self._special_parsed):
            if token_text in text:
                text = text.replace(token_text, _ESCAPE + chr(_ESCAPE_BASE + index))
        return text

    def _unescape(self, text: str) -> str:
        def original(match) -> str:
            code = ord(match.group(1)) - _ESCAPE_BASE
            if match.group(1) == _ESCAPE:
                return _ESCAPE
            return self._special_parsed[code] if 0 <= code < len(self._special_parsed) else match.group(0)
        return _ESCAPED_PAIR.sub(original, text)

    def encode_template(self, text: str, add_bos: bool | None = None, max_tokens: int | None = None) -> list[int]:
        """Token ids for a rendered chat template whose message texts went through `escape_specials`: the
        template's own control-token strings are special tokens (as `encode(parse_special=True)`), the messages'
        are plain text. A text without escapes gives exactly what `encode(text, parse_special=True)` gives."""
        self._check_fits(text, max_tokens)
        fragments = []
        for fragment in self._partition(text, parse_special=True):
            if isinstance(fragment, str) and _ESCAPE in fragment:
                fragments.extend(self._partition(self._unescape(fragment), parse_special=False))
            else:
                fragments.append(fragment)
        return self._encode_fragments(fragments, add_bos)

    def _encode_fragments(self, fragments: list, add_bos: bool | None) -> list[int]:
        out: list[int] = []
        use_defaults = add_bos is None
        want_bos = self.add_bos if use_defaults else bool(add_bos)
        if want_bos and self.bos_id is not None:
            out.append(self.bos_id)
        if self._kind == "spm":
            lookup = self._spm_lookup()
            is_prev_special = True
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    is_prev_special = True
                else:
                    if self.add_space_prefix and is_prev_special:
                        frag = " " + frag
                    self._spm_tokenize(frag.replace(" ", "\u2581"), out, lookup)
                    is_prev_special = False
        else:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    out.extend(self._bpe.encode(frag))
        if use_defaults and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list:
        """llama.cpp's tokenizer_st_partition: split special-token strings out of the text."""
        if not text:
            return []
        specials = self._special_all if parse_special else self._special_user
        frags: list = [text]
        for tok_text, tid in specials:
            if tok_text not in text:
                continue
            new: list = []
            for frag in frags:
                if isinstance(frag, int) or tok_text not in frag:
                    new.append(frag)
                    continue
                parts = frag.split(tok_text)
                for k, part in enumerate(parts):
                    if k:
                        new.append(tid)
                    if part:
                        new.append(part)
            frags = new
        return frags

    def _spm_lookup(self) -> Callable[[str], int | None]:
        """Text -> id for one encode: a text asks for the same pieces again and again ("▁t" + "he"), and each is
        looked up in the vocabulary's index once."""
        index_get = self._index.get
        seen: dict[str, int | None] = {}

        def lookup(piece: str) -> int | None:
            tid = seen.get(piece, -1)
            if tid == -1:
                tid = seen[piece] = index_get(piece)
            return tid
        return lookup

    def _spm_tokenize(self, text: str, out: list[int], lookup: Callable[[str], int | None]) -> None:
        """llama.cpp's llm_tokenizer_spm_session::tokenize on whitespace-escaped text."""
        n = len(text)
        if n == 0:
            return
        scores = self._scores
        sym = list(text)              # current text of each symbol (one code point to start)
        lens = [1] * n                # code points per symbol; 0 once merged into its left neighbour
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap = []
        for i in range(1, n):
            tid = lookup(sym[i - 1] + sym[i])
            if tid is not None:
                # Highest score first; ties go to the leftmost pair (llm_bigram_spm::comparator).
                heap.append((-scores[tid], i - 1, i, 2))
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            _, left, right, size = pop(heap)
            ll, rl = lens[left], lens[right]
            if ll == 0 or rl == 0 or ll + rl != size:
                continue
            merged = sym[left] + sym[right]
            sym[left] = merged
            lens[left] = ll + rl
            lens[right] = 0
            r2 = nxt[right]
            nxt[left] = r2
            if r2 >= 0:
                prev[r2] = left
            p = prev[left]
            if p >= 0:
                tid = lookup(sym[p] + merged)
                if tid is not None:
                    push(heap, (-scores[tid], p, left, lens[p] + ll + rl))
            if r2 >= 0:
                tid = lookup(merged + sym[r2])
                if tid is not None:
                    push(heap, (-scores[tid], left, r2, ll + rl + lens[r2]))
        i = 0
        byte_ids = self._byte_ids
        while i != -1:
            s = sym[i]
            tid = lookup(s)
            if tid is not None:
                out.append(tid)
            else:  # byte fallback
                for b in s.encode("utf-8"):
                    bid = byte_ids[b]
                    if bid is None:
                        raise TokenizerError(f"vocabulary has no byte token <0x{b:02X}> for {s!r}")
                    out.append(bid)
            i = nxt[i]

    # ------------------------------------------------------------------ decoding
    def token_type(self, token_id: int) -> int:
        return int(self._types[token_id])

    def is_control(self, token_id: int) -> bool:
        """True for control tokens (BOS/EOS, turn markers...), as llama_vocab::is_control."""
        return 0 <= token_id < self.vocab_size and int(self._types[token_id]) == TOKEN_CONTROL

    def piece_bytes(self, token_id: int, special: bool = False) -> bytes:
        """The raw bytes `token_id` stands for (llama.cpp's token_to_piece). Control and unknown tokens
        give b"" unless `special`; a byte token gives its single (possibly partial-UTF-8) byte."""
        return self._piece_cached(token_id, special)

    def _piece(self, token_id: int, special: bool) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} out of range for a vocabulary of {self.vocab_size}")
        ttype = int(self._types[token_id])
        text = self.tokens[token_id]
        if ttype in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            piece = text.encode("utf-8") if special else b""
        elif ttype == TOKEN_USER_DEFINED:
            piece = text.encode("utf-8")
        elif self._kind == "spm":
            if ttype == TOKEN_NORMAL:
                piece = text.replace("\u2581", " ").encode("utf-8")
            elif ttype == TOKEN_BYTE:
                piece = bytes([int(text[3:-1], 16)])
            else:
                piece = b""
        else:
            if ttype == TOKEN_NORMAL:
                # Undo the byte-level mapping; a character outside it stands for its own UTF-8.
                piece = b"".join(bytes((_BYTE_DECODER[c],)) if c in _BYTE_DECODER else c.encode("utf-8")
                                 for c in text)
            else:
                piece = b""
        return piece

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Text for `ids`; invalid UTF-8 (e.g. a cut-off byte sequence) becomes U+FFFD."""
        return b"".join(self.piece_bytes(int(i), special) for i in ids).decode("utf-8", errors="replace")

    def stream_decoder(self, special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, special)


class ByteLevelBpe:
    """llama.cpp's byte-level BPE (llm_tokenizer_bpe_session) over a vocabulary's packed texts.

    The text is split into words by `ByteLevelPreTokenizer`, each word's bytes mapped to GPT-2's printable
    characters. Each word then starts as one symbol per character and merges, lowest merge rank first and leftmost
    among equal ranks, until no adjacent pair has a merge. The merges are kept packed: the pair's two token ids as
    one 64-bit key in a sorted array, beside its rank and the merged token's id. A HF BPE model with its vocabulary
    and merge maps took ~16 MB for SmolLM2's 49k tokens and merges; these arrays take under 1 MB."""

    WORD_CACHE_SIZE = 8192      # words looked up again (" the", " of") are merged once
    # Only words this short are cached: a client's base64 blob or long run of letters is one "word" of up to the
    # context's length, and 8,192 of those would hold gigabytes.
    CACHED_WORD_CHARS = 64

    def __init__(self, tokens: PackedStrings, index: VocabularyIndex, merges: Iterable[str], pre: str):
        self._pre_tokenizer = ByteLevelPreTokenizer(pre)
        self._ignore_merges = pre in _PRE_LLAMA3
        self._index = index
        self._n = n = len(tokens)
        keys, merged = array("q"), array("i")
        # A dict for the three lookups of each merge (the index's are 10x slower: 0.3 s of SmolLM2's load), for
        # this moment only; later duplicates win, as in the index.
        token_ids = {text: i for i, text in enumerate(tokens)}
        for merge in merges:
            pos = merge.find(" ", 1)  # llama.cpp splits each merge at the first space after position 0
            if pos < 0:
                raise TokenizerError(f"malformed BPE merge {merge!r}")
            left, right = merge[:pos], merge[pos + 1:]
            left_id, right_id, merged_id = token_ids.get(left), token_ids.get(right), token_ids.get(left + right)
            if left_id is None or right_id is None or merged_id is None:
                raise TokenizerError(f"the BPE merge {merge!r} names a token the vocabulary does not have")
            keys.append(left_id * n + right_id)
            merged.append(merged_id)
        del token_ids
        key_array = np.frombuffer(keys, dtype=np.int64)
        order = np.argsort(key_array, kind="stable")        # a merge's rank is its place in the list
        key_array = key_array[order]
        # A pair listed twice keeps its first rank, as llama.cpp's bpe_ranks.emplace does.
        first = np.ones(len(key_array), dtype=bool)
        first[1:] = key_array[1:] != key_array[:-1]
        order = order[first]
        self._keys = array("q", key_array[first].tobytes())
        self._ranks = array("i", order.astype(np.int32).tobytes())
        self._merged = array("i", np.frombuffer(merged, dtype=np.int32)[order].tobytes())
        self._word_ids = functools.lru_cache(maxsize=self.WORD_CACHE_SIZE)(self._merge_word)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        cached, limit = self._word_ids, self.CACHED_WORD_CHARS
        for word in self._pre_tokenizer.words(text):
            out.extend(cached(word) if len(word) <= limit else self._merge_word(word))
        return out

    def _merge(self, left_id: int, right_id: int) -> tuple[int, int] | None:
        """(rank, merged id) of the pair, or None where the merges have none."""
        key = left_id * self._n + right_id
        keys = self._keys
        i = bisect.bisect_left(keys, key)
        if i < len(keys) and keys[i] == key:
            return self._ranks[i], self._merged[i]
        return None

    def _merge_word(self, word: str) -> tuple[int, ...]:
        lookup = self._index.get
        if self._ignore_merges:
            whole = lookup(word)
            if whole is not None:
                return (whole,)
        ids: list[int | None] = [lookup(ch) for ch in word]
        n = len(ids)
        nxt = list(range(1, n + 1))
        prev = list(range(-1, n - 1))
        alive = [True] * n
        # (rank, left, right, left id, right id, merged id): the heap orders by rank, then leftmost.
        queue: list[tuple[int, int, int, int, int, int]] = []

        def consider(left: int, right: int) -> None:
            left_id, right_id = ids[left], ids[right]
            if left_id is not None and right_id is not None:
                found = self._merge(left_id, right_id)
                if found is not None:
                    heapq.heappush(queue, (found[0], left, right, left_id, right_id, found[1]))

        for i in range(1, n):
            consider(i - 1, i)
        while queue:
            _, left, right, left_id, right_id, merged_id = heapq.heappop(queue)
            # A pair whose symbols have merged since it was queued is stale (llama.cpp compares the texts).
            if not (alive[left] and alive[right] and nxt[left] == right and ids[left] == left_id
                    and ids[right] == right_id):
                continue
            ids[left] = merged_id
            alive[right] = False
            after = nxt[right]
            nxt[left] = after
            if after < n:
                prev[after] = left
            if prev[left] >= 0:
                consider(prev[left], left)
            if after < n:
                consider(left, after)
        # A character outside the vocabulary (no byte-level vocabulary lacks one) is dropped, as llama.cpp does
        # with a symbol it cannot find byte by byte.
        return tuple(tid for tid, keep in zip(ids, alive) if keep and tid is not None)


# Unicode's White_Space property, which the pre-tokenizer regexes' \\s means (Python's \\s also takes U+001C-U+001F).
_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# Past the last code point any letter or number is assigned to (planes 4-16 have none).
_LETTERS_AND_NUMBERS_END = 0x40000
# Letters and numbers assigned since Unicode 14.0 (Python 3.11's `unicodedata`), up to 16.0: the ones HF
# `tokenizers`' regexes know and a Python before 3.13 does not (found code point by code point against it).
_NEWER_LETTERS = (
    (0x01C89, 0x01C8A), (0x0A7CB, 0x0A7CD), (0x0A7DA, 0x0A7DC), (0x105C0, 0x105F3), (0x10D4A, 0x10D65),
    (0x10D6F, 0x10D85), (0x10EC2, 0x10EC4), (0x1123F, 0x11240), (0x11380, 0x11389), (0x1138B, 0x1138B),
    (0x1138E, 0x1138E), (0x11390, 0x113B5), (0x113B7, 0x113B7), (0x113D1, 0x113D1), (0x113D3, 0x113D3),
    (0x11BC0, 0x11BE0), (0x11F02, 0x11F02), (0x11F04, 0x11F10), (0x11F12, 0x11F33), (0x1342F, 0x1342F),
    (0x13441, 0x13446), (0x13460, 0x143FA), (0x16100, 0x1611D), (0x16D40, 0x16D6C), (0x18CFF, 0x18CFF),
    (0x1B132, 0x1B132), (0x1B155, 0x1B155), (0x1DF25, 0x1DF2A), (0x1E030, 0x1E06D), (0x1E4D0, 0x1E4EB),
    (0x1E5D0, 0x1E5ED), (0x1E5F0, 0x1E5F0), (0x2B739, 0x2B739), (0x2EBF0, 0x2EE5D), (0x31350, 0x323AF))
_NEWER_NUMBERS = (
    (0x10D40, 0x10D49), (0x116D0, 0x116E3), (0x11BF0, 0x11BF9), (0x11F50, 0x11F59), (0x16130, 0x16139),
    (0x16D70, 0x16D79), (0x1CCF0, 0x1CCF9), (0x1D2C0, 0x1D2D3), (0x1E4F0, 0x1E4F9), (0x1E5F1, 0x1E5FA))
# Numbers of Unicode 17.0, which HF's digit splitter (Rust's char::is_numeric) knows and its regexes do not.
_NEWER_SPLIT_DIGITS = r"\U00011de0-\U00011de9\U00016ff4-\U00016ff6"


@functools.cache
def _letter_and_number_classes() -> tuple[str, str]:
    """The contents of regex character classes for Unicode's letters (\\p{L}) and numbers (\\p{N}), which Python's
    `re` does not know, as code point ranges from `unicodedata` (50 ms, once a process)."""
    ranges: dict[str, list[tuple[int, int] | list[int]]] = {"L": list(_NEWER_LETTERS), "N": list(_NEWER_NUMBERS)}
    category = unicodedata.category
    for cp in range(_LETTERS_AND_NUMBERS_END):
        group = ranges.get(category(chr(cp))[0])
        if group is not None:
            if isinstance(group[-1], list) and group[-1][1] == cp - 1:
                group[-1][1] = cp
            else:
                group.append([cp, cp])

    def text(spans: list[tuple[int, int] | list[int]]) -> str:
        return "".join(f"\\U{lo:08x}" if lo == hi else f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in spans)
    return text(ranges["L"]), text(ranges["N"])


def _with_unicode_classes(pattern: str, letters: str, numbers: str) -> str:
    """`pattern` with \\p{L}, \\p{N}, \\s and \\S written as the code point ranges they stand for, inside a
    character class and out."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        if pattern.startswith((r"\p{L}", r"\p{N}"), i):
            body = letters if pattern[i + 3] == "L" else numbers
            out.append(body if in_class else f"[{body}]")
            i += 5
        elif pattern.startswith(r"\s", i):
            out.append(_WHITE_SPACE if in_class else f"[{_WHITE_SPACE}]")
            i += 2
        elif pattern.startswith(r"\S", i) and not in_class:
            out.append(f"[^{_WHITE_SPACE}]")
            i += 2
        elif pattern[i] == "\\":
            out.append(pattern[i:i + 2])
            i += 2
        else:
            if pattern[i] == "[" and not in_class:
                in_class = True
            elif pattern[i] == "]" and in_class:
                in_class = False
            out.append(pattern[i])
            i += 1
    return "".join(out)


class ByteLevelPreTokenizer:
    """Splits a text into the words byte-level BPE merges within, as llama.cpp's regexes for the GGUF's `pre` type
    do (and HF `tokenizers`' Split pre-tokenizer with them), each word's UTF-8 bytes then written as GPT-2's
    printable characters. Digits first stand alone where the `pre` type says so (SmolLM2's)."""

    _BYTE_CHARS = {b: ord(c) for b, c in _bytes_to_unicode().items()}   # latin-1 code point -> printable one

    def __init__(self, pre: str):
        letters, numbers = _letter_and_number_classes()
        if pre in _PRE_SMOLLM or pre in _PRE_GPT2:
            pattern = _GPT2_RE + r"|\s+"
        elif pre in _PRE_LLAMA3:
            pattern = _LLAMA3_RE
        elif pre in _PRE_QWEN2:
            pattern = _QWEN2_RE
        else:
            raise TokenizerError(f"unsupported BPE pre-tokenizer {pre!r} (supported: "
                                 f"{', '.join(sorted(_PRE_SMOLLM | _PRE_GPT2 | _PRE_LLAMA3 | _PRE_QWEN2))})")
        pattern = _with_unicode_classes(pattern, letters, numbers)
        self._words = re.compile(pattern)
        self._digits = re.compile(f"([{numbers}{_NEWER_SPLIT_DIGITS}])") if pre in _PRE_SMOLLM else None

    def words(self, text: str) -> list[str]:
        pieces = [p for p in self._digits.split(text) if p] if self._digits is not None else [text]
        out: list[str] = []
        for piece in pieces:
            at = 0
            for match in self._words.finditer(piece):
                if match.start() > at:             # text no alternative matches stands as a word of its own
                    out.append(piece[at:match.start()])
                out.append(match.group())
                at = match.end()
            if at < len(piece):
                out.append(piece[at:])
        chars = self._BYTE_CHARS
        return [word.encode("utf-8").decode("latin-1").translate(chars) for word in out]


class StreamDecoder:
    """Incremental detokenizer: feed ids one at a time, get back only newly completed text.

    Bytes of a UTF-8 character split across tokens (byte-fallback or byte-level pieces) are held
    back until the character is complete; `flush()` returns whatever is left (as U+FFFD if invalid).
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False):
        self.tokenizer = tokenizer
        self.special = special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._decoder.decode(self.tokenizer.piece_bytes(int(token_id), self.special))

    def flush(self) -> str:
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text
