"""What a GGUF file says about itself, read from its header alone: no llama.cpp, no tensor data.

A GGUF file starts with its header (ggml's docs/gguf.md), all little-endian:

    magic "GGUF" | version u32 | tensor count u64 | KV count u64
    KV pairs:     key (string), value type u32, value
    tensor infos: name (string), n_dims u32, dims u64[n_dims], ggml type u32, data offset u64

then the tensor data, from the next multiple of `general.alignment` (32 by default). A string is
a u64 length and that many UTF-8 bytes; an array is an item type u32, a count u64 and the items.

gguf.GGUFReader turns every array item into a numpy object: about 10 s for Gemma's 262,144-token
vocabulary. This reader walks the header once over a memory map and decodes no array. String
arrays are walked only to find their end (a tight loop over the length prefixes: ~14 ms for
Gemma's tokens), and the tokenizer's arrays are hashed as the bytes they are in the file, which
is all the fingerprint needs. The gguf package supplies the format's names and numbers.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType, Keys, LlamaFileType

from flylocal.errors import ModelError

GGUF_MAGIC_BYTES = b"GGUF"

FORMAT = 1               # of Info.to_dict: a cache written in another format is read afresh
VERSIONS = (2, 3)        # version 1 had 32-bit counts and lengths; llama.cpp no longer reads it
MAX_DIMS = 4             # GGML_MAX_DIMS
MAX_TENSORS = 1 << 20    # far beyond any model; a count past these is a corrupt (or hostile) header,
MAX_KV = 1 << 16         # which would otherwise be walked for minutes

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SCALARS = {
    GGUFValueType.UINT8: struct.Struct("<B"), GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"), GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: _U32, GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.UINT64: _U64, GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT32: struct.Struct("<f"), GGUFValueType.FLOAT64: struct.Struct("<d"),
    GGUFValueType.BOOL: struct.Struct("<?"),
}

# What makes two files tokenize alike: llama.cpp's draft/target rule compares the vocabulary type,
# the special tokens and the token texts; types and merges decide how text becomes those tokens.
TOKENIZER_ARRAYS = (Keys.Tokenizer.LIST, Keys.Tokenizer.TOKEN_TYPE, Keys.Tokenizer.MERGES)
SPECIAL_ID = re.compile(r"tokenizer\.ggml\.\w+_token_id")


class UnreadableFile(ModelError):
    """The file could not be read (permissions, I/O): not a fact about its contents."""


@dataclass(frozen=True)
class Info:
    """The facts `flylocal models` reports about one GGUF file."""
    architecture: str            # general.architecture ("" when the file names none)
    name: str                    # general.name
    parameters: int              # the tensors' element counts, summed
    file_type: str               # "Q4_K_M": general.file_type, else the tensors' commonest type
    file_size: int               # bytes
    context_length: int | None   # {arch}.context_length: the context it was trained for
    vocab_size: int              # tokens in tokenizer.ggml.tokens (0: the file has no tokenizer)
    tokenizer: str               # tokenizer.ggml.model: "gpt2", "llama", ...
    fingerprint: str             # sha256 of the tokenizer (`_fingerprint`); "" without one
    chat_template: bool          # has tokenizer.chat_template

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Info:
        return cls(**data)


@dataclass(frozen=True)
class _Array:
    """An array value, not decoded: its items lie in the file at [start, end)."""
    item_type: int
    count: int
    start: int
    end: int


class _Cursor:
    """A read position in the mapped header; reading past the file's end raises ModelError."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def truncated(self) -> ModelError:
        return ModelError(f"truncated or corrupt GGUF file {self.path}: its header runs past the end "
                          f"of the file ({self.size} bytes)")

    def corrupt(self, why: str) -> ModelError:
        return ModelError(f"corrupt GGUF file {self.path}: {why}")

    def unpack(self, fmt: struct.Struct) -> tuple:
        try:
            values = fmt.unpack_from(self.buf, self.pos)
        except struct.error:
            raise self.truncated() from None
        self.pos += fmt.size
        return values

    def u32(self) -> int:
        return self.unpack(_U32)[0]

    def u64(self) -> int:
        return self.unpack(_U64)[0]

    def skip(self, n: int) -> None:
        if n > self.size - self.pos:
            raise self.truncated()
        self.pos += n

    def string(self) -> str:
        n = self.u64()
        start = self.pos
        self.skip(n)
        return self.buf[start:self.pos].decode("utf-8", "replace")

    def skip_strings(self, count: int) -> None:
        """Step over `count` strings. Only the length prefixes are read: a 262k-token vocabulary
        is skipped in milliseconds, where decoding each string would take far longer."""
        buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
        if count > (self.size - pos) // 8:
            raise self.truncated()
        try:
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
        except (struct.error, OverflowError):      # past the end, or past any offset at all
            raise self.truncated() from None
        if pos > self.size:
            raise self.truncated()
        self.pos = pos


def read_info(path: Path) -> Info:
    """The header facts of GGUF file `path`. Raises ModelError, naming the file, unless it is a
    whole GGUF file: a readable header, and tensor data that fits in the file."""
    return _read(path, _parse)


def read_chat_template(path: Path) -> str:
    """The chat template GGUF file `path` carries ("" without one), read from its header."""
    return _read(path, lambda cur: _text(_kv_pairs(cur)[1].get(Keys.Tokenizer.CHAT_TEMPLATE)))


def _read(path: Path, parse):
    """parse(cursor) over GGUF file `path`, mapped; ModelError naming the file when it is
    missing, unreadable or too short to be one."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 4:
                raise ModelError(f"not a GGUF file: {path}")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return parse(_Cursor(buf, path))
    except FileNotFoundError:
        raise ModelError(f"model file not found: {path}") from None
    except OSError as e:
        raise UnreadableFile(f"cannot read model file {path}: {e.strerror}") from None


def _parse(cur: _Cursor) -> Info:
    n_tensors, kv = _kv_pairs(cur)
    tensors = [(ggml_type, n) for _, ggml_type, n, _ in _tensors(cur, n_tensors, kv)]
    arch = _text(kv.get(Keys.General.ARCHITECTURE))
    tokens = kv.get(Keys.Tokenizer.LIST)
    context = kv.get(Keys.LLM.CONTEXT_LENGTH.format(arch=arch))
    return Info(
        architecture=arch,
        name=_text(kv.get(Keys.General.NAME)),
        parameters=sum(n for _, n in tensors),
        file_type=_file_type(kv.get(Keys.General.FILE_TYPE), tensors),
        file_size=cur.size,
        context_length=context if isinstance(context, int) else None,
        vocab_size=tokens.count if isinstance(tokens, _Array) else 0,
        tokenizer=_text(kv.get(Keys.Tokenizer.MODEL)),
        fingerprint=_fingerprint(cur.buf, kv),
        chat_template=isinstance(kv.get(Keys.Tokenizer.CHAT_TEMPLATE), str),
    )


def _kv_pairs(cur: _Cursor) -> tuple[int, dict]:
    """The header up to the tensor infos: (tensor count, {key: value})."""
    if cur.u32() != GGUF_MAGIC:
        raise ModelError(f"not a GGUF file: {cur.path}")
    version = cur.u32()
    if version not in VERSIONS:
        raise cur.corrupt(f"GGUF version {version} is not supported (only {' and '.join(map(str, VERSIONS))})")
    n_tensors, n_kv = cur.u64(), cur.u64()
    if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
        raise cur.corrupt(f"it claims {n_tensors} tensors and {n_kv} metadata keys")
    kv = {}
    for _ in range(n_kv):
        key = cur.string()
        kv[key] = _value(cur, cur.u32(), key)
    return n_tensors, kv


def _text(value) -> str:
    return value if isinstance(value, str) else ""


def _value(cur: _Cursor, vtype: int, key: str):
    """One KV value: a scalar or a string decoded, an array as an _Array."""
    if vtype == GGUFValueType.STRING:
        return cur.string()
    if vtype == GGUFValueType.ARRAY:
        return _array(cur, key)
    fmt = _SCALARS.get(vtype)
    if fmt is None:
        raise cur.corrupt(f"key {key} has the unknown value type {vtype}")
    return cur.unpack(fmt)[0]


def _array(cur: _Cursor, key: str) -> _Array:
    item_type, count = cur.u32(), cur.u64()
    start = cur.pos
    if item_type == GGUFValueType.STRING:
        cur.skip_strings(count)
    elif item_type in _SCALARS:
        cur.skip(count * _SCALARS[item_type].size)
    else:      # arrays of arrays too: llama.cpp reads none, and no converter writes them
        raise cur.corrupt(f"key {key} is an array of items of type {item_type}")
    return _Array(item_type, count, start, cur.pos)


def _tensors(cur: _Cursor, count: int, kv: dict) -> list[tuple[str, int, int, int]]:
    """The tensor infos as (name, ggml type, element count, bytes) after checking that each
    tensor's data lies within the file: a file cut short past its header is caught here, without
    reading the data."""
    infos = []
    for _ in range(count):
        name = cur.string()
        n_dims = cur.u32()
        if n_dims > MAX_DIMS:
            raise cur.corrupt(f"tensor {name} has {n_dims} dimensions")
        dims = cur.unpack(struct.Struct(f"<{n_dims}Q"))
        ggml_type, offset = cur.u32(), cur.u64()
        infos.append((name, ggml_type, _product(dims), offset))
    alignment = kv.get(Keys.General.ALIGNMENT, GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise cur.corrupt(f"general.alignment is {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment
    sizes = []
    for name, ggml_type, n, offset in infos:
        if ggml_type not in GGML_QUANT_SIZES:
            raise cur.corrupt(f"tensor {name} has the unknown type {ggml_type}")
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        end = data_start + offset + n // block * block_bytes
        if end > cur.size:
            raise ModelError(f"truncated GGUF file {cur.path}: tensor {name} ends at byte {end}, past the end "
                             f"of the file ({cur.size} bytes)")
        sizes.append((name, ggml_type, n, n // block * block_bytes))
    return sizes


def _product(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _file_type(value, tensors: list[tuple[int, int]]) -> str:
    """llama.cpp's name of the file type, without its MOSTLY_/ALL_ prefix. A file that states
    none (some converters omit it) is named after the type that holds most of its elements."""
    if isinstance(value, int):
        try:
            name = LlamaFileType(value).name
        except ValueError:
            return f"type {value}"
        return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    weights = collections.Counter()
    for ggml_type, n in tensors:
        weights[ggml_type] += n
    if not weights:
        return "?"
    return GGMLQuantizationType(weights.most_common(1)[0][0]).name


def _fingerprint(buf: mmap.mmap, kv: dict) -> str:
    """A sha256 of the tokenizer: its model, its special token ids, and its token list, token
    types and merges as they lie in the file. Two files with the same fingerprint tokenize alike,
    so one can draft for the other by llama.cpp's rule. "" for a file without a token list."""
    if not isinstance(kv.get(Keys.Tokenizer.LIST), _Array):
        return ""
    h = hashlib.sha256()
    h.update(f"{Keys.Tokenizer.MODEL}={kv.get(Keys.Tokenizer.MODEL)}\n".encode())
    for key in sorted(k for k in kv if SPECIAL_ID.fullmatch(k)):
        h.update(f"{key}={kv[key]}\n".encode())
    for key in TOKENIZER_ARRAYS:
        array = kv.get(key)
        if isinstance(array, _Array):
            h.update(f"{key}:{array.item_type}:{array.count}\n".encode())
            h.update(buf[array.start:array.end])
    return h.hexdigest()


@dataclass(frozen=True)
class Layout:
    """What placing a model's layers on a GPU, and sizing its context, need from its header
    (flylocal.llama.placement, flylocal.llama.model.sequences_that_fit)."""
    n_layer: int                   # {arch}.block_count
    layer_bytes: tuple[int, ...]   # the weights of blk.0 .. blk.{n_layer-1}
    output_bytes: int              # the output layer: output.weight (token_embd.weight where tied) and the norm
    n_head: int
    n_head_kv: int
    key_width: int                 # per head
    value_width: int
    n_vocab: int
    model_bytes: int = 0           # every tensor's weights: what llama.cpp counts as the model's size


_BLOCK = re.compile(r"blk\.(\d+)\.")


def read_layout(path: Path) -> Layout:
    """The Layout of GGUF file `path` (ModelError as read_info raises it)."""
    return _read(path, _parse_layout)


def _parse_layout(cur: _Cursor) -> Layout:
    n_tensors, kv = _kv_pairs(cur)
    tensors = _tensors(cur, n_tensors, kv)
    arch = _text(kv.get(Keys.General.ARCHITECTURE))

    def number(key: str, default: int) -> int:
        value = kv.get(key.format(arch=arch))
        return value if isinstance(value, int) and value > 0 else default   # an array (per layer): the default

    n_layer = number(Keys.LLM.BLOCK_COUNT, 0)
    layers = [0] * n_layer
    named = {name: nbytes for name, _, _, nbytes in tensors}
    for name, _, _, nbytes in tensors:
        m = _BLOCK.match(name)
        if m and int(m.group(1)) < n_layer:
            layers[int(m.group(1))] += nbytes
    output = named.get("output.weight", named.get("token_embd.weight", 0)) + named.get("output_norm.weight", 0)
    n_head = number(Keys.Attention.HEAD_COUNT, 1)
    width = number(Keys.LLM.EMBEDDING_LENGTH, 0) // n_head
    tokens = kv.get(Keys.Tokenizer.LIST)
    return Layout(n_layer=n_layer, layer_bytes=tuple(layers), output_bytes=output, n_head=n_head,
                  n_head_kv=number(Keys.Attention.HEAD_COUNT_KV, n_head),
                  key_width=number(Keys.Attention.KEY_LENGTH, width), value_width=number(Keys.Attention.VALUE_LENGTH, width),
                  n_vocab=tokens.count if isinstance(tokens, _Array) else 0, model_bytes=sum(named.values()))


def check_gguf_file(path: Path) -> None:
    """Raise ModelError unless `path` is a readable file that starts like a GGUF file (before
    llama.cpp is asked to load it; llama.cpp itself names what is wrong inside one)."""
    if not path.exists():
        raise ModelError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelError(f"model path is not a file: {path}")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise ModelError(f"cannot read model file {path}: {e.strerror}") from None
    if len(head) < 8 or head[:4] != GGUF_MAGIC_BYTES:
        raise ModelError(f"not a GGUF file: {path}")
